"""`outbox-relay bench --poolers`: the relay behind PgBouncer in transaction mode
against the relay on a direct URL, in one run on the same servers.

Each arrangement drains the same backlog and carries the same light load; they
alternate within every repetition, so a ratio compares runs minutes apart at most.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from relay_tools.bench import measure
from relay_tools.bench.harness import Target, bench_target, dumps
from relay_tools.bench.stats import percentile
from relay_tools.localservers import throwaway_pgbouncer


@dataclass(frozen=True)
class PoolerPlan:
    repetitions: int = 3
    drain_rows: int = 50_000
    rate: float = 200.0  # events/s for the latency runs
    latency_seconds: float = 10.0
    pool_size: int = 4  # PgBouncer's default_pool_size

    @classmethod
    def quick(cls) -> PoolerPlan:
        return cls(repetitions=1, drain_rows=2_000, latency_seconds=2.0)


@dataclass
class Arrangement:
    name: str
    drain: list[float] = field(default_factory=list)  # rows/s
    p50: list[float] = field(default_factory=list)  # ms, commit to consumer
    p99: list[float] = field(default_factory=list)


def arrangements(direct: str, pooled: str) -> dict[str, dict[str, str]]:
    """Each arrangement's relay settings (``OUTBOX_RELAY_*``)."""
    return {
        "direct": {},
        "direct, claims unprepared (--database-pooler transaction)": {
            "database_pooler": "transaction"
        },
        "PgBouncer transaction mode + --listen-database-url direct": {
            "database_url": pooled,
            "listen_database_url": direct,
        },
        "PgBouncer transaction mode only (self-check fails: poll, 1s)": {"database_url": pooled},
    }


async def measure_arrangements(target: Target, pooled: str, plan: PoolerPlan) -> list[Arrangement]:
    settings = arrangements(target.url, pooled)
    results = {name: Arrangement(name) for name in settings}
    for _ in range(plan.repetitions):
        for name, relay_settings in settings.items():
            await target.reset()
            results[name].drain.append(
                await measure.drain_rate(target, plan.drain_rows, settings=relay_settings)
            )
            await target.reset()
            samples = await measure.end_to_end(
                target, plan.rate, plan.latency_seconds, settings=relay_settings
            )
            results[name].p50.append(percentile(samples, 0.5) * 1000)
            results[name].p99.append(percentile(samples, 0.99) * 1000)
    return list(results.values())


def render(results: list[Arrangement], plan: PoolerPlan) -> str:
    direct = statistics.median(results[0].drain)
    lines = [
        f"drain of {plan.drain_rows:,} rows, a transaction each; latency at {plan.rate:g}/s "
        f"(medians of {plan.repetitions}; PgBouncer 1.18, default_pool_size "
        f"{plan.pool_size})",
        "",
        "| arrangement | drain rows/s | / direct | p50 ms | p99 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for result in results:
        drain = statistics.median(result.drain)
        lines.append(
            f"| {result.name} | {drain:,.0f} | {drain / direct:.2f} | "
            f"{statistics.median(result.p50):.1f} | {statistics.median(result.p99):.1f} |"
        )
    return "\n".join(lines) + "\n"


async def _main(
    database_url: str | None, nats_url: str | None, plan: PoolerPlan
) -> list[Arrangement]:
    async with bench_target(database_url, nats_url) as target:
        port = urlsplit(target.server_url).port or 5432
        with throwaway_pgbouncer(port, pool_size=plan.pool_size) as bouncer:
            return await measure_arrangements(target, bouncer.url(target.database), plan)


def main(
    database_url: str | None, nats_url: str | None, plan: PoolerPlan, json_path: str | None
) -> int:
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        results = runner.run(_main(database_url, nats_url, plan))
    print(render(results, plan), end="")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as out:
            out.write(
                dumps({"plan": asdict(plan), "arrangements": [asdict(r) for r in results]}) + "\n"
            )
    return 0
