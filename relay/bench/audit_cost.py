"""What `outbox-relay audit` costs on a large table: throwaway Postgres and NATS,
``--rows`` rows drained by the relay into one stream, then the audit run as a
user runs it, timed, with its peak memory; then again after 100 messages were
deleted from the stream (it must find exactly those).

    python -m relay.bench.audit_cost --rows 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import nats
import psycopg

from relay.config import Config
from relay.database import connection_string, install
from relay.localservers import ThrowawayNats, ThrowawayPostgres
from relay.sqlfiles import Names

STREAM = "EVENTS"
FILL = (
    "insert into outbox_events (id, event_type, source, subject, time, data) "
    "select gen_random_uuid(), 'cost.e' || (i %% 20), 'bench', 'entity-' || (i %% 1000), "
    'now(), \'{"order": 12345, "amount": "99.95", "currency": "EUR"}\' '
    "from generate_series(1, %s) i"
)
LOST = 100


async def _nats(url: str, rows: int, delete: bool) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    if delete:
        step = max(rows // LOST, 1)
        for seq in range(step, step * LOST + 1, step):
            await js.delete_msg(STREAM, seq)
    else:
        await js.add_stream(name=STREAM, subjects=["cost.>"])
    await nc.close()


def _audit(env: dict[str, str]) -> str:
    """One `outbox-relay audit --json` as a subprocess, under /usr/bin/time."""
    result = subprocess.run(
        ["/usr/bin/time", "-f", "%e %M", sys.executable, "-m", "relay", "audit", "--json"],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    report = json.loads(result.stdout)
    wall, peak_kb = result.stderr.strip().splitlines()[-1].split()
    return (
        f"exit {result.returncode}, checked {report['checked']}, missing "
        f"{len(report['missing'])}, expired {report['expired']}; the audit {report['seconds']}s, "
        f"the process {wall}s and {int(peak_kb) / 1024:.0f} MiB at its peak"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    rows = parser.parse_args().rows
    postgres, broker = ThrowawayPostgres(), ThrowawayNats()
    try:
        postgres.start()
        broker.start()
        install(connection_string(postgres.url), Names.for_config(Config()))
        asyncio.run(_nats(broker.url, rows, delete=False))
        with psycopg.connect(postgres.url, autocommit=True) as conn:
            conn.execute(FILL, (rows,))
            env = {
                **os.environ,
                "OUTBOX_RELAY_DATABASE_URL": postgres.url,
                "OUTBOX_RELAY_NATS_URL": broker.url,
                "OUTBOX_RELAY_METRICS_PORT": "0",
            }
            started = time.monotonic()
            relay = subprocess.Popen(
                [sys.executable, "-m", "relay", "run"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            unpublished = "select count(*) from outbox_events where published_at is null"
            while (conn.execute(unpublished).fetchone() or (0,))[0]:
                time.sleep(1)
            drained = time.monotonic() - started
            relay.terminate()
            relay.wait(30)
        print(f"{rows} rows drained in {drained:.0f}s ({rows / drained:.0f} rows/s)", flush=True)
        print(f"audit: {_audit(env)}", flush=True)
        asyncio.run(_nats(broker.url, rows, delete=True))
        print(f"audit after deleting {LOST} messages: {_audit(env)}", flush=True)
    finally:
        postgres.destroy()
        broker.destroy()


if __name__ == "__main__":
    main()
