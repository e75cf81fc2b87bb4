"""What `outbox-relay audit` costs on a large table: throwaway Postgres and NATS,
``--rows`` rows drained by the relay into one stream, then the audit run as a
user runs it, timed, with its peak memory; then again after 100 messages were
deleted from the stream (it must find exactly those).

    python -m relay_tools.bench.audit_cost --rows 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys

import nats

from relay_tools.bench.harness import RelayProcess, Target
from relay_tools.localservers import ThrowawayNats, ThrowawayPostgres

LOST = 100


async def _published(target: Target, rows: int) -> None:
    """``rows`` rows in ``target``'s table, drained by the relay into its stream."""
    await target.create()
    await target.fill(rows)
    async with RelayProcess(target.url, target.nats_url):
        await target.wait_until_drained(1.0)


async def _lose_messages(target: Target, rows: int) -> None:
    """Delete ``LOST`` messages spread over the stream."""
    nc = await nats.connect(target.nats_url)
    js = nc.jetstream()
    step = max(rows // LOST, 1)
    for seq in range(step, step * LOST + 1, step):
        await js.delete_msg(target.stream, seq)
    await nc.close()


def _audit(target: Target) -> str:
    """One `outbox-relay audit --json` as a subprocess, under /usr/bin/time."""
    env = {
        **os.environ,
        "OUTBOX_RELAY_DATABASE_URL": target.url,
        "OUTBOX_RELAY_NATS_URL": target.nats_url,
    }
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
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    rows = parser.parse_args().rows
    postgres, broker = ThrowawayPostgres(), ThrowawayNats()
    try:
        postgres.start()
        broker.start()
        target = Target(postgres.url, broker.url)
        asyncio.run(_published(target, rows))
        print(f"{rows} rows published", flush=True)
        print(f"audit: {_audit(target)}", flush=True)
        asyncio.run(_lose_messages(target, rows))
        print(f"audit after deleting {LOST} messages: {_audit(target)}", flush=True)
    finally:
        postgres.destroy()
        broker.destroy()


if __name__ == "__main__":
    main()
