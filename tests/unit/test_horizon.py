"""The vacuum horizon's holders told in seconds, and what reads the table less
while one holds it: pure logic, no server."""

from __future__ import annotations

from relay.gauges import BACKLOG_DUTY, SWEEP_INTERVAL, next_backlog_read, sweep_now
from relay.horizon import (
    HOLDER_KINDS,
    XID_CLOCK_SPAN,
    Holder,
    XidClock,
    advice,
    describe,
    holder_seconds,
)
from relay.retention import FROM_RECENT_ROWS, FULL_PASS_INTERVAL, RetentionCursor


def test_the_xid_clock_tells_an_xids_age_from_the_first_sample_after_it():
    clock = XidClock()
    for t, next_xid in ((0.0, 100), (5.0, 150), (10.0, 400)):
        clock.sample(t, next_xid)
    assert clock.age(120, now=12.0) == 7.0  # handed out before the sample at 5 s
    assert clock.age(99, now=12.0) == 12.0  # older than every sample: at least all of them
    assert clock.age(400, now=12.0) == 0.0  # after every sample
    assert clock.age(150, now=12.0) == 2.0


def test_the_xid_clock_forgets_samples_past_its_span_but_keeps_the_bound():
    clock = XidClock()
    clock.sample(0.0, 100)
    clock.sample(10.0, 200)
    clock.sample(XID_CLOCK_SPAN + 20.0, 300)
    clock.sample(XID_CLOCK_SPAN + 30.0, 400)
    # The first sample is gone; an xid older than all is as old as the oldest kept.
    assert clock.age(50, now=XID_CLOCK_SPAN + 30.0) == XID_CLOCK_SPAN + 20.0


def holder(**kw: object) -> Holder:
    fields = {"kind": "snapshot", "pid": 42, "name": "psql", "state": "idle in transaction",
              "xids": 5000, "seconds": 200.0, "visible": True}  # fmt: skip
    return Holder(**{**fields, **kw})  # type: ignore[arg-type]


def test_a_holders_age_is_the_longer_of_its_transactions_and_the_clocks():
    clock = XidClock()
    clock.sample(0.0, 1000)
    clock.sample(100.0, 9000)
    # xmin = 10000 - 5000 = 5000, handed out before the sample at 100 s
    assert holder_seconds(holder(seconds=200.0), clock, next_xid=10000, now=130.0) == 200.0
    assert holder_seconds(holder(seconds=None), clock, next_xid=10000, now=130.0) == 30.0


def test_a_holder_hidden_from_the_role_is_named_with_the_grant_that_shows_it():
    line = describe(holder(visible=False, state=None, seconds=None), 400.0)
    assert "pid 42" in line
    assert "pg_read_all_stats" in line
    assert "at least 6.7m" in line
    line = describe(holder(), 200.0)
    assert line == (
        "held for 3.3m (5000 transactions) by session 'psql' (pid 42, idle in transaction)"
    )
    slot = describe(holder(kind="slot", pid=None, name="standby1", state="active"), 9)
    assert slot == "held for 9s (5000 transactions) by replication slot 'standby1' (active)"


def test_a_writer_of_the_table_is_named_with_what_ends_each_kind_of_hold():
    line = describe(holder(kind="writer", wrote_table=True), 200.0)
    assert line.startswith(
        "held for 3.3m (5000 transactions) by session with an xid 'psql' (pid 42, idle in "
        "transaction); it has written to the outbox table"
    )
    kinds = [holder(kind="writer"), holder(kind="prepared"), holder(kind="writer")]
    assert len(advice(kinds)) == 2
    assert "idle_in_transaction_session_timeout" in advice(kinds)[0]
    assert "COMMIT PREPARED" in advice(kinds)[1]
    assert all(advice([holder(kind=kind)]) for kind in HOLDER_KINDS)


def test_a_slow_backlog_read_is_repeated_less_often():
    assert next_backlog_read(100.0, 0.01, 5.0) == 105.0
    assert next_backlog_read(100.0, 1.0, 5.0) == 100.0 + BACKLOG_DUTY


def test_retention_walks_on_from_its_last_row_and_from_the_first_now_and_then():
    cursor = RetentionCursor(now=0.0)
    cursor.start_pass(0.0)
    assert cursor.after == "-infinity"
    cursor.deleted_up_to("2026-12-04 10:00:00.5+00")
    cursor.deleted_up_to(None)  # a statement that deleted nothing keeps the place
    cursor.start_pass(60.0)
    assert cursor.after == "2026-12-04 10:00:00.5+00"
    cursor.start_pass(FULL_PASS_INTERVAL)
    assert cursor.after == "-infinity"


def test_a_failed_full_pass_gives_way_to_the_passes_and_is_tried_an_interval_later():
    cursor = RetentionCursor(now=0.0)
    cursor.start_pass(0.0)
    assert cursor.after == "-infinity"
    cursor.failed()  # the first walk, from the first row, timed out: no place yet
    assert cursor.after is FROM_RECENT_ROWS
    cursor.start_pass(30.0)
    assert cursor.after is FROM_RECENT_ROWS  # not the walk that failed, again
    cursor.deleted_up_to("2026-12-04 10:00:00.5+00")
    cursor.start_pass(FULL_PASS_INTERVAL)
    assert cursor.after == "-infinity"
    cursor.failed()
    assert cursor.after == "2026-12-04 10:00:00.5+00"
    cursor.start_pass(FULL_PASS_INTERVAL + 30.0)
    assert cursor.after == "2026-12-04 10:00:00.5+00"
    cursor.deleted_up_to("2026-12-04 10:05:00+00")
    cursor.failed()  # a failure once the pass moved keeps its place
    assert cursor.after == "2026-12-04 10:05:00+00"
    cursor.start_pass(2 * FULL_PASS_INTERVAL)
    assert cursor.after == "-infinity"


def test_the_sweep_waits_while_the_horizon_is_held_and_runs_once_it_lets_go():
    assert sweep_now(0.0)
    assert sweep_now(SWEEP_INTERVAL - 1)
    assert not sweep_now(SWEEP_INTERVAL)
    assert not sweep_now(3600.0)
