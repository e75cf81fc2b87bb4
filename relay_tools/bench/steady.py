"""`outbox-relay bench steady`: what the relay costs at the steady loads services run.

At each rate, pgbench's clients commit single-row transactions (``-R``, spread over
``subjects`` subjects) for ``seconds`` after a warm-up, and the bench reads:

- the relays' CPU (/proc, user and system, every replica together): % of one core
  and microseconds per event;
- the database transactions and statements the relays ran per event:
  ``pg_stat_database`` and ``pg_stat_statements`` (top level) of the bench's
  database, less the producers' own (one statement and one transaction per event),
  read from another database so that the reads are not counted;
- p50/p99 from the producer transaction's start (the envelope's ``time``, its
  now()) to the consumer's arrival (a core NATS subscription on the stream's
  subjects; one clock, one machine), and from its commit (the commit time Postgres
  keeps with ``track_commit_timestamp``, of a transaction a trigger names in a side
  table: the row's own xmin is the relay's mark's by then);
- rows held for order: claimed behind an earlier row of their subject that another
  relay's batch held, and left for a later claim (the relays' own counter);
- lost events (committed, not arrived within 30 s of the end);
- with ``--window``, CPU per event in each window of that length (does it grow?).

``--compare DIR`` runs the relay found in DIR (a checkout of another commit, whose
``relay`` package is run and installs its own SQL) beside this build, in turns at
each rate, each on a database of its own. ``--producer-ratio N`` also measures the producers'
commit rate on the installed table against the contract's table alone, and each
part of the installed table alone (pgbench, 8 clients, relay stopped, in turns, N
times: relay_tools.bench.producer_cost).

    outbox-relay bench steady --rates 200,1000,3000 --seconds 20 [--compare DIR]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import nats
import psycopg
from nats.aio.client import Client
from nats.aio.msg import Msg

from relay.config import Config
from relay_tools.bench import producer_cost
from relay_tools.bench.harness import (
    RelayProcess,
    Target,
    dumps,
    wait_until_ready,
    with_database,
)
from relay_tools.localservers import (
    free_port,
    postgres_binary,
    throwaway_nats,
    throwaway_postgres,
)

THIS_BUILD = "this build"
# Settle after the relays are ready and the producers start, before measuring.
WARMUP = 3.0
# After the producers stop: how long the last events may take to arrive.
ARRIVAL_TIMEOUT = 30.0
POSTGRES_SETTINGS = (
    "shared_preload_libraries = 'pg_stat_statements'",
    "pg_stat_statements.track = top",
    "pg_stat_statements.max = 5000",
    "track_commit_timestamp = on",
)
# Each producer transaction's id, kept where the relay's marks never rewrite it: the
# row's xmin then names the producer's transaction, whose commit time Postgres keeps
# (track_commit_timestamp), for the latency from the commit itself. The trigger's
# insert is the producers' cost alike for every build.
_COMMITS = """
create table if not exists bench_commits (id uuid);
truncate bench_commits;
create or replace function bench_commit_id() returns trigger language plpgsql as $$
begin
  insert into bench_commits values (new.id);
  return null;
end $$;
drop trigger if exists bench_commit_id on outbox_events;
create trigger bench_commit_id after insert on outbox_events
  for each row execute function bench_commit_id();
"""
_COUNTS = """
select d.xact_commit + d.xact_rollback,
       coalesce((select sum(s.calls) from pg_stat_statements s where s.dbid = d.datid), 0),
       coalesce((select sum(s.calls) from pg_stat_statements s
                  where s.dbid = d.datid and starts_with(s.query, %s)), 0)
  from pg_stat_database d where d.datname = %s
"""
# pg_stat_statements' text of the producers' insert (their statements, not the relay's).
_INSERT_TEXT = "insert into outbox_events (id, event_type, source, subject, time, data)"
_TOP_STATEMENTS = r"""
select s.calls, round(s.mean_exec_time::numeric, 3) || ' ms: '
                || left(regexp_replace(s.query, '\s+', ' ', 'g'), 60)
  from pg_stat_statements s join pg_database d on d.oid = s.dbid
 where d.datname = %s order by s.calls desc limit 8
"""


@dataclass(frozen=True)
class SteadyPlan:
    rates: Sequence[float] = (200.0, 1000.0, 3000.0)
    seconds: float = 20.0
    replicas: int = 1
    producers: int = 4
    subjects: int = 200
    window: float = 0.0  # seconds; 0: no windows
    compare: str | None = None  # a checkout whose relay runs beside this build
    # Seconds a partition: this build also on a table partitioned so, its partitions
    # kept ``partitions_ahead`` seconds past now (the relay's default: 3 days).
    partitions: float | None = None
    partitions_ahead: float = Config.partitions_ahead
    producer_repetitions: int = 0  # also the producers' ratio (producer_cost), this often

    @classmethod
    def quick(cls) -> SteadyPlan:
        return cls(rates=(100.0,), seconds=3.0)


@dataclass
class SteadyRow:
    build: str
    rate: float
    layout: str
    replicas: int
    committed_per_s: float
    cpu_percent: float
    us_per_event: float
    transactions_per_event: float
    statements_per_event: float
    p50_ms: float
    p99_ms: float
    lost: int
    # From the producer transaction's commit (its commit time, as Postgres keeps it),
    # None where the server keeps none.
    commit_p50_ms: float | None = None
    commit_p99_ms: float | None = None
    held_per_event: float = 0.0  # rows held for order (another relay's batch had their subject)
    windows_us_per_event: list[float] = field(default_factory=list)
    # The most called statements in the window, per event (the producers' insert too).
    top_statements: list[tuple[float, str]] = field(default_factory=list)


def _pgbench_script(target: Target, plan: SteadyPlan) -> Path:
    script = Path(tempfile.mkstemp(suffix=".sql")[1])
    script.write_text(
        f"\\set s random(0, {plan.subjects - 1})\n"
        "insert into outbox_events (id, event_type, source, subject, time, data) values "
        f"(gen_random_uuid(), '{target.event_type}', 'bench', 's' || :s, now(), "
        "'{\"n\": 1}');\n"
    )
    script.chmod(0o644)
    return script


class Arrivals:
    """A core NATS subscription on the stream's subjects: each event's commit-side
    time (its envelope's ``time``, the producer transaction's now()) and the wall
    clock at its arrival, by id; copies counted once."""

    def __init__(self, nats_url: str, subject: str, event_type: str) -> None:
        self._url = nats_url
        self._subject = subject
        self._event_type = event_type
        self.events: dict[str, tuple[float, float]] = {}
        self._nc: Client | None = None

    async def __aenter__(self) -> Arrivals:
        self._nc = await nats.connect(self._url)

        async def on_message(msg: Msg) -> None:
            arrived = time.time()
            if msg.subject != self._event_type:
                return  # the readiness probe
            envelope = json.loads(msg.data)
            if envelope["id"] not in self.events:
                written = datetime.fromisoformat(envelope["time"]).timestamp()
                self.events[envelope["id"]] = (written, arrived)

        await self._nc.subscribe(self._subject, cb=on_message, pending_msgs_limit=2_000_000)
        await self._nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._nc is not None:
            await self._nc.close()

    def written_between(self, start: float, end: float) -> list[tuple[float, float]]:
        return [(w, a) for w, a in self.events.values() if start <= w < end]

    def from_commit(self, commits: dict[str, float], start: float, end: float) -> list[float]:
        """Seconds from each commit to its arrival, for the events written between
        ``start`` and ``end`` whose commit time is known."""
        return [
            arrived - commits[event_id]
            for event_id, (written, arrived) in self.events.items()
            if start <= written < end and event_id in commits
        ]


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _counts(
    server_url: str, database: str, *, reset: bool = False
) -> tuple[int, int, int, list[tuple[int, str]]]:
    """Transactions, top-level statements and the producers' inserts of ``database``
    so far, and the most called statements, read from the server's ``postgres``
    database (so these reads are not counted); ``reset`` then empties
    pg_stat_statements."""
    async with await psycopg.AsyncConnection.connect(
        with_database(server_url, "postgres"), autocommit=True
    ) as conn:
        row = await (await conn.execute(_COUNTS, (_INSERT_TEXT, database))).fetchone()
        top = await (await conn.execute(_TOP_STATEMENTS, (database,))).fetchall()
        if reset:
            await conn.execute("select pg_stat_statements_reset()")
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2]), [(int(calls), text) for calls, text in top]


class SteadyTarget(Target):
    """A bench database installed by this build, or by the relay in ``source``;
    with ``partitions`` (seconds a partition, seconds of them ahead), its table
    partitioned so by that build's `install --partitions`."""

    def __init__(
        self,
        server_url: str,
        nats_url: str,
        source: str | None,
        partitions: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(server_url, nats_url)
        self.source = source
        self.partitions = partitions

    @property
    def build(self) -> str:
        return THIS_BUILD if self.source is None else self.source

    @property
    def layout(self) -> str:
        return "plain" if self.partitions is None else f"partitioned by {self.partitions[0]:g} s"

    async def install(self) -> None:
        if self.source is None:
            if self.partitions is None:
                await super().install()
            else:
                await self.install_partitioned(*self.partitions)
            return
        partitions = (
            []
            if self.partitions is None
            else ["--partitions", f"{self.partitions[0]:g}s",
                  "--partitions-ahead", f"{self.partitions[1]:g}s"]
        )  # fmt: skip
        await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "relay", "install", *partitions],
            cwd=self.source,
            env={**os.environ, "OUTBOX_RELAY_DATABASE_URL": self.url},
            check=True,
            capture_output=True,
        )
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            await conn.execute("create extension if not exists pg_stat_statements")

    async def create(self) -> None:
        await super().create()
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            await conn.execute("create extension if not exists pg_stat_statements")

    def relay(self) -> RelayProcess:
        port = str(free_port())
        if self.partitions is None:
            return RelayProcess(self.url, self.nats_url, source=self.source, metrics_port=port)
        ahead = f"{self.partitions[1]:g}s"
        return RelayProcess(
            self.url, self.nats_url, source=self.source, partitions_ahead=ahead, metrics_port=port
        )


async def measure_rate(target: SteadyTarget, plan: SteadyPlan, rate: float) -> SteadyRow:
    """One build at one rate: relays started, pgbench producing at ``rate`` (its own
    process: a Python producer at 3,000/s took half a core of the bench's), warmed
    up, measured, stopped."""
    await target.reset()
    async with await psycopg.AsyncConnection.connect(target.url, autocommit=True) as conn:
        await conn.execute(_COMMITS)
    relays = [target.relay() for _ in range(plan.replicas)]
    script = _pgbench_script(target, plan)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(script.unlink, missing_ok=True)
        for relay in relays:
            await stack.enter_async_context(relay)
        await wait_until_ready(target)
        arrivals = await stack.enter_async_context(
            Arrivals(target.nats_url, f"{target.prefix}.>", target.event_type)
        )
        producing = await asyncio.create_subprocess_exec(
            postgres_binary("pgbench"), "-n", "-c", str(plan.producers), "-j", "1",
            "-R", str(rate), "-T", str(round(WARMUP + plan.seconds + 1)), "-f", str(script),
            target.url, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stack.push_async_callback(_stopped, producing)
        await asyncio.sleep(WARMUP)
        measured_from = time.time()
        cpu_at = [sum(relay.cpu_seconds() for relay in relays)]
        times = [measured_from]
        counts_before = await _counts(target.server_url, target.database, reset=True)
        held_before = await _held_rows(relays)
        window = plan.window or plan.seconds
        until = measured_from + plan.seconds
        while (now := time.time()) < until - 0.05:
            await asyncio.sleep(min(window, until - now))
            cpu_at.append(sum(relay.cpu_seconds() for relay in relays))
            times.append(time.time())
        counts_after = await _counts(target.server_url, target.database)
        held = await _held_rows(relays) - held_before
        _, errors = await producing.communicate()
        if producing.returncode:
            raise RuntimeError(f"pgbench failed: {errors.decode(errors='replace')[-500:]}")
        committed = await _committed_ids(target)
        commits = await _commit_times(target)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ARRIVAL_TIMEOUT):
                while not committed <= arrivals.events.keys():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    elapsed = times[-1] - times[0]
    measured = arrivals.written_between(times[0], times[-1])
    events = len(measured)
    cpu = cpu_at[-1] - cpu_at[0]
    windows = [
        (cpu_at[i + 1] - cpu_at[i])
        / max(1, len(arrivals.written_between(times[i], times[i + 1])))
        * 1e6
        for i in range(len(cpu_at) - 1)
    ]
    latencies = [arrived - written for written, arrived in measured]
    from_commit = arrivals.from_commit(commits, times[0], times[-1])
    inserts = counts_after[2]
    transactions = counts_after[0] - counts_before[0] - inserts
    statements = counts_after[1] - inserts
    return SteadyRow(
        build=target.build,
        layout=target.layout,
        rate=rate,
        replicas=plan.replicas,
        committed_per_s=events / elapsed,
        cpu_percent=cpu / elapsed * 100,
        us_per_event=cpu / max(1, events) * 1e6,
        transactions_per_event=transactions / max(1, events),
        statements_per_event=statements / max(1, events),
        p50_ms=_percentile(latencies, 0.5) * 1000,
        p99_ms=_percentile(latencies, 0.99) * 1000,
        commit_p50_ms=_percentile(from_commit, 0.5) * 1000 if from_commit else None,
        commit_p99_ms=_percentile(from_commit, 0.99) * 1000 if from_commit else None,
        lost=len(committed - arrivals.events.keys()),
        held_per_event=held / max(1, events),
        windows_us_per_event=windows if plan.window else [],
        top_statements=[(calls / max(1, events), text) for calls, text in counts_after[3]],
    )


async def _held_rows(relays: Sequence[RelayProcess]) -> float:
    """Rows held for order so far, by all ``relays`` together."""
    held = await asyncio.gather(
        *(asyncio.to_thread(relay.metric, "outbox_relay_held_rows_total") for relay in relays)
    )
    return sum(held)


async def _stopped(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
        await process.wait()


async def _commit_times(target: Target) -> dict[str, float]:
    """Each producer transaction's commit time (epoch seconds) by event id; empty
    where the server keeps no commit times (a --database-url without
    track_commit_timestamp)."""
    async with await psycopg.AsyncConnection.connect(target.url, autocommit=True) as conn:
        try:
            cursor = await conn.execute(
                "select id::text, extract(epoch from pg_xact_commit_timestamp(xmin))::float8 "
                "from bench_commits"
            )
        except psycopg.Error:
            return {}
        return {row[0]: row[1] for row in await cursor.fetchall() if row[1] is not None}


async def _committed_ids(target: Target) -> set[str]:
    async with await psycopg.AsyncConnection.connect(target.url, autocommit=True) as conn:
        cursor = await conn.execute(
            "select id::text from outbox_events where event_type = %s", (target.event_type,)
        )
        return {row[0] for row in await cursor.fetchall()}


@contextlib.asynccontextmanager
async def _targets(
    database_url: str | None, nats_url: str | None, plan: SteadyPlan
) -> AsyncIterator[list[SteadyTarget]]:
    with contextlib.ExitStack() as servers:
        if database_url is None:
            database_url = servers.enter_context(
                throwaway_postgres(durable=True, settings=POSTGRES_SETTINGS)
            ).url
        if nats_url is None:
            nats_url = servers.enter_context(throwaway_nats()).url
        sources: list[str | None] = [None] if plan.compare is None else [plan.compare, None]
        layouts = (
            [None] if plan.partitions is None else [None, (plan.partitions, plan.partitions_ahead)]
        )
        targets = [
            SteadyTarget(database_url, nats_url, source, layout)
            for layout in layouts
            for source in sources
        ]
        async with await psycopg.AsyncConnection.connect(
            with_database(database_url, "postgres"), autocommit=True
        ) as conn:
            await conn.execute("create extension if not exists pg_stat_statements")
        try:
            for target in targets:
                await target.create()
            yield targets
        finally:
            for target in targets:
                await target.drop()


async def steady(
    database_url: str | None, nats_url: str | None, plan: SteadyPlan
) -> tuple[list[SteadyRow], dict[str, list[float]]]:
    """The rows, and the producers' commits/s by arrangement when asked for."""
    rows: list[SteadyRow] = []
    producers: dict[str, list[float]] = {}
    async with _targets(database_url, nats_url, plan) as targets:
        for rate in plan.rates:
            for target in targets:
                rows.append(await measure_rate(target, plan, rate))
                print(render_row(rows[-1], show_statements=True), file=sys.stderr, flush=True)
        if plan.producer_repetitions:
            producers = await producer_cost.measure(targets[-1].url, plan.producer_repetitions)
    return rows, producers


HEADER = (
    "| build | table | offered/s | committed/s | relays | relay CPU | CPU per event "
    "| DB transactions per event | statements per event | p50 | p99 "
    "| p50 from commit | p99 from commit | lost |\n"
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
    "| ---: | ---: | ---: |"
)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} ms"


def render_row(row: SteadyRow, *, show_statements: bool = False) -> str:
    line = (
        f"| {row.build} | {row.layout} | {row.rate:,.0f} | {row.committed_per_s:,.0f} "
        f"| {row.replicas} | {row.cpu_percent:.1f}% | {row.us_per_event:,.0f} µs "
        f"| {row.transactions_per_event:.2f} | {row.statements_per_event:.2f} "
        f"| {row.p50_ms:.2f} ms | {row.p99_ms:.2f} ms "
        f"| {_ms(row.commit_p50_ms)} | {_ms(row.commit_p99_ms)} | {row.lost} |"
    )
    if show_statements:
        line += "".join(f"\n    {per:6.3f} per event: {text}" for per, text in row.top_statements)
    if row.held_per_event:
        line += f"\n  rows held for order: {row.held_per_event * 1000:.1f} per 1,000 events"
    if row.windows_us_per_event:
        each = ", ".join(f"{w:,.0f}" for w in row.windows_us_per_event)
        line += f"\n  CPU per event by window (µs): {each}"
    return line


def render(rows: Sequence[SteadyRow]) -> str:
    """The table, then the ratios: this build against the other, table by table;
    each build's partitioned table against its plain one."""
    lines = [HEADER, *(render_row(row) for row in rows)]
    by_rate: dict[float, dict[tuple[str, str], SteadyRow]] = {}
    for row in rows:
        by_rate.setdefault(row.rate, {})[row.build, row.layout] = row
    for rate, found in by_rate.items():
        for (build, layout), row in found.items():
            if build != THIS_BUILD:
                mine = found.get((THIS_BUILD, layout))
                if mine is not None:
                    lines.append(
                        f"at {rate:,.0f}/s, {layout}: CPU per event "
                        f"{mine.us_per_event / row.us_per_event:.2f} of {build}'s"
                    )
            plain = found.get((build, "plain"))
            if layout != "plain" and plain is not None:
                cpu, p99 = row.us_per_event / plain.us_per_event, row.p99_ms / plain.p99_ms
                lines.append(
                    f"at {rate:,.0f}/s, {build}, {layout}: CPU per event {cpu:.2f}, "
                    f"p99 {p99:.2f} of the plain table's"
                )
    return "\n".join(lines)


def main(
    database_url: str | None, nats_url: str | None, plan: SteadyPlan, json_path: str | None
) -> int:
    rows, producers = asyncio.run(steady(database_url, nats_url, plan))
    print(render(rows))
    if producers:
        print("\nProducers, pgbench 8 clients, relay stopped, in turns:")
        print(producer_cost.render(producers))
    if json_path:
        with open(json_path, "w") as f:
            f.write(dumps({"rows": [asdict(row) for row in rows], "producers": producers}))
    return 0 if all(row.lost == 0 for row in rows) else 1
