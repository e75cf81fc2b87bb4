"""Failures that are the broker's, not the rows': a subject no stream captures yet,
a stream that is full. Their rows wait, holding their subjects, with their attempts
untouched however long it lasts; none goes dead. (A cluster losing its leader or
its quorum: test_cluster.py.)"""

from __future__ import annotations

import pytest

from tests.integration.test_failures import passes_after
from tests.support import database
from tests.support.database import Event
from tests.support.relayproc import wait_until
from tests.support.stream import DISCARD_NEW, run_js

pytestmark = pytest.mark.integration

# A cap that a few failures would reach: none of these may count.
SMALL_CAP = {"max_attempts": 2, "backoff_base": "50ms", "backoff_max": "300ms"}


def stored_order(stream, events: list[Event], *streams: str | None) -> list[float]:
    stored = {m.msg_id: m.stored_at for name in streams for m in stream.read(name)}
    return [stored[str(e.id)] for e in events]


def test_a_subject_no_stream_captures_waits_for_its_stream(db_url, stream, start_relay):
    relay = start_relay(poll_interval="50ms", **SMALL_CAP)
    late_type = f"{stream.prefix}_late.created"
    late = Event(late_type, "account-1", {"n": 1})
    database.insert(db_url, [late])
    # JetStream answers that no stream captures it: NATS is up, this subject lacks a
    # stream, and the relay says which one. The row waits, spending no attempt.
    wait_until(
        lambda: relay.metric("outbox_relay_subjects_without_stream") == 1,
        message="the subject reported",
    )
    assert relay.ready()
    behind = Event(stream.subject("ok"), "account-1", {"n": 2})
    other = Event(stream.subject("ok"), "account-2", {"n": 3})
    database.insert_in_order(db_url, [behind, other], commit_each=True)
    [message] = wait_until(lambda: stream.read() or None, message="the other subject's row")
    assert message.msg_id == str(other.id)
    passes_after(relay, 10)
    rows = database.rows_by_id(db_url)
    assert rows[str(late.id)]["attempts"] == 0
    assert rows[str(late.id)]["relay_dead_at"] is None
    assert rows[str(late.id)]["relay_last_error"].startswith("no_stream")
    assert rows[str(behind.id)]["published_at"] is None  # held behind it
    warnings = [
        r for r in relay.log_records() if "no stream captures subject" in r.get("message", "")
    ]
    assert len(warnings) == 1  # once per subject, not once per try
    # The operator extends the stream: the row goes, then the one it held.
    stream.update(stream.name, subjects=[f"{stream.prefix}.>", late_type])
    wait_until(lambda: database.unpublished_count(db_url) == 0, message="drain")
    times = stored_order(stream, [late, behind], None)
    assert times == sorted(times)
    wait_until(lambda: relay.metric("outbox_relay_subjects_without_stream") == 0, message="gauge")
    assert database.dead_count(db_url, 2) == 0
    assert not any(k.startswith("outbox_relay_dead_marked_total") for k in relay.metrics())


def test_a_full_stream_makes_its_rows_wait_without_attempts(db_url, stream, start_relay):
    # max_msgs reached with discard new: JetStream refuses every new message for the
    # stream's state ("maximum messages exceeded"), which no row can cause.
    full_name, full_subject = f"{stream.name}_FULL", f"{stream.prefix}_full.created"
    stream.create(full_name, [full_subject], max_msgs=1, discard=DISCARD_NEW)

    async def fill(js):
        await js.publish(full_subject, b"filler")

    run_js(stream.url, fill)
    try:
        relay = start_relay(poll_interval="50ms", **SMALL_CAP)
        waiting = Event(full_subject, "account-1", {"n": 1})
        behind = Event(stream.subject("ok"), "account-1", {"n": 2})
        other = Event(stream.subject("ok"), "account-2", {"n": 3})
        database.insert_in_order(db_url, [waiting, behind, other], commit_each=True)
        wait_until(lambda: len(stream.read()) == 1, message="the other subject's row")

        def refusals() -> float:
            return relay.metric(
                "outbox_relay_publish_failures_total",
                event_type=full_subject,
                reason="stream_unavailable",
            )

        # Tried again and again (more often than the cap would allow, were they
        # counted), with pauses: what is left is a batch NATS acknowledges none of,
        # and readiness says how it fails.
        wait_until(lambda: refusals() >= 4, message="several refusals")
        wait_until(
            lambda: "stream_unavailable" in relay.get("/readyz")[1], message="readiness says why"
        )
        rows = database.rows_by_id(db_url)
        assert rows[str(waiting.id)]["attempts"] == 0
        assert rows[str(waiting.id)]["relay_dead_at"] is None
        assert rows[str(behind.id)]["published_at"] is None
        assert relay.metric("outbox_relay_broker_outage_batches_total") >= 1
        stream.update(full_name, max_msgs=-1)
        wait_until(lambda: database.unpublished_count(db_url) == 0, message="drain")
        times = stored_order(stream, [waiting, behind], None, full_name)
        assert times == sorted(times)
        assert relay.metric("outbox_relay_dead_rows") == 0
    finally:
        stream.delete(full_name)
