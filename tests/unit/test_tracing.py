"""When the relay traces, and what it calls itself (relay/tracing.py); the spans
themselves are checked over a real OTLP connection in tests/integration/test_tracing.py."""

from __future__ import annotations

import pytest

from relay import app
from relay.config import Config
from relay.errors import ConfigError
from relay.headers import TraceContext
from relay.tracing import (
    LINKS_PER_SPAN,
    NoTracing,
    PublishedRow,
    link_limit,
    links_to_make,
    sampled,
    start_tracing,
    tracestate_pairs,
    tracing_requested,
)
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


def test_with_trace_rows_each_sampled_rows_span_is_in_its_producers_trace(monkeypatch):
    """--trace-rows: a span per published row whose producer sampled its trace, a
    child of the producer's span from the row's created_at to the acks, linked to
    the publish span; none for an unsampled producer or an unwritable created_at;
    a created_at ahead of the relay's clock starts at the acks, never after them."""
    pytest.importorskip("opentelemetry.sdk")
    producers = [context(n, "01") for n in range(3)] + [context(3, "00")]
    producers[1] = producers[1]._replace(tracestate="shop=a1")
    published = [
        PublishedRow("row-0", "order.paid", 1_700_000_000.25, producers[0]),
        PublishedRow("row-1", "order.paid", 4_000_000_000.0, producers[1]),  # clock ahead
        PublishedRow("row-2", "order.paid", float("-inf"), producers[2]),
        PublishedRow("row-3", "order.paid", 1_700_000_000.0, producers[3]),  # unsampled
    ]
    with OtlpSink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
        tracing = start_tracing(row_spans=True)
        assert tracing.row_spans
        span = tracing.publish_span(["order.paid"] * 4, producers)
        span.end({}, published)
        tracing.shutdown()
    (publish,) = [s for s in sink.spans if s.name == "send order.paid"]
    rows = {s.attributes["messaging.message.id"]: s for s in sink.spans if s.name != publish.name}
    assert sorted(rows) == ["row-0", "row-1"]
    for n, row in enumerate((rows["row-0"], rows["row-1"])):
        assert (row.trace_id, row.parent_span_id) == (f"{n + 1:032x}", f"{n + 1:016x}")
        assert row.name == "outbox order.paid"
        assert row.links == [(publish.trace_id, publish.span_id)]
        assert row.end_ns == publish.end_ns
        assert row.attributes["messaging.destination.name"] == "order.paid"
    assert rows["row-0"].start_ns == 1_700_000_000_250_000_000
    assert rows["row-1"].start_ns == rows["row-1"].end_ns
    assert rows["row-1"].trace_state == "shop=a1"


def test_without_trace_rows_a_batch_makes_one_span(monkeypatch):
    pytest.importorskip("opentelemetry.sdk")
    with OtlpSink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
        tracing = start_tracing()
        assert not tracing.row_spans
        tracing.publish_span(["a.b"], [context(0, "01")]).end({})
        tracing.shutdown()
    assert [s.name for s in sink.spans] == ["send a.b"]


def test_trace_rows_without_tracing_says_so(monkeypatch, caplog):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert isinstance(start_tracing(row_spans=True), NoTracing)
    assert "--trace-rows is on but tracing is off" in caplog.text


@pytest.mark.parametrize(
    ("environ", "limit"),
    [
        ({}, LINKS_PER_SPAN),
        ({"OTEL_SPAN_LINK_COUNT_LIMIT": "128"}, 128),
        ({"OTEL_SPAN_LINK_COUNT_LIMIT": " 0 "}, 0),
        ({"OTEL_SPAN_LINK_COUNT_LIMIT": "unset"}, None),
    ],
)
def test_the_link_limit_is_the_sdks_variable_or_ours(environ, limit):
    assert link_limit(environ) == limit


@pytest.mark.parametrize("value", ["-1", "many", "1.5"])
def test_a_link_limit_the_sdk_would_refuse_stops_the_start_in_one_line(monkeypatch, caplog, value):
    # The relay's own start, as `outbox-relay run` makes it: exit status 2 and one
    # line, before any server is reached (none answers at these addresses).
    for name, setting in {**ENDPOINT, "OTEL_SPAN_LINK_COUNT_LIMIT": value}.items():
        monkeypatch.setenv(name, setting)
    config = Config(
        database_url="postgresql://127.0.0.1:1/x", nats_urls=("nats://127.0.0.1:1",),
        metrics_port=0,
    )  # fmt: skip
    assert app.run(config) == 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"OTEL_SPAN_LINK_COUNT_LIMIT: a non-negative integer or 'unset', not {value!r}"
    ]
    with pytest.raises(ConfigError, match="OTEL_SPAN_LINK_COUNT_LIMIT: a non-negative integer"):
        start_tracing({**ENDPOINT, "OTEL_SPAN_LINK_COUNT_LIMIT": value})


def test_by_default_a_span_links_at_most_links_per_span(monkeypatch):
    pytest.importorskip("opentelemetry.sdk")
    monkeypatch.delenv("OTEL_SPAN_LINK_COUNT_LIMIT", raising=False)
    producers = [context(n, "01") for n in range(LINKS_PER_SPAN + 8)]
    with OtlpSink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
        tracing = start_tracing()
        tracing.publish_span(["a.b"] * len(producers), producers).end({})
        tracing.shutdown()
    (span,) = sink.spans
    assert len(span.links) == LINKS_PER_SPAN
    assert span.attributes["outbox_relay.unlinked_producers"] == 8


@pytest.mark.parametrize(
    ("header", "pairs"),
    [
        ("shop=a1", (("shop", "a1"),)),
        (
            "rojo=00f067aa0ba902b7, congo=t61rcWkgMzE",
            (("rojo", "00f067aa0ba902b7"), ("congo", "t61rcWkgMzE")),
        ),
        ("tenant@vendor=x,,", (("tenant@vendor", "x"),)),
        ("Shop=a1", None),  # upper case key
        ("shop=a,b", None),  # "b" is no member
        ("shop=a1,shop=a2", None),  # a key twice
        ("shop=", None),  # no value
        (",".join(f"k{n}=v" for n in range(33)), None),  # more than 32
    ],
)
def test_a_tracestate_is_taken_whole_or_dropped(header, pairs):
    assert tracestate_pairs(header) == pairs


def test_a_row_span_drops_a_bad_tracestate_without_a_warning(monkeypatch, caplog):
    pytest.importorskip("opentelemetry.sdk")
    producer = context(0, "01")._replace(tracestate="Not A Member")
    with OtlpSink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
        tracing = start_tracing(row_spans=True)
        span = tracing.publish_span(["a.b"], [producer])
        span.end({}, [PublishedRow("row-0", "a.b", 1_700_000_000.0, producer)])
        tracing.shutdown()
    [row_span] = [s for s in sink.spans if s.name == "outbox a.b"]
    assert row_span.trace_state == ""
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
