"""A time-partitioned outbox table (`install --partitions`), against real Postgres
and NATS: installed as the contract's table partitioned on created_at, refused over
a plain table, published in order, kept partitions ahead by the relay, and retired
by retention, which drops expired partitions whose rows are all spent, keeps one
that holds a row still to publish, and never makes producers wait behind an idle
writer."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.sql import Literal

from relay.claimstart import (
    CLAIM_REACH_MARGIN_SECONDS,
    LATE_INSERT_SECONDS,
    MIN_SEQ,
    StartKey,
)
from relay.config import Config
from relay.database import (
    GENERIC_PLAN,
    LAYOUT_CLOCK,
    PARTITIONED_CLAIM_STATEMENT,
    partition_creation,
    partition_layout,
)
from relay.partitions import (
    LOCKS_A_PARTITION,
    MAX_PARTITIONS_AHEAD,
    NewPartition,
    partition_name,
    reach,
)
from relay.sqlfiles import (
    Names,
    claim_execution,
    claim_parameters,
    claim_preparation,
    claim_with_values,
    install_script,
    migration_statements,
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


# A relay retiring partitions of a minute quickly, keeping them as far ahead as
# partitioned_url installs them (the default, 3 days, would have it create 4,320
# partitions meanwhile, each ATTACH conflicting with a DETACH's first step).
RETIRING = {"retention": "2min", "retention_interval": "200ms", "partitions_ahead": "3min"}


def start(relays: list[RelayProcess], url: str, **settings: Any) -> RelayProcess:
    relay = RelayProcess(url, SHARED_NATS_URL, **FAST, **settings)
    relays.append(relay)
    return relay.start()


def layout(url: str):
    with psycopg.connect(url) as conn:
        kind = conn.execute(partition_statement(NAMES, "layout")).fetchone()
        conn.execute(partition_statement(NAMES, "readable_bounds"))
        rows = conn.execute(partition_statement(NAMES, "partitions")).fetchall()
        now = conn.execute(LAYOUT_CLOCK).fetchone()
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


def partition_bounds(conn: psycopg.Connection[Any], name: str) -> tuple[float, float]:
    """Partition ``name``'s bounds, epoch seconds."""
    with conn.transaction():
        conn.execute(partition_statement(NAMES, "readable_bounds"))
        rows = conn.execute(partition_statement(NAMES, "partitions")).fetchall()
    [(start, end)] = [(lower, upper) for found, lower, upper, _ in rows if found == name]
    return start, end


def insert_into_partition(url: str, name: str, *, published: bool, attempts: int = 0) -> str:
    """A row whose created_at falls in partition ``name`` (its first second)."""
    row_id = str(uuid.uuid4())
    with psycopg.connect(url) as conn:
        conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, "
            "created_at, published_at, attempts) values (%s, 'old.event', 't', %s, now(), "
            "'{}', to_timestamp(%s) + interval '1 second', "
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
    # The relay's row triggers (the late row's two, and the three that keep its key)
    # fire ALWAYS on every partition, as on the table.
    states = database.fetch(
        partitioned_url,
        "select c.relname, t.tgenabled from pg_trigger t join pg_class c on c.oid = t.tgrelid "
        "join pg_inherits i on i.inhrelid = c.oid where not t.tgisinternal",
    )
    assert len(states) == 5 * len(found.partitions)
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


@pytest.fixture
def minutes_url() -> Iterator[str]:
    """A fresh database whose outbox table is partitioned by the minute, installed
    with the default --partitions-ahead."""
    url = database.create_database(SHARED_PG_URL)
    yield url
    database.drop_database(SHARED_PG_URL, url)


def test_the_relay_keeps_at_most_a_hundred_partitions_ahead_and_exports_what_claims_lock(
    minutes_url, stream, relays
):
    # Three days of one-minute partitions, the default --partitions-ahead, filled the
    # server's lock table within a minute: every claim locks every partition, and
    # every statement on the server failed with "out of shared memory", producers'
    # inserts included.
    db_url = minutes_url
    run_cli(db_url, "install", "--partitions", "1min")
    assert len(layout(db_url).partitions) <= MAX_PARTITIONS_AHEAD + 1
    relay = start(relays, db_url)
    wait_until(
        lambda: (
            relay.metric("outbox_relay_partitions_ahead_seconds")
            >= (MAX_PARTITIONS_AHEAD - 1) * MINUTE
        ),
        timeout=60.0,  # 100 partitions, 64 a round, each round's statements one by one
        message="partitions created as far ahead as the cap",
    )
    assert relay.metric("outbox_relay_partitions_ahead_target_seconds") == (
        MAX_PARTITIONS_AHEAD * MINUTE
    )
    [warning] = [r["message"] for r in relay.log_records() if "--partitions-ahead" in r["message"]]
    assert "would be 4320 partitions of 60s; the relay keeps 100 (6000s ahead)" in warning
    found = layout(db_url)
    assert len(found.partitions) <= MAX_PARTITIONS_AHEAD + 1
    wait_until(
        lambda: (
            relay.metric("outbox_relay_partitions_lock_share")
            == len(layout(db_url).partitions) * LOCKS_A_PARTITION / found.lock_slots
        ),
        # A round reads the partitions before it creates the minute's new one, and the
        # next comes a quarter period later.
        timeout=60.0,
        message="the lock table's share exported",
    )
    # The relay publishes, and producers insert, beside it.
    event = Event(stream.subject("order.created"), "order-1", {"n": 1})
    database.insert(db_url, [event])
    wait_until(lambda: database.unpublished_count(db_url) == 0, message="the row published")


def test_a_claim_planned_afresh_locks_the_entries_a_partition_the_relay_counts(partitioned_url):
    # outbox_relay_partitions_lock_share counts LOCKS_A_PARTITION lock table entries a
    # partition for a claim planned afresh, as after every partition created or dropped.
    def locks_of_a_claim_planned_afresh() -> int:
        with psycopg.connect(partitioned_url, autocommit=True, prepare_threshold=None) as conn:
            conn.execute(claim_preparation(NAMES, PARTITIONED_CLAIM_STATEMENT, partitioned=True))
            cursor = conn.execute(
                claim_execution(
                    PARTITIONED_CLAIM_STATEMENT,
                    500,
                    20,
                    StartKey("-infinity", MIN_SEQ, "-infinity"),
                    plan_cache_mode=GENERIC_PLAN,
                )
            )
            while cursor.nextset():
                pass
            [(count,)] = conn.execute(
                "select count(*) from pg_locks where pid = pg_backend_pid() and not fastpath"
            ).fetchall()
            return int(count)

    before = (len(layout(partitioned_url).partitions), locks_of_a_claim_planned_afresh())
    for minutes_ago in range(1, 41):
        add_past_partition(partitioned_url, minutes_ago)
    after = (len(layout(partitioned_url).partitions), locks_of_a_claim_planned_afresh())
    per_partition = (after[1] - before[1]) / (after[0] - before[0])
    assert LOCKS_A_PARTITION - 1 < per_partition <= LOCKS_A_PARTITION
    assert after[1] <= after[0] * LOCKS_A_PARTITION


def test_retention_drops_spent_partitions_and_keeps_one_that_holds_a_row(
    partitioned_url, stream, relays
):
    spent = [add_past_partition(partitioned_url, minutes) for minutes in (10, 9)]
    held = add_past_partition(partitioned_url, 8)
    for name in spent:
        insert_into_partition(partitioned_url, name, published=True)
    dead = insert_into_partition(partitioned_url, held, published=False, attempts=20)
    fresh = Event(stream.subject("fresh"), "fresh-1")
    relay = start(relays, partitioned_url, **RETIRING)
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
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(psycopg.connect(partitioned_url))
        writer.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data) "
            "values (gen_random_uuid(), %s, 't', 'idle-writer', now(), '{}')",
            (stream.subject("idle"),),
        )
        relay = start(relays, partitioned_url, **RETIRING)
        producers = stack.enter_context(psycopg.connect(partitioned_url, autocommit=True))
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

        try:
            wait_until(detach_timed_out, timeout=30, interval=0.05, message="a detach timed out")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the relay's log ends:\n{relay.logs()[-4000:]}") from None
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


def partitioned_claim_plan(
    url: str, start_at: str, ceiling: str = "-infinity", floor_cap: str = "infinity"
) -> str:
    """EXPLAIN ANALYZE of the claim as the relay runs it (prepared, on a connection
    with its session settings), from the start key ``start_at``, its walks ending at
    its reach ('-infinity') or not ('infinity') and beginning at its floor
    ('infinity') or not ('-infinity'), looking for nothing beyond; rolled back."""
    start = StartKey(
        start_at,
        MIN_SEQ,
        start_at,
        ceiling=ceiling,
        beyond_from="infinity",
        floor_cap=floor_cap,
    )
    statement = PARTITIONED_CLAIM_STATEMENT
    with relay_session(url) as conn:
        conn.autocommit = True
        conn.execute(claim_preparation(NAMES, statement, partitioned=True))
        # The generic plan, which the relay's claims always run on (claim_execution).
        conn.execute("set plan_cache_mode = force_generic_plan")
        for _ in range(6):
            conn.execute("begin")
            conn.execute(claim_execution(statement, 500, 20, start, plan_cache_mode=GENERIC_PLAN))
            conn.execute("rollback")
        conn.execute("begin")
        values = claim_parameters(500, 20, start).values()
        explain = psycopg.sql.SQL("explain (analyze, timing off, costs off) execute {} ({})")
        lines = conn.execute(
            explain.format(statement, psycopg.sql.SQL(", ").join(map(Literal, values)))
        ).fetchall()
        conn.execute("rollback")
    return "\n".join(line for (line,) in lines)


@pytest.mark.parametrize("statistics", ["stale", "fresh"])
def test_the_claim_walks_only_the_partitions_from_its_start_key(partitioned_url, statistics):
    # Twelve spent minutes behind the start key, and a burst of 20,000 rows in this
    # minute's partition. Each walk must read about a batch, in order (no sort of
    # the burst), and leave the partitions before the start key unread. They end two
    # minutes before this one begins: the walks may read back the claim's reach (61 s)
    # and the late-insert slack before the start key, which from the minute's first
    # seconds reaches into the minute before the last (a test that read them failed so).
    old = [add_past_partition(partitioned_url, minutes) for minutes in range(14, 2, -1)]
    with psycopg.connect(partitioned_url, autocommit=True) as conn:
        for name in old:
            conn.execute(
                "insert into outbox_events (id, event_type, source, subject, time, data, "
                "created_at, published_at) select gen_random_uuid(), 'a.b', 's', 'e' || g, "
                "now(), '{}', to_timestamp(%s) + g * interval '1 ms', now() "
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
        # Two lookups are in every partition behind the floor by design, each one
        # index descent: a late row (alias l) and a dead row (d) may be anywhere.
        if found and found.group(2) not in ("l", "d"):
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


def partitions_in_plan(url: str, plan: str) -> dict[str, float]:
    """The partitions a plan opened, by name, with their starts (epoch seconds)."""
    opened = set(re.findall(r" on (outbox_events_p\w+) \w+_\d+ \(actual", plan))
    with psycopg.connect(url) as conn:
        return {name: partition_bounds(conn, name)[0] for name in opened}


def test_the_claim_opens_no_partition_past_its_reach(partitioned_url):
    # Twenty minutes of partitions ahead, empty, as 3 days of hourly ones would be.
    run_cli(partitioned_url, "install", "--partitions", "1min", "--partitions-ahead", "20min")
    database.insert(partitioned_url, [Event("a.b", f"e{n}") for n in range(50)])
    [(now, start_at)] = database.fetch(
        partitioned_url, "select extract(epoch from now())::float8, now()::text"
    )
    plan = partitioned_claim_plan(partitioned_url, start_at)
    # The claim's reach runs from its own statement's time, read after it ran: a
    # partition that begins between the two times may open.
    [(ran_by,)] = database.fetch(partitioned_url, "select extract(epoch from now())::float8")
    reach = ran_by + LATE_INSERT_SECONDS + CLAIM_REACH_MARGIN_SECONDS
    opened = partitions_in_plan(partitioned_url, plan)
    assert opened, plan
    assert max(opened.values()) <= reach, f"a partition past the reach opened:\n{plan}"
    assert "Subplans Removed" in plan, plan
    # Behind a transaction pooler the claim goes with its values in place: the same walks.
    key = StartKey(start_at, MIN_SEQ, start_at, ceiling="-infinity", beyond_from="-infinity")
    with relay_session(partitioned_url) as conn:
        found = conn.execute(claim_with_values(NAMES, 500, 20, key, partitioned=True)).fetchall()
        conn.rollback()
    assert len([row for row in found if row[0] is False]) == 50
    assert found[-1][-1] == "false"  # looked beyond the reach, and found nothing
    # With the ceiling lifted (a flagged row beyond the reach), the walks go to the end.
    lifted = partitions_in_plan(
        partitioned_url, partitioned_claim_plan(partitioned_url, start_at, "infinity")
    )
    assert max(lifted.values()) >= now + 15 * MINUTE


def test_the_claim_is_never_planned_with_its_values_not_even_after_a_new_partition(
    partitioned_url,
):
    # Planned with its values, a claim on a table of a few partitions costs several
    # times a run of its generic plan, and Postgres would plan five so after each
    # new or dropped partition.
    [(start_at,)] = database.fetch(partitioned_url, "select now()::text")
    start = StartKey(start_at, MIN_SEQ, start_at, ceiling="-infinity", floor_cap="infinity")
    statement = PARTITIONED_CLAIM_STATEMENT
    with relay_session(partitioned_url) as conn:
        conn.autocommit = True
        conn.execute(claim_preparation(NAMES, statement, partitioned=True))
        for step in range(8):
            if step == 4:
                add_past_partition(partitioned_url, 20)
            conn.execute(claim_execution(statement, 500, 20, start, plan_cache_mode=GENERIC_PLAN))
            conn.execute("rollback")
        plans = conn.execute(
            "select generic_plans, custom_plans from pg_prepared_statements where name = %s",
            ("outbox_relay_claim_partitioned",),
        ).fetchall()
    assert plans == [(8, 0)]


def test_the_claim_opens_no_partition_below_its_floor(partitioned_url):
    # Twelve minutes of spent partitions behind the start key, as a week of hourly
    # ones would be. The walks from the start begin at the floor (the start key less
    # the claim's reach), and so does the probe for an earlier waiting row of a
    # subject (alias b): only the lookup of dead rows (alias d), whose rows may be
    # anywhere, opens those. The late rows' lookup (alias l) opens no partition at
    # all: it reads their keys' own table.
    old = [add_past_partition(partitioned_url, minutes) for minutes in range(14, 2, -1)]
    for name in old:
        insert_into_partition(partitioned_url, name, published=True)
    database.insert(partitioned_url, [Event("a.b", f"e{n}") for n in range(50)])
    [(now, start_at)] = database.fetch(
        partitioned_url, "select extract(epoch from now())::float8, now()::text"
    )
    floor = now - LATE_INSERT_SECONDS - CLAIM_REACH_MARGIN_SECONDS - LATE_INSERT_SECONDS

    def walked_partitions(plan: str) -> dict[str, float]:
        """The partitions the walks opened (those pruned when the claim ran too)."""
        walk = r" on (outbox_events_p\w+) ([a-ce-z]|[a-z]{2,})_\d+ \((?:actual|never)"
        opened = set(re.findall(walk, plan))
        with psycopg.connect(partitioned_url) as conn:
            return {name: partition_bounds(conn, name)[0] for name, _ in opened}

    plan = partitioned_claim_plan(partitioned_url, start_at)
    walked = walked_partitions(plan)
    assert walked, plan
    assert min(walked.values()) >= floor - MINUTE, f"a partition below the floor opened:\n{plan}"
    assert not set(walked) & set(old), plan
    assert " on outbox_events_relay_late_keys l " in plan, plan
    assert not re.search(r" on outbox_events_p\w+ l_\d+ ", plan), plan
    # Without the floor (a refused claim's second run), the walks open them all.
    floorless = walked_partitions(
        partitioned_claim_plan(partitioned_url, start_at, floor_cap="-infinity")
    )
    assert set(old) <= set(floorless)
    # Behind a transaction pooler, with its values in place: the same 50 rows, not refused.
    key = StartKey(start_at, MIN_SEQ, start_at, ceiling="-infinity", floor_cap="infinity")
    with relay_session(partitioned_url) as conn:
        found = conn.execute(claim_with_values(NAMES, 500, 20, key, partitioned=True)).fetchall()
        conn.rollback()
    assert len([row for row in found if row[0] is False]) == 50
    assert found[-1][9] == 0  # not refused


def relay_past_its_first_row(
    relays: list[RelayProcess], url: str, stream: Any
) -> tuple[RelayProcess, str]:
    """A relay that has published a first row and claims from a start key (so its
    walks have a floor); and the subject its rows go to."""
    relay = start(relays, url)
    subject = stream.subject("a.b")
    database.insert(url, [Event(subject, "before")])
    wait_until(lambda: database.unpublished_count(url) == 0, message="first row")
    wait_until(lambda: relay.metric("outbox_relay_claims_bounded") == 1, message="a start key")
    return relay, subject


def test_a_late_row_below_the_walks_floor_refuses_the_claim_which_runs_again_without_it(
    partitioned_url, stream, relays
):
    relay, subject = relay_past_its_first_row(relays, partitioned_url, stream)
    # A row created ten minutes ago, inserted now (flagged late), and a row of its
    # subject after it, in one transaction: the late row lies below every floor.
    past = add_past_partition(partitioned_url, 10)
    late_id, next_id = uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(partitioned_url) as conn:
        conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, "
            "created_at) values (%s, %s, 't', 'entity', now(), '{}', "
            "to_timestamp(%s) + interval '1 second')",
            (late_id, subject, partition_bounds(conn, past)[0]),
        )
        conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data) "
            "values (%s, %s, 't', 'entity', now(), '{}')",
            (next_id, subject),
        )
    wait_until(
        lambda: database.unpublished_count(partitioned_url) == 0,
        message="the late row and the one after it published",
    )
    ids = [m.envelope["id"] for m in stream.read_all() if m.envelope["subject"] == "entity"]
    assert ids == [str(late_id), str(next_id)]
    assert relay.metric("outbox_relay_claims_below_floor_total") >= 1


def test_a_dead_row_below_the_walks_floor_still_holds_its_subject(partitioned_url, stream, relays):
    # The probe for an earlier waiting row of a subject begins at the floor; a dead
    # row ten minutes back lies below it, and must hold its subject all the same.
    _, subject = relay_past_its_first_row(relays, partitioned_url, stream)
    past = add_past_partition(partitioned_url, 10)
    dead_id, held_id, other_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(partitioned_url) as conn:
        conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, "
            "created_at, attempts, relay_retry_at, relay_dead_at, relay_last_error) "
            "values (%s, %s, 't', 'entity', now(), '{}', to_timestamp(%s) + interval '1 second', "
            "1, 'infinity', now(), 'rejected')",
            (dead_id, subject, partition_bounds(conn, past)[0]),
        )
    # Its subject's next row, then another subject's: once the second is published,
    # a claim has walked past the first.
    database.insert_in_order(
        partitioned_url,
        [Event(subject, "entity", id=held_id), Event(subject, "other", id=other_id)],
    )

    def published(row_id: uuid.UUID) -> bool:
        return database.fetch(
            partitioned_url,
            "select published_at is not null from outbox_events where id = %s",
            (row_id,),
        ) == [(True,)]

    wait_until(lambda: published(other_id), message="the other subject's row published")
    assert not published(held_id), "published past its subject's dead row"
    run_cli(partitioned_url, "skip", "--id", str(dead_id), "--execute")
    wait_until(
        lambda: published(held_id), message="the held row published once the dead one was skipped"
    )
    ids = [m.envelope["id"] for m in stream.read_all() if m.envelope["subject"] == "entity"]
    assert ids == [str(held_id)]


def insert_from_the_future(
    url: str, event_type: str, subject: str, retry_in: float | None = None
) -> None:
    """A row created two and a half minutes ahead of the database's clock (past the
    walks' reach, inside the partitions kept ahead), waiting out a retry of
    ``retry_in`` seconds if given."""
    database.execute(
        url,
        "insert into outbox_events (id, event_type, source, subject, time, data, created_at, "
        "relay_retry_at) values (gen_random_uuid(), %s, 't', %s, now(), '{}', "
        "now() + interval '150 seconds', now() + %s * interval '1 second')",
        (event_type, subject, retry_in),
    )


def test_a_row_from_the_future_is_flagged_and_published_before_the_walks_reach_it(
    partitioned_url, stream, relays
):
    relay = start(relays, partitioned_url, partitions_ahead="3min")
    database.insert(partitioned_url, [Event(stream.subject("a.b"), "before")])
    wait_until(lambda: database.unpublished_count(partitioned_url) == 0, message="first row")
    insert_from_the_future(partitioned_url, stream.subject("a.b"), "ahead")
    wait_until(
        lambda: database.unpublished_count(partitioned_url) == 0,
        timeout=60.0,
        message="the row from the future published",
    )
    [(late, early)] = database.fetch(
        partitioned_url,
        "select relay_late, published_at < created_at - %s * interval '1 second' "
        "from outbox_events where subject = 'ahead'",
        (LATE_INSERT_SECONDS + CLAIM_REACH_MARGIN_SECONDS,),
    )
    assert late, "the trigger did not flag a row from the future"
    assert early, "published only once the walks' reach came to it"
    assert len(stream.read_all()) == 2
    # One waiting out a retry keeps the claims walking to the end, and says so.
    insert_from_the_future(partitioned_url, stream.subject("a.b"), "waiting", retry_in=10.0)
    wait_until(lambda: relay.metric("outbox_relay_claims_past_reach") == 1, message="past reach")
    wait_until(
        lambda: (
            database.unpublished_count(partitioned_url) == 0
            and relay.metric("outbox_relay_claims_past_reach") == 0
        ),
        timeout=30.0,
        message="published, and the walks back at their reach",
    )


def test_an_id_written_twice_across_partitions_is_published_and_found_by_the_audit(
    partitioned_url, stream, relays
):
    # The primary key is (id, created_at): one envelope id may land in two partitions.
    # The relay publishes both rows (the stream keeps one message: same Nats-Msg-Id),
    # and the audit names the id.
    past = add_past_partition(partitioned_url, 5)
    reused = Event(stream.subject("reused"), "entity-1")
    database.insert(partitioned_url, [reused])
    with psycopg.connect(partitioned_url) as conn:
        conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, created_at) "
            "values (%s, %s, 't', 'entity-2', now(), '{}', to_timestamp(%s) + interval '1 s')",
            (reused.id, reused.event_type, partition_bounds(conn, past)[0]),
        )
    relay = start(relays, partitioned_url)
    wait_until(
        lambda: database.unpublished_count(partitioned_url) == 0, message="both rows published"
    )
    assert relay.ready()
    assert [m.msg_id for m in stream.read_all()] == [str(reused.id)]
    found = cli(partitioned_url, "audit", "--since", "1h", "--nats-url", SHARED_NATS_URL)
    assert found.returncode == 1, found.stdout + found.stderr
    assert "1 envelope ids written more than once" in found.stdout
    assert f"id {reused.id} 2 times" in found.stdout


def test_a_relay_whose_role_may_not_create_partitions_serves_on_and_says_so(
    partitioned_url, stream, relays
):
    # A role from `install --grant-to` has no DDL: the relay cannot create partitions.
    # It publishes as ever, counts and logs each failed round, and still reports how
    # far the partitions reach, which is what the alert reads.
    role = f"outbox_relay_{uuid.uuid4().hex[:8]}"
    database.execute(SHARED_PG_URL, f'create role "{role}" login')
    try:
        run_cli(partitioned_url, "install", "--grant-to", role, "--partitions-ahead", "3min")
        url = partitioned_url.replace("postgresql://postgres@", f"postgresql://{role}@", 1)
        relay = start(relays, url, partitions_ahead="30min")
        event = Event(stream.subject("granted"), "account-1")
        database.insert(partitioned_url, [event])
        wait_until(lambda: [m.msg_id for m in stream.read()] == [str(event.id)], message="sent")
        wait_until(
            lambda: relay.metric("outbox_relay_database_errors_total", task="partitions") >= 1,
            message="a failed round counted",
        )
        assert "creating partitions failed: " in relay.logs()
        assert "permission denied" in relay.logs()
        assert "takes the table's owner" in relay.logs()
        assert 0 < relay.metric("outbox_relay_partitions_ahead_seconds") < 5 * MINUTE
        assert relay.ready()
        relay.close()
    finally:
        database.execute(partitioned_url, f'drop owned by "{role}"')
        database.execute(SHARED_PG_URL, f'drop role "{role}"')


def test_partition_bounds_are_read_right_whatever_the_sessions_datestyle(partitioned_url):
    # pg_get_expr prints bounds in the session's TimeZone and DateStyle; "SQL, DMY" in
    # Asia/Kolkata prints IST, which Postgres reads back as Israel's time. Read so, the
    # bounds were off by three and a half hours: install found no partition holding
    # now and created ones overlapping those there (refused by Postgres).
    dbname = partitioned_url.rsplit("/", 1)[-1]
    database.execute(
        SHARED_PG_URL,
        f"alter database \"{dbname}\" set datestyle = 'SQL, DMY'",
    )
    database.execute(SHARED_PG_URL, f"alter database \"{dbname}\" set timezone = 'Asia/Kolkata'")
    before = layout(partitioned_url)
    run_cli(partitioned_url, "install", "--partitions-ahead", "6min")
    after = layout(partitioned_url)
    assert {p.name for p in before.partitions} < {p.name for p in after.partitions}
    assert reach(after.partitions, after.now) >= 6 * MINUTE - 5


def test_a_plain_table_is_migrated_online_losing_and_reordering_nothing(db_url, stream, relays):
    # docs/partitions.md, *Migrating a plain table*, while a producer commits rows of
    # ten subjects one by one and a relay publishes them: step 1, the switch with
    # install's script in its transaction, then install --partitions. The plain
    # table becomes the partition before the bound, new rows land after it.
    relay = start(relays, db_url, partitions_ahead="3min")
    committed: list[tuple[str, str, int]] = []
    stop = threading.Event()

    def produce() -> None:
        with psycopg.connect(db_url, autocommit=True) as conn:
            for n in itertools.count():
                if stop.is_set():
                    return
                row_id, subject = str(uuid.uuid4()), f"s{n % 10}"
                conn.execute(
                    "insert into outbox_events (id, event_type, source, subject, time, data) "
                    "values (%s, %s, 't', %s, now(), %s)",
                    (row_id, stream.subject("migrated"), subject, json.dumps({"n": n})),
                )
                committed.append((row_id, subject, n))
                time.sleep(0.005)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        wait_until(lambda: len(committed) > 100, message="rows before the migration")
        [(now,)] = database.fetch(db_url, "select extract(epoch from now())::float8")
        bound = now + 15.0
        steps = migration_statements(NAMES, bound)
        with psycopg.connect(db_url, autocommit=True) as conn:
            for step in ("migration_bound", "migration_validate", "migration_key"):
                conn.execute(steps[step])
        with psycopg.connect(db_url) as conn:
            conn.execute(steps["migration_switch"])
            for statement in install_script(NAMES):
                conn.execute(statement)
        run_cli(db_url, "install", "--partitions", "1min", "--partitions-ahead", "3min")
        wait_until(
            lambda: database.fetch(
                db_url, "select count(*) from outbox_events where created_at >= to_timestamp(%s)",
                (bound,),
            )[0][0] > 100,
            timeout=60,
            message="rows after the bound",
        )  # fmt: skip
    finally:
        stop.set()
        producer.join()
    wait_until(lambda: database.unpublished_count(db_url) == 0, message="every row published")
    found = layout(db_url)
    assert (found.kind, found.managed) == ("p", True)
    [before] = [p for p in found.partitions if p.name == "outbox_events_before"]
    assert (before.start, before.end) == (float("-inf"), pytest.approx(bound))
    assert any(p.start == pytest.approx(bound) for p in found.partitions)
    stored = [(m.msg_id, m.envelope["subject"], m.envelope["data"]["n"]) for m in stream.read_all()]
    assert sorted(stored) == sorted(committed)
    for subject in {s for _, s, _ in committed}:
        mine = [n for _, s, n in stored if s == subject]
        assert mine == sorted(mine), f"{subject} out of order"
    assert relay.ready()
