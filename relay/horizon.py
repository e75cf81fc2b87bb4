"""What holds the MVCC horizon back, and for how long: decisions and wording, no I/O.

While a transaction, a standby's feedback, a replication slot or a prepared
transaction holds the horizon, every row the relay marks or deletes leaves a dead
tuple no vacuum may remove: the table and its indexes grow until it lets go. The
relay's claims do not pay for those (relay/claimstart.py); the operator still has
to end the holder, and these say which one it is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# How far back the clock remembers: a horizon older than this shows as this old.
XID_CLOCK_SPAN = 6 * 3600.0


@dataclass(frozen=True, slots=True)
class Holder:
    """One thing holding the horizon (the horizon_holders query's row)."""

    kind: str  # a key of HOLDER_KINDS
    pid: int | None
    name: str | None  # application_name, slot name, or the prepared transaction's gid
    state: str | None
    xids: int  # how many transactions old its xmin is
    seconds: float | None  # since its transaction started, where the role may see it
    visible: bool  # False: another role's session, without pg_read_all_stats
    wrote_table: bool = False  # it holds a RowExclusiveLock on the outbox table


# Each kind of holder: how `status` and the log name it, and what ends its hold.
HOLDER_KINDS = {
    "writer": (
        "session with an xid",
        "a transaction that has written, open (idle in transaction: a leaked session, a "
        "migration, a batch job): end it; idle_in_transaction_session_timeout is the backstop",
    ),
    "snapshot": (
        "session",
        "a long query or repeatable-read transaction: end it, or bound it with statement_timeout",
    ),
    "standby": (
        "standby's feedback",
        "a query on a hot standby with hot_standby_feedback: end it there, or bound it "
        "with statement_timeout on the standby",
    ),
    "slot": (
        "replication slot",
        "a slot whose consumer is behind or gone: pg_drop_replication_slot once it is gone",
    ),
    "prepared": (
        "prepared transaction",
        "a prepared transaction its coordinator forgot: COMMIT PREPARED or ROLLBACK "
        "PREPARED its gid",
    ),
}


def read_holders(rows: Iterable[Sequence[Any]]) -> list[Holder]:
    """The horizon_holders query's rows."""
    return [
        Holder(kind, pid, name, state, int(xids), seconds, visible, wrote)
        for kind, pid, name, state, xids, seconds, visible, wrote in rows
    ]


class XidClock:
    """When transaction ids were handed out, sampled now and then, so that the age
    of any xid (a slot's, another role's session's) can be told in seconds without
    any privilege: an xid below a sample's next xid was handed out before that
    sample. ``now`` is one monotonic clock (trio's)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def sample(self, now: float, next_xid: int) -> None:
        self._samples.append((now, next_xid))
        while len(self._samples) > 2 and self._samples[1][0] < now - XID_CLOCK_SPAN:
            self._samples.popleft()

    def age(self, xid: int, now: float) -> float:
        """At least how many seconds ago ``xid`` was handed out: since the first
        sample that came after it (0 if none did, the whole span if all did)."""
        for at, next_xid in self._samples:
            if next_xid > xid:
                return now - at
        return 0.0


def holder_seconds(holder: Holder, clock: XidClock, next_xid: int, now: float) -> float:
    """How long ``holder`` has held the horizon: its transaction's age where the role
    may see it, and at least as long as the clock says its xmin is old."""
    by_clock = clock.age(next_xid - holder.xids, now)
    return max(holder.seconds or 0.0, by_clock)


def describe(holder: Holder, seconds: float) -> str:
    """One line for `outbox-relay status` and the log."""
    age = _age(seconds)
    kind = HOLDER_KINDS[holder.kind][0] if holder.kind in HOLDER_KINDS else holder.kind
    wrote = (
        "; it has written to the outbox table: its rows go out when it commits, and only "
        "the claim that first sees it committed walks back to them"
        if holder.wrote_table
        else ""
    )
    if not holder.visible:
        return (
            f"held for at least {age} ({holder.xids} transactions) by {kind} pid {holder.pid} "
            f"of another role, application {holder.name!r}: its state and start are hidden "
            f"from this role (grant it pg_read_all_stats to see them){wrote}"
        )
    where = f"pid {holder.pid}, " if holder.pid is not None else ""
    return (
        f"held for {age} ({holder.xids} transactions) by {kind} {holder.name!r} "
        f"({where}{holder.state}){wrote}"
    )


def advice(holders: Iterable[Holder]) -> list[str]:
    """What ends the hold, once for each kind among ``holders``."""
    kinds = dict.fromkeys(h.kind for h in holders if h.kind in HOLDER_KINDS)
    return [HOLDER_KINDS[kind][1] for kind in kinds]


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"
