"""What a partitioned outbox table costs the relay's claim and mark, by how many
partitions it has: the claim as the relay runs it (prepared, on its generic plan,
from a start key a few seconds back, with the relay's session settings), the same
claim without its walks' floor (as before it had one), the claim planned with its
values (as Postgres would run a prepared statement's first five executions, and five
after each new or dropped partition, but for the relay's plan_cache_mode), and a mark
of one row, each ``--count`` times, on a plain table and on one partitioned by the
minute with the same rows (``--rows`` spent rows a past partition, ``--live`` rows
to publish now), in a scratch database on ``--database-url`` (default: the shared
server's). Prints the wall time per statement, client included, and the ratio to the
plain table's; and the entries the partitioned claim holds in the server's lock table,
planned afresh (as after each partition created or dropped) and on its plan.

    python -m relay_tools.bench.partition_cost --partitions 4,13,33,63 [--live 500]
"""

from __future__ import annotations

import argparse
import time
import uuid

import psycopg
from psycopg import sql

from relay import database
from relay.claimstart import MIN_SEQ, StartKey
from relay.config import Config
from relay.database import (
    CLAIM_STATEMENT,
    GENERIC_PLAN,
    PARTITIONED_CLAIM_STATEMENT,
    partition_creation,
)
from relay.partitions import NewPartition, partition_name
from relay.sqlfiles import (
    Names,
    claim_execution,
    claim_preparation,
    mark_statement,
    partition_statement,
)
from relay_tools.bench.harness import with_database

AHEAD = 2  # future partitions, as --partitions-ahead keeps them (--ahead)


def _fill(url: str, names: Names, past: int, rows: int, live: int = 3) -> None:
    """``rows`` spent rows in each of ``past`` minutes, and ``live`` rows now."""
    minute = int(time.time() // 60) * 60
    table = names.table
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "insert into {} (id, event_type, source, subject, time, data, created_at, "
                "published_at) select gen_random_uuid(), 'a', 's', 'x' || (g %% 100), now(), "
                "'{{}}', to_timestamp(%s) + (g %% %s) * interval '1 ms' "
                "+ (g / %s) * interval '1 minute', now() from generate_series(0, %s - 1) g"
            ).format(table),
            (minute - past * 60, rows, rows, past * rows),
        )
        conn.execute(
            sql.SQL(
                "insert into {} (id, event_type, source, subject, time, data) "
                "select gen_random_uuid(), 'a', 's', 'x' || g, now(), '{{}}' "
                "from generate_series(1, %s) g"
            ).format(table),
            (live,),
        )
        conn.execute(sql.SQL("analyze {}").format(table))


def _install(url: str, names: Names, partitions: int, ahead: int) -> None:
    """The table, plain (``partitions`` 0) or partitioned by the minute, ``ahead`` of
    them past this one."""
    conninfo = database.connection_string(url)
    if partitions:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(partition_statement(names, "create_table"))
    database.install(conninfo, names)
    minute = int(time.time() // 60) * 60
    with psycopg.connect(url) as conn:
        for k in range(-(partitions - ahead - 1), ahead + 1) if partitions else ():
            start = float(minute + 60 * k)
            new = NewPartition(partition_name(names.base, start), start, start + 60)
            for statement in partition_creation(names, new):
                conn.execute(statement)


def _time_statements(
    url: str, names: Names, count: int, partitioned: bool, floor: bool = True
) -> tuple[float, float, tuple[int, int]]:
    """Seconds per claim and per one-row mark (as the relay claims and marks that
    table: a partitioned table's claim with its walks' reach and, with ``floor``, its
    floor, not looking beyond either), and the lock table entries the claim holds
    planned afresh and on its plan."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(time.time() - 5))
    start = StartKey(
        stamp,
        MIN_SEQ,
        stamp,
        ceiling="-infinity",
        beyond_from="infinity",
        floor_cap="infinity" if floor else "-infinity",
    )
    statement = PARTITIONED_CLAIM_STATEMENT if partitioned else CLAIM_STATEMENT
    config = Config(database_url=url, table=(*names.schema, names.base))
    # Never prepared by psycopg: it would deallocate the claim, too, at the first rollback.
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
        for name, value in database.Database(config).session_settings.items():
            conn.execute("select set_config(%s, %s, false)", (name, value))
        conn.execute(claim_preparation(names, statement, partitioned=partitioned))
        generic = GENERIC_PLAN if partitioned else None
        claim = claim_execution(statement, 500, 20, start, plan_cache_mode=generic)

        def one_claim() -> int:
            """The claim's lock table entries (beyond a session's fast-path slots)."""
            cursor = conn.execute(claim)
            cursor.nextset()  # past the BEGIN's result
            if partitioned:
                cursor.nextset()  # past the plan_cache_mode's
            cursor.fetchall()
            [(held,)] = conn.execute(
                "select count(*) from pg_locks where pid = pg_backend_pid() and not fastpath"
            ).fetchall()
            conn.execute("rollback")
            return int(held)

        locks = (one_claim(), one_claim())  # planned afresh, then on its plan
        for _ in range(10):  # warmed: the generic plan made, the caches filled
            one_claim()
        began = time.perf_counter()
        for _ in range(count):
            one_claim()
        claim_seconds = (time.perf_counter() - began) / count
        if partitioned and floor:
            # As Postgres runs a prepared statement's first five executions, and five
            # again after each new or dropped partition, unless told otherwise.
            custom = claim_execution(statement, 500, 20, start, plan_cache_mode="force_custom_plan")
            began = time.perf_counter()
            for _ in range(count):
                cursor = conn.execute(custom)
                cursor.nextset()
                cursor.nextset()
                cursor.fetchall()
                conn.execute("rollback")
            print(
                f"{'':>10}  partitioned claim planned with its values: "
                f"{(time.perf_counter() - began) / count * 1e6:.0f} us",
                flush=True,
            )
        [(row_id,)] = conn.execute(
            sql.SQL("select id::text from {} where published_at is null limit 1").format(
                names.table
            )
        ).fetchall()
        now = time.time()
        mark = mark_statement(names, "mark_published", partitioned)
        params = {"ids": "{" + row_id + "}", "since": now - 60, "until": now + 60}
        began = time.perf_counter()
        for _ in range(count):
            conn.execute("begin")
            conn.execute(mark, params)
            conn.execute("rollback")
        mark_seconds = (time.perf_counter() - began) / count
    return claim_seconds, mark_seconds, locks


def measure(
    server_url: str, counts: list[int], rows: int, count: int, ahead: int, *, live: int = 3
) -> None:
    name = f"outbox_relay_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    url = with_database(server_url, name)
    try:
        print(f"{'partitions':>10}  {'claim plain':>11}  {'partitioned':>11}  {'ratio':>5}  "
              f"{'no floor':>11}  {'ratio':>5}  "
              f"{'mark plain':>10}  {'partitioned':>11}  {'ratio':>5}  "
              f"{'locks planned':>13}  {'on its plan':>11}")  # fmt: skip
        for partitions in counts:
            figures = []
            for schema, n in (("plain", 0), ("partitioned", partitions)):
                names = Names.for_config(Config(table=(schema, "outbox_events")))
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(sql.SQL("drop schema if exists {} cascade").format(
                        sql.Identifier(schema)))  # fmt: skip
                    conn.execute(sql.SQL("create schema {}").format(sql.Identifier(schema)))
                _install(url, names, n, ahead)
                _fill(url, names, max(partitions - ahead - 1, 1), rows, live)
                figures.append(_time_statements(url, names, count, n > 0))
            floorless, _, _ = _time_statements(url, names, count, True, floor=False)
            (claim_plain, mark_plain, _), (claim_parts, mark_parts, locks) = figures
            print(
                f"{partitions:>10}  {claim_plain * 1e6:>8.0f} us  {claim_parts * 1e6:>8.0f} us  "
                f"{claim_parts / claim_plain:>5.2f}  {floorless * 1e6:>8.0f} us  "
                f"{floorless / claim_plain:>5.2f}  {mark_plain * 1e6:>7.0f} us  "
                f"{mark_parts * 1e6:>8.0f} us  {mark_parts / mark_plain:>5.2f}  "
                f"{locks[0]:>13,}  {locks[1]:>11,}"
            )
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--partitions", default="4,13,33,63", help="comma-separated counts")
    parser.add_argument("--rows", type=int, default=1000, help="spent rows a past partition")
    parser.add_argument("--count", type=int, default=300, help="statements timed each way")
    parser.add_argument(
        "--ahead", type=int, default=AHEAD, help="of the partitions, how many past this one"
    )
    parser.add_argument(
        "--live", type=int, default=3, help="rows to publish now (a claim takes up to 500)"
    )
    args = parser.parse_args()
    counts = [int(n) for n in args.partitions.split(",")]
    measure(args.database_url, counts, args.rows, args.count, args.ahead, live=args.live)


if __name__ == "__main__":
    main()
