"""The outbox table's writers: transactions that hold a RowExclusiveLock on the
table and have an xid, read from ``pg_locks`` a few times a second (the
``table_writers`` query). They give the claims a bound that a long transaction
elsewhere cannot take away (relay/claimstart.py says where the bound is used).

Why it holds. A row that a claim sees and an earlier claim did not belongs to a
transaction that committed between the two. A poll that finished before the
earlier claim began either saw that transaction holding the table's lock (and its
xid), or the transaction took the lock, and so inserted its rows, after the poll
began: its rows' ``created_at`` is then no earlier than the poll's time less the
late-insert slack (or the trigger flagged them). For a writer a poll saw, the
bound is the time of the last poll that did not see it: it took the lock after
that one began. A writer is only waited for by the claims whose snapshot sees it
finished; while it runs, its rows are not visible to any claim.

``pg_locks`` reads the backends' fast-path locks, then the shared lock table,
each under the lock that its owner takes to change it: per backend, a lock taken
after the read began is not seen, and one held before is. A transaction's xid lock
is in the shared table and read last, so a writer seen without one took its xid,
and wrote its rows, after the poll began.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from relay.errors import RelayError

if TYPE_CHECKING:  # relay.database imports this module (through relay.claimstart)
    from relay.database import Database
    from relay.metrics import Metrics

log = logging.getLogger(__name__)

# How often the writers are read. pg_locks takes every lock-manager partition's lock
# for a moment: a few reads a second cost the producers nothing measurable
# (docs/performance.md), one per claim would.
WRITERS_INTERVAL = 0.25

UNKNOWN = "-infinity"


@dataclass(frozen=True, slots=True)
class Writer:
    xid: int  # its top-level xid, with the epoch (xid8)
    since: str  # no row of it has an earlier created_at, unflagged (exact text)


@dataclass(frozen=True, slots=True)
class WriterPoll:
    """One read of the table's writers: when it began (exact text) and whom it saw."""

    polled_at: str
    writers: tuple[Writer, ...] = ()

    @property
    def known(self) -> bool:
        return self.polled_at != UNKNOWN


NO_POLL = WriterPoll(UNKNOWN)


class WriterTracker:
    """Carries each writer's bound from poll to poll: a pure state machine, fed the
    polls in the order they ran."""

    def __init__(self) -> None:
        self._last: WriterPoll | None = None

    def observe(self, polled_at: str, seen: Sequence[tuple[int, str | None]]) -> WriterPoll:
        """Take a poll that began at ``polled_at`` and saw ``seen``: each writer's xid
        and, when the relay's role may read it, its transaction's start. A poll that
        failed in between changes nothing: a writer the last poll did not see took
        the lock after that poll began."""
        known = {} if self._last is None else {w.xid: w.since for w in self._last.writers}
        writers = []
        for xid, started in seen:
            if xid in known:
                since = known[xid]
            elif self._last is not None:
                # Not holding the lock when the last poll began.
                since = self._last.polled_at
            else:
                # There at the first poll: its transaction's start, or unknown (a
                # prepared transaction, another role's session).
                since = started if started is not None else UNKNOWN
            writers.append(Writer(xid, since))
        self._last = WriterPoll(polled_at, tuple(writers))
        return self._last


async def run_writer_polls(database: Database, metrics: Metrics) -> None:
    """Read the table's writers every :data:`WRITERS_INTERVAL` and offer each poll
    to the claims' start key."""
    tracker = WriterTracker()
    failing = False
    while True:
        try:
            polled_at, seen = await database.table_writers()
        except RelayError as exc:
            metrics.database_errors.labels(task="writers").inc()
            if not failing:
                log.warning("could not read the table's writers (claims may walk further "
                            "back until it can): %s", exc)  # fmt: skip
                failing = True
        else:
            if failing:
                log.info("the table's writers are read again")
                failing = False
            poll = tracker.observe(polled_at, seen)
            database.claim_start.offer(poll)
            metrics.table_writers.set(len(poll.writers))
        await trio.sleep(WRITERS_INTERVAL)
