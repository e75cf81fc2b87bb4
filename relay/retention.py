"""Retention: delete spent rows in batches, on a schedule, never unpublished ones;
on a table partitioned by created_at, drop expired partitions instead
(relay/partitions.py)."""

from __future__ import annotations

import logging

import trio

from relay.config import Config
from relay.database import Database
from relay.errors import RelayError
from relay.metrics import Metrics
from relay.partitions import retire_partitions

log = logging.getLogger(__name__)

FROM_THE_FIRST_ROW = "-infinity"
# From the rows that came of age in the last FULL_PASS_INTERVAL (the delete_spent
# query's null): where a pass starts when a walk from the first row failed and no
# earlier pass left a place.
FROM_RECENT_ROWS = None

# How often a pass walks the published_at index from its first entry instead of from
# where the last pass stopped, for the rows it skipped (another relay's retention
# held them) or that were marked with an earlier published_at after it passed.
FULL_PASS_INTERVAL = 600.0


class RetentionCursor:
    """Where the next retention statement starts: after the last row deleted, and
    from the first row once every FULL_PASS_INTERVAL. A full pass that fails (its
    walk from the first entry timed out while the horizon is held, say) goes back to
    where the passes had got to, and is tried again an interval later rather than
    every round. ``now`` is trio's clock."""

    def __init__(self, now: float) -> None:
        self.after: str | None = FROM_THE_FIRST_ROW
        self._full_pass_at = now
        self._before_full_pass: str | None = FROM_RECENT_ROWS

    def start_pass(self, now: float) -> None:
        if now >= self._full_pass_at:
            if self.after != FROM_THE_FIRST_ROW:
                self._before_full_pass = self.after
            self.after = FROM_THE_FIRST_ROW
            self._full_pass_at = now + FULL_PASS_INTERVAL

    def deleted_up_to(self, published_at: str | None) -> None:
        if published_at is not None:
            self.after = published_at

    def failed(self) -> None:
        """A statement failed: a full pass that had not moved yet gives way to the
        passes from where they had got to (from the recent rows, at start)."""
        if self.after == FROM_THE_FIRST_ROW:
            self.after = self._before_full_pass


async def run_retention(config: Config, database: Database, metrics: Metrics) -> None:
    cursor = RetentionCursor(trio.current_time())
    while True:
        try:
            layout = await database.partition_layout()
            if layout.managed:
                # Until the LISTEN self-check tells whether a transaction pooler stands
                # between, connections carry no lock_timeout: a detach would wait for as
                # long as an idle writer stays open. The check takes a round trip or two.
                if database.pooled is not None:
                    await retire_partitions(config, database, metrics, layout)
            else:
                await _delete_spent(config, database, metrics, cursor)
            if purged := await database.purge_late_keys():
                metrics.late_keys_purged.inc(purged)
                log.warning(
                    "retention removed %d late rows' keys whose rows were gone (a TRUNCATE "
                    "or a partition dropped by hand); claims started from them until now",
                    purged,
                )
        except RelayError as exc:
            cursor.failed()
            metrics.database_errors.labels(task="retention").inc()
            log.warning("retention failed, will retry next round: %s", exc)
        await trio.sleep(config.retention_interval)


async def _delete_spent(
    config: Config, database: Database, metrics: Metrics, cursor: RetentionCursor
) -> None:
    deleted = 0
    cursor.start_pass(trio.current_time())
    try:
        while True:
            batch = await database.delete_spent(
                config.retention, config.retention_batch_size, cursor.after, FULL_PASS_INTERVAL
            )
            cursor.deleted_up_to(batch.last_published_at)
            deleted += batch.count
            metrics.retention_deleted.inc(batch.count)
            if batch.count < config.retention_batch_size:
                break
            # Let the scheduler have the database between batches.
            await trio.sleep(0.01)
    finally:
        if deleted:
            log.info("retention deleted %d spent rows", deleted)
