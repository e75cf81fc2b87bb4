"""The one door between trio and asyncio.

psycopg's async API and nats-py are asyncio libraries; the relay is a trio
program. Every call into them goes through :func:`call`, so no function mixes
the two worlds, and a trio cancellation cancels the asyncio side cleanly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, ParamSpec, TypeVar

import trio_asyncio

P = ParamSpec("P")
T = TypeVar("T")


async def call(fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Await the asyncio coroutine function ``fn(*args, **kwargs)`` from trio."""
    result: T = await trio_asyncio.aio_as_trio(fn)(*args, **kwargs)
    return result


def open_loop() -> AbstractAsyncContextManager[Any]:
    """The asyncio loop that runs inside trio for the whole process."""
    loop: AbstractAsyncContextManager[Any] = trio_asyncio.open_loop()
    return loop
