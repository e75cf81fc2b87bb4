"""What the relay's read of the table's writers (relay/writers.py: ``pg_locks``, 4
times a second) costs producers: pgbench's 8 writers inserting single outbox rows
on a throwaway Postgres, with nothing else running, and with the read running
beside them at the relay's rate and at a much higher one (to see what it would cost
per claim), alternating, ``--repetitions`` times. Prints each arrangement's
commits/s (median, and each repetition) and its ratio to the first.

    python -m relay_tools.bench.writers_cost --repetitions 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics

import psycopg

from relay.config import Config
from relay.sqlfiles import Names, query
from relay.writers import WRITERS_INTERVAL
from relay_tools.bench.harness import Target, bench_target
from relay_tools.bench.measure import producer_commits

SECONDS = 8.0
# Reads a second: none; the relay's; one per claim at a few hundred claims a second.
RATES = (0.0, 1 / WRITERS_INTERVAL, 200.0)


async def _read_writers(url: str, rate: float, stop: asyncio.Event) -> int:
    """Read the table's writers ``rate`` times a second until ``stop``; how many."""
    statement = query(Names.for_config(Config()), "table_writers")
    reads = 0
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            await (await conn.execute(statement, {"table": "outbox_events"})).fetchall()
            reads += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1 / rate)
    return reads


async def _commits(target: Target, rate: float) -> float:
    """Producers' commits/s while the writers are read ``rate`` times a second."""
    stop = asyncio.Event()
    reader = asyncio.create_task(_read_writers(target.url, rate, stop)) if rate else None
    try:
        return await producer_commits(target, SECONDS)
    finally:
        stop.set()
        if reader is not None:
            await reader


async def _main(repetitions: int) -> dict[float, list[float]]:
    results: dict[float, list[float]] = {rate: [] for rate in RATES}
    async with bench_target(None, None) as target:
        for _ in range(repetitions):
            for rate in RATES:
                results[rate].append(await _commits(target, rate))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    results = asyncio.run(_main(args.repetitions))
    base = statistics.median(results[RATES[0]])
    for rate, runs in results.items():
        median = statistics.median(runs)
        each = ", ".join(f"{r:,.0f}" for r in runs)
        print(
            f"writers read {rate:>5g}/s: {median:>8,.0f} commits/s median ({each}); "
            f"{median / base:.3f} of none"
        )


if __name__ == "__main__":
    main()
