"""A psycopg async connection that trio can drive itself.

psycopg's async API waits through asyncio: under trio-asyncio each wait starts a
trio task for the reader, queues a timer and resolves a future: 2.3-2.5 times the
CPU of the same round trip waited on by trio directly (docs/performance.md,
*Steady load*). :class:`TrioConnection` waits with trio's own primitives when trio
calls it, and as psycopg does when asyncio does (a pool's checks, the connect).

It reaches into psycopg's wait protocol (``AsyncConnection.wait`` and the
generators it consumes), hence the upper bound on psycopg in pyproject.toml.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
from typing import Any

import psycopg
import sniffio
import trio
from psycopg import errors
from psycopg.abc import RV, PQGen
from psycopg.pq import TransactionStatus
from psycopg.waiting import Ready, Wait


def break_connection(conn: psycopg.AsyncConnection[Any]) -> None:
    """Shut the connection's socket down under it, so whatever waits on it fails at
    once. For a connection that stopped answering: cancelling the wait instead would
    make psycopg send a cancel request down the same dead path and wait for it."""
    with contextlib.suppress(OSError, psycopg.Error):
        fd = conn.pgconn.socket
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)


def _ready_now(fileno: int, wanted: Wait) -> int:
    """Whether the socket can be read or written right now, without waiting."""
    poll = select.poll()
    poll.register(
        fileno,
        (select.POLLIN if wanted & Wait.R else 0) | (select.POLLOUT if wanted & Wait.W else 0),
    )
    ready: int = Ready.NONE
    for _, event in poll.poll(0):
        if event & (select.POLLIN | select.POLLERR | select.POLLHUP):
            ready |= Ready.R
        if event & select.POLLOUT:
            ready |= Ready.W
    return ready


async def _either(fileno: int) -> int:
    """Until the socket can be read or written (psycopg asks for both while it flushes
    a large message, to read what the server sends meanwhile)."""
    ready = _ready_now(fileno, Wait.RW)
    if ready:
        return ready
    found: int = Ready.NONE
    async with trio.open_nursery() as nursery:

        async def until(wait: Any, state: Ready) -> None:
            nonlocal found
            await wait(fileno)
            found |= state
            nursery.cancel_scope.cancel()

        nursery.start_soon(until, trio.lowlevel.wait_readable, Ready.R)
        nursery.start_soon(until, trio.lowlevel.wait_writable, Ready.W)
    return found


async def drive(conn: psycopg.AsyncConnection[Any], gen: PQGen[RV]) -> RV:
    """Run one of psycopg's generators on ``conn`` to its end, waiting in trio.

    Interrupted while the server is answering (a cancellation, a timeout), the
    connection cannot be used again: the rest of the answer would be read as the
    answer to the next statement. Its socket is shut down, so it fails at once and
    is thrown away, rather than cancel the statement down a path that may be dead."""
    fileno = conn.pgconn.socket
    try:
        state = next(gen)
        while True:
            if state == Wait.R:
                await trio.lowlevel.wait_readable(fileno)
                state = gen.send(Ready.R)
            elif state == Wait.W:
                await trio.lowlevel.wait_writable(fileno)
                state = gen.send(Ready.W)
            else:
                state = gen.send(await _either(fileno))
    except StopIteration as done:
        result: RV = done.value
        return result
    except OSError as exc:
        raise errors.OperationalError("connection socket closed") from exc
    except BaseException:
        if conn.pgconn.transaction_status == TransactionStatus.ACTIVE:
            break_connection(conn)
        raise


class TrioConnection(psycopg.AsyncConnection[Any]):
    """An :class:`psycopg.AsyncConnection` whose waits are trio's when trio calls it.

    Connect it through the asyncio door (``aio.call(TrioConnection.connect, ...)``);
    then await its methods from trio directly. Only one trio task may use it at a
    time: its lock is asyncio's, which trio cannot wait on."""

    async def wait(
        self,
        gen: PQGen[RV],
        interval: float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109  (psycopg's signature)
    ) -> RV:
        if sniffio.current_async_library() != "trio":
            if interval is None:
                return await super().wait(gen, timeout=timeout)
            return await super().wait(gen, interval, timeout)
        if timeout is None:
            return await drive(self, gen)
        with trio.move_on_after(timeout):  # psycopg's own bound: notifies(timeout=...)
            return await drive(self, gen)
        raise errors._WaitTimeout("wait timeout expired")
