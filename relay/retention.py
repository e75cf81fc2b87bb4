"""Retention: delete spent rows in batches, on a schedule, never unpublished ones."""

from __future__ import annotations

import logging

import trio

from relay.config import Config
from relay.database import Database
from relay.errors import RelayError
from relay.metrics import Metrics

log = logging.getLogger(__name__)


async def run_retention(config: Config, database: Database, metrics: Metrics) -> None:
    while True:
        deleted = 0
        try:
            while True:
                count = await database.delete_spent(config.retention, config.retention_batch_size)
                deleted += count
                metrics.retention_deleted.inc(count)
                if count < config.retention_batch_size:
                    break
                # Let the scheduler have the database between batches.
                await trio.sleep(0.01)
        except RelayError as exc:
            metrics.database_errors.labels(task="retention").inc()
            log.warning("retention failed, will retry next round: %s", exc)
        if deleted:
            log.info("retention deleted %d spent rows", deleted)
        await trio.sleep(config.retention_interval)
