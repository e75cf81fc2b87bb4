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
    frozen dataclass costs three times as much to build."""

    id: RowId
    event_type: str
    source: str
    subject: str
    time: str | None
    data: str
    created_at: float
    seq: int
    attempts: int
    # Optional columns a producer may write (relay/headers.py): its W3C trace
    # context, and headers of its own as a JSON object's text.
    traceparent: str | None = None
    tracestate: str | None = None
    headers: str | None = None

    @property
    def order_key(self) -> tuple[float, int, RowId]:
        """Rows are published in this order, the claim index's. ``seq`` breaks
        ``created_at`` ties, which every row inserted by one transaction shares
        (``now()`` is the transaction's start), in the order they were inserted; ``id``
        only makes the order total (``seq`` comes from a sequence and never repeats)."""
        return (self.created_at, self.seq, self.id)


class FailureReason(enum.StrEnum):
    """Why a publish failed; also the ``reason`` label of the failure metric.

    Each reason is the fault of one party. The row's (``permanent``): it can never
    be published as it is, and it goes dead at once. The broker's (``broker_fault``:
    NATS, JetStream or the stream's configuration): the row is retried later with
    its attempts untouched, however long that takes. The relay's (``relay_fault``:
    something it did not expect, a bug of its own or of its client library, logged
    with its traceback): the same, attempts untouched. ``refused`` is the rest: the
    stream turned this message down for a reason it gave; it counts as one attempt,
    up to the cap."""

    TIMEOUT = "timeout"
    DISCONNECTED = "disconnected"
    NO_STREAM = "no_stream"  # JetStream confirms that no stream captures the subject
    NO_RESPONDERS = "no_responders"  # a stream captures it but none answered (no leader)
    STREAM_UNAVAILABLE = "stream_unavailable"  # refused for the stream's state: full, offline
    PERMISSION_DENIED = "permission_denied"  # the relay's NATS user may not publish there
    TOO_LARGE = "too_large"
    INVALID_SUBJECT = "invalid_subject"
    INVALID_TIME = "invalid_time"
    INVALID_DATA = "invalid_data"  # the data fails its event type's schema (--schemas)
    INVALID_HEADERS = "invalid_headers"  # a reserved header, or one NATS cannot carry
    REFUSED = "refused"
    RELAY_ERROR = "relay_error"  # unexpected: the relay's, or its client library's

    @property
    def permanent(self) -> bool:
        """The row cannot be published as it is: it goes dead at once instead of
        burning attempts."""
        return self in _PERMANENT

    @property
    def broker_fault(self) -> bool:
        """The broker failed, not the row: the row never moves toward the cap for it."""
        return self in _BROKER_FAULTS

    @property
    def relay_fault(self) -> bool:
        """Something the relay did not expect: not the row's either."""
        return self is FailureReason.RELAY_ERROR


_PERMANENT = frozenset(
    {
        FailureReason.TOO_LARGE,
        FailureReason.INVALID_SUBJECT,
        FailureReason.INVALID_TIME,
        FailureReason.INVALID_DATA,
        FailureReason.INVALID_HEADERS,
    }
)
_BROKER_FAULTS = frozenset(
    {
        FailureReason.TIMEOUT,
        FailureReason.DISCONNECTED,
        FailureReason.NO_STREAM,
        FailureReason.NO_RESPONDERS,
        FailureReason.STREAM_UNAVAILABLE,
        FailureReason.PERMISSION_DENIED,
    }
)


class Rejection(NamedTuple):
    """Why a row can never be published as it is (a reason inside the row): it goes
    dead with ``detail`` as its ``relay_last_error``."""

    reason: FailureReason
    detail: str


@dataclass(frozen=True, slots=True)
class Acked:
    """The broker stored the message (``duplicate`` if it already had it)."""

    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    reason: FailureReason
    detail: str


PublishResult = Acked | Failed
