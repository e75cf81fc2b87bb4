"""A held MVCC horizon: what a claim costs behind the dead entries it leaves, and
the rows a claim that starts from a key, not from the claim index's first entry,
must still find (relay/claimstart.py, the claim in sql/queries.sql).

The claims here are the relay's own (Transaction.claim with a ClaimStart), run in
the test's process so the plan of the next claim can be read with the key the
relay would use."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from relay import backlog
from relay import database as relay_database
from relay.claimstart import FROM_FIRST_ENTRY, LATE_INSERT_SECONDS, MAX_SEQ, ClaimStart, StartKey
from relay.config import Config
from relay.database import POOLED_CONNECTION, Transaction
from relay.marks import FailureMark, Marks
from relay.model import OutboxRow
from relay.sqlfiles import Names, claim_parameters, query
from relay.writers import UNKNOWN, WriterTracker
from tests.support import database
from tests.support.database import LAYOUTS, Event, relay_session
from tests.support.relayproc import wait_until
from tests.support.servers import ThrowawayStandby, throwaway_postgres

pytestmark = pytest.mark.integration

NAMES = Names.for_config(Config())
BATCH = 50


def read_writers(url: str) -> tuple[str, list[tuple[int, str | None]]]:
    """The table_writers query, as relay/writers.py's task reads it."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(query(NAMES, "table_writers"), {"table": "outbox_events"}).fetchall()
    return rows[0][0], [(int(xid), started) for _, xid, started in rows if xid is not None]


class Claims:
    """The relay's claims on one pooled-style connection, with its start key, each
    after a read of the table's writers (the relay reads them 4 times a second)."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], url: str | None = None) -> None:
        self.conn = conn
        self.url = url or conn.info.dsn
        self.start = ClaimStart()
        self.writers = WriterTracker()
        self.poll_writers = True
        self._prepared: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], set[bool]] = (
            weakref.WeakKeyDictionary()
        )

    async def claim(self, marks: Callable[[list[OutboxRow]], Marks] | None = None) -> list[str]:
        """One batch: claim, mark (published unless ``marks`` says otherwise), commit.
        The subjects' sequence numbers claimed, in claim order."""
        if self.poll_writers:
            self.start.offer(self.writers.observe(*read_writers(self.url)))
        tx = Transaction(self.conn, NAMES, self._prepared, self.start)
        claim = await tx.claim(BATCH, 20)
        rows = [row for row in claim.rows if row.subject not in claim.blockers]
        await tx.mark_and_commit(
            marks(rows) if marks else Marks(published=[row.id for row in rows])
        )
        return [row.id for row in rows]

    async def drain(self) -> list[str]:
        claimed: list[str] = []
        while found := await self.claim():
            claimed += found
        return claimed


@pytest.fixture(params=LAYOUTS)
def outbox_layout(request: pytest.FixtureRequest) -> str:
    """The start key and the late rows work on a plain table and on one partitioned
    by the minute."""
    return str(request.param)


def run(url: str, test: Callable[[Claims], Awaitable[None]]) -> None:
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(url, **POOLED_CONNECTION) as conn:
            await test(Claims(conn, url))

    asyncio.run(main())


def insert(url: str, subject: str, count: int = 1, **columns: Any) -> list[str]:
    ids = [str(uuid.uuid4()) for _ in range(count)]
    names = ", ".join(columns)
    values = ", ".join(f"%({name})s" for name in columns)
    with psycopg.connect(url, autocommit=True) as conn:
        for row_id in ids:
            conn.execute(
                "insert into outbox_events (id, event_type, source, subject, time, data"
                + (f", {names}" if columns else "")
                + ") values (%(id)s, 'a.b', 's', %(subject)s, now(), '{}'"
                + (f", {values}" if columns else "")
                + ")",
                {"id": row_id, "subject": subject, **columns},
            )
    return ids


def wait_out_the_late_insert_slack(url: str) -> None:
    """Until the database's clock is LATE_INSERT_SECONDS past its now(): a row
    created before is then old enough that only its bound covers it."""
    # Epoch seconds, which any DateStyle writes alike.
    [(started,)] = database.fetch(url, "select extract(epoch from clock_timestamp())")
    wait_until(
        lambda: database.fetch(
            url,
            "select extract(epoch from clock_timestamp()) > %s + %s",
            (started, LATE_INSERT_SECONDS),
        )[0][0],
        timeout=LATE_INSERT_SECONDS + 10,
        message="the late-insert slack to pass",
    )


def claim_index_entries(url: str, start: StartKey) -> int:
    """Entries of the claim index one claim of BATCH rows reads (it visits the heap
    for each: a dead entry costs as much as a live one), counted by the server for
    this transaction, which is rolled back. Buffers would undercount: consecutive
    entries on one heap page touch its buffer once."""
    with relay_session(url) as conn:
        conn.execute(query(NAMES, "claim"), claim_parameters(BATCH, 20, start)).fetchall()
        [(read,)] = conn.execute(
            INDEX_ENTRIES_READ, {"index": "outbox_events_relay_claim_idx"}
        ).fetchall()
        conn.rollback()
    return int(read)


# An index's entries read in this transaction; a partitioned index's, its partitions'.
INDEX_ENTRIES_READ = """
    select sum(pg_stat_get_xact_tuples_returned(i))
      from (select %(index)s::regclass union select relid from pg_partition_tree(%(index)s)) t (i)
"""


HOLDERS = ["report", "writer elsewhere", "outbox writer"]
# What `status` says of each: its kind, and whether it has written to the table.
HOLDER_STATUS = {
    "report": ("snapshot", False),
    "writer elsewhere": ("writer", False),
    "outbox writer": ("writer", True),
    "prepared outbox writer": ("prepared", True),
    "standby report": ("standby", False),
}


@contextlib.contextmanager
def horizon_held(url: str, holder: str, standby_url: str | None = None) -> Iterator[str | None]:
    """``holder`` holds the horizon back until the block ends, then lets go (a writer
    commits). Yields the id of the row it inserted into the outbox, if any."""
    with psycopg.connect(standby_url or url) as conn:
        held = None
        if holder in ("report", "standby report"):
            conn.execute("set transaction isolation level repeatable read")
            conn.execute("select count(*) from outbox_events").fetchall()
            if standby_url is not None:
                # Its feedback reaches the primary at the next status interval.
                wait_until(
                    lambda: (
                        database.fetch(
                            url,
                            "select count(*) from pg_stat_replication "
                            "where backend_xmin is not null",
                        )[0][0]
                        == 1
                    ),
                    message="the standby's feedback to hold the primary's horizon",
                )
        elif holder == "writer elsewhere":
            conn.execute("create table if not exists elsewhere (i int)")
            conn.commit()
            conn.execute("insert into elsewhere values (1)")  # an xid, idle in transaction
        else:
            [held] = insert_in(conn, "e1")
            if holder.startswith("prepared"):
                conn.execute("prepare transaction 'held'")
        yield held
        if holder.startswith("prepared"):
            database.execute(url, "commit prepared 'held'")
        else:
            conn.commit()


def insert_in(conn: psycopg.Connection[Any], subject: str) -> list[str]:
    row_id = str(uuid.uuid4())
    conn.execute(
        "insert into outbox_events (id, event_type, source, subject, time, data) "
        "values (%s, 'a.b', 's', %s, now(), '{}')",
        (row_id, subject),
    )
    return [row_id]


def without_writers(key: StartKey) -> StartKey:
    """``key`` with the snapshots' bound only, as before the writers' bound."""
    return replace(key, locks_at="-infinity", writer_xids="{}", writer_since="{}")


async def claims_cost_a_few_batches(url: str, claims: Claims, holder: str | None) -> None:
    """A claim now reads a few batches of entries, not the 200,000 dead ones that
    ``holder`` keeps (None: none), and reads them all without the writers' bound when
    a writer holds them."""
    insert(url, "s", BATCH)
    assert not claims.start.walked_from_first_entry
    key = claims.start.key()
    keyed = claim_index_entries(url, key)
    assert keyed <= 10 * BATCH, keyed
    if holder is not None:
        from_first = claim_index_entries(url, FROM_FIRST_ENTRY)
        assert from_first > 200000, from_first  # the dead entries are still there
    if holder is not None and HOLDER_STATUS[holder][0] in ("writer", "prepared"):
        # A writer holds the snapshots' xmin: only the writers' bound is left.
        assert claim_index_entries(url, without_writers(key)) > 200000
    await claims.drain()


def check_claims_behind_dead_entries(url: str, holder: str, standby_url: str | None = None) -> None:
    # While ``holder`` holds the horizon, 200,000 rows are published (their claim-index
    # entries are dead, and no vacuum or index scan may remove them), then load goes
    # on. A claim that walked from the index's first entry visited every one of them,
    # every claim. A held outbox row is claimed once its writer commits, before the
    # row of its subject committed after it, and the claims are cheap again.
    async def test(claims: Claims) -> None:
        with horizon_held(url, holder, standby_url) as held:
            database.execute(
                url,
                """insert into outbox_events (id, event_type, source, subject, time, data,
                                              created_at)
                   select gen_random_uuid(), 'a.b', 's', 'e' || (g %% 500), now(), '{}',
                          clock_timestamp()
                     from generate_series(1, 200000) g""",
            )
            # Published as the relay marks them (the claims would take 4,000 batches).
            database.execute(url, "update outbox_events set published_at = now()")
            assert await claims.drain() == []  # the first claim walks them all once
            wait_out_the_late_insert_slack(url)
            for _ in range(5):  # sustained load, light
                insert(url, "s", BATCH // 2)
                await claims.claim()
            await claims_cost_a_few_batches(url, claims, holder)
            [oldest, *_] = backlog.read_status(url, Config()).horizon.holders
            assert (oldest.kind, oldest.wrote_table) == HOLDER_STATUS[holder]
            [(dead,)] = database.fetch(
                url, "select count(*) from outbox_events where published_at is not null"
            )
            assert dead >= 200000
        if held is not None:
            after = insert(url, "e1")
            assert await claims.drain() == [held, *after]
            await claims_cost_a_few_batches(url, claims, None)

    run(url, test)


@pytest.mark.parametrize("holder", HOLDERS)
def test_a_claim_costs_a_few_batches_behind_200k_dead_entries_whatever_holds_them(db_url, holder):
    check_claims_behind_dead_entries(db_url, holder)


def test_a_prepared_transaction_that_wrote_costs_the_claims_nothing_until_it_commits():
    with throwaway_postgres(settings=["max_prepared_transactions = 4"]) as pg:
        database.install(pg.url)
        check_claims_behind_dead_entries(pg.url, "prepared outbox writer")


def test_a_report_on_a_hot_standby_with_feedback_costs_the_claims_nothing():
    with throwaway_postgres() as pg:
        database.install(pg.url)
        standby = ThrowawayStandby(
            pg, settings=["hot_standby_feedback = on", "wal_receiver_status_interval = 1s"]
        )
        try:
            standby.start()
            wait_until(
                lambda: database.fetch(
                    standby.url, "select to_regclass('outbox_events') is not null"
                )[0][0],
                message="the standby to have the table",
            )
            check_claims_behind_dead_entries(pg.url, "standby report", standby.url)
        finally:
            standby.destroy()


def test_a_row_inserted_long_after_its_created_at_is_claimed_before_later_rows(db_url):
    # A transaction reads for a while, then writes its event: the row's created_at
    # (now(), the transaction's start) is older than the relay's start key. The
    # late-insert trigger flags it, and the next claim starts there: it goes before
    # the row of its subject committed after it.
    async def test(claims: Claims) -> None:
        insert(db_url, "other", 3)
        await claims.drain()
        with psycopg.connect(db_url) as slow:
            slow.execute("select 1")  # the transaction starts: created_at is now()
            wait_out_the_late_insert_slack(db_url)
            insert(db_url, "other", 3)
            assert len(await claims.drain()) == 3  # the start key passes created_at
            late = str(uuid.uuid4())
            slow.execute(
                "insert into outbox_events (id, event_type, source, subject, time, data) "
                "values (%s, 'a.b', 's', 'e1', now(), '{}')",
                (late,),
            )
            slow.commit()
        after = insert(db_url, "e1")
        assert database.fetch(
            db_url, "select relay_late from outbox_events where id = %s", (late,)
        ) == [(True,)]
        assert await claims.drain() == [late, *after]

    run(db_url, test)


def test_rows_of_writers_held_across_many_claims_come_before_their_subjects_later_rows(db_url):
    # Three writers insert a row each at once (not late), each after a poll has seen
    # the table without it, and stay open across many claims while producers commit
    # rows of the same subjects; they commit in the reverse order. While they run, the
    # snapshots give no bound (each holds an xid); the writers' bound (relay/writers.py)
    # keeps each held row claimed after its commit, before the row of its subject
    # committed after it.
    async def test(claims: Claims) -> None:
        insert(db_url, "other", 3)
        await claims.drain()
        writers: list[tuple[str, psycopg.Connection[Any]]] = []
        held: dict[str, str] = {}
        try:
            for subject in ("e1", "e2", "e3"):
                writers.append((subject, psycopg.connect(db_url)))
                [held[subject]] = insert_in(writers[-1][1], subject)
                wait_out_the_late_insert_slack(db_url)
                for _ in range(2):
                    insert(db_url, subject, 2)
                    insert(db_url, "other", 2)
                    assert len(await claims.drain()) == 4
            for subject, conn in reversed(writers):
                conn.commit()
                after = insert(db_url, subject)
                insert(db_url, "other", 2)
                claimed = await claims.drain()
                assert [r for r in claimed if r in (held[subject], *after)] == [
                    held[subject],
                    *after,
                ]
        finally:
            for _, conn in writers:
                conn.close()
        assert database.fetch(db_url, "select count(*) from outbox_events where relay_late") == [
            (0,)
        ]

    run(db_url, test)


def test_a_requeued_row_is_claimed_before_the_rows_it_held_back(db_url):
    # A dead row leaves the claim index; the start key moves on past it. `requeue`
    # brings it back at its old place, flagged, and it goes first.
    async def test(claims: Claims) -> None:
        [dead] = insert(db_url, "e1")
        await claims.claim(
            lambda rows: Marks(failed=[FailureMark(row.id, 20, None, "x") for row in rows])
        )
        held = insert(db_url, "e1", 2)
        wait_out_the_late_insert_slack(db_url)
        for _ in range(3):
            insert(db_url, "other", 3)
            assert len(await claims.drain()) == 3  # e1 is held behind its dead row
        with psycopg.connect(db_url) as conn:
            conn.execute(query(NAMES, "requeue_reset"), {"ids": [dead]})
        assert await claims.drain() == [dead, *held]

    run(db_url, test)


def test_a_held_horizon_is_reported_by_the_gauges_and_named_by_status(db_url, stream, start_relay):
    relay = start_relay(gauge_interval="200ms")
    with psycopg.connect(db_url, application_name="nightly-report") as reporting:
        reporting.execute("set transaction isolation level repeatable read")
        reporting.execute("select count(*) from outbox_events").fetchall()
        database.insert(db_url, [Event(stream.subject("a"), "e1") for _ in range(50)])
        wait_until(lambda: relay.metric("outbox_relay_horizon_transactions") > 0)
        wait_until(lambda: relay.metric("outbox_relay_horizon_age_seconds") >= 1.0)
        assert relay.metric("outbox_relay_table_bytes") > 0
        [(pid,)] = database.fetch(
            db_url, "select pid from pg_stat_activity where application_name = 'nightly-report'"
        )
        status = backlog.read_status(db_url, Config())
        [held] = [h for h in status.horizon.holders if h.pid == pid]
        assert held.visible
        assert held.state == "idle in transaction"
        lines = "\n".join(backlog.render_horizon(status.horizon, shown_from=0.0))
        assert f"by session 'nightly-report' (pid {pid}, idle in transaction)" in lines
        reporting.rollback()
    wait_until(lambda: relay.metric("outbox_relay_horizon_transactions") == 0)


def test_a_writer_of_the_table_is_told_from_a_report_by_status_and_the_gauges(
    db_url, stream, start_relay
):
    relay = start_relay(gauge_interval="200ms")
    with psycopg.connect(db_url, application_name="leaked-orm-session") as writer:
        first = Event(stream.subject("a"), "e1")
        writer.execute(
            database.INSERT,
            (first.id, first.event_type, first.source, first.subject, first.time, "{}"),
        )  # then idle in its transaction
        held = str(first.id)
        [(pid,)] = database.fetch(
            db_url, "select pid from pg_stat_activity where application_name = %s",
            ("leaked-orm-session",),
        )  # fmt: skip
        wait_until(lambda: relay.metric("outbox_relay_horizon_holder", kind="writer") == 1)
        wait_until(lambda: relay.metric("outbox_relay_table_writers") >= 1)
        later = [Event(stream.subject("a"), "e1") for _ in range(5)]
        database.insert(db_url, later)
        wait_until(lambda: len(stream.read()) == 5, message="rows committed after it")
        # The claims kept their bound: the writer holds the snapshots' xmin, not theirs.
        assert relay.metric("outbox_relay_claims_bounded") == 1
        status = backlog.read_status(db_url, Config())
        [holder] = [h for h in status.horizon.holders if h.pid == pid]
        assert (holder.kind, holder.wrote_table) == ("writer", True)
        lines = "\n".join(backlog.render_horizon(status.horizon, shown_from=0.0))
        assert f"by session with an xid 'leaked-orm-session' (pid {pid}, " in lines
        assert "it has written to the outbox table" in lines
        assert "idle_in_transaction_session_timeout is the backstop" in lines
        writer.commit()
    wait_until(lambda: len(stream.read()) == 6, message="the held row, after its commit")
    assert [m.msg_id for m in stream.read()][-1] == held
    wait_until(lambda: relay.metric("outbox_relay_horizon_holder", kind="writer") == 0)


def test_status_names_a_holder_it_may_not_see_and_the_grant_that_would_show_it(db_url):
    role = f"outbox_status_{uuid.uuid4().hex[:8]}"
    database.execute(db_url, f'create role "{role}" login')
    database.execute(db_url, f'grant select on outbox_events to "{role}"')
    try:
        with psycopg.connect(db_url, application_name="nightly-report") as reporting:
            reporting.execute("set transaction isolation level repeatable read")
            reporting.execute("select count(*) from outbox_events").fetchall()
            url = db_url.replace("postgresql://postgres@", f"postgresql://{role}@", 1)
            status = backlog.read_status(url, Config())
            [held] = [h for h in status.horizon.holders if h.name == "nightly-report"]
            assert not held.visible
            lines = "\n".join(backlog.render_horizon(status.horizon))
            assert "hidden from this role (grant it pg_read_all_stats" in lines
            reporting.rollback()
    finally:
        database.execute(db_url, f'drop owned by "{role}"')
        database.execute(db_url, f'drop role "{role}"')


@pytest.mark.parametrize("outbox_layout", ["plain"])  # a partitioned table deletes no row
def test_retention_walks_on_from_its_last_row_past_the_dead_entries_it_left(db_url):
    # (A partitioned table's retention drops partitions and deletes no row.)
    # 50,000 spent rows, deleted 1,000 a statement while the horizon is held: each
    # delete leaves a dead entry at the head of the published_at index. Walking on
    # from the last row deleted, every statement reads about its batch; from the
    # first entry, the last one read every entry the others left.
    database.execute(
        db_url,
        """insert into outbox_events (id, event_type, source, subject, time, data, published_at)
           select gen_random_uuid(), 'a.b', 's', 'e', now(), '{}',
                  now() - interval '1 day' + g * interval '1 ms'
             from generate_series(1, 50000) g""",
    )
    index = "outbox_events_relay_published_idx"

    def delete(after: str) -> tuple[int, str | None, int]:
        with relay_session(db_url) as conn:
            count, last = conn.execute(
                query(NAMES, "delete_spent"),
                {"retention": 3600, "batch_size": 1000, "after": after, "lookback": 600},
            ).fetchone()
            [(read,)] = conn.execute(INDEX_ENTRIES_READ, {"index": index}).fetchall()
            conn.commit()
        return count, last, int(read)

    with psycopg.connect(db_url) as reporting:
        reporting.execute("set transaction isolation level repeatable read")
        reporting.execute("select count(*) from outbox_events").fetchall()
        after = "-infinity"
        for _ in range(49):
            count, last, read = delete(after)
            assert count == 1000
            assert read <= 1001, read
            after = last
        count, _, read = delete("-infinity")
        assert count == 1000
        assert read >= 49000, read  # what every statement read, walking from the first
        reporting.rollback()


def swept(url: str, claims: Claims) -> bool:
    """Whether the sweep (off the claim's path, every minute in the relay) finds a
    live row before where the claims start."""
    key = claims.start.key()
    params = {"start_at": key.start_at, "start_seq": key.start_seq, "bound_at": key.bound_at}
    with psycopg.connect(url) as conn:
        [(found,)] = conn.execute(query(NAMES, "sweep"), params).fetchall()
    return bool(found)


async def published_then_passed(url: str, claims: Claims) -> str:
    """A row of subject e1, published, then passed by the start key (rows of other
    subjects claimed after the late-insert slack)."""
    [row] = insert(url, "e1")
    assert await claims.drain() == [row]
    wait_out_the_late_insert_slack(url)
    for _ in range(3):
        insert(url, "other", 3)
        assert len(await claims.drain()) == 3
    assert not claims.start.walked_from_first_entry
    return row


async def a_known_bound(url: str, claims: Claims) -> StartKey:
    """The start key once it carries the snapshots' bound, claiming a row of another
    subject at a time until it does: a claim's bound is known once an earlier claim's
    transaction is older than every one still running on the server, and any
    database's transaction (a test's teardown, autovacuum's) can hold that back."""
    while (key := claims.start.key()).bound_at == UNKNOWN:
        insert(url, "other")
        assert len(await claims.drain()) == 1
    return key


def test_a_row_put_back_by_hand_is_claimed_before_the_later_rows_of_its_subject(db_url):
    # A published row set unpublished again by hand (not with `requeue`, as an older
    # relay's requeue did): the revival trigger flags it late, and the next claim
    # starts there. No sweep is needed.
    async def test(claims: Claims) -> None:
        put_back = await published_then_passed(db_url, claims)
        database.execute(
            db_url, "update outbox_events set published_at = null where id = %s", (put_back,)
        )
        after = insert(db_url, "e1")
        assert await claims.drain() == [put_back, *after]

    run(db_url, test)


def test_a_dead_row_brought_back_by_hand_and_a_row_moved_back_are_flagged(db_url):
    async def test(claims: Claims) -> None:
        await published_then_passed(db_url, claims)
        [dead, moved] = insert(db_url, "e2", 2)
        database.execute(
            db_url,
            "update outbox_events set relay_dead_at = now(), relay_retry_at = 'infinity' "
            "where id = %s",
            (dead,),
        )
        assert await claims.drain() == []  # e2 is held behind its dead row
        database.execute(
            db_url,
            "update outbox_events set relay_dead_at = null, relay_retry_at = null where id = %s",
            (dead,),
        )
        database.execute(
            db_url,
            "update outbox_events set created_at = created_at - interval '1 hour' where id = %s",
            (moved,),
        )
        assert database.fetch(
            db_url, "select relay_late from outbox_events where id = any(%s::uuid[])",
            ([dead, moved],),
        ) == [(True,), (True,)]  # fmt: skip
        assert await claims.drain() == [moved, dead]

    run(db_url, test)


def late_keys(url: str) -> list[tuple[str, bool]]:
    """The late rows' keys: each row's id, and whether the key matches a live late row
    exactly."""
    return database.fetch(
        url,
        "select k.id::text, exists (select 1 from outbox_events t where t.id = k.id "
        "and t.created_at = k.created_at and t.relay_seq = k.relay_seq and t.relay_late "
        "and coalesce(t.published_at, t.relay_dead_at) is null) "
        "from public.outbox_events_relay_late_keys k order by k.created_at, k.relay_seq",
    )


def test_a_late_rows_key_is_kept_where_the_claims_look_from_its_insert_to_its_end(db_url):
    # The claims look for late rows in their keys' table: every way a row becomes a
    # live late row writes its key, every way it stops being one removes it, in the
    # same transaction; a producer's role that may only insert still writes the key,
    # and its temporary table of the same name does not stand in for the real one;
    # and a publication of every table (for a CDC reader) does not stop a key's delete.
    producer = f"producer_{uuid.uuid4().hex[:12]}"
    database.execute(db_url, f"create role {producer}")
    database.execute(db_url, "create publication every_table for all tables")
    try:
        database.execute(db_url, f"grant insert on outbox_events to {producer}")
        database.execute(db_url, f"grant usage on sequence outbox_events_relay_seq to {producer}")
        late, on_time = str(uuid.uuid4()), str(uuid.uuid4())
        insert_as_producer = (
            "insert into outbox_events (id, event_type, source, subject, time, data, created_at) "
            "values (%s, 'a.b', 't', 'e1', now(), '{}', %s) on conflict do nothing"
        )
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(f"set role {producer}")
            conn.execute(
                "create temporary table outbox_events_relay_late_keys "
                "(id uuid, created_at timestamptz, relay_seq bigint)"
            )
            conn.execute(insert_as_producer, (late, "2026-01-01 00:00:00+00"))
            conn.execute(insert_as_producer, (on_time, datetime.datetime.now(datetime.UTC)))
            # The same row again, skipped by "on conflict do nothing": no second key.
            conn.execute(insert_as_producer, (late, "2026-01-01 00:00:00+00"))
            assert conn.execute(
                "select count(*) from outbox_events_relay_late_keys"
            ).fetchall() == [(0,)]
        assert late_keys(db_url) == [(late, True)]

        def update(assignments: str) -> list[tuple[str, bool]]:
            database.execute(
                db_url, f"update outbox_events set {assignments} where id = %s", (late,)
            )
            return late_keys(db_url)

        assert update("attempts = attempts + 1, relay_retry_at = now()") == [(late, True)]
        assert update("published_at = now(), relay_retry_at = null") == []
        assert update("published_at = null") == [(late, True)]  # put back by hand
        assert update("created_at = created_at + interval '1 minute'") == [(late, True)]
        assert update("relay_dead_at = now(), relay_retry_at = 'infinity'") == []
        assert update("relay_dead_at = null, relay_retry_at = null") == [(late, True)]
        database.execute(db_url, "delete from outbox_events where id = %s", (late,))
        assert late_keys(db_url) == []
        # An on-time row moved back in time is flagged, and its key written.
        database.execute(
            db_url,
            "update outbox_events set created_at = created_at - interval '1 hour' where id = %s",
            (on_time,),
        )
        assert late_keys(db_url) == [(on_time, True)]
        # TRUNCATE fires no row trigger: the key outlives its row until retention's purge.
        database.execute(db_url, "truncate outbox_events")
        assert late_keys(db_url) == [(on_time, False)]
        with psycopg.connect(db_url, autocommit=True) as conn:
            assert conn.execute(query(NAMES, "purge_late_keys")).rowcount == 1
        assert late_keys(db_url) == []
    finally:
        database.execute(db_url, "drop publication every_table")
        database.execute(db_url, f"drop owned by {producer}")
        database.execute(db_url, f"drop role {producer}")


def test_the_sweep_finds_a_row_put_back_while_the_triggers_were_off_between_claims(db_url):
    # The triggers disabled, a row put back, the triggers enabled again, all between
    # two claims: no claim saw them off (its guard would have walked from the first
    # entry), and nothing flagged the row. The sweep sees it, and the next claim walks
    # from the first entry.
    async def test(claims: Claims) -> None:
        put_back = await published_then_passed(db_url, claims)
        assert not swept(db_url, claims)
        with psycopg.connect(db_url) as conn:
            conn.execute("alter table outbox_events disable trigger zz_outbox_events_relay_revived")
            conn.execute("update outbox_events set published_at = null where id = %s", (put_back,))
            conn.execute(
                "alter table outbox_events enable always trigger zz_outbox_events_relay_revived"
            )
        assert await claims.drain() == []  # past the start key: no claim sees it
        assert swept(db_url, claims)
        claims.start.rewind()
        assert await claims.drain() == [put_back]
        assert not swept(db_url, claims)

    run(db_url, test)


async def walk_from_the_start_key_again(url: str, claims: Claims) -> None:
    """With the triggers back, the next claim still walks from the first entry, and
    the one after it from its start key again."""
    insert(url, "other")
    await claims.drain()
    insert(url, "other")
    await claims.drain()
    assert not claims.start.walked_from_first_entry


@pytest.mark.parametrize("how", ["disabled", "key disabled", "uninstalled"])
def test_while_the_late_row_triggers_do_not_fire_every_claim_walks_from_the_first_entry(
    db_url, how
):
    # Disabled by hand, or the SQL uninstalled while relays run: an old created_at
    # goes unflagged, or flagged with no key where the claims look. The claim's guard
    # sees the triggers off and walks from the first entry, so the row goes before the
    # later row of its subject, and the claims keep walking from there until one does
    # so with the triggers back.
    async def test(claims: Claims) -> None:
        await published_then_passed(db_url, claims)
        if how == "disabled":
            database.execute(
                db_url, "alter table outbox_events disable trigger zz_outbox_events_relay_late"
            )
        elif how == "key disabled":
            database.execute(
                db_url,
                "alter table outbox_events disable trigger zz_outbox_events_relay_late_key_added",
            )
        else:
            relay_database.uninstall(db_url, NAMES)
        [old] = insert(db_url, "e1", created_at="2026-01-01 00:00:00+00", relay_seq=1)
        after = insert(db_url, "e1", relay_seq=2)
        assert await claims.drain() == [old, *after]
        assert claims.start.walked_from_first_entry
        database.install(db_url)
        await walk_from_the_start_key_again(db_url, claims)

    run(db_url, test)


# A partitioned table attached as a partition (an archive of older partitions, say):
# its own partitions carry the triggers, one level further down.
SUB_PARTITIONED = """
do $$
declare bound text := (select pg_get_expr(relpartbound, oid) from pg_class
                        where relname = 'outbox_events_before');
begin
  alter table outbox_events detach partition outbox_events_before;
  create table outbox_events_archive (like outbox_events including defaults
                                      including constraints) partition by range (created_at);
  execute 'alter table outbox_events_archive attach partition outbox_events_before ' || bound;
  execute 'alter table outbox_events attach partition outbox_events_archive ' || bound;
end $$;
"""


@pytest.mark.parametrize("outbox_layout", ["partitioned"])
@pytest.mark.parametrize("depth", ["partition", "partition of a partition"])
def test_a_late_row_trigger_disabled_on_one_partition_makes_claims_walk_from_the_first_entry(
    db_url, depth
):
    # Each partition carries its own copies of the triggers, and ALTER TABLE on one
    # partition disables only its copy: the parent's stay enabled. The claim's guard
    # and the start-up check look at every partition's, at every level.
    if depth != "partition":
        database.execute(db_url, SUB_PARTITIONED)
        assert database.fetch(db_url, query(NAMES, "late_guard")) == [([],)]

    async def test(claims: Claims) -> None:
        await published_then_passed(db_url, claims)
        disable = "alter table outbox_events_before {} trigger zz_outbox_events_relay_late"
        database.execute(db_url, disable.format("disable"))
        [(problems,)] = database.fetch(db_url, query(NAMES, "late_guard"))
        assert problems == [
            "the late-row triggers do not fire ALWAYS on partition outbox_events_before"
        ]
        [old] = insert(db_url, "e1", created_at="2026-01-01 00:00:00+00", relay_seq=1)
        assert database.fetch(
            db_url,
            "select tableoid::regclass::text, relay_late is true from outbox_events where id = %s",
            (old,),
        ) == [("outbox_events_before", False)]  # fmt: skip
        after = insert(db_url, "e1", relay_seq=2)
        assert await claims.drain() == [old, *after]
        assert claims.start.walked_from_first_entry
        database.execute(db_url, disable.format("enable always"))
        assert database.fetch(db_url, query(NAMES, "late_guard")) == [([],)]
        await walk_from_the_start_key_again(db_url, claims)

    run(db_url, test)


def _dbname(url: str) -> str:
    return url.rsplit("/", 1)[-1]


def test_rows_written_under_the_replica_role_or_with_a_null_relay_seq_keep_their_order(db_url):
    # session_replication_role = replica (logical replication's apply, pg_restore)
    # skips ordinary triggers; the relay's fire ALWAYS. A null relay_seq (an explicit
    # null, a COPY that carries the column) is numbered by the same trigger.
    async def test(claims: Claims) -> None:
        await published_then_passed(db_url, claims)
        with psycopg.connect(db_url) as conn:
            conn.execute("set session_replication_role = replica")
            replica = str(uuid.uuid4())
            conn.execute(
                "insert into outbox_events (id, event_type, source, subject, time, data, "
                "created_at, relay_seq) values (%s, 'a.b', 's', 'e1', now(), '{}', "
                "now() - interval '10 seconds', null)",
                (replica,),
            )
            conn.commit()
        copied = str(uuid.uuid4())
        with psycopg.connect(db_url) as conn, conn.cursor() as cursor:
            columns = "id, event_type, source, subject, time, data, relay_seq"
            with cursor.copy(f"copy outbox_events ({columns}) from stdin") as copy:
                copy.write_row((copied, "a.b", "s", "e1", "2026-12-05 00:00:00+00", "{}", None))
        [explicit] = insert(db_url, "e1", relay_seq=None)
        after = insert(db_url, "e1")
        assert database.fetch(
            db_url, "select count(*) from outbox_events where relay_seq is null "
            "and published_at is null",
        ) == [(0,)]  # fmt: skip
        assert await claims.drain() == [replica, copied, explicit, *after]

    run(db_url, test)


def test_a_live_row_without_a_relay_seq_is_refused_while_the_trigger_is_off(db_url):
    # The table's check holds what the trigger gives: with the trigger disabled, a
    # producer's explicit null fails its own transaction rather than sit unclaimable.
    database.execute(
        db_url, "alter table outbox_events disable trigger zz_outbox_events_relay_late"
    )
    with pytest.raises(psycopg.errors.CheckViolation):
        insert(db_url, "e1", relay_seq=None)


def test_a_service_trigger_that_waits_before_the_insert_takes_its_xid_loses_no_order(db_url):
    # A BEFORE INSERT trigger of the service's own that sorts after the relay's and
    # waits (a lock, a lookup): the row's xid would come after the relay's clock test,
    # and claims meanwhile would bound their start past its created_at. The relay's
    # test takes the xid first, so the snapshot's xmin holds the bound back.
    database.execute(
        db_url,
        """
        create function zzz_service_lookup() returns trigger language plpgsql as $$
        begin
          perform pg_sleep(2 * {slack});
          return new;
        end $$;
        create trigger zzz_service_lookup before insert on outbox_events
          for each row when (new.subject = 'e1') execute function zzz_service_lookup();
        """.replace("{slack}", str(LATE_INSERT_SECONDS)),
    )
    [(problems,)] = database.fetch(db_url, query(NAMES, "late_guard"))
    assert problems == [
        "the BEFORE row trigger zzz_service_lookup fires after the late-row triggers and "
        "may change created_at unseen"
    ]

    async def test(claims: Claims) -> None:
        insert(db_url, "other", 3)
        await claims.drain()
        slow = str(uuid.uuid4())
        done = asyncio.Event()

        async def service_insert() -> None:
            async with await psycopg.AsyncConnection.connect(db_url) as conn:
                await conn.execute(
                    "insert into outbox_events (id, event_type, source, subject, time, data) "
                    "values (%s, 'a.b', 's', 'e1', now(), '{}')",
                    (slow,),
                )
                await conn.commit()
            done.set()

        task = asyncio.create_task(service_insert())
        claimed: list[str] = []
        while not done.is_set():  # claims of other subjects while it waits
            insert(db_url, "other")
            claimed += await claims.drain()
            await asyncio.sleep(0.05)
        await task
        database.execute(db_url, "drop trigger zzz_service_lookup on outbox_events")
        [later] = insert(db_url, "e1")
        claimed += await claims.drain()
        assert slow in claimed
        assert claimed.index(slow) < claimed.index(later)

    run(db_url, test)


def test_a_claim_whose_clock_is_behind_its_bound_walks_from_the_first_entry(db_url):
    # The database's clock stepped back: rows committed since may carry created_at
    # values before the bound. The claim's guard sees its statement time behind the
    # bound and walks from the first entry, and says so.
    async def test(claims: Claims) -> None:
        [early] = insert(db_url, "e1")  # on time: not flagged late
        ahead = StartKey("infinity", MAX_SEQ, "9999-01-01 00:00:00+00")
        claims.start._key = ahead  # as if the last claims ran on a clock years ahead
        assert claims.start.key() == ahead
        assert await claims.claim() == [early]
        assert claims.start.walked_from_first_entry

    run(db_url, test)


@pytest.mark.parametrize("where", ["database", "role"])
def test_a_database_whose_datestyle_is_not_iso_keeps_exact_start_keys(db_url, where):
    # 'SQL, DMY' with Asia/Kolkata writes a time as "05/12/2026 15:49:10 IST", which
    # Postgres reads back as Israel's time: the start key and retention's cursor must
    # cross as text that does not depend on them.
    name = _dbname(db_url)
    target = f'database "{name}"'
    if where == "role":
        [(role,)] = database.fetch(db_url, "select current_user")
        target = f'role "{role}" in {target}'
    database.execute(db_url, f"alter {target} set datestyle = 'SQL, DMY'")
    database.execute(db_url, f"alter {target} set timezone = 'Asia/Kolkata'")
    try:

        async def test(claims: Claims) -> None:
            await published_then_passed(db_url, claims)
            async with asyncio.timeout(30):
                key = await a_known_bound(db_url, claims)
            assert key.bound_at.endswith(" AD"), key  # UTC, ISO order, the era
            [early] = insert(db_url, "e1", created_at="2026-01-01 00:00:00+00")
            after = insert(db_url, "e1")
            assert await claims.drain() == [early, *after]
            insert(db_url, "other", 3)
            assert len(await claims.drain()) == 3
            assert not claims.start.walked_from_first_entry

        run(db_url, test)
    finally:
        database.execute(db_url, f"alter {target} reset all")
