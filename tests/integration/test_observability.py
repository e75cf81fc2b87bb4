"""Metrics, readiness, logs and the operator commands against real servers."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from relay.config import Config
from relay.sqlfiles import Names, query
from tests.integration.test_failures import RefusingStream
from tests.support import database
from tests.support.database import Event
from tests.support.relayproc import cli, wait_until
from tests.support.servers import throwaway_nats, throwaway_postgres
from tests.support.stream import TestStream

pytestmark = pytest.mark.integration


def test_counters_and_gauges_follow_the_table(db_url, stream, start_relay):
    refusing = RefusingStream(stream)
    try:
        relay = start_relay(
            gauge_interval="100ms", max_attempts=50, backoff_base="30s", backoff_max="30s"
        )
        good = [Event(stream.subject("counted"), f"c{i}") for i in range(25)]
        stuck = Event(refusing.subject, "stuck")
        dead = Event("", "dead")
        database.insert(db_url, [*good, stuck, dead])
        wait_until(lambda: len(stream.read()) == 25, message="good rows")

        def gauges():
            m = relay.metrics()
            return (m.get("outbox_relay_unpublished_rows"), m.get("outbox_relay_dead_rows"))

        wait_until(lambda: gauges() == (2.0, 1.0), message="backlog gauges")
        m = relay.metrics()
        assert m[f'outbox_relay_published_total{{event_type="{stream.subject("counted")}"}}'] == 25
        assert (
            m[
                f'outbox_relay_publish_failures_total{{event_type="{refusing.subject}",reason="refused"}}'
            ]
            == 1
        )
        assert m['outbox_relay_publish_failures_total{event_type="",reason="invalid_subject"}'] == 1
        assert m["outbox_relay_publish_latency_seconds_count"] == 25
        assert m["outbox_relay_batch_size_count"] >= 1
        # The oldest live row is the one in backoff (the dead one does not count here).
        wait_until(
            lambda: relay.metric("outbox_relay_oldest_unpublished_age_seconds") > 0.2,
            message="age grows",
        )
        assert m["outbox_relay_up"] == 1
        assert m["outbox_relay_ready"] == 1
        assert m["outbox_relay_listen_connected"] == 1
        assert m["outbox_relay_nats_connected"] == 1
        assert m['outbox_relay_build_info{version="0.1.0"}'] == 1
        failure = next(r for r in relay.log_records() if r.get("row_id") == str(stuck.id))
        assert (failure["event_type"], failure["reason"], failure["level"]) == (
            refusing.subject,
            "refused",
            "warning",
        )
    finally:
        refusing.delete()


def test_each_relay_counts_the_relays_sharing_its_table(start_relay):
    """Each holds the presence lock on its LISTEN connection while it is connected;
    the gauge counts the holders, and a relay that stops is no longer counted."""
    first = start_relay(gauge_interval="100ms")
    second = start_relay(gauge_interval="100ms")
    for relay in (first, second):
        wait_until(lambda r=relay: r.metric("outbox_relay_relays") == 2, message="two relays")
    second.stop()
    wait_until(lambda: first.metric("outbox_relay_relays") == 1, message="one relay")


def test_readiness_follows_nats_and_postgres(start_relay):
    with throwaway_nats() as nats, throwaway_postgres() as pg:
        database.install(pg.url)
        relay = start_relay(database_url=pg.url, nats_url=nats.url, poll_interval="200ms")
        assert relay.get("/readyz") == (200, "ready\n")
        nats.kill()
        wait_until(
            lambda: relay.get("/readyz") == (503, "not ready: NATS is not connected\n"),
            message="not ready without NATS",
        )
        assert relay.metric("outbox_relay_nats_connected") == 0
        assert relay.metric("outbox_relay_ready") == 0
        assert relay.get("/healthz")[0] == 200  # alive all the same
        nats.start()
        relay.wait_ready()
        assert relay.metric("outbox_relay_nats_connected") == 1
        pg.stop("fast")
        wait_until(lambda: relay.get("/readyz")[0] == 503, message="not ready without Postgres")
        assert relay.get("/readyz")[1] in (
            "not ready: LISTEN connection is down\n",
            "not ready: Postgres is unreachable\n",
        )
        assert relay.metric("outbox_relay_listen_connected") == 0
        pg.start()
        relay.wait_ready(timeout=30)
        event = Event("ready.check", "x")
        stream = TestStream(nats.url)
        stream.create("READY", ["ready.>"])
        database.insert(pg.url, [event])
        wait_until(lambda: stream.read("READY"), message="delivery after both came back")


def test_streams_that_forget_ids_before_a_retry_are_named_at_start(start_relay):
    # A retried row comes back after up to --backoff-max + --publish-timeout (5m5s
    # at the defaults): a stream that has forgotten its id by then stores it twice.
    def checked(relay) -> list[str]:
        """The relay's lines about duplicate windows, once its check has ended."""

        def lines() -> list[str] | None:
            found = [
                r["message"]
                for r in relay.log_records()
                if "duplicate window" in r["message"] or "keeps message ids" in r["message"]
            ]
            return found if any(m.startswith("checked the duplicate") for m in found) else None

        return wait_until(lines, message="the duplicate windows checked")

    with throwaway_nats() as nats:
        stream = TestStream(nats.url, duplicate_window=1200.0)
        stream.create("SHORTWINDOW", ["short.>"])  # the server's default: 2 minutes
        relay = start_relay(nats_url=nats.url)
        lines = checked(relay)
        assert "checked the duplicate windows of 2 streams: 1 shorter than 305s" in lines
        assert any(
            line.startswith(
                "stream SHORTWINDOW keeps message ids for 2m, less than --backoff-max + "
                "--publish-timeout (305s)"
            )
            for line in lines
        ), lines
        assert not any(stream.name in line for line in lines), lines
        assert relay.metric("outbox_relay_streams_short_duplicate_window") == 1
        relay.stop()
        calm = start_relay(nats_url=nats.url, backoff_max="60s")
        assert checked(calm) == ["checked the duplicate windows of 2 streams: 0 shorter than 65s"]
        assert calm.metric("outbox_relay_streams_short_duplicate_window") == 0


@pytest.fixture
def stuck_rows(db_url):
    """Two dead rows of one type, one of another, one backing off, one published."""
    rows = {
        "dead_a1": ("orders.created", 20, None),
        "dead_a2": ("orders.created", 20, None),
        "dead_b": ("bad type", 20, None),
        "backing_off": ("orders.created", 3, "now() + interval '1 hour'"),
        "published": ("orders.created", 0, None),
    }
    ids = {}
    with psycopg.connect(db_url) as conn:
        for name, (event_type, attempts, retry) in rows.items():
            ids[name] = uuid.uuid4()
            conn.execute(
                "insert into outbox_events (id, event_type, source, subject, time, data, "
                "attempts, relay_retry_at, relay_last_error, published_at, created_at) "
                f"values (%s, %s, 't', %s, now(), '{{}}', %s, {retry or 'null'}, %s, "
                f"{'now()' if name == 'published' else 'null'}, now() - interval '90 seconds')",
                (ids[name], event_type, name, attempts, f"other: broke {name}"),
            )
    return ids


def test_status_table_and_json(db_url, stuck_rows):
    result = cli(db_url, "status")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "EVENT",
        "TYPE",
        "UNPUBLISHED",
        "DEAD",
        "SKIPPED",
        "BACKING",
        "OFF",
        "OLDEST",
        "MAX",
        "ATTEMPTS",
    ]
    orders = next(line for line in lines if line.startswith("orders.created"))
    assert orders.split()[1:5] == ["3", "2", "0", "1"]
    assert orders.split()[6] == "20/20"
    assert "4 unpublished, 3 dead" in result.stdout
    as_json = json.loads(cli(db_url, "status", "--json").stdout)
    by_type = {entry["event_type"]: entry for entry in as_json["backlog"]}
    assert by_type["orders.created"]["unpublished"] == 3
    assert by_type["orders.created"]["dead"] == 2
    assert by_type["bad type"]["dead"] == 1
    assert by_type["orders.created"]["oldest_age_seconds"] >= 90
    assert by_type["bad type"]["last_error"] == "other: broke dead_b"
    # Each dead row holds its subject (here one row each, nothing behind them).
    held = {entry["subject"]: entry for entry in as_json["held"]}
    assert held.keys() == {"dead_a1", "dead_a2", "dead_b"}
    assert held["dead_b"]["first_dead_id"] == str(stuck_rows["dead_b"])
    assert held["dead_b"]["waiting"] == 0
    assert "held subjects" in result.stdout


def test_requeue_is_a_dry_run_until_executed(db_url, stuck_rows):
    before = database.rows_by_id(db_url)
    result = cli(db_url, "requeue", "--all-dead")
    assert result.returncode == 0, result.stderr
    assert "3 rows would be requeued (dry run: add --execute)" in result.stdout
    assert database.rows_by_id(db_url) == before


def test_requeue_by_event_type_resets_only_those_dead_rows(db_url, stuck_rows):
    result = cli(db_url, "requeue", "--event-type", "orders.created", "--execute")
    assert "requeued 2 rows" in result.stdout, result.stdout + result.stderr
    rows = database.rows_by_id(db_url)
    for name in ("dead_a1", "dead_a2"):
        row = rows[str(stuck_rows[name])]
        assert (row["attempts"], row["relay_retry_at"], row["relay_last_error"]) == (0, None, None)
        assert row["relay_dead_at"] is None
    assert rows[str(stuck_rows["dead_b"])]["attempts"] == 20
    assert rows[str(stuck_rows["backing_off"])]["attempts"] == 3


def test_requeue_by_id_and_all_dead(db_url, stuck_rows):
    result = cli(
        db_url,
        "requeue",
        "--id",
        str(stuck_rows["backing_off"]),
        "--id",
        str(stuck_rows["published"]),
        "--execute",
    )
    assert "requeued 1 rows" in result.stdout  # a published row is never touched
    row = database.rows_by_id(db_url)[str(stuck_rows["backing_off"])]
    assert (row["attempts"], row["relay_retry_at"]) == (0, None)
    assert "requeued 3 rows" in cli(db_url, "requeue", "--all-dead", "--execute").stdout
    assert cli(db_url, "requeue").returncode == 2
    assert cli(db_url, "requeue", "--id", "not-a-uuid").returncode == 2


def test_requeued_rows_are_published(db_url, stream, start_relay):
    # Left at the cap without relay_dead_at (by a relay from before it, or by hand),
    # or dead as a version from before dead rows held their subjects left it
    # (relay_retry_at null): the relay marks both dead when it starts, holding their
    # subjects, and requeue brings them back, each before the row it held.
    dead = Event(stream.subject("again"), "x", {"n": 1})
    earlier_dead = Event(stream.subject("again"), "y", {"n": 1})
    behind = Event(stream.subject("again"), "y", {"n": 2})
    database.insert_in_order(db_url, [dead, earlier_dead, behind], commit_each=True)
    database.execute(
        db_url,
        "update outbox_events set attempts = 20 where id = %s",
        (dead.id,),
    )
    database.execute(
        db_url,
        "update outbox_events set attempts = 3, relay_dead_at = now() where id = %s",
        (earlier_dead.id,),
    )
    relay = start_relay(poll_interval="30s", max_attempts=20)
    rows = database.rows_by_id(db_url)
    assert rows[str(dead.id)]["relay_dead_at"] is not None
    assert rows[str(dead.id)]["holds_subject"]
    assert rows[str(earlier_dead.id)]["holds_subject"]
    assert any(
        "2 rows of outbox_events were at the attempt cap (20)" in record["message"]
        for record in relay.log_records()
    ), relay.logs()
    wait_until(lambda: relay.metric("outbox_relay_dead_rows") == 2, message="dead gauge")
    assert relay.metric("outbox_relay_held_subjects") == 2
    assert stream.read() == []  # the row behind waits (the relay started with it there)
    assert "requeued 2 rows" in cli(db_url, "requeue", "--all-dead", "--execute").stdout
    wait_until(lambda: len(stream.read()) == 3, message="requeued rows (woken by requeue)")
    order = [m.msg_id for m in stream.read() if m.msg_id != str(dead.id)]
    assert order == [str(earlier_dead.id), str(behind.id)]
    assert database.rows_by_id(db_url)[str(dead.id)]["relay_dead_at"] is None


def test_gauge_query_reads_only_the_partial_index(db_url):
    with psycopg.connect(db_url) as conn:
        conn.execute("""
            insert into outbox_events (id, event_type, source, subject, time, data, created_at,
                                       published_at)
            select gen_random_uuid(), 'a.b', 's', 'e', now(), '{}',
                   now() - (g || ' seconds')::interval, case when g > 1000 then now() end
              from generate_series(1, 200000) g""")
        conn.commit()
        conn.execute("analyze outbox_events")
        names = Names.for_config(Config())
        for name in ("backlog", "status"):
            plan = "\n".join(
                row[0]
                for row in conn.execute(
                    psycopg.sql.SQL("explain ") + query(names, name), {"max_attempts": 20}
                )
            )
            assert "outbox_events_unpublished_idx" in plan, plan
            assert "Seq Scan" not in plan, plan
