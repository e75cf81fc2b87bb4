"""The measurements, each one repetition: floors, the relay, the plain poller."""

from __future__ import annotations

import asyncio
import re
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import nats
import psycopg

from relay.claimstart import FROM_FIRST_ENTRY
from relay.config import Config
from relay.sqlfiles import Names, claim_parameters, query
from relay_tools.bench.baseline import plain_poller
from relay_tools.bench.harness import (
    Consumer,
    RelayProcess,
    Target,
    listening,
    machine_busy_seconds,
    produce_at_rate,
    wait_until_ready,
)
from relay_tools.localservers import postgres_binary


async def wake_floor(target: Target, samples: int, *, with_row: bool = False) -> list[float]:
    """Seconds from a notifying COMMIT being issued to the listener having it.

    ``with_row``: the notifying transaction also writes a row, as every producer's
    does, so its commit waits for the WAL flush before anyone is notified. A bare
    notify writes nothing and flushes nothing."""
    latencies: list[float] = []
    async with (
        listening(target.url, "bench_floor") as listener,
        await psycopg.AsyncConnection.connect(target.url) as notifier,
    ):
        if with_row:
            await notifier.execute("create table if not exists bench_floor_rows (n int)")
            await notifier.commit()
        for _ in range(samples):
            if with_row:
                await notifier.execute("insert into bench_floor_rows values (1)")

            async def first() -> float:
                async for _ in listener.notifies(stop_after=1):
                    pass
                return time.perf_counter()

            waiting = asyncio.create_task(first())
            await asyncio.sleep(0.002)
            await notifier.execute("select pg_notify('bench_floor', '')")
            started = time.perf_counter()
            await notifier.commit()
            latencies.append(await waiting - started)
    return latencies


async def publish_floor(target: Target, samples: int) -> list[float]:
    """Seconds from a JetStream publish to its PubAck, one at a time."""
    nc = await nats.connect(target.nats_url)
    js = nc.jetstream()
    latencies = []
    try:
        for i in range(samples):
            started = time.perf_counter()
            await js.publish(
                f"{target.prefix}.floor", b'{"n": 1}', headers={"Nats-Msg-Id": f"f{i}"}
            )
            latencies.append(time.perf_counter() - started)
    finally:
        await nc.close()
    return latencies


async def claim_and_mark_rate(target: Target, rows: int, batch: int = 500) -> float:
    """Rows/s of claiming batches FOR UPDATE SKIP LOCKED and marking each batch with
    one UPDATE, with no broker in between."""
    await target.fill(rows)
    async with await psycopg.AsyncConnection.connect(target.url) as conn:
        started = time.perf_counter()
        done = 0
        while done < rows:
            cur = await conn.execute(
                "select id from outbox_events where published_at is null order by created_at "
                "limit %s for update skip locked", (batch,))  # fmt: skip
            ids = [row[0] for row in await cur.fetchall()]
            await conn.execute(
                "update outbox_events set published_at = now() where id = any(%s)", (ids,)
            )
            await conn.commit()
            done += len(ids)
            if not ids:
                break
        return done / (time.perf_counter() - started)


async def claim_time(target: Target, samples: int = 7, batch: int = 500) -> float:
    """Milliseconds one claim of ``batch`` rows takes (the relay's claim statement,
    rolled back), median of ``samples``, on fresh statistics."""
    names = Names.for_config(Config())
    await target.execute("vacuum analyze outbox_events")
    times = []
    async with await psycopg.AsyncConnection.connect(target.url) as conn:
        for _ in range(samples):
            started = time.perf_counter()
            cur = await conn.execute(
                query(names, "claim"),
                claim_parameters(batch, Config().max_attempts, FROM_FIRST_ENTRY),
            )
            await cur.fetchall()
            times.append((time.perf_counter() - started) * 1000)
            await conn.rollback()
    return sorted(times)[len(times) // 2]


async def publish_rate(target: Target, messages: int) -> float:
    """Messages/s of pipelined JetStream publishing (publish_async), no database."""
    nc = await nats.connect(target.nats_url)
    js = nc.jetstream(publish_async_max_pending=4000)
    body = b'{"specversion":"1.0","data":{"pad":"' + b"x" * 200 + b'"}}'
    try:
        started = time.perf_counter()
        futures = [
            await js.publish_async(f"{target.prefix}.rate", body,
                                   headers={"Nats-Msg-Id": str(uuid.uuid4())})
            for _ in range(messages)
        ]  # fmt: skip
        await asyncio.gather(*futures)
        return messages / (time.perf_counter() - started)
    finally:
        await nc.close()


async def end_to_end(
    target: Target,
    rate: float,
    seconds: float,
    *,
    plain: bool = False,
    settings: Mapping[str, str] | None = None,
) -> list[float]:
    """Seconds from COMMIT to the consumer, at ``rate`` events/s from four producers,
    through the relay (``settings``: its options) or the plain poller."""
    async with (
        Consumer(target.nats_url, f"{target.prefix}.>") as consumer,
        _Publishing(target, plain, 1, dict(settings or {})),
    ):
        committed = await produce_at_rate(target.url, target.event_type, rate, seconds)
        async with asyncio.timeout(30):
            await consumer.wait_for(set(committed))
    return [consumer.arrived[event_id] - at for event_id, at in committed.items()]


@dataclass(frozen=True)
class Shape:
    """What a backlog looks like when it lands, and who drains it."""

    one_transaction: bool = False  # every row written by one transaction
    dead_ahead: int = 0  # rows at the cap, older than the backlog
    replicas: int = 1  # relays sharing the table


async def drain_rate(
    target: Target,
    rows: int,
    *,
    plain: bool = False,
    shape: Shape = Shape(),
    settings: Mapping[str, str] | None = None,
    data: str | None = None,
    columns: Mapping[str, str] | None = None,
) -> float:
    """Rows/s to publish a backlog of ``rows`` committed rows (``settings``: the
    relays' options; ``data`` and ``columns``: each row's, as SQL, see Target.fill)."""
    if shape.dead_ahead:
        # Before the relays start: the incident is over, the relays were restarted.
        await target.add_dead(shape.dead_ahead, Config().max_attempts)
    async with _publisher(target, plain, shape.replicas, **(settings or {})):
        # The relays (or poller) are running and idle; the backlog lands at once.
        if data is None:
            await target.fill(rows, one_transaction=shape.one_transaction, columns=columns)
        else:
            await target.fill(
                rows, one_transaction=shape.one_transaction, data=data, columns=columns
            )
        started = time.perf_counter()
        await target.execute("select pg_notify('outbox_events', '')")
        await target.wait_until_drained(0.05)
        return rows / (time.perf_counter() - started)


async def drain_memory(target: Target, rows: int) -> tuple[float, float]:
    """The relay's peak resident memory (MiB) while draining a backlog of ``rows``
    written by one transaction, and the rows/s it drained them at."""
    async with _publisher(target, False) as publishing:
        await target.fill(rows, one_transaction=True)
        started = time.perf_counter()
        await target.execute("select pg_notify('outbox_events', '')")
        await target.wait_until_drained(0.2)
        rate = rows / (time.perf_counter() - started)
        return publishing.peak_rss_mb(), rate


@dataclass(frozen=True)
class DrainCost:
    """A drain's rate, and CPU microseconds per row of the relay alone (all its
    threads) and of the whole machine (every process on every core)."""

    rate: float
    relay_us_per_row: float
    machine_us_per_row: float


async def drain_in_mode(target: Target, rows: int, mode: str) -> DrainCost:
    """A backlog of ``rows`` (a transaction each) published with ``--publish-mode mode``."""
    return await drain_cost(target, rows, settings={"publish_mode": mode})


async def drain_cost(
    target: Target,
    rows: int,
    *,
    settings: Mapping[str, str] | None = None,
    data: str | None = None,
    columns: Mapping[str, str] | None = None,
) -> DrainCost:
    """A backlog of ``rows`` (a transaction each) published by a relay with
    ``settings`` (``data`` and ``columns``: each row's, as SQL, see Target.fill)."""
    async with _Publishing(target, False, 1, dict(settings or {})) as publishing:
        if data is None:
            await target.fill(rows, columns=columns)
        else:
            await target.fill(rows, data=data, columns=columns)
        relay_cpu, machine_cpu = publishing.cpu_seconds(), machine_busy_seconds()
        started = time.perf_counter()
        await target.execute("select pg_notify('outbox_events', '')")
        await target.wait_until_drained(0.05)
        elapsed = time.perf_counter() - started
        return DrainCost(
            rate=rows / elapsed,
            relay_us_per_row=(publishing.cpu_seconds() - relay_cpu) / rows * 1e6,
            machine_us_per_row=(machine_busy_seconds() - machine_cpu) / rows * 1e6,
        )


def _publisher(target: Target, plain: bool, replicas: int = 1, **settings: str) -> _Publishing:
    """The relay (``settings``: its options, as ``OUTBOX_RELAY_*``), or the plain poller."""
    return _Publishing(target, plain, replicas, settings)


class _Publishing:
    def __init__(
        self, target: Target, plain: bool, replicas: int, settings: dict[str, str]
    ) -> None:
        self._target = target
        self._plain = plain
        self._relays = [
            RelayProcess(target.url, target.nats_url, **settings)
            for _ in range(0 if plain else replicas)
        ]
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Publishing:
        if self._plain:
            self._task = asyncio.create_task(
                plain_poller(self._target.url, self._target.nats_url, self._stop)
            )
        for relay in self._relays:
            await relay.__aenter__()
        await wait_until_ready(self._target)
        return self

    def peak_rss_mb(self) -> float:
        return max(relay.peak_rss_mb() for relay in self._relays)

    def cpu_seconds(self) -> float:
        return sum(relay.cpu_seconds() for relay in self._relays)

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._stop.set()
            await self._task
        for relay in self._relays:
            await relay.__aexit__(*exc)


_TPS = re.compile(r"tps = ([0-9.]+) \(without initial connection time\)")

PLAIN_NOTIFY_TRIGGER = """
create or replace function bench_plain_notify() returns trigger language plpgsql as $$
begin perform pg_notify('outbox_events', ''); return null; end $$;
create or replace trigger outbox_events_relay_notify after insert on outbox_events
  for each statement execute function bench_plain_notify();
"""


def pgbench_commits(
    url: str, event_type: str, seconds: float, writers: int = 8, table: str = "outbox_events"
) -> float:
    """Commits/s of ``writers`` pgbench clients inserting single outbox rows into
    ``table`` (a transaction each), for ``seconds``."""
    script = Path(tempfile.mkstemp(suffix=".sql")[1])
    script.write_text(
        "\\set s random(1, 1000)\n"
        f"insert into {table} (id, event_type, source, subject, time, data) values "
        f"(gen_random_uuid(), '{event_type}', 'bench', 's' || :s, now(), '{{\"n\": 1}}');\n"
    )
    script.chmod(0o644)
    try:
        output = subprocess.run(
            [postgres_binary("pgbench"), "-n", "-c", str(writers), "-j", "2", "-T",
             str(max(1, round(seconds))), "-f", str(script), url],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    finally:
        script.unlink(missing_ok=True)
    match = _TPS.search(output)
    if not match:
        raise RuntimeError(f"pgbench printed no tps:\n{output}")
    return float(match.group(1))


async def producer_commits(target: Target, seconds: float, writers: int = 8) -> float:
    """Commits/s of ``writers`` concurrent single-row outbox inserts (pgbench)."""
    return await asyncio.to_thread(pgbench_commits, target.url, target.event_type, seconds, writers)
