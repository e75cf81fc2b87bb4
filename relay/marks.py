"""What to write back for a batch, decided from what the broker said."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from relay.backoff import row_retry_delay
from relay.model import Acked, Failed, FailureReason, OutboxRow, PublishResult, RowId

# Failures that say the broker is up: it answered about this subject.
_ANSWERED = frozenset({FailureReason.NO_STREAM, FailureReason.PERMISSION_DENIED})


def broker_outage(results: Mapping[RowId, PublishResult]) -> bool:
    """Whether the broker, not the rows, failed this batch: it acknowledged none of
    the messages sent, and every one that failed failed for the broker's reason
    (:attr:`FailureReason.broker_fault`). Rows rejected before sending (a bad
    subject, too large) do not count either way, and a subject no stream captures
    says the broker is up (JetStream answered the question): its rows wait on their
    own, and the rest of the table goes on. So does a subject the relay's NATS user
    may not publish on: the server answered, and said so.

    The scheduler then stops claiming and probes, with a pause that grows, instead
    of marking every row of every batch."""
    sent_failures = 0
    for result in results.values():
        if isinstance(result, Acked) or result.reason in _ANSWERED:
            return False
        if result.reason.broker_fault:
            sent_failures += 1
        elif not result.reason.permanent:
            return False  # refused by the stream: about this message
    return sent_failures > 0


# The longest a row that failed for the broker's reason waits before it is tried
# again, whatever its age: once the broker is back, its rows follow within this.
BROKER_FAULT_RETRY_MAX = 30.0


def broker_fault_delay(age: float, base: float, cap: float) -> float:
    """Seconds before a row that failed for the broker's reason (while other rows of
    its batch went through: one stream down, a subject no stream captures yet) is
    tried again: a tenth of the row's age, at least ``base``, at most ``cap`` and
    BROKER_FAULT_RETRY_MAX. Its attempts are not counted, so the delay grows with
    how long it has waited instead."""
    return max(min(age / 10.0, cap, BROKER_FAULT_RETRY_MAX), min(base, cap))


@dataclass(frozen=True, slots=True)
class FailureMark:
    id: RowId
    attempts: int
    retry_delay: float | None  # None: the row is dead, and holds its subject
    error: str


@dataclass
class Marks:
    published: list[RowId] = field(default_factory=list)
    failed: list[FailureMark] = field(default_factory=list)
    newly_dead: list[tuple[OutboxRow, Failed]] = field(default_factory=list)
    # Rows that failed for the broker's reason, marked to wait with their attempts
    # untouched (not in an outage: then they are not marked at all).
    broker_faults: list[tuple[OutboxRow, Failed]] = field(default_factory=list)
    # The broker failed the batch (broker_outage): its rows that failed were spared.
    broker_outage: bool = False


def decide_marks(
    rows: Mapping[RowId, OutboxRow],
    results: Mapping[RowId, PublishResult],
    *,
    now: float,
    max_attempts: int,
    backoff_base: float,
    backoff_max: float,
) -> Marks:
    """Acked rows are published. A row that cannot be published as it is goes dead
    at once; a row the stream refused gets one more attempt and a retry delay, or
    goes dead on its last attempt. A row that failed for the broker's reason, or for
    the relay's own (unexpected) error, keeps its attempts: it waits
    (:func:`broker_fault_delay`), or, when the whole batch was the broker's outage,
    is left exactly as it was. Rows without a result were
    never sent and are left as they are. ``now`` is epoch seconds."""
    marks = Marks(broker_outage=broker_outage(results))
    for row_id, result in results.items():
        if isinstance(result, Acked):
            marks.published.append(row_id)
            continue
        row = rows[row_id]
        error = f"{result.reason.value}: {result.detail}"[:1000]
        if result.reason.broker_fault or result.reason.relay_fault:
            if not marks.broker_outage:
                delay = broker_fault_delay(now - row.created_at, backoff_base, backoff_max)
                marks.failed.append(FailureMark(row_id, row.attempts, delay, error))
                if result.reason.broker_fault:
                    marks.broker_faults.append((row, result))
            continue
        attempts = max_attempts if result.reason.permanent else min(row.attempts + 1, max_attempts)
        if attempts >= max_attempts:
            marks.failed.append(FailureMark(row_id, attempts, None, error))
            marks.newly_dead.append((row, result))
        else:
            delay = row_retry_delay(attempts, backoff_base, backoff_max)
            marks.failed.append(FailureMark(row_id, attempts, delay, error))
    return marks
