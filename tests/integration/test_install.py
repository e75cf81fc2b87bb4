"""`outbox-relay install` / `uninstall` against a real database, and the claim plan."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid
import weakref
from typing import Any

import psycopg
import pytest

from relay.claimstart import FROM_FIRST_ENTRY, ClaimStart
from relay.config import Config
from relay.database import POOLED_CONNECTION, Database, Transaction
from relay.errors import DatabaseUnavailable
from relay.marks import FailureMark, Marks
from relay.sqlfiles import (
    Names,
    claim_parameters,
    claim_preparation,
    claim_with_values,
    local_settings,
    query,
)
from tests.support import database
from tests.support.database import Event, relay_session
from tests.support.servers import SHARED_PG_URL

pytestmark = pytest.mark.integration

CATALOG = """
select 'column', attname || ' ' || format_type(atttypid, atttypmod) || ' ' || attnotnull
  from pg_attribute
 where attrelid = 'outbox_events'::regclass and attnum > 0 and not attisdropped
union all
select 'index', pg_get_indexdef(indexrelid) from pg_index where indrelid = 'outbox_events'::regclass
union all
select 'trigger', pg_get_triggerdef(oid) from pg_trigger
 where tgrelid = 'outbox_events'::regclass and not tgisinternal
union all
select 'function', pg_get_functiondef(p.oid) from pg_proc p
 where proname like 'outbox_events_relay%%'
order by 1, 2
"""


# The table as the contract gives it, as a service's own migration creates it.
CONTRACT_TABLE = """create table outbox_events (
    id uuid primary key, event_type text not null, source text not null,
    subject text not null, time timestamptz not null, data jsonb not null,
    created_at timestamptz not null default now(), published_at timestamptz null,
    attempts int not null default 0)"""


def cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        env={"OUTBOX_RELAY_DATABASE_URL": url, "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture
def empty_db():
    url = database.create_database(SHARED_PG_URL)
    yield url
    database.drop_database(SHARED_PG_URL, url)


def test_install_twice_changes_nothing(empty_db):
    assert cli("install", url=empty_db).returncode == 0
    first = database.fetch(empty_db, CATALOG)
    assert cli("install", url=empty_db).returncode == 0
    assert database.fetch(empty_db, CATALOG) == first
    kinds = {kind for kind, _ in first}
    assert kinds == {"column", "index", "trigger", "function"}
    columns = [c for k, c in first if k == "column"]
    assert "published_at timestamp with time zone false" in columns
    assert "attempts integer true" in columns
    assert "relay_retry_at timestamp with time zone false" in columns
    assert "relay_dead_at timestamp with time zone false" in columns
    assert "relay_seq bigint false" in columns
    indexes = " ".join(c for k, c in first if k == "index")
    assert (
        "CREATE INDEX outbox_events_unpublished_idx ON public.outbox_events USING btree "
        "(created_at) WHERE (published_at IS NULL)"
    ) in indexes
    assert (
        "CREATE INDEX outbox_events_relay_claim_idx ON public.outbox_events USING btree "
        "(created_at, relay_seq) WHERE (COALESCE(published_at, relay_dead_at) IS NULL)"
    ) in indexes
    # Producers' rows are numbered as they are inserted.
    database.insert(empty_db, [Event("a.b", "s"), Event("a.b", "s")])
    assert database.fetch(empty_db, "select relay_seq from outbox_events order by 1") == [
        (1,),
        (2,),
    ]


def test_install_replaces_the_backoff_indexes_of_earlier_installs(empty_db):
    # Earlier installs had backoff indexes the claim's probe no longer uses: install
    # drops them and creates the one ordered as the claim is.
    assert cli("install", url=empty_db).returncode == 0
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("drop index outbox_events_relay_waiting_idx")
        conn.execute(
            "create index outbox_events_relay_backoff_idx on outbox_events "
            "(subject, created_at, id) where published_at is null and relay_retry_at is not null"
        )
        conn.execute(
            "create index outbox_events_relay_retry_idx on outbox_events "
            "(subject, created_at, id) where relay_retry_at is not null"
        )
    assert cli("install", url=empty_db).returncode == 0
    indexes = " ".join(c for k, c in database.fetch(empty_db, CATALOG) if k == "index")
    assert "outbox_events_relay_backoff_idx" not in indexes
    assert "outbox_events_relay_retry_idx" not in indexes
    assert (
        "CREATE INDEX outbox_events_relay_waiting_idx ON public.outbox_events USING btree "
        "(subject, created_at, relay_seq) WHERE (relay_retry_at IS NOT NULL)"
    ) in indexes


def test_install_over_an_earlier_install_numbers_the_unpublished_rows_once(empty_db):
    # An earlier install: the contract's table, the relay's first two columns, and
    # rows of one transaction (one created_at) that earlier relays published in id
    # order. Install numbers the unpublished ones in that order, below every number
    # the sequence will give, and leaves published rows alone.
    database.execute(empty_db, CONTRACT_TABLE)
    database.execute(
        empty_db,
        "alter table outbox_events add column relay_retry_at timestamptz, "
        "add column relay_last_error text",
    )
    old = [Event("a.b", "s", id=uuid.UUID(int=n)) for n in (5, 3, 9, 1)]
    database.insert(empty_db, old)
    database.execute(
        empty_db, "update outbox_events set published_at = now() where id = %s", (str(old[3].id),)
    )
    assert cli("install", url=empty_db).returncode == 0
    numbered = database.fetch(empty_db, "select id, relay_seq from outbox_events order by id")
    assert numbered == [
        (uuid.UUID(int=1), None),
        (uuid.UUID(int=3), -3),
        (uuid.UUID(int=5), -2),
        (uuid.UUID(int=9), -1),
    ]
    database.insert(empty_db, [Event("a.b", "s")])
    assert cli("install", url=empty_db).returncode == 0  # numbers nothing again
    assert database.fetch(empty_db, "select count(*), max(relay_seq) from outbox_events") == [
        (5, 1)
    ]


def test_install_over_an_earlier_install_replaces_its_late_trigger_and_fires_all_always(
    empty_db,
):
    # An install before this one: its insert trigger named without "zz_", every
    # trigger firing as ordinary triggers do (not under the replica role), no
    # revival trigger, no check, and no table of the late rows' keys.
    assert cli("install", url=empty_db).returncode == 0
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("drop trigger zz_outbox_events_relay_late on outbox_events")
        conn.execute("drop trigger zz_outbox_events_relay_revived on outbox_events")
        for key_trigger in ("added", "moved", "gone"):
            conn.execute(
                f"drop trigger zz_outbox_events_relay_late_key_{key_trigger} on outbox_events"
            )
        conn.execute("drop function outbox_events_relay_late_key()")
        conn.execute("drop table outbox_events_relay_late_keys")
        conn.execute("alter table outbox_events drop constraint outbox_events_relay_seq_set")
        conn.execute(
            "create trigger outbox_events_relay_late before insert on outbox_events "
            "for each row when (new.created_at < clock_timestamp() - interval '1 second') "
            "execute function outbox_events_relay_late()"
        )
        conn.execute("alter table outbox_events enable trigger outbox_events_relay_notify")
        # A row that trigger flagged, live: the install finds its key.
        conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, created_at) "
            "values ('00000000-0000-0000-0000-00000000000a', 'a.b', 't', 's', now(), '{}', "
            "now() - interval '1 hour')"
        )
    [(problems,)] = database.fetch(empty_db, query(Names.for_config(Config()), "late_guard"))
    assert problems == [
        "the late-row triggers are missing or do not fire ALWAYS",
        "the check that every live row has a relay_seq is missing",
    ]
    assert cli("install", url=empty_db).returncode == 0
    triggers = database.fetch(
        empty_db,
        "select tgname, tgenabled from pg_trigger "
        "where tgrelid = 'outbox_events'::regclass and not tgisinternal order by tgname",
    )
    assert triggers == [
        ("outbox_events_relay_notify", "A"),
        ("zz_outbox_events_relay_late", "A"),
        ("zz_outbox_events_relay_late_key_added", "A"),
        ("zz_outbox_events_relay_late_key_gone", "A"),
        ("zz_outbox_events_relay_late_key_moved", "A"),
        ("zz_outbox_events_relay_revived", "A"),
    ]
    assert database.fetch(empty_db, query(Names.for_config(Config()), "late_guard")) == [([],)]
    assert database.fetch(empty_db, "select id::text from outbox_events_relay_late_keys") == [
        ("00000000-0000-0000-0000-00000000000a",)
    ]
    assert cli("uninstall", url=empty_db).returncode == 0
    assert database.fetch(
        empty_db,
        "select count(*) from pg_constraint where conname = 'outbox_events_relay_seq_set'",
    ) == [(0,)]


def test_install_over_an_earlier_install_makes_its_late_trigger_flag_rows_from_the_future(
    empty_db,
):
    # The late trigger of an install before this one: its name, ALWAYS, no test for
    # a created_at ahead of the clock, no comment.
    assert cli("install", url=empty_db).returncode == 0
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("drop trigger zz_outbox_events_relay_late on outbox_events")
        conn.execute(
            "create trigger zz_outbox_events_relay_late before insert on outbox_events "
            "for each row when (new.relay_seq is null or (pg_current_xact_id() is not null "
            "and new.created_at < clock_timestamp() - interval '1 second')) "
            "execute function outbox_events_relay_late()"
        )
        conn.execute("alter table outbox_events enable always trigger zz_outbox_events_relay_late")
    future = (
        "insert into outbox_events (id, event_type, source, subject, time, data, created_at) "
        "values (gen_random_uuid(), 'a.b', 't', %s, now(), '{}', now() + %s * interval '1 s') "
        "returning relay_late is true"
    )
    assert database.fetch(empty_db, future, ("before", 3600)) == [(False,)]
    assert cli("install", url=empty_db).returncode == 0
    assert database.fetch(empty_db, future, ("after", 3600)) == [(True,)]
    assert database.fetch(empty_db, future, ("on time", 0)) == [(False,)]
    assert database.fetch(
        empty_db,
        "select tgenabled from pg_trigger where tgname = 'zz_outbox_events_relay_late'",
    ) == [("A",)]


def test_install_over_an_earlier_install_gives_the_wake_up_its_when_and_the_sequence_a_cache(
    empty_db,
):
    # The install before this one: a sequence without CACHE, and a wake-up trigger
    # without WHEN, whose function ran for every insert.
    assert cli("install", url=empty_db).returncode == 0
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("alter sequence outbox_events_relay_seq cache 1")
        conn.execute("drop trigger outbox_events_relay_notify on outbox_events")
        conn.execute(
            "create trigger outbox_events_relay_notify after insert on outbox_events "
            "for each statement execute function outbox_events_relay_notify()"
        )
    assert cli("install", url=empty_db).returncode == 0
    [(definition, enabled)] = database.fetch(
        empty_db,
        "select pg_get_triggerdef(oid), tgenabled from pg_trigger "
        "where tgname = 'outbox_events_relay_notify'",
    )
    assert "WHEN ((NOT pg_try_advisory_xact_lock_shared(" in definition
    assert enabled == "A"
    assert database.fetch(
        empty_db,
        "select seqcache from pg_sequence where seqrelid = 'outbox_events_relay_seq'::regclass",
    ) == [(64,)]


def test_the_wake_up_notifies_only_while_the_sleep_lock_is_held(empty_db):
    """The trigger's WHEN: an insert notifies while a relay holds the sleep lock, and
    does not (and holds the lock shared until it commits) while none does."""
    assert cli("install", url=empty_db).returncode == 0
    names = Names.for_config(Config())
    insert = (
        "insert into outbox_events (id, event_type, source, subject, time, data) "
        "values (gen_random_uuid(), 'a.b', 's', 'x', now(), '{}')"
    )
    with (
        psycopg.connect(empty_db, autocommit=True) as listener,
        psycopg.connect(empty_db, autocommit=True) as relay,
        psycopg.connect(empty_db, autocommit=True) as producer,
    ):
        listener.execute("listen outbox_events")
        relay.execute(query(names, "idle_lock"))
        producer.execute(insert)
        assert len(list(listener.notifies(timeout=5, stop_after=1))) == 1
        relay.execute(query(names, "idle_unlock"))
        with producer.transaction():
            producer.execute(insert)
            # The producer holds the lock shared: a relay must wait for it to sleep.
            relay.execute("set lock_timeout = '50ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                relay.execute(query(names, "idle_lock"))
        assert list(listener.notifies(timeout=0.5)) == []


def test_reinstall_takes_no_lock_on_an_installed_table(db_url):
    """Install runs on every deploy, beside live producers and relays: on an installed
    table it must not wait for (or block) anyone. Held in ACCESS EXCLUSIVE mode, the
    table conflicts with every lock there is, so an install that asked for any lock
    on it would wait out its lock timeout and fail."""
    with psycopg.connect(db_url) as holder:
        holder.execute("lock table outbox_events in access exclusive mode")
        result = cli("install", url=db_url)
        assert result.returncode == 0, result.stderr
        holder.rollback()


def test_install_keeps_an_existing_table_and_its_rows(empty_db):
    database.execute(empty_db, CONTRACT_TABLE)
    database.execute(
        empty_db,
        "insert into outbox_events (id, event_type, source, subject, time, "
        "data) values (gen_random_uuid(), 'a', 'b', 'c', now(), '{}')",
    )
    assert cli("install", url=empty_db).returncode == 0
    assert database.fetch(empty_db, "select count(*), max(relay_retry_at) from outbox_events") == [
        (1, None)
    ]


def test_uninstall_removes_only_what_the_relay_added(empty_db):
    assert cli("install", url=empty_db).returncode == 0
    database.insert(empty_db, [database.Event("a.b", "s")])
    result = cli("uninstall", url=empty_db)
    assert result.returncode == 0, result.stderr
    catalog = database.fetch(empty_db, CATALOG)
    assert {kind for kind, _ in catalog} == {"column", "index"}
    # Producers pay for nothing of the relay's: relay_seq has no default any more.
    assert database.fetch(
        empty_db,
        "select column_default from information_schema.columns "
        "where table_name = 'outbox_events' and column_name = 'relay_seq'",
    ) == [(None,)]
    assert database.fetch(empty_db, "select to_regclass('outbox_events_relay_seq')") == [(None,)]
    assert database.fetch(empty_db, "select count(*) from outbox_events") == [(1,)]
    indexes = [
        name
        for (name,) in database.fetch(
            empty_db, "select indexname from pg_indexes where tablename = 'outbox_events'"
        )
    ]
    assert sorted(indexes) == ["outbox_events_pkey", "outbox_events_unpublished_idx"]
    assert cli("uninstall", url=empty_db).returncode == 0  # idempotent too


def test_print_writes_sql_and_touches_nothing(empty_db):
    result = cli("install", "--print", url=empty_db)
    assert result.returncode == 0
    assert 'create table if not exists "outbox_events"' in result.stdout
    assert "pg_notify('outbox_events', '')" in result.stdout
    assert database.fetch(empty_db, "select to_regclass('outbox_events')") == [(None,)]
    # What --print shows is what install runs.
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute(result.stdout)
    assert cli("install", url=empty_db).returncode == 0


def test_install_in_a_schema_with_a_custom_table_and_channel(empty_db):
    database.execute(empty_db, "create schema billing")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "relay",
            "install",
            "--table",
            "billing.events",
            "--channel",
            "billing_wake",
        ],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        env={"OUTBOX_RELAY_DATABASE_URL": empty_db, "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    names = Names.for_config(Config(table=("billing", "events"), channel="billing_wake"))
    insert = (
        "insert into billing.events (id, event_type, source, subject, time, data) "
        "values (gen_random_uuid(), 'a', 'b', 'c', now(), '{}')"
    )
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("listen billing_wake")
        conn.execute(insert)  # no relay asleep: no notification
        assert list(conn.notifies(timeout=0.3, stop_after=1)) == []
        conn.execute(query(names, "idle_lock"))  # as a relay does before it sleeps
        # A producer is another session (a session never conflicts with its own locks).
        database.execute(empty_db, insert)
        assert [n.channel for n in conn.notifies(timeout=2, stop_after=1)] == ["billing_wake"]


def test_install_reports_a_failure_in_one_line(empty_db):
    bad = empty_db.replace("/relay_test_", "/no_such_db_")
    result = cli("install", url=bad)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "install failed" in result.stderr


def test_unknown_table_fails_at_start_with_one_clear_line(db_url):
    result = subprocess.run(
        [sys.executable, "-m", "relay", "run", "--table", "no_such_table", "--metrics-port", "0"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        env={"OUTBOX_RELAY_DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stderr
    assert "--table: table no_such_table does not exist" in errors[0]
    assert "Traceback" not in result.stderr


def test_claim_query_uses_the_claim_index_on_a_large_table(db_url):
    with psycopg.connect(db_url) as conn:
        conn.execute("""
            insert into outbox_events (id, event_type, source, subject, time, data, created_at,
                                       published_at)
            select gen_random_uuid(), 'a.b', 's', 'e' || (g % 1000), now(), '{}',
                   now() - (g || ' seconds')::interval,
                   case when g > 2000 then now() end
              from generate_series(1, 200000) g""")
        conn.commit()
        conn.execute("analyze outbox_events")
    with relay_session(db_url) as conn:
        assert_claim_reads_about_a_batch(claim_plan(conn))


def held_batch_and_plans(url: str) -> tuple[str, str]:
    """The claim's plan alone, then beside another relay holding the first batch."""
    names = Names.for_config(Config())
    with relay_session(url) as other, relay_session(url) as conn:
        alone = claim_plan(conn)
        held = other.execute(query(names, "claim"), claim_parameters(500, 20, FROM_FIRST_ENTRY))
        assert len(claimed_and_blockers(held.fetchall())) == 500
        beside = claim_plan(conn)
        other.rollback()
    return alone, beside


def assert_claims_read_about_a_batch_on_stale_then_fresh_statistics(url: str) -> None:
    """The claim alone and beside another relay's batch, on the statistics the table
    has (taken before its rows), then on fresh ones."""
    for statistics in ("stale", "fresh"):
        if statistics == "fresh":
            database.execute(url, "vacuum analyze outbox_events")
        for plan in held_batch_and_plans(url):
            try:
                assert_claim_reads_about_a_batch(plan)
            except AssertionError:
                raise AssertionError(f"{statistics} statistics:\n{plan}") from None


def test_a_million_rows_of_one_transaction_cost_a_claim_one_batch(db_url):
    # A backfill, a bulk import, a migration: one transaction, one created_at for a
    # million rows. Ordered within the group by relay_seq, which the claim index
    # holds, a claim reads its batch and stops; the contract's index on created_at
    # alone would make it read (and sort) the whole group, every claim. Planned on
    # statistics from before the rows (stale), then on fresh ones.
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("analyze outbox_events")
        conn.execute("""
            insert into outbox_events (id, event_type, source, subject, time, data)
            select gen_random_uuid(), 'a.b', 's', 'e' || (g % 1000), now(), '{}'
              from generate_series(1, 1000000) g""")
    assert_claims_read_about_a_batch_on_stale_then_fresh_statistics(db_url)


def test_dead_rows_ahead_of_a_backlog_cost_a_claim_nothing(db_url):
    # An incident's leftovers: 100,000 dead rows older than a 100,000-row backlog of
    # other subjects (a dead row holds its own subject's later rows: those wait).
    # Dead rows are not in the claim index, so no claim walks past them; they are in
    # the waiting index, which each row's "does an earlier row of its subject wait?"
    # reads at its own subject.
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("analyze outbox_events")
        for dead in (True, False):
            conn.execute(
                """
                insert into outbox_events (id, event_type, source, subject, time, data,
                                           created_at, attempts, relay_dead_at, relay_retry_at)
                select gen_random_uuid(), 'a.b', 's', case when %s then 'd' else 'e' end
                       || (g %% 1000), now(), '{}', clock_timestamp(),
                       case when %s then 20 else 0 end, case when %s then now() end,
                       case when %s then 'infinity'::timestamptz end
                  from generate_series(1, 100000) g""",
                (dead, dead, dead, dead),
            )
    assert_claims_read_about_a_batch_on_stale_then_fresh_statistics(db_url)


def claimed_and_blockers(found: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The claim's rows without its summary (the last row, blocker null)."""
    assert found[-1][0] is None
    return found[:-1]


def claim_plan(conn, batch_size: int = 500) -> str:
    """EXPLAIN ANALYZE of the claim, rolled back, on a connection with the relay's
    session settings."""
    names = Names.for_config(Config())
    lines = conn.execute(
        psycopg.sql.SQL("explain (analyze, timing off, costs off) ") + query(names, "claim"),
        claim_parameters(batch_size, 20, FROM_FIRST_ENTRY),
    ).fetchall()
    conn.rollback()
    return "\n".join(line for (line,) in lines)


def assert_claim_reads_about_a_batch(plan: str, batch_size: int = 500) -> None:
    """Every scan of the claim reads at most two batches' worth of rows (it may step
    over a batch another relay holds), walks only the claim index, the retry index or
    the late rows' keys' index, and sorts nothing bigger than its own batch. The guard reads
    the catalog's few triggers of the table (a scan of pg_trigger, which the planner
    walks by its index once a database has many)."""
    for line in plan.splitlines():
        if "Seq Scan on pg_trigger" in line:
            continue
        if "Seq Scan" in line or "Bitmap" in line:
            raise AssertionError(f"{line.strip()} in plan:\n{plan}")
        if "Scan using" in line and "on outbox_events" in line:
            assert any(
                f"outbox_events_relay_{index}_idx" in line
                for index in ("claim", "waiting", "late_keys")
            ), plan
            found = re.search(r"rows=(\d+) loops=(\d+)", line)
            assert found, line
            if "relay_waiting_idx" not in line:  # probed once per row considered
                assert int(found.group(1)) * int(found.group(2)) <= 2 * batch_size, plan
        removed = re.search(r"Rows Removed by Filter: (\d+)", line)
        if removed:
            assert int(removed.group(1)) <= 2 * batch_size, plan


@pytest.mark.parametrize("statistics", ["empty table", "drained table"])
def test_claim_reads_one_batch_of_a_burst_on_stale_statistics(db_url, statistics):
    # A burst that lands on a table last analyzed while empty (new, or truncated) or
    # while drained (every row published: the steady state of a relay that keeps up).
    # Either way the planner believes the backlog is a row or two. Left alone, it
    # bitmap-scanned and sorted the whole burst for every claim (empty), sorted it
    # (drained, ~200 ms for 50,000 rows), or rescanned the whole burst for every row
    # it considered (drained, before the retry index: past the 30 s statement
    # timeout). Each row's backoff question must be one probe of the retry index by
    # subject, and the claim must read no further than its batch.
    burst = """
        insert into outbox_events (id, event_type, source, subject, time, data, created_at)
        select gen_random_uuid(), 'a.b', 's', 'e' || (g % 1000), now(), '{}', clock_timestamp()
          from generate_series(1, 50000) g"""
    with psycopg.connect(db_url, autocommit=True) as conn:
        if statistics == "drained table":
            conn.execute(burst)
            conn.execute("update outbox_events set published_at = now()")
        conn.execute("analyze outbox_events")
        conn.execute(burst)
    with relay_session(db_url) as conn:
        plan = claim_plan(conn)
    assert_claim_reads_about_a_batch(plan)
    probe = "Index Scan using outbox_events_relay_waiting_idx on outbox_events b"
    assert probe in plan, plan
    assert "Index Cond: ((subject = o.subject)" in plan, plan


def test_the_prepared_claim_planned_on_a_tiny_table_reads_about_a_batch_once_it_grows(db_url):
    # The relay prepares the claim once a connection and soon runs it on a generic
    # plan, kept until the table is next analyzed. Planned while the table held a few
    # rows (new, or just drained and analyzed so), its cheapest plan was a sequential
    # scan in each of the claim's eight scans, and it stayed as the table grew: 1-2
    # ms a claim after 20 s at 200 events/s, growing (docs/performance.md).
    names = Names.for_config(Config())
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("""
            insert into outbox_events (id, event_type, source, subject, time, data)
            select gen_random_uuid(), 'a.b', 's', 'e' || g, now(), '{}'
              from generate_series(1, 3) g""")
        conn.execute("analyze outbox_events")
    statement = psycopg.sql.Identifier("claim")
    values = psycopg.sql.SQL(", ").join(
        psycopg.sql.Literal(v) for v in claim_parameters(500, 20, FROM_FIRST_ENTRY).values()
    )
    execute = psycopg.sql.SQL("execute {} ({})").format(statement, values)
    with relay_session(db_url) as conn:
        conn.execute("set plan_cache_mode = force_generic_plan")  # where the relay settles
        conn.execute(claim_preparation(names, statement))
        conn.commit()
        conn.execute(execute)
        conn.rollback()
        with psycopg.connect(db_url, autocommit=True) as producer:
            producer.execute("""
                insert into outbox_events (id, event_type, source, subject, time, data,
                                           created_at, published_at)
                select gen_random_uuid(), 'a.b', 's', 'e' || (g % 200), now(), '{}',
                       clock_timestamp(), clock_timestamp()
                  from generate_series(1, 20000) g""")
        lines = conn.execute(
            psycopg.sql.SQL("explain (analyze, timing off, costs off) ") + execute
        ).fetchall()
        conn.rollback()
    plan = "\n".join(line for (line,) in lines)
    assert "$2" in plan, plan  # the generic plan
    assert_claim_reads_about_a_batch(plan)


def test_one_big_transaction_is_claimed_without_blockers(db_url):
    # Every row of one transaction shares created_at (now()); relay_seq orders them. The
    # rest of the transaction's rows come after the batch and hold nothing back.
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("""
            insert into outbox_events (id, event_type, source, subject, time, data)
            select gen_random_uuid(), 'a.b', 's', 'e' || (g % 10), now(), '{}'
              from generate_series(1, 5000) g""")
    with psycopg.connect(db_url) as conn:
        found = conn.execute(
            query(Names.for_config(Config()), "claim"), claim_parameters(500, 20, FROM_FIRST_ENTRY)
        ).fetchall()
        conn.rollback()
    found = claimed_and_blockers(found)
    assert len(found) == 500
    assert not any(row[0] for row in found)  # no blockers


def test_claim_beside_another_batch_on_stale_statistics_hashes_the_subjects(db_url):
    # Another batch holds the first rows of a burst (another replica's, or this relay's
    # previous batch still in flight): its rows are unpublished, not later than this
    # batch, and not in it, so the blocker scan reads every one of them and asks
    # whether its subject is in the batch. On statistics from before the burst the
    # planner expected a handful of claimed rows and answered with a nested loop over
    # them: 500 x 500 comparisons, 60 ms a claim. The question must be a hash lookup.
    settings = Database(Config(database_url=db_url)).session_settings
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("analyze outbox_events")
        conn.execute("""
            insert into outbox_events (id, event_type, source, subject, time, data, created_at)
            select gen_random_uuid(), 'a.b', 's', 'e' || (g % 1000), now(), '{}',
                   clock_timestamp()
              from generate_series(1, 50000) g""")
    with psycopg.connect(db_url) as other, psycopg.connect(db_url) as conn:
        for session in (other, conn):
            for name, value in settings.items():
                session.execute("select set_config(%s, %s, false)", (name, value))
            session.commit()
        held = other.execute(
            query(Names.for_config(Config()), "claim"), claim_parameters(500, 20, FROM_FIRST_ENTRY)
        ).fetchall()
        assert len(claimed_and_blockers(held)) == 500
        plan = claim_plan(conn)
        other.rollback()
    assert "Nested Loop" not in plan, plan
    assert re.search(r"\(hashed SubPlan \d+\) IS TRUE", plan), plan


def test_marks_are_planned_each_time_and_the_claim_is_prepared(db_url):
    # A prepared statement soon runs on one generic plan made without its parameters,
    # kept until the table is next analyzed. For the claim that plan is an index walk
    # whatever the table's size; for a mark made while the table was small it is a
    # sequential scan, kept as a backlog piles up (80 ms to mark 100 rows of 2,300
    # during a benchmark). So the relay prepares the claim, once per connection, and
    # never the marks.
    names = Names.for_config(Config())

    async def batches(count: int) -> list[tuple[str, str]]:
        async with await psycopg.AsyncConnection.connect(db_url, **POOLED_CONNECTION) as conn:
            prepared: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], set[bool]] = (
                weakref.WeakKeyDictionary()
            )
            for _ in range(count):
                database.insert(db_url, [Event("a.b", "s")])
                tx = Transaction(conn, names, prepared, ClaimStart())
                claim = await tx.claim(batch_size=10, max_attempts=20)
                assert claim.rows
                marks = Marks(
                    published=[row.id for row in claim.rows],
                    # a failure mark for a row that is not there: the statement runs
                    failed=[FailureMark(str(uuid.uuid4()), 1, 1.0, "x")],
                )
                await tx.mark_and_commit(marks)
            cursor = await conn.execute("select name, statement from pg_prepared_statements")
            return [(row[0], row[1]) for row in await cursor.fetchall()]

    prepared = asyncio.run(batches(8))
    [(name, statement)] = prepared  # the marks ran 8 times each, and were never prepared
    assert name == "outbox_relay_claim"
    assert "-- The next batch" in statement, statement
    with psycopg.connect(db_url) as conn:
        unpublished = conn.execute(
            "select count(*) from outbox_events where published_at is null"
        ).fetchone()
    assert unpublished == (0,)


def test_the_prepared_claim_outlives_a_rollback_and_comes_back_after_a_deallocate(db_url):
    # psycopg deallocates every prepared statement on ROLLBACK if it prepared any
    # itself; pooled connections never let it. A claim deallocated anyway (a proxy's
    # DISCARD ALL) fails one batch, and the next one prepares it again.
    names = Names.for_config(Config())

    async def claims() -> list[str]:
        outcomes = []
        async with await psycopg.AsyncConnection.connect(db_url, **POOLED_CONNECTION) as conn:
            prepared: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], set[bool]] = (
                weakref.WeakKeyDictionary()
            )
            for step in ("first", "after rollback", "after deallocate", "retried"):
                for _ in range(6):  # enough for psycopg to prepare it, if it would
                    await conn.execute(query(names, "backlog"), {"max_attempts": 20})
                if step == "after deallocate":
                    await conn.execute("deallocate all")
                database.insert(db_url, [Event("a.b", "s")])
                try:
                    claim = await Transaction(conn, names, prepared, ClaimStart()).claim(10, 20)
                    outcomes.append(f"{step}: {len(claim.rows)}")
                except DatabaseUnavailable as exc:
                    outcomes.append(f"{step}: {exc}")
                await conn.rollback()
        return outcomes

    outcomes = asyncio.run(claims())
    assert outcomes[:2] == ["first: 1", "after rollback: 2"], outcomes
    assert outcomes[2].startswith("after deallocate: claim: InvalidSqlStatementName"), outcomes
    assert outcomes[3] == "retried: 4", outcomes


def test_the_claim_behind_a_transaction_pooler_reads_one_batch_on_stale_statistics(db_url):
    """Behind a transaction pooler the claim goes unprepared, with its values in
    place, and the relay's settings hold for its transaction only (no bitmap scan
    among them): on a burst the planner believes is tiny it still walks the claim
    index and stops at the batch."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("analyze outbox_events")
        conn.execute("""
            insert into outbox_events (id, event_type, source, subject, time, data, created_at)
            select gen_random_uuid(), 'a.b', 's', 'e' || (g % 1000), now(), '{}',
                   clock_timestamp()
              from generate_series(1, 50000) g""")
    settings = Database(Config(database_url=db_url)).session_settings
    names = Names.for_config(Config())
    with psycopg.connect(db_url) as conn:
        conn.execute(local_settings(settings))
        lines = conn.execute(
            psycopg.sql.SQL("explain (analyze, timing off, costs off) ")
            + claim_with_values(names, 500, 20, FROM_FIRST_ENTRY)
        ).fetchall()
        conn.rollback()
        # Nothing of it outlives the transaction.
        assert conn.execute("show enable_bitmapscan").fetchone() == ("on",)
        assert conn.execute("show enable_seqscan").fetchone() == ("on",)
    assert_claim_reads_about_a_batch("\n".join(line for (line,) in lines))
