"""The user-facing tools: `outbox-relay bench` (quick mode) and `outbox-relay demo`,
and the demo's idempotent consumer, the README's consumer example."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import nats.errors
import psycopg
import pytest

from relay_tools import demo
from relay_tools.bench import producer_cost
from relay_tools.bench.measure import pgbench_commits
from relay_tools.localservers import throwaway_postgres
from tests.support import database
from tests.support.database import Event
from tests.support.relayproc import wait_until
from tests.support.servers import SHARED_NATS_URL, SHARED_PG_URL
from tests.support.stream import run_js

pytestmark = pytest.mark.integration

FIGURES = {
    "wake_floor", "wake_row_floor", "publish_floor", "claim_mark_rate", "publish_rate",
    "relay_latency_100_p50", "relay_latency_100_p99", "relay_latency_100_max",
    "relay_latency_1000_p50", "relay_latency_1000_p99", "relay_latency_1000_max",
    "drain_mode_message_rate", "drain_mode_batch_rate", "drain_mode_atomic_rate",
    "cpu_mode_message", "cpu_mode_batch", "cpu_mode_atomic", "relay_latency_batch_1000_p99",
    "machine_cpu_mode_message", "machine_cpu_mode_batch", "machine_cpu_mode_atomic",
    "ceiling_mode_batch",
    "drain_rate", "drain_bulk_rate", "drain_dead_ahead_rate", "drain_replicas_rate",
    "drain_bulk_ratio", "drain_dead_ahead_ratio", "drain_replicas_ratio",
    "drain_memory", "drain_million_rate", "commits_contract_table", "commits_relay_indexes",
    "producer_index_ratio", "commits_no_trigger", "commits_relay_trigger",
    "commits_plain_trigger", "producer_cost_ratio", "plain_trigger_ratio",
    "plain_drain_rate", "plain_latency_100_p50", "plain_latency_100_p99",
    "plain_latency_100_max", "frozen_session_ended", "frozen_ratio_held",
    "frozen_ratio_after", "frozen_recovered_after", "claim_clear", "claim_behind_waiting",
    "claim_behind_held",
}  # fmt: skip


def test_bench_quick_mode_runs_every_measurement(tmp_path):
    """The figures are printed, not asserted: CI machines are too noisy for that."""
    out = tmp_path / "bench.json"
    charts = tmp_path / "charts"
    result = subprocess.run(
        [sys.executable, "-m", "relay", "bench", "--quick", "--json", str(out),
         "--plot", str(charts)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    print(result.stdout)
    assert_charts(charts, "drain.png", "latency.png")
    document = json.loads(out.read_text())
    # No server address, so no password or token, in what a user may paste anywhere.
    assert "://" not in out.read_text()
    assert set(document["figures"]) == FIGURES
    for figure in document["figures"].values():
        assert figure["min"] <= figure["median"] <= figure["max"]
        assert figure["median"] > 0, figure
    assert len(document["targets"]) == 13
    assert "targets:" in result.stdout
    assert "of that ceiling" in result.stdout
    assert "done in" in result.stderr  # the progress line finished


def test_bench_steady_quick_counts_the_relays_cost_per_event(tmp_path):
    """`bench steady --quick --partitions 1h`: one rate for a few seconds, on the plain
    table and on one partitioned by the hour; the figures are printed, and only
    their sanity asserted (CI machines are too noisy for targets)."""
    out = tmp_path / "steady.json"
    result = subprocess.run(
        [sys.executable, "-m", "relay", "bench", "steady", "--quick", "--partitions", "1h",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    print(result.stdout)
    rows = json.loads(out.read_text())["rows"]
    assert [row["layout"] for row in rows] == ["plain", "partitioned by 3600 s"]
    for row in rows:
        assert row["lost"] == 0
        assert row["committed_per_s"] > 0
        assert row["us_per_event"] > 0
        # The relay claims and marks: statements of its own, beside the producers' inserts.
        assert row["statements_per_event"] > 0
        assert row["p50_ms"] <= row["p99_ms"]
        # From the commit, which comes after the transaction's start: known for the
        # throwaway server, which keeps commit times.
        assert 0 < row["commit_p50_ms"] <= row["commit_p99_ms"]
        assert row["commit_p50_ms"] < row["p50_ms"]
    assert "| this build | plain | 100 |" in result.stdout
    assert "at 100/s, this build, partitioned by 3600 s: CPU per event" in result.stdout


def test_the_round_trip_bench_prints_each_way_of_waiting():
    """`python -m relay_tools.bench.roundtrip`: a line per way of waiting, with its CPU
    and wall time per round trip (figures only: no speed is asserted)."""
    result = subprocess.run(
        [sys.executable, "-m", "relay_tools.bench.roundtrip", "--count", "50",
         "--database-url", SHARED_PG_URL],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    ways = [line.split("CPU")[0].strip() for line in result.stdout.splitlines()]
    assert ways == ["sync", "asyncio door", "trio", "crossing"]
    assert all(
        re.search(r"CPU +[\d.]+ us +wall +[\d.]+ us", line) for line in result.stdout.splitlines()
    )


def test_the_publish_latency_bench_runs_each_relay_in_turns():
    """`python -m relay_tools.bench.publish_latency`: a line per turn and a median line
    per relay, this checkout run in two publish modes (figures only: no speed is
    asserted)."""
    here = str(Path(__file__).resolve().parents[2])
    result = subprocess.run(
        [sys.executable, "-m", "relay_tools.bench.publish_latency", "--rate", "50",
         "--seconds", "1", "--repetitions", "1",
         "--relay", f"{here}:batch", "--relay", f"{here}:message"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    turn = r"p50 [\d.]+ ms, p99 [\d.]+ ms.*CPU \d+ us an event"
    for mode in ("batch", "message"):
        assert re.search(rf"1/1 {re.escape(here)}:{mode}: {turn}", result.stdout), result.stdout
        assert re.search(rf"  {re.escape(here)}:{mode}: {turn}", result.stdout), result.stdout


def test_demo_beside_a_real_outbox_touches_nothing_of_it(db_url, stream):
    """With the user's servers named, the demo runs beside their outbox: their rows,
    their relay's channel and their stream are left exactly as they were, and what
    the demo made is gone afterwards."""
    theirs = Event(stream.subject("orders.placed"), "order-1")
    database.insert(db_url, [theirs])
    before = database.rows_by_id(db_url)
    result = subprocess.run(
        [sys.executable, "-m", "relay", "demo", "--seconds", "3", "--rate", "100"],
        capture_output=True, text=True, timeout=120, check=False,
        env={"OUTBOX_RELAY_DATABASE_URL": db_url, "OUTBOX_RELAY_NATS_URL": SHARED_NATS_URL,
             "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "events/s" in result.stdout
    shipped = re.search(r"stopped: (\d+) of (\d+) orders shipped exactly once", result.stdout)
    assert shipped, result.stdout + result.stderr
    # Every order the demo committed reached its consumer, however slowly its relay started.
    assert int(shipped.group(2)) > 0, result.stdout + result.stderr
    assert shipped.group(1) == shipped.group(2), result.stdout + result.stderr
    # Their row: unpublished, never tried, and not in their stream.
    assert database.rows_by_id(db_url) == before
    assert stream.read() == []
    # Nothing of the demo's is left: no schema, no table, no stream.
    assert (
        database.fetch(
            db_url, "select nspname from pg_namespace where nspname like 'outbox_relay_demo%%'"
        )
        == []
    )
    assert (
        database.fetch(db_url, "select tablename from pg_tables where tablename like 'demo_%%'")
        == []
    )

    async def demo_streams(js) -> list[str]:
        return [name async for name in _stream_names(js) if name.startswith("OUTBOX_RELAY_DEMO")]

    assert run_js(SHARED_NATS_URL, demo_streams) == []


async def _stream_names(js):
    for info in await js.streams_info():
        yield info.config.name


def test_the_demos_consumer_waits_through_either_timeout_a_fetch_raises(db_url):
    """nats-py's fetch raises its own TimeoutError when nothing came, and the builtin
    one when its deadline runs out between its two pull requests (a loaded machine):
    the consumer took the second for a failure and stopped, and its demo then waited
    a minute and shipped none of its orders."""
    envelope = {"id": str(uuid.uuid4()), "time": "2026-12-06T00:00:00Z",
                "data": {"order_id": str(uuid.uuid4())}}  # fmt: skip
    stop, stats = asyncio.Event(), demo.Stats()
    stats.produced = 1

    class Message:
        data = json.dumps(envelope).encode()

        async def ack(self) -> None:
            stop.set()

    class Subscription:
        def __init__(self) -> None:
            self.answers: list[BaseException | list[Message]] = [
                TimeoutError(),
                nats.errors.TimeoutError(),
                [Message()],
            ]

        async def fetch(self, batch: int, **options: float) -> list[Message]:
            answer = self.answers.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer

    class JetStream:
        async def pull_subscribe(self, *args: object, **kwargs: object) -> Subscription:
            return Subscription()

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            await conn.execute(demo.SCHEMA)
        await demo.consume(db_url, demo.DemoNames.new(), JetStream(), stop, stats)

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        runner.run(asyncio.wait_for(main(), 30))
    assert (stats.consumed, stats.duplicates) == (1, 0)


def test_a_demo_part_that_fails_is_named():
    async def main() -> tuple[str | None, str | None]:
        async def fails() -> None:
            raise OSError("connection refused")

        async def works() -> None:
            return None

        parts = {"producer": asyncio.create_task(works()),
                 "consumer": asyncio.create_task(fails())}  # fmt: skip
        before = demo.failure(parts)
        await asyncio.wait(parts.values())
        after = demo.failure(parts)
        return (before and str(before)), (after and str(after))

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        assert runner.run(main()) == (
            None, "the demo's consumer stopped: OSError('connection refused')"
        )  # fmt: skip


def test_consumer_does_its_work_once_per_envelope_id(db_url):
    async def main() -> tuple[bool, bool, int]:
        async with await psycopg.AsyncConnection.connect(db_url) as conn:
            await conn.execute(demo.SCHEMA)  # the demo's tables, in the test's database
            await conn.commit()
            envelope = {"id": str(uuid.uuid4()), "data": {"order_id": str(uuid.uuid4())}}
            first = await demo.handle(conn, envelope)
            again = await demo.handle(conn, envelope)  # a redelivery
            cursor = await conn.execute("select count(*) from demo_shipments")
            row = await cursor.fetchone()
            return first, again, row[0]

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        assert runner.run(main()) == (True, False, 1)


def test_the_demo_on_its_own_servers_shows_no_warning():
    # A newcomer's first screen: the demo makes its own stream, so it makes it as the
    # relay wants it (ids kept past --backoff-max + --publish-timeout); the relay had
    # warned about the demo's own stream.
    result = subprocess.run(
        [sys.executable, "-m", "relay", "demo", "--seconds", "3", "--rate", "50"],
        capture_output=True, text=True, timeout=180, check=False,
        env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "orders shipped exactly once" in output
    assert "WARNING" not in output
    assert "keeps message ids" not in output


def test_the_soak_quick_mode_prints_every_window_and_the_targets(tmp_path):
    """The figures are printed, not asserted (CI machines are too noisy for latency
    targets); what every run must show is there: each window, with and without the
    hold, and nothing lost or out of order; again with every claim walking from the
    claim index's first entry, for the chart of the two."""
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "-m", "relay", "bench", "--soak", "--quick", "--without-start-key",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    print(result.stdout)
    # The chart of a saved run, without running again.
    charts = tmp_path / "charts"
    plotted = subprocess.run(
        [sys.executable, "-m", "relay", "bench", "--plot", str(charts), "--from-json", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert plotted.returncode == 0, plotted.stdout + plotted.stderr
    assert_charts(charts, "soak.png", "soak-start-key.png")
    assert "targets:" in result.stdout, result.stdout + result.stderr
    assert "every claim walking from the claim index's first entry" in result.stdout
    document = json.loads(out.read_text())
    without_key = document["without_start_key"]
    assert without_key["plan"]["start_key"] is False
    assert (without_key["lost"], without_key["inversions"]) == (0, 0)
    assert all(w["events"] > 0 for w in without_key["windows"])
    assert "://" not in out.read_text()
    windows = document["windows"]
    assert len(windows) == 8
    assert [w["held"] for w in windows] == [False, False, True, True, True, True, False, False]
    assert all(w["events"] > 0 for w in windows)
    assert document["lost"] == 0
    assert document["inversions"] == 0
    assert max(w["dead_tuples"] for w in windows if w["held"]) > 0


def test_the_poolers_quick_mode_measures_every_arrangement(tmp_path):
    """Every arrangement drains and carries its load; the figures are printed, and
    the one through the pooler alone shows the poll's latency, not LISTEN's."""
    out = tmp_path / "poolers.json"
    result = subprocess.run(
        [sys.executable, "-m", "relay", "bench", "--poolers", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    arrangements = {a["name"]: a for a in json.loads(out.read_text())["arrangements"]}
    assert len(arrangements) == 4
    assert all(a["drain"][0] > 0 and a["p99"][0] > 0 for a in arrangements.values())
    assert "://" not in out.read_text()
    assert "| PgBouncer transaction mode + --listen-database-url direct |" in result.stdout


def test_the_features_quick_mode_drains_each_arrangement(tmp_path):
    """Every arrangement drains the order payload, no row dead (the bench stops on
    one) and spans exported with tracing on; the ratios are printed."""
    out = tmp_path / "features.json"
    result = subprocess.run(
        [sys.executable, "-m", "relay", "bench", "--features", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(out.read_text())
    arrangements = {
        "without", "with_schemas", "padded", "traced", "tracing_on", "tracing_on_128_links",
        "tracing_on_tenth", "trace_rows", "trace_rows_tenth",
    }  # fmt: skip
    assert set(document["rates"]) == set(document["relay_us_per_row"]) == arrangements
    assert all(len(runs) == 1 and runs[0] > 0 for runs in document["rates"].values())
    assert set(document["ratios"]) == arrangements - {"without", "padded"}
    # Spans linked to the producers, at most the SDK's default link limit each.
    assert 0 < document["links"] <= 128 * document["spans"]
    assert result.stdout.count("[MET]") + result.stdout.count("[NOT MET]") == 4
    assert result.stdout.count("[figure]") == 3


def test_the_hostile_quick_mode_settles_every_case_in_order_with_the_relay_up(tmp_path):
    """Issue 39's cases beside steady load on a non-ISO DateStyle, through the
    relay as an operator runs it: each row published in order or dead with a reason
    inside it, nothing of the producer's in the envelope, the relay never down. Its
    figures (seconds, p99) are printed, never asserted."""
    out = tmp_path / "hostile.json"
    result = subprocess.run(
        [sys.executable, "-m", "relay", "bench", "--hostile", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(out.read_text())
    outcomes = {case["case"]: case["outcome"] for case in document["cases"]}
    dead = {name: outcome for name, outcome in outcomes.items() if outcome != "published"}
    wide = "a header 1.2 MB in UTF-8 (600k characters)"
    assert set(dead) == {"data 3,000 deep, --schemas", "headers 3,000 deep", wide}
    assert dead["data 3,000 deep, --schemas"] == (
        "dead: invalid_data: schema: the data nested deeper than the relay reads"
    )
    assert dead["headers 3,000 deep"] == (
        "dead: invalid_headers: headers: a JSON object of strings is expected: nested deeper "
        "than the relay reads"
    )
    # Its bytes: the 1.2 MB value, the Nats-Msg-Id, and an envelope whose size varies.
    assert dead[wide].startswith("dead: too_large: message is 1200"), dead[wide]
    assert dead[wide].endswith(" bytes, over the server's max_payload 1048576"), dead[wide]
    assert all(case["in_order"] in (True, None) for case in document["cases"])
    assert all(case["envelope_keys_ok"] for case in document["cases"])
    assert document["relay_stayed_up"]
    assert document["events"] > 0


def assert_charts(directory: Path, *names: str) -> None:
    """Each chart is there, a PNG with something drawn in it."""
    assert sorted(p.name for p in directory.iterdir()) == sorted(names)
    for name in names:
        data = (directory / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), name
        assert len(data) > 10_000, name  # axes, bars and labels, not an empty canvas


def test_the_producer_cost_cdc_arrangement_feeds_a_slot_that_is_read():
    """The CDC arrangement measures producers whose server decodes their WAL for a
    reader: the slot's reader must really read (its confirmed position moves past
    where the producers began), or the figure would be a server merely at
    wal_level = logical."""
    with throwaway_postgres(durable=True, settings=producer_cost.CDC_SETTINGS) as server:
        table = asyncio.run(producer_cost.build_cdc(server.url))
        with producer_cost.cdc_reader(server.url), psycopg.connect(server.url) as conn:
            conn.autocommit = True
            (before,) = conn.execute("select pg_current_wal_lsn()").fetchone()
            commits = pgbench_commits(server.url, producer_cost.EVENT_TYPE, 1.0, 2, table)

            def confirmed() -> bool:
                (moved,) = conn.execute(
                    "select confirmed_flush_lsn > %s::pg_lsn from pg_replication_slots"
                    " where slot_name = %s",
                    (str(before), producer_cost.CDC_NAME),
                ).fetchone()
                return bool(moved)

            wait_until(confirmed, 30, message="the CDC reader confirming the inserts")
    assert commits > 0
