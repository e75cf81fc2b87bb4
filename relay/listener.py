"""The LISTEN task: a dedicated connection that turns notifications into wake-ups.

A notification is only a hint. What makes the relay correct is that it always
re-reads the table: after every (re)connect it sweeps at once, because rows may
have committed while nobody listened, and the poll timer covers anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import psycopg
import trio
from psycopg import sql

from relay import aio
from relay.backoff import ReconnectBackoff
from relay.database import break_connection
from relay.health import Health
from relay.metrics import Metrics
from relay.wakeup import Wakeup

log = logging.getLogger(__name__)


async def _wait_for_notification(conn: psycopg.AsyncConnection[Any], seconds: float) -> int:
    """asyncio side: up to ``seconds`` for the first notification; how many came."""
    received = 0
    async for _ in conn.notifies(timeout=seconds, stop_after=1):
        received += 1
    return received


async def _connect_autocommit(conninfo: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(conninfo, autocommit=True)


async def _probe_or_break(conn: psycopg.AsyncConnection[Any], seconds: float) -> None:
    """asyncio side: ``select 1``. A connection that does not answer within
    ``seconds`` is broken on purpose, which makes the pending query fail at once."""

    def give_up() -> None:
        log.warning("LISTEN probe unanswered after %.1fs: dropping the connection", seconds)
        break_connection(conn)

    watchdog = asyncio.get_running_loop().call_later(seconds, give_up)
    try:
        await conn.execute("select 1")
    finally:
        watchdog.cancel()


class Listener:
    def __init__(
        self,
        *,
        conninfo: str,
        channel: str,
        keepalive: float,
        wakeup: Wakeup,
        health: Health,
        metrics: Metrics,
    ) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._keepalive = keepalive
        # A probe that takes this long means the connection is dead, even if the
        # kernel has not noticed yet (a blackholed path sends no RST).
        self._probe_timeout = min(5.0, keepalive)
        self._wakeup = wakeup
        self._health = health
        self._metrics = metrics

    async def run(self) -> None:
        backoff = ReconnectBackoff(initial=0.1, cap=5.0)
        while True:
            try:
                await self._listen_once(backoff)
            except (psycopg.Error, OSError, trio.TooSlowError) as exc:
                reason = "probe timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
                log.warning("LISTEN connection lost: %s", reason.strip().splitlines()[0])
            self._set_state(up=False)
            await trio.sleep(backoff.next_delay())

    async def _listen_once(self, backoff: ReconnectBackoff) -> None:
        with trio.fail_after(10):
            conn: psycopg.AsyncConnection[Any] = await aio.call(_connect_autocommit, self._conninfo)
        try:
            statement = sql.SQL("listen {}").format(sql.Identifier(self._channel))
            with trio.fail_after(self._probe_timeout):
                await aio.call(conn.execute, statement)
            self._set_state(up=True)
            backoff.reset()
            log.info("listening on channel %s", self._channel)
            # Rows may have committed while no one listened: sweep now.
            self._wakeup.set("reconnect")
            while True:
                if await aio.call(_wait_for_notification, conn, self._keepalive):
                    self._wakeup.set("notify")
                    continue
                # Quiet for a whole keepalive: make sure the connection still works.
                await self._probe(conn)
        finally:
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(2),
                contextlib.suppress(psycopg.Error, OSError),
            ):
                await aio.call(conn.close)

    async def _probe(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await aio.call(_probe_or_break, conn, self._probe_timeout)

    def _set_state(self, *, up: bool) -> None:
        self._health.listening = up
        self._metrics.listen_connected.set(1 if up else 0)
