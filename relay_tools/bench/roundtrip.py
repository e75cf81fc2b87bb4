"""What one Postgres round trip costs the relay's process in CPU, by how it waits:
``select 1`` on one connection, ``--count`` times each way, on the machine's
Postgres (``--database-url``, default the shared server's):

- sync: psycopg's blocking connection (the floor: no event loop at all);
- asyncio door: an ``AsyncConnection`` awaited on the asyncio side of trio-asyncio,
  as the batch's claim and marks are (psycopg waits through asyncio: a reader task,
  a timer and a future per wait);
- trio: :class:`relay.pgtrio.TrioConnection` awaited from trio, as the LISTEN
  connection is;
- crossing: a trio-to-asyncio call that does nothing (``aio.call``), what each call
  through the door adds.

Each line is the process's CPU time (user and system) and the wall time, per
round trip.

    python -m relay_tools.bench.roundtrip --count 3000
"""

from __future__ import annotations

# trio_asyncio first, as in relay/__init__.py: psycopg binds asyncio's loop lookup.
import trio_asyncio  # noqa: F401  # isort: skip
import argparse
import time
from collections.abc import Awaitable, Callable

import psycopg
import trio

from relay import aio
from relay.pgtrio import TrioConnection


def _report(name: str, count: int, measure: Callable[[], None]) -> None:
    cpu, wall = time.process_time(), time.perf_counter()
    measure()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"{name:<14} CPU {1e6 * cpu / count:7.1f} us   wall {1e6 * wall / count:7.1f} us")


async def _areport(name: str, count: int, measure: Callable[[], Awaitable[None]]) -> None:
    cpu, wall = time.process_time(), time.perf_counter()
    await measure()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"{name:<14} CPU {1e6 * cpu / count:7.1f} us   wall {1e6 * wall / count:7.1f} us")


def measure(url: str, count: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("select 1")

        def sync() -> None:
            for _ in range(count):
                conn.execute("select 1").fetchall()

        _report("sync", count, sync)

    async def main() -> None:
        async with aio.open_loop():
            conn = await aio.call(TrioConnection.connect, url, autocommit=True)
            try:

                async def door() -> None:
                    for _ in range(count):
                        await (await conn.execute("select 1")).fetchall()

                async def through_door() -> None:
                    await aio.call(door)

                async def from_trio() -> None:
                    for _ in range(count):
                        await (await conn.execute("select 1")).fetchall()

                async def nothing() -> None:
                    pass

                async def crossings() -> None:
                    for _ in range(count):
                        await aio.call(nothing)

                await from_trio()  # warm both paths up
                await _areport("asyncio door", count, through_door)
                await _areport("trio", count, from_trio)
                await _areport("crossing", count, crossings)
            finally:
                await conn.close()

    trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--count", type=int, default=3000)
    args = parser.parse_args()
    measure(args.database_url, args.count)


if __name__ == "__main__":
    main()
