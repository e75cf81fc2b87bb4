"""Where a claim's walk of the claim index starts: a pure state machine, fed each
claim's summary (see the claim in sql/queries.sql, which says why).

A claim that walked from the index's first entry paid for every dead entry there,
and while anything holds the MVCC horizon back those are every row published
since. So each claim starts at the earliest of:

- the first live entry the previous claim saw (the rows committed by then);
- the earliest ``created_at`` a row committed since can have: its transaction took
  its xid after the snapshot's xmin, so after an earlier claim whose own xid is
  older than that xmin, and so after that claim's statement time; a row is
  inserted within :data:`LATE_INSERT_SECONDS` of its ``created_at`` unless the
  late-insert trigger flagged it, and flagged rows the claim finds by themselves.

Until the relay has seen a claim whose xid is older than a snapshot's xmin (at
start, or while a transaction that has written stays open), the bound is unknown
and the claim walks from the first entry, as every claim did before.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# A row inserted more than this long after its created_at is flagged late by the
# trigger (sql/install/004_late_rows.sql), and every claim walks back this far
# behind the bound. Long enough that a request's transaction is never late; short
# enough that the walk back costs little.
LATE_INSERT_SECONDS = 1.0

MIN_SEQ = -(2**63)
MAX_SEQ = 2**63 - 1


@dataclass(frozen=True, slots=True)
class StartKey:
    """The claim's parameters for where its walks start (timestamps as Postgres
    text, exact)."""

    start_at: str
    start_seq: int
    bound_at: str


# Every walk from the index's first entry: the claim as it was before start keys.
FROM_FIRST_ENTRY = StartKey("-infinity", MIN_SEQ, "-infinity")


@dataclass(frozen=True, slots=True)
class ClaimSummary:
    """What a claim reports about itself (its last row)."""

    start_at: str | None  # the first live entry's created_at; None: no live row
    start_seq: int | None  # None with a start_at: a live row with no relay_seq
    statement_at: str  # the claim statement's time (statement_timestamp())
    xmin: int  # its snapshot's xmin
    xid: int | None  # its transaction's xid; None: it locked nothing
    # The claim's guard was off: a late-row trigger did not fire ALWAYS, or the clock
    # was behind the bound. The claim walked from the first entry.
    guard_off: bool = False


# Earlier claims kept for the bound. While a transaction that has written holds the
# xmin, every claim adds one and none can be let go; past this many, every other
# one is let go (the first and the last stay): any claim whose xid is older than a
# later xmin gives a sound bound, only an earlier one.
CLAIMS_KEPT = 1024


def thinned(claims: deque[tuple[int, str]]) -> deque[tuple[int, str]]:
    """Every other claim of ``claims``, keeping the first and the last."""
    kept = list(claims)[::2]
    if kept[-1] != claims[-1]:
        kept.append(claims[-1])
    return deque(kept)


class ClaimStart:
    """The start key, carried from claim to claim. Claims must be fed in the order
    they ran (the relay's claims take turns)."""

    def __init__(self) -> None:
        self._key = FROM_FIRST_ENTRY
        # A rewind holds until a claim that walked from the first entry reports with
        # its guard on: a claim already in flight (from the old key) must not undo it.
        self._rewind = False
        # (xid, statement time) of earlier claims, oldest first; xids only grow.
        self._claims: deque[tuple[int, str]] = deque()
        # Why the last rewind happened, for the log (None: none pending).
        self.rewound_for: str | None = None

    def key(self) -> StartKey:
        return FROM_FIRST_ENTRY if self._rewind else self._key

    def observe(self, summary: ClaimSummary, used: StartKey) -> None:
        """Take the summary of a claim that ran from ``used``."""
        if summary.guard_off:
            # Rows may have been written that no trigger flagged: walk from the first
            # entry until a claim that did so finds the guard on again.
            self.rewind("the late-row triggers do not fire, or the clock went back")
        elif used == FROM_FIRST_ENTRY:
            self._rewind = False
        if summary.xid is not None:
            self._claims.append((summary.xid, summary.statement_at))
            if len(self._claims) > CLAIMS_KEPT:
                self._claims = thinned(self._claims)
        # The latest claim whose xid is older than every transaction still running.
        while len(self._claims) > 1 and self._claims[1][0] < summary.xmin:
            self._claims.popleft()
        bound = self._claims[0][1] if self._claims and self._claims[0][0] < summary.xmin else None
        if bound is None:
            self._key = FROM_FIRST_ENTRY
        elif summary.start_at is None:
            self._key = StartKey("infinity", MAX_SEQ, bound)
        elif summary.start_seq is None:
            # A live row without its place among the inserts: the table's check
            # (sql/install/004_late_rows.sql) is missing. No key can name it.
            self._key = FROM_FIRST_ENTRY
            self.rewind("a live row has no relay_seq")
        else:
            self._key = StartKey(summary.start_at, summary.start_seq, bound)

    def rewind(self, why: str | None = None) -> None:
        """Walk from the first entry at the next claim (the sweep found a row before
        the start key, and said so; or a claim found what ``why`` says)."""
        if why is not None and not self._rewind:
            self.rewound_for = why
        self._rewind = True

    def take_rewind_reason(self) -> str | None:
        """Why the claims began to walk from the first entry since this was last
        asked (once per rewind, for the log), or None."""
        why, self.rewound_for = self.rewound_for, None
        return why

    @property
    def walks_from_first_entry(self) -> bool:
        return self.key().bound_at == "-infinity"
