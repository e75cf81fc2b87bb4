"""What a JetStream batch publish's replies mean for each of its messages (ADR-50).

Pure state: :mod:`relay.broker` sends the messages and feeds the replies in; these
classes say when to wait, when the batch is over, and what became of each message.
A result of ``None`` means the stream did not store the message and nothing needs
to be said about it: the row stays exactly as it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from relay.model import Acked, Failed, FailureReason, PublishResult

NO_RESPONDERS = Failed(
    FailureReason.NO_RESPONDERS, "no responders: no stream leader answered for the subject"
)

# Errors about the batch itself, not a message in it: batching disabled on the
# stream, an ID or pattern the server rejects, too many batches in flight, and an
# atomic batch holding a message the stream already has. The batch goes per message.
BATCH_LEVEL_ERRORS = frozenset({
    10174, 10175, 10176, 10177, 10179, 10199, 10200, 10201,  # atomic
    10205, 10206, 10207, 10208,  # fast
    10210, 10211,  # too many batches in flight
})  # fmt: skip

# The ack frequency a fast batch asks for (the server may lower it, never raise it),
# and how many of those acks may be outstanding before the sender waits: two keep
# the server busy with the next stretch while the ack for the last one travels.
FAST_BATCH_FLOW = 500
FAST_BATCH_OUTSTANDING_ACKS = 2


# relay.replies.api_error: (code, err_code, description) -> the failure it stands for.
ApiErrorClassifier = Callable[[int | None, int | None, str], Failed]


@dataclass(frozen=True)
class Reply:
    """One reply of a batch publish, decoded."""

    kind: str  # "flow", "gap", "ok" (a zero-byte atomic ack), "puback", "error"
    seq: int = 0  # "flow": persisted up to here
    ack_every: int = 0  # "flow": the server acks every this many messages
    count: int = 0  # "puback": messages of the batch that count as stored
    err_code: int | None = None
    failure: Failed | None = None


def decode(  # noqa: PLR0911 - one return per kind of reply
    status: str | None, data: bytes, classify_error: ApiErrorClassifier
) -> Reply:
    """A reply of a batch publish: a flow ack, a gap report, the final PubAck, or an error."""
    if status == "503":
        return Reply("error", failure=NO_RESPONDERS)
    if not data:
        return Reply("ok")
    try:
        reply = json.loads(data)
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        unreadable = Failed(FailureReason.RELAY_ERROR, f"unexpected batch reply {data[:200]!r}")
        return Reply("error", failure=unreadable)
    kind = reply.get("type")
    if kind == "ack":
        return Reply("flow", seq=_int(reply.get("seq")), ack_every=max(1, _int(reply.get("msgs"))))
    if kind == "gap":
        return Reply("gap")
    error = reply.get("error")
    if isinstance(error, dict):  # a plain error, or (newer servers) {"type":"err","seq":N,...}
        err_code, failure = error_failure(error, classify_error)
        return Reply("error", err_code=err_code, failure=failure)
    if "batch" in reply:
        # A batch's PubAck says nothing of duplicates per message (a fast batch skips
        # one silently; an atomic batch is turned down whole, 10201): batch modes
        # count no duplicate acks.
        return Reply("puback", count=_int(reply.get("count")))
    return Reply(
        "error", failure=Failed(FailureReason.RELAY_ERROR, f"not a batch reply {data[:200]!r}")
    )


def error_failure(
    error: dict[str, object], classify_error: ApiErrorClassifier
) -> tuple[int | None, Failed]:
    """A JetStream reply's ``error`` object: its err_code and the failure it stands for."""
    code, err_code = error.get("code"), error.get("err_code")
    err_code = err_code if isinstance(err_code, int) else None
    description = str(error.get("description", error))
    return err_code, classify_error(code if isinstance(code, int) else None, err_code, description)


def decode_failure(failure: Failed) -> Reply:
    """A failure of the relay's own send (the connection refused it) as a reply."""
    return Reply("error", failure=failure)


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


class FastBatch:
    """One fast batch (``gap: fail``) of ``count`` messages, sequences 1..count.

    The first message is sent alone: its reply says whether the stream takes fast
    batches and how often the server will ack. Then messages go while fewer than
    :data:`FAST_BATCH_OUTSTANDING_ACKS` acks are outstanding; the last one commits.
    A flow ack for sequence N means 1..N are stored (gaps fail the batch), and acks
    are cumulative, so a lost one is covered by the next."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.sent = 0  # messages handed to the connection so far
        self.started = False
        self.persisted = 0  # every message up to this sequence is stored
        self.ack_every = 1
        self.stored: int | None = None  # from the final PubAck: the batch is over
        self.refused_at: tuple[int, Failed] | None = None  # a message the stream refused
        self.batch_refused: Reply | None = None  # the batch itself: send per message
        self.broker_failure: Failed | None = None  # no leader, the stream's state

    @property
    def over(self) -> bool:
        return (
            self.stored is not None
            or self.batch_refused is not None
            or self.broker_failure is not None
        )

    def may_send(self, sent: int) -> bool:
        """Whether the message after ``sent`` may go now."""
        if self.over or (sent >= 1 and not self.started):
            return False
        return self.persisted + self.ack_every * FAST_BATCH_OUTSTANDING_ACKS > sent

    def on_reply(self, seq: int, reply: Reply) -> None:
        """The reply to message ``seq`` (its reply subject says which)."""
        if self.over:
            return  # e.g. "batch ID unknown" for messages sent after the commit
        if reply.kind == "flow":
            self.started = True
            self.persisted = max(self.persisted, min(reply.seq, self.count))
            self.ack_every = reply.ack_every
        elif reply.kind == "puback":
            self.stored = min(reply.count, self.count)
            self.persisted = max(self.persisted, self.stored)
        elif reply.kind == "error" and reply.failure is not None:
            if reply.err_code in BATCH_LEVEL_ERRORS and not self.persisted and seq == 1:
                self.batch_refused = reply
            elif reply.failure.reason.broker_fault or reply.err_code in BATCH_LEVEL_ERRORS:
                self.broker_failure = reply.failure
            elif seq <= self.persisted:
                pass  # stale: a flow ack already said this message is stored
            elif self.refused_at is None:
                self.refused_at = (seq, reply.failure)
                if seq == 1:
                    self.stored = 0  # a batch that fails at once ends there
        # "gap" is informational: the final PubAck follows with what was stored.

    def results(self, unanswered: Failed) -> list[PublishResult | None]:
        """Each message's result once the batch is over or out of time; ``unanswered``
        for a message that may or may not be stored (its ack did not come)."""
        refused_seq = self.refused_at[0] if self.refused_at else self.count + 1
        if self.stored is not None:
            unknown_from = unknown_to = self.stored + 1  # nothing unknown: it is over
        else:
            unknown_from, unknown_to = self.persisted + 1, refused_seq
        missing = self.broker_failure or unanswered
        results: list[PublishResult | None] = []
        for seq in range(1, self.count + 1):
            if seq <= self.persisted:
                results.append(_ACKED)
            elif self.refused_at is not None and seq == refused_seq:
                results.append(self.refused_at[1])
            elif unknown_from <= seq < unknown_to:
                results.append(missing)
            else:
                results.append(None)  # after the batch stopped: never stored
        return results


class AtomicBatch:
    """One atomic batch: the first message's reply is empty or an error; the commit's
    is a PubAck for all of them or an error for all of them."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.committed: Reply | None = None  # the final PubAck
        self.error: Reply | None = None

    @property
    def over(self) -> bool:
        return self.committed is not None or self.error is not None

    def on_reply(self, reply: Reply) -> None:
        if self.over:
            return
        if reply.kind == "puback":
            self.committed = reply
        elif reply.kind == "error":
            self.error = reply

    @property
    def send_per_message(self) -> bool:
        """The stream turned the batch down for the batch's sake (a duplicate in it,
        batching off) or for one of its messages without saying which: each message
        then gets its own verdict."""
        error = self.error
        if error is None or error.failure is None:
            return False
        return error.err_code in BATCH_LEVEL_ERRORS or not error.failure.reason.broker_fault

    def results(self, unanswered: Failed) -> Sequence[PublishResult]:
        if self.committed is not None:
            if self.committed.count != self.count:
                # All or nothing, and the server says neither: the relay cannot tell
                # which rows are stored, so none is marked; the republish dedupes.
                odd = Failed(
                    FailureReason.RELAY_ERROR,
                    f"an atomic batch of {self.count} committed {self.committed.count}",
                )
                return [odd] * self.count
            return [_ACKED] * self.count
        failure = self.error.failure if self.error and self.error.failure else unanswered
        return [failure] * self.count


_ACKED = Acked(duplicate=False)
