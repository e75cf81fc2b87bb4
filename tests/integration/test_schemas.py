"""Event data checked against its schema, against real Postgres and NATS: an invalid
row goes dead and never reaches the stream while other subjects flow, its subject
waits behind it, and once the schema is fixed (SIGHUP) and the row requeued both
publish in order; `outbox-relay validate` finds exactly the invalid rows of a large
table in bounded memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relay.config import Config
from relay.database import connection_string
from relay.schemas import Schemas
from relay.validate import validate_table
from tests.support import database
from tests.support.database import Event
from tests.support.relayproc import cli, run_cli, wait_until

pytestmark = pytest.mark.integration

FAST = {"poll_interval": "200ms", "backoff_base": "200ms", "backoff_max": "1s"}


def payment_schema(minimum: float) -> dict:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["amount"],
        "properties": {"amount": {"type": "number", "minimum": minimum}},
    }


def write_schema(folder: Path, event_type: str, schema: dict) -> None:
    (folder / f"{event_type}.schema.json").write_text(json.dumps(schema))


def test_an_invalid_row_is_dead_holds_its_subject_and_goes_once_fixed(
    db_url, stream, start_relay, tmp_path
):
    paid = stream.subject("payment.captured")
    write_schema(tmp_path, paid, payment_schema(0))
    relay = start_relay(schemas=str(tmp_path), **FAST)
    invalid = Event(paid, "account-1", {"amount": -5})
    behind = Event(paid, "account-1", {"amount": 7})
    others = [Event(paid, f"account-{n}", {"amount": n}) for n in range(2, 12)]
    unchecked = Event(stream.subject("note.added"), "account-2", {"text": "no schema"})
    database.insert_in_order(db_url, [invalid, behind], commit_each=True)
    database.insert(db_url, [*others, unchecked])
    wait_until(
        lambda: database.unpublished_count(db_url) == 2,
        message="every row published but the invalid one and the row behind it",
    )
    rows = database.rows_by_id(db_url)
    assert rows[str(invalid.id)]["relay_dead_at"] is not None
    assert rows[str(invalid.id)]["attempts"] == 20  # dead at once: set to the cap
    assert rows[str(invalid.id)]["relay_last_error"] == (
        "invalid_data: schema: /amount: -5 is less than the minimum of 0"
    )
    assert rows[str(behind.id)]["published_at"] is None
    stored = {m.msg_id for m in stream.read()}
    assert stored == {str(e.id) for e in [*others, unchecked]}
    assert relay.metric("outbox_relay_schema_rejections_total", event_type=paid) == 1
    assert relay.metric("outbox_relay_schemaless_rows_total", event_type=unchecked.event_type)
    # The schema was wrong (refunds are negative): fix it, reread it, requeue the row.
    write_schema(tmp_path, paid, payment_schema(-1000))
    relay.signal(signal.SIGHUP)
    wait_until(lambda: "schemas reloaded" in relay.logs(), message="the schemas reread")
    run_cli(db_url, "requeue", "--id", str(invalid.id), "--execute")
    wait_until(lambda: database.unpublished_count(db_url) == 0, message="both published")
    order = [m.msg_id for m in stream.read() if m.msg_id in {str(invalid.id), str(behind.id)}]
    assert order == [str(invalid.id), str(behind.id)]
    assert relay.process.poll() is None  # SIGHUP rereads, it does not stop the relay


def test_a_schema_that_does_not_compile_stops_the_start_in_one_line(db_url, start_relay, tmp_path):
    (tmp_path / "payment.captured.schema.json").write_text('{"type": "nonsense"}')
    relay = start_relay(schemas=str(tmp_path), wait_ready=False)
    assert relay.process.wait(30) == 2
    errors = [r["message"] for r in relay.log_records() if r["level"] == "error"]
    assert len(errors) == 1, relay.logs()
    assert errors[0].startswith("cannot start: --schemas: payment.captured.schema.json: ")
    assert "Traceback" not in relay.logs()


def test_validate_finds_exactly_the_invalid_rows_of_a_large_table_in_bounded_memory(
    db_url, tmp_path
):
    write_schema(tmp_path, "payment.captured", payment_schema(0))
    # 100,000 rows of about 1 KB of data, published or not; every 9,973rd is invalid.
    database.execute(
        db_url,
        "insert into outbox_events (id, event_type, source, subject, time, data, published_at) "
        "select gen_random_uuid(), 'payment.captured', 't', 'a' || (g %% 100), now(), "
        "jsonb_build_object('amount', case when g %% 9973 = 0 then -g else g end, "
        "'pad', repeat('x', 1000)), case when g %% 2 = 0 then now() end "
        "from generate_series(1, 100000) g",
    )
    expected = {
        row_id
        for (row_id,) in database.fetch(
            db_url, "select id::text from outbox_events where (data->>'amount')::int < 0"
        )
    }
    assert len(expected) == 10
    report = validate_table(connection_string(db_url), Config(), Schemas.load(str(tmp_path)), None)
    assert report.checked == 100_000
    assert {r["id"] for r in report.invalid} == expected
    # Memory: the command's peak resident size over the same command on no rows.
    # Held at once, the rows (libpq's buffer, then Python's) would add over 100 MB.
    everything = validate_peak_rss(db_url, tmp_path, exit_status=1)
    nothing = validate_peak_rss(db_url, tmp_path, "--since", "1ms", exit_status=0)
    assert everything - nothing < 30 * 2**20, f"{(everything - nothing) / 2**20:.0f} MiB more"


# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, from pytest's process.
PEAK_RSS = """
import re, sys
from relay.cli import main
code = main(sys.argv[1:])
with open("/proc/self/status") as status:
    peak_kb = re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1)
print(int(peak_kb) * 1024, code)
"""


def validate_peak_rss(db_url: str, schemas: Path, *args: str, exit_status: int) -> int:
    """The peak resident bytes of `outbox-relay validate` run in a fresh process."""
    result = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, "validate", "--schemas", str(schemas), *args],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "OUTBOX_RELAY_DATABASE_URL": db_url},
    )  # fmt: skip
    *_, last = result.stdout.strip().splitlines()
    peak, code = last.split()
    assert code == str(exit_status), result.stdout[-2000:] + result.stderr
    return int(peak)


def test_validate_exit_status_and_json(db_url, tmp_path):
    write_schema(tmp_path, "payment.captured", payment_schema(0))
    good = Event("payment.captured", "a", {"amount": 1})
    database.insert(db_url, [good, Event("note.added", "a", {})])
    result = cli(db_url, "validate", "--schemas", str(tmp_path), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout) == {
        "checked": 2,
        "invalid_count": 0,
        "invalid": [],
        "no_schema": {"note.added": 1},
    }
    bad = Event("payment.captured", "a", {"amount": -1})
    database.insert(db_url, [bad])
    result = cli(db_url, "validate", "--schemas", str(tmp_path), "--since", "1h")
    assert result.returncode == 1
    assert f"{bad.id}  payment.captured  schema: /amount: -1 is less than" in result.stdout
    required = cli(db_url, "validate", "--schemas", str(tmp_path), "--schemas-required")
    assert required.returncode == 1
    assert "no note.added.schema.json" in required.stdout
    assert cli(db_url, "validate").returncode == 2  # no --schemas
    unreachable = cli("postgresql://127.0.0.1:1/x", "validate", "--schemas", str(tmp_path))
    assert unreachable.returncode == 2
