"""Runs every measurement in one go and reports them against the targets."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from relay.sqlfiles import IDLE_LOCK_CLASS
from relay_tools.bench import measure
from relay_tools.bench.harness import (
    RelayProcess,
    Target,
    bench_target,
    dumps,
    provenance,
    wait_until_ready,
)
from relay_tools.bench.stats import Figure, percentile


@dataclass(frozen=True)
class Plan:
    """How big each measurement is; --quick shrinks everything to seconds."""

    repetitions: int = 3
    floor_samples: int = 300
    floor_rows: int = 50_000
    latency_seconds: float = 5.0
    drain_rows: int = 100_000
    # Rows at the cap ahead of the dead-rows shape's backlog (an incident's leftovers).
    dead_ahead_rows: int = 20_000
    # Relays sharing the table in the replicas shape.
    replicas: int = 3
    memory_rows: int = 1_000_000
    plain_drain_rows: int = 10_000
    cost_seconds: float = 5.0
    # The LISTEN keepalive of the relay frozen asleep: the default, as operators run it.
    frozen_keepalive: float = 10.0
    # Rows a claim walks past (waiting on the broker, or held behind dead rows), ahead
    # of a backlog of claim_walk_backlog rows.
    claim_walk_rows: int = 50_000
    claim_walk_backlog: int = 10_000

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            repetitions=1,
            floor_samples=30,
            floor_rows=2_000,
            latency_seconds=1.0,
            drain_rows=3_000,
            dead_ahead_rows=600,
            replicas=3,
            memory_rows=5_000,
            plain_drain_rows=500,
            cost_seconds=1.0,
            frozen_keepalive=1.0,
            claim_walk_rows=2_000,
            claim_walk_backlog=1_000,
        )


@dataclass
class Report:
    figures: dict[str, Figure] = field(default_factory=dict)

    def add(self, key: str, name: str, unit: str, values: list[float]) -> Figure:
        self.figures[key] = Figure(name, unit, tuple(values))
        return self.figures[key]

    def get(self, key: str) -> float:
        return self.figures[key].median


class Progress:
    """One line on stderr that says what runs now."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._done = 0
        self._started = time.perf_counter()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self._done += 1
        elapsed = time.perf_counter() - self._started
        sys.stderr.write(f"\r\033[K[{self._done}/{self._total}] {what} ({elapsed:.0f}s)")
        sys.stderr.flush()
        yield

    def finish(self) -> None:
        sys.stderr.write(f"\r\033[Kdone in {time.perf_counter() - self._started:.0f}s\n")


async def _repeat(
    plan: Plan, progress: Progress, what: str, fn: Callable[[], Awaitable[float]], reset: Target
) -> list[float]:
    values = []
    for rep in range(plan.repetitions):
        with progress.step(f"{what} ({rep + 1}/{plan.repetitions})"):
            await reset.reset()
            values.append(await fn())
    return values


async def _latency(
    plan: Plan, progress: Progress, report: Report, target: Target, *, rate: float, plain: bool
) -> None:
    who = "plain" if plain else "relay"
    p50, p99, worst = [], [], []
    for rep in range(plan.repetitions):
        with progress.step(
            f"{who} end-to-end latency at {rate:g}/s ({rep + 1}/{plan.repetitions})"
        ):
            await target.reset()
            samples = await measure.end_to_end(target, rate, plan.latency_seconds, plain=plain)
            p50.append(percentile(samples, 0.5) * 1000)
            p99.append(percentile(samples, 0.99) * 1000)
            worst.append(max(samples) * 1000)
    label = "plain poller" if plain else "relay"
    report.add(
        f"{who}_latency_{rate:g}_p50", f"{label}: commit to consumer at {rate:g}/s, p50", "ms", p50
    )
    report.add(
        f"{who}_latency_{rate:g}_p99", f"{label}: commit to consumer at {rate:g}/s, p99", "ms", p99
    )
    report.add(
        f"{who}_latency_{rate:g}_max",
        f"{label}: commit to consumer at {rate:g}/s, max",
        "ms",
        worst,
    )


async def _drains(plan: Plan, progress: Progress, report: Report, target: Target) -> None:
    """The same backlog in each shape, the shapes interleaved in every repetition so
    each ratio compares runs minutes apart at most (this machine's speed drifts)."""
    rows = plan.drain_rows
    shapes = {
        "drain_rate": (
            f"relay: drain {rows:,} rows, a transaction each",
            measure.Shape(),
        ),
        "drain_bulk_rate": (
            f"relay: drain {rows:,} rows of one transaction",
            measure.Shape(one_transaction=True),
        ),
        "drain_dead_ahead_rate": (
            f"relay: drain {rows:,} rows behind {plan.dead_ahead_rows:,} dead",
            measure.Shape(dead_ahead=plan.dead_ahead_rows),
        ),
        "drain_replicas_rate": (
            f"{plan.replicas} relays: drain {rows:,} rows",
            measure.Shape(replicas=plan.replicas),
        ),
    }
    results: dict[str, list[float]] = {key: [] for key in shapes}
    for rep in range(plan.repetitions):
        for key, (name, shape) in shapes.items():
            with progress.step(f"{name} ({rep + 1}/{plan.repetitions})"):
                await target.reset()
                results[key].append(await measure.drain_rate(target, rows, shape=shape))
    for key, (name, _) in shapes.items():
        report.add(key, name, "rows/s", results[key])
    for key, what in (
        ("drain_bulk", "one transaction"),
        ("drain_dead_ahead", "dead rows ahead"),
        ("drain_replicas", f"{plan.replicas} relays"),
    ):
        report.add(
            f"{key}_ratio",
            f"drain ratio, {what} / a transaction each",
            "ratio",
            [
                shaped / plain
                for shaped, plain in zip(results[f"{key}_rate"], results["drain_rate"], strict=True)
            ],
        )


PUBLISH_MODES = ("message", "batch", "atomic")


async def _publish_modes(plan: Plan, progress: Progress, report: Report, target: Target) -> None:
    """The drain and the relay's CPU per row in each --publish-mode, into a stream
    that allows batches; then the latency at 1,000/s with fast batches."""
    await target.allow_batches(True)
    try:
        for mode in PUBLISH_MODES:
            drains = []
            for rep in range(plan.repetitions):
                with progress.step(f"drain, --publish-mode {mode} ({rep + 1}/{plan.repetitions})"):
                    await target.reset()
                    drains.append(await measure.drain_in_mode(target, plan.drain_rows, mode))
            report.add(
                f"drain_mode_{mode}_rate",
                f"relay: drain {plan.drain_rows:,} rows, --publish-mode {mode}",
                "rows/s",
                [d.rate for d in drains],
            )
            report.add(
                f"cpu_mode_{mode}",
                f"relay: CPU per row, --publish-mode {mode}",
                "us",
                [d.relay_us_per_row for d in drains],
            )
            report.add(
                f"machine_cpu_mode_{mode}",
                f"machine: CPU per row, every process, --publish-mode {mode}",
                "us",
                [d.machine_us_per_row for d in drains],
            )
            if mode == "batch":
                # What the drain would reach with every core busy at its CPU per row:
                # the relay, Postgres and NATS share these cores (docs/performance.md).
                cores = os.cpu_count() or 1
                report.add(
                    "ceiling_mode_batch",
                    f"ceiling: --publish-mode batch with all {cores} cores busy",
                    "rows/s",
                    [cores * 1e6 / d.machine_us_per_row for d in drains],
                )
        p99 = []
        for rep in range(plan.repetitions):
            with progress.step(
                f"relay end-to-end latency at 1000/s, batches ({rep + 1}/{plan.repetitions})"
            ):
                await target.reset()
                samples = await measure.end_to_end(
                    target, 1000.0, plan.latency_seconds, settings={"publish_mode": "batch"}
                )
                p99.append(percentile(samples, 0.99) * 1000)
        report.add(
            "relay_latency_batch_1000_p99",
            "relay: commit to consumer at 1000/s, p99, --publish-mode batch",
            "ms",
            p99,
        )
    finally:
        await target.allow_batches(False)


async def _claim_walk(plan: Plan, progress: Progress, report: Report, target: Target) -> None:
    """What rows the claim cannot take but walks past cost it: rows of a subject no
    stream captures (each waiting out its retry), and rows held behind dead rows."""
    rows = plan.claim_walk_rows
    shapes = {
        "claim_clear": ("claim of 500 rows, nothing ahead", None),
        "claim_behind_waiting": (
            f"claim of 500 rows behind {rows:,} waiting on the broker",
            target.add_waiting,
        ),
        "claim_behind_held": (
            f"claim of 500 rows behind {rows:,} held by 100 dead rows",
            target.add_held,
        ),
    }
    for key, (name, add) in shapes.items():
        values = []
        for rep in range(plan.repetitions):
            with progress.step(f"{name} ({rep + 1}/{plan.repetitions})"):
                await target.reset()
                if add is not None:
                    await add(rows)
                await target.fill(plan.claim_walk_backlog)
                values.append(await measure.claim_time(target))
        report.add(key, name, "ms", values)


async def _index_cost(plan: Plan, progress: Progress, report: Report, target: Target) -> None:
    """What producers pay for the relay's columns and indexes, without its trigger:
    the contract's table alone (everything of the relay's uninstalled) against the
    relay's install with its trigger dropped. No relay runs, so neither side shares
    the CPU with one."""
    results: dict[str, list[float]] = {"contract": [], "relay": []}
    for rep in range(plan.repetitions):
        for arm in ("contract", "relay"):
            with progress.step(
                f"producer commits/s, {arm} table, no trigger ({rep + 1}/{plan.repetitions})"
            ):
                await target.execute("truncate outbox_events")
                if arm == "contract":
                    await target.uninstall()
                else:
                    await target.install()
                    await target.drop_notify_trigger()
                results[arm].append(await measure.producer_commits(target, plan.cost_seconds))
    await target.install()
    report.add(
        "commits_contract_table",
        "producers, 8 writers, the contract's table alone",
        "commits/s",
        results["contract"],
    )
    report.add(
        "commits_relay_indexes",
        "producers, 8 writers, relay's columns and indexes",
        "commits/s",
        results["relay"],
    )
    report.add(
        "producer_index_ratio",
        "producer cost ratio, relay's columns and indexes / none",
        "ratio",
        [r / c for r, c in zip(results["relay"], results["contract"], strict=True)],
    )


async def _producer_cost(plan: Plan, progress: Progress, report: Report, target: Target) -> None:
    results: dict[str, list[float]] = {"none": [], "relay": [], "plain": []}
    async with RelayProcess(target.url, target.nats_url):
        await wait_until_ready(target)
        for rep in range(plan.repetitions):
            for trigger in ("none", "relay", "plain"):
                with progress.step(
                    f"producer commits/s, {trigger} trigger ({rep + 1}/{plan.repetitions})"
                ):
                    await target.drop_notify_trigger()
                    if trigger == "relay":
                        await target.install()
                    elif trigger == "plain":
                        await target.execute(measure.PLAIN_NOTIFY_TRIGGER)
                    results[trigger].append(
                        await measure.producer_commits(target, plan.cost_seconds)
                    )
    # Leave the relay's trigger in place (the plain one must go first).
    await target.drop_notify_trigger()
    await target.install()
    report.add(
        "commits_no_trigger", "producers, 8 writers, no trigger", "commits/s", results["none"]
    )
    report.add(
        "commits_relay_trigger",
        "producers, 8 writers, relay's trigger",
        "commits/s",
        results["relay"],
    )
    report.add(
        "commits_plain_trigger",
        "producers, 8 writers, plain pg_notify trigger",
        "commits/s",
        results["plain"],
    )
    report.add(
        "producer_cost_ratio",
        "producer cost ratio, relay's trigger / none",
        "ratio",
        [r / n for r, n in zip(results["relay"], results["none"], strict=True)],
    )
    report.add(
        "plain_trigger_ratio",
        "producer cost ratio, plain pg_notify / none",
        "ratio",
        [p / n for p, n in zip(results["plain"], results["none"], strict=True)],
    )


SLEEP_LOCK_HELD = f"""
select count(*) from pg_locks l join pg_stat_activity a on a.pid = l.pid
 where l.locktype = 'advisory' and l.classid = {IDLE_LOCK_CLASS} and l.mode = 'ExclusiveLock'
   and l.granted and a.application_name = 'outbox-relay listen' and a.datname = current_database()
"""

# A freeze must stop taxing producers within this long (the outage issue's target).
FROZEN_RECOVERY_LIMIT = 75.0
# A drain with fast batches must reach this multiple of the per-message publish floor
# (the batch-publishing issue's target); the verdict and the context line share it.
FAST_BATCH_TARGET = 1.2


async def _frozen_relay(plan: Plan, progress: Progress, report: Report, target: Target) -> None:
    """Producers beside a relay frozen (SIGSTOP) while it holds the sleep lock: what
    they pay while its session lives, how soon the server ends it, and what they
    pay after; each against producers with no trigger at all beside the same frozen
    relay (a live relay's draining would compete with them for the CPU)."""
    relay = RelayProcess(
        target.url,
        target.nats_url,
        listen_keepalive=f"{plan.frozen_keepalive:g}s",
        poll_interval="1h",
    )
    with progress.step("producer commits/s beside a relay frozen asleep"):
        async with relay:
            await wait_until_ready(target)
            async with asyncio.timeout(60):
                while await target.fetch_value(SLEEP_LOCK_HELD) == 0:  # noqa: ASYNC110 - a database condition, no event to wait on
                    await asyncio.sleep(0.05)
            assert relay.process is not None
            relay.process.send_signal(signal.SIGSTOP)
            frozen_at = time.perf_counter()
            try:
                while_held = await measure.producer_commits(target, plan.cost_seconds)
                async with asyncio.timeout(FROZEN_RECOVERY_LIMIT * 2):
                    while await target.fetch_value(SLEEP_LOCK_HELD) != 0:  # noqa: ASYNC110 - as above
                        await asyncio.sleep(0.1)
                ended_after = time.perf_counter() - frozen_at
                after = await measure.producer_commits(target, plan.cost_seconds)
                recovered_after = time.perf_counter() - frozen_at
                await target.drop_notify_trigger()
                none = await measure.producer_commits(target, plan.cost_seconds)
                await target.install()
            finally:
                relay.process.send_signal(signal.SIGCONT)
    report.add(
        "frozen_session_ended",
        "relay frozen asleep: server ends its session after",
        "s",
        [ended_after],
    )
    report.add(
        "frozen_ratio_held",
        "producer cost ratio, relay frozen asleep, lock held",
        "ratio",
        [while_held / none],
    )
    report.add(
        "frozen_ratio_after",
        "producer cost ratio, relay frozen asleep, session ended",
        "ratio",
        [after / none],
    )
    report.add(
        "frozen_recovered_after",
        "relay frozen asleep: producers measured back by",
        "s",
        [recovered_after],
    )


async def run_all(target: Target, plan: Plan) -> Report:
    report = Report()
    progress = Progress(total=plan.repetitions * 30 + 2)

    for key, name, what, measurement in (
        ("wake_floor", "floor: LISTEN wake-up, commit to listener", "LISTEN wake-up floor",
         measure.wake_floor),
        # Not a target's floor: what a producer's commit (which writes a row, so waits
        # for the WAL flush) adds to the bare notify above, for reading the latencies.
        ("wake_row_floor", "reference: wake-up when the commit writes a row",
         "LISTEN wake-up with a row", functools.partial(measure.wake_floor, with_row=True)),
        ("publish_floor", "floor: JetStream publish to ack", "publish-to-ack floor",
         measure.publish_floor),
    ):  # fmt: skip
        medians = []
        for i in range(plan.repetitions):
            with progress.step(f"{what} ({i + 1}/{plan.repetitions})"):
                samples = await measurement(target, plan.floor_samples)
            medians.append(percentile(samples, 0.5) * 1000)
        report.add(key, name, "ms", medians)
    report.add(
        "claim_mark_rate",
        "floor: claim and mark, no broker",
        "rows/s",
        await _repeat(
            plan,
            progress,
            "claim-and-mark floor",
            lambda: measure.claim_and_mark_rate(target, plan.floor_rows),
            target,
        ),
    )
    report.add(
        "publish_rate",
        "floor: pipelined JetStream publish, no database",
        "msgs/s",
        await _repeat(
            plan,
            progress,
            "pipelined publish floor",
            lambda: measure.publish_rate(target, plan.floor_rows),
            target,
        ),
    )
    for rate in (100.0, 1000.0):
        await _latency(plan, progress, report, target, rate=rate, plain=False)
    await _drains(plan, progress, report, target)
    await _publish_modes(plan, progress, report, target)
    await _claim_walk(plan, progress, report, target)
    with progress.step(f"relay draining {plan.memory_rows:,} rows of one transaction"):
        await target.reset()
        peak, rate = await measure.drain_memory(target, plan.memory_rows)
        report.add(
            "drain_memory",
            f"relay: peak RSS draining {plan.memory_rows:,} rows of one transaction",
            "MiB",
            [peak],
        )
        report.add(
            "drain_million_rate",
            f"relay: drain {plan.memory_rows:,} rows of one transaction",
            "rows/s",
            [rate],
        )
    await _producer_cost(plan, progress, report, target)
    await _index_cost(plan, progress, report, target)
    await _frozen_relay(plan, progress, report, target)
    report.add(
        "plain_drain_rate",
        f"plain poller: drain a {plan.plain_drain_rows:,}-row backlog",
        "rows/s",
        await _repeat(
            plan,
            progress,
            "plain poller drain",
            lambda: measure.drain_rate(target, plan.plain_drain_rows, plain=True),
            target,
        ),
    )
    await _latency(plan, progress, report, target, rate=100.0, plain=True)
    progress.finish()
    return report


@dataclass(frozen=True)
class Verdict:
    target: str
    measured: float
    bound: float
    met: bool


def verdicts(report: Report) -> list[Verdict]:
    """The issue's targets, as ratios inside this one run."""
    floor = min(report.get("claim_mark_rate"), report.get("publish_rate"))
    wake_publish = report.get("wake_floor") + report.get("publish_floor")
    drain = report.get("drain_rate")
    batched = report.get("drain_mode_batch_rate")
    batched_bound = FAST_BATCH_TARGET * report.get("publish_rate")
    checks = [
        (
            f"drain with fast batches >= {FAST_BATCH_TARGET:g} x the per-message publish floor",
            batched,
            batched_bound,
            batched >= batched_bound,
        ),
        (
            "p99 at 1000/s with fast batches <= 1.25 x per message",
            report.get("relay_latency_batch_1000_p99"),
            1.25 * report.get("relay_latency_1000_p99"),
            report.get("relay_latency_batch_1000_p99")
            <= 1.25 * report.get("relay_latency_1000_p99"),
        ),
        ("drain >= 0.8 x the lower raw floor", drain, 0.8 * floor, drain >= 0.8 * floor),
        (
            "drain >= 8 x the plain poller",
            drain,
            8 * report.get("plain_drain_rate"),
            drain >= 8 * report.get("plain_drain_rate"),
        ),
        (
            "p50 at 100/s <= 2 x (wake + publish floors)",
            report.get("relay_latency_100_p50"),
            2 * wake_publish,
            report.get("relay_latency_100_p50") <= 2 * wake_publish,
        ),
        (
            "p99 at 100/s <= 5 x (wake + publish floors)",
            report.get("relay_latency_100_p99"),
            5 * wake_publish,
            report.get("relay_latency_100_p99") <= 5 * wake_publish,
        ),
        (
            "producer cost ratio >= 0.9 at 8 writers",
            report.get("producer_cost_ratio"),
            0.9,
            report.get("producer_cost_ratio") >= 0.9,
        ),
        (
            "producers >= 0.85 x within 75 s of a relay frozen asleep",
            report.get("frozen_ratio_after"),
            0.85,
            report.get("frozen_ratio_after") >= 0.85
            and report.get("frozen_recovered_after") <= FROZEN_RECOVERY_LIMIT,
        ),
        *(
            (
                f"{what} drains >= 0.8 x a transaction each",
                report.get(f"{key}_ratio"),
                0.8,
                report.get(f"{key}_ratio") >= 0.8,
            )
            for key, what in (
                ("drain_bulk", "one transaction"),
                ("drain_dead_ahead", "behind dead rows"),
                ("drain_replicas", "several relays"),
            )
        ),
        (
            "producer ratio >= 0.9 with the relay's columns and indexes",
            report.get("producer_index_ratio"),
            0.9,
            report.get("producer_index_ratio") >= 0.9,
        ),
        (
            "peak memory draining < 150 MiB",
            report.get("drain_memory"),
            150.0,
            report.get("drain_memory") < 150.0,
        ),
    ]
    return [Verdict(name, measured, bound, met) for name, measured, bound, met in checks]


def context(report: Report) -> list[str]:
    """How far the fast-batch target is from what the machine's cores allow: the
    floor has a publisher and NATS alone on them, the drain shares them with Postgres."""
    ceiling = report.get("ceiling_mode_batch")
    drained = report.get("drain_mode_batch_rate") / ceiling
    wanted = FAST_BATCH_TARGET * report.get("publish_rate") / ceiling
    return [
        f"fast batches drained at {drained:.2f} of their ceiling "
        f"(every core busy at their CPU per row: {ceiling:,.0f} rows/s)",
        f"{FAST_BATCH_TARGET:g} x the per-message publish floor would be {wanted:.2f} "
        "of that ceiling",
    ]


def render(report: Report, plan: Plan) -> str:
    lines = [f"outbox-relay bench: {plan.repetitions} repetition(s); median [min - max]", ""]
    width = max(len(f.name) for f in report.figures.values())
    for figure in report.figures.values():
        fmt = "{:,.0f}" if figure.median >= 100 else "{:.2f}"
        lines.append(
            f"{figure.name:<{width}}  {fmt.format(figure.median):>10} {figure.unit:<9}"
            f" [{fmt.format(figure.low)} - {fmt.format(figure.high)}]"
        )
    lines += ["", "targets:"]
    for v in verdicts(report):
        mark = "met    " if v.met else "NOT MET"
        lines.append(f"  {mark} {v.target}: {v.measured:,.2f} vs {v.bound:,.2f}")
    lines += ["", "context:", *(f"  {line}" for line in context(report))]
    return "\n".join(lines) + "\n"


async def bench(database_url: str | None, nats_url: str | None, plan: Plan) -> Report:
    async with bench_target(database_url, nats_url) as target:
        return await run_all(target, plan)


def main(database_url: str | None, nats_url: str | None, quick: bool, json_path: str | None) -> int:
    plan = Plan.quick() if quick else Plan()
    run = provenance()  # the build measured is the one checked out when the run began
    # A plain asyncio loop: importing relay installs trio-asyncio's loop policy, which
    # the relay needs in its own process but the benchmark's client side does not.
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        report = runner.run(bench(database_url, nats_url, plan))
    sys.stdout.write(render(report, plan))
    if json_path:
        document = {
            "run": run,
            "plan": plan.__dict__,
            "figures": {key: f.as_dict() for key, f in report.figures.items()},
            "targets": [v.__dict__ for v in verdicts(report)],
        }
        Path(json_path).write_text(dumps(document) + "\n")
    return 0
