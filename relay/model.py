"""The values that flow through the relay: a claimed row and what became of it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

RowId = str
"""A row's id as the claim query returns it: the uuid's text, 36 lowercase characters.
Text, not :class:`uuid.UUID`: the envelope and the marks want text, and a UUID object
per row cost a parse, a hash per lookup and a dump per mark. Two ids compare as text
exactly as Postgres compares the uuids (byte by byte), since the canonical text is
fixed-width lowercase hex."""


class OutboxRow(NamedTuple):
    """One claimed ``outbox_events`` row, as the claim query renders it: ``data`` is
    the jsonb payload as JSON text, ``time`` the RFC 3339 text of the envelope's time
    in UTC (None when RFC 3339 cannot express it), ``created_at`` epoch seconds,
    ``seq`` the row's ``relay_seq`` (its place among the inserts).

    A named tuple, not a frozen dataclass: one is built per claimed row, and a
    frozen dataclass costs three times as much to build (4.7 vs 1.5 us here)."""

    id: RowId
    event_type: str
    source: str
    subject: str
    time: str | None
    data: str
    created_at: float
    seq: int
    attempts: int

    @property
    def order_key(self) -> tuple[float, int, RowId]:
        """Rows are published in this order, the claim index's. ``seq`` breaks
        ``created_at`` ties, which every row inserted by one transaction shares
        (``now()`` is the transaction's start), in the order they were inserted; ``id``
        only makes the order total (``seq`` comes from a sequence and never repeats)."""
        return (self.created_at, self.seq, self.id)


class FailureReason(enum.StrEnum):
    """Why a publish failed; also the ``reason`` label of the failure metric."""

    TIMEOUT = "timeout"
    NO_STREAM = "no_stream"
    TOO_LARGE = "too_large"
    INVALID_SUBJECT = "invalid_subject"
    INVALID_TIME = "invalid_time"
    DISCONNECTED = "disconnected"
    OTHER = "other"

    @property
    def permanent(self) -> bool:
        """A permanent failure cannot succeed on retry: the row goes to the cap at once
        instead of burning attempts and holding up its subject."""
        return self in _PERMANENT


_PERMANENT = frozenset(
    {
        FailureReason.NO_STREAM,
        FailureReason.TOO_LARGE,
        FailureReason.INVALID_SUBJECT,
        FailureReason.INVALID_TIME,
    }
)


@dataclass(frozen=True, slots=True)
class Acked:
    """The broker stored the message (``duplicate`` if it already had it)."""

    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    reason: FailureReason
    detail: str


PublishResult = Acked | Failed
