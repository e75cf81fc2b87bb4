"""A time-partitioned outbox table (`install --partitions`), against real Postgres
and NATS: installed as the contract's table partitioned on created_at, refused over
a plain table, published in order, kept partitions ahead by the relay, and retired
by retention, which drops expired partitions whose rows are all spent, keeps one
that holds a row still to publish, and never makes producers wait behind an idle
writer."""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.sql import Literal

from relay.claimstart import MIN_SEQ, StartKey
from relay.config import Config
from relay.database import CLAIM_STATEMENT, partition_creation, partition_layout
from relay.partitions import NewPartition, partition_name, reach
from relay.sqlfiles import (
    Names,
    claim_execution,
    claim_parameters,
    claim_preparation,
    partition_statement,
)
from tests.support import database
from tests.support.database import Event, relay_session
from tests.support.relayproc import RelayProcess, cli, run_cli, wait_until
from tests.support.servers import SHARED_NATS_URL, SHARED_PG_URL

pytestmark = pytest.mark.integration

NAMES = Names.for_config(Config())
FAST = {"poll_interval": "200ms", "backoff_base": "200ms", "backoff_max": "1s"}
MINUTE = 60.0


@pytest.fixture
def partitioned_url() -> Iterator[str]:
    """A fresh database whose outbox table is partitioned by the minute."""
    url = database.create_database(SHARED_PG_URL)
    run_cli(url, "install", "--partitions", "1min", "--partitions-ahead", "3min")
    yield url
    database.drop_database(SHARED_PG_URL, url)


def start(relays: list[RelayProcess], url: str, **settings: Any) -> RelayProcess:
    relay = RelayProcess(url, SHARED_NATS_URL, **FAST, **settings)
    relays.append(relay)
    return relay.start()


def layout(url: str):
    with psycopg.connect(url) as conn:
        kind = conn.execute(partition_statement(NAMES, "layout")).fetchone()
        rows = conn.execute(partition_statement(NAMES, "partitions")).fetchall()
        now = conn.execute("select extract(epoch from statement_timestamp())::float8").fetchone()
    return partition_layout(kind, rows, now)


def partition_names(url: str) -> set[str]:
    return {p.name for p in layout(url).partitions}


def add_past_partition(url: str, minutes_ago: int) -> str:
    """A partition of the minute that began ``minutes_ago`` minutes before this one."""
    start_at = (math.floor(time.time() / MINUTE) - minutes_ago) * MINUTE
    partition = NewPartition(partition_name(NAMES.base, start_at), start_at, start_at + MINUTE)
    with psycopg.connect(url) as conn:
        for statement in partition_creation(NAMES, partition):
            conn.execute(statement)
    return partition.name


def partition_bounds(conn: psycopg.Connection[Any], name: str) -> tuple[str, str]:
    [row] = conn.execute(
        "select b[1], b[2] from pg_class c, regexp_match(pg_get_expr(c.relpartbound, c.oid), "
        "'FROM \\(''([^'']*)''\\) TO \\(''([^'']*)''\\)') b where c.relname = %s",
        (name,),
    ).fetchall()
    return row[0], row[1]


def insert_into_partition(url: str, name: str, *, published: bool, attempts: int = 0) -> str:
    """A row whose created_at falls in partition ``name`` (its first second)."""
    row_id = str(uuid.uuid4())
    with psycopg.connect(url) as conn:
        conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, "
            "created_at, published_at, attempts) values (%s, 'old.event', 't', %s, now(), "
            "'{}', %s::timestamptz + interval '1 second', "
            "case when %s then now() end, %s)",
            (row_id, f"subject-{row_id}", partition_bounds(conn, name)[0], published, attempts),
        )
    return row_id


def columns(url: str, schema: str) -> list[tuple[Any, ...]]:
    """The outbox table's columns in ``schema`` (a sequence default without its schema)."""
    return database.fetch(
        url,
        "select column_name, data_type, is_nullable, "
        "replace(column_default, %s, '') from information_schema.columns "
        "where table_schema = %s and table_name = 'outbox_events' order by ordinal_position",
        (f"{schema}.", schema),
    )


def test_install_partitions_creates_the_contract_table_partitioned_with_partitions_ahead(
    partitioned_url,
):
    found = layout(partitioned_url)
    assert (found.kind, found.managed) == ("p", True)
    assert reach(found.partitions, found.now) >= 3 * MINUTE - 5
    assert all(p.end - p.start == MINUTE for p in found.partitions)
    # The same columns as the plain table an install makes, the relay's included.
    database.execute(partitioned_url, "create schema plain")
    database.install(partitioned_url, Config(table=("plain", "outbox_events")))
    assert columns(partitioned_url, "public") == columns(partitioned_url, "plain")
    [(key,)] = database.fetch(
        partitioned_url,
        "select pg_get_constraintdef(oid) from pg_constraint "
        "where conrelid = 'public.outbox_events'::regclass and contype = 'p'",
    )
    assert key == "PRIMARY KEY (id, created_at)"
    # The relay's triggers fire ALWAYS on every partition, as on the table.
    states = database.fetch(
        partitioned_url,
        "select c.relname, t.tgenabled from pg_trigger t join pg_class c on c.oid = t.tgrelid "
        "join pg_inherits i on i.inhrelid = c.oid where not t.tgisinternal",
    )
    assert len(states) == 2 * len(found.partitions)
    assert {state for _, state in states} == {"A"}
    # Installing again changes nothing; another period is refused in one line.
    run_cli(partitioned_url, "install", "--partitions", "1min", "--partitions-ahead", "3min")
    assert {p.name for p in layout(partitioned_url).partitions} >= {
        p.name for p in found.partitions if p.end > time.time()
    }
    refused = cli(partitioned_url, "install", "--partitions", "1h")
    assert refused.returncode == 1
    [line] = refused.stderr.strip().splitlines()
    assert "outbox_events is partitioned by 1m, not 1h" in line


def test_install_partitions_refuses_a_plain_table(db_url):
    refused = cli(db_url, "install", "--partitions", "1d")
    assert refused.returncode == 1
    [line] = refused.stderr.strip().splitlines()
    assert "outbox_events is a plain table" in line
    assert "docs/partitions.md" in line
    assert layout(db_url).kind == "r"


def test_the_relay_publishes_a_partitioned_table_in_order_and_keeps_partitions_ahead(
    partitioned_url, stream, relays
):
    relay = start(relays, partitioned_url, partitions_ahead="6min")
    events = [
        Event(stream.subject(f"order.{n % 3}"), f"order-{n % 5}", {"n": n}) for n in range(60)
    ]
    database.insert_in_order(partitioned_url, events[:30], commit_each=True)
    database.insert(partitioned_url, events[30:])
    wait_until(
        lambda: database.unpublished_count(partitioned_url) == 0,
        message="every row published",
    )
    stored = [m.envelope["data"]["n"] for m in stream.read_all()]
    for entity in range(5):
        mine = [n for n in stored if n % 5 == entity]
        assert mine == sorted(mine), f"order-{entity} out of order: {mine}"
    assert sorted(stored) == list(range(60))
    wait_until(
        lambda: relay.metric("outbox_relay_partitions_ahead_seconds") >= 5 * MINUTE,
        message="partitions created six minutes ahead",
    )
    assert relay.metric("outbox_relay_partitions_created_total") >= 2
    assert relay.metric("outbox_relay_partitions_ahead_target_seconds") == 6 * MINUTE


def test_retention_drops_spent_partitions_and_keeps_one_that_holds_a_row(
    partitioned_url, stream, relays
):
    spent = [add_past_partition(partitioned_url, minutes) for minutes in (10, 9)]
    held = add_past_partition(partitioned_url, 8)
    for name in spent:
        insert_into_partition(partitioned_url, name, published=True)
    dead = insert_into_partition(partitioned_url, held, published=False, attempts=20)
    fresh = Event(stream.subject("fresh"), "fresh-1")
    relay = start(relays, partitioned_url, retention="2min", retention_interval="200ms")
    database.insert(partitioned_url, [fresh])
    wait_until(
        lambda: not (set(spent) & partition_names(partitioned_url)),
        message="the spent partitions dropped",
    )
    wait_until(lambda: relay.metric("outbox_relay_partitions_held") == 1, message="one kept")
    assert held in partition_names(partitioned_url)
    assert dead in relay.logs()
    assert relay.metric("outbox_relay_partitions_dropped_total") == 2
    wait_until(lambda: database.unpublished_count(partitioned_url) == 1, message="fresh published")
    # Rows are never deleted: the fresh row stays, published, in its partition.
    assert relay.metric("outbox_relay_retention_deleted_total") == 0
    assert database.rows_by_id(partitioned_url)[str(fresh.id)]["published_at"] is not None
    # Given up on, the row no longer holds its partition.
    run_cli(partitioned_url, "skip", "--id", dead, "--execute")
    wait_until(
        lambda: held not in partition_names(partitioned_url), message="the held partition dropped"
    )
    wait_until(lambda: relay.metric("outbox_relay_partitions_held") == 0, message="none kept")


def test_retention_waits_for_an_idle_writer_without_making_producers_wait(
    partitioned_url, stream, relays
):
    expired = add_past_partition(partitioned_url, 10)
    insert_into_partition(partitioned_url, expired, published=True)
    # A writer idle in its transaction: a detach must wait for it to end.
    writer = psycopg.connect(partitioned_url)
    try:
        writer.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data) "
            "values (gen_random_uuid(), %s, 't', 'idle-writer', now(), '{}')",
            (stream.subject("idle"),),
        )
        relay = start(relays, partitioned_url, retention="2min", retention_interval="200ms")
        producers = psycopg.connect(partitioned_url, autocommit=True)
        # Queued behind a lock the relay waits for, an insert would fail here.
        producers.execute("set lock_timeout = '1s'")
        inserted = 0

        def detach_timed_out() -> bool:
            nonlocal inserted
            producers.execute(
                "insert into outbox_events (id, event_type, source, subject, time, data) "
                "values (gen_random_uuid(), %s, 't', %s, now(), '{}')",
                (stream.subject("busy"), f"busy-{inserted}"),
            )
            inserted += 1
            return relay.metric("outbox_relay_database_errors_total", task="retention") >= 1

        wait_until(detach_timed_out, timeout=30, interval=0.05, message="a detach timed out")
        assert "lock timeout" in relay.logs()
        assert expired in {p.name for p in layout(partitioned_url).partitions}
        writer.commit()
        wait_until(
            lambda: expired not in partition_names(partitioned_url),
            timeout=30,
            message="the partition dropped once the writer ended",
        )
        wait_until(
            lambda: database.unpublished_count(partitioned_url) == 0,
            message="every producer's row published",
        )
        assert inserted > 1
        producers.close()
    finally:
        writer.close()


def partitioned_claim_plan(url: str, start_at: str) -> str:
    """EXPLAIN ANALYZE of the claim as the relay runs it (prepared, on a connection
    with its session settings), from the start key ``start_at``, rolled back."""
    start = StartKey(start_at, MIN_SEQ, start_at)
    with relay_session(url) as conn:
        conn.autocommit = True
        conn.execute(claim_preparation(NAMES, CLAIM_STATEMENT))
        # Past the five custom plans, onto the generic plan the relay keeps using.
        for _ in range(6):
            conn.execute("begin")
            conn.execute(claim_execution(CLAIM_STATEMENT, 500, 20, start))
            conn.execute("rollback")
        conn.execute("begin")
        values = claim_parameters(500, 20, start).values()
        explain = psycopg.sql.SQL("explain (analyze, timing off, costs off) execute {} ({})")
        lines = conn.execute(
            explain.format(CLAIM_STATEMENT, psycopg.sql.SQL(", ").join(map(Literal, values)))
        ).fetchall()
        conn.execute("rollback")
    return "\n".join(line for (line,) in lines)


@pytest.mark.parametrize("statistics", ["stale", "fresh"])
def test_the_claim_walks_only_the_partitions_from_its_start_key(partitioned_url, statistics):
    # Twelve spent minutes behind the start key, and a burst of 20,000 rows in this
    # minute's partition. Each walk must read about a batch, in order (no sort of
    # the burst), and leave the partitions before the start key unread.
    old = [add_past_partition(partitioned_url, minutes) for minutes in range(13, 1, -1)]
    with psycopg.connect(partitioned_url, autocommit=True) as conn:
        for name in old:
            conn.execute(
                "insert into outbox_events (id, event_type, source, subject, time, data, "
                "created_at, published_at) select gen_random_uuid(), 'a.b', 's', 'e' || g, "
                "now(), '{}', %s::timestamptz + g * interval '1 ms', now() "
                "from generate_series(1, 2000) g",
                (partition_bounds(conn, name)[0],),
            )
        if statistics == "stale":
            conn.execute("analyze outbox_events")
        [(start_at,)] = conn.execute("select now()::text").fetchall()
        conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, created_at) "
            "select gen_random_uuid(), 'a.b', 's', 'e' || (g % 1000), now(), '{}', "
            "clock_timestamp() from generate_series(1, 20000) g"
        )
        if statistics == "fresh":
            conn.execute("analyze outbox_events")
    plan = partitioned_claim_plan(partitioned_url, start_at)
    walked = 0
    for line in plan.splitlines():
        found = re.search(
            r"on (outbox_events_p\w+) (\w+)_\d+ \(actual rows=(\d+) loops=(\d+)\)", line
        )
        # Two lookups are in every partition by design, each one index descent: a
        # late row (alias l) and a row of the subject waiting (b) may be anywhere.
        if found and found.group(2) not in ("l", "b"):
            walked += 1
            assert found.group(1) not in old, f"read before the start key: {line}\n{plan}"
        if found:
            assert int(found.group(3)) * int(found.group(4)) <= 2 * 500, f"{line}\n{plan}"
        sorted_rows = re.search(r"Sort \(actual rows=(\d+)", line)
        if sorted_rows:
            assert int(sorted_rows.group(1)) <= 500, f"{line}\n{plan}"
        removed = re.search(r"Rows Removed by Filter: (\d+)", line)
        if removed:
            assert int(removed.group(1)) <= 2 * 500, f"{line}\n{plan}"
    assert walked, plan
