"""Table-wide gauges, read on a short interval: backlog, oldest row, dead rows,
skipped rows and the subjects dead rows hold back."""

from __future__ import annotations

import logging

import trio

from relay.config import Config
from relay.database import Database
from relay.errors import RelayError
from relay.metrics import Metrics

log = logging.getLogger(__name__)


async def run_gauges(config: Config, database: Database, metrics: Metrics) -> None:
    while True:
        try:
            backlog = await database.backlog(config.max_attempts)
        except RelayError as exc:
            metrics.database_errors.labels(task="gauges").inc()
            log.debug("could not read the backlog: %s", exc)
        else:
            metrics.unpublished.set(backlog.unpublished)
            metrics.dead_rows.set(backlog.dead)
            metrics.skipped_rows.set(backlog.skipped)
            metrics.held_subjects.set(backlog.held_subjects)
            metrics.oldest_age.set(backlog.oldest_age_seconds)
        await trio.sleep(config.gauge_interval)
