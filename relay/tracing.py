"""OpenTelemetry spans, optional: on when the standard `OTEL_*` variables name an
exporter endpoint and the `otel` extra is installed (`pip install
'outbox-relay[otel]'`); off otherwise, at the cost of one attribute check a batch.

One span per publish of a batch (its rows of one claim that go out together),
after the OpenTelemetry messaging conventions for a batch send: kind PRODUCER,
`messaging.system = nats`, the destination when the batch has one subject, the
batch's size, and a link to each row's producer context. Each message's
`traceparent` header then names this span; the producer's context stays in the
CloudEvents extension (relay/envelope.py). A batch with failed rows records them on
the span.

Links are most of a span's cost (the SDK's objects, then its encoder: measured in
docs/performance.md), so a span links only producer contexts that were sampled (an
unsampled one names a trace nobody recorded), at most LINKS_PER_SPAN unless
`OTEL_SPAN_LINK_COUNT_LIMIT` says otherwise (the SDK's own default, 128, costs a
drain several percent), and none when the span itself is not sampled.

With ``--trace-rows``, each published row whose producer sampled its trace also gets
a span of its own in that trace: a child of the producer's span, from the row's
``created_at`` to the batch's acks ("time in the outbox", as Debezium's commit span),
linked to the publish span. It costs a span a row, so it is off by default.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from relay.errors import ConfigError
from relay.headers import TraceContext

log = logging.getLogger(__name__)

# The SDK's variables that ask for traces to be exported (the exporter reads them).
_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# Links a publish span makes when OTEL_SPAN_LINK_COUNT_LIMIT is not set: a batch
# holds more rows only while a backlog drains (docs/events.md).
LINKS_PER_SPAN = 32
_LINK_LIMIT = "OTEL_SPAN_LINK_COUNT_LIMIT"


class PublishedRow(NamedTuple):
    """A row the broker acked, with its producer's context: for its own span."""

    id: str
    event_type: str
    created_at: float  # epoch seconds
    producer: TraceContext


class PublishSpan(Protocol):
    """The span of one batch publish, as the batch uses it."""

    @property
    def context(self) -> TraceContext | None:
        """The context each message's headers carry (None: the producer's)."""
        ...

    def end(self, failed: Mapping[str, int], published: Sequence[PublishedRow] = ()) -> None:
        """End the span; ``failed`` counts the rows that failed, by reason;
        ``published``: the acked rows that get a span of their own (``row_spans``)."""
        ...


class Tracing(Protocol):
    enabled: bool
    row_spans: bool  # --trace-rows: the batch passes its published rows to end()

    def publish_span(
        self, subjects: Sequence[str], producers: Sequence[TraceContext]
    ) -> PublishSpan:
        """The span of publishing messages to ``subjects`` (one a message), linked
        to the ``producers``' contexts (the rows' that have one)."""
        ...

    def shutdown(self) -> None: ...


class _NoSpan:
    context = None

    def end(self, failed: Mapping[str, int], published: Sequence[PublishedRow] = ()) -> None:
        return None


class NoTracing:
    enabled = False
    row_spans = False

    def publish_span(
        self, subjects: Sequence[str], producers: Sequence[TraceContext]
    ) -> PublishSpan:
        return _NoSpan()

    def shutdown(self) -> None:
        return None


def tracing_requested(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for exported traces (and does not turn them off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(environ.get(name) for name in _ENDPOINTS)


def sampled(context: TraceContext) -> bool:
    """Whether the producer sampled its trace: the trace-flags' lowest bit, which
    every version of traceparent keeps at characters 53-54."""
    return context.traceparent[54] in "13579bdf"


def links_to_make(
    producers: Sequence[TraceContext], limit: int | None
) -> tuple[list[TraceContext], int]:
    """The producer contexts a span links to, in row order: the sampled ones, at
    most ``limit`` of them (None: no limit); and how many sampled ones that left out."""
    wanted = [context for context in producers if sampled(context)]
    if limit is None or len(wanted) <= limit:
        return wanted, 0
    return wanted[:limit], len(wanted) - limit


# W3C Trace Context list members (section 3.3.1): the SDK's TraceState parser logs a
# warning for each member that is not one, which would be a line per row.
_TRACESTATE_MEMBER = re.compile(
    r"([a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=([\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e])"
)
_TRACESTATE_MEMBERS = 32


@functools.lru_cache(maxsize=1024)  # rows of a producer share their tracestate
def tracestate_pairs(header: str) -> tuple[tuple[str, str], ...] | None:
    """The members of a tracestate header, or None when any is not a W3C list
    member, a key repeats, or there are more than 32 (the whole header is dropped)."""
    pairs: dict[str, str] = {}
    for listed in header.split(","):
        member = listed.strip(" \t")
        if not member:
            continue
        match = _TRACESTATE_MEMBER.fullmatch(member)
        if match is None or match[1] in pairs:
            return None
        pairs[match[1]] = match[2]
    return tuple(pairs.items()) if len(pairs) <= _TRACESTATE_MEMBERS else None


def link_limit(environ: Mapping[str, str]) -> int | None:
    """Links a publish span makes: OTEL_SPAN_LINK_COUNT_LIMIT as the SDK reads it
    ("unset": no limit, None), else LINKS_PER_SPAN."""
    value = environ.get(_LINK_LIMIT)
    if value is None:
        return LINKS_PER_SPAN
    value = value.strip().lower()
    if value == "unset":
        return None
    if not value.isdigit():
        raise ConfigError(_LINK_LIMIT, f"a non-negative integer or 'unset', not {value!r}")
    return int(value)


def start_tracing(environ: Mapping[str, str] | None = None, *, row_spans: bool = False) -> Tracing:
    """The SDK's tracing when the environment asks for it and the extra is
    installed; NoTracing (with one warning if the extra is missing) otherwise.
    ``row_spans``: a span for each published row too (``--trace-rows``)."""
    environ = os.environ if environ is None else environ
    if not tracing_requested(environ):
        if row_spans:
            log.warning(
                "--trace-rows is on but tracing is off (no OTEL_EXPORTER_OTLP_ENDPOINT, or "
                "OTEL_SDK_DISABLED / OTEL_TRACES_EXPORTER=none): no spans"
            )
        return NoTracing()
    try:
        return _OtelTracing(row_spans=row_spans, environ=environ)
    except ImportError as exc:
        log.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed (%s): "
            "no spans; pip install 'outbox-relay[otel]'",
            exc.name,
        )
        return NoTracing()


class _OtelSpan:
    def __init__(self, span: Any, tracing: _OtelTracing) -> None:
        self._span = span
        self._tracing = tracing
        context = span.get_span_context()
        self.context = TraceContext(
            f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}",
            context.trace_state.to_header() or None,
        )

    def end(self, failed: Mapping[str, int], published: Sequence[PublishedRow] = ()) -> None:
        if failed:
            reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(failed.items()))
            self._span.set_attribute("outbox_relay.failed_rows", sum(failed.values()))
            self._span.set_status(self._tracing.status_error, f"rows not published ({reasons})")
        acked_at = time.time_ns()
        self._span.end(end_time=acked_at)
        if published:
            self._tracing.row_spans_of(self._span, published, acked_at)


class _OtelTracing:
    enabled = True

    def __init__(self, *, row_spans: bool, environ: Mapping[str, str]) -> None:
        self._link_limit = link_limit(environ)  # first: one line for a bad value
        # Imported here: the extra is optional, and without it nothing is loaded.
        from opentelemetry import trace  # noqa: PLC0415
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
        from opentelemetry.trace import (  # noqa: PLC0415
            Link,
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            TraceFlags,
            TraceState,
            set_span_in_context,
        )
        from opentelemetry.trace.status import StatusCode  # noqa: PLC0415

        from relay import __version__  # noqa: PLC0415

        # OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES name the service; else the SDK
        # would say "unknown_service:python".
        resource = Resource.create({"service.version": __version__})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "outbox-relay"}))
        self._provider = TracerProvider(resource=resource)  # OTEL_TRACES_SAMPLER applies
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self._tracer = trace.get_tracer("outbox-relay", __version__, self._provider)
        self._span_context = SpanContext
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._kind = SpanKind.PRODUCER
        self.status_error = StatusCode.ERROR
        self.row_spans = row_spans
        self._link = Link
        self._in_context = set_span_in_context
        self._non_recording = NonRecordingSpan
        self._trace_state = TraceState
        self._internal = SpanKind.INTERNAL
        log.info(
            "OpenTelemetry tracing on: a span per batch publish%s",
            ", and one per published row (--trace-rows)" if row_spans else "",
        )

    def publish_span(
        self, subjects: Sequence[str], producers: Sequence[TraceContext]
    ) -> PublishSpan:
        distinct = set(subjects)
        destination = next(iter(distinct)) if len(distinct) == 1 else None
        attributes: dict[str, Any] = {
            "messaging.system": "nats",
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.batch.message_count": len(subjects),
        }
        if destination is not None:
            attributes["messaging.destination.name"] = destination
        # Links are added after the start: a span the sampler drops makes none.
        span = self._tracer.start_span(
            f"send {destination}" if destination else "send",
            kind=self._kind,
            attributes=attributes,
        )
        if span.is_recording():
            links, left_out = links_to_make(producers, self._link_limit)
            for context in links:
                span.add_link(self._producer_context(context))
            if left_out:
                span.set_attribute("outbox_relay.unlinked_producers", left_out)
        return _OtelSpan(span, self)

    def _producer_context(self, context: TraceContext, trace_state: Any = None) -> Any:
        # A checked traceparent (relay/headers.py): ids at fixed places, sampled.
        value = context.traceparent
        return self._span_context(
            int(value[3:35], 16), int(value[36:52], 16), True, self._sampled, trace_state
        )

    def row_spans_of(self, publish: Any, rows: Sequence[PublishedRow], acked_at: int) -> None:
        """A span for each row whose producer sampled its trace, in that trace: from
        its created_at (never after the acks, whatever the two clocks say) to the
        acks, linked to the publish span."""
        publish_context = publish.get_span_context()
        for row in rows:
            if not sampled(row.producer) or not math.isfinite(row.created_at):
                continue
            header = row.producer.tracestate
            pairs = tracestate_pairs(header) if header else None
            state = self._trace_state(list(pairs)) if pairs else None
            span = self._tracer.start_span(
                f"outbox {row.event_type}",
                context=self._in_context(
                    self._non_recording(self._producer_context(row.producer, state))
                ),
                kind=self._internal,
                attributes={
                    "messaging.system": "nats",
                    "messaging.destination.name": row.event_type,
                    "messaging.message.id": row.id,
                },
                links=[self._link(publish_context)],
                # created_at has microseconds: rounded there, the float is exact.
                start_time=min(round(row.created_at * 1_000_000) * 1_000, acked_at),
            )
            span.end(end_time=acked_at)

    def shutdown(self) -> None:
        self._provider.shutdown()  # exports what is left
