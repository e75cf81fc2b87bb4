"""When the relay traces, and what it calls itself (relay/tracing.py); the spans
themselves are checked over a real OTLP connection in tests/integration/test_tracing.py."""

from __future__ import annotations

import pytest

from relay.headers import TraceContext
from relay.tracing import NoTracing, links_to_make, sampled, start_tracing, tracing_requested
from relay_tools.otlpsink import OtlpSink

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        (ENDPOINT, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"}, True),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, False),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_SERVICE_NAME": "relay"}, False),  # a name alone exports nothing
    ],
)
def test_tracing_is_on_only_when_an_exporter_endpoint_is_set(environ, on):
    assert tracing_requested(environ) is on


def test_off_is_the_no_op(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    tracing = start_tracing()
    assert isinstance(tracing, NoTracing)
    span = tracing.publish_span(["a.b"], [])
    assert span.context is None


@pytest.mark.parametrize(
    ("environ", "name"),
    [
        ({}, "outbox-relay"),
        ({"OTEL_SERVICE_NAME": "billing-relay"}, "billing-relay"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=payments-relay"}, "payments-relay"),
    ],
)
def test_the_service_name_is_the_environments_or_outbox_relay(monkeypatch, environ, name):
    for variable in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in {**ENDPOINT, **environ}.items():
        monkeypatch.setenv(variable, value)
    tracing = start_tracing()
    try:
        assert tracing.enabled
        assert tracing._provider.resource.attributes["service.name"] == name  # type: ignore[attr-defined]
    finally:
        tracing.shutdown()


def context(n: int, flags: str) -> TraceContext:
    return TraceContext(f"00-{n + 1:032x}-{n + 1:016x}-{flags}", None)


@pytest.mark.parametrize(
    ("flags", "is_sampled"), [("01", True), ("00", False), ("03", True), ("02", False)]
)
def test_sampled_is_the_trace_flags_lowest_bit(flags, is_sampled):
    assert sampled(context(0, flags)) is is_sampled
    later = TraceContext(context(0, flags).traceparent.replace("00-", "01-", 1) + "-x", None)
    assert sampled(later) is is_sampled


def test_a_span_links_the_sampled_producers_in_row_order_up_to_the_limit():
    producers = [context(n, "01" if n % 3 else "00") for n in range(12)]
    wanted = [c for n, c in enumerate(producers) if n % 3]
    assert links_to_make(producers, None) == (wanted, 0)
    assert links_to_make(producers, 8) == (wanted, 0)
    assert links_to_make(producers, 5) == (wanted[:5], 3)
    assert links_to_make(producers, 0) == ([], 8)
    assert links_to_make([context(0, "00")], 5) == ([], 0)


def test_the_spans_links_through_the_sdk(monkeypatch):
    """Through the SDK and its OTLP exporter to a receiver on loopback: the links
    made, the count left out, and none (no span) when the sampler drops the span."""
    pytest.importorskip("opentelemetry.sdk")
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "3")
    producers = [context(n, "01" if n % 2 else "00") for n in range(10)]
    for sampler, spans in (("always_on", 1), ("always_off", 0)):
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
        with OtlpSink() as sink:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
            tracing = start_tracing()
            tracing.publish_span(["a.b"] * 10, producers).end({})
            tracing.shutdown()  # exports what is left
            assert len(sink.spans) == spans
            if spans:
                (span,) = sink.spans
                assert span.links == [(f"{n:032x}", f"{n:016x}") for n in (2, 4, 6)]
                assert span.attributes["outbox_relay.unlinked_producers"] == 2
                assert span.attributes["messaging.batch.message_count"] == 10
