"""Where the installed table's cost to producers goes: pgbench's 8 clients inserting
single outbox rows (one per transaction) into tables that differ by one part at a
time, in turns, ``--repetitions`` times, on a throwaway Postgres (durable, as
producers' databases are), no relay running. Each arrangement is a table of its own
in a schema of its own, built by `outbox-relay install` and then stripped:

- contract: the seed's table and index alone;
- columns: and the relay's columns (nullable, no default);
- indexes: and the relay's indexes (the claim index is the only one an insert enters);
- relay_seq: and relay_seq's default (nextval) and the check that holds it;
- late trigger: and the late-row trigger (its WHEN; the function runs for late rows);
- installed: and the wake-up trigger: the table as `install` leaves it;
- installed before: as the install before this change left it (a sequence without
  CACHE, a wake-up trigger without WHEN, whose function ran for every insert);
- partitioned: the installed table made by `install --partitions 1d` (range
  partitions of a day on created_at, the key (id, created_at));
- with ``--cdc``, contract with a CDC slot: the contract's table alone on a second
  throwaway Postgres with `wal_level = logical`, published, and a logical slot read
  as Debezium and Sequin read theirs (the pgoutput plugin, by `pg_recvlogical`, on
  the same machine as the server, as a walsender is).

Prints each arrangement's ratio to the contract's table (the median of each
repetition's, each arrangement against the contract's turn of the same repetition),
and its commits/s (median, and each repetition).

    python -m relay_tools.bench.producer_cost --repetitions 5 [--cdc]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import time
from collections.abc import Iterator

import psycopg
from psycopg import sql

from relay.config import Config
from relay.database import first_partitions
from relay.sqlfiles import Names, install_script, partition_statement
from relay_tools.bench.harness import bench_target
from relay_tools.bench.measure import pgbench_commits
from relay_tools.localservers import postgres_binary, throwaway_postgres

SECONDS = 8.0
CONTRACT = """
create table {table} (
  id uuid primary key, event_type text not null, source text not null,
  subject text not null, time timestamptz not null, data jsonb not null,
  created_at timestamptz not null default now(), published_at timestamptz null,
  attempts int not null default 0);
create index outbox_events_unpublished_idx on {table} (created_at) where published_at is null;
"""
_WAKEUP = "drop trigger outbox_events_relay_notify on {table}"
_LATE = "drop trigger zz_outbox_events_relay_late on {table}"
_SEQ = (
    "alter table {table} drop constraint outbox_events_relay_seq_set",
    "alter table {table} alter relay_seq drop default",
)
_INDEXES = tuple(
    f"drop index {{schema}}.outbox_events_relay_{name}_idx"
    for name in ("claim", "waiting", "published", "late")
)
_BEFORE = (
    "alter sequence {schema}.outbox_events_relay_seq cache 1",
    _WAKEUP,
    "create trigger outbox_events_relay_notify after insert on {table} for each statement "
    "execute function {schema}.outbox_events_relay_notify()",
)
# Each arrangement: what is taken away from the installed table (None: the contract's).
ARRANGEMENTS: dict[str, tuple[str, ...] | None] = {
    "contract": None,
    "columns": (_WAKEUP, _LATE, *_SEQ, *_INDEXES),
    "indexes": (_WAKEUP, _LATE, *_SEQ),
    "relay_seq": (_WAKEUP, _LATE),
    "late trigger": (_WAKEUP,),
    "installed": (),
    "installed before": _BEFORE,
    "partitioned": (),
}
# Arrangements whose table `install --partitions` makes, with their period.
PARTITIONED = {"partitioned": 86400.0}
# The contract's table on a server that feeds a CDC reader (measured with --cdc).
CDC = "contract, CDC slot"
CDC_SETTINGS = ("wal_level = logical", "max_wal_senders = 4", "max_replication_slots = 4")
CDC_NAME = "producer_cost_cdc"  # its publication's and its slot's
EVENT_TYPE = "bench.created"


def _schema(arrangement: str) -> str:
    return "producer_cost_" + arrangement.replace(" ", "_")


async def build(url: str) -> None:
    """Every arrangement's table, each in its schema, empty."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for arrangement, stripped in ARRANGEMENTS.items():
            schema = _schema(arrangement)
            table = f"{schema}.outbox_events"
            await conn.execute(
                sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(schema))
            )
            await conn.execute(sql.SQL("create schema {}").format(sql.Identifier(schema)))
            names = Names.for_config(Config(table=(schema, "outbox_events")))
            period = PARTITIONED.get(arrangement)
            if period is None:
                await conn.execute(CONTRACT.format(table=table).encode())
            else:
                await conn.execute(partition_statement(names, "create_table"))
            if stripped is None:
                continue
            for statement in install_script(names):
                await conn.execute(statement)
            if period is not None:
                for statement in first_partitions(names, period, period, time.time()):
                    await conn.execute(statement)
            for change in stripped:
                await conn.execute(change.format(table=table, schema=schema).encode())


async def build_cdc(url: str) -> str:
    """The contract's table, published, and a logical slot for it; the table's name."""
    table = "public.outbox_events"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(CONTRACT.format(table=table).encode())
        await conn.execute(f"create publication {CDC_NAME} for table {table}".encode())
        await conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (CDC_NAME,))
    return table


@contextlib.contextmanager
def cdc_reader(url: str) -> Iterator[None]:
    """The slot read for as long as the block runs, its changes thrown away (-F 0:
    no fsync of its output, which goes to /dev/null; progress is still reported)."""
    reader = subprocess.Popen(
        [postgres_binary("pg_recvlogical"), "-d", url, "--slot", CDC_NAME, "--start",
         "-o", "proto_version=1", "-o", f"publication_names={CDC_NAME}",
         "-F", "0", "-s", "1", "-f", "-"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        yield
    finally:
        exited = reader.poll()
        reader.terminate()
        _, errors = reader.communicate(timeout=10)
    if exited is not None:  # the figures were taken without a reader
        raise RuntimeError(f"pg_recvlogical exited while it was to read: {errors.decode()}")


async def measure(
    url: str, repetitions: int, seconds: float = SECONDS, cdc_url: str | None = None
) -> dict[str, list[float]]:
    """Commits/s of each arrangement, in turns (the order reversed each repetition),
    each table emptied after its turn; with ``cdc_url`` (a server with CDC_SETTINGS),
    the CDC arrangement there too."""
    await build(url)
    tables = {(url, f"{_schema(name)}.outbox_events"): name for name in ARRANGEMENTS}
    with contextlib.ExitStack() as readers:
        if cdc_url is not None:
            tables[(cdc_url, await build_cdc(cdc_url))] = CDC
            readers.enter_context(cdc_reader(cdc_url))
        results: dict[str, list[float]] = {name: [] for name in tables.values()}
        turns = list(tables.items())
        for _ in range(repetitions):
            for (server, table), arrangement in turns:
                results[arrangement].append(
                    await asyncio.to_thread(pgbench_commits, server, EVENT_TYPE, seconds, 8, table)
                )
                async with await psycopg.AsyncConnection.connect(server, autocommit=True) as conn:
                    await conn.execute(f"truncate {table}".encode())
                    await conn.execute("checkpoint")
            turns.reverse()  # so that a drift of the machine's rate favours no turn
    return results


def paired_ratios(results: dict[str, list[float]], arrangement: str) -> list[float]:
    """An arrangement's commits/s over the contract table's in the same repetition:
    the machine's rate drifts over a run (by a third here, a disk shared with other
    machines), and a turn is best compared with the turns beside it."""
    return [run / base for run, base in zip(results[arrangement], results["contract"], strict=True)]


def render(results: dict[str, list[float]]) -> str:
    lines = []
    for arrangement, runs in results.items():
        ratios = paired_ratios(results, arrangement)
        lines.append(
            f"{arrangement:>18}: {statistics.median(ratios):.3f} of the contract's table, "
            f"median of each repetition's ({', '.join(f'{r:.3f}' for r in ratios)}); "
            f"{statistics.median(runs):,.0f} commits/s median "
            f"({', '.join(f'{r:,.0f}' for r in runs)})"
        )
    return "\n".join(lines)


async def _main(repetitions: int, cdc: bool) -> dict[str, list[float]]:
    with contextlib.ExitStack() as servers:
        cdc_url = None
        if cdc:
            cdc_server = throwaway_postgres(durable=True, settings=CDC_SETTINGS)
            cdc_url = servers.enter_context(cdc_server).url
        async with bench_target(None, None) as target:
            return await measure(target.url, repetitions, cdc_url=cdc_url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument(
        "--cdc", action="store_true", help="also the contract's table feeding a CDC slot"
    )
    args = parser.parse_args()
    print(render(asyncio.run(_main(args.repetitions, args.cdc))))


if __name__ == "__main__":
    main()
