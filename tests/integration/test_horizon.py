"""A held MVCC horizon: what a claim costs behind the dead entries it leaves, and
the rows a claim that starts from a key, not from the claim index's first entry,
must still find (relay/claimstart.py, the claim in sql/queries.sql).

The claims here are the relay's own (Transaction.claim with a ClaimStart), run in
the test's process so the plan of the next claim can be read with the key the
relay would use."""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from relay import backlog
from relay.claimstart import FROM_FIRST_ENTRY, LATE_INSERT_SECONDS, ClaimStart, StartKey
from relay.config import Config
from relay.database import POOLED_CONNECTION, Transaction
from relay.marks import FailureMark, Marks
from relay.model import OutboxRow
from relay.sqlfiles import Names, claim_parameters, query
from tests.support import database
from tests.support.database import Event, relay_session
from tests.support.relayproc import wait_until

pytestmark = pytest.mark.integration

NAMES = Names.for_config(Config())
BATCH = 50


class Claims:
    """The relay's claims on one pooled-style connection, with its start key."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.start = ClaimStart()
        self._prepared: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()

    async def claim(self, marks: Callable[[list[OutboxRow]], Marks] | None = None) -> list[str]:
        """One batch: claim, mark (published unless ``marks`` says otherwise), commit.
        The subjects' sequence numbers claimed, in claim order."""
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


def run(url: str, test: Callable[[Claims], Awaitable[None]]) -> None:
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(url, **POOLED_CONNECTION) as conn:
            await test(Claims(conn))

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
    [(started,)] = database.fetch(url, "select clock_timestamp()")
    wait_until(
        lambda: database.fetch(
            url,
            "select clock_timestamp() > %s + make_interval(secs => %s)",
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
            "select pg_stat_get_xact_tuples_returned('outbox_events_relay_claim_idx'::regclass)"
        ).fetchall()
        conn.rollback()
    return int(read)


def test_a_claim_costs_a_few_batches_behind_200k_dead_entries_the_horizon_keeps(db_url):
    # A reporting transaction holds the horizon; 200,000 rows are published meanwhile
    # (their claim-index entries are dead, and no vacuum or index scan may remove
    # them), then load goes on. A claim that walked from the index's first entry
    # visited every one of them, every claim.
    with psycopg.connect(db_url) as reporting:
        reporting.execute("set transaction isolation level repeatable read")
        reporting.execute("select count(*) from outbox_events").fetchall()
        database.execute(
            db_url,
            """insert into outbox_events (id, event_type, source, subject, time, data,
                                          created_at)
               select gen_random_uuid(), 'a.b', 's', 'e' || (g %% 500), now(), '{}',
                      clock_timestamp()
                 from generate_series(1, 200000) g""",
        )

        async def test(claims: Claims) -> None:
            assert len(await claims.drain()) == 200000  # the first claim walks it all once
            wait_out_the_late_insert_slack(db_url)
            for _ in range(5):  # sustained load, light
                insert(db_url, "s", BATCH // 2)
                await claims.claim()
            insert(db_url, "s", BATCH)
            assert not claims.start.walks_from_first_entry
            keyed = claim_index_entries(db_url, claims.start.key())
            from_first = claim_index_entries(db_url, FROM_FIRST_ENTRY)
            assert keyed <= 10 * BATCH, (keyed, from_first)
            assert from_first > 200000, from_first  # the dead entries are still there

        run(db_url, test)
        [(dead,)] = database.fetch(
            db_url, "select count(*) from outbox_events where published_at is not null"
        )
        assert dead >= 200000
        reporting.rollback()


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


def test_a_row_of_a_transaction_that_commits_late_is_claimed_before_later_rows(db_url):
    # The transaction inserts at once (its row is not late) and commits after the
    # relay claimed later rows: the bound from the snapshot's xmin keeps the start
    # key at or before its created_at while it runs.
    async def test(claims: Claims) -> None:
        insert(db_url, "other", 3)
        await claims.drain()
        with psycopg.connect(db_url) as long_tx:
            late = str(uuid.uuid4())
            long_tx.execute(
                "insert into outbox_events (id, event_type, source, subject, time, data) "
                "values (%s, 'a.b', 's', 'e1', now(), '{}')",
                (late,),
            )
            wait_out_the_late_insert_slack(db_url)
            for _ in range(3):
                insert(db_url, "other", 3)
                assert len(await claims.drain()) == 3
            long_tx.commit()
        after = insert(db_url, "e1")
        assert database.fetch(
            db_url, "select relay_late from outbox_events where id = %s", (late,)
        ) == [(None,)]
        assert await claims.drain() == [late, *after]

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


def test_retention_walks_on_from_its_last_row_past_the_dead_entries_it_left(db_url):
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
                {"retention": 3600, "batch_size": 1000, "after": after},
            ).fetchone()
            [(read,)] = conn.execute(
                "select pg_stat_get_xact_tuples_returned(%s::regclass)", (index,)
            ).fetchall()
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


def test_the_sweep_finds_a_row_put_back_by_hand_and_a_rewind_claims_it(db_url):
    # A published row set unpublished again by hand (not with `requeue`): nothing
    # flags it, and the claims start past it. The sweep (off the claim's path, every
    # minute in the relay) sees it, and the next claim walks from the first entry.
    async def test(claims: Claims) -> None:
        [put_back] = insert(db_url, "e1")
        assert await claims.drain() == [put_back]
        wait_out_the_late_insert_slack(db_url)
        for _ in range(3):
            insert(db_url, "other", 3)
            assert len(await claims.drain()) == 3

        def swept() -> bool:
            key = claims.start.key()
            params = {"start_at": key.start_at, "start_seq": key.start_seq,
                      "bound_at": key.bound_at}  # fmt: skip
            with psycopg.connect(db_url) as conn:
                [(found,)] = conn.execute(query(NAMES, "sweep"), params).fetchall()
            return bool(found)

        assert not swept()
        database.execute(
            db_url, "update outbox_events set published_at = null where id = %s", (put_back,)
        )
        assert await claims.drain() == []  # past the start key: no claim sees it
        assert swept()
        claims.start.rewind()
        assert await claims.drain() == [put_back]
        assert not swept()

    run(db_url, test)
