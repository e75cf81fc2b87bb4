"""`outbox-relay bench --soak`: sustained load while something holds the vacuum
horizon back, and after it lets go.

Producers commit single-row transactions at a steady rate over many subjects; the
relay runs as operators run it (one or more replicas), with a short retention so
that it deletes rows too; a holder of one kind (:data:`HOLDERS`) holds the horizon
for the middle of the run. A holder that wrote an outbox row commits it at the end:
it must arrive then, before the row of its subject committed after it. Per
window of commit time: latency from commit to consumer (p50, p99, max), the table's
dead tuples and size, the backlog (committed, not yet arrived) and the relay's CPU.
The verdict: every window of the hold keeps its p99 within twice the p99 before it
(or under 40 ms, whichever is larger), the backlog never passes one second of load,
and every event arrives once, in order per subject.

With ``partitions`` (``bench --soak --partitions PERIOD``) the same soak runs twice,
on the plain table and on one partitioned by PERIOD (whose retention drops
partitions), and the two are compared: WAL bytes per event
(``pg_current_wal_lsn()``), rows deleted, autovacuum runs, the table's size after the
hold and p99 (:func:`layout_verdicts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import nats
import psycopg
from nats.aio.msg import Msg
from psycopg import sql

from relay.config import Config, parse_positive_duration
from relay.sqlfiles import Names, query
from relay_tools.bench.harness import (
    RelayProcess,
    Target,
    bench_target,
    dumps,
    provenance,
    wait_until_ready,
    with_database,
)
from relay_tools.bench.stats import percentile
from relay_tools.localservers import ThrowawayStandby, throwaway_postgres

INSERT = (
    "insert into outbox_events (id, event_type, source, subject, time, data) "
    "values (%s, %s, 'soak', %s, now(), %s)"
)

# What holds the horizon: a repeatable-read report; a writer idle in its
# transaction after writing another table; a writer that inserted an outbox row and
# commits at the end; the same as a prepared transaction; a report on a hot standby
# with hot_standby_feedback (the last two need the bench's throwaway Postgres).
HOLDERS = ("report", "writer", "outbox-writer", "prepared", "standby")
THROWAWAY_ONLY = ("prepared", "standby")
HELD_SUBJECT = "held"
HOLDER_TEXT = {
    "report": "a repeatable-read report",
    "writer": "a writer idle in its transaction (another table)",
    "outbox-writer": "a writer of an outbox row, committing at the end",
    "prepared": "a prepared transaction that wrote an outbox row, committed at the end",
    "standby": "a report on a hot standby with hot_standby_feedback",
}

# The targets, as ratios and bounds measured in the same run.
P99_RATIO = 2.0
P99_FLOOR_MS = 40.0
BACKLOG_SECONDS = 1.0
# A partitioned table against the plain one, in one run: WAL per event at most this
# share of the plain table's; the size at the end at most this share of the size
# before the hold (the bloat gone with its partitions); p99 within this share of
# the plain table's (an allowance for the noise between two runs).
WAL_RATIO = 0.75
SIZE_AFTER_RATIO = 1.25
P99_LAYOUT_RATIO = 1.10

# The table's WAL, deletes and autovacuum runs so far, partitions summed (dropped
# partitions' statistics go with them: retention deletes nothing there anyway).
TABLE_COUNTERS = """
select pg_current_wal_lsn() - '0/0',
       coalesce(sum(n_tup_del), 0), coalesce(sum(autovacuum_count), 0)
  from pg_stat_user_tables
 where relid in (select 'outbox_events'::regclass
                 union select relid from pg_partition_tree('outbox_events'))
"""


@dataclass(frozen=True)
class SoakPlan:
    rate: float = 1500.0
    subjects: int = 500
    producers: int = 4
    before: float = 90.0
    hold: float = 300.0
    after: float = 90.0
    window: float = 30.0
    retention: str = "20s"
    retention_interval: str = "5s"
    holder: str = "report"
    replicas: int = 1
    # Seconds a partition, to compare a partitioned table with the plain one (None:
    # the plain table only); and how far ahead its relays keep partitions.
    partitions: float | None = None
    partitions_ahead: str = "5min"
    layout: str = "plain"
    # Also the plain table's soak with every claim walking from the claim index's first
    # entry (the claim before the start key), for the chart of the two; and whether
    # this run is that one (its late-row trigger fires on replicas only, which turns the
    # claim's guard off: relay/claimstart.py).
    without_start_key: bool = False
    start_key: bool = True
    # postgresql.conf lines of the throwaway Postgres (not applied to --database-url).
    server_settings: tuple[str, ...] = ()

    def for_layouts(self, period: float) -> SoakPlan:
        """The plan that compares the plain table with one partitioned by ``period``.
        Its retention outlives checkpoints, as a retention of days does checkpoints
        minutes apart: a delete then writes a full page image of a page no other
        write touched since the last checkpoint, and so may WAL-log it anew. Long
        enough before the hold for the size to settle (a partition filled and an
        expired one dropped), and after it for the hold's partitions to go."""
        retention = 90.0  # three checkpoints of Postgres's shortest interval, 30 s
        settle = period + retention + 60.0
        return replace(
            self,
            partitions=period,
            retention=f"{retention:g}s",
            server_settings=(*self.server_settings, "checkpoint_timeout = 30s"),
            before=max(self.before, settle),
            after=max(self.after, settle + 60.0),
        )

    @classmethod
    def quick(cls) -> SoakPlan:
        return cls(rate=300.0, subjects=50, before=4.0, hold=8.0, after=4.0, window=2.0)

    @property
    def seconds(self) -> float:
        return self.before + self.hold + self.after


@dataclass
class Window:
    start: float  # seconds into the run
    held: bool
    events: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    dead_tuples: int = 0  # the most seen in the window
    table_mb: float = 0.0  # at the window's end
    backlog: int = 0  # the most committed-not-arrived seen in the window
    relay_cpu: float = 0.0  # share of one core


@dataclass
class SoakReport:
    plan: SoakPlan
    windows: list[Window]
    committed: int
    arrived: int
    lost: int
    inversions: int
    drained_after_release: float | None  # seconds from the release to an empty backlog
    # The held outbox row (outbox-writer, prepared): from its commit to its arrival.
    held_row_ms: float | None = None
    verdicts: list[tuple[str, bool]] = field(default_factory=list)
    wal_bytes: int = 0
    rows_deleted: int = 0
    autovacuum_runs: int = 0
    p99_ms: float = 0.0  # over every event of the run


@dataclass
class _Run:
    started: float
    committed: dict[str, tuple[float, str, int]] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)
    last_seq: dict[str, int] = field(default_factory=dict)
    inversions: int = 0
    samples: list[tuple[float, int, int, int, float]] = field(default_factory=list)


async def _produce(target: Target, plan: SoakPlan, run: _Run, index: int) -> None:
    """One producer: its own subjects (so its commit order is their created_at order),
    at rate / producers, each event's commit time noted."""
    per_producer = plan.rate / plan.producers
    subjects = [f"s{k}" for k in range(index, plan.subjects, plan.producers)]
    seq = dict.fromkeys(subjects, 0)
    async with await psycopg.AsyncConnection.connect(target.url, autocommit=True) as conn:
        start = run.started + index / plan.rate
        n = 0
        while (due := start + n / per_producer) - run.started < plan.seconds:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            subject = subjects[n % len(subjects)]
            seq[subject] += 1
            event_id = str(uuid.uuid4())
            data = json.dumps({"seq": seq[subject]})
            run.committed[event_id] = (time.perf_counter(), subject, seq[subject])
            await conn.execute(INSERT, (event_id, target.event_type, subject, data))
            n += 1


def _on_message(run: _Run) -> Callable[[Msg], Awaitable[None]]:
    async def on_message(msg: Msg) -> None:
        event_id = (msg.headers or {}).get("Nats-Msg-Id", "")
        if event_id in run.arrived or event_id not in run.committed:
            return  # a duplicate (the first arrival counts), or the readiness probe
        run.arrived[event_id] = time.perf_counter()
        envelope = json.loads(msg.data)
        subject, seq = envelope["subject"], envelope["data"]["seq"]
        if seq < run.last_seq.get(subject, 0):
            run.inversions += 1
        run.last_seq[subject] = max(seq, run.last_seq.get(subject, 0))

    return on_message


async def _sample(
    target: Target, relays: list[RelayProcess], run: _Run, stop: asyncio.Event
) -> None:
    """Once a second: the table's dead tuples and size, the backlog, the relays' CPU."""
    health = query(Names.for_config(Config()), "table_health")
    async with await psycopg.AsyncConnection.connect(target.url, autocommit=True) as conn:
        while not stop.is_set():
            cursor = await conn.execute(health, {"table": "outbox_events"})
            row = await cursor.fetchone()
            assert row is not None
            backlog = len(run.committed) - len(run.arrived)
            now = time.perf_counter() - run.started
            cpu = sum(relay.cpu_seconds() for relay in relays)
            run.samples.append((now, int(row[0]), int(row[1]), backlog, cpu))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


async def _insert_held(
    conn: psycopg.AsyncConnection[Any], target: Target, run: _Run, seq: int
) -> str:
    """A row of the held subject, counted as committed now (it may arrive as soon as
    its transaction commits, before this returns)."""
    event_id = str(uuid.uuid4())
    run.committed[event_id] = (time.perf_counter(), HELD_SUBJECT, seq)
    await conn.execute(
        INSERT, (event_id, target.event_type, HELD_SUBJECT, json.dumps({"seq": seq}))
    )
    return event_id


async def _hold(target: Target, plan: SoakPlan, run: _Run, standby_url: str | None) -> None:
    """``plan.holder`` holds the horizon for ``plan.hold``, then lets go."""
    await asyncio.sleep(max(0.0, run.started + plan.before - time.perf_counter()))
    url = standby_url if plan.holder == "standby" else target.url
    assert url is not None
    release = run.started + plan.before + plan.hold
    async with await psycopg.AsyncConnection.connect(
        url, application_name=f"soak-{plan.holder}"
    ) as conn:
        if plan.holder in ("report", "standby"):
            await conn.execute("set transaction isolation level repeatable read")
            await (await conn.execute("select count(*) from outbox_events")).fetchall()
        elif plan.holder == "writer":
            await conn.execute("create table if not exists soak_elsewhere (i int)")
            await conn.commit()
            await conn.execute("insert into soak_elsewhere values (1)")
        else:
            held = await _insert_held(conn, target, run, 1)
            if plan.holder == "prepared":
                await conn.execute("prepare transaction 'soak-held'")
        await asyncio.sleep(max(0.0, release - time.perf_counter()))
        if plan.holder in ("outbox-writer", "prepared"):
            # Committed from here: its latency counts from the commit.
            run.committed[held] = (time.perf_counter(), HELD_SUBJECT, 1)
            if plan.holder == "prepared":
                await conn.set_autocommit(True)
                await conn.execute("commit prepared 'soak-held'")
            else:
                await conn.commit()
                await conn.set_autocommit(True)
            await _insert_held(conn, target, run, 2)
        else:
            await conn.rollback()


def _windows(plan: SoakPlan, run: _Run) -> list[Window]:
    windows = []
    count = round(plan.seconds / plan.window)
    for i in range(count):
        start, end = i * plan.window, (i + 1) * plan.window
        held = start >= plan.before and end <= plan.before + plan.hold
        latencies = [
            run.arrived[event_id] - at
            for event_id, (at, _, _) in run.committed.items()
            if event_id in run.arrived and start <= at - run.started < end
        ]
        window = Window(start, held, len(latencies))
        if latencies:
            window.p50_ms = percentile(latencies, 0.5) * 1000
            window.p99_ms = percentile(latencies, 0.99) * 1000
            window.max_ms = max(latencies) * 1000
        samples = [s for s in run.samples if start <= s[0] < end]
        if samples:
            window.dead_tuples = max(s[1] for s in samples)
            window.table_mb = samples[-1][2] / 1e6
            window.backlog = max(s[3] for s in samples)
            span = samples[-1][0] - samples[0][0]
            if span > 0:
                window.relay_cpu = (samples[-1][4] - samples[0][4]) / span
        windows.append(window)
    return windows


def _drained_after_release(plan: SoakPlan, run: _Run) -> float | None:
    release = plan.before + plan.hold
    for at, _, _, backlog, _ in run.samples:
        if at >= release and backlog <= plan.rate * BACKLOG_SECONDS:
            return max(0.0, at - release)
    return None


def _held_row_ms(run: _Run) -> float | None:
    held = [
        (seq, run.arrived[event_id] - at)
        for event_id, (at, subject, seq) in run.committed.items()
        if subject == HELD_SUBJECT and event_id in run.arrived
    ]
    return next((seconds * 1000 for seq, seconds in held if seq == 1), None)


def verdicts(report: SoakReport) -> list[tuple[str, bool]]:
    plan = report.plan
    before = [w for w in report.windows if w.start + plan.window <= plan.before and w.start > 0]
    held = [w for w in report.windows if w.held]
    baseline = max((w.p99_ms for w in before), default=0.0)
    allowed = max(P99_RATIO * baseline, P99_FLOOR_MS)
    worst = max((w.p99_ms for w in held), default=0.0)
    backlog = max((w.backlog for w in report.windows), default=0)
    return [
        (
            f"p99 in every window of the hold {worst:.1f} ms <= {allowed:.1f} ms "
            f"(the larger of {P99_RATIO:g} x {baseline:.1f} ms before it and {P99_FLOOR_MS:g} ms)",
            worst <= allowed,
        ),
        (
            f"backlog at most {backlog} rows <= one second of load ({plan.rate:g})",
            backlog <= plan.rate * BACKLOG_SECONDS,
        ),
        (f"lost {report.lost} == 0", report.lost == 0),
        (f"per-subject order inversions {report.inversions} == 0", report.inversions == 0),
    ]


async def _table_counters(target: Target) -> tuple[int, int, int]:
    async with await psycopg.AsyncConnection.connect(target.url, autocommit=True) as conn:
        row = await (await conn.execute(TABLE_COUNTERS)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


async def soak(target: Target, plan: SoakPlan, standby_url: str | None = None) -> SoakReport:
    settings = {"retention": plan.retention, "retention_interval": plan.retention_interval}
    if plan.layout == "partitioned":
        assert plan.partitions is not None
        settings["partitions_ahead"] = plan.partitions_ahead
    relays = [RelayProcess(target.url, target.nats_url, **settings) for _ in range(plan.replicas)]
    counters = await _table_counters(target)
    run = _Run(started=0.0)
    nc = await nats.connect(target.nats_url)
    stop = asyncio.Event()
    try:
        await nc.subscribe(f"{target.prefix}.>", cb=_on_message(run), pending_msgs_limit=10_000_000)
        await nc.flush()
        async with contextlib.AsyncExitStack() as stack:
            for relay in relays:
                await stack.enter_async_context(relay)
            await wait_until_ready(target)
            run.started = time.perf_counter()
            sampler = asyncio.create_task(_sample(target, relays, run, stop))
            await asyncio.gather(
                _hold(target, plan, run, standby_url),
                *(_produce(target, plan, run, i) for i in range(plan.producers)),
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(120):
                    while not run.committed.keys() <= run.arrived.keys():  # noqa: ASYNC110 - a callback fills it
                        await asyncio.sleep(0.05)
            stop.set()
            await sampler
    finally:
        await nc.close()
    wal, deleted, autovacuums = (
        after - before
        for after, before in zip(await _table_counters(target), counters, strict=True)
    )
    lost = len(set(run.committed) - set(run.arrived))
    report = SoakReport(
        plan,
        _windows(plan, run),
        len(run.committed),
        len(run.arrived),
        lost,
        run.inversions,
        _drained_after_release(plan, run),
        _held_row_ms(run),
        wal_bytes=wal,
        rows_deleted=deleted,
        autovacuum_runs=autovacuums,
        p99_ms=percentile(
            [run.arrived[i] - at for i, (at, _, _) in run.committed.items() if i in run.arrived],
            0.99,
        )
        * 1000,
    )
    report.verdicts = verdicts(report)
    return report


def table_sizes(report: SoakReport) -> tuple[float, float]:
    """The table's largest size before the hold, and over the run's last minute and
    a half: a partitioned table's size is a saw (a partition fills, an expired one
    goes), so its teeth are compared."""
    plan = report.plan
    before = [w.table_mb for w in report.windows if w.start + plan.window <= plan.before]
    last = [w.table_mb for w in report.windows if w.start >= plan.seconds - 90.0]
    return max(before, default=0.0), max(last, default=0.0)


def layout_verdicts(plain: SoakReport, partitioned: SoakReport) -> list[tuple[str, bool]]:
    """The partitioned table against the plain one, run in turns."""
    wal = [r.wal_bytes / max(r.committed, 1) for r in (plain, partitioned)]
    p99 = [r.p99_ms for r in (plain, partitioned)]
    before, after = table_sizes(partitioned)
    return [
        (f"partitioned: retention deleted {partitioned.rows_deleted} rows == 0",
         partitioned.rows_deleted == 0),
        (f"WAL per event {wal[1]:,.0f} B <= {WAL_RATIO:g} x the plain table's {wal[0]:,.0f} B",
         wal[1] <= WAL_RATIO * wal[0]),
        (f"partitioned: table at most {after:.1f} MB in the last 90 s <= {SIZE_AFTER_RATIO:g} x "
         f"{before:.1f} MB before the hold", after <= SIZE_AFTER_RATIO * before),
        (f"p99 over the run {p99[1]:.1f} ms <= {P99_LAYOUT_RATIO:g} x the plain table's "
         f"{p99[0]:.1f} ms", p99[1] <= P99_LAYOUT_RATIO * p99[0]),
    ]  # fmt: skip


def render(report: SoakReport) -> str:
    plan = report.plan
    layout = (
        f"a table partitioned by {plan.partitions:g} s, {plan.partitions_ahead} ahead"
        if plan.layout == "partitioned"
        else "the plain table"
    )
    lines = [
        f"soak on {layout}: {plan.rate:g} events/s over {plan.subjects} subjects for "
        f"{plan.seconds:g} s, "
        f"{plan.replicas} relay{'s' if plan.replicas > 1 else ''}; the horizon held by "
        f"{HOLDER_TEXT[plan.holder]} from {plan.before:g} s to {plan.before + plan.hold:g} s; "
        f"retention {plan.retention} every {plan.retention_interval}"
        + (f"; Postgres with {', '.join(plan.server_settings)}" if plan.server_settings else ""),
        "",
        f"{'window':>11}  {'held':4}  {'events':>6}  {'p50 ms':>7}  {'p99 ms':>7}  "
        f"{'max ms':>7}  {'dead tuples':>11}  {'table MB':>8}  {'backlog':>7}  {'relay CPU':>9}",
    ]
    for w in report.windows:
        lines.append(
            f"{_clock(w.start)}-{_clock(w.start + plan.window)}  {'yes' if w.held else 'no':4}  "
            f"{w.events:>6}  {w.p50_ms:>7.1f}  {w.p99_ms:>7.1f}  {w.max_ms:>7.1f}  "
            f"{w.dead_tuples:>11}  {w.table_mb:>8.1f}  {w.backlog:>7}  {w.relay_cpu:>8.0%}"
        )
    drained = report.drained_after_release
    lines += [
        "",
        f"committed {report.committed}, arrived {report.arrived}, lost {report.lost}, "
        f"order inversions {report.inversions}; backlog under one second of load "
        + (f"{drained:.0f} s after the release" if drained is not None else "never after release"),
        *(
            [
                f"the held outbox row arrived {report.held_row_ms:.1f} ms after its commit, "
                "before the next row of its subject (or the inversions count it)"
            ]
            if report.held_row_ms is not None
            else []
        ),
        f"p99 over the run {report.p99_ms:.1f} ms; table at most "
        f"{table_sizes(report)[0]:.1f} MB before the hold, {table_sizes(report)[1]:.1f} MB "
        "in the last 90 s",
        f"WAL {report.wal_bytes / max(report.committed, 1):,.0f} bytes per event; "
        f"rows deleted {report.rows_deleted}; autovacuum runs {report.autovacuum_runs} "
        "(on the tables left at the end)",
        "",
        "targets:",
        *(f"  {'met' if ok else 'NOT MET'}: {text}" for text, ok in report.verdicts),
    ]
    return "\n".join(lines) + "\n"


def render_layouts(plain: SoakReport, partitioned: SoakReport) -> str:
    lines = ["partitioned against plain, in turns on one machine:"]
    lines += [f"  {'met' if ok else 'NOT MET'}: {text}" for text, ok in
              layout_verdicts(plain, partitioned)]  # fmt: skip
    return "\n".join(lines) + "\n"


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


async def _main(database_url: str | None, nats_url: str | None, plan: SoakPlan) -> SoakReport:
    with contextlib.ExitStack() as servers:
        primary = None
        if plan.holder in THROWAWAY_ONLY:
            if database_url is not None:
                raise SystemExit(f"bench --soak --holder {plan.holder} runs on a throwaway "
                                 "Postgres only: leave out --database-url")  # fmt: skip
            primary = servers.enter_context(
                throwaway_postgres(durable=True, settings=["max_prepared_transactions = 4"])
            )
            database_url = primary.url
        async with bench_target(database_url, nats_url, plan.server_settings) as target:
            if plan.layout == "partitioned":
                assert plan.partitions is not None
                ahead = parse_positive_duration(plan.partitions_ahead)
                await target.install_partitioned(plan.partitions, ahead)
            if not plan.start_key:
                await _turn_the_guard_off(target)
            standby_url = None
            if plan.holder == "standby":
                assert primary is not None
                standby = ThrowawayStandby(primary, settings=["hot_standby_feedback = on"])
                servers.callback(standby.destroy)
                standby.start()
                standby_url = with_database(standby.url, target.database)
            return await soak(target, plan, standby_url)


async def _turn_the_guard_off(target: Target) -> None:
    """Make every claim walk from the claim index's first entry, as claims did before
    the start key: the late-row trigger fires on replicas only, so the claim's guard
    cannot trust the start key (the relay warns once, and says how to mend it)."""
    names = Names.for_config(Config())
    statement = sql.SQL("alter table {} enable replica trigger {}").format(
        names.table, names.late_trigger
    )
    async with await psycopg.AsyncConnection.connect(target.url, autocommit=True) as conn:
        await conn.execute(statement)


def main(
    database_url: str | None,
    nats_url: str | None,
    plan: SoakPlan,
    json_path: str | None,
) -> int:
    layouts = ["plain", "partitioned"] if plan.partitions is not None else ["plain"]
    run = provenance()  # the build measured is the one checked out when the run began
    reports = []
    for layout in layouts:
        with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
            report = runner.run(_main(database_url, nats_url, replace(plan, layout=layout)))
        print(render(report))
        reports.append(report)
    verdicts_met = all(ok for report in reports for _, ok in report.verdicts)
    if len(reports) == 2:
        print(render_layouts(*reports), end="")
        verdicts_met = verdicts_met and all(ok for _, ok in layout_verdicts(*reports))
    without_key = None
    if plan.without_start_key:
        # A comparison, not a target: its verdicts are printed, not the run's outcome.
        print("again, every claim walking from the claim index's first entry:\n")
        with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
            without_key = runner.run(
                _main(database_url, nats_url, replace(plan, layout="plain", start_key=False))
            )
        print(render(without_key))
    if json_path:
        # The run, the plain table's soak as ever (the charts read it), the others inside.
        plain, *partitioned = (_figures(r) for r in reports)
        with open(json_path, "w", encoding="utf-8") as out:
            document = {"run": run, **plain}
            if partitioned:
                document["partitioned"] = partitioned[0]
            if without_key is not None:
                document["without_start_key"] = _figures(without_key)
            out.write(dumps(document))
            out.write("\n")
    return 0 if verdicts_met else 1


def _figures(report: SoakReport) -> dict[str, Any]:
    return {**asdict(report), "plan": asdict(report.plan)}
