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

That bound is lost while any transaction with an xid stays open (a session idle
in its transaction after a write, a prepared transaction). The table's writers
(relay/writers.py) give a second bound that only a transaction that has written
to this table can hold back, and only for the claims whose snapshot sees it
finished; each claim uses the later of the two. While neither is known (at start),
the claim walks from the first entry, as every claim did before.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from relay.writers import NO_POLL, UNKNOWN, WriterPoll

# A row inserted more than this long after its created_at is flagged late by the
# trigger (sql/install/004_late_rows.sql), and every claim walks back this far
# behind the bound. Long enough that a request's transaction is never late; short
# enough that the walk back costs little.
LATE_INSERT_SECONDS = 1.0

# On a partitioned table the walks end this far (and the late-insert slack) past
# the claim statement's start, unless a row flagged late lies beyond (see
# walk_ceiling in sql/queries.sql): how long a claim's snapshot may come after its
# statement began, behind a lock, and still see a row inserted meanwhile on time.
CLAIM_REACH_MARGIN_SECONDS = 60.0
# How often a claim on a partitioned table looks for flagged rows beyond the walks'
# bound (a look opens the partitions ahead once): the longest such a row waits.
LOOK_BEYOND_EVERY = 1.0

MIN_SEQ = -(2**63)
MAX_SEQ = 2**63 - 1


@dataclass(frozen=True, slots=True)
class StartKey:
    """The claim's parameters for where its walks start (timestamps as Postgres
    text, exact)."""

    start_at: str
    start_seq: int
    bound_at: str  # the snapshots' bound
    # The writers' bound: when the poll of the table's writers began, and the
    # writers it saw with their own bounds, as Postgres array literals.
    locks_at: str = UNKNOWN
    writer_xids: str = "{}"
    writer_since: str = "{}"
    # Where the walks end on a partitioned table, beyond the claim's reach ('infinity':
    # nowhere; '-infinity': at the reach), and whether the claim looks for flagged
    # rows beyond the reach ('-infinity') or not ('infinity'). Not part of where the
    # walks start, so not of a key's identity.
    ceiling: str = field(default="infinity", compare=False)
    beyond_from: str = field(default="infinity", compare=False)
    # Where the walks from the start begin on a partitioned table, at the earliest
    # ('infinity': at the floor the key gives, see walk_floor; '-infinity': nowhere).
    floor_cap: str = field(default="-infinity", compare=False)


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
    finished_writers: frozenset[int] = frozenset()  # xids its snapshot saw finished
    from_first_entry: bool = False  # its walks started at the first entry
    bound_at: str = UNKNOWN  # the bound it walked from (less the late-insert slack)
    # A live flagged row lies beyond the walks' reach; None: not looked for.
    rows_beyond: bool | None = None


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


# Finished writers remembered (see ClaimStart._finished): far more than are ever
# listed by the polls of one claim's time.
FINISHED_KEPT = 4096


def array_literal(values: list[str]) -> str:
    """A Postgres array literal of ``values``, each quoted (timestamps have spaces)."""
    return "{" + ",".join(f'"{v}"' for v in values) + "}"


class ClaimStart:
    """The start key, carried from claim to claim. Claims must be fed in the order
    they ran (the relay's claims take turns): :meth:`sending` as each is sent,
    :meth:`observe` with its summary."""

    def __init__(self) -> None:
        self._key = FROM_FIRST_ENTRY
        # A rewind holds until a claim that walked from the first entry reports with
        # its guard on: a claim already in flight (from the old key) must not undo it.
        self._rewind = False
        # (xid, statement time) of earlier claims, oldest first; xids only grow.
        self._claims: deque[tuple[int, str]] = deque()
        # Why the last rewind happened, for the log (None: none pending).
        self.rewound_for: str | None = None
        # The table's writers: the newest poll, the newest when the last claim was
        # sent, and the one the next claim rests on (it finished before the claim
        # whose first live entry the next claim starts from began).
        self._latest_poll = NO_POLL
        self._sent_poll = NO_POLL
        self._poll = NO_POLL
        # Writers a claim saw finished (its first live entry covers their rows), the
        # latest FINISHED_KEPT: a poll that began before one committed may list it
        # after it is gone from later ones.
        self._finished: dict[int, None] = {}
        self.walked_from_first_entry = True
        self.walked_bound = UNKNOWN
        # The last look for flagged rows beyond the walks' reach found some: the walks
        # go to the end until a look finds none. When the last look was sent (the
        # caller's clock, seconds).
        self._beyond = False
        self._looked_at = float("-inf")
        # The last claim's look found rows beyond the reach that its walks did not
        # take: the next claim will (claim again now rather than sleep).
        self.found_beyond = False

    def offer(self, poll: WriterPoll) -> None:
        """A poll of the table's writers has finished."""
        self._latest_poll = poll

    def key(self) -> StartKey:
        """Where the next claim starts."""
        poll = self._poll
        if self._rewind or (self._key.bound_at == UNKNOWN and not poll.known):
            return FROM_FIRST_ENTRY
        if not poll.known:
            return self._key
        writers = [w for w in poll.writers if w.xid not in self._finished]
        return replace(
            self._key,
            locks_at=poll.polled_at,
            writer_xids="{" + ",".join(str(w.xid) for w in writers) + "}",
            writer_since=array_literal([w.since for w in writers]),
        )

    def sending(self, now: float = 0.0) -> StartKey:
        """The key for a claim being sent at ``now`` (seconds, any steady clock)."""
        self._sent_poll = self._latest_poll
        key = self.key()
        if key == FROM_FIRST_ENTRY:
            return key  # to the end, whatever the reach
        look = now - self._looked_at >= LOOK_BEYOND_EVERY
        if look:
            self._looked_at = now
        return replace(
            key,
            ceiling="infinity" if self._beyond else "-infinity",
            beyond_from="-infinity" if look else "infinity",
            floor_cap="infinity",
        )

    @staticmethod
    def without_floor(key: StartKey) -> StartKey:
        """``key`` for the claim run again after ``key``'s was refused, its walks
        starting below their floor. Nothing of the refused claim is observed: it
        claimed nothing and its summary says nothing of where the next should start."""
        return replace(key, floor_cap="-infinity")

    def observe(self, summary: ClaimSummary, used: StartKey) -> None:
        """Take the summary of a claim that ran from ``used``."""
        self.walked_from_first_entry = summary.from_first_entry
        self.walked_bound = summary.bound_at
        self.found_beyond = False
        if used.beyond_from == "-infinity" and summary.rows_beyond is not None:
            self.found_beyond = summary.rows_beyond and used.ceiling != "infinity"
            self._beyond = summary.rows_beyond
        # The poll that finished before this claim was sent bounds what the next
        # claim may see that this one did not.
        self._poll = self._sent_poll
        self._finished.update(dict.fromkeys(summary.finished_writers))
        while len(self._finished) > FINISHED_KEPT:
            del self._finished[next(iter(self._finished))]
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
        bound_at = UNKNOWN if bound is None else bound
        if summary.start_at is None:
            self._key = StartKey("infinity", MAX_SEQ, bound_at)
        elif summary.start_seq is None:
            # A live row without its place among the inserts: the table's check
            # (sql/install/004_late_rows.sql) is missing. No key can name it.
            self._key = FROM_FIRST_ENTRY
            self.rewind("a live row has no relay_seq")
        else:
            self._key = StartKey(summary.start_at, summary.start_seq, bound_at)

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

    def sweep_key(self) -> StartKey | None:
        """Where the claims start, for the sweep (None: they walk from the first
        entry, and the sweep has nothing to look for)."""
        key = self.key()
        if key == FROM_FIRST_ENTRY or self.walked_bound == UNKNOWN:
            return None
        return StartKey(key.start_at, key.start_seq, self.walked_bound)
