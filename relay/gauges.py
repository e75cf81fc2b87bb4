"""Table-wide gauges, read on a short interval: backlog, oldest row, dead rows,
skipped rows and the subjects dead rows hold back; what holds the vacuum horizon
back, and the table's dead tuples and size."""

from __future__ import annotations

import logging

import trio

from relay.config import Config
from relay.database import Database
from relay.errors import RelayError
from relay.horizon import XidClock, describe, holder_seconds
from relay.metrics import Metrics

log = logging.getLogger(__name__)

# The backlog query reads the contract's index of unpublished rows, and while the
# horizon is held that index keeps a dead entry for every row published since: the
# query may then take long. It is read again only after this many times as long as
# it took, so it never takes more than a small share of a database core.
BACKLOG_DUTY = 20.0

# A horizon held longer than this is logged (once, then when it lets go).
HORIZON_WARNING = 300.0


def next_backlog_read(started: float, took: float, interval: float) -> float:
    """When to read the backlog again, after a read that began at ``started`` and
    took ``took`` seconds."""
    return started + max(interval, took * BACKLOG_DUTY)


async def run_gauges(config: Config, database: Database, metrics: Metrics) -> None:
    clock = XidClock()
    backlog_due = trio.current_time()
    warned = False
    while True:
        now = trio.current_time()
        try:
            health, holders = await database.horizon()
        except RelayError as exc:
            metrics.database_errors.labels(task="gauges").inc()
            log.warning("could not read the table's health: %s", exc)
        else:
            clock.sample(now, health.next_xid)
            metrics.table_dead_tuples.set(health.dead_tuples)
            metrics.table_bytes.set(health.total_bytes)
            seconds = 0.0
            if holders:
                seconds = holder_seconds(holders[0], clock, health.next_xid, now)
            metrics.horizon_age.set(seconds)
            metrics.horizon_xids.set(holders[0].xids if holders else 0)
            if seconds > HORIZON_WARNING and not warned:
                log.warning(
                    "the vacuum horizon is %s: %d dead tuples in %s so far, which no "
                    "vacuum may remove until it lets go (`outbox-relay status`)",
                    describe(holders[0], seconds),
                    health.dead_tuples,
                    config.table_display,
                )
                warned = True
            elif warned and seconds < HORIZON_WARNING:
                log.info("the vacuum horizon moves again")
                warned = False
        if now >= backlog_due:
            started = trio.current_time()
            try:
                backlog = await database.backlog(config.max_attempts)
            except RelayError as exc:
                metrics.database_errors.labels(task="gauges").inc()
                log.warning("could not read the backlog: %s", exc)
            else:
                metrics.unpublished.set(backlog.unpublished)
                metrics.dead_rows.set(backlog.dead)
                metrics.skipped_rows.set(backlog.skipped)
                metrics.held_subjects.set(backlog.held_subjects)
                metrics.oldest_age.set(backlog.oldest_age_seconds)
            took = trio.current_time() - started
            backlog_due = next_backlog_read(started, took, config.gauge_interval)
        await trio.sleep(config.gauge_interval)
