"""What a row adds to its message (relay/headers.py, relay/envelope.py): W3C trace
context checked, and headers guarded so that no row can make the server act."""

from __future__ import annotations

import json

import pytest

from relay import headers as module
from relay.envelope import (
    MSG_ID_HEADER,
    Message,
    MessageSettings,
    build_message,
    message_for,
    percent_encode,
)
from relay.headers import TRACESTATE_LIMIT, TraceContext, header_problem, row_headers, trace_context
from relay.headers import trace_context as read_trace
from relay.model import FailureReason, OutboxRow, Rejection

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def message_of(source: OutboxRow, *, binary: bool = False) -> Message | Rejection:
    """The row's message as the batch builds it: its trace context read first."""
    trace = read_trace(source.traceparent, source.tracestate)
    return message_for(source, MessageSettings(1 << 20, binary), trace)


def row(**optional: str | None) -> OutboxRow:
    return OutboxRow(
        "0b1d3c9e-8a56-4e0e-9c51-6d0b2a7f3a11", "orders.paid", "shop", "order-1",
        "2026-12-05T00:00:00Z", '{"amount": 5}', 0.0, 1, 0, **optional,
    )  # fmt: skip


@pytest.mark.parametrize(
    "value",
    [
        TRACEPARENT,
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",  # not sampled
    ],
)
def test_a_valid_traceparent_is_kept(value):
    assert trace_context(value, "vendor=x") == TraceContext(value, "vendor=x")


@pytest.mark.parametrize("tail", ["-later-fields", '-","x":"injected', "-" + "f" * 1_000_000])
def test_a_later_versions_fields_past_the_four_it_has_are_not_passed_on(tail):
    kept = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert trace_context(kept + tail, None) == TraceContext(kept, None)
    # A line break is not a field: such a traceparent is not W3C's at all.
    assert trace_context(kept + "-\r\nNats-Rollup: all", None) is None


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero parent id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # 00 with more
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
        "01-00000000000000000000000000000000-00f067aa0ba902b7-01",  # later version, zero id
        "01-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01-x",  # the same, parent
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",  # fields without a dash
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",  # short flags
    ],
)
def test_an_invalid_traceparent_is_dropped_with_its_tracestate(value):
    assert trace_context(value, "vendor=x") is None


def test_a_tracestate_nats_cannot_carry_or_too_long_is_dropped_alone():
    assert trace_context(TRACEPARENT, "a=1\r\nNats-Rollup: all") == TraceContext(TRACEPARENT, None)
    assert trace_context(TRACEPARENT, "a=\u00e9t\u00e9") == TraceContext(TRACEPARENT, None)
    assert trace_context(TRACEPARENT, "a=1\tb") == TraceContext(TRACEPARENT, None)
    too_long = "a=" + "x" * TRACESTATE_LIMIT
    assert trace_context(TRACEPARENT, too_long) == TraceContext(TRACEPARENT, None)
    assert trace_context(None, "vendor=x") is None


def test_the_trace_context_goes_in_the_headers_and_the_cloudevents_extension():
    message = build_message(row(), "2026-12-05T00:00:00Z", TraceContext(TRACEPARENT, "v=1"))
    assert message.headers == {
        MSG_ID_HEADER: "0b1d3c9e-8a56-4e0e-9c51-6d0b2a7f3a11",
        "traceparent": TRACEPARENT,
        "tracestate": "v=1",
    }
    envelope = json.loads(message.body)
    assert envelope["traceparent"] == TRACEPARENT
    assert envelope["tracestate"] == "v=1"
    assert envelope["data"] == {"amount": 5}


def test_a_row_without_the_optional_columns_builds_the_message_it_always_did():
    plain = message_of(row())
    assert isinstance(plain, Message)
    assert plain.headers == {MSG_ID_HEADER: "0b1d3c9e-8a56-4e0e-9c51-6d0b2a7f3a11"}
    assert b"traceparent" not in plain.body
    assert plain == build_message(row(), "2026-12-05T00:00:00Z")


def test_a_rows_headers_go_on_its_message_and_count_in_its_size():
    built = message_of(
        row(headers='{"x-tenant": "acme", "x-priority": "high"}', traceparent=TRACEPARENT)
    )
    assert isinstance(built, Message)
    assert built.headers["x-tenant"] == "acme"
    assert built.headers["x-priority"] == "high"
    assert built.headers["traceparent"] == TRACEPARENT
    bare = build_message(row(), "2026-12-05T00:00:00Z")
    added = len("x-tenant: acme\r\n") + len("x-priority: high\r\n")
    added += len(f"traceparent: {TRACEPARENT}\r\n") + len(f',"traceparent":"{TRACEPARENT}"')
    assert built.wire_size == bare.wire_size + added


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ('{"Nats-Rollup": "all"}', "'Nats-Rollup' is reserved: a Nats- header makes the server"),
        ('{"nats-ttl": "1s"}', "'nats-ttl' is reserved"),
        ('{"NATS-Expected-Last-Sequence": "1"}', "is reserved"),
        ('{"Nats-Msg-Id": "other"}', "'Nats-Msg-Id' is reserved"),
        ('{"bad name": "x"}', "'bad name' is not a header name NATS can carry"),
        ('{"a:b": "x"}', "is not a header name NATS can carry"),
        ('{"": "x"}', "'' is not a header name"),
        ('{"x-line": "a\\r\\nNats-Rollup: all"}', "'x-line': the value holds a line break"),
        ('{"x-number": 5}', "'x-number': the value must be a string, not int"),
        ('{"traceparent": "x"}', "'traceparent' is set by the relay"),
        ('{"ce-id": "x"}', "'ce-id' is set by the relay"),
        ('["x"]', "a JSON object of strings is expected, not list"),
    ],
)
def test_a_reserved_or_uncarriable_header_makes_the_row_dead(headers, reason):
    built = message_of(row(headers=headers))
    assert isinstance(built, tuple)
    failure, text = built
    assert failure is FailureReason.INVALID_HEADERS
    assert failure.permanent
    assert text.startswith("headers: ")
    assert reason in text


def test_headers_null_or_empty_add_nothing():
    assert row_headers(None) == ({}, None)
    assert row_headers("null") == ({}, None)
    assert row_headers("{}") == ({}, None)
    assert header_problem("x-ok", "a value\twith a tab") is None


def test_binary_mode_puts_the_data_in_the_body_and_each_attribute_in_a_ce_header():
    source = row(traceparent=TRACEPARENT, tracestate="v=1", headers='{"x-tenant": "acme"}')
    built = message_of(source._replace(source="shop/eu west"), binary=True)
    assert isinstance(built, Message)
    assert built.body == b'{"amount": 5}'
    assert built.headers == {
        MSG_ID_HEADER: "0b1d3c9e-8a56-4e0e-9c51-6d0b2a7f3a11",
        "x-tenant": "acme",
        "ce-specversion": "1.0",
        "ce-id": "0b1d3c9e-8a56-4e0e-9c51-6d0b2a7f3a11",
        "ce-type": "orders.paid",
        "ce-source": "shop/eu%20west",
        "ce-subject": "order-1",
        "ce-time": "2026-12-05T00:00:00Z",
        "content-type": "application/json",
        "ce-traceparent": TRACEPARENT,
        "ce-tracestate": "v=1",
        "traceparent": TRACEPARENT,
        "tracestate": "v=1",
    }


def test_binary_mode_hop_context_takes_the_header_the_producers_stays_an_attribute():
    hop = TraceContext("00-11111111111111111111111111111111-2222222222222222-01", None)
    built = build_message(row(), "t", TraceContext(TRACEPARENT, None), None, hop, binary=True)
    assert built.headers["traceparent"] == hop.traceparent
    assert built.headers["ce-traceparent"] == TRACEPARENT


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        ("plain-ascii_value.1", "plain-ascii_value.1"),
        ("two words", "two%20words"),
        ('say "hi"', "say%20%22hi%22"),
        ("100%", "100%25"),
        ("Grüße", "Gr%C3%BC%C3%9Fe"),
        ("line\nbreak", "line%0Abreak"),
    ],
)
def test_header_values_are_percent_encoded_as_the_cloudevents_binding_says(value, encoded):
    assert percent_encode(value) == encoded


def test_the_headers_cache_keeps_short_texts_only_and_at_most_its_count():
    module._cached_headers.cache_clear()
    for n in range(module.HEADERS_CACHED + 50):
        assert row_headers(json.dumps({"x-tenant": f"t{n}"}))[1] is None
    assert module._cached_headers.cache_info().currsize == module.HEADERS_CACHED
    module._cached_headers.cache_clear()
    long_text = json.dumps({"x-blob": "b" * module.HEADERS_CACHED_TEXT})
    assert row_headers(long_text) == ({"x-blob": "b" * module.HEADERS_CACHED_TEXT}, None)
    assert module._cached_headers.cache_info().currsize == 0


@pytest.mark.parametrize(
    "text",
    [
        '{"h": ' + "[" * 3000 + "]" * 3000 + "}",
        '{"h": 1' + "0" * 400 + "}",
        "[" * 1100 + "]" * 1100,
    ],
)
def test_headers_no_parser_reads_whole_are_the_rows_fault_not_an_exception(text):
    found, problem = row_headers(text)
    assert found == {}
    assert problem is not None
    assert problem.startswith("headers: ")
