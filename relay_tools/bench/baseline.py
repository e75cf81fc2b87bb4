"""The seed's plain design, as a reference: poll every second, claim a batch,
publish each row and wait for its ack, one UPDATE per row. Kept small and here,
in the benchmark, on purpose: it is what the relay is measured against."""

from __future__ import annotations

import asyncio
import contextlib

import nats
import psycopg

from relay.envelope import build_message
from relay.model import OutboxRow

CLAIM = (
    "select id::text, event_type, source, subject, "
    "to_char(time at time zone 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), data::text, "
    "extract(epoch from created_at)::float8, 0, attempts "
    "from outbox_events where published_at is null order by created_at limit %s "
    "for update skip locked"
)


async def plain_poller(url: str, nats_url: str, stop: asyncio.Event, batch: int = 500) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            while not stop.is_set():
                async with conn.transaction():
                    cursor = await conn.execute(CLAIM, (batch,))
                    rows: list[tuple[str, str, str, str, str, str, float, int, int]]
                    rows = await cursor.fetchall()
                    for row in rows:
                        message = build_message(OutboxRow(*row), row[4])
                        try:
                            await js.publish(
                                message.subject, message.body, headers=message.headers, timeout=5
                            )
                        except Exception:  # noqa: BLE001 - the plain design: count and move on
                            await conn.execute(
                                "update outbox_events set attempts = attempts + 1 where id = %s",
                                (row[0],),
                            )
                        else:
                            await conn.execute(
                                "update outbox_events set published_at = now() where id = %s",
                                (row[0],),
                            )
                if len(rows) < batch:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        await nc.close()
