"""What every measurement needs: a database and a stream of its own, producers,
a consumer that timestamps arrivals, and the relay as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import psycopg
from nats.aio.client import Client
from nats.aio.msg import Msg

from relay.config import Config
from relay.database import connection_string, install, uninstall
from relay.sqlfiles import Names
from relay_tools import exposition
from relay_tools.localservers import throwaway_nats, throwaway_postgres

INSERT = (
    "insert into outbox_events (id, event_type, source, subject, time, data) "
    "values (%s, %s, 'bench', %s, now(), %s)"
)


def provenance() -> dict[str, str]:
    """What a run's figures, and the charts drawn from them, say of where they come
    from: the command as it was typed, the machine, the date and the build."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return {
        "command": shlex.join(["outbox-relay", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} cores {platform.machine()}, {memory:.0f} GiB",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "build": _build(),
    }


def _build() -> str:
    """The checkout's commit, "+changes" when the measured code (relay/, relay_tools/,
    sql/) differs from it; "unknown" outside a git checkout."""
    checkout = Path(__file__).resolve().parents[2]

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], cwd=checkout, capture_output=True, text=True, check=False
        )

    commit = git("rev-parse", "--short", "HEAD")
    if commit.returncode != 0:
        return "unknown"
    changed = git("status", "--porcelain", "--", "relay", "relay_tools", "sql").stdout.strip()
    return commit.stdout.strip() + ("+changes" if changed else "")


def with_database(url: str, name: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))


@dataclass
class Target:
    """A database with the relay installed, and a stream capturing ``prefix.>``."""

    server_url: str
    nats_url: str
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def database(self) -> str:
        return f"outbox_bench_{self.token}"

    @property
    def url(self) -> str:
        return with_database(self.server_url, self.database)

    @property
    def prefix(self) -> str:
        return f"bench{self.token}"

    @property
    def stream(self) -> str:
        return f"BENCH{self.token.upper()}"

    @property
    def event_type(self) -> str:
        return f"{self.prefix}.created"

    async def create(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.server_url, autocommit=True) as c:
            await c.execute(f'create database "{self.database}"')
        await self.install()
        nc = await nats.connect(self.nats_url)
        try:
            await nc.jetstream().add_stream(name=self.stream, subjects=[f"{self.prefix}.>"])
        finally:
            await nc.close()

    async def allow_batches(self, allowed: bool) -> None:
        """Let the stream take batch publishes, fast and atomic (or no longer)."""
        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream()
            config = (await js.stream_info(self.stream)).config
            config.allow_batched = config.allow_atomic = allowed or None
            await js.update_stream(config)
        finally:
            await nc.close()

    async def install(self) -> None:
        """`outbox-relay install` on the database (the relay's trigger included)."""
        await asyncio.to_thread(install, connection_string(self.url), Names.for_config(Config()))

    async def install_partitioned(self, period: float, ahead: float) -> None:
        """The table made again by `install --partitions`: range partitions of
        ``period`` seconds on created_at, ``ahead`` seconds of them past now."""
        await self.execute("drop table if exists outbox_events cascade")
        await asyncio.to_thread(
            install,
            connection_string(self.url),
            Names.for_config(Config()),
            partitions=period,
            partitions_ahead=ahead,
        )

    async def uninstall(self) -> None:
        """`outbox-relay uninstall`: the contract's table alone is left."""
        await asyncio.to_thread(uninstall, connection_string(self.url), Names.for_config(Config()))

    async def drop_notify_trigger(self) -> None:
        """The relay's insert trigger (or the plain one of the same name) gone; install
        keeps a trigger it finds by name, so a plain one must go before it runs."""
        await self.execute("drop trigger if exists outbox_events_relay_notify on outbox_events")

    async def drop(self) -> None:
        with contextlib.suppress(Exception):
            nc = await nats.connect(self.nats_url)
            try:
                await nc.jetstream().delete_stream(self.stream)
            finally:
                await nc.close()
        async with await psycopg.AsyncConnection.connect(self.server_url, autocommit=True) as c:
            await c.execute(f'drop database if exists "{self.database}" with (force)')

    async def reset(self) -> None:
        """Empty the table and the stream between measurements."""
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as c:
            await c.execute("truncate outbox_events")
        nc = await nats.connect(self.nats_url)
        try:
            await nc.jetstream().purge_stream(self.stream)
        finally:
            await nc.close()

    async def fetch_value(self, statement: str) -> Any:
        """The first column of the first row of ``statement``."""
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as c:
            row = await (await c.execute(statement)).fetchone()
        return row[0] if row else None

    async def execute(self, statement: str, params: tuple[Any, ...] = ()) -> None:
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as c:
            await c.execute(statement, params)

    async def wait_until_drained(self, interval: float) -> None:
        """Until no row is left to publish (dead rows never will be), asking every
        ``interval`` seconds on one connection (a connection per look would compete
        with what is measured)."""
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as c:
            while True:
                cur = await c.execute(
                    "select exists (select 1 from outbox_events"
                    " where coalesce(published_at, relay_dead_at) is null)"
                )
                row = await cur.fetchone()
                if not (row and row[0]):
                    return
                await asyncio.sleep(interval)

    async def fill(
        self,
        rows: int,
        subjects: int = 1000,
        *,
        one_transaction: bool = False,
        data: str = "jsonb_build_object('n', g, 'pad', repeat('x', 200))",
        columns: Mapping[str, str] | None = None,
    ) -> None:
        """A backlog of ``rows`` committed rows, inserted without notifying anyone:
        each with its own created_at (as many small transactions leave them), or all
        written by one transaction and so sharing one (a backfill, a bulk import).
        ``data``: the SQL of each row's data, from the series number ``g``;
        ``columns``: more columns, each with the SQL of its value."""
        created_at = "now()" if one_transaction else "clock_timestamp()"
        names = "".join(f", {name}" for name in columns or {})
        values = "".join(f", {value}" for value in (columns or {}).values())
        async with await psycopg.AsyncConnection.connect(self.url) as c:
            for start in range(0, rows, 100_000):
                count = min(100_000, rows - start)
                await c.execute(
                    "insert into outbox_events (id, event_type, source, subject, time, data, "
                    f"created_at{names}) select gen_random_uuid(), %s, 'bench', "
                    f"'s' || (g %% %s::int), now(), {data}, {created_at}{values} "
                    "from generate_series(%s::int, %s::int) g",
                    (self.event_type, subjects, start, start + count - 1),
                )
                if not one_transaction:
                    await c.commit()
            await c.commit()

    async def add_dead(self, rows: int, attempts: int) -> None:
        """``rows`` rows older than any backlog and at the attempt cap, as an incident
        leaves them (the relay that starts next marks them dead), on subjects of their
        own: a dead row holds back its subject's later rows, which would never drain."""
        await self.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, "
            "created_at, attempts, relay_last_error) select gen_random_uuid(), %s, 'bench', "
            "'dead' || (g %% 1000), now(), jsonb_build_object('n', g, 'pad', repeat('x', 200)), "
            "clock_timestamp() - interval '1 day', %s, 'timeout: an incident' "
            "from generate_series(1, %s::int) g",
            (self.event_type, attempts, rows),
        )

    async def add_waiting(self, rows: int) -> None:
        """``rows`` rows of an event type no stream captures, each waiting out its
        retry, as the relay leaves them (its attempts untouched)."""
        await self.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, "
            "created_at, relay_retry_at, relay_last_error) select gen_random_uuid(), "
            "'nostream.created', 'bench', 'waiting' || g, now(), '{}', clock_timestamp(), "
            "now() + interval '1 hour', 'no_stream: no stream captures the subject' "
            "from generate_series(1, %s::int) g",
            (rows,),
        )

    async def add_held(self, rows: int, dead: int = 100) -> None:
        """``dead`` dead rows, and ``rows`` rows of their subjects behind them."""
        await self.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, "
            "created_at, attempts, relay_dead_at, relay_retry_at, relay_last_error) "
            "select gen_random_uuid(), %s, 'bench', 'held' || g, now(), '{}', "
            "clock_timestamp(), 20, now(), 'infinity', 'too_large: an incident' "
            "from generate_series(1, %s::int) g",
            (self.event_type, dead),
        )
        await self.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, "
            "created_at) select gen_random_uuid(), %s, 'bench', 'held' || (g %% %s::int + 1), "
            "now(), '{}', clock_timestamp() from generate_series(1, %s::int) g",
            (self.event_type, dead, rows),
        )


class Consumer:
    """A core NATS subscription on the stream's subjects, noting arrival times; with
    ``keep_order``, also every arrival's id in order (copies too) and each message's
    envelope while it is small."""

    def __init__(self, nats_url: str, subject: str, *, keep_order: bool = False) -> None:
        self._url = nats_url
        self._subject = subject
        self.arrived: dict[str, float] = {}
        self._keep_order = keep_order
        self.order: list[str] = []
        self.envelopes: dict[str, dict[str, Any]] = {}
        self._nc: Client | None = None

    async def __aenter__(self) -> Consumer:
        self._nc = await nats.connect(self._url)

        async def on_message(msg: Msg) -> None:
            msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
            self.arrived.setdefault(msg_id, time.perf_counter())
            if self._keep_order:
                self.order.append(msg_id)
                if msg_id not in self.envelopes and len(msg.data) < 100_000:
                    self.envelopes[msg_id] = json.loads(msg.data)

        await self._nc.subscribe(self._subject, cb=on_message, pending_msgs_limit=2_000_000)
        await self._nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._nc is not None:
            await self._nc.close()

    async def wait_for(self, ids: set[str]) -> None:
        """Until every one of ``ids`` has arrived (callers bound it with a timeout)."""
        while not ids <= self.arrived.keys():  # noqa: ASYNC110 - arrivals come from a callback
            await asyncio.sleep(0.01)


async def produce_at_rate(
    url: str, event_type: str, rate: float, seconds: float, producers: int = 4
) -> dict[str, float]:
    """Single-row transactions at ``rate`` events/s in total from ``producers``
    connections; the time each commit was issued, by event id."""
    committed: dict[str, float] = {}
    per_producer = rate / producers

    async def producer(index: int) -> None:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            start = time.perf_counter() + index / rate  # stagger the producers
            n = 0
            while True:
                due = start + n / per_producer
                if due - start > seconds:
                    return
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                event_id = str(uuid.uuid4())
                await conn.execute(INSERT, (event_id, event_type, f"s{n % 97}", '{"n": 1}'))
                committed[event_id] = time.perf_counter()
                await conn.commit()
                n += 1

    await asyncio.gather(*(producer(i) for i in range(producers)))
    return committed


class RelayProcess:
    """`outbox-relay run` as a child process, as an operator runs it."""

    def __init__(self, url: str, nats_url: str, source: str | None = None, **settings: str) -> None:
        """``source``: a checkout whose ``relay`` package runs instead of this one."""
        self._source = source
        self._env = {
            **os.environ,
            "OUTBOX_RELAY_DATABASE_URL": url,
            "OUTBOX_RELAY_NATS_URL": nats_url,
            "OUTBOX_RELAY_METRICS_PORT": "0",
            "OUTBOX_RELAY_LOG_LEVEL": "warning",
        }
        # The relay's options by name; OpenTelemetry's variables (OTEL_*) as they are.
        self._env.update(
            {
                k if k.startswith("OTEL_") else f"OUTBOX_RELAY_{k.upper()}": v
                for k, v in settings.items()
            }
        )
        self.process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> RelayProcess:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "relay", "run", env=self._env, cwd=self._source,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 20)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on the relay's metrics endpoint (its port set
        by ``metrics_port``), 0 if it has none."""
        port = self._env["OUTBOX_RELAY_METRICS_PORT"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            return exposition.total(exposition.samples(answer.read().decode()), name)

    def cpu_seconds(self) -> float:
        """CPU time the process has used so far, user and system (/proc/PID/stat)."""
        assert self.process is not None
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        utime, stime = int(fields[11]), int(fields[12])
        return (utime + stime) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mb(self) -> float:
        """The process's peak resident memory so far (VmHWM), in MiB."""
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmHWM in /proc status")


def busy_seconds(proc_stat: str, ticks_per_second: int) -> float:
    """CPU seconds every core together has spent busy, from /proc/stat's first line:
    every state but idle and iowait (guest time is already counted in user)."""
    ticks = [int(value) for value in proc_stat.split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / ticks_per_second


def machine_busy_seconds() -> float:
    """CPU time the whole machine has used so far: the relay, Postgres, NATS, the
    kernel's network and disk work, and this benchmark."""
    return busy_seconds(Path("/proc/stat").read_text(), os.sysconf("SC_CLK_TCK"))


async def wait_until_ready(target: Target) -> None:
    """Until a relay publishes a probe event (it is connected and listening)."""
    consumer = Consumer(target.nats_url, f"{target.prefix}.>")
    async with consumer, asyncio.timeout(60):
        probes: set[str] = set()
        while not probes & consumer.arrived.keys():
            probe = str(uuid.uuid4())
            probes.add(probe)
            await target.execute(INSERT, (probe, f"{target.prefix}.probe", "probe", "{}"))
            await asyncio.sleep(0.25)


@contextlib.asynccontextmanager
async def listening(url: str, channel: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(f"listen {channel}")
        yield conn


def dumps(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=True)


@contextlib.asynccontextmanager
async def bench_target(
    database_url: str | None, nats_url: str | None, settings: tuple[str, ...] = ()
) -> AsyncIterator[Target]:
    """A database and a stream of the bench's own, on the servers named, else on
    throwaway ones on loopback (``settings``: the throwaway Postgres's own lines of
    postgresql.conf); dropped (and the servers stopped) afterwards."""
    with contextlib.ExitStack() as servers:
        if database_url is None:
            postgres = throwaway_postgres(durable=True, settings=settings)
            database_url = servers.enter_context(postgres).url
        if nats_url is None:
            nats_url = servers.enter_context(throwaway_nats()).url
        target = Target(database_url, nats_url)
        await target.create()
        try:
            yield target
        finally:
            await target.drop()
