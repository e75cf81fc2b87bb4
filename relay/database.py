"""The relay's door to Postgres: claim, gate, mark, retention, gauges, install.

psycopg errors met here are translated, once, into the relay's error tree. (The
operator commands, relay/backlog.py and relay/audit.py, and the LISTEN connection,
relay/listen_connection.py, use psycopg themselves.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable, Set
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.errors
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from relay import aio
from relay.claimstart import ClaimStart, ClaimSummary, StartKey
from relay.config import Config, show_duration
from relay.errors import DatabaseUnavailable, SetupError, first_line
from relay.horizon import Holder, read_holders
from relay.marks import Marks
from relay.model import OutboxRow, RowId
from relay.ordering import OrderKey, earliest_blockers
from relay.partitions import NewPartition, Partition, partitions_to_create, period_of
from relay.pgtrio import TrioConnection, break_connection
from relay.poolers import pooled_from_config
from relay.sqlfiles import (
    Names,
    claim_execution_template,
    claim_parameters,
    claim_preparation,
    claim_unprepared,
    claim_with_values,
    grant_script,
    install_script,
    mark_statement,
    partition_statement,
    query,
    uninstall_script,
)

log = logging.getLogger(__name__)

# Connection settings the relay wants unless the URL says otherwise. TCP keepalives
# and tcp_user_timeout turn a silently dead network path into an error within
# seconds instead of a hang of minutes.
_CONNECTION_DEFAULTS = {
    "application_name": "outbox-relay",
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
}

# Every pooled connection is in autocommit and never prepares a statement by itself.
# Autocommit: a batch opens its own transaction in the same message as its claim
# (see CLAIM_STATEMENT). Never prepared, for two reasons. A statement that psycopg
# prepared would make it drop every prepared statement, the claim's too, at the next
# rollback (psycopg deallocates all of them on ROLLBACK). And a prepared statement
# soon runs on one generic plan, made without its parameters in hand and kept until
# the table is next analyzed: for the marks, made while the table was small (a new
# or truncated table), that plan is a sequential scan, and stays one as a backlog
# piles up (docs/performance.md). Planned each time, a mark looks its rows up by
# primary key.
POOLED_CONNECTION: dict[str, Any] = {"autocommit": True, "prepare_threshold": None}

# The claim, prepared once on each pooled connection (planning it costs about as
# much as running it). A batch sends "begin; execute" as one simple-protocol
# message: a driver-side transaction would cost a round trip for its BEGIN before
# the claim could be sent, a third of a light-load claim (docs/performance.md).
CLAIM_STATEMENT = sql.Identifier("outbox_relay_claim")
# A partitioned table's claim (its walks bounded: walk_ceiling in sql/queries.sql),
# under a name of its own: a table migrated to partitions under a running relay
# finds the plain one prepared on its connections.
PARTITIONED_CLAIM_STATEMENT = sql.Identifier("outbox_relay_claim_partitioned")
# A partitioned table's claim runs on its generic plan always (claim_execution).
GENERIC_PLAN = "force_generic_plan"
# The claim's execution as bytes with a %s for each value, by (partitioned, begin,
# encoding), as the marks' statements are kept (Names.encoded): composing them afresh
# each batch was about 4% of a steady-load relay's samples (docs/performance.md).
_CLAIM_TEMPLATES: dict[tuple[bool, bool, str], bytes] = {}

# How long giving a connection back may take (its rollback) before the connection
# is taken for dead and closed.
RETURN_TIMEOUT = 5.0

# A batch's connection is kept by the batches, trio-side, for this long after it left
# the pool, and goes back to the pool after the first batch past it: a batch then
# costs no crossing into asyncio to take one or give it back, and the pool still sees
# each connection often enough to recycle it (max_lifetime). One is kept: light load
# runs one batch at a time; a second batch in flight takes and returns its own.
KEEP_OUT_OF_POOL = 60.0

_SETUP_ERRORS = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedColumn,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.InvalidSchemaName,
    psycopg.errors.InsufficientPrivilege,
)


def connection_string(url: str) -> str:
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        # libpq quotes the token it stumbled on, which may be a password: not shown.
        reason = re.sub(r'"[^"]*"', '"..."', first_line(exc))
        raise SetupError(f"database URL cannot be parsed: {reason}") from None
    for key, value in _CONNECTION_DEFAULTS.items():
        params.setdefault(key, value)
    return make_conninfo(**{k: str(v) for k, v in params.items()})


def translate(exc: BaseException, doing: str) -> Exception:
    """The relay's error for a psycopg (or pool) exception raised while ``doing``."""
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return SetupError(
            f"{doing}: {first_line(exc)} (the relay's role lacks a grant it needs: "
            "`outbox-relay install --grant-to ROLE` grants them)"
        )
    if isinstance(exc, _SETUP_ERRORS):
        return SetupError(f"{doing}: {exc.__class__.__name__}: {str(exc).strip()}")
    if isinstance(exc, PoolTimeout):
        return DatabaseUnavailable(f"{doing}: no database connection available ({exc})")
    return DatabaseUnavailable(f"{doing}: {exc.__class__.__name__}: {first_line(exc)}")


@asynccontextmanager
async def translated(doing: str) -> AsyncIterator[None]:
    try:
        yield
    except (psycopg.Error, PoolTimeout) as exc:
        raise translate(exc, doing) from exc


@dataclass(frozen=True)
class SetupReport:
    trigger_present: bool
    # What the start keys rest on and the table lacks (the late_guard query): while
    # the late-row triggers do not fire, every claim walks from the claim index's
    # first entry (relay/claimstart.py, the claim's guard).
    late_guard_problems: list[str]
    # Rows found at the cap without relay_dead_at, or dead as an earlier version left
    # them (not holding their subject), and marked dead now (the adopt_dead query).
    adopted_dead: int


async def _execute_and_commit(
    conn: psycopg.AsyncConnection[Any],
    statements: list[tuple[bytes, dict[str, Any]]],
    crash_before_commit: Callable[[], None] | None,
) -> None:
    """The statements and the COMMIT in one simple-protocol message, each statement's
    parameters bound client-side (psycopg quotes them): one round trip, without the
    pipeline's machinery (entering, syncing and leaving it were 7% of a light-load
    relay's profile: docs/performance.md).
    Planned with their values in hand, as on a pooled connection they would be anyway
    (see POOLED_CONNECTION). An error ends the message: the COMMIT is not run."""
    cursor = psycopg.AsyncClientCursor(conn)
    bound = [cursor.mogrify(statement, params) for statement, params in statements]
    if crash_before_commit is not None:
        # Test-only: let the server apply the marks, then die before COMMIT.
        if bound:
            await cursor.execute(";\n".join(bound))
        crash_before_commit()
    await cursor.execute(";\n".join([*bound, "commit"]))


def _uuid_array(ids: list[RowId]) -> str:
    """``ids`` as one Postgres array literal, sent untyped and read as uuid[]."""
    return "{" + ",".join(ids) + "}"


async def _give_back(pool: AsyncConnectionPool[TrioConnection], conn: TrioConnection) -> None:
    """asyncio side: roll back whatever the connection was doing and return it to the
    pool. A connection that cannot roll back within a few seconds (a dead path) is
    closed, and the pool replaces it, rather than leaked out of the pool."""
    try:
        # The timer only when there is something to roll back: a batch that committed
        # gives its connection back idle, and a timer costs a pass of the scheduler.
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            async with asyncio.timeout(RETURN_TIMEOUT):
                await conn.rollback()
    except (psycopg.Error, TimeoutError):
        break_connection(conn)
        with contextlib.suppress(psycopg.Error):
            await conn.close()
    await pool.putconn(conn)


async def _roll_back_from_trio(conn: TrioConnection) -> None:
    """trio side: end whatever transaction ``conn`` is in, waiting in trio. One that
    cannot roll back within a few seconds (a dead path) is closed: the pool replaces
    it when it comes back."""
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        return
    with trio.move_on_after(RETURN_TIMEOUT):
        try:
            await conn.rollback()
        except psycopg.Error:
            pass
        else:
            return
    break_connection(conn)
    with contextlib.suppress(psycopg.Error):
        await conn.close()


async def _notify(conninfo: str, channel: str, payload: str) -> None:
    conn = await psycopg.AsyncConnection.connect(conninfo, autocommit=True)
    async with conn:
        await conn.execute("select pg_notify(%s, %s)", (channel, payload))


@dataclass(frozen=True)
class Claim:
    rows: list[OutboxRow]
    blockers: dict[str, OrderKey]
    from_first_entry: bool = False  # its walks started at the claim index's first entry
    # Live flagged rows lie beyond where its walks ended: the next claim takes them.
    found_beyond: bool = False
    # A partitioned table's claim whose walks went past their reach, to the end, for
    # rows from the future.
    past_reach: bool = False
    # Its first run was refused, for rows below its walks' floor, and it ran again
    # without the floor.
    below_floor: bool = False


@dataclass(frozen=True)
class Deleted:
    count: int
    last_published_at: str | None  # exact, as Postgres text; None when none went


@dataclass(frozen=True)
class Backlog:
    unpublished: int
    dead: int
    skipped: int
    held_subjects: int
    oldest_age_seconds: float


class Transaction:
    """One claim-publish-mark transaction on one connection (in autocommit, as
    :data:`POOLED_CONNECTION` makes them: the claim opens the transaction). trio side:
    its statements are waited on by trio (:class:`relay.pgtrio.TrioConnection`).

    ``prepared`` holds the claims each connection has prepared; ``start``
    carries where the claim's walks start from one claim to the next."""

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        names: Names,
        prepared: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], set[bool]],
        start: ClaimStart,
        local_settings: dict[str, str] | None = None,
        *,
        partitioned: bool = False,
    ) -> None:
        self._conn = conn
        self._partitioned = partitioned
        self._names = names
        self._prepared = prepared
        self._start = start
        # Behind a transaction pooler: the settings each transaction sets for itself,
        # and the claim goes unprepared (see claim_unprepared).
        self._local_settings = local_settings
        # The claimed rows' created_at, earliest and latest, a second wider: the marks'
        # bounds, by which a partitioned table's planner keeps to their partitions.
        self._created_span = (float("-inf"), float("inf"))

    async def claim(
        self, batch_size: int, max_attempts: int, ours: Set[RowId] = frozenset()
    ) -> Claim:
        """The next batch, and the rows outside it that hold some of it back (other
        than ``ours``, this relay's own batches in flight)."""
        conn = self._conn
        partitioned = self._partitioned
        async with translated("claim"):
            cursor = psycopg.AsyncClientCursor(conn)
            start = self._start.sending(time.monotonic())
            found = await self._run_claim(cursor, batch_size, max_attempts, start, begin=True)
            below_floor = found[-1][9] == 1
            if below_floor:
                # Refused (walk_floor in sql/queries.sql): it claimed nothing. Again in
                # the same transaction, from the start key alone.
                start = self._start.without_floor(start)
                found = await self._run_claim(cursor, batch_size, max_attempts, start)
        # The last row is the claim's summary (blocker null): where the next starts.
        *found, summary = found
        (_, start_at, statement_at, xmin, xid, guard_off, finished, _, start_seq, _,
         from_first, bound_at, beyond) = summary  # fmt: skip
        walked = ClaimSummary(
            start_at,
            start_seq,
            statement_at,
            int(xmin),
            xid and int(xid),
            guard_off == "true",
            frozenset(int(x) for x in finished.strip("{}").split(",") if x),
            from_first == "true",
            bound_at,
            None if beyond is None else beyond == "true",
        )
        self._start.observe(walked, start)
        why = self._start.take_rewind_reason()
        if why is not None:
            log.warning(
                "claims walk the claim index from its first entry until this is mended: %s "
                "(`outbox-relay install` restores the triggers and the table's check)",
                why,
            )
        rows = [OutboxRow(*row[1:]) for row in found if not row[0]]
        if rows:
            created = [row.created_at for row in rows]
            self._created_span = (min(created) - 1.0, max(created) + 1.0)
        blockers = earliest_blockers(
            ((row[4], (row[7], row[8], row[1])) for row in found if row[0]), ours
        )
        return Claim(
            rows,
            blockers,
            walked.from_first_entry,
            self._start.found_beyond,
            partitioned and start.ceiling == "infinity" and not walked.from_first_entry,
            below_floor,
        )

    async def _run_claim(
        self,
        cursor: psycopg.AsyncClientCursor[Any],
        batch_size: int,
        max_attempts: int,
        start: StartKey,
        *,
        begin: bool = False,
    ) -> list[Any]:
        """The claim's rows from ``start`` (opening the transaction with ``begin``),
        its summary last."""
        conn = self._conn
        partitioned = self._partitioned
        if self._local_settings is not None:
            if begin:
                text = claim_unprepared(
                    self._names,
                    batch_size,
                    max_attempts,
                    start,
                    self._local_settings,
                    partitioned=partitioned,
                )
            else:
                text = claim_with_values(
                    self._names, batch_size, max_attempts, start, partitioned=partitioned
                )
            await cursor.execute(text)
            leading = 2 if begin else 0  # the BEGIN's result and the settings'
        else:
            statement = PARTITIONED_CLAIM_STATEMENT if partitioned else CLAIM_STATEMENT
            prepared = self._prepared.setdefault(conn, set())
            if partitioned not in prepared:
                await conn.execute(
                    claim_preparation(self._names, statement, partitioned=partitioned)
                )
                prepared.add(partitioned)
            key = (partitioned, begin, conn.info.encoding)
            if (template := _CLAIM_TEMPLATES.get(key)) is None:
                template = _CLAIM_TEMPLATES[key] = claim_execution_template(
                    statement, begin=begin, plan_cache_mode=GENERIC_PLAN if partitioned else None
                ).as_bytes(conn)
            values = tuple(claim_parameters(batch_size, max_attempts, start).values())
            try:
                await cursor.execute(template, values)
            except psycopg.errors.InvalidSqlStatementName:
                # Deallocated behind our back (DISCARD ALL by a proxy, say): this
                # batch fails and is retried, and the next claim prepares it again.
                self._prepared.pop(conn, None)
                raise
            # The BEGIN's result, and the plan_cache_mode's.
            leading = int(begin) + int(partitioned)
        for _ in range(leading):
            cursor.nextset()
        return await cursor.fetchall()

    async def mark_and_commit(
        self, marks: Marks, crash_before_commit: Callable[[], None] | None = None
    ) -> None:
        """One statement for every acked row, one for every failed row, and the
        commit, sent together in one message, one round trip (_execute_and_commit)."""
        statements: list[tuple[bytes, dict[str, Any]]] = []
        since, until = self._created_span
        if marks.published:
            statements.append(
                (
                    self._mark("mark_published"),
                    {"ids": _uuid_array(marks.published), "since": since, "until": until},
                )
            )
        if marks.failed:
            statements.append(
                (
                    self._mark("mark_failed"),
                    {
                        "ids": [m.id for m in marks.failed],
                        "attempts": [m.attempts for m in marks.failed],
                        "delays": [m.retry_delay for m in marks.failed],
                        "errors": [m.error for m in marks.failed],
                        "since": since,
                        "until": until,
                    },
                )
            )
        async with translated("mark"):
            await _execute_and_commit(self._conn, statements, crash_before_commit)

    def _mark(self, name: str) -> bytes:
        """The marks' statement ``name``, composed and encoded once a connection
        encoding."""
        key = (f"{name} partitioned" if self._partitioned else name, self._conn.info.encoding)
        if (encoded := self._names.encoded.get(key)) is None:
            composed = mark_statement(self._names, name, self._partitioned)
            encoded = self._names.encoded[key] = composed.as_bytes(self._conn)
        return encoded

    async def commit(self) -> None:
        async with translated("commit"):
            await self._conn.commit()


class Database:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.names = Names.for_config(config)
        self._conninfo = connection_string(config.database_url)
        # A row lock must never outlive its batch: a relay frozen mid-batch (SIGSTOP,
        # a stalled VM) is cut off by the server and its rows are released for the
        # other replicas. The batch itself is bounded by publish_timeout.
        idle_ms = int((config.publish_timeout + 10.0) * 1000)
        self._session_settings = {
            "idle_in_transaction_session_timeout": str(idle_ms),
            "statement_timeout": "30000",
            "lock_timeout": "5000",
            # The claim must walk the unpublished index in order and stop at the batch
            # size. On stale statistics (a backlog that arrived before autovacuum's
            # analyze: a new table, a burst after a truncate) the planner believes the
            # backlog is tiny and picks a bitmap scan that sorts all of it
            # (docs/performance.md). No relay query wants a bitmap scan.
            "enable_bitmapscan": "off",
            # Nor a sequential scan of the table: the claim's generic plan, made once a
            # connection while the table held a few rows (new, or drained and analyzed
            # so), scanned all of it in each of its eight scans until the next analyze,
            # as the table grew (docs/performance.md). Off only weighs the planner
            # against it: a query with no index to use still scans.
            "enable_seqscan": "off",
            # A mark lost in a Postgres crash only republishes its rows, with the
            # same Nats-Msg-Id (at-least-once, deduped): not worth a WAL flush wait
            # per batch. Producers' commits are theirs.
            "synchronous_commit": "off",
        }
        self._pool: AsyncConnectionPool[TrioConnection] | None = None
        # The batches' connection between batches (see KEEP_OUT_OF_POOL), and when it
        # left the pool (trio's clock).
        self._kept: tuple[TrioConnection, float] | None = None
        # The claims prepared on each connection: the plain table's (False), a
        # partitioned table's (True).
        self._claim_prepared: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], set[bool]] = (
            weakref.WeakKeyDictionary()
        )
        # None until the LISTEN self-check tells (relay/poolers.py); meanwhile the
        # relay behaves as behind a transaction pooler, which is right either way.
        self._pooled_from_config = pooled_from_config(config)
        self._pooled = self._pooled_from_config
        # The pooled connections that carry the session settings (never behind a
        # transaction pooler: set there, they would stay with a server connection).
        self._configured: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()
        self.claim_start = ClaimStart()
        # Whether the table is partitioned, as the last read of its layout said (the
        # retention and partition tasks read it each round): the marks' bound.
        self._partitioned = False

    @property
    def conninfo(self) -> str:
        return self._conninfo

    @property
    def session_settings(self) -> dict[str, str]:
        """What every pooled connection sets at connect."""
        return dict(self._session_settings)

    @property
    def pooled(self) -> bool | None:
        """Whether --database-url is a transaction pooler; None while unknown."""
        return self._pooled

    def learn_pooler(self, pooled: bool) -> None:
        """What the LISTEN self-check told, when the configuration did not. A check
        that heard its notification proves no transaction pooler stands between, so
        it overrules an earlier one that did not (a restart, a lost notification);
        one that did not hear only settles what was unknown."""
        if self._pooled_from_config is None and (self._pooled is None or not pooled):
            self._pooled = pooled

    async def _checked_out(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Give a connection the session settings at its first use once it is known
        that no transaction pooler stands between (one round trip, once). Either side
        of the door: the connection waits on the loop that awaits it."""
        if self._pooled is False and conn not in self._configured:
            for name, value in self._session_settings.items():
                await conn.execute("select set_config(%s, %s, false)", (name, value))
            self._configured.add(conn)

    async def open(self) -> None:
        """Start the pool without waiting: an unreachable database at start is an
        outage to ride out, not a reason to exit."""
        self._pool = AsyncConnectionPool(
            self._conninfo,
            # Its connections wait in trio when trio drives them (the batches) and in
            # asyncio when asyncio does (everything else, through the door).
            connection_class=TrioConnection,
            min_size=1,
            max_size=4,
            open=False,
            kwargs=POOLED_CONNECTION,
            # No check on checkout: it would cost a round trip on every batch. A broken
            # connection fails its statement, the batch is retried, and the pool
            # discards the connection when it comes back in a bad state.
            timeout=5.0,
            # Keep trying for as long as the relay runs; the pool backs off by itself.
            reconnect_timeout=86400.0,
            name="outbox-relay",
        )
        await aio.call(self._pool.open, wait=False)

    async def close(self) -> None:
        if self._pool is not None:
            with trio.move_on_after(5):
                if self._kept is not None:
                    (conn, _), self._kept = self._kept, None
                    await aio.call(self._pool.putconn, conn)
                await aio.call(self._pool.close)
            self._pool = None

    def _require_pool(self) -> AsyncConnectionPool[TrioConnection]:
        if self._pool is None:
            raise RuntimeError("Database.open() was not called")
        return self._pool

    @asynccontextmanager
    async def connection(self, doing: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled connection, in autocommit: each statement is its own transaction."""
        pool = self._require_pool()
        async with translated(doing):
            conn = await aio.call(pool.getconn)
        try:
            async with translated(doing):
                await aio.call(self._checked_out, conn)
            yield conn
        finally:
            # Shielded: the connection goes back even when the task was cancelled
            # mid-statement.
            with trio.CancelScope(shield=True):
                await aio.call(_give_back, pool, conn)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """trio side: a batch transaction, its statements waited on by trio
        (relay/pgtrio.py). Leaving without ``commit`` rolls it back."""
        conn, taken_at = await self._batch_connection()
        try:
            async with translated("begin batch"):
                await self._checked_out(conn)
            yield Transaction(
                conn,
                self.names,
                self._claim_prepared,
                self.claim_start,
                None if self._pooled is False else self.session_settings,
                partitioned=self._partitioned,
            )
        finally:
            # Runs to its end even when the batch was cancelled (its deadline passed).
            with trio.CancelScope(shield=True):
                await _roll_back_from_trio(conn)
                await self._end_batch(conn, taken_at)

    async def _batch_connection(self) -> tuple[TrioConnection, float]:
        """The connection kept from the last batch, else one from the pool."""
        if self._kept is not None:
            kept, self._kept = self._kept, None
            return kept
        pool = self._require_pool()
        async with translated("begin batch"):
            conn = await aio.call(pool.getconn)
        return conn, trio.current_time()

    async def _end_batch(self, conn: TrioConnection, taken_at: float) -> None:
        """Keep ``conn`` for the next batch, or give it back to the pool: when one is
        kept already, when it has been out long enough, or when it is not fit."""
        fit = not conn.closed and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        if (
            fit
            and self._kept is None
            and self._pool is not None
            and trio.current_time() - taken_at < KEEP_OUT_OF_POOL
        ):
            self._kept = (conn, taken_at)
            return
        if self._pool is not None:
            await aio.call(_give_back, self._pool, conn)

    async def check_setup(self) -> SetupReport:
        """Fail clearly if the table or the relay's columns are missing; mark dead the
        rows at the cap that are not (see the adopt_dead query)."""
        table_text = sql.Identifier(*self.config.table).as_string()
        async with self.connection("check setup") as conn, translated("check setup"):
            cursor = await aio.call(conn.execute, "select to_regclass(%s)", (table_text,))
            found = await aio.call(cursor.fetchone)
            if found is None or found[0] is None:
                raise SetupError(
                    f"--table: table {self.config.table_display} does not exist "
                    "(run `outbox-relay install`, or check the name)"
                )
            cursor = await aio.call(
                conn.execute, query(self.names, "relay_columns"), {"table": table_text}
            )
            columns = await aio.call(cursor.fetchone)
            if columns is None or columns[0] != 9:
                raise SetupError(
                    f"--table: table {self.config.table_display} lacks the relay's columns "
                    "(relay_retry_at, relay_last_error, relay_dead_at, relay_seq, "
                    "relay_skipped_at, relay_late, traceparent, tracestate, headers): "
                    "run `outbox-relay install`"
                )
            cursor = await aio.call(
                conn.execute,
                query(self.names, "trigger_present"),
                {"table": table_text, "trigger": self.names.trigger_name},
            )
            found = await aio.call(cursor.fetchone)
            trigger = bool(found and found[0])
            cursor = await aio.call(conn.execute, query(self.names, "late_guard"))
            found = await aio.call(cursor.fetchone)
            late_guard_problems = list(found[0]) if found else []
            cursor = await aio.call(
                conn.execute,
                query(self.names, "adopt_dead"),
                {"max_attempts": self.config.max_attempts},
            )
            adopted = cursor.rowcount
        return SetupReport(
            trigger_present=trigger, late_guard_problems=late_guard_problems, adopted_dead=adopted
        )

    async def notify(self, channel: str, payload: str) -> None:
        """Send a notification on a short connection of its own to --database-url
        (the LISTEN self-check), which sets nothing: through a pooler it leaves
        nothing behind on the server connection it gets."""
        async with translated("notify"):
            await aio.call(_notify, self._conninfo, channel, payload)

    async def backlog(self, max_attempts: int) -> Backlog:
        async with self.connection("gauges") as conn, translated("gauges"):
            cursor = await aio.call(
                conn.execute, query(self.names, "backlog"), {"max_attempts": max_attempts}
            )
            row = await aio.call(cursor.fetchone)
        assert row is not None  # an aggregate always returns one row
        return Backlog(*row)

    async def horizon(self, limit: int = 1) -> tuple[TableHealth, list[Holder]]:
        """The table's dead tuples and size, and what holds the horizon back (the
        oldest ``limit`` holders)."""
        table = sql.Identifier(*self.config.table).as_string()
        async with self.connection("gauges") as conn, translated("gauges"):
            cursor = await aio.call(
                conn.execute, query(self.names, "table_health"), {"table": table}
            )
            row = await aio.call(cursor.fetchone)
            cursor = await aio.call(
                conn.execute, query(self.names, "horizon_holders"), {"limit": limit, "table": table}
            )
            holders = await aio.call(cursor.fetchall)
        assert row is not None  # one row of scalars
        return TableHealth(*row), read_holders(holders)

    async def table_writers(self) -> tuple[str, list[tuple[int, str | None]]]:
        """When this read of pg_locks began (exact text), and the table's writers it
        saw: each one's xid and, where the role may read it, its transaction's start."""
        async with self.connection("writers") as conn, translated("writers"):
            cursor = await aio.call(
                conn.execute,
                query(self.names, "table_writers"),
                {"table": sql.Identifier(*self.config.table).as_string()},
            )
            rows = await aio.call(cursor.fetchall)
        polled_at = rows[0][0]
        return polled_at, [(int(xid), started) for _, xid, started in rows if xid is not None]

    async def sweep(self) -> bool:
        """Whether a live row sits before where the claims start, unflagged: one walk
        of the claim index from its first entry, off the claim's path."""
        start = self.claim_start.sweep_key()
        if start is None:
            return False
        params = {"start_at": start.start_at, "start_seq": start.start_seq,
                  "bound_at": start.bound_at}  # fmt: skip
        async with self.connection("sweep") as conn, translated("sweep"):
            cursor = await aio.call(conn.execute, query(self.names, "sweep"), params)
            row = await aio.call(cursor.fetchone)
        return bool(row and row[0])

    async def delete_spent(
        self, retention: float, batch_size: int, after: str | None, lookback: float
    ) -> Deleted:
        """Delete up to ``batch_size`` spent rows published from ``after`` on (text,
        exact; '-infinity' for all; None for those that came of age in the last
        ``lookback`` seconds), oldest first."""
        params = {"retention": retention, "batch_size": batch_size, "after": after,
                  "lookback": lookback}  # fmt: skip
        async with self.connection("retention") as conn, translated("retention"):
            cursor = await aio.call(conn.execute, query(self.names, "delete_spent"), params)
            row = await aio.call(cursor.fetchone)
        assert row is not None  # an aggregate always returns one row
        return Deleted(*row)

    async def purge_late_keys(self) -> int:
        """Remove the late rows' keys whose rows are gone or spent; how many."""
        async with self.connection("retention") as conn, translated("retention"):
            cursor = await aio.call(conn.execute, query(self.names, "purge_late_keys"))
        return cursor.rowcount

    async def partition_layout(self) -> PartitionLayout:
        """Whether the table is partitioned the way the relay manages, by range of
        created_at, and if so its partitions; with the database's clock."""
        async with self.connection("partitions") as conn, translated("partitions"):
            layout = await aio.call(read_partition_layout, conn, self.names)
        self._partitioned = layout.kind == "p"
        return layout

    async def create_partitions(self, ahead: float) -> list[NewPartition]:
        """Create the partitions that make the table reach ``ahead`` seconds past
        now (none when another relay holds the partition lock)."""
        async with self.connection("partitions") as conn, translated("create partitions"):
            return await aio.call(_create_partitions, conn, self.names, ahead, None)

    async def partition_held(self, name: str) -> list[str]:
        """Up to five ids of rows that keep partition ``name`` from being dropped."""
        statement = partition_statement(
            self.names, "partition_held", partition=self.names.partition(name)
        )
        async with self.connection("retention") as conn, translated("retention"):
            cursor = await aio.call(conn.execute, statement)
            rows = await aio.call(cursor.fetchall)
        return [row[0] for row in rows]

    async def _partition_ddl(self, statement: str, partition: str, **slots: sql.Composable) -> None:
        composed = partition_statement(
            self.names, statement, partition=self.names.partition(partition), **slots
        )
        async with self.connection("retention") as conn, translated(f"{statement} {partition}"):
            await aio.call(conn.execute, composed)

    async def detach_partition(self, name: str) -> None:
        await self._partition_ddl("detach_partition", name)

    async def finalize_detach(self, name: str) -> None:
        await self._partition_ddl("finalize_detach", name)

    async def attach_partition(self, name: str, start: float, end: float) -> None:
        await self._partition_ddl(
            "attach_partition", name, start=sql.Literal(start), end=sql.Literal(end)
        )

    async def drop_partition(self, name: str) -> None:
        await self._partition_ddl("drop_partition", name)


@dataclass(frozen=True)
class PartitionLayout:
    kind: str | None  # "r" a plain table, "p" a partitioned one, None: no such table
    managed: bool  # partitioned by range of created_at alone
    partitions: list[Partition]
    now: float  # the database's clock, epoch seconds
    # Entries in the server's lock table: max_locks_per_transaction x (max_connections
    # + max_prepared_transactions), as Postgres sizes it.
    lock_slots: int


def partition_layout(
    layout: tuple[Any, ...] | None, partitions: list[tuple[Any, ...]], now: tuple[Any, ...] | None
) -> PartitionLayout:
    """The rows of sql/partitions.sql's layout and partitions, and the clock's (with
    the size of the server's lock table)."""
    kind, managed = (layout[0], bool(layout[1])) if layout else (None, False)
    assert now is not None
    clock, lock_slots = now
    return PartitionLayout(kind, managed, [Partition(*r) for r in partitions], clock, lock_slots)


def partition_creation(names: Names, partition: NewPartition) -> list[sql.Composed]:
    """The statements that create ``partition`` and attach it to the table."""
    target = names.partition(partition.name)
    bounds = {"start": sql.Literal(partition.start), "end": sql.Literal(partition.end)}
    return [
        partition_statement(names, "create_partition", partition=target),
        partition_statement(names, "attach_partition", partition=target, **bounds),
    ]


def first_partitions(names: Names, period: float, ahead: float, now: float) -> list[sql.Composed]:
    """What a new partitioned table's first partitions take (install --print)."""
    planned = partitions_to_create([], now, ahead, names.base, period=period)
    return [statement for p in planned for statement in partition_creation(names, p)]


def _layout_statements(names: Names) -> tuple[sql.Composed, sql.Composed, str]:
    """The table's kind; its partitions, after the settings that read their bounds
    right (in the same transaction); the database's clock and lock table's size."""
    return (
        partition_statement(names, "layout"),
        # On a line of its own: a block may end in a comment.
        partition_statement(names, "readable_bounds") + sql.SQL("\n;\n")
        + partition_statement(names, "partitions"),
        LAYOUT_CLOCK,
    )  # fmt: skip


LAYOUT_CLOCK = (
    "select extract(epoch from statement_timestamp())::float8, "
    "current_setting('max_locks_per_transaction')::int "
    "* (current_setting('max_connections')::int "
    "+ current_setting('max_prepared_transactions')::int)"
)


async def read_partition_layout(
    conn: psycopg.AsyncConnection[Any], names: Names
) -> PartitionLayout:
    """asyncio side: the table's kind and partitions, and the database's now."""
    layout, partitions, now = _layout_statements(names)
    async with conn.transaction():
        kind = await (await conn.execute(layout)).fetchone()
        rows: list[tuple[Any, ...]] = []
        if kind and kind[0] == "p":
            cursor = await conn.execute(partitions)
            cursor.nextset()
            rows = await cursor.fetchall()
        clock = await (await conn.execute(now)).fetchone()
    return partition_layout(kind, rows, clock)


async def _create_partitions(
    conn: psycopg.AsyncConnection[Any], names: Names, ahead: float, period: float | None
) -> list[NewPartition]:
    """asyncio side: one transaction under the partition lock that reads the
    partitions again and creates what they lack."""
    async with conn.transaction():
        cursor = await conn.execute(partition_statement(names, "partition_lock"))
        locked = await cursor.fetchone()
        if not (locked and locked[0]):
            return []
        # ATTACH waits behind other DDL on the table, never behind producers.
        await conn.execute("select set_config('lock_timeout', '5s', true)")
        layout = await read_partition_layout(conn, names)
        planned = partitions_to_create(
            layout.partitions, layout.now, ahead, names.base, period=period
        )
        for partition in planned:
            for statement in partition_creation(names, partition):
                await conn.execute(statement)
    return planned


@dataclass(frozen=True)
class TableHealth:
    dead_tuples: int
    total_bytes: int
    next_xid: int
    relays: int  # holding the presence lock: connected relays of this table


def install(
    conninfo: str,
    names: Names,
    grant_to: str | None = None,
    partitions: float | None = None,
    partitions_ahead: float = Config.partitions_ahead,
) -> None:
    """Apply every file in sql/install in one transaction (idempotent), and grant
    ``grant_to`` what a relay running as that role needs. With ``partitions`` (a
    period in seconds), a missing table is created range-partitioned on created_at;
    on a table partitioned so, partitions are created ``partitions_ahead`` past now."""
    with psycopg.connect(conninfo) as conn, conn.transaction():
        # Two installs at once (a Job retried beside a replica's) must not race on
        # "create ... if not exists"; the lock ends with the transaction.
        conn.execute("select pg_advisory_xact_lock(hashtext('outbox-relay install'))")
        # A first install on a busy table needs its locks briefly; rather than queue
        # behind a long transaction (and stall every producer queued behind us),
        # give up with a clear error after a while. A repeat install takes none.
        conn.execute("set local lock_timeout = '10s'")
        layout_query, partitions_query, now_query = _layout_statements(names)
        if partitions is not None:
            _create_partitioned_table(conn, names, conn.execute(layout_query).fetchone())
        for statement in install_script(names):
            conn.execute(statement)
        kind = conn.execute(layout_query).fetchone()
        rows: list[tuple[Any, ...]] = []
        if kind and kind[0] == "p":
            cursor = conn.execute(partitions_query)
            cursor.nextset()
            rows = cursor.fetchall()
        layout = partition_layout(kind, rows, conn.execute(now_query).fetchone())
        if layout.managed:
            conn.execute(partition_statement(names, "partition_lock_wait"))
            period = _install_period(names, period_of(layout.partitions), partitions)
            planned = partitions_to_create(
                layout.partitions, layout.now, partitions_ahead, names.base, period=period
            )
            for partition in planned:
                for statement in partition_creation(names, partition):
                    conn.execute(statement)
        if grant_to is not None:
            conn.execute(grant_script(names, grant_to))


def _create_partitioned_table(
    conn: psycopg.Connection[Any], names: Names, kind: tuple[Any, ...] | None
) -> None:
    if kind is None:
        conn.execute(partition_statement(names, "create_table"))
    elif kind[0] != "p":
        raise SetupError(
            f"{names.display} is a plain table: --partitions creates a partitioned "
            "one and cannot convert it in place (docs/partitions.md, *Installing*)"
        )


def _install_period(names: Names, existing: float | None, requested: float | None) -> float | None:
    """The period new partitions get: the table's own, which --partitions may not change."""
    if existing is not None and requested is not None and existing != requested:
        raise SetupError(
            f"{names.display} is partitioned by {show_duration(existing)}, not "
            f"{show_duration(requested)}: new partitions follow the newest one's width "
            "(docs/partitions.md says how to change the period)"
        )
    return existing or requested


def uninstall(conninfo: str, names: Names) -> None:
    with psycopg.connect(conninfo) as conn, conn.transaction():
        conn.execute(uninstall_script(names))
