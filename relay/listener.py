"""The LISTEN task: a dedicated connection that turns notifications into wake-ups,
and holds the sleep lock while the publisher sleeps.

A notification is only a hint. What makes the relay correct is that it always
re-reads the table: after every (re)connect it sweeps at once, because rows may
have committed while nobody listened, and the poll timer covers anything else.

The sleep lock (see ``sql/install/003_notify_trigger.sql``) lives on this
connection on purpose: if the connection dies, the lock goes with it, producers
stop notifying, and the reconnect sweep covers the gap, exactly as for a lost
LISTEN.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg.errors
import trio
from psycopg import sql
from psycopg.abc import Query

from relay import aio
from relay.backoff import ReconnectBackoff
from relay.database import break_connection
from relay.health import Health
from relay.metrics import Metrics
from relay.sqlfiles import Names, query
from relay.wakeup import Wakeup

log = logging.getLogger(__name__)

# How long the sleep lock may wait for producers in flight. While this connection
# waits for a lock it cannot hear notifications (they are delivered afterwards), so
# the wait is short; a producer transaction open for longer makes the publisher
# claim again and retry, rather than sleep.
SLEEP_LOCK_TIMEOUT_MS = 10


class Sleep(enum.Enum):
    """May the publisher sleep until it is notified?"""

    SAFE = "safe"  # this relay holds the sleep lock: producers notify
    SAFE_OTHER = "safe-other"  # another relay holds it: producers notify
    BUSY = "busy"  # producers are in flight: claim again, then retry
    DEAF = "deaf"  # no LISTEN connection: only the poll and the reconnect wake us


# How the LISTEN connection shows in pg_stat_activity (the pool's say "outbox-relay").
APPLICATION_NAME = "outbox-relay listen"


async def _connect_autocommit(conninfo: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(
        conninfo, autocommit=True, application_name=APPLICATION_NAME
    )


async def _wait_for_notification(
    conn: psycopg.AsyncConnection[Any], seconds: float, notified: Callable[[], None]
) -> int:
    """asyncio side: up to ``seconds`` for the first notification; how many came.

    ``notified`` is called as soon as one comes, here on the asyncio side: the way
    back to trio (the return of this call) took 0.22 ms (median) at light load, and
    the publisher need not wait for it. trio-asyncio runs asyncio callbacks inside
    a trio task, so a synchronous trio call such as setting an Event is allowed."""
    received = 0
    async for _ in conn.notifies(timeout=seconds, stop_after=1):
        notified()
        received += 1
    return received


async def _execute_or_break(
    conn: psycopg.AsyncConnection[Any], statement: Query, seconds: float
) -> tuple[Any, ...] | None:
    """asyncio side: run ``statement``; its first row. A connection that does not
    answer within ``seconds`` is broken on purpose, which makes the statement fail at
    once: every statement on the LISTEN connection goes through here, so a silently
    dead path is found whatever the connection was doing."""

    def give_up() -> None:
        log.warning("LISTEN connection unanswered after %.1fs: dropping it", seconds)
        break_connection(conn)

    watchdog = asyncio.get_running_loop().call_later(seconds, give_up)
    try:
        cursor = await conn.execute(statement)
        return await cursor.fetchone() if cursor.description else None
    finally:
        watchdog.cancel()


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one real error in a race's exception group (the others are cancellations)."""
    for leaf in group.exceptions:
        if isinstance(leaf, BaseExceptionGroup):
            return _first_error(leaf)
        if not isinstance(leaf, trio.Cancelled):
            return leaf
    return group


class Listener:
    def __init__(
        self,
        *,
        conninfo: str,
        names: Names,
        channel: str,
        keepalive: float,
        wakeup: Wakeup,
        health: Health,
        metrics: Metrics,
    ) -> None:
        self._conninfo = conninfo
        self._names = names
        self._channel = channel
        self._keepalive = keepalive
        # A probe that takes this long means the connection is dead, even if the
        # kernel has not noticed yet (a blackholed path sends no RST).
        self._probe_timeout = min(5.0, keepalive)
        self._wakeup = wakeup
        self._health = health
        self._metrics = metrics
        # The publisher's requests, carried out by this task on its connection.
        self._want_sleep = False
        self._holding = False
        self._answer: trio.MemorySendChannel[Sleep] | None = None
        self._poke = trio.Event()

    # -- the publisher's side ---------------------------------------------------

    async def prepare_sleep(self) -> Sleep:
        """Ask for the sleep lock; returns once this task has tried."""
        if not self._health.listening:
            return Sleep.DEAF
        send, receive = trio.open_memory_channel[Sleep](1)
        self._answer, self._want_sleep = send, True
        self._poke.set()
        with trio.move_on_after(5):
            async with receive:
                return await receive.receive()
        return Sleep.DEAF

    def wake_up(self) -> None:
        """The publisher is awake: let the lock go, so producers stop notifying."""
        self._want_sleep = False
        self._answer = None
        if self._holding:
            self._poke.set()

    # -- the task ---------------------------------------------------------------

    async def run(self) -> None:
        backoff = ReconnectBackoff(initial=0.1, cap=5.0)
        while True:
            try:
                await self._listen_once(backoff)
            except (psycopg.Error, OSError, trio.TooSlowError) as exc:
                reason = "connect timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
                log.warning("LISTEN connection lost: %s", reason.strip().splitlines()[0])
            self._set_state(up=False)
            await trio.sleep(backoff.next_delay())

    async def _listen_once(self, backoff: ReconnectBackoff) -> None:
        with trio.fail_after(10):
            conn: psycopg.AsyncConnection[Any] = await aio.call(_connect_autocommit, self._conninfo)
        try:
            await self._execute(
                sql.SQL("select set_config('lock_timeout', {}, false)").format(
                    sql.Literal(f"{SLEEP_LOCK_TIMEOUT_MS}ms")
                ),
                conn,
            )
            await self._execute(sql.SQL("listen {}").format(sql.Identifier(self._channel)), conn)
            self._set_state(up=True)
            backoff.reset()
            log.info("listening on channel %s", self._channel)
            # Rows may have committed while no one listened: sweep now.
            self._wakeup.set("reconnect")
            while True:
                await self._serve_requests(conn)
                outcome = await self._wait(conn)
                if outcome == "quiet":
                    # Quiet for a whole keepalive: make sure the connection still works.
                    await self._execute(sql.SQL("select 1"), conn)
        finally:
            # Not listening from here on, before the close below awaits: a publisher
            # asking to sleep meanwhile must hear DEAF at once, not wait for an answer.
            self._set_state(up=False)
            self._holding = False
            self._answer_request(Sleep.DEAF)
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(2),
                contextlib.suppress(psycopg.Error, OSError),
            ):
                await aio.call(conn.close)

    async def _serve_requests(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._poke = trio.Event()
        if self._want_sleep and self._answer is not None:
            if self._holding:
                # The publisher woke and asks to sleep again before this task got
                # round to letting the lock go. Held all along, it is as good as new
                # (every producer since it was granted has notified).
                answer = Sleep.SAFE
            else:
                answer = await self._take_sleep_lock(conn)
            self._answer_request(answer)
        elif not self._want_sleep and self._holding:
            await self._execute(query(self._names, "idle_unlock"), conn)
            self._holding = False

    async def _take_sleep_lock(self, conn: psycopg.AsyncConnection[Any]) -> Sleep:
        try:
            await self._execute(query(self._names, "idle_lock"), conn)
        except psycopg.errors.LockNotAvailable:
            row = await self._execute(query(self._names, "idle_sleeper"), conn)
            return Sleep.SAFE_OTHER if row and row[0] else Sleep.BUSY
        self._holding = True
        return Sleep.SAFE

    async def _execute(
        self, statement: Query, conn: psycopg.AsyncConnection[Any]
    ) -> tuple[Any, ...] | None:
        return await aio.call(_execute_or_break, conn, statement, self._probe_timeout)

    def _notified(self) -> None:
        self._wakeup.set("notify")

    def _answer_request(self, answer: Sleep) -> None:
        channel, self._answer = self._answer, None
        if channel is not None:
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                channel.send_nowait(answer)

    async def _wait(self, conn: psycopg.AsyncConnection[Any]) -> str:
        """Until a notification ("notify"), a request ("poke") or a quiet keepalive."""
        outcome = "quiet"
        try:
            async with trio.open_nursery() as nursery:

                async def notifications() -> None:
                    nonlocal outcome
                    if await aio.call(
                        _wait_for_notification, conn, self._keepalive, self._notified
                    ):
                        outcome = "notify"
                    nursery.cancel_scope.cancel()

                async def requests() -> None:
                    nonlocal outcome
                    await self._poke.wait()
                    outcome = "poke"
                    nursery.cancel_scope.cancel()

                nursery.start_soon(notifications)
                nursery.start_soon(requests)
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        return outcome

    def _set_state(self, *, up: bool) -> None:
        self._health.listening = up
        self._metrics.listen_connected.set(1 if up else 0)
