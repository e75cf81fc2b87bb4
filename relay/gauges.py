"""Table-wide gauges, read on a short interval: backlog, oldest row, dead rows,
skipped rows and the subjects dead rows hold back; what holds the vacuum horizon
back, and the table's dead tuples and size."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

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

# How often the sweep looks for a live row before where the claims start (what the
# late-row triggers and the claims' guard cannot see: a row put back while the
# triggers were off between two claims): found within this, and published.
SWEEP_INTERVAL = 60.0


def sweep_now(horizon_seconds: float) -> bool:
    """Whether the sweep may run: its walk from the claim index's first entry pays
    for every dead entry a held horizon keeps (and may time out, every minute, under a
    long hold), so it waits while the horizon has been held for a sweep interval."""
    return horizon_seconds < SWEEP_INTERVAL


def next_backlog_read(started: float, took: float, interval: float) -> float:
    """When to read the backlog again, after a read that began at ``started`` and
    took ``took`` seconds."""
    return started + max(interval, took * BACKLOG_DUTY)


class _Horizon:
    """The horizon's gauges, and its warning once it has been held a while."""

    def __init__(self) -> None:
        self.clock = XidClock()
        self.warned = False
        self.seconds = 0.0  # how long the oldest holder has held it, at the last read

    async def read(self, config: Config, database: Database, metrics: Metrics) -> None:
        now = trio.current_time()
        health, holders = await database.horizon()
        self.clock.sample(now, health.next_xid)
        metrics.relays.set(health.relays)
        metrics.table_dead_tuples.set(health.dead_tuples)
        metrics.table_bytes.set(health.total_bytes)
        seconds = holder_seconds(holders[0], self.clock, health.next_xid, now) if holders else 0.0
        self.seconds = seconds
        metrics.horizon_age.set(seconds)
        metrics.horizon_xids.set(holders[0].xids if holders else 0)
        metrics.horizon_holder.clear()
        if holders:
            metrics.horizon_holder.labels(kind=holders[0].kind).set(1)
        if seconds > HORIZON_WARNING and not self.warned:
            log.warning(
                "the vacuum horizon is %s: %d dead tuples in %s so far, which no vacuum may "
                "remove until it lets go (`outbox-relay status`)",
                describe(holders[0], seconds),
                health.dead_tuples,
                config.table_display,
            )
            self.warned = True
        elif self.warned and seconds < HORIZON_WARNING:
            log.info("the vacuum horizon moves again")
            self.warned = False


async def _read_backlog(config: Config, database: Database, metrics: Metrics) -> None:
    backlog = await database.backlog(config.max_attempts)
    metrics.unpublished.set(backlog.unpublished)
    metrics.dead_rows.set(backlog.dead)
    metrics.skipped_rows.set(backlog.skipped)
    metrics.held_subjects.set(backlog.held_subjects)
    metrics.oldest_age.set(backlog.oldest_age_seconds)


async def _sweep(config: Config, database: Database) -> None:
    if await database.sweep():
        log.warning(
            "a live row of %s sits before where the claims start (a row put back by hand, "
            "or a clock stepped back): the next claim walks from the first entry",
            config.table_display,
        )
        database.claim_start.rewind()


async def run_gauges(config: Config, database: Database, metrics: Metrics) -> None:
    horizon = _Horizon()
    backlog_due = trio.current_time()
    sweep_due = trio.current_time() + SWEEP_INTERVAL
    while True:
        now = trio.current_time()
        await _attempt("read the table's health", horizon.read(config, database, metrics), metrics)
        if now >= backlog_due:
            started = trio.current_time()
            await _attempt("read the backlog", _read_backlog(config, database, metrics), metrics)
            took = trio.current_time() - started
            backlog_due = next_backlog_read(started, took, config.gauge_interval)
        if now >= sweep_due and sweep_now(horizon.seconds):
            sweep_due = now + SWEEP_INTERVAL
            await _attempt("sweep before the claims' start", _sweep(config, database), metrics)
        await trio.sleep(config.gauge_interval)


async def _attempt(what: str, work: Awaitable[None], metrics: Metrics) -> None:
    try:
        await work
    except RelayError as exc:
        metrics.database_errors.labels(task="gauges").inc()
        log.warning("could not %s: %s", what, exc)
