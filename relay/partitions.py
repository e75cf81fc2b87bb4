"""A time-partitioned outbox table: partitions created ahead, and expired ones
dropped by retention instead of their rows being deleted (docs/partitions.md).

The decisions are the pure functions here; relay/database.py runs their SQL
(sql/partitions.sql). All times are epoch seconds on the database's clock, which
is the one that writes created_at.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import trio

from relay.claimstart import CLAIM_REACH_MARGIN_SECONDS, LATE_INSERT_SECONDS
from relay.config import Config
from relay.errors import RelayError, SetupError, first_line
from relay.metrics import Metrics

if TYPE_CHECKING:  # relay/database.py runs this module's plans
    from relay.database import Database, PartitionLayout

log = logging.getLogger(__name__)

# Partitions one round creates at most: a relay back after a long stop catches up
# over a few rounds rather than holding the partition lock for one long one.
CREATE_LIMIT = 64
# Postgres cuts longer identifiers short, and two partitions would then share a name.
MAX_IDENTIFIER_BYTES = 63
# Past this many partitions that every claim opens, the relay says, once, what they
# cost it (docs/partitions.md, *What partitions cost*).
PARTITIONS_WARNED = 40
# The most partitions the relay keeps ahead of now, whatever --partitions-ahead asks:
# every claim locks every partition, in a lock table the whole server shares, and
# 3 days of one-minute partitions filled it within a minute (docs/partitions.md,
# *The server's lock table*). Hourly partitions keep their 3 days.
MAX_PARTITIONS_AHEAD = 100
# Lock table entries a claim planned afresh (after each partition created or dropped)
# holds for each partition of the table, at most: tests/integration/test_partitions.py
# measures it.
LOCKS_A_PARTITION = 14
# Past this share of the server's lock table, the relay says what its claims take.
LOCK_SHARE_WARNED = 0.25


@dataclass(frozen=True)
class Partition:
    """One partition as the catalog has it, its bounds in epoch seconds: -inf for
    MINVALUE, inf for MAXVALUE, None for a DEFAULT partition (left alone)."""

    name: str
    start: float | None
    end: float | None
    detach_pending: bool = False


@dataclass(frozen=True)
class NewPartition:
    name: str
    start: float
    end: float


def opened_by_claims(partitions: Sequence[Partition], now: float) -> int:
    """How many of ``partitions`` every claim opens: those that start within the
    claims' reach of ``now`` (the partitions ahead past it are pruned; those behind
    the walks' floor are opened by the lookups of late and dead rows alone)."""
    reach = now + LATE_INSERT_SECONDS + CLAIM_REACH_MARGIN_SECONDS
    return sum(1 for p in partitions if p.start is None or p.start <= reach)


def partition_name(base: str, start: float) -> str:
    """``<table>_pYYYYMMDD_HHMM`` of the partition's start in UTC (seconds too when
    the start is not on a minute), so that names sort as the partitions do."""
    moment = datetime.fromtimestamp(start, UTC)
    stamp = moment.strftime("%Y%m%d_%H%M" if moment.second == 0 else "%Y%m%d_%H%M%S")
    name = f"{base}_p{stamp}"
    if len(name.encode()) > MAX_IDENTIFIER_BYTES:
        raise ValueError(
            f"partition name {name!r} is longer than Postgres's {MAX_IDENTIFIER_BYTES} bytes: "
            "a partitioned outbox table's name may have at most "
            f"{MAX_IDENTIFIER_BYTES - len(name.encode()) + len(base.encode())} bytes"
        )
    return name


def _live(partitions: Sequence[Partition]) -> list[tuple[float, float]]:
    """The bounds of the partitions that are not DEFAULT and not being detached,
    oldest first (a MINVALUE start is -inf, a MAXVALUE end inf)."""
    return sorted(
        (p.start, p.end)
        for p in partitions
        if p.start is not None and p.end is not None and not p.detach_pending
    )


def period_of(partitions: Sequence[Partition]) -> float | None:
    """The period: the newest partition's width, of those with two finite bounds
    (None: there is none)."""
    widths = [end - start for start, end in _live(partitions) if math.isfinite(end - start)]
    return widths[-1] if widths else None


def partitions_to_create(
    partitions: Sequence[Partition],
    now: float,
    ahead: float,
    base: str,
    *,
    period: float | None = None,
    limit: int = CREATE_LIMIT,
) -> list[NewPartition]:
    """The partitions that make the table reach ``ahead`` seconds past ``now``, each
    one period wide (the newest partition's width unless ``period`` is given), each
    starting where the newest ends. After a gap (the relay was stopped longer than
    the partitions reached) they start again at the period that holds ``now``,
    aligned to the epoch, rather than fill a past no producer writes to now."""
    period = period or period_of(partitions)
    if period is None or period <= 0:
        return []
    ahead = capped_ahead(ahead, period)
    live = _live(partitions)
    current = math.floor(now / period) * period
    start = current
    if live:
        newest_end = max(end for _, end in live)
        if math.isinf(newest_end):  # a MAXVALUE partition: nothing can follow it
            return []
        start = newest_end if newest_end > current else current
    created: list[NewPartition] = []
    while start < now + ahead and len(created) < limit:
        created.append(NewPartition(partition_name(base, start), start, start + period))
        start += period
    return created


def capped_ahead(ahead: float, period: float) -> float:
    """How far ahead the relay keeps partitions of ``period`` when asked for
    ``ahead``: at most :data:`MAX_PARTITIONS_AHEAD` of them."""
    return min(ahead, MAX_PARTITIONS_AHEAD * period)


def lock_share(partitions: int, lock_slots: int) -> float:
    """The share of the server's lock table (``lock_slots`` entries) one relay's claim
    planned afresh takes on a table of ``partitions`` partitions; 0 when unknown."""
    return partitions * LOCKS_A_PARTITION / lock_slots if lock_slots > 0 else 0.0


def reach(partitions: Sequence[Partition], now: float) -> float:
    """Seconds from ``now`` to the end of the partitions that cover it without a
    gap: how long producers can go on inserting if no partition were created.
    0 when none covers ``now`` (producers' inserts fail); inf past a MAXVALUE one."""
    end: float | None = None
    for start, stop in _live(partitions):
        if end is None:
            if start <= now < stop:
                end = stop
        elif start == end:
            end = stop
        else:
            break
    return 0.0 if end is None else end - now


def expired(partitions: Sequence[Partition], now: float, retention: float) -> list[Partition]:
    """Partitions retention may drop, oldest first: every row in them was created
    more than ``retention`` ago. A partition whose detach is pending (an earlier
    round stopped half-way) comes first whatever its age: only the relay's
    retention or an operator starts one, and it is already out of producers' way."""
    pending = [p for p in partitions if p.detach_pending]
    cutoff = now - retention
    old = [
        p for p in partitions
        if not p.detach_pending and p.end is not None and p.start is not None and p.end <= cutoff
    ]  # fmt: skip
    return pending + sorted(old, key=lambda p: p.end or 0.0)  # every end here is a float


async def run_partition_creation(config: Config, database: Database, metrics: Metrics) -> None:
    """Keep the table's partitions reaching ``config.partitions_ahead`` past now, on
    a range-partitioned table; on a plain one, look again now and then (a table
    migrated while the relay runs)."""
    warned: set[str] = set()
    while True:
        interval = config.retention_interval
        try:
            layout = await database.partition_layout()
            if layout.managed:
                judge_layout(config, metrics, layout, warned)
                interval = await _create_ahead(config, database, metrics, layout)
            else:  # 0 on a plain table, where the alerts on them never fire
                metrics.partitions_ahead_target.set(0)
                metrics.partitions_lock_share.set(0)
        except SetupError as exc:
            metrics.database_errors.labels(task="partitions").inc()
            log.error(
                "creating partitions failed: %s; creating them takes the table's owner (a "
                "role from `install --grant-to` has no DDL): run the relay as the owner, or "
                "`outbox-relay install` as the owner on a schedule (docs/partitions.md)",
                first_line(exc.__cause__ or exc),  # the server's words, not the grant hint
            )
        except RelayError as exc:
            metrics.database_errors.labels(task="partitions").inc()
            log.warning("creating partitions failed, will retry: %s", exc)
        except ValueError as exc:
            metrics.database_errors.labels(task="partitions").inc()
            log.error("cannot create partitions: %s", exc)
        await trio.sleep(interval)


def judge_layout(
    config: Config, metrics: Metrics, layout: PartitionLayout, warned: set[str]
) -> None:
    """Export how far ahead the partitions are kept and what share of the server's
    lock table a claim takes; say once each what costs too much, and why."""
    period = period_of(layout.partitions)
    target = capped_ahead(config.partitions_ahead, period) if period else config.partitions_ahead
    metrics.partitions_ahead_target.set(target)
    if target < config.partitions_ahead and "ahead" not in warned:
        warned.add("ahead")
        log.warning(
            "%s: --partitions-ahead %gs would be %d partitions of %gs; the relay keeps "
            "%d (%gs ahead): every claim locks every partition, in a lock table the whole "
            "server shares (docs/partitions.md); a longer period keeps more time ahead",
            config.table_display, config.partitions_ahead,
            math.ceil(config.partitions_ahead / period) if period else 0, period or 0,
            MAX_PARTITIONS_AHEAD, target,
        )  # fmt: skip
    share = lock_share(len(layout.partitions), layout.lock_slots)
    metrics.partitions_lock_share.set(share)
    if share > LOCK_SHARE_WARNED and "locks" not in warned:
        warned.add("locks")
        log.error(
            "%s has %d partitions: a claim planned afresh (after each partition created or "
            "dropped) holds about %d of the server's %d lock table entries "
            "(max_locks_per_transaction x (max_connections + max_prepared_transactions)); "
            "when they run out, every statement on the server fails with 'out of shared "
            "memory', producers' inserts included: raise max_locks_per_transaction, or "
            "choose a longer period or a shorter --retention (docs/partitions.md)",
            config.table_display, len(layout.partitions),
            len(layout.partitions) * LOCKS_A_PARTITION, layout.lock_slots,
        )  # fmt: skip
    opened = opened_by_claims(layout.partitions, layout.now)
    if opened > PARTITIONS_WARNED and "opened" not in warned:
        warned.add("opened")
        log.warning(
            "%s has %d partitions up to a minute past now: every claim opens "
            "each of them to look for late and dead rows, which costs the claim "
            "about 15us a partition (docs/partitions.md); a longer period, or a "
            "shorter --retention, makes fewer",
            config.table_display,
            opened,
        )


async def _create_ahead(
    config: Config, database: Database, metrics: Metrics, layout: PartitionLayout
) -> float:
    """One round: the reach as it is (exported first, so that it is right when
    creating fails), the partitions the table lacks, and the delay to the next round."""
    metrics.partitions_ahead.set(reach(layout.partitions, layout.now))
    interval = config.retention_interval
    period = period_of(layout.partitions)
    if period:
        # Often enough that one missed round never costs a period's reach.
        interval = min(interval, max(period / 4, 1.0))
    created = await database.create_partitions(config.partitions_ahead)
    if created:
        metrics.partitions_created.inc(len(created))
        log.info("created partitions %s", ", ".join(p.name for p in created))
        layout = await database.partition_layout()
        metrics.partitions_ahead.set(reach(layout.partitions, layout.now))
    return 0.0 if len(created) == CREATE_LIMIT else interval


async def retire_partitions(
    config: Config, database: Database, metrics: Metrics, layout: PartitionLayout
) -> None:
    """One retention round on a partitioned table (its ``layout`` as just read):
    every expired partition that holds no row still to publish is detached
    (concurrently: producers never wait) and dropped. One that holds such rows
    stays, counted and logged with them."""
    held = 0
    for partition in expired(layout.partitions, layout.now, config.retention):
        if not partition.detach_pending:
            rows = await database.partition_held(partition.name)
            if rows:
                held += 1
                log.warning(
                    "retention keeps partition %s of %s: it holds rows not yet published "
                    "(or dead), such as %s (`outbox-relay status` lists them)",
                    partition.name,
                    config.table_display,
                    ", ".join(rows),
                )
                continue
            await database.detach_partition(partition.name)
        else:
            await database.finalize_detach(partition.name)
        # A row may have come in with an old created_at between the check and the
        # detach: such a partition goes back, whole.
        rows = await database.partition_held(partition.name)
        if rows and partition.start is not None and partition.end is not None:
            await database.attach_partition(partition.name, partition.start, partition.end)
            log.warning("retention put partition %s back: rows came in as it was detached "
                        "(%s)", partition.name, ", ".join(rows))  # fmt: skip
            held += 1
            continue
        if rows:
            held += 1
            log.warning("retention leaves detached partition %s alone: it holds rows not yet "
                        "published (%s)", partition.name, ", ".join(rows))  # fmt: skip
            continue
        await database.drop_partition(partition.name)
        metrics.partitions_dropped.inc()
        log.info("retention dropped partition %s of %s", partition.name, config.table_display)
    metrics.partitions_held.set(held)
