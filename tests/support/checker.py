"""The history checker: what the producers committed and what the table says,
against what the stream holds. Ground truth is the table and the producers' own
record; the stream is read back in full."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Committed:
    """An event a producer committed: its row id, subject and per-subject sequence."""

    id: str
    subject: str
    seq: int


@dataclass(frozen=True)
class Stored:
    """A message in the stream, in stream order."""

    id: str
    subject: str
    seq: int


@dataclass(frozen=True)
class RowState:
    published: bool
    attempts: int


@dataclass
class Verdict:
    committed: int = 0
    stored: int = 0
    lost: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    marked_but_missing: list[str] = field(default_factory=list)
    duplicates: int = 0
    order_inversions: list[tuple[str, int, int]] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    dead: int = 0

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.unexpected
            or self.marked_but_missing
            or self.order_inversions
            or self.stuck
        )

    def summary(self) -> str:
        return (
            f"committed {self.committed}, stored {self.stored}, lost {len(self.lost)}, "
            f"unexpected {len(self.unexpected)}, marked but missing "
            f"{len(self.marked_but_missing)}, duplicates {self.duplicates}, order "
            f"inversions {len(self.order_inversions)}, stuck {len(self.stuck)}, "
            f"dead {self.dead}"
        )


def check(
    committed: Iterable[Committed],
    table: Mapping[str, RowState],
    stream: Iterable[Stored],
    *,
    max_attempts: int,
) -> Verdict:
    committed = list(committed)
    stream = list(stream)
    verdict = Verdict(committed=len(committed), stored=len(stream))
    truth = {event.id for event in committed}
    copies = Counter(message.id for message in stream)
    in_stream = set(copies)
    dead = {
        row_id
        for row_id, row in table.items()
        if not row.published and row.attempts >= max_attempts
    }
    verdict.dead = len(dead & truth)
    # Lost: committed, not in the stream, and not a row the relay gave up on (a dead
    # row is reported, loudly, by the relay itself; it is not silently lost).
    verdict.lost = sorted(truth - in_stream - dead)
    # Unexpected: in the stream but never committed (a rolled-back write, say).
    verdict.unexpected = sorted(in_stream - truth)
    verdict.marked_but_missing = sorted(
        row_id for row_id, row in table.items() if row.published and row_id not in in_stream
    )
    verdict.duplicates = sum(count - 1 for count in copies.values())
    verdict.stuck = sorted(
        row_id for row_id, row in table.items() if not row.published and row.attempts < max_attempts
    )
    # Per-subject order in first-publication order: a message whose sequence number
    # is below one already published for its subject came out of order.
    highest: dict[str, int] = {}
    seen: set[str] = set()
    for message in stream:
        if message.id in seen:
            continue
        seen.add(message.id)
        top = highest.get(message.subject)
        if top is not None and message.seq < top:
            verdict.order_inversions.append((message.subject, top, message.seq))
        highest[message.subject] = max(top or message.seq, message.seq)
    return verdict
