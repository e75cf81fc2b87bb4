"""The LISTEN connection's Postgres side: the statements the listener runs on it.

The listener (:mod:`relay.listener`) decides what to run and when; this adapter
runs it, from trio (:mod:`relay.pgtrio`), and translates psycopg's errors once: a
connection that fails or stops answering raises
:class:`~relay.errors.DatabaseUnavailable`, and a sleep lock that cannot be had
within its timeout is an answer (``False``), not an error.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg.errors
import trio
from psycopg import sql
from psycopg.abc import Query

from relay import aio
from relay.database import translate
from relay.errors import DatabaseUnavailable
from relay.pgtrio import TrioConnection, break_connection
from relay.sqlfiles import Names, query

log = logging.getLogger(__name__)

# How the LISTEN connection shows in pg_stat_activity (the pool's say "outbox-relay").
APPLICATION_NAME = "outbox-relay listen"

# How long the sleep lock may wait for producers in flight. While this connection
# waits for a lock it cannot hear notifications (they are delivered afterwards), so
# the wait is short; a producer transaction open for longer makes the scheduler
# claim again and retry, rather than sleep.
SLEEP_LOCK_TIMEOUT_MS = 10


async def _execute_or_break(
    conn: TrioConnection, statement: Query, seconds: float
) -> tuple[Any, ...] | None:
    """Run ``statement``; its first row. A connection that does not answer within
    ``seconds`` is broken on purpose (:func:`relay.pgtrio.drive`) and the call
    fails: every statement on the LISTEN connection goes through here, so a silently
    dead path is found whatever the connection was doing."""
    with trio.move_on_after(seconds):
        cursor = await conn.execute(statement)
        return await cursor.fetchone() if cursor.description else None
    log.warning("LISTEN connection unanswered after %.1fs: dropping it", seconds)
    break_connection(conn)
    raise DatabaseUnavailable(f"LISTEN connection: no answer within {seconds:.1f}s")


async def _wait_for_notification(
    conn: TrioConnection, seconds: float, notified: Callable[[], None]
) -> int:
    """Notifications for ``seconds`` (or until cancelled); how many came.

    ``notified`` is called as each one comes. The wait goes on after a notification:
    at light load the relay keeps the sleep lock and hears one per commit, and a wait
    rebuilt for each cost more than the batch."""
    received = 0
    with trio.move_on_after(seconds):
        async with contextlib.aclosing(conn.notifies()) as notices:
            async for _ in notices:
                notified()
                received += 1
    return received


async def _hears(
    conn: TrioConnection, payload: str, seconds: float, notified: Callable[[], None]
) -> bool:
    """Whether a notification carrying ``payload`` comes within ``seconds``;
    ``notified`` is called for any other (a producer's)."""
    with trio.move_on_after(seconds):
        async with contextlib.aclosing(conn.notifies()) as notices:
            async for notice in notices:
                if notice.payload == payload:
                    return True
                notified()
    return False


def session_settings(idle_timeout: float) -> dict[str, str]:
    """The LISTEN session's settings. The server ends the session when the relay stops
    talking (``idle_timeout``, see :func:`relay.listener.server_idle_timeout`) or its
    host stops answering TCP (keepalives, and a bound on unacknowledged data), so a
    lost relay's sleep lock does not keep every producer notifying."""
    return {
        "lock_timeout": f"{SLEEP_LOCK_TIMEOUT_MS}ms",
        "idle_session_timeout": f"{round(idle_timeout * 1000)}ms",
        "tcp_keepalives_idle": "5",
        "tcp_keepalives_interval": "2",
        "tcp_keepalives_count": "3",
        "tcp_user_timeout": "10000",
    }


class PostgresListenConnection:
    """One LISTEN connection to Postgres, in autocommit. Every statement is bounded
    by ``answer_timeout``: past it the connection is broken and the call raises.

    Connected through the asyncio door, then driven from trio (:mod:`relay.pgtrio`):
    it waits for every notification, and at light load that is one per event."""

    def __init__(
        self,
        conn: TrioConnection,
        names: Names,
        answer_timeout: float,
        idle_timeout: float,
    ) -> None:
        self._conn = conn
        self._names = names
        self._answer_timeout = answer_timeout
        self._idle_timeout = idle_timeout

    @classmethod
    async def connect(
        cls, conninfo: str, names: Names, answer_timeout: float, idle_timeout: float
    ) -> PostgresListenConnection:
        try:
            conn = await aio.call(
                TrioConnection.connect,
                conninfo,
                autocommit=True,
                application_name=APPLICATION_NAME,
            )
        except (psycopg.Error, OSError) as exc:
            raise translate(exc, "LISTEN connection") from exc
        return cls(conn, names, answer_timeout, idle_timeout)

    async def _execute(self, statement: Query) -> tuple[Any, ...] | None:
        try:
            return await _execute_or_break(self._conn, statement, self._answer_timeout)
        except (psycopg.Error, OSError) as exc:
            raise translate(exc, "LISTEN connection") from exc

    async def listen(self, channel: str) -> None:
        # Only the settings this server knows (idle_session_timeout is Postgres 14+).
        settings = sql.SQL(", ").join(
            sql.SQL("({}, {})").format(sql.Literal(name), sql.Literal(value))
            for name, value in session_settings(self._idle_timeout).items()
        )
        await self._execute(
            sql.SQL(
                "select set_config(s.name, s.value, false) from (values {}) as s(name, value) "
                "join pg_settings p on p.name = s.name"
            ).format(settings)
        )
        await self._execute(sql.SQL("listen {}").format(sql.Identifier(channel)))
        await self._execute(query(self._names, "presence_lock"))

    async def set_listening(self, channel: str, listening: bool) -> None:
        verb = "listen" if listening else "unlisten"
        await self._execute(sql.SQL(verb + " {}").format(sql.Identifier(channel)))

    async def try_pace_lock(self) -> bool:
        row = await self._execute(query(self._names, "pace_lock"))
        return bool(row and row[0])

    async def release_pace_lock(self) -> None:
        await self._execute(query(self._names, "pace_unlock"))

    async def probe(self) -> None:
        await self._execute(sql.SQL("select 1"))

    async def try_sleep_lock(self) -> bool:
        try:
            await _execute_or_break(
                self._conn, query(self._names, "idle_lock"), self._answer_timeout
            )
        except psycopg.errors.LockNotAvailable:
            return False
        except (psycopg.Error, OSError) as exc:
            raise translate(exc, "LISTEN connection") from exc
        return True

    async def another_relay_sleeps(self) -> bool:
        row = await self._execute(query(self._names, "idle_sleeper"))
        return bool(row and row[0])

    async def release_sleep_lock(self) -> None:
        await self._execute(query(self._names, "idle_unlock"))

    async def wait_for_notification(self, seconds: float, notified: Callable[[], None]) -> int:
        try:
            return await _wait_for_notification(self._conn, seconds, notified)
        except (psycopg.Error, OSError) as exc:
            raise translate(exc, "LISTEN connection") from exc

    async def hears(self, payload: str, seconds: float, notified: Callable[[], None]) -> bool:
        try:
            return await _hears(self._conn, payload, seconds, notified)
        except (psycopg.Error, OSError) as exc:
            raise translate(exc, "LISTEN connection") from exc

    async def close(self) -> None:
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(2),
            contextlib.suppress(psycopg.Error, OSError),
        ):
            await self._conn.close()
