"""When the relay traces, and what it calls itself (relay/tracing.py); the spans
themselves are checked over a real OTLP connection in tests/integration/test_tracing.py."""

from __future__ import annotations

import pytest

from relay.tracing import NoTracing, start_tracing, tracing_requested

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
