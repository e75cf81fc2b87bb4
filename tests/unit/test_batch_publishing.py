"""The pure parts of JetStream batch publishing: which mode a stream gets, how a
claimed batch splits by mode, and what a batch's replies mean for each message
(replies shaped as nats-server 2.15.1 sends them)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Sequence

import pytest
import trio
from nats.aio.client import _CRLF_, NATS_HDR_LINE, Client, ServerVersion
from nats.protocol.command import hpub_cmd

from relay import aio
from relay.batch import Batch, published_rows, split_by_publish_mode
from relay.batchreplies import (
    FAST_BATCH_OUTSTANDING_ACKS,
    AtomicBatch,
    FastBatch,
    Reply,
    decode,
)
from relay.broker import Broker
from relay.config import Config
from relay.envelope import Message, MessageSettings, message_for
from relay.failpoints import Failpoints
from relay.headers import trace_context
from relay.inboxes import atomic_batch_headers, batch_outcome, fast_batch_reply, hpub_frame
from relay.model import Acked, Failed, FailureReason, OutboxRow, PublishResult
from relay.replies import api_error
from relay.streams import (
    MIN_BATCH_MESSAGES,
    PublishMode,
    StreamModes,
    choose_mode,
    stream_for,
    subject_matches,
)
from relay.tracing import PublishedRow

TIMEOUT = Failed(FailureReason.TIMEOUT, "no ack before the publish timeout")
ACKED = Acked()


def reply(data: bytes, status: str | None = None) -> Reply:
    return decode(status, data, api_error)


FLOW_START = b'{"type":"ack","seq":0,"msgs":100}'


def flow(seq: int, every: int = 100) -> bytes:
    return b'{"type":"ack","seq":%d,"msgs":%d}' % (seq, every)


def puback(count: int) -> bytes:
    return b'{"stream":"S","seq":%d,"batch":"b1","count":%d}' % (100 + count, count)


TOO_BIG = (
    b'{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum '
    b'allowed"},"stream":"T","seq":0}'
)
UNKNOWN_BATCH = (
    b'{"error":{"code":400,"err_code":10208,"description":"batch publish ID unknown"},'
    b'"stream":"T","seq":0}'
)
FAST_DISABLED = (
    b'{"error":{"code":400,"err_code":10205,"description":"batch publish is disabled"},'
    b'"stream":"U","seq":0}'
)
ATOMIC_DUPLICATE = (
    b'{"error":{"code":400,"err_code":10201,"description":"atomic publish batch contains '
    b'duplicate message id"},"stream":"S","seq":0}'
)
NO_SPACE = (
    b'{"error":{"code":503,"err_code":10077,"description":"insufficient resources"},'
    b'"stream":"S","seq":0}'
)


# -- which stream, which mode ---------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("orders.>", "orders.placed", True),
        ("orders.>", "orders.placed.eu", True),
        ("orders.>", "orders", False),
        ("orders.*", "orders.placed", True),
        ("orders.*", "orders.placed.eu", False),
        ("*.placed", "orders.placed", True),
        ("orders.placed", "orders.placed", True),
        ("orders.placed", "orders.paid", False),
    ],
)
def test_subject_filters(pattern, subject, matches):
    assert subject_matches(pattern, subject) is matches


def test_the_stream_that_captures_a_subject():
    streams = [StreamModes("A", ("a.>",)), StreamModes("B", ("b.*", "c.x"))]
    assert stream_for("b.y", streams) == streams[1]
    assert stream_for("c.x", streams) == streams[1]
    assert stream_for("d", streams) is None


NEW, ATOMIC_ONLY, OLD = (2, 15, 1), (2, 12, 1), (2, 9, 10)
BOTH = StreamModes("S", ("s.>",), allow_batched=True, allow_atomic=True)
REPLICATED = StreamModes("S", ("s.>",), allow_batched=True, allow_atomic=True, replicas=3)


@pytest.mark.parametrize(
    ("stream", "version", "wanted", "mode"),
    [
        (BOTH, NEW, "auto", PublishMode.BATCH),
        (BOTH, ATOMIC_ONLY, "auto", PublishMode.MESSAGE),  # fast batches came in 2.14
        (BOTH, ATOMIC_ONLY, "atomic", PublishMode.ATOMIC),
        (BOTH, (2, 12, 0), "atomic", PublishMode.MESSAGE),  # no Nats-Msg-Id in 2.12.0 batches
        (BOTH, OLD, "auto", PublishMode.MESSAGE),
        # Atomic batches only when asked for: they drained no faster than per message.
        (StreamModes("S", ("s.>",), allow_atomic=True), NEW, "auto", PublishMode.MESSAGE),
        (StreamModes("S", ("s.>",)), NEW, "auto", PublishMode.MESSAGE),
        (BOTH, NEW, "atomic", PublishMode.ATOMIC),
        (BOTH, NEW, "message", PublishMode.MESSAGE),
        # Forcing a mode the stream does not allow falls back to per message.
        (StreamModes("S", ("s.>",), allow_atomic=True), NEW, "batch", PublishMode.MESSAGE),
        (None, NEW, "auto", PublishMode.MESSAGE),
        # A replicated stream can ack a fast batch it has not stored: never fast batches
        # there, even when asked for; atomic ones are answered honestly.
        (REPLICATED, NEW, "auto", PublishMode.MESSAGE),
        (REPLICATED, NEW, "batch", PublishMode.MESSAGE),
        (REPLICATED, NEW, "atomic", PublishMode.ATOMIC),
    ],
)
def test_the_mode_a_stream_gets(stream, version, wanted, mode):
    assert choose_mode(stream, version, wanted) is mode


def row(subject: str, event_type: str, n: int) -> OutboxRow:
    return OutboxRow(str(uuid.uuid4()), event_type, "t", subject, "2026", "{}", float(n), n, 0)


FAST_BATCH = MIN_BATCH_MESSAGES[PublishMode.BATCH]  # the fewest rows a fast batch takes


def test_a_row_subject_in_two_streams_goes_one_by_one_and_keeps_its_order():
    plan = {
        "a.x": (PublishMode.BATCH, "A"),
        "b.x": (PublishMode.ATOMIC, "B"),
        "m.x": (PublishMode.MESSAGE, "M"),
    }
    rows = [
        row("e1", "a.x", 1),
        row("e2", "a.x", 2),
        row("e1", "b.x", 3),  # e1 spans A and B
        row("e3", "a.x", 4),
        row("e4", "b.x", 5),
        row("e5", "b.x", 6),
        row("e6", "m.x", 7),
        *(row(f"f{n}", "a.x", n) for n in range(8, 8 + FAST_BATCH - 2)),
    ]
    one_by_one, batched = split_by_publish_mode(rows, plan)
    assert [r.seq for r in one_by_one] == [1, 3, 7]
    assert [(mode, [r.seq for r in group]) for mode, group in batched] == [
        (PublishMode.BATCH, [2, 4, *range(8, 8 + FAST_BATCH - 2)]),
        (PublishMode.ATOMIC, [5, 6]),
    ]


def test_a_group_of_one_row_goes_per_message():
    plan = {"a.x": (PublishMode.BATCH, "A")}
    one_by_one, batched = split_by_publish_mode([row("e1", "a.x", 1)], plan)
    assert len(one_by_one) == 1
    assert batched == []


@pytest.mark.parametrize(
    ("mode", "fewest"), [(PublishMode.BATCH, FAST_BATCH), (PublishMode.ATOMIC, 2)]
)
def test_a_stream_s_rows_go_as_a_batch_from_its_mode_s_fewest(mode, fewest):
    """A fast batch makes two broker round trips (its first message goes alone), so a
    few rows go per message, in a wave; an atomic batch takes two or more."""
    plan = {"a.x": (mode, "A"), "m.x": (PublishMode.MESSAGE, "M")}
    too_few = [row(f"e{n}", "a.x", n) for n in range(fewest - 1)]
    enough = [row(f"e{n}", "a.x", n) for n in range(fewest)]
    assert split_by_publish_mode(too_few, plan) == (too_few, [])
    assert split_by_publish_mode(enough, plan) == ([], [(mode, enough)])
    other = row("o", "m.x", 99)
    mixed = [*too_few[: len(too_few) // 2], other, *too_few[len(too_few) // 2 :]]
    assert split_by_publish_mode(mixed, plan) == (mixed, [])  # in the claim's order
    assert split_by_publish_mode([other, *enough], plan) == ([other], [(mode, enough)])


# -- wire formats ---------------------------------------------------------------------


def test_fast_batch_reply_subjects_start_add_and_commit():
    assert fast_batch_reply("_INBOX.x.", "b1", 1, 3) == "_INBOX.x.b1.500.fail.1.0.$FI"
    assert fast_batch_reply("_INBOX.x.", "b1", 2, 3) == "_INBOX.x.b1.500.fail.2.1.$FI"
    assert fast_batch_reply("_INBOX.x.", "b1", 3, 3) == "_INBOX.x.b1.500.fail.3.2.$FI"


def test_atomic_batch_headers_keep_the_message_id_and_commit_on_the_last():
    first = atomic_batch_headers({"Nats-Msg-Id": "r1"}, "b1", 1, 2)
    last = atomic_batch_headers({"Nats-Msg-Id": "r2"}, "b1", 2, 2)
    assert first == {"Nats-Msg-Id": "r1", "Nats-Batch-Id": "b1", "Nats-Batch-Sequence": "1"}
    assert last["Nats-Batch-Commit"] == "1"
    assert last["Nats-Msg-Id"] == "r2"


def test_decoding_each_kind_of_reply():
    assert reply(FLOW_START) == Reply("flow", seq=0, ack_every=100)
    assert reply(b'{"type":"gap","last_seq":3,"seq":4}').kind == "gap"
    assert reply(puback(5)) == Reply("puback", count=5)
    assert reply(b"").kind == "ok"
    refused = reply(TOO_BIG)
    assert refused.kind == "error"
    assert refused.err_code == 10054
    assert refused.failure is not None
    assert refused.failure.reason is FailureReason.REFUSED
    assert reply(b"", status="503").failure.reason is FailureReason.NO_RESPONDERS
    # Newer servers tag a mid-batch error; it reads the same.
    tagged = reply(
        b'{"type":"err","seq":3,"error":{"code":400,"err_code":10054,"description":"x"}}'
    )
    assert tagged.kind == "error"
    assert tagged.err_code == 10054


# -- fast batches ---------------------------------------------------------------------


def test_fast_batch_sends_the_first_message_alone_then_within_the_outstanding_acks():
    batch = FastBatch(1_000)
    assert batch.may_send(0)
    assert not batch.may_send(1)  # the server must say it takes the batch first
    batch.on_reply(1, reply(flow(0, every=10)))
    window = 10 * FAST_BATCH_OUTSTANDING_ACKS
    assert batch.may_send(window - 1)
    assert not batch.may_send(window)
    batch.on_reply(10, reply(flow(10, every=10)))
    assert batch.may_send(window + 9)
    assert not batch.may_send(window + 10)
    # Acks are cumulative: one for 40 covers a lost one for 30.
    batch.on_reply(40, reply(flow(40, every=10)))
    assert batch.persisted == 40


def test_fast_batch_all_stored():
    batch = FastBatch(5)
    batch.on_reply(1, reply(FLOW_START))
    batch.on_reply(5, reply(puback(5)))
    assert batch.over
    assert batch.results(TIMEOUT) == [ACKED] * 5


def test_a_refusal_of_a_message_a_flow_ack_said_is_stored_is_stale():
    # A flow ack for 3 says 1..3 are stored; an error about 2 after it cannot unstore
    # it. The flow ack wins, whichever reply arrived first.
    for replies in (
        [(3, reply(flow(3, every=1))), (2, reply(TOO_BIG))],
        [(2, reply(TOO_BIG)), (3, reply(flow(3, every=1)))],
    ):
        batch = FastBatch(5)
        batch.on_reply(1, reply(FLOW_START))
        for seq, answer in replies:
            batch.on_reply(seq, answer)
        results = batch.results(TIMEOUT)
        assert results[:3] == [ACKED] * 3, replies


def test_fast_batch_partial_failure_stops_at_the_refused_message():
    # As 2.15.1 answers a too-large third message: its error, a gap report for the
    # fourth, the final PubAck (count 2) and "unknown batch" for the fifth.
    batch = FastBatch(5)
    batch.on_reply(1, reply(FLOW_START))
    batch.on_reply(3, reply(TOO_BIG))
    assert not batch.over  # the final PubAck says what was stored
    batch.on_reply(4, reply(b'{"type":"gap","last_seq":3,"seq":4}'))
    batch.on_reply(4, reply(puback(2)))
    batch.on_reply(5, reply(UNKNOWN_BATCH))
    results = batch.results(TIMEOUT)
    assert results[:2] == [ACKED, ACKED]
    assert isinstance(results[2], Failed)
    assert results[2].reason is FailureReason.REFUSED
    assert results[3:] == [None, None]  # never stored: the rows stay as they were


def test_fast_batch_whose_commit_ack_is_lost():
    # Flow acks said 1..4 are stored; nothing after that came before the deadline.
    batch = FastBatch(6)
    batch.on_reply(1, reply(flow(0, every=2)))
    batch.on_reply(2, reply(flow(2, every=2)))
    batch.on_reply(4, reply(flow(4, every=2)))
    assert not batch.over
    assert batch.results(TIMEOUT) == [ACKED] * 4 + [TIMEOUT] * 2


def test_fast_batch_refused_at_once_ends_there():
    batch = FastBatch(3)
    batch.on_reply(1, reply(TOO_BIG))
    assert batch.over
    results = batch.results(TIMEOUT)
    assert isinstance(results[0], Failed)
    assert results[1:] == [None, None]


def test_fast_batch_turned_down_when_the_stream_does_not_allow_it():
    batch = FastBatch(3)
    batch.on_reply(1, reply(FAST_DISABLED))
    assert batch.over
    assert batch.batch_refused is not None


def test_fast_batch_broker_failure_is_nobody_s_row():
    batch = FastBatch(4)
    batch.on_reply(1, reply(FLOW_START))
    batch.on_reply(2, reply(b"", status="503"))
    results = batch.results(TIMEOUT)
    assert all(isinstance(r, Failed) and r.reason.broker_fault for r in results)


# -- atomic batches -------------------------------------------------------------------


def test_atomic_batch_committed():
    batch = AtomicBatch(3)
    batch.on_reply(reply(b""))
    batch.on_reply(reply(puback(3)))
    assert batch.over
    assert not batch.send_per_message
    assert batch.results(TIMEOUT) == [ACKED] * 3


def test_an_atomic_commit_that_counts_other_than_the_batch_marks_nothing():
    # All or nothing, and the server said neither: no row is marked published, and
    # none is blamed (the republish is deduplicated).
    batch = AtomicBatch(3)
    batch.on_reply(reply(b""))
    batch.on_reply(reply(puback(2)))
    results = batch.results(TIMEOUT)
    assert all(isinstance(r, Failed) and r.reason.relay_fault for r in results)


def test_atomic_batch_with_a_duplicate_goes_per_message():
    batch = AtomicBatch(5)
    batch.on_reply(reply(b""))
    batch.on_reply(reply(ATOMIC_DUPLICATE))
    assert batch.over
    assert batch.send_per_message


def test_atomic_batch_refused_for_one_message_goes_per_message():
    batch = AtomicBatch(5)
    batch.on_reply(reply(TOO_BIG))
    assert batch.send_per_message  # which message, only a publish each can tell


def test_atomic_batch_refused_for_the_stream_s_state_fails_whole_without_blame():
    batch = AtomicBatch(2)
    batch.on_reply(reply(NO_SPACE))
    assert not batch.send_per_message
    assert all(r.reason is FailureReason.STREAM_UNAVAILABLE for r in batch.results(TIMEOUT))


def test_atomic_batch_whose_commit_ack_is_lost_is_unknown_whole():
    batch = AtomicBatch(3)
    batch.on_reply(reply(b""))
    assert not batch.over
    assert batch.results(TIMEOUT) == [TIMEOUT] * 3


def test_batch_outcome_labels():
    assert batch_outcome([ACKED, ACKED]) == "stored"
    assert batch_outcome([ACKED, Failed(FailureReason.REFUSED, "x"), None]) == "stopped"
    assert batch_outcome([ACKED, TIMEOUT]) == "unanswered"


# -- the batch's loop over batches ----------------------------------------------------


class ScriptedBroker:
    """Answers each batch publish from a script: per call, a function of the
    messages sent to their results."""

    max_payload = 1024 * 1024

    def __init__(self, script: list) -> None:
        self.script = script
        self.batches: list[list[str]] = []
        self.waves: list[list[str]] = []

    async def publish_modes(self, subjects: Iterable[str]) -> dict[str, tuple[PublishMode, str]]:
        return dict.fromkeys(subjects, (PublishMode.BATCH, "S"))

    async def publish_batch(
        self, mode: PublishMode, messages: Sequence[Message], budget: float
    ) -> list[PublishResult | None] | None:
        self.batches.append([m.headers["Nats-Msg-Id"] for m in messages])
        return self.script.pop(0)(messages)

    async def publish_wave(self, messages: Sequence[Message], budget: float) -> list[PublishResult]:
        self.waves.append([m.headers["Nats-Msg-Id"] for m in messages])
        return [ACKED] * len(messages)


def publish(broker: ScriptedBroker, rows: list[OutboxRow]) -> dict:
    batch = Batch(config=Config(), database=None, broker=broker, failpoints=Failpoints(frozenset()))  # type: ignore[arg-type]

    async def run() -> dict:
        async with aio.open_loop():
            return await batch._publish(rows, trio.current_time() + 5)

    return trio.run(run)


def test_after_a_refused_message_the_other_subjects_go_in_the_next_batch():
    count = 5 + 3 * FAST_BATCH  # enough rows after the refused one for another batch
    rows = [row(f"e{n % 3}", "s.x", n) for n in range(count)]  # e0, e1, e2, e0, ...
    refused = Failed(FailureReason.REFUSED, "too big")
    broker = ScriptedBroker([
        lambda ms: [ACKED, ACKED, ACKED, ACKED, refused] + [None] * (count - 5),  # row 4 (e1)
        lambda ms: [ACKED] * len(ms),
    ])  # fmt: skip
    results = publish(broker, rows)
    # The second batch holds the rows after row 4 but not those of e1, behind it.
    after = [n for n in range(5, count) if n % 3 != 1]
    assert broker.batches[1] == [rows[n].id for n in after]
    assert results[rows[4].id] is refused
    assert not any(rows[n].id in results for n in range(7, count, 3))  # unsent, left as was
    assert all(isinstance(results[rows[n].id], Acked) for n in (0, 1, 2, 3, *after))


def test_rows_left_too_few_for_a_batch_go_in_a_wave():
    rows = [row(f"e{n % 3}", "s.x", n) for n in range(FAST_BATCH)]
    refused = Failed(FailureReason.REFUSED, "too big")
    broker = ScriptedBroker([lambda ms: [ACKED, refused] + [None] * (FAST_BATCH - 2)])
    results = publish(broker, rows)
    assert len(broker.batches) == 1
    left = [rows[n].id for n in range(2, FAST_BATCH) if n % 3 != 1]
    assert [id_ for wave in broker.waves for id_ in wave] == left
    assert all(isinstance(results[id_], Acked) for id_ in left)


def test_a_batch_turned_down_goes_one_message_at_a_time_in_waves():
    rows = [row(f"e{n % 2}", "s.x", n) for n in range(FAST_BATCH)]
    broker = ScriptedBroker([lambda ms: None])
    results = publish(broker, rows)
    assert broker.waves == [
        [rows[n].id, rows[n + 1].id] for n in range(0, FAST_BATCH, 2)
    ]  # fmt: skip
    assert all(isinstance(r, Acked) for r in results.values())
    assert len(results) == FAST_BATCH


def test_the_broker_s_failure_ends_the_pass_without_another_batch():
    # The broker failed the second message; the third and fourth (other subjects)
    # were not stored and nothing was said of them. They wait for the next pass:
    # another batch now would go to a broker in trouble.
    rows = [row(f"e{n}", "s.x", n) for n in range(2 * FAST_BATCH)]
    broker = ScriptedBroker([
        lambda ms: [ACKED, TIMEOUT] + [None] * (len(ms) - 2),
        lambda ms: [ACKED] * len(ms),
    ])  # fmt: skip
    results = publish(broker, rows)
    assert len(broker.batches) == 1
    assert broker.waves == []
    assert results[rows[1].id] is TIMEOUT
    assert not any(r.id in results for r in rows[2:])


def test_hpub_frames_are_what_nats_py_writes():
    headers = {"Nats-Msg-Id": "0190a1b2-0000-4000-8000-000000000001", "Nats-Batch-Sequence": "7"}
    body = b'{"specversion":"1.0","data":{"n":1}}'
    block = bytearray(NATS_HDR_LINE + _CRLF_)
    for key, value in headers.items():
        block += key.encode() + b": " + value.encode() + _CRLF_
    block += _CRLF_
    theirs = hpub_cmd("orders.placed", "_INBOX.x.b1.1", block, body)
    assert hpub_frame("orders.placed", "_INBOX.x.b1.1", headers, body) == theirs
    # Without a reply nats-py leaves two spaces where the reply goes; the server
    # reads both the same.
    without = hpub_cmd("orders.placed", "", block, body).replace(b"  ", b" ", 1)
    assert hpub_frame("orders.placed", "", headers, body) == without


def test_a_traced_rows_frame_is_what_nats_pys_publish_writes():
    """nats-py's own publish, its socket write captured: the relay's frame for a
    message with trace context and a row's headers (one padded with spaces) is the
    same bytes, so every publish mode sends the same message."""
    nc = Client()
    written: list[bytes] = []

    async def capture(command: bytes, priority: bool = False) -> None:
        written.append(command)

    nc._send_command = capture  # type: ignore[method-assign]
    source = row("e1", "orders.placed", 1)._replace(
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        tracestate="shop=a1",
        headers='{"x-tenant": " acme ", "x-priority": "high"}',
    )
    message = message_for(
        source, MessageSettings(1 << 20), trace_context(source.traceparent, source.tracestate)
    )
    assert isinstance(message, Message)
    assert message.headers["x-tenant"] == "acme"
    asyncio.run(
        nc._send_publish(
            message.subject, "_INBOX.x.a.1", message.body, len(message.body), message.headers
        )
    )
    assert written == [hpub_frame(message.subject, "_INBOX.x.a.1", message.headers, message.body)]


def test_only_acked_rows_with_a_producer_context_get_a_row_span():
    rows = [row(f"e{n}", "a.x", n) for n in range(4)]
    producer = trace_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None)
    assert producer is not None
    results: dict[str, PublishResult] = {
        rows[0].id: ACKED,
        rows[1].id: Acked(duplicate=True),
        rows[2].id: TIMEOUT,
    }
    traces = {rows[0].id: producer, rows[1].id: None, rows[2].id: producer, rows[3].id: producer}
    assert published_rows(rows, results, traces) == [
        PublishedRow(rows[0].id, "a.x", rows[0].created_at, producer)
    ]


def test_one_stream_is_one_group():
    plan = {"a.x": (PublishMode.BATCH, "A"), "a.y": (PublishMode.BATCH, "A")}
    rows = [row(f"e{n % 2}", "a.y" if n % 3 else "a.x", n) for n in range(FAST_BATCH)]
    assert split_by_publish_mode(rows, plan) == ([], [(PublishMode.BATCH, rows)])
    message = {"a.x": (PublishMode.MESSAGE, "A")}
    assert split_by_publish_mode(rows[:1], message) == (rows[:1], [])


class CountingClient:
    """A connected client as far as ``Broker.server_version`` looks: nats-py builds
    and parses a new ServerVersion at every ask."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.asked = 0

    @property
    def connected_server_version(self) -> ServerVersion:
        self.asked += 1
        return ServerVersion(self.version)


def test_the_server_version_is_parsed_once_a_connection():
    broker = Broker(["nats://127.0.0.1:4222"], lambda connected: None)
    client = CountingClient("2.15.1")
    broker._nc = client  # type: ignore[assignment]
    assert broker.server_version == (2, 15, 1)
    assert broker.server_version == (2, 15, 1)
    assert client.asked == 1
    broker._nc = None
    assert broker.server_version == (0, 0, 0)  # not connected: the oldest, not remembered
    broker._nc = CountingClient("not a version")  # type: ignore[assignment]
    broker._server_version = None  # as connect and the reconnect callback do
    assert broker.server_version == (0, 0, 0)
