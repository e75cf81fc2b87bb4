"""Rows Postgres accepts that the relay's model did not: each is published, or set
aside dead with a reason inside the row, and the relay never stops for one (issue
39). Against a relay process, real Postgres and real NATS."""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import pytest

from tests.support import database
from tests.support.relayproc import RelayProcess, wait_until

pytestmark = pytest.mark.integration

FAST = {"poll_interval": "200ms", "backoff_base": "200ms", "backoff_max": "1s"}
TRACE_IDS = "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def insert_raw(url: str, event_type: str, subject: str, data: str, **columns: str) -> str:
    """One row with ``data`` as jsonb text, exactly as given."""
    row_id = str(uuid.uuid4())
    names = "".join(f", {name}" for name in columns)
    marks = ", %s" * len(columns)
    database.execute(
        url,
        f"insert into outbox_events (id, event_type, source, subject, time, data{names}) "
        f"values (%s, %s, 'tests', %s, now(), %s::jsonb{marks})",
        (row_id, event_type, subject, data, *columns.values()),
    )
    return row_id


def settled(url: str, ids: list[str]) -> bool:
    [(count,)] = database.fetch(
        url,
        "select count(*) from outbox_events where id = any(%s::uuid[]) "
        "and coalesce(published_at, relay_dead_at) is not null",
        (ids,),
    )
    return count == len(ids)


def errors(url: str) -> dict[str, str | None]:
    return {
        str(row_id): error
        for row_id, error in database.fetch(
            url, "select id, relay_last_error from outbox_events where published_at is null"
        )
    }


def never_stopped(relay: RelayProcess) -> None:
    assert relay.process.poll() is None, relay.logs()[-3000:]
    assert "Traceback" not in relay.logs(), relay.logs()[-3000:]


def test_rows_no_double_can_hold_nested_past_1024_or_with_tails_are_published_or_dead(
    db_url, stream, start_relay, tmp_path: Path
):
    checked = stream.subject("payment.captured")
    unchecked = stream.subject("note.added")
    (tmp_path / f"{checked}.schema.json").write_text(json.dumps({"type": "object"}))
    relay = start_relay(schemas=str(tmp_path), **FAST)
    deep = "[" * 3000 + "1" + "]" * 3000
    huge = insert_raw(db_url, checked, "a-1", '{"n": 1e400}')
    deep_checked = insert_raw(db_url, checked, "a-2", deep)
    deep_unchecked = insert_raw(db_url, unchecked, "a-3", deep)
    deep_headers = insert_raw(db_url, unchecked, "a-4", "{}", headers='{"h": ' + deep + "}")
    injected = insert_raw(
        db_url, unchecked, "a-5", "{}", traceparent=f'01-{TRACE_IDS}-","admin":true,"x":"'
    )
    # 600,000 characters, 1.2 MB in UTF-8: over NATS's 1 MiB max_payload in bytes alone.
    wide = insert_raw(db_url, unchecked, "a-6", "{}", headers=json.dumps({"x-wide": "é" * 600_000}))
    behind = insert_raw(db_url, checked, "a-1", '{"n": 1}')
    ids = [huge, deep_checked, deep_unchecked, deep_headers, injected, wide, behind]
    wait_until(lambda: settled(db_url, ids), message="every row published or dead")

    dead = errors(db_url)
    assert set(dead) == {deep_checked, deep_headers, wide}, dead
    assert dead[deep_checked] == "invalid_data: schema: the data nested deeper than the relay reads"
    assert (dead[deep_headers] or "").startswith("invalid_headers: headers: a JSON object")
    assert (dead[wide] or "").startswith("too_large: message is 1200"), dead[wide]
    stored = {m.msg_id: m for m in stream.read()}
    assert json.loads(stored[huge].body)["data"] == {"n": 10**400}
    assert stored[deep_unchecked].body.endswith(b',"data":' + deep.encode() + b"}")
    envelope = stored[injected].envelope
    assert "admin" not in envelope
    assert "x" not in envelope
    assert envelope["traceparent"] == f"01-{TRACE_IDS}"
    assert [m.msg_id for m in stream.read() if m.msg_id in (huge, behind)] == [huge, behind]
    never_stopped(relay)
    assert relay.metric("outbox_relay_nats_connected") == 1


def test_a_reload_with_a_schema_that_cannot_be_used_keeps_the_old_set(
    db_url, stream, start_relay, tmp_path: Path
):
    checked = stream.subject("payment.captured")
    (tmp_path / f"{checked}.schema.json").write_text(json.dumps({"type": "object"}))
    relay = start_relay(schemas=str(tmp_path), **FAST)
    bad = {"$id": "not a uri ::", "type": "object"}
    (tmp_path / f"{checked}.schema.json").write_text(json.dumps(bad))
    relay.signal(signal.SIGHUP)
    wait_until(lambda: "schemas not reloaded" in relay.logs(), message="the reload refused")
    deep = '{"properties": {"a": ' * 3000 + "{}" + "}}" * 3000  # past what json.loads reads
    (tmp_path / f"{checked}.schema.json").write_text(deep)
    relay.signal(signal.SIGHUP)
    wait_until(
        lambda: relay.logs().count("schemas not reloaded") == 2, message="the second refused"
    )
    invalid = insert_raw(db_url, checked, "a-1", "[]")  # the old set: an object
    wait_until(lambda: settled(db_url, [invalid]), message="the row checked")
    assert errors(db_url)[invalid] == 'invalid_data: schema: (the data): [] is not of type "object"'
    never_stopped(relay)
