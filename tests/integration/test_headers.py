"""What a row adds to its message, against real Postgres and NATS: the producer's
trace context and its own headers arrive with the message; a row whose headers
would make the server act (Nats-Rollup) or that NATS cannot carry is dead, and the
stream keeps every earlier message."""

from __future__ import annotations

import json
import urllib.parse
import uuid

import pytest

from tests.support import database
from tests.support.database import Event
from tests.support.relayproc import wait_until

pytestmark = pytest.mark.integration

FAST = {"poll_interval": "200ms", "backoff_base": "200ms", "backoff_max": "1s"}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def insert_with(db_url: str, event: Event, **columns: str | None) -> None:
    names = ", ".join(columns)
    marks = ", ".join(["%s"] * len(columns))
    database.execute(
        db_url,
        "insert into outbox_events (id, event_type, source, subject, time, data, "
        f"{names}) values (%s, %s, %s, %s, %s, %s, {marks})",
        (
            event.id, event.event_type, event.source, event.subject, event.time,
            json.dumps(event.data), *columns.values(),
        ),
    )  # fmt: skip


def test_trace_context_and_headers_arrive_with_the_message(db_url, stream, start_relay):
    start_relay(**FAST)
    traced = Event(stream.subject("order.paid"), "order-1", {"amount": 5})
    insert_with(
        db_url,
        traced,
        traceparent=TRACEPARENT,
        tracestate="shop=a1",
        headers=json.dumps({"x-tenant": "acme"}),
    )
    broken = Event(stream.subject("order.paid"), "order-2", {"amount": 6})
    insert_with(db_url, broken, traceparent="not-a-traceparent", tracestate="shop=a2")
    wait_until(lambda: len(stream.read()) == 2, message="both published")
    by_id = {m.msg_id: m for m in stream.read()}
    message = by_id[str(traced.id)]
    assert message.headers["traceparent"] == TRACEPARENT
    assert message.headers["tracestate"] == "shop=a1"
    assert message.headers["x-tenant"] == "acme"
    assert message.envelope["traceparent"] == TRACEPARENT  # the CloudEvents extension
    assert message.envelope["tracestate"] == "shop=a1"
    # An invalid trace context is dropped, never fatal: the event goes without it.
    dropped = by_id[str(broken.id)]
    assert "traceparent" not in dropped.headers
    assert "tracestate" not in dropped.headers
    assert "traceparent" not in dropped.envelope


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"Nats-Rollup": "all"}, "'Nats-Rollup' is reserved"),
        ({"Nats-TTL": "1s"}, "'Nats-TTL' is reserved"),
        ({"bad name": "x"}, "'bad name' is not a header name NATS can carry"),
    ],
)
def test_a_row_whose_headers_would_act_on_the_stream_is_dead_and_holds_its_subject(
    db_url, stream, start_relay, headers, reason
):
    start_relay(**FAST)
    earlier = [Event(stream.subject("order.paid"), f"order-{n}", {"n": n}) for n in range(10)]
    database.insert(db_url, earlier)
    wait_until(lambda: len(stream.read()) == 10, message="the earlier rows published")
    rogue = Event(stream.subject("order.paid"), "order-1", {"n": 10})
    insert_with(db_url, rogue, headers=json.dumps(headers))
    behind = Event(stream.subject("order.paid"), "order-1", {"n": 11})
    other = Event(stream.subject("order.paid"), f"order-{uuid.uuid4().hex[:6]}", {"n": 12})
    database.insert_in_order(db_url, [behind, other], commit_each=True)
    wait_until(lambda: len(stream.read()) == 11, message="the other subject's row published")
    row = database.rows_by_id(db_url)[str(rogue.id)]
    assert row["relay_dead_at"] is not None
    assert row["relay_last_error"].startswith("invalid_headers: headers: ")
    assert reason in row["relay_last_error"]
    stored = [m.msg_id for m in stream.read()]
    # Nothing purged: every earlier message is still there, and the rogue never went.
    assert stored == [str(e.id) for e in earlier] + [str(other.id)]
    assert database.rows_by_id(db_url)[str(behind.id)]["published_at"] is None


def test_binary_mode_round_trips_through_a_consumer(db_url, stream, start_relay):
    """--envelope binary: the consumer gets the data as the body and rebuilds the
    event from the ce- headers (percent-decoded), the producer's trace context
    among them."""
    start_relay(envelope="binary", **FAST)
    event = Event(stream.subject("order.paid"), "order 7 / eu", {"amount": 5, "note": "grüße"})
    insert_with(db_url, event, traceparent=TRACEPARENT, headers=json.dumps({"x-tenant": "acme"}))
    wait_until(lambda: len(stream.read()) == 1, message="published")
    message = stream.read()[0]
    assert json.loads(message.body) == event.data
    attributes = {
        key[3:]: urllib.parse.unquote(value)
        for key, value in message.headers.items()
        if key.startswith("ce-")
    }
    assert attributes == {
        "specversion": "1.0",
        "id": str(event.id),
        "type": event.event_type,
        "source": event.source,
        "subject": "order 7 / eu",
        "time": attributes["time"],
        "traceparent": TRACEPARENT,
    }
    assert attributes["time"].endswith("Z")
    assert message.headers["content-type"] == "application/json"
    assert message.headers["x-tenant"] == "acme"
    assert message.msg_id == str(event.id)
