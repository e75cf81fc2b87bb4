"""relay/pgtrio.py against a real Postgres: a psycopg connection driven from trio,
and from asyncio through the door, and what a cut-short wait leaves behind."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
import pytest
import trio

from relay import aio
from relay.pgtrio import TrioConnection
from tests.support import database
from tests.support.relayproc import wait_until
from tests.support.servers import SHARED_PG_URL


@contextlib.asynccontextmanager
async def connection(**settings: Any) -> AsyncIterator[TrioConnection]:
    conn = await aio.call(TrioConnection.connect, SHARED_PG_URL, autocommit=True, **settings)
    try:
        yield conn
    finally:
        await conn.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        async with aio.open_loop():
            await test()

    trio.run(main)


async def first_payload(conn: TrioConnection) -> str:
    with trio.fail_after(10):
        async with contextlib.aclosing(conn.notifies()) as notices:
            async for notice in notices:
                return notice.payload
    raise AssertionError("the notifications ended")


def test_statements_and_notifications_from_trio_and_from_asyncio() -> None:
    async def test() -> None:
        async with connection() as conn:
            await conn.execute("listen pgtrio_test")
            cursor = await conn.execute("select 41 + 1")
            assert await cursor.fetchone() == (42,)
            # The same connection through the door: psycopg's own asyncio wait.
            cursor = await aio.call(conn.execute, "select 'asyncio'")
            assert await aio.call(cursor.fetchone) == ("asyncio",)
            database.execute(SHARED_PG_URL, "select pg_notify('pgtrio_test', 'hello')")
            assert await first_payload(conn) == "hello"
            # psycopg's own bound on the wait, from trio: no notification, no error.
            async with contextlib.aclosing(conn.notifies(timeout=0.05)) as notices:
                assert [n async for n in notices] == []

    run(test)


def test_a_notification_wait_cut_short_leaves_the_connection_usable() -> None:
    async def test() -> None:
        async with connection() as conn:
            await conn.execute("listen pgtrio_test")
            with trio.move_on_after(0.05):
                async with contextlib.aclosing(conn.notifies()) as notices:
                    async for _ in notices:
                        pytest.fail("no notification was sent")
            cursor = await conn.execute("select 1")
            assert await cursor.fetchone() == (1,)
            database.execute(SHARED_PG_URL, "select pg_notify('pgtrio_test', 'after')")
            assert await first_payload(conn) == "after"

    run(test)


def test_a_statement_cut_short_breaks_the_connection() -> None:
    """A statement interrupted while the server runs it leaves its answer on the
    wire: the connection is shut down rather than reused. The server hears it (its
    client check) and ends the backend long before the statement would finish."""

    pids: list[int] = []

    async def test() -> None:
        async with connection(options="-c client_connection_check_interval=100") as conn:
            pids.append(conn.info.backend_pid)
            with trio.move_on_after(0.2):
                await conn.execute("select pg_sleep(60)")
            with pytest.raises(psycopg.OperationalError):
                await conn.execute("select 1")

    run(test)
    wait_until(
        lambda: (
            not database.fetch(SHARED_PG_URL, "select 1 from pg_stat_activity where pid = %s", pids)
        ),
        timeout=30,
        message="the server to end the interrupted statement's session",
    )
