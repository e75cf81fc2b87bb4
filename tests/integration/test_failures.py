"""Failing rows: backoff, the attempt cap, unpublishable rows, order around failures."""

from __future__ import annotations

from datetime import datetime
from itertools import pairwise

import psycopg
import pytest

from relay import app, natsinternals
from relay.backoff import row_retry_delay
from relay.config import Config
from tests.support import database
from tests.support.database import Event
from tests.support.relayproc import run_cli, wait_until
from tests.support.servers import SHARED_NATS_URL
from tests.support.stream import TestStream

pytestmark = pytest.mark.integration


class RefusingStream:
    """A second stream whose one subject refuses every event for its size (a
    max_msg_size smaller than any envelope): a refusal of the message, not the
    broker's state, so each counts an attempt. ``accept()`` lifts the limit.

    A full stream (max_msgs with discard new) is no vehicle for this: it is the
    broker's fault, which never counts (test_broker_faults.py)."""

    def __init__(self, stream: TestStream) -> None:
        self.stream = stream
        self.name = f"{stream.name}_SMALL"
        self.subject = f"{stream.prefix}_small.refused"
        stream.create(self.name, [self.subject], max_msg_size=64)

    def accept(self) -> None:
        self.stream.update(self.name, max_msg_size=-1)

    def delete(self) -> None:
        self.stream.delete(self.name)


@pytest.fixture
def refusing(stream):
    created = RefusingStream(stream)
    yield created
    created.delete()


def passes_after(relay, count: int) -> None:
    """Until the relay has woken by its poll ``count`` more times: each such pass
    read the table, so what a test expects it to leave alone has had its chances."""
    start = relay.metric("outbox_relay_wakeups_total", reason="poll")
    wait_until(
        lambda: relay.metric("outbox_relay_wakeups_total", reason="poll") >= start + count,
        message=f"{count} more polls",
    )


def failure_times(relay, row_id: str) -> list[tuple[float, int]]:
    """(log time, attempts) of each logged failed publish of one row."""
    out = []
    for record in relay.log_records():
        if record.get("row_id") == row_id and record.get("message", "").startswith(
            "publish failed"
        ):
            out.append((datetime.fromisoformat(record["time"]).timestamp(), record["attempts"]))
    return out


# Every change of a row's attempts, as the server saw it: the retry time the relay
# stored, and when it stored it (the same clock, in the same statement).
ATTEMPT_LOG = """
create table attempt_log (
  id uuid, attempts int, retry_at timestamptz, logged_at timestamptz default clock_timestamp());
create function log_attempt() returns trigger language plpgsql as $$
begin
  if new.attempts is distinct from old.attempts then
    insert into attempt_log (id, attempts, retry_at)
    values (new.id, new.attempts, new.relay_retry_at);
  end if;
  return new;
end $$;
create trigger log_attempt after update on outbox_events
  for each row execute function log_attempt();
"""


def test_failing_row_backs_off_exponentially_and_stops_at_the_cap(db_url, refusing, start_relay):
    database.execute(db_url, ATTEMPT_LOG)
    relay = start_relay(
        backoff_base="200ms", backoff_max="800ms", max_attempts=6, poll_interval="50ms"
    )
    event = Event(refusing.subject, "r")
    database.insert(db_url, [event])
    row_id = str(event.id)
    wait_until(
        lambda: database.rows_by_id(db_url)[row_id]["attempts"] == 6,
        timeout=20,
        message="row at the cap",
    )
    row = database.rows_by_id(db_url)[row_id]
    assert row["published_at"] is None
    assert row["holds_subject"]  # dead: waits for good, and holds its subject
    assert row["relay_last_error"].startswith("refused: JetStream refused the message")
    times = failure_times(relay, row_id)
    assert [attempts for _, attempts in times] == [1, 2, 3, 4, 5]  # the 6th logs as dead
    log = database.fetch(
        db_url,
        "select attempts, extract(epoch from nullif(retry_at, 'infinity') - logged_at)::float8, "
        "extract(epoch from logged_at)::float8, extract(epoch from retry_at)::float8 "
        "from attempt_log where id = %s order by logged_at",
        (row_id,),
    )
    assert [attempts for attempts, *_ in log] == [1, 2, 3, 4, 5, 6]
    for attempts, stored_delay, _, _ in log[:-1]:
        # The retry time is the mark's clock plus the delay; the trigger's clock reads
        # a moment after the mark's, so the stored delay is at most the expected one.
        expected = row_retry_delay(attempts, 0.2, 0.8)
        assert expected - 0.1 < stored_delay <= expected, (attempts, stored_delay)
    assert log[-1][1] is None  # at the cap: dead, retried never
    for (_, _, _, retry_at), (attempts, _, tried_at, _) in pairwise(log):
        # Never tried again before the stored retry time.
        assert tried_at > retry_at, (attempts, tried_at, retry_at)
    dead_lines = [
        r
        for r in relay.log_records()
        if r.get("row_id") == row_id and "attempt cap" in r.get("message", "")
    ]
    assert len(dead_lines) == 1
    assert (
        relay.metric(
            "outbox_relay_publish_failures_total", event_type=event.event_type, reason="refused"
        )
        == 6
    )
    # At the cap it is left alone: no more attempts, no more log lines, through many
    # passes of the relay over the table.
    passes_after(relay, 10)
    assert database.rows_by_id(db_url)[row_id]["attempts"] == 6
    assert len(failure_times(relay, row_id)) == 5
    wait_until(lambda: relay.metric("outbox_relay_dead_rows") == 1, message="dead gauge")


@pytest.mark.parametrize(
    ("event_type", "reason"),
    [
        ("", "invalid_subject"),
        ("has space", "invalid_subject"),
        ("orders.*", "invalid_subject"),
        ("orders.>", "invalid_subject"),
        ("orders..created", "invalid_subject"),
        (".orders", "invalid_subject"),
        ("$JS.API.STREAM.DELETE.X", "invalid_subject"),
    ],
)
def test_unpublishable_row_goes_dead_at_once_and_holds_its_subject(
    db_url, stream, start_relay, event_type, reason
):
    relay = start_relay(max_attempts=20, poll_interval="50ms", gauge_interval="200ms")
    bad = Event(event_type, "account-1")
    behind = [Event(stream.subject("ok"), "account-1", {"n": i}) for i in range(3)]
    other = Event(stream.subject("ok"), "account-2")
    database.insert_in_order(db_url, [bad, *behind, other], commit_each=True)
    [message] = wait_until(lambda: stream.read() or None, message="the other subject's row")
    assert message.msg_id == str(other.id)
    wait_until(
        lambda: (
            relay.metric("outbox_relay_dead_rows") == 1
            and relay.metric("outbox_relay_held_subjects") == 1
        ),
        message="gauges of the dead row and the subject it holds",
    )
    passes_after(relay, 5)
    assert [m.msg_id for m in stream.read()] == [str(other.id)]  # the rows behind wait
    row = database.rows_by_id(db_url)[str(bad.id)]
    assert row["published_at"] is None
    assert row["attempts"] == 20
    assert row["relay_dead_at"] is not None
    assert row["holds_subject"]
    assert row["relay_last_error"].startswith(reason)
    assert relay.metric("outbox_relay_dead_marked_total", event_type=event_type, reason=reason) == 1
    assert all(database.rows_by_id(db_url)[str(e.id)]["attempts"] == 0 for e in behind)


def test_payload_over_max_payload_goes_to_the_cap_at_once(db_url, stream, start_relay):
    relay = start_relay(max_attempts=20)
    huge = Event(stream.subject("huge"), "s", {"blob": "x" * (1024 * 1024)})
    fits = Event(stream.subject("huge"), "t", {"blob": "y" * 100_000})
    database.insert(db_url, [huge, fits])
    [message] = wait_until(lambda: stream.read() or None, message="the row that fits")
    assert message.msg_id == str(fits.id)
    row = database.rows_by_id(db_url)[str(huge.id)]
    assert row["attempts"] == 20
    assert "max_payload" in row["relay_last_error"]
    assert (
        relay.metric(
            "outbox_relay_dead_marked_total", event_type=huge.event_type, reason="too_large"
        )
        == 1
    )


def test_timestamps_python_cannot_hold_stop_only_their_own_rows(db_url, stream, start_relay):
    # Postgres accepts infinities and years past 9999; Python's datetime does not. A
    # claim that loaded them as datetimes failed as a whole, for every row behind them.
    relay = start_relay(max_attempts=20)
    rows = {
        "time infinity": ("'infinity'", "now()"),
        "time year 12000": ("'12000-01-01 00:00:00+00'", "now()"),
        "created_at -infinity": ("now()", "'-infinity'"),
        "created_at infinity": ("now()", "'infinity'"),
        "good 1": ("now()", "clock_timestamp()"),
        "good 2": ("now()", "clock_timestamp()"),
    }
    ids = {}
    with psycopg.connect(db_url) as conn:
        for label, (moment, created) in rows.items():
            ids[label] = conn.execute(
                "insert into outbox_events (id, event_type, source, subject, time, data, "
                f"created_at) values (gen_random_uuid(), %s, 't', %s, {moment}::timestamptz, "
                f"'{{}}', {created}::timestamptz) returning id::text",
                (stream.subject("times"), label),
            ).fetchone()[0]
        conn.commit()

    def four_delivered():
        got = {m.msg_id for m in stream.read()}
        return got if len(got) == 4 else None

    delivered = wait_until(four_delivered, message="the four rows with a valid time")
    assert delivered == {ids[k] for k in rows if not k.startswith("time ")}
    with psycopg.connect(db_url) as conn:
        dead = dict(
            conn.execute(
                "select id::text, relay_last_error from outbox_events "
                "where published_at is null and attempts = 20"
            ).fetchall()
        )
    assert dead.keys() == {ids["time infinity"], ids["time year 12000"]}
    assert all(error.startswith("invalid_time") for error in dead.values()), dead
    assert (
        relay.metric(
            "outbox_relay_dead_marked_total",
            event_type=stream.subject("times"),
            reason="invalid_time",
        )
        == 2
    )


def test_failing_row_holds_its_subject_back_and_nothing_else(db_url, stream, refusing, start_relay):
    start_relay(backoff_base="200ms", backoff_max="400ms", max_attempts=1000, poll_interval="50ms")
    first = Event(stream.subject("ok"), "account-1", {"n": 1})
    failing = Event(refusing.subject, "account-1", {"n": 2})
    after = Event(stream.subject("ok"), "account-1", {"n": 3})
    other = [Event(stream.subject("ok"), "account-2", {"n": i}) for i in range(5)]
    database.insert_in_order(db_url, [first, failing, after, *other], commit_each=True)
    wait_until(lambda: len(stream.read()) == 6, message="first row and the other subject")
    wait_until(  # several backoff rounds of the failing row
        lambda: database.rows_by_id(db_url)[str(failing.id)]["attempts"] >= 3,
        message="retries of the failing row",
    )
    ids = [m.msg_id for m in stream.read()]
    assert str(after.id) not in ids  # waits behind the failing row
    assert set(ids) == {str(first.id), *(str(e.id) for e in other)}
    rows = database.rows_by_id(db_url)
    assert rows[str(failing.id)]["attempts"] >= 2
    assert rows[str(after.id)]["attempts"] == 0  # never tried, so never failed
    # The broker takes it again: the failing row goes, then the one behind it.
    refusing.accept()
    wait_until(lambda: database.unpublished_count(db_url) == 0, message="drain")
    # Stored in that order (one server clock for both streams): the row behind was
    # sent only once the failing row's ack was in.
    stored = {m.msg_id: m.stored_at for m in stream.read() + stream.read(refusing.name)}
    assert stored[str(failing.id)] < stored[str(after.id)]


def test_failing_row_holds_its_subject_in_a_deep_backlog(db_url, stream, refusing, start_relay):
    # The same, drained in small batches with a second batch in flight: the batch
    # claimed beside the one holding the failing row has later rows of its subject,
    # and must not send them when the failing row's batch does not settle it.
    events = []
    for i in range(300):
        if i == 7:
            events.append(Event(refusing.subject, "account-1", {"n": i}))
        else:
            events.append(Event(stream.subject("ok"), f"account-{i % 4}", {"n": i}))
    failing = events[7]
    behind = [e for e in events[8:] if e.subject == "account-1"]
    database.insert_in_order(db_url, events)
    start_relay(
        batch_size=10, backoff_base="200ms", backoff_max="400ms", max_attempts=1000,
        poll_interval="50ms",
    )  # fmt: skip
    others = len(events) - 1 - len(behind)
    wait_until(lambda: len(stream.read()) == others, message="every other subject")
    wait_until(  # several backoff rounds of the failing row
        lambda: database.rows_by_id(db_url)[str(failing.id)]["attempts"] >= 3,
        message="retries of the failing row",
    )
    assert {m.msg_id for m in stream.read()} == {
        str(e.id) for e in events if e is not failing and e not in behind
    }
    refusing.accept()
    wait_until(lambda: database.unpublished_count(db_url) == 0, message="drain")
    stored = {m.msg_id: m.stored_at for m in stream.read() + stream.read(refusing.name)}
    account_1 = sorted((e for e in events if e.subject == "account-1"), key=lambda e: e.data["n"])
    times = [stored[str(e.id)] for e in account_1]
    assert times == sorted(times)


def test_a_dead_row_holds_its_subject_until_requeued_then_goes_first(
    db_url, stream, refusing, start_relay
):
    relay = start_relay(
        backoff_base="100ms", backoff_max="100ms", max_attempts=3, poll_interval="50ms"
    )
    failing = Event(refusing.subject, "account-1", {"n": 1})
    behind = [Event(stream.subject("ok"), "account-1", {"n": n}) for n in (2, 3)]
    other = Event(stream.subject("ok"), "account-2", {"n": 4})
    database.insert_in_order(db_url, [failing, *behind, other], commit_each=True)
    wait_until(
        lambda: database.rows_by_id(db_url)[str(failing.id)]["attempts"] == 3, message="dead"
    )
    wait_until(lambda: len(stream.read()) == 1, message="the other subject's row")
    passes_after(relay, 5)
    assert [m.msg_id for m in stream.read()] == [str(other.id)]  # on every pass, they wait
    status = run_cli(db_url, "status")
    assert "held subjects" in status
    assert "account-1" in status
    assert str(failing.id) in status
    # The cause fixed, the operator requeues the dead row: it goes first, then the
    # rows it held, in order.
    refusing.accept()
    run_cli(db_url, "requeue", "--id", str(failing.id), "--execute")
    wait_until(lambda: database.unpublished_count(db_url) == 0, message="drain")
    stored = {m.msg_id: m.stored_at for m in stream.read() + stream.read(refusing.name)}
    order = [failing, *behind]
    times = [stored[str(e.id)] for e in order]
    assert times == sorted(times)


def test_skip_keeps_a_dead_row_and_releases_its_subject(db_url, stream, start_relay):
    relay = start_relay(max_attempts=20, poll_interval="50ms", gauge_interval="200ms")
    bad = Event("orders.*", "account-1")  # never publishable
    behind = [Event(stream.subject("ok"), "account-1", {"n": n}) for n in range(3)]
    database.insert_in_order(db_url, [bad, *behind], commit_each=True)
    wait_until(lambda: relay.metric("outbox_relay_held_subjects") == 1, message="held")
    dry_run = run_cli(db_url, "skip", "--id", str(bad.id))
    assert "1 rows would be skipped" in dry_run
    passes_after(relay, 3)
    assert stream.read() == []
    run_cli(db_url, "skip", "--id", str(bad.id), "--execute")
    wait_until(lambda: len(stream.read()) == 3, message="the rows it held")
    assert [m.msg_id for m in stream.read()] == [str(e.id) for e in behind]
    row = database.rows_by_id(db_url)[str(bad.id)]
    assert row["published_at"] is None  # kept, never marked published
    assert row["relay_skipped_at"] is not None
    assert not row["holds_subject"]
    wait_until(
        lambda: (
            relay.metric("outbox_relay_skipped_rows") == 1
            and relay.metric("outbox_relay_dead_rows") == 0
            and relay.metric("outbox_relay_held_subjects") == 0
        ),
        message="gauges",
    )
    assert "1 skipped" in run_cli(db_url, "status")
    # `requeue --all-dead` leaves it alone; only its id brings it back.
    assert "0 rows would be requeued" in run_cli(db_url, "requeue", "--all-dead")
    assert "was skipped" in run_cli(db_url, "requeue", "--id", str(bad.id))
    # Skipping again, or skipping a published row, changes nothing.
    again = run_cli(db_url, "skip", "--id", str(bad.id), "--id", str(behind[0].id), "--execute")
    assert "skipped 0 rows" in again


def test_backoff_holds_across_a_restart(db_url, refusing, start_relay):
    first = start_relay(
        backoff_base="20s", backoff_max="20s", max_attempts=10, poll_interval="50ms"
    )
    event = Event(refusing.subject, "x")
    database.insert(db_url, [event])
    wait_until(
        lambda: database.rows_by_id(db_url)[str(event.id)]["attempts"] == 1, message="first failure"
    )
    assert first.stop() == 0
    refusing.accept()  # it would succeed now, if it were tried
    second = start_relay(
        backoff_base="20s", backoff_max="20s", max_attempts=10, poll_interval="50ms"
    )
    passes_after(second, 10)
    row = database.rows_by_id(db_url)[str(event.id)]
    assert row["attempts"] == 1
    assert row["published_at"] is None  # still waiting out the 20 s from before
    database.execute(db_url, "update outbox_events set relay_retry_at = now()")
    wait_until(lambda: database.unpublished_count(db_url) == 0, message="retry after backoff")


def test_a_nats_py_without_its_write_queue_stops_the_start_in_one_line(db_url, monkeypatch, caplog):
    """The check of nats-py's internals runs in a nursery task, after connect: its
    SetupError reaches the command line as one line and exit status 2, not as an
    exception group's traceback."""

    def renamed_queue(nc: object) -> None:
        natsinternals.check(object())  # type: ignore[arg-type]  # a client with no queue

    monkeypatch.setattr("relay.broker.check_nats_internals", renamed_queue)
    config = Config(database_url=db_url, nats_urls=(SHARED_NATS_URL,), metrics_port=0)
    assert app.run(config) == 2
    failures = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert failures == [
        "cannot start: this nats-py has no _pending write queue, _pending_data_size or "
        "_transport: install a release pyproject.toml allows (the relay writes through them)"
    ]
