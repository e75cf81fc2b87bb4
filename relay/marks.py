"""What to write back for a batch, decided from what the broker said."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from relay.backoff import row_retry_delay
from relay.model import Acked, Failed, FailureReason, OutboxRow, PublishResult, RowId

# Failures that say nothing about the row: the broker did not answer in time, or
# the connection went away. On their own in a batch they are the broker's outage.
BROKER_SIDE = frozenset({FailureReason.TIMEOUT, FailureReason.DISCONNECTED})


def broker_outage(results: Mapping[RowId, PublishResult]) -> bool:
    """Whether the broker, not the rows, failed this batch: it acknowledged none of
    the messages sent, and every one that failed failed in a way no row can cause.
    Rows rejected before sending (a bad subject, too large) do not count either way.

    A broker that stalls or drops the path fails every publish in flight, batch after
    batch, until the client notices; counting those toward the cap would kill good
    rows for the broker's fault."""
    sent_failures = 0
    for result in results.values():
        if isinstance(result, Acked):
            return False
        if result.reason in BROKER_SIDE:
            sent_failures += 1
        elif not result.reason.permanent:
            return False  # refused by the stream: about this message
    return sent_failures > 0


@dataclass(frozen=True, slots=True)
class FailureMark:
    id: RowId
    attempts: int
    retry_delay: float | None  # None: the row is at the cap and is left alone
    error: str


@dataclass
class Marks:
    published: list[RowId] = field(default_factory=list)
    failed: list[FailureMark] = field(default_factory=list)
    newly_dead: list[tuple[OutboxRow, Failed]] = field(default_factory=list)
    # The broker failed the batch (broker_outage): its rows that failed were spared.
    broker_outage: bool = False


def decide_marks(
    rows: Mapping[RowId, OutboxRow],
    results: Mapping[RowId, PublishResult],
    *,
    max_attempts: int,
    backoff_base: float,
    backoff_max: float,
) -> Marks:
    """Acked rows are published; a failed row gets one more attempt and a retry delay,
    or goes straight to the cap when the failure is permanent or this was its last
    attempt. Rows without a result were never sent and are left as they are, and so
    are rows that failed only because the broker did (see :func:`broker_outage`)."""
    marks = Marks(broker_outage=broker_outage(results))
    for row_id, result in results.items():
        if isinstance(result, Acked):
            marks.published.append(row_id)
            continue
        if marks.broker_outage and result.reason in BROKER_SIDE:
            continue
        row = rows[row_id]
        attempts = max_attempts if result.reason.permanent else min(row.attempts + 1, max_attempts)
        error = f"{result.reason.value}: {result.detail}"[:1000]
        if attempts >= max_attempts:
            marks.failed.append(FailureMark(row_id, attempts, None, error))
            marks.newly_dead.append((row, result))
        else:
            delay = row_retry_delay(attempts, backoff_base, backoff_max)
            marks.failed.append(FailureMark(row_id, attempts, delay, error))
    return marks
