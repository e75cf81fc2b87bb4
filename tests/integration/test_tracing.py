"""OpenTelemetry over a real OTLP/HTTP connection: the relay's SDK exporter sends to
a small receiver (relay_tools/otlpsink.py), which decodes the protobuf. One
request's trace id is found on the producer's side (the row), the relay's span
(linked), and the message a consumer reads (its traceparent names the relay's
span; the envelope keeps the producer's)."""

from __future__ import annotations

import json

import pytest

from relay_tools.otlpsink import OtlpSink
from tests.integration.test_headers import TRACEPARENT, insert_with
from tests.support import database
from tests.support.database import Event
from tests.support.relayproc import wait_until

pytestmark = pytest.mark.integration

PRODUCER_TRACE = TRACEPARENT.split("-")[1]
PRODUCER_SPAN = TRACEPARENT.split("-")[2]
SPAN_KIND_PRODUCER = 4  # opentelemetry.proto.trace.v1.Span.SpanKind
STATUS_ERROR = 2


@pytest.fixture
def sink():
    with OtlpSink() as receiver:
        yield receiver


def tracing_relay(start_relay, sink: OtlpSink, **settings):
    return start_relay(
        environment={
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: export soon after each span
            "OTEL_SERVICE_NAME": "relay-under-test",
        },
        poll_interval="200ms",
        **settings,
    )


def test_one_trace_from_the_row_through_the_relays_span_to_the_message(
    db_url, stream, start_relay, sink
):
    relay = tracing_relay(start_relay, sink)
    event = Event(stream.subject("order.paid"), "order-1", {"amount": 5})
    insert_with(db_url, event, traceparent=TRACEPARENT, tracestate="shop=a1")
    wait_until(lambda: len(stream.read()) == 1, message="published")
    linked = wait_until(
        lambda: [s for s in sink.spans if (PRODUCER_TRACE, PRODUCER_SPAN) in s.links],
        message="the relay's span, linked to the producer's",
    )
    span = linked[0]
    assert span.name == f"send {event.event_type}"
    assert span.kind == SPAN_KIND_PRODUCER
    assert span.attributes["messaging.system"] == "nats"
    assert span.attributes["messaging.destination.name"] == event.event_type
    assert span.attributes["messaging.batch.message_count"] == 1
    message = stream.read()[0]
    # The header is this hop's (the relay's span); the envelope keeps the producer's.
    _, trace_id, span_id, _ = message.headers["traceparent"].split("-")
    assert (trace_id, span_id) == (span.trace_id, span.span_id)
    assert message.envelope["traceparent"] == TRACEPARENT
    assert message.envelope["tracestate"] == "shop=a1"
    assert "OpenTelemetry tracing on" in relay.logs()


def test_with_trace_rows_the_row_has_a_span_in_the_producers_trace(
    db_url, stream, start_relay, sink
):
    """--trace-rows: the row's own span is a child of the producer's span (its trace
    id, its parent), from the row's created_at to the acks, and linked to the
    relay's publish span, which the message's traceparent names."""
    relay = tracing_relay(start_relay, sink, trace_rows="true")
    event = Event(stream.subject("order.paid"), "order-4", {"amount": 5})
    insert_with(db_url, event, traceparent=TRACEPARENT, tracestate="shop=a1")
    wait_until(lambda: len(stream.read()) == 1, message="published")
    [row_span] = wait_until(
        lambda: [s for s in sink.spans if s.name == f"outbox {event.event_type}"],
        message="the row's span",
    )
    assert (row_span.trace_id, row_span.parent_span_id) == (PRODUCER_TRACE, PRODUCER_SPAN)
    assert row_span.trace_state == "shop=a1"
    assert row_span.attributes["messaging.message.id"] == str(event.id)
    [(created_at_us,)] = database.fetch(
        db_url,
        "select (extract(epoch from created_at) * 1000000)::bigint from outbox_events "
        "where id = %s",
        (event.id,),
    )
    assert row_span.start_ns == created_at_us * 1000
    assert row_span.end_ns >= row_span.start_ns
    _, trace_id, span_id, _ = stream.read()[0].headers["traceparent"].split("-")
    assert row_span.links == [(trace_id, span_id)]
    assert "one per published row (--trace-rows)" in relay.logs()


def test_a_new_users_request_is_found_from_the_producer_to_the_consumer(
    db_url, stream, start_relay, sink
):
    """As docs/events.md shows a new user: the producer's own SDK injects its request
    span's context into the row; the relay runs with OTEL_EXPORTER_OTLP_ENDPOINT set
    and --trace-rows; a consumer continues from the message it reads. The request's
    trace id is on the producer's span, on the relay's spans (the publish span's
    link and the row's span) and in the message."""
    from opentelemetry import propagate  # noqa: PLC0415
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
        OTLPSpanExporter,
    )
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: PLC0415
    from opentelemetry.trace import SpanKind  # noqa: PLC0415

    shop = TracerProvider()
    shop.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{sink.endpoint}/v1/traces"))
    )
    tracer = shop.get_tracer("shop")
    tracing_relay(start_relay, sink, trace_rows="true")
    event = Event(stream.subject("order.paid"), "order-5", {"amount": 5})
    with tracer.start_as_current_span("POST /orders") as request:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        insert_with(
            db_url, event, traceparent=carrier["traceparent"], tracestate=carrier.get("tracestate")
        )
    request_trace = f"{request.get_span_context().trace_id:032x}"
    request_span = f"{request.get_span_context().span_id:016x}"
    wait_until(lambda: len(stream.read()) == 1, message="published")
    message = stream.read()[0]
    with tracer.start_as_current_span(
        f"process {event.event_type}",
        context=propagate.extract(message.headers),
        kind=SpanKind.CONSUMER,
    ) as handling:
        assert message.envelope["traceparent"].split("-")[1] == request_trace
    shop.shutdown()

    # The relay's publish span: the one the message's traceparent names.
    _, hop_trace, hop_span, _ = message.headers["traceparent"].split("-")
    [publish] = wait_until(
        lambda: [s for s in sink.spans if (s.trace_id, s.span_id) == (hop_trace, hop_span)],
        message="the relay's publish span",
    )
    assert (request_trace, request_span) in publish.links
    [row_span] = wait_until(
        lambda: [s for s in sink.spans if s.name == f"outbox {event.event_type}"],
        message="the row's span",
    )
    assert (row_span.trace_id, row_span.parent_span_id) == (request_trace, request_span)
    [producer] = [s for s in sink.spans if s.name == "POST /orders"]
    assert producer.trace_id == request_trace
    # The consumer continues the relay's hop: its parent is the publish span.
    handling_context = handling.get_span_context()
    [consumer] = [s for s in sink.spans if s.span_id == f"{handling_context.span_id:016x}"]
    assert (consumer.trace_id, consumer.parent_span_id) == (publish.trace_id, publish.span_id)


def test_a_failure_is_recorded_on_the_span(db_url, stream, start_relay, sink):
    tracing_relay(start_relay, sink)
    rogue = Event(stream.subject("order.paid"), "order-2", {"n": 1})
    insert_with(db_url, rogue, headers=json.dumps({"Nats-Rollup": "all"}), traceparent=TRACEPARENT)
    failed = wait_until(
        lambda: [s for s in sink.spans if s.status_code == STATUS_ERROR],
        message="a span with the failure",
    )
    assert "invalid_headers: 1" in failed[0].status_message
    assert failed[0].attributes["outbox_relay.failed_rows"] == 1
    assert database.dead_count(db_url, 20) == 1


@pytest.mark.parametrize(
    "off",
    [
        {},  # no endpoint: the relay's log and the message's header say tracing is off
        {"OTEL_SDK_DISABLED": "true"},
        {"OTEL_TRACES_EXPORTER": "none"},
    ],
)
def test_with_tracing_off_nothing_is_exported(db_url, stream, start_relay, sink, off):
    # With the sink named as the endpoint, OTEL_SDK_DISABLED or OTEL_TRACES_EXPORTER
    # turn tracing off: the sink would count anything exported.
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint} if off else {}
    relay = start_relay(poll_interval="200ms", environment={**endpoint, **off})
    event = Event(stream.subject("order.paid"), "order-3", {"amount": 5})
    insert_with(db_url, event, traceparent=TRACEPARENT)
    wait_until(lambda: len(stream.read()) == 1, message="published")
    # No span of the relay's: the header carries the producer's context unchanged.
    assert stream.read()[0].headers["traceparent"] == TRACEPARENT
    assert "OpenTelemetry tracing on" not in relay.logs()
    relay.stop()  # an SDK would flush its spans at exit
    assert sink.requests == 0
