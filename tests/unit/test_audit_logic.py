"""The audit's decisions, as pure functions: which row a message id names, when
an absent message left by a limit, how repairs keep per-subject order."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from nats.js.api import PubAck

from relay.audit import (
    AuditReport,
    MissingRow,
    StreamView,
    _repair,
    message_key,
    parse_time,
    removed_by_limits,
    repair_msg_id,
)
from relay.config import Config
from relay.model import OutboxRow
from relay.ordering import SubjectQueues
from relay.sqlfiles import Names

# A stream's info as nats-server 2.15 answers $JS.API.STREAM.INFO (trimmed).
INFO = {
    "config": {
        "name": "EVENTS", "subjects": ["orders.>"], "retention": "limits", "max_consumers": -1,
        "max_msgs": 1000, "max_bytes": -1, "max_age": 3_600_000_000_000,
        "max_msgs_per_subject": -1, "discard": "old", "duplicate_window": 120_000_000_000,
    },
    "state": {
        "messages": 1000, "bytes": 250_000, "first_seq": 501, "last_seq": 1500,
        "first_ts": "2026-12-03T18:00:00.123456789Z", "last_ts": "2026-12-03T18:30:00Z",
    },
}  # fmt: skip
NOW = parse_time("2026-12-03T18:30:00Z")


def view(**changes) -> StreamView:
    info = json.loads(json.dumps(INFO))
    for key, value in changes.items():
        (info["state"] if key in info["state"] else info["config"])[key] = value
    return StreamView.from_info(info)


def test_a_stream_info_is_read_as_jetstream_writes_it():
    stream = view()
    assert (stream.name, stream.max_age, stream.max_msgs, stream.duplicate_window) == (
        "EVENTS", 3600.0, 1000, 120.0,
    )  # fmt: skip
    assert stream.first_ts == pytest.approx(NOW - 1800 + 0.123456789)
    assert stream.keeps_what_it_stores
    assert not view(retention="workqueue").keeps_what_it_stores
    assert view(messages=0).first_ts is None


def test_a_message_id_names_its_row_and_a_repaired_copy_names_the_same_row():
    row_id = str(uuid.uuid4())
    copy = repair_msg_id(row_id, NOW)
    assert copy != row_id
    assert repair_msg_id(row_id, NOW + 1) != copy
    assert message_key(row_id) == message_key(copy) == uuid.UUID(row_id).int & (2**64 - 1)
    assert message_key("not-a-row") is None


BEFORE_FRONT = NOW - 1900  # published before the stream's oldest message
AFTER_FRONT = NOW - 600


@pytest.mark.parametrize(
    ("published_at", "changes", "subject_messages", "removed"),
    [
        # A stream at max_msgs (discard old) removes its oldest: before the front, yes.
        (BEFORE_FRONT, {}, None, True),
        # ... but a message newer than the front was taken from the middle.
        (AFTER_FRONT, {}, None, False),
        # Marked just after the oldest message's time (its batch's acks took a
        # while): it may have been stored before it.
        (NOW - 1800 + 5.0, {}, None, True),
        (NOW - 1800 + 7.0, {}, None, False),
        # Not at the limit (a purge emptied part of it): no limit accounts for it.
        (BEFORE_FRONT, {"messages": 400, "max_age": 0}, None, False),
        # Old enough for max_age.
        (NOW - 4000, {"messages": 400}, None, True),
        # discard new never removes a message for max_msgs.
        (BEFORE_FRONT, {"discard": "new", "max_age": 0}, None, False),
        # max_bytes, at it.
        (BEFORE_FRONT, {"max_msgs": -1, "max_age": 0, "max_bytes": 250_000}, None, True),
        # The subject at max_msgs_per_subject removes that subject's oldest, anywhere.
        (AFTER_FRONT, {"max_msgs_per_subject": 10}, 10, True),
        (AFTER_FRONT, {"max_msgs_per_subject": 10}, 3, False),
        # An emptied stream: only a limit can explain it.
        (AFTER_FRONT, {"messages": 0, "max_age": 0}, None, False),
        (NOW - 4000, {"messages": 0}, None, True),
    ],
)
def test_an_absent_message_left_by_a_limit_only_when_one_accounts_for_it(
    published_at, changes, subject_messages, removed
):
    stream = view(**changes)
    assert removed_by_limits(published_at, NOW, stream, subject_messages, 6.0) is removed


def row(subject: str, n: int) -> OutboxRow:
    return OutboxRow(str(uuid.uuid4()), "orders.paid", "s", subject, "t", "{}", float(n), n, 0)


def test_repairs_go_in_waves_that_keep_each_subjects_order():
    # The repair publishes through the relay's own per-subject waves.
    a1, b1, a2, a3, c1 = row("a", 1), row("b", 2), row("a", 3), row("a", 4), row("c", 5)
    queues = SubjectQueues([a1, b1, a2, a3, c1])
    waves = []
    while queues:
        waves.append(queues.next_wave())
    assert waves == [[a1, b1, c1], [a2], [a3]]
    assert not SubjectQueues([])


def test_the_report_lists_every_missing_id_in_json_and_the_first_in_text():
    report = AuditReport(since=3600, checked=30, streams={"EVENTS": 30})
    report.missing = [MissingRow(str(i), "orders.paid", "a", NOW, "EVENTS") for i in range(12)]
    assert json.loads(report.as_json())["missing"] == [str(i) for i in range(12)]
    text = report.summary()
    assert "12 missing" in text
    assert "... and 2 more" in text


def test_repair_publishes_in_waves_and_stops_a_subject_at_its_failure():
    # _repair itself, on fakes of a connection and of JetStream: a wave is one row of
    # each subject, sent only once the previous wave's acks are in; a subject whose
    # row failed stops there, its later rows untried, while the others go on.
    a1, b1, a2, a3, b2 = row("a", 1), row("b", 2), row("a", 3), row("a", 4), row("b", 5)
    calls: list[tuple[str, int]] = []  # (row id, acks in when it was sent)
    acked: list[str] = []

    class Cursor:
        async def fetchall(self) -> list[tuple[object, ...]]:
            return [tuple(r) for r in (a1, b1, a2, a3, b2)]

    class Conn:
        async def execute(self, *_args: object) -> Cursor:
            return Cursor()

        async def commit(self) -> None:
            pass

    class JetStream:
        async def publish(self, subject, body, timeout, headers):  # noqa: ASYNC109 - js.publish's signature
            row_id = json.loads(body)["id"]
            calls.append((row_id, len(acked)))
            await asyncio.sleep(0)
            if row_id == a2.id:
                raise TimeoutError("no ack")
            acked.append(row_id)
            return PubAck(stream="EVENTS", seq=len(acked))

    class Nats:
        def jetstream(self) -> JetStream:
            return JetStream()

    report = AuditReport(since=3600, checked=5, streams={"EVENTS": 5})
    report.missing = [
        MissingRow(r.id, "orders.paid", r.subject, NOW, "EVENTS") for r in (a1, b1, a2, a3, b2)
    ]
    asyncio.run(_repair(Conn(), Nats(), Names.for_config(Config()), report))  # type: ignore[arg-type]
    assert calls == [(a1.id, 0), (b1.id, 0), (a2.id, 2), (b2.id, 2)]
    assert report.repaired == [a1.id, b1.id, b2.id]
    assert set(report.repair_failed) == {a2.id, a3.id}
    assert "TimeoutError" in report.repair_failed[a2.id]
    assert "not tried" in report.repair_failed[a3.id]
