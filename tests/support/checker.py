"""The history checker: what the producers committed and what the table says,
against what the stream holds. Ground truth is the table and the producers' own
record; the stream is read back in full."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Committed:
    """An event a producer committed: its row id, subject and per-subject sequence."""

    id: str
    subject: str
    seq: int


@dataclass(frozen=True)
class Stored:
    """A message in the stream, in stream order: ``id`` its Nats-Msg-Id, ``subject``
    and ``seq`` from its body, ``envelope_id`` its envelope's id (None: not read)."""

    id: str
    subject: str
    seq: int
    envelope_id: str | None = None


@dataclass(frozen=True)
class RowState:
    published: bool
    attempts: int
    dead: bool = False  # the relay gave up on it (relay_dead_at)
    skipped: bool = False  # an operator gave up on it (relay_skipped_at)


@dataclass
class Verdict:
    """What the history shows. Every list names row ids. A good row (any row that is
    not poison) must end in the stream; a poison row must end dead (or skipped, once
    dead, by the operator) and never in the stream. A dead good row is a failure like
    any other: the relay gave up on an event it could have published."""

    committed: int = 0
    stored: int = 0
    lost: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    marked_but_missing: list[str] = field(default_factory=list)
    duplicates: int = 0
    order_inversions: list[tuple[str, int, int]] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    poison: int = 0
    poison_dead: int = 0
    poison_published: list[str] = field(default_factory=list)
    # Messages whose envelope id is not their Nats-Msg-Id, or whose body is not the
    # committed row's (a header or body mix-up between rows).
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.unexpected
            or self.marked_but_missing
            or self.order_inversions
            or self.stuck
            or self.dead
            or self.poison_published
            or self.mismatched
        )

    def summary(self) -> str:
        return (
            f"committed {self.committed}, stored {self.stored}, lost {len(self.lost)}, "
            f"unexpected {len(self.unexpected)}, marked but missing "
            f"{len(self.marked_but_missing)}, duplicates {self.duplicates}, order "
            f"inversions {len(self.order_inversions)}, stuck {len(self.stuck)}, "
            f"good rows dead {len(self.dead)}, poison {self.poison} "
            f"(dead {self.poison_dead}, published {len(self.poison_published)}), "
            f"mismatched {len(self.mismatched)}"
        )

    def details(self) -> str:
        """The first few ids of each failure, for an assertion message."""
        return (
            f"lost {self.lost[:5]} unexpected {self.unexpected[:5]} marked but missing "
            f"{self.marked_but_missing[:5]} inversions {self.order_inversions[:5]} "
            f"stuck {self.stuck[:5]} dead {self.dead[:5]} "
            f"poison published {self.poison_published[:5]} mismatched {self.mismatched[:5]}"
        )


def check(
    committed: Iterable[Committed],
    table: Mapping[str, RowState],
    stream: Iterable[Stored],
    *,
    max_attempts: int,
    poison: Set[str] = frozenset(),
) -> Verdict:
    """``poison``: ids of the rows written to be unpublishable (a superset is fine:
    only the committed ones count)."""
    committed = list(committed)
    stream = list(stream)
    verdict = Verdict(committed=len(committed), stored=len(stream))
    truth = {event.id for event in committed}
    bad = truth & poison
    good = truth - bad
    copies = Counter(message.id for message in stream)
    in_stream = set(copies)
    at_cap = {
        row_id
        for row_id, row in table.items()
        if not row.published and (row.dead or row.attempts >= max_attempts)
    }
    given_up = at_cap | {row_id for row_id, row in table.items() if row.skipped}
    # Lost: a good event the stream does not have, whatever the table says (dead,
    # stuck, marked, or gone).
    verdict.lost = sorted(good - in_stream)
    verdict.dead = sorted(good & at_cap)
    verdict.poison = len(bad)
    verdict.poison_dead = len(bad & given_up)
    verdict.poison_published = sorted(bad & in_stream)
    # Unexpected: in the stream but never committed (a rolled-back write, say).
    verdict.unexpected = sorted(in_stream - truth)
    verdict.marked_but_missing = sorted(
        row_id for row_id, row in table.items() if row.published and row_id not in in_stream
    )
    verdict.duplicates = sum(count - 1 for count in copies.values())
    by_id = {event.id: event for event in committed}
    verdict.mismatched = sorted({
        message.id
        for message in stream
        if (message.envelope_id is not None and message.envelope_id != message.id)
        or (
            message.id in by_id
            and (by_id[message.id].subject, by_id[message.id].seq)
            != (message.subject, message.seq)
        )
    })  # fmt: skip
    # Stuck: left unpublished and not given up on (a poison row too: it must go dead).
    verdict.stuck = sorted(
        row_id for row_id, row in table.items() if not row.published and row_id not in given_up
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
