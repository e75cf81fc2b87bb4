"""A coalescing wake-up: many signals while the scheduler is busy become one pass."""

from __future__ import annotations

import trio


class Wakeup:
    """``set(reason)`` never blocks; ``wait()`` returns the reasons collected since the
    last wait. A notification is only a hint that rows may be there: the scheduler
    re-reads the table, so folding several hints into one pass loses nothing."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self._reasons: set[str] = set()

    def set(self, reason: str) -> None:
        self._reasons.add(reason)
        self._event.set()

    @property
    def pending(self) -> bool:
        return self._event.is_set()

    async def wait_pending(self) -> None:
        """Until a wake-up is pending, without taking it."""
        await self._event.wait()

    def take(self) -> frozenset[str]:
        """The reasons pending now (maybe none), cleared."""
        reasons = frozenset(self._reasons)
        self._reasons.clear()
        self._event = trio.Event()
        return reasons

    async def wait(self) -> frozenset[str]:
        await self._event.wait()
        return self.take()
