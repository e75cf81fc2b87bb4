"""`outbox-relay audit`: rows marked published whose message the stream lost are
found, told apart from messages the stream's limits removed, and restored by
`--repair` in per-subject order, inside the stream's duplicate window; the finding,
the repair and the relay's own audits on a partitioned table too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict

import psycopg
import pytest

from relay.config import Config
from relay.sqlfiles import AUDIT_LOCK_CLASS, idle_lock_key
from tests.support import database
from tests.support.database import LAYOUTS, Event
from tests.support.relayproc import wait_until
from tests.support.servers import SHARED_NATS_URL, free_port
from tests.support.stream import TestStream, run_js

pytestmark = pytest.mark.integration


def audit(db_url: str, *args: str, nats_url: str = SHARED_NATS_URL) -> tuple[int, dict]:
    result = subprocess.run(
        [sys.executable, "-m", "relay", "audit", "--json", *args],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "OUTBOX_RELAY_DATABASE_URL": db_url, "OUTBOX_RELAY_NATS_URL": nats_url},
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return result.returncode, json.loads(result.stdout)


def publish_through_relay(db_url: str, start_relay, events: list[Event], **settings):
    relay = start_relay(**settings)
    database.insert(db_url, events)
    wait_until(
        lambda: (
            database.fetch(db_url, "select count(*) from outbox_events where published_at is null")
            == [(0,)]
        ),
        message="every row published",
    )
    return relay


@pytest.mark.parametrize("outbox_layout", LAYOUTS)
def test_lost_messages_are_found_and_repaired_in_order(db_url, stream, start_relay):
    events = [Event(stream.subject(f"account.{i % 4}"), f"entity-{i % 6}") for i in range(120)]
    for i, event in enumerate(events):
        event.data = {"n": i}
    publish_through_relay(db_url, start_relay, events)
    status, report = audit(db_url)
    assert (status, report["checked"], report["missing"]) == (0, 120, []), report
    assert report["streams"] == {stream.name: 120}

    # Lose some acknowledged messages: three deleted, and one subject purged.
    stored = {m.msg_id: m for m in stream.read_all()}
    deleted = [str(events[i].id) for i in (5, 17, 90)]
    purged_subject = stream.subject("account.3")
    purged = {str(e.id) for e in events if e.event_type == purged_subject}

    async def lose(js):
        for row_id in deleted:
            await js.delete_msg(stream.name, stored[row_id].seq)
        await js.purge_stream(stream.name, subject=purged_subject)

    run_js(stream.url, lose)
    lost = set(deleted) | purged
    status, report = audit(db_url)
    assert status == 1
    assert set(report["missing"]) == lost
    assert (report["checked"], report["expired"]) == (120, 0)

    # Repair, seconds after the first publish: inside the stream's duplicate window.
    status, report = audit(db_url, "--repair")
    assert status == 1
    assert (set(report["repaired"]), report["repair_failed"]) == (lost, {})
    after = stream.read_all()
    copies = [m for m in after if m.msg_id.split(":repair:")[0] in lost]
    assert {m.envelope["id"] for m in copies} == lost  # each once, its envelope id unchanged
    assert all(m.msg_id != m.envelope["id"] for m in copies)
    by_id = {str(e.id): e for e in events}
    for m in copies:
        assert m.envelope["data"] == by_id[m.envelope["id"]].data
    # Per-subject order among the repaired rows: their own insertion order.
    order: dict[str, list[int]] = defaultdict(list)
    for m in copies:
        order[m.envelope["subject"]].append(m.envelope["data"]["n"])
    assert all(ns == sorted(ns) for ns in order.values()), order
    status, report = audit(db_url)
    assert (status, report["missing"]) == (0, []), report


def test_messages_the_streams_limits_removed_are_not_missing(db_url, start_relay):
    stream = TestStream(SHARED_NATS_URL, max_msgs=50)
    try:
        events = [Event(stream.subject("capped"), f"entity-{i % 3}") for i in range(80)]
        publish_through_relay(db_url, start_relay, events)
        status, report = audit(db_url)
        assert (status, report["missing"], report["expired"]) == (0, [], 30), report
        # A purge is not a limit: with the stream emptied, all 80 are missing.
        run_js(stream.url, lambda js: js.purge_stream(stream.name))
        status, report = audit(db_url)
        assert (status, len(report["missing"])) == (1, 80), report
    finally:
        stream.delete()


def test_a_subject_no_stream_captures_any_more_is_missing(db_url, start_relay):
    stream = TestStream(SHARED_NATS_URL)
    events = [Event(stream.subject("gone"), "entity-1") for _ in range(5)]
    publish_through_relay(db_url, start_relay, events)
    stream.delete()
    status, report = audit(db_url)
    assert (status, set(report["missing"])) == (1, {str(e.id) for e in events}), report


@pytest.mark.parametrize("outbox_layout", LAYOUTS)
def test_the_relay_audits_on_its_own_and_reports_what_is_missing(db_url, stream, start_relay):
    events = [Event(stream.subject("audited"), f"entity-{i % 3}") for i in range(30)]
    relay = publish_through_relay(db_url, start_relay, events, audit_interval="500ms")
    wait_until(
        lambda: (
            relay.metric("outbox_relay_audit_checked_rows") == 30
            and relay.metric("outbox_relay_audit_last_success_timestamp_seconds") > 0
        ),
        message="a clean audit",
    )
    assert relay.metric("outbox_relay_audit_missing_rows") == 0
    lost = stream.read_all()[7]
    run_js(stream.url, lambda js: js.delete_msg(stream.name, lost.seq))
    wait_until(
        lambda: relay.metric("outbox_relay_audit_missing_rows") == 1,
        message="the deleted message reported",
    )
    assert any(
        "missing from their streams" in r["message"] and lost.msg_id in r["message"]
        for r in relay.log_records()
    ), relay.logs()


@pytest.mark.parametrize("outbox_layout", LAYOUTS)
def test_an_audit_beside_a_busy_relay_finds_nothing_missing(db_url, stream, start_relay):
    """Rows are marked while the audit reads: one marked after the audit read its
    stream must wait for the next audit, not be reported missing."""
    relay = start_relay(audit_interval="200ms")
    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            database.insert(db_url, [Event(stream.subject("busy"), f"e-{i}") for i in range(20)])
            time.sleep(0.005)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    audits: set[float] = set()
    try:

        def audited_five_times() -> bool:
            assert relay.metric("outbox_relay_audit_missing_rows") == 0, relay.logs()
            audits.add(relay.metric("outbox_relay_audit_last_success_timestamp_seconds"))
            return len(audits - {0.0}) >= 5 and relay.metric("outbox_relay_audit_checked_rows") > 0

        wait_until(audited_five_times, interval=0.05, message="five audits under load")
    finally:
        stop.set()
        producer.join(10)


def test_one_relay_audits_at_a_time(db_url, stream, start_relay):
    """Replicas share one configuration: while one holds the table's audit lock,
    the others skip their audits instead of reading the same streams again, and
    drop their own earlier finding (the auditing replica's gauge is the truth)."""
    events = [Event(stream.subject("locked"), "entity-1") for _ in range(3)]
    relay = publish_through_relay(db_url, start_relay, events, audit_interval="200ms")
    lost = stream.read_all()[0]
    run_js(stream.url, lambda js: js.delete_msg(stream.name, lost.seq))
    wait_until(lambda: relay.metric("outbox_relay_audit_missing_rows") == 1, message="found")
    key = idle_lock_key(Config())
    with psycopg.connect(db_url, autocommit=True) as holder:
        holder.execute("select pg_advisory_lock(%s, %s)", (AUDIT_LOCK_CLASS, key))
        skipped = relay.logs().count("another relay is auditing")
        wait_until(
            lambda: relay.logs().count("another relay is auditing") > skipped,
            message="an audit skipped",
        )
        assert relay.metric("outbox_relay_audit_missing_rows") == 0
        holder.execute("select pg_advisory_unlock(%s, %s)", (AUDIT_LOCK_CLASS, key))
        wait_until(
            lambda: relay.metric("outbox_relay_audit_missing_rows") == 1,
            message="an audit once the lock is free",
        )


def test_an_audit_that_cannot_reach_nats_exits_2_with_one_line(db_url):
    result = subprocess.run(
        [sys.executable, "-m", "relay", "audit", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "OUTBOX_RELAY_DATABASE_URL": db_url,
             "OUTBOX_RELAY_NATS_URL": f"nats://relay:s3cret@127.0.0.1:{free_port()}"},
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "audit failed: cannot connect to NATS at nats://relay:***@" in result.stderr
    assert "Traceback" not in result.stderr
    assert "s3cret" not in result.stderr
