"""JetStream batch publishing against a real nats-server 2.15 (the Debian server on
the machine is 2.9 and has neither mode): each mode delivers every row once and in
per-subject order, a duplicate inside a batch is stored once, and a message the
stream refuses stops its own subject only."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.js.api import StreamConfig

from relay.envelope import build_message
from relay.model import OutboxRow
from relay.streams import MIN_BATCH_MESSAGES, PublishMode
from relay_tools import exposition
from relay_tools.localservers import throwaway_nats
from tests.support import database
from tests.support.database import Event
from tests.support.relayproc import wait_until
from tests.support.stream import TestStream, run_js

pytestmark = pytest.mark.integration

DEPLOY_STREAM = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "events-stream.json"
FAST = {"poll_interval": "200ms", "backoff_base": "200ms", "backoff_max": "1s"}
BOTH = {"allow_batched": True, "allow_atomic": True}


@pytest.fixture(scope="module")
def nats215():
    with throwaway_nats() as server:
        yield server


def events(stream: TestStream, count: int, subjects: int) -> list[Event]:
    return [
        Event(stream.subject(f"kind{n % 3}"), f"entity-{n % subjects}", {"n": n})
        for n in range(count)
    ]


def assert_each_once_in_order(stream: TestStream, sent: list[Event]) -> None:
    stored = stream.read_all()
    ids = [m.msg_id for m in stored]
    assert sorted(ids) == sorted(str(e.id) for e in sent), "each row stored exactly once"
    per_subject: dict[str, list[int]] = {}
    for message in sorted(stored, key=lambda m: m.seq):
        envelope = message.envelope
        per_subject.setdefault(envelope["subject"], []).append(envelope["data"]["n"])
    for subject, numbers in per_subject.items():
        assert numbers == sorted(numbers), f"{subject} out of order"


@pytest.mark.parametrize(
    ("allows", "wanted", "expected"),
    [
        (BOTH, "auto", "batch"),
        ({"allow_atomic": True}, "auto", "message"),  # atomic only when asked for
        (BOTH, "atomic", "atomic"),
        (BOTH, "message", "message"),
        ({}, "auto", "message"),
    ],
)
def test_each_mode_delivers_every_row_once_in_order(  # noqa: PLR0917 - fixtures, parameters
    db_url, start_relay, nats215, allows, wanted, expected
):
    stream = TestStream(nats215.url, **allows)
    relay = start_relay(nats_url=nats215.url, publish_mode=wanted, batch_size=300, **FAST)
    # One transaction of 2,000 rows over 40 entities, then 200 a transaction each.
    sent = events(stream, 2_200, subjects=40)
    database.insert(db_url, sent[:2_000])
    database.insert_in_order(db_url, sent[2_000:], commit_each=True)
    wait_until(lambda: database.unpublished_count(db_url) == 0, 60, message="every row published")
    assert_each_once_in_order(stream, sent)
    assert relay.metric("outbox_relay_publish_mode", stream=stream.name, mode=expected) == 1
    assert f"{stream.name}: {expected}" in relay.logs()
    stored_in_batches = relay.metric(
        "outbox_relay_batch_publishes_total", mode=expected, outcome="stored"
    )
    if expected == "message":
        assert not any(k.startswith("outbox_relay_batch_publishes_total") for k in relay.metrics())
    else:
        assert stored_in_batches > 0
        assert (
            relay.metric("outbox_relay_batch_publishes_total", mode=expected, outcome="turned_down")
            == 0
        )


def test_a_few_rows_go_per_message_into_a_stream_that_takes_fast_batches(
    db_url, start_relay, nats215
):
    """A fast batch costs two broker round trips (its first message goes alone), so a
    transaction of a few rows, what a claim finds at light load, goes per message;
    a larger one as a fast batch (MIN_BATCH_MESSAGES, docs/publish-modes.md)."""
    stream = TestStream(nats215.url, **BOTH)
    relay = start_relay(nats_url=nats215.url, **FAST)
    wait_until(lambda: f"{stream.name}: batch" in relay.logs(), 30, message="fast batches chosen")
    few = MIN_BATCH_MESSAGES[PublishMode.BATCH] - 1
    sent = events(stream, few + 2 * MIN_BATCH_MESSAGES[PublishMode.BATCH], subjects=7)
    database.insert(db_url, sent[:few])  # one transaction: one claim finds all of them
    wait_until(lambda: database.unpublished_count(db_url) == 0, 30, message="the few published")
    assert exposition.total(relay.metrics(), "outbox_relay_published_total") == few
    assert relay.metric("outbox_relay_batch_publishes_total", mode="batch", outcome="stored") == 0
    database.insert(db_url, sent[few:])
    wait_until(lambda: database.unpublished_count(db_url) == 0, 30, message="every row published")
    assert relay.metric("outbox_relay_batch_publishes_total", mode="batch", outcome="stored") >= 1
    assert_each_once_in_order(stream, sent)


@pytest.mark.parametrize("mode", ["batch", "atomic"])
def test_a_duplicate_inside_a_batch_is_stored_once(db_url, start_relay, nats215, mode):
    """Rows whose messages the stream already holds (a relay crashed after the
    broker's ack, before its mark) are claimed again among new ones: each is
    stored once and every row ends published."""
    stream = TestStream(nats215.url, **BOTH)
    sent = events(stream, 400, subjects=20)
    already = sent[100:110] + sent[250:251]

    async def publish_first(js) -> None:
        for event in already:
            envelope = b'{"stored":"earlier"}'
            await js.publish(event.event_type, envelope, headers={"Nats-Msg-Id": str(event.id)})

    run_js(nats215.url, publish_first)
    database.insert(db_url, sent)
    relay = start_relay(nats_url=nats215.url, publish_mode=mode, **FAST)
    wait_until(lambda: database.unpublished_count(db_url) == 0, 60, message="every row published")
    stored = stream.read_all()
    assert sorted(m.msg_id for m in stored) == sorted(str(e.id) for e in sent)
    if mode == "atomic":
        # One duplicate rejects an atomic batch whole: it went one message at a time.
        assert relay.metric("outbox_relay_batch_publishes_total", mode=mode, outcome="turned_down")
        assert relay.metric("outbox_relay_duplicate_acks_total") >= len(already)
    else:
        # A fast batch skips a duplicate and goes on.
        assert relay.metric("outbox_relay_batch_publishes_total", mode=mode, outcome="stored")


@pytest.mark.parametrize("mode", ["batch", "atomic"])
def test_a_message_the_stream_refuses_stops_only_its_subject(db_url, start_relay, nats215, mode):
    stream = TestStream(nats215.url, max_msg_size=2_000, **BOTH)
    sent = events(stream, 300, subjects=10)
    big = 150
    sent[big] = Event(sent[big].event_type, sent[big].subject, {"n": big, "pad": "x" * 3_000})
    database.insert(db_url, sent)
    relay = start_relay(nats_url=nats215.url, publish_mode=mode, max_attempts=2, **FAST)
    blocked = {e.id for e in sent[big:] if e.subject == sent[big].subject}
    wait_until(
        lambda: database.unpublished_count(db_url) == len(blocked),
        60,
        message="every row but the refused one's subject published",
    )
    wait_until(lambda: database.dead_count(db_url, 2) == 1, 30, message="the refused row dead")
    rows = database.rows_by_id(db_url)
    assert rows[str(sent[big].id)]["attempts"] == 2
    assert all(rows[str(i)]["published_at"] is None for i in blocked)
    stored = {m.msg_id for m in stream.read_all()}
    assert stored == {str(e.id) for e in sent if e.id not in blocked}
    assert (
        relay.metric(
            "outbox_relay_publish_failures_total", event_type=sent[big].event_type, reason="refused"
        )
        == 2
    )


def test_the_deploy_stream_takes_fast_batches(db_url, start_relay, nats215):
    """deploy/nats/events-stream.json, as the README's step 1 adds it (one replica
    here), is accepted by nats-server 2.15 and gets fast batches."""
    config = json.loads(DEPLOY_STREAM.read_text())
    config.update(num_replicas=1, name=f"EVENTS{uuid.uuid4().hex[:8]}")
    prefix = f"billing{uuid.uuid4().hex[:8]}"
    config["subjects"] = [f"{prefix}.>"]

    async def add(js) -> None:
        await js.add_stream(StreamConfig.from_response(config))

    run_js(nats215.url, add)
    relay = start_relay(nats_url=nats215.url, **FAST)
    # Said at start, before any row: the operator sees the mode the relay will use.
    wait_until(
        lambda: f"{config['name']}: batch" in relay.logs(), 10, message="the mode logged at start"
    )
    database.insert(
        db_url, [Event(f"{prefix}.invoice.paid", f"i{n % 5}", {"n": n}) for n in range(50)]
    )
    wait_until(lambda: database.unpublished_count(db_url) == 0, 30, message="every row published")
    assert relay.metric("outbox_relay_publish_mode", stream=config["name"], mode="batch") == 1

    async def delete(js) -> None:
        await js.delete_stream(config["name"])

    run_js(nats215.url, delete)


def near_limit(stream: TestStream, subject: str, under: int, max_payload: int) -> Event:
    """An event whose message is ``under`` bytes under ``max_payload``, as the relay
    builds it (headers and body: what the server counts)."""
    event = Event(
        stream.subject("big"), subject, {"n": 0, "pad": ""},
        time=datetime(2026, 1, 1, tzinfo=UTC),
    )  # fmt: skip
    row = OutboxRow(
        str(event.id), event.event_type, event.source, subject,
        "2026-01-01T00:00:00.000000Z", json.dumps({"n": 0, "pad": ""}), 0.0, 0, 0,
    )  # fmt: skip
    pad = max_payload - under - build_message(row, row.time or "").wire_size
    event.data["pad"] = "x" * pad
    return event


@pytest.mark.parametrize("mode", ["message", "batch", "atomic"])
def test_a_message_just_under_max_payload_is_published_in_every_mode(
    db_url, start_relay, nats215, mode
):
    # The server closes the connection on a message over max_payload, headers
    # counted: an atomic batch adds three, so a row that fits alone did not fit in
    # one, and its stream stopped for good (claimed first, the connection dropped).
    stream = TestStream(nats215.url, **BOTH)
    relay = start_relay(nats_url=nats215.url, publish_mode=mode, batch_size=50, **FAST)
    max_payload = 1024 * 1024
    big = [near_limit(stream, "entity-big", under, max_payload) for under in (1, 50, 100)]
    for n, event in enumerate(big, 1):
        event.data["n"] = n
    sent = [*big, *events(stream, 40, subjects=5)]
    after = Event(stream.subject("kind0"), "entity-big", {"n": 10})
    database.insert(db_url, [*sent, after])
    wait_until(lambda: database.unpublished_count(db_url) == 0, 60, message="every row published")
    assert_each_once_in_order(stream, [*sent, after])
    assert relay.metric("outbox_relay_dead_rows") == 0


def test_a_stream_changed_is_read_again_before_the_next_batch(db_url, start_relay, nats215):
    """A stream that stops taking fast batches (as one scaled to three replicas
    must) gets the next rows per message: the relay hears the server's advisory and
    reads the streams again first, not up to 30 s later."""
    stream = TestStream(nats215.url, **BOTH)
    relay = start_relay(nats_url=nats215.url, batch_size=300, **FAST)
    sent = events(stream, 600, subjects=20)
    database.insert(db_url, sent[:300])
    wait_until(lambda: database.unpublished_count(db_url) == 0, 60, message="first rows published")
    assert relay.metric("outbox_relay_publish_mode", stream=stream.name, mode="batch") == 1
    batches = relay.metric("outbox_relay_batch_publishes_total", mode="batch", outcome="stored")
    stream.update(stream.name, allow_batched=False)
    wait_until(
        lambda: f"stream {stream.name} updated: reading" in relay.logs(),
        30,
        message="the relay heard of the change",
    )
    database.insert(db_url, sent[300:])
    wait_until(lambda: database.unpublished_count(db_url) == 0, 60, message="every row published")
    assert relay.metric("outbox_relay_publish_mode", stream=stream.name, mode="message") == 1
    after = relay.metric("outbox_relay_batch_publishes_total", mode="batch", outcome="stored")
    assert after == batches, "a fast batch went to a stream that no longer takes them"
    assert_each_once_in_order(stream, sent)
