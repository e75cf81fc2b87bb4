"""Commit-to-consumer latency and relay CPU per event at a steady rate, for relays
from other checkouts in other publish modes, in turns in one run: how the threshold
under which a stream's rows go per message instead of as a fast batch
(``MIN_BATCH_MESSAGES``, ``relay/streams.py``) was chosen.

Each ``--relay DIR:MODE`` runs ``outbox-relay run`` from the checkout in DIR (say a
worktree with the threshold changed) with ``--publish-mode MODE``, into a stream that
allows fast and atomic batches, on throwaway Postgres and nats-server 2.15 servers;
the producers are four Python connections, one row a transaction.

    python -m relay_tools.bench.publish_latency --rate 1000 --seconds 15 \\
        --repetitions 3 --relay /tmp/t2:batch --relay /tmp/t32:batch --relay .:message
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import dataclass

from relay_tools.bench.harness import (
    Consumer,
    RelayProcess,
    Target,
    produce_at_rate,
    wait_until_ready,
)
from relay_tools.bench.stats import percentile
from relay_tools.localservers import ThrowawayNats, ThrowawayPostgres


@dataclass(frozen=True)
class Turn:
    p50_ms: float
    p99_ms: float
    cpu_us_per_event: float


async def _turn(target: Target, source: str, mode: str, rate: float, seconds: float) -> Turn:
    async with Consumer(target.nats_url, f"{target.prefix}.>") as consumer:
        relay = RelayProcess(target.url, target.nats_url, source=source, publish_mode=mode)
        async with relay:
            await wait_until_ready(target)
            cpu = relay.cpu_seconds()
            committed = await produce_at_rate(target.url, target.event_type, rate, seconds)
            async with asyncio.timeout(30):
                await consumer.wait_for(set(committed))
            cpu = relay.cpu_seconds() - cpu
    latencies = [consumer.arrived[event_id] - at for event_id, at in committed.items()]
    return Turn(
        percentile(latencies, 0.5) * 1000,
        percentile(latencies, 0.99) * 1000,
        cpu * 1e6 / len(latencies),
    )


async def _run(target: Target, relays: list[str], rate: float, seconds: float, reps: int) -> None:
    await target.create()
    await target.allow_batches(True)
    turns: dict[str, list[Turn]] = {relay: [] for relay in relays}
    for rep in range(reps):
        for relay in relays:
            source, mode = relay.rsplit(":", 1)
            await target.reset()
            turn = await _turn(target, source, mode, rate, seconds)
            turns[relay].append(turn)
            print(
                f"{rep + 1}/{reps} {relay}: p50 {turn.p50_ms:.2f} ms, p99 {turn.p99_ms:.2f} ms, "
                f"CPU {turn.cpu_us_per_event:.0f} us an event",
                flush=True,
            )
    print(f"medians at {rate:g} events/s, {reps} turns of {seconds:g} s each:")
    for relay, each in turns.items():
        print(
            f"  {relay}: p50 {statistics.median(t.p50_ms for t in each):.2f} ms, "
            f"p99 {statistics.median(t.p99_ms for t in each):.2f} ms "
            f"({', '.join(f'{t.p99_ms:.1f}' for t in each)}), "
            f"CPU {statistics.median(t.cpu_us_per_event for t in each):.0f} us an event"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s")
    parser.add_argument("--seconds", type=float, default=15.0, help="produced a turn")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument(
        "--relay", action="append", required=True, metavar="DIR:MODE",
        help="a checkout and the --publish-mode to run it in (repeat)",
    )  # fmt: skip
    args = parser.parse_args()
    postgres, broker = ThrowawayPostgres(), ThrowawayNats()
    try:
        postgres.start()
        broker.start()
        target = Target(postgres.url, broker.url)
        asyncio.run(_run(target, args.relay, args.rate, args.seconds, args.repetitions))
    finally:
        postgres.destroy()
        broker.destroy()


if __name__ == "__main__":
    main()
