"""Which stream captures a subject, and how the relay publishes into it.

A stream that allows it and a server that supports it take a claimed batch as one
JetStream batch publish (ADR-50) instead of a publish and an ack per message:

- ``batch``: fast batch publishing (stream ``allow_batched``, server 2.14+). Not
  atomic; sent with ``gap: fail``, so the stream stores the batch's messages in
  order and stops at the first one it cannot store. A duplicate is skipped.
- ``atomic``: atomic batch publishing (stream ``allow_atomic``, server 2.12.1+ for
  ``Nats-Msg-Id``). All or nothing; one duplicate rejects the whole batch.
- ``message``: one publish and one ack per message, pipelined across subjects.

``auto`` takes ``batch`` where it can and ``message`` elsewhere. No mode takes fast
batches into a replicated stream: there nats-server 2.15.1 counts a message whose
earlier publish is still being proposed (not yet stored, and lost if its leader
goes) as a skipped duplicate and acks the batch, where a single publish gets error
10158 and is tried again (docs/publish-modes.md). Atomic batches
drained no faster than per-message publishing (the server stages each batch before
it commits it; docs/performance.md) and the relay needs no atomicity across rows,
so they are used only when asked for.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class PublishMode(enum.StrEnum):
    BATCH = "batch"
    ATOMIC = "atomic"
    MESSAGE = "message"


AUTO = "auto"
PUBLISH_MODE_CHOICES = (AUTO, *(mode.value for mode in PublishMode))

# Server versions (major, minor, patch) that first took each mode: fast batches came
# in 2.14.0; atomic batches in 2.12.0, but with Nats-Msg-Id (the relay's dedupe key)
# only from 2.12.1.
_SINCE = {PublishMode.BATCH: (2, 14, 0), PublishMode.ATOMIC: (2, 12, 1)}

# A stream's rows in a claimed batch go per message when fewer than this. A fast
# batch sends its first message alone and waits for the server's reply before the
# rest: two broker round trips where a wave of single publishes takes one, which
# fewer acks repay only in a large batch (docs/publish-modes.md). A lone message
# gains nothing from a batch of either kind.
MIN_BATCH_MESSAGES = {PublishMode.BATCH: 32, PublishMode.ATOMIC: 2}


def worth_a_batch(mode: PublishMode, messages: int) -> bool:
    """Whether ``messages`` rows of one stream go as one batch in ``mode``."""
    return mode is not PublishMode.MESSAGE and messages >= MIN_BATCH_MESSAGES[mode]


# Atomic batches: the server's default limit of messages per batch.
ATOMIC_BATCH_LIMIT = 1000

# The most bytes an atomic batch's headers add to a message (Nats-Batch-Id, a uuid's
# 32 hex digits; Nats-Batch-Sequence, up to the limit; Nats-Batch-Commit on the
# last), each "Key: Value\r\n": what the server counts against max_payload.
ATOMIC_HEADER_BYTES = sum(
    len(key) + len(value) + 4
    for key, value in (
        ("Nats-Batch-Id", "0" * 32),
        ("Nats-Batch-Sequence", str(ATOMIC_BATCH_LIMIT)),
        ("Nats-Batch-Commit", "1"),
    )
)


@dataclass(frozen=True)
class StreamModes:
    """What a stream's configuration allows, as STREAM.INFO reports it."""

    name: str
    subjects: tuple[str, ...]
    allow_batched: bool = False
    allow_atomic: bool = False
    replicas: int = 1

    @property
    def fast_batches_safe(self) -> bool:
        """Whether a fast batch's acks can be trusted: only a stream without a
        replica group (see the module's docstring)."""
        return self.replicas <= 1


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a NATS subject filter (``*`` one token, ``>`` the rest) captures ``subject``."""
    want = pattern.split(".")
    have = subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(have) > index
        if index >= len(have) or (token != "*" and token != have[index]):
            return False
    return len(have) == len(want)


def stream_for(subject: str, streams: Iterable[StreamModes]) -> StreamModes | None:
    """The stream that captures ``subject`` (JetStream lets only one do so)."""
    for stream in streams:
        if any(subject_matches(pattern, subject) for pattern in stream.subjects):
            return stream
    return None


def supported_modes(version: tuple[int, int, int]) -> frozenset[PublishMode]:
    return frozenset(
        {PublishMode.MESSAGE} | {mode for mode, since in _SINCE.items() if version >= since}
    )


def choose_mode(
    stream: StreamModes | None, version: tuple[int, int, int], wanted: str = AUTO
) -> PublishMode:
    """How to publish into ``stream``: fast batches where the stream allows them, the
    server supports them and the stream has one replica, or the mode the operator
    asked for (``--publish-mode``) where it is available; per message everywhere
    else, and for a subject no stream captures."""
    if stream is None or wanted == PublishMode.MESSAGE:
        return PublishMode.MESSAGE
    supported = supported_modes(version)
    allowed = {
        PublishMode.BATCH: (
            stream.allow_batched and PublishMode.BATCH in supported and stream.fast_batches_safe
        ),
        PublishMode.ATOMIC: stream.allow_atomic and PublishMode.ATOMIC in supported,
    }
    preferred = PublishMode.BATCH if wanted == AUTO else PublishMode(wanted)
    return preferred if allowed.get(preferred) else PublishMode.MESSAGE


def describe_modes(modes: Mapping[str, PublishMode]) -> str:
    """One log line's worth: each stream and the mode the relay publishes it with."""
    if not modes:
        return "no streams"
    return ", ".join(f"{name}: {mode}" for name, mode in sorted(modes.items()))


def short_duplicate_windows(
    windows: Iterable[tuple[str, float]], minimum: float
) -> list[tuple[str, float]]:
    """The streams, of (name, duplicate window in seconds), that forget a message id
    before ``minimum`` seconds: a row whose ack was lost and that is retried after
    that long is stored again, under the same id."""
    return sorted((name, window) for name, window in windows if window < minimum)


# How long what was read of the streams is used before it is read again (a fallback:
# a stream's change is heard as it happens), and how soon a failed read is tried again.
STREAM_MODES_TTL = 30.0
STREAM_MODES_RETRY = 5.0


class StreamModesCache:
    """What was last read of the streams' publish modes, and when to read them again:
    a pure state machine, fed the events and the loop's time.

    Stale (nothing read since the connection or since a stream changed) means no
    stream is known, so every subject goes per message, which any stream takes. A
    read that began before the last change says nothing of it: what it read is not
    taken, and the next batch reads again (a read in flight while a stream scaled to
    three replicas must not send it fast batches for a TTL)."""

    def __init__(self) -> None:
        self.streams: list[StreamModes] = []
        self.stale = True
        self.due = 0.0  # loop time of the next read
        self._changes = 0  # changes heard so far

    def changed(self) -> None:
        """A stream was created, changed or deleted, or the connection is new."""
        self._changes += 1
        self.stale = True
        self.due = 0.0

    def forget(self) -> None:
        """Read again before the next batch (a stream turned a batch down)."""
        self.due = 0.0

    def must_read_first(self, now: float) -> bool:
        """The batch waits for a read: nothing usable is known."""
        return self.stale and now >= self.due

    def may_refresh(self, now: float) -> bool:
        """What is known is old: read again beside the batch."""
        return not self.stale and now >= self.due

    def read_started(self) -> int:
        """A read begins; what it returns goes to :meth:`read_done` with this token."""
        return self._changes

    def read_done(self, token: int, streams: list[StreamModes], now: float) -> bool:
        """A read that began with ``token`` returned ``streams``; whether it was taken."""
        if token != self._changes:
            return False  # a stream changed while it ran: stale still, due now
        self.streams = streams
        self.stale = False
        self.due = now + STREAM_MODES_TTL
        return True

    def read_failed(self, now: float) -> None:
        self.due = now + STREAM_MODES_RETRY

    def known(self) -> list[StreamModes]:
        """The streams to choose modes from: none while stale."""
        return [] if self.stale else self.streams
