"""JetStream helpers for the tests (plain asyncio; the tests themselves are sync)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, StreamConfig


@dataclass(frozen=True)
class StoredMessage:
    seq: int
    subject: str
    headers: dict[str, str]
    body: bytes
    stored_at: datetime | None = None  # the server's clock, comparable across streams

    @property
    def envelope(self) -> dict[str, Any]:
        return json.loads(self.body)

    @property
    def msg_id(self) -> str:
        return self.headers.get("Nats-Msg-Id", "")


async def _with_js(url: str, action: Any, options: dict[str, Any]) -> Any:
    # A cluster's URLs come comma-separated, as the relay takes them.
    nc = await nats.connect(url.split(","), connect_timeout=5, allow_reconnect=False, **options)
    try:
        return await action(nc.jetstream())
    finally:
        await nc.close()


def run_js(url: str, action: Any, **options: Any) -> Any:
    """``action(js)`` on a connection to ``url``; ``options`` are nats-py's connect
    options (TLS, credentials)."""
    return asyncio.run(_with_js(url, action, options))


# What a cluster answers while it elects leaders after an outage: a read asked again
# gets its answer once it has them.
CLUSTER_SETTLING = (
    nats.js.errors.ServiceUnavailableError,
    nats.errors.NoRespondersError,
    TimeoutError,
)


def read_js(url: str, action: Any, settle_timeout: float = 60.0, **options: Any) -> Any:
    """``run_js`` for a read (``action`` stores and deletes nothing), asked again while the
    server answers as a settling cluster does, for at most ``settle_timeout`` s."""
    deadline = time.monotonic() + settle_timeout
    while True:
        try:
            return run_js(url, action, **options)
        except CLUSTER_SETTLING:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class TestStream:
    """A stream of its own for one test, capturing ``<prefix>.>``."""

    __test__ = False  # not a test class, despite the name

    def __init__(
        self,
        url: str,
        connect: dict[str, Any] | None = None,
        token: str | None = None,
        **limits: Any,
    ) -> None:
        """``connect``: nats-py's connect options for a secured server; ``token``
        names the stream and its subjects (a fresh one when not given)."""
        self.url = url
        self.connect = connect or {}
        token = token or uuid.uuid4().hex[:10]
        self.name = f"T{token}"
        self.prefix = f"t{token}"
        self.create(self.name, [f"{self.prefix}.>"], **limits)

    def subject(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"

    def create(self, name: str, subjects: list[str], **limits: Any) -> None:
        async def action(js: Any) -> None:
            await js.add_stream(StreamConfig(name=name, subjects=subjects, **limits))

        run_js(self.url, action, **self.connect)

    def update(self, name: str, **changes: Any) -> None:
        async def action(js: Any) -> None:
            info = await js.stream_info(name)
            config = info.config
            for key, value in changes.items():
                setattr(config, key, value)
            await js.update_stream(config)

        run_js(self.url, action, **self.connect)

    def delete(self, name: str | None = None) -> None:
        async def action(js: Any) -> None:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(name or self.name)

        run_js(self.url, action, **self.connect)

    def read_all(self, name: str | None = None) -> list[StoredMessage]:
        """Every message, in stream order, through one ephemeral pull consumer (fast
        for large streams; ``read`` fetches message by message)."""

        async def action(js: Any) -> list[StoredMessage]:
            stream = name or self.name
            info = await js.stream_info(stream)
            total = info.state.messages
            out: list[StoredMessage] = []
            if total == 0:
                return out
            sub = await js.pull_subscribe(
                ">", stream=stream,
                config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                                      inactive_threshold=30.0),
            )  # fmt: skip
            while len(out) < total:
                for msg in await sub.fetch(min(1000, total - len(out)), timeout=10):
                    meta = msg.metadata
                    out.append(StoredMessage(meta.sequence.stream, msg.subject,
                                             dict(msg.headers or {}), msg.data or b"",
                                             meta.timestamp))  # fmt: skip
            await sub.unsubscribe()
            return out

        return read_js(self.url, action, **self.connect)

    def read(self, name: str | None = None) -> list[StoredMessage]:
        """Every message in the stream, in stream order."""

        async def action(js: Any) -> list[StoredMessage]:
            stream = name or self.name
            info = await js.stream_info(stream)
            out: list[StoredMessage] = []
            if info.state.messages == 0:
                return out
            seq = info.state.first_seq
            while seq <= info.state.last_seq:
                try:
                    msg = await js.get_msg(stream, seq)
                except nats.js.errors.NotFoundError:
                    seq += 1
                    continue
                headers = dict(msg.headers or {})
                out.append(StoredMessage(seq, msg.subject, headers, msg.data or b"", msg.time))
                seq += 1
            return out

        return read_js(self.url, action, **self.connect)


DISCARD_NEW = DiscardPolicy.NEW
