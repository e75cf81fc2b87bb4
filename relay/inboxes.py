"""How a wave or a batch goes out and its replies come back: HPUB frames built in
one step, the ack inbox that settles each message of a wave, the batch inbox that
routes each batch reply to its batch, and the batch protocol's reply subjects and
headers (ADR-50).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import trio
from nats.aio.msg import Msg

from relay.batchreplies import FAST_BATCH_FLOW
from relay.model import Acked, Failed, PublishResult
from relay.replies import PERMISSION_DENIED, parse_ack


def hpub_frame(subject: str, reply: str, headers: Mapping[str, str], body: bytes) -> bytes:
    """One HPUB protocol frame, as nats-py's publish writes it (a test holds the two
    byte for byte), built in one step: a wave or a batch needs neither nats-py's
    per-message checks (the subject, size and headers were checked when the row was)
    nor its per-message queueing, which cost more than the rest of its sending."""
    head = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    block = head.encode()
    size = len(block)
    command = (
        f"HPUB {subject} {reply} {size} {size + len(body)}\r\n"
        if reply
        else (f"HPUB {subject} {size} {size + len(body)}\r\n")
    )
    return command.encode() + block + body + b"\r\n"


class Wave:
    """The acks one wave waits for: a result slot per message, and one trio event
    that is set when the last outstanding ack arrives (one wake-up per wave, not one
    per message). The acks arrive in nats-py's asyncio callbacks, which trio-asyncio
    runs inside a trio task: they may set a trio event, and the wave is waited on
    from trio, with no crossing."""

    __slots__ = ("done", "pending", "results", "tokens")

    def __init__(self, size: int) -> None:
        self.results: list[PublishResult | None] = [None] * size
        self.tokens: list[str] = []
        self.pending = 0
        self.done = trio.Event()

    def settle(self, index: int, result: PublishResult) -> None:
        if self.results[index] is None:
            self.results[index] = result
            self.pending -= 1
            if self.pending == 0:
                self.done.set()


class AckInbox:
    """Pipelined JetStream publishing: every message carries a reply subject under
    one wildcard inbox, and each reply settles its message's slot in its wave.

    nats-py's own publish_async raises API errors inside its reply callback instead
    of failing the message's future, so a refused message would only surface as a
    timeout; this inbox turns every reply into a result."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._next = 0
        self._waiting: dict[str, tuple[Wave, int, str]] = {}

    def expect(self, wave: Wave, index: int, subject: str) -> str:
        """The reply subject for message ``index`` of ``wave``, published on ``subject``."""
        self._next += 1
        token = str(self._next)
        self._waiting[token] = (wave, index, subject)
        wave.tokens.append(token)
        wave.pending += 1
        return self.prefix + token

    def forget(self, wave: Wave) -> None:
        """Stop waiting for ``wave``'s outstanding acks (its deadline passed)."""
        for token in wave.tokens:
            self._waiting.pop(token, None)

    async def on_reply(self, msg: Msg) -> None:
        entry = self._waiting.pop(msg.subject[len(self.prefix) :], None)
        if entry is not None:
            wave, index, _ = entry
            wave.settle(index, parse_ack(msg))

    def deny(self, subject: str) -> None:
        """Settle every message waiting on ``subject`` as denied: the server dropped
        them and will send no ack, so waiting would only spend the publish timeout."""
        denied = [t for t, (_, _, s) in self._waiting.items() if s == subject]
        for token in denied:
            wave, index, _ = self._waiting.pop(token)
            wave.settle(index, PERMISSION_DENIED)


class BatchInbox:
    """The replies of batch publishes: one wildcard subscription, each reply routed
    by the batch id that its subject carries to that batch's handler, with the
    sequence of the message it answers (the reply subject's last number before
    the fast-batch suffix, or its last token for an atomic batch)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._open: dict[str, Callable[[int, Msg], None]] = {}

    def open(self, batch_id: str, handler: Callable[[int, Msg], None]) -> None:
        self._open[batch_id] = handler

    def close(self, batch_id: str) -> None:
        self._open.pop(batch_id, None)

    async def on_reply(self, msg: Msg) -> None:
        tokens = msg.subject[len(self.prefix) :].split(".")
        handler = self._open.get(tokens[0])
        if handler is None:
            return
        seq_token = tokens[-3] if tokens[-1] == "$FI" and len(tokens) >= 4 else tokens[-1]
        handler(int(seq_token) if seq_token.isdigit() else 0, msg)


def batch_outcome(results: Sequence[PublishResult | None]) -> str:
    """The ``outcome`` label of a batch publish: every message stored, stopped at a
    message the stream refused, or unanswered (a timeout, the broker's failure)."""
    if all(isinstance(result, Acked) for result in results):
        return "stored"
    if any(isinstance(r, Failed) and r.reason.broker_fault for r in results):
        return "unanswered"
    return "stopped"


def fast_batch_reply(prefix: str, batch_id: str, seq: int, last: int) -> str:
    """A fast batch message's reply subject (ADR-50):
    ``<prefix>.<id>.<flow>.<gap mode>.<seq>.<op>.$FI``, op 0 starting the batch,
    1 adding to it, 2 storing the last message and committing."""
    op = 0 if seq == 1 else 2 if seq == last else 1
    return f"{prefix}{batch_id}.{FAST_BATCH_FLOW}.fail.{seq}.{op}.$FI"


def atomic_batch_headers(
    headers: Mapping[str, str], batch_id: str, seq: int, last: int
) -> dict[str, str]:
    """A message's headers in an atomic batch: the batch, its place, and on the last
    message the commit."""
    batched = {**headers, "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(seq)}
    if seq == last:
        batched["Nats-Batch-Commit"] = "1"
    return batched
