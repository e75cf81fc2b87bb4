"""Where a message is built: from a claimed row to the CloudEvents 1.0 message it
is published as, or the reason inside the row that it never can be
(:func:`message_for`, the one door; the rest are its parts)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import NamedTuple

from relay.headers import TraceContext, row_headers
from relay.model import FailureReason, OutboxRow, Rejection
from relay.publishable import UNWRITABLE_TIME, size_problem, subject_problem

MSG_ID_HEADER = "Nats-Msg-Id"

# ``encode_basestring`` is the C routine json.dumps(ensure_ascii=False) uses for a
# string: a quoted, escaped JSON string. The envelope is assembled from it directly,
# which costs a quarter of building a dict and encoding it (this runs once per row).
_quote = encode_basestring


class Message(NamedTuple):
    """One message to publish (a named tuple: one is built per row)."""

    subject: str
    body: bytes
    headers: dict[str, str]

    @property
    def wire_size(self) -> int:
        """Bytes the server counts against max_payload: headers block plus body, in
        UTF-8 (a header value may be any text but control characters)."""
        # NATS/1.0\r\n, one "Key: Value\r\n" per header, then a blank line. A loop, not
        # sum() over a generator: this runs once per row.
        size = 12 + len(self.body)
        for key, value in self.headers.items():
            size += len(key) + 4 + (len(value) if value.isascii() else len(value.encode()))
        return size


@dataclass(frozen=True, slots=True)
class MessageSettings:
    """What a message depends on besides its row: the server's max_payload, the
    content mode, and the data's check against its schema (event type, data as
    jsonb's text) -> why it is invalid, or None (relay/schemas.py)."""

    max_payload: int
    binary: bool = False
    data_problem: Callable[[str, str], str | None] | None = None


def message_for(
    row: OutboxRow,
    settings: MessageSettings,
    trace: TraceContext | None = None,
    hop: TraceContext | None = None,
) -> Message | Rejection:
    """The message ``row`` is published as, or why it never can be: a time RFC 3339
    cannot write, headers NATS cannot carry or that would make the server act, a
    subject that is not a publish subject, more UTF-8 bytes than max_payload
    (headers included), data that fails its schema.

    ``trace`` is the row's trace context as :func:`relay.headers.trace_context` read
    it (None when it has none valid: the message goes without); ``hop``, the relay's
    own span's context, which the ``traceparent`` header then carries."""
    if row.time is None:
        return UNWRITABLE_TIME
    extra, problem = row_headers(row.headers)
    if problem is not None:
        return Rejection(FailureReason.INVALID_HEADERS, problem)
    problem = subject_problem(row.event_type)
    if problem is not None:
        return Rejection(FailureReason.INVALID_SUBJECT, f"{problem}: {row.event_type[:200]!r}")
    message = build_message(row, row.time, trace, extra, hop, binary=settings.binary)
    problem = size_problem(message.wire_size, settings.max_payload)
    if problem is not None:
        return Rejection(FailureReason.TOO_LARGE, problem)
    if settings.data_problem is not None:
        problem = settings.data_problem(row.event_type, row.data)
        if problem is not None:
            return Rejection(FailureReason.INVALID_DATA, problem)
    return message


def build_message(
    row: OutboxRow,
    time: str,
    trace: TraceContext | None = None,
    extra_headers: Mapping[str, str] | None = None,
    hop: TraceContext | None = None,
    *,
    binary: bool = False,
) -> Message:
    """The envelope for ``row`` (whose RFC 3339 ``time`` the caller checked): the
    row's id is the envelope id and the dedupe key (``Nats-Msg-Id``), so a republish
    inside the stream's duplicate window is dropped by the broker and anywhere else
    by the consumer.

    ``trace``, the producer's trace context (checked: relay/headers.py), goes in the
    CloudEvents distributed-tracing extension, and in the ``traceparent`` and
    ``tracestate`` headers unless the relay's own span (``hop``) takes them, as the
    extension's rule for each hop has it; ``extra_headers``, the row's own (guarded),
    go in headers. ``binary``: the CloudEvents binary content mode
    (:func:`_binary_message`) instead of the structured JSON envelope."""
    headers = _headers(row.id, extra_headers, hop or trace)
    if binary:
        return _binary_message(row, time, trace, headers)
    row_id = row.id
    extension = ""
    if trace is not None:
        extension = ',"traceparent":' + _quote(trace.traceparent)
        if trace.tracestate:
            extension += ',"tracestate":' + _quote(trace.tracestate)
    # ``data`` arrives as jsonb's own text rendering, which is valid JSON: splice it in
    # rather than parse and re-serialise every payload.
    body = (
        '{"specversion":"1.0","id":"'
        + row_id
        + '","type":'
        + _quote(row.event_type)
        + ',"source":'
        + _quote(row.source)
        + ',"subject":'
        + _quote(row.subject)
        + ',"time":"'
        + time
        + '","datacontenttype":"application/json"'
        + extension
        + ',"data":'
        + row.data
        + "}"
    )
    return Message(row.event_type, body.encode(), headers)


def _headers(
    row_id: str, extra_headers: Mapping[str, str] | None, carried: TraceContext | None
) -> dict[str, str]:
    """The headers both content modes send: the dedupe key, the row's own, and the
    trace context this hop carries."""
    headers = {MSG_ID_HEADER: row_id}
    if extra_headers:
        headers.update(extra_headers)
    if carried is not None:
        headers["traceparent"] = carried.traceparent
        if carried.tracestate:
            headers["tracestate"] = carried.tracestate
    return headers


# CloudEvents HTTP binding 3.1.3.2, which the NATS binding's binary mode follows: a
# header value percent-encodes space, '"', '%' and everything outside printable ASCII
# (as UTF-8 bytes).
_HEADER_SAFE = frozenset(range(0x21, 0x7F)) - {0x22, 0x25}


def percent_encode(value: str) -> str:
    if value.isascii() and value.isprintable() and not any(c in value for c in ' "%'):
        return value
    return "".join(chr(byte) if byte in _HEADER_SAFE else f"%{byte:02X}" for byte in value.encode())


def _binary_message(
    row: OutboxRow, time: str, trace: TraceContext | None, headers: dict[str, str]
) -> Message:
    """The event in the CloudEvents binary content mode (``--envelope binary``): the
    body is the data alone, each attribute a ``ce-`` header beside ``headers`` (the
    ones both modes send), ``content-type`` the data's. The producer's trace context
    is the ``ce-traceparent`` and ``ce-tracestate`` extension attributes; the
    ``traceparent`` header is this hop's, as in :func:`build_message`."""
    headers.update(
        {
            "ce-specversion": "1.0",
            "ce-id": row.id,
            "ce-type": percent_encode(row.event_type),
            "ce-source": percent_encode(row.source),
            "ce-subject": percent_encode(row.subject),
            "ce-time": time,
            "content-type": "application/json",
        }
    )
    if trace is not None:
        headers["ce-traceparent"] = percent_encode(trace.traceparent)
        if trace.tracestate:
            headers["ce-tracestate"] = percent_encode(trace.tracestate)
    return Message(row.event_type, row.data.encode(), headers)
