"""`outbox-relay demo`: the relay at work in one command.

It starts throwaway Postgres and NATS JetStream servers (or uses the ones named
by OUTBOX_RELAY_DATABASE_URL / OUTBOX_RELAY_NATS_URL), installs the SQL on a table
of its own, creates a stream of its own, and runs three things until Ctrl-C:

- a producer that writes a domain row (an order) and its event in ONE transaction,
  the way every service using the outbox must;
- the relay, as `outbox-relay run` in a child process;
- a consumer that dedupes on the envelope id under a unique constraint, in the
  same transaction as its own work (see :func:`handle`), as the contract says.

It prints one live line: events/s, backlog, and commit-to-consumer latency. On
Ctrl-C everything it started is stopped and what it created is removed. Against a
real database and NATS it touches nothing but its own (see :class:`DemoNames`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats
import psycopg
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay.config import Config, redact_url
from relay.database import connection_string, install
from relay.sqlfiles import Names
from relay_tools.localservers import throwaway_nats, throwaway_postgres

SCHEMA = """
create table if not exists demo_orders (
  id uuid primary key, customer text not null, amount_cents int not null,
  placed_at timestamptz not null default now());
create table if not exists demo_shipments (
  order_id uuid primary key, shipped_at timestamptz not null default now());
-- The consumer's dedupe table: one row per envelope id it has acted on.
create table if not exists demo_processed_events (
  event_id uuid primary key, processed_at timestamptz not null default now());
"""


DELIVER_THE_REST_TIMEOUT = 60.0  # seconds, after the producer stopped


@dataclass(frozen=True)
class DemoNames:
    """Everything the demo creates is named after one token, so that it can run
    beside a real outbox (the user's table, channel, stream and subjects) and
    remove exactly what it made: a schema that holds its outbox table, trigger and
    domain tables; a NATS channel; a stream capturing only its own subjects."""

    token: str

    @classmethod
    def new(cls) -> DemoNames:
        return cls(uuid.uuid4().hex[:12])

    @property
    def schema(self) -> str:
        return f"outbox_relay_demo_{self.token}"

    @property
    def table(self) -> tuple[str, str]:
        return (self.schema, "outbox_events")

    @property
    def channel(self) -> str:
        return self.schema

    @property
    def event_type(self) -> str:
        return f"{self.schema}.order.placed"

    @property
    def subjects(self) -> str:
        return f"{self.schema}.>"

    @property
    def stream(self) -> str:
        return self.schema.upper()

    def conninfo(self, conninfo: str) -> str:
        """``conninfo`` with the demo's schema as the only one searched, so the
        demo's unqualified statements (the README's examples) reach its own tables."""
        params = conninfo_to_dict(conninfo)
        options = f"{params.get('options') or ''} -c search_path={self.schema}".strip()
        return make_conninfo(conninfo, options=options)


async def place_order(conn: psycopg.AsyncConnection[Any], customer: str, event_type: str) -> None:
    """The producer side of the outbox: the domain write and its event commit (or
    roll back) together. The event id is made here, before the insert."""
    order_id, event_id = uuid.uuid4(), uuid.uuid4()
    amount = random.randint(100, 50_000)
    async with conn.transaction():
        await conn.execute(
            "insert into demo_orders (id, customer, amount_cents) values (%s, %s, %s)",
            (order_id, customer, amount),
        )
        await conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data) "
            "values (%s, %s, 'demo-shop', %s, now(), %s)",
            (event_id, event_type, f"order/{order_id}",
             json.dumps({"order_id": str(order_id), "customer": customer, "amount_cents": amount})),
        )  # fmt: skip


async def handle(conn: psycopg.AsyncConnection[Any], envelope: Mapping[str, Any]) -> bool:
    """The consumer side: idempotent by construction. The envelope id goes into a
    table with a unique constraint in the same transaction as the handler's work,
    so a redelivery (at-least-once) finds it there and does nothing twice.

    Returns whether this delivery did the work (False: a duplicate)."""
    async with conn.transaction():
        cursor = await conn.execute(
            "insert into demo_processed_events (event_id) values (%s) on conflict do nothing",
            (envelope["id"],),
        )
        if cursor.rowcount == 0:
            return False  # seen before: a duplicate delivery, nothing to do
        await conn.execute(
            "insert into demo_shipments (order_id) values (%s) on conflict do nothing",
            (envelope["data"]["order_id"],),
        )
    return True


class Stats:
    def __init__(self) -> None:
        self.produced = 0
        self.consumed = 0
        self.caught_up = asyncio.Event()  # set while every produced order is consumed
        self.caught_up.set()
        self.duplicates = 0
        self.latencies: list[float] = []


async def produce(
    url: str, names: DemoNames, stop: asyncio.Event, rate: float, stats: Stats
) -> None:
    customers = ["ada", "grace", "edsger", "barbara", "ken", "leslie"]
    async with await psycopg.AsyncConnection.connect(url) as conn:
        while not stop.is_set():
            await place_order(conn, random.choice(customers), names.event_type)
            stats.produced += 1
            stats.caught_up.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), random.expovariate(rate))


async def consume(
    url: str, names: DemoNames, js: JetStreamContext, stop: asyncio.Event, stats: Stats
) -> None:
    subscription = await js.pull_subscribe(
        names.subjects, durable="demo-shipping", stream=names.stream
    )
    async with await psycopg.AsyncConnection.connect(url) as conn:
        while not stop.is_set():
            try:
                messages = await subscription.fetch(100, timeout=0.5)
            except TimeoutError:
                # nats-py raises its own TimeoutError, and the builtin one when the
                # deadline runs out between its two pull requests: both mean "none yet".
                continue
            for message in messages:
                envelope = json.loads(message.data)
                if await handle(conn, envelope):
                    sent = datetime.fromisoformat(envelope["time"].replace("Z", "+00:00"))
                    stats.latencies.append((datetime.now(UTC) - sent).total_seconds())
                    stats.consumed += 1
                    if stats.consumed >= stats.produced:
                        stats.caught_up.set()
                else:
                    stats.duplicates += 1
                # Ack after the commit: a crash in between redelivers, and handle()
                # turns the redelivery into a no-op.
                await message.ack()


async def report(url: str, stop: asyncio.Event, stats: Stats) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        last, last_at = 0, time.perf_counter()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            cursor = await conn.execute(
                "select count(*) from outbox_events where published_at is null"
            )
            row = await cursor.fetchone()
            now = time.perf_counter()
            rate = (stats.consumed - last) / (now - last_at)
            last, last_at = stats.consumed, now
            window, stats.latencies = stats.latencies, []
            latency = f"{statistics.median(window) * 1000:6.1f} ms" if window else "     - ms"
            sys.stdout.write(
                f"\r{rate:7.1f} events/s  backlog {row[0] if row else 0:5d}  "
                f"commit-to-consumer p50 {latency}  consumed {stats.consumed}  "
                f"duplicates ignored {stats.duplicates}   "
            )
            sys.stdout.flush()


class DemoFailed(Exception):
    """A part of the demo stopped with an error: the demo stops too, and says which."""


def failure(parts: Mapping[str, asyncio.Task[None]]) -> DemoFailed | None:
    """The first of the demo's parts that stopped with an error, if one did."""
    for name, task in parts.items():
        if task.done() and not task.cancelled() and (error := task.exception()) is not None:
            return DemoFailed(f"the demo's {name} stopped: {error!r}")
    return None


async def deliver_the_rest(
    stats: Stats, relay: asyncio.subprocess.Process, consumer: asyncio.Task[None]
) -> None:
    """Returns, once the producer stopped, when the consumer has every order that
    was committed, the relay exited or the consumer failed, so a timed run ends
    with its orders shipped rather than with whatever was in flight when the clock
    ran out."""
    caught_up = asyncio.create_task(stats.caught_up.wait())
    relay_exited = asyncio.create_task(relay.wait())
    try:
        await asyncio.wait([caught_up, relay_exited, consumer], return_when=asyncio.FIRST_COMPLETED)
    finally:
        caught_up.cancel()
        relay_exited.cancel()


async def create_stream(js: JetStreamContext, names: DemoNames) -> None:
    # Ids kept as long as a retried row can take to come back (--backoff-max plus
    # --publish-timeout), as the README asks of a stream: the relay checks it.
    defaults = Config()
    await js.add_stream(
        name=names.stream,
        subjects=[names.subjects],
        duplicate_window=defaults.backoff_max + defaults.publish_timeout + 60.0,
    )


async def start_relay(
    database_url: str, nats_url: str, names: DemoNames
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay", "run",
        env={**os.environ, "OUTBOX_RELAY_DATABASE_URL": database_url,
             "OUTBOX_RELAY_NATS_URL": nats_url, "OUTBOX_RELAY_METRICS_PORT": "0",
             "OUTBOX_RELAY_TABLE": ".".join(names.table),
             "OUTBOX_RELAY_CHANNEL": names.channel, "OUTBOX_RELAY_LOG_LEVEL": "warning"},
        # Its own session: Ctrl-C reaches the demo, which stops the producer first
        # and then the relay, in that order.
        start_new_session=True,
    )  # fmt: skip


async def run_demo(database_url: str, nats_url: str, rate: float, seconds: float | None) -> None:
    names = DemoNames.new()
    config = Config(
        database_url=database_url, nats_urls=(nats_url,), table=names.table, channel=names.channel
    )
    conninfo = connection_string(database_url)
    demo_conninfo = names.conninfo(conninfo)
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        await conn.execute(sql.SQL("create schema {}").format(sql.Identifier(names.schema)))
    nc: NatsClient | None = None
    relay: asyncio.subprocess.Process | None = None
    stop_producing, stop, stats = asyncio.Event(), asyncio.Event(), Stats()
    parts: dict[str, asyncio.Task[None]] = {}
    try:
        await asyncio.to_thread(install, conninfo, Names.for_config(config))
        async with await psycopg.AsyncConnection.connect(demo_conninfo, autocommit=True) as conn:
            await conn.execute(SCHEMA)
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await create_stream(js, names)
        relay = await start_relay(database_url, nats_url, names)
        print(
            f"relay running (pid {relay.pid}) against {redact_url(database_url)} and {nats_url}, "
            f"on the demo's own table {'.'.join(names.table)} and stream {names.stream}"
        )
        print("producing orders; press Ctrl-C to stop\n")
        parts = {
            "producer": asyncio.create_task(
                produce(demo_conninfo, names, stop_producing, rate, stats)
            ),
            "consumer": asyncio.create_task(consume(demo_conninfo, names, js, stop, stats)),
            "report": asyncio.create_task(report(demo_conninfo, stop, stats)),
        }
        finished = asyncio.Event()
        # Ctrl-C cancels this coroutine (asyncio.Runner); SIGTERM ends it the same way.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, finished.set)
        finishing = asyncio.create_task(finished.wait())
        # Until the time is up, SIGTERM, or a part of the demo fails.
        await asyncio.wait(
            [finishing, *parts.values()], timeout=seconds, return_when=asyncio.FIRST_COMPLETED
        )
        finishing.cancel()
        # The producer stops first; the relay and the consumer then finish what
        # was committed (a relay that started slowly still gets its orders out).
        stop_producing.set()
        await asyncio.wait([parts["producer"]])
        if failure(parts) is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DELIVER_THE_REST_TIMEOUT):
                    await deliver_the_rest(stats, relay, parts["consumer"])
    finally:
        stop_producing.set()
        stop.set()
        await asyncio.gather(*parts.values(), return_exceptions=True)
        if relay is not None:
            with contextlib.suppress(ProcessLookupError):  # it may have stopped by itself
                relay.terminate()
            await relay.wait()
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_stream(names.stream)
            await nc.close()
        async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(names.schema))
            )
    print(f"\n\nstopped: {stats.consumed} of {stats.produced} orders shipped exactly once, "
          f"{stats.duplicates} duplicate deliveries ignored")  # fmt: skip
    if (failed := failure(parts)) is not None:
        raise failed


def main(environ: Mapping[str, str], rate: float, seconds: float | None) -> int:
    database_url = environ.get("OUTBOX_RELAY_DATABASE_URL")
    nats_url = environ.get("OUTBOX_RELAY_NATS_URL")
    with contextlib.ExitStack() as servers:
        if database_url is None:
            print("starting a throwaway Postgres on loopback ...")
            database_url = servers.enter_context(throwaway_postgres()).url
        if nats_url is None:
            print("starting a throwaway NATS JetStream on loopback ...")
            nats_url = servers.enter_context(throwaway_nats()).url
        # A plain asyncio loop: the relay (which needs trio-asyncio) runs in its own process.
        with (
            asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner,
            contextlib.suppress(KeyboardInterrupt),
        ):
            runner.run(run_demo(database_url, nats_url.split(",")[0], rate, seconds))
    print("everything the demo started is stopped and removed")
    return 0
