"""The one loop that keeps trying something that depends on a server: connect to
NATS, wait for the database, keep the LISTEN connection, run a batch. Each failure
is logged in one line and followed by a pause from a :class:`ReconnectBackoff`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from relay.backoff import ReconnectBackoff

log = logging.getLogger(__name__)

T = TypeVar("T")


async def retry(
    attempt: Callable[[], Awaitable[T]],
    *,
    failures: tuple[type[BaseException], ...],
    backoff: ReconnectBackoff,
    describe: Callable[[BaseException], str] = str,
    on_failure: Callable[[BaseException], None] | None = None,
    pause: Callable[[float], Awaitable[object]] = trio.sleep,
) -> T:
    """``attempt()`` until it returns, and its result. After a failure of one of
    ``failures`` (any other propagates): ``on_failure``, a warning "<what>; retrying
    in <delay>", and ``pause`` for the backoff's next delay (a caller that may stop
    meanwhile wakes early, and its attempt raises). The caller resets the backoff
    when what it keeps up is up: a connection may fail long after its attempt began."""
    while True:
        try:
            return await attempt()
        except failures as exc:
            if on_failure is not None:
                on_failure(exc)
            delay = backoff.next_delay()
            log.warning("%s; retrying in %.1fs", describe(exc), delay)
            await pause(delay)
