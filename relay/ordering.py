"""Per-subject order: which claimed rows may go, and in which waves.

Two rows with the same ``subject`` are published in ``order_key`` order. Rows
of different subjects are unordered, so they are sent pipelined together; the
rows of one subject go one per wave, and a wave is sent only after the
previous wave's acks are in, so a later row of a subject never reaches the
broker before an earlier one has been acknowledged.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence, Set

from relay.model import Acked, OutboxRow, PublishResult, RowId

OrderKey = tuple[float, int, RowId]  # (created_at in epoch seconds, relay_seq, id)


def earliest_blockers(
    found: Iterable[tuple[str, OrderKey]], ours: Set[RowId] = frozenset()
) -> dict[str, OrderKey]:
    """The earliest blocker of each subject, from the claim's (subject, order key)
    blocker rows, leaving out the rows of this relay's own batches in flight
    (``ours``): those are waited on, not held behind (see :func:`unsettled_subjects`)."""
    earliest: dict[str, OrderKey] = {}
    for subject, key in found:
        if key[2] in ours:
            continue
        if subject not in earliest or key < earliest[subject]:
            earliest[subject] = key
    return earliest


def held_behind_blockers(rows: Iterable[OutboxRow], blockers: Mapping[str, OrderKey]) -> set[RowId]:
    """Ids of claimed rows that must wait because an earlier unpublished row of their
    subject is not in this batch (another relay holds it, or it committed late).

    ``blockers`` maps a subject to the order key of its earliest such row."""
    held: set[RowId] = set()
    for row in rows:
        first_outside = blockers.get(row.subject)
        if first_outside is not None and row.order_key > first_outside:
            held.add(row.id)
    return held


class SubjectQueues:
    """The publishable rows of a batch, queued per subject in order.

    ``next_wave`` takes the head of every live queue; ``stop`` ends a subject for
    this batch after its head failed, leaving its later rows untouched."""

    def __init__(self, rows: Sequence[OutboxRow]) -> None:
        self._queues: OrderedDict[str, deque[OutboxRow]] = OrderedDict()
        for row in sorted(rows, key=lambda r: r.order_key):
            self._queues.setdefault(row.subject, deque()).append(row)

    def next_wave(self) -> list[OutboxRow]:
        wave = [queue.popleft() for queue in self._queues.values()]
        for subject in [s for s, queue in self._queues.items() if not queue]:
            del self._queues[subject]
        return wave

    def stop(self, subject: str) -> list[OutboxRow]:
        """Drop ``subject``'s remaining rows from this batch and return them."""
        return list(self._queues.pop(subject, ()))

    def __bool__(self) -> bool:
        return bool(self._queues)


def unsettled_subjects(
    rows: Iterable[OutboxRow], results: Mapping[RowId, PublishResult]
) -> frozenset[str]:
    """Subjects a later batch must not publish yet: one of their ``rows`` was not
    sent (held, or out of time) or failed. A row that failed waits, or is dead, and
    either way holds its subject back."""
    unsettled: set[str] = set()
    for row in rows:
        if not isinstance(results.get(row.id), Acked):
            unsettled.add(row.subject)
    return frozenset(unsettled)
