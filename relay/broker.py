"""The only door to NATS: connect, and publish a wave of messages pipelined.

nats-py errors are translated here into :class:`~relay.model.Failed` values
(one per message) or :class:`~relay.errors.BrokerUnavailable`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck

from relay import aio
from relay.config import redact_url
from relay.envelope import Message
from relay.errors import BrokerUnavailable
from relay.model import Acked, Failed, FailureReason, PublishResult

log = logging.getLogger(__name__)

_DISCONNECTED_ERRORS = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
)


def classify(exc: BaseException) -> Failed:  # noqa: PLR0911 - a lookup table, one return a row
    """The failure a publish exception stands for."""
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return Failed(FailureReason.NO_STREAM, "no stream captures the subject (no responders)")
    if isinstance(exc, nats.errors.MaxPayloadError):
        return Failed(FailureReason.TOO_LARGE, "message exceeds the server's max_payload")
    if isinstance(exc, nats.errors.BadSubjectError):
        return Failed(FailureReason.INVALID_SUBJECT, "the client rejected the subject")
    if isinstance(exc, _DISCONNECTED_ERRORS):
        return Failed(FailureReason.DISCONNECTED, f"not connected to NATS ({exc})")
    if isinstance(exc, asyncio.TimeoutError | nats.errors.TimeoutError):
        return Failed(FailureReason.TIMEOUT, "no ack before the publish timeout")
    if isinstance(exc, nats.js.errors.APIError):
        return Failed(FailureReason.OTHER, f"JetStream refused the message: {exc}")
    return Failed(FailureReason.OTHER, f"{exc.__class__.__name__}: {exc}")


class Broker:
    def __init__(
        self,
        urls: Sequence[str],
        on_connection_change: Callable[[bool], None],
        name: str = "outbox-relay",
    ) -> None:
        self._urls = list(urls)
        self._name = name
        self._on_change = on_connection_change
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def max_payload(self) -> int:
        if self._nc is None:
            raise BrokerUnavailable("not connected to NATS")
        return self._nc.max_payload

    async def connect(self) -> None:
        """One try to connect. Once connected, nats-py reconnects by itself, forever,
        and the callbacks keep :attr:`connected` and the caller informed."""

        async def disconnected() -> None:
            if self._nc is not None:  # not while close() is closing it
                log.warning("NATS connection lost; reconnecting")
            self._on_change(False)

        async def reconnected() -> None:
            url = self._nc.connected_url if self._nc else None
            log.info("NATS reconnected to %s", redact_url(url.geturl()) if url else "?")
            self._on_change(True)

        async def error(exc: Exception) -> None:
            log.warning("NATS client error: %s", exc)

        async def closed() -> None:
            self._on_change(False)

        try:
            self._nc = await aio.call(
                nats.connect,
                servers=self._urls,
                name=self._name,
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                ping_interval=5,
                max_outstanding_pings=2,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                error_cb=error,
                closed_cb=closed,
            )
        except Exception as exc:
            servers = ", ".join(redact_url(u) for u in self._urls)
            raise BrokerUnavailable(f"cannot connect to NATS at {servers}: {exc}") from exc
        self._js = self._nc.jetstream()
        self._on_change(True)

    async def close(self) -> None:
        if self._nc is not None:
            nc, self._nc = self._nc, None
            try:
                await aio.call(nc.close)
            except Exception as exc:  # noqa: BLE001 - closing is best effort
                log.debug("closing NATS: %s", exc)

    async def publish_wave(self, messages: Sequence[Message], budget: float) -> list[PublishResult]:
        """Publish ``messages`` pipelined and wait up to ``budget`` seconds for their
        acks. One result per message, in order; never raises for a message.

        The budget is explicit, not a trio cancel scope, because cancelling would
        throw away the acks that did arrive; each of those is a row to mark."""
        if self._js is None or not self.connected:
            return [Failed(FailureReason.DISCONNECTED, "not connected to NATS")] * len(messages)
        results = await aio.call(self._publish_all, self._js, messages, budget)
        return await self._confirm_no_stream(messages, results)

    async def _publish_all(
        self, js: JetStreamContext, messages: Sequence[Message], budget: float
    ) -> list[PublishResult]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        sent: list[asyncio.Future[PubAck] | Failed] = []
        for message in messages:
            try:
                future = await js.publish_async(
                    message.subject,
                    message.body,
                    headers=dict(message.headers),
                    wait_stall=max(0.0, deadline - loop.time()),
                )
                sent.append(future)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a value
                sent.append(classify(exc))
        waiting = [item for item in sent if isinstance(item, asyncio.Future)]
        if waiting:
            _, late = await asyncio.wait(waiting, timeout=max(0.0, deadline - loop.time()))
            for future in late:
                future.cancel()
        connected = self.connected
        results: list[PublishResult] = []
        for item in sent:
            if isinstance(item, Failed):
                results.append(item)
            elif item.cancelled():
                results.append(
                    Failed(FailureReason.TIMEOUT, "no ack before the publish timeout")
                    if connected
                    else Failed(FailureReason.DISCONNECTED, "connection lost before the ack")
                )
            elif item.exception() is not None:
                results.append(classify(item.exception()))  # type: ignore[arg-type] # checked just above
            else:
                ack = item.result()
                results.append(Acked(duplicate=bool(getattr(ack, "duplicate", False))))
        return results

    async def _confirm_no_stream(
        self, messages: Sequence[Message], results: list[PublishResult]
    ) -> list[PublishResult]:
        """ "No responders" also happens for a moment while a stream elects a leader.
        A row only goes to the cap for it once JetStream confirms that no stream
        captures the subject; otherwise it is an ordinary, retried failure."""
        verdicts: dict[str, bool] = {}
        confirmed: list[PublishResult] = []
        for message, result in zip(messages, results, strict=True):
            if isinstance(result, Failed) and result.reason is FailureReason.NO_STREAM:
                if message.subject not in verdicts:
                    verdicts[message.subject] = await self._no_stream_for(message.subject)
                if not verdicts[message.subject]:
                    confirmed.append(
                        Failed(
                            FailureReason.OTHER, "no responders, but a stream captures the subject"
                        )
                    )
                    continue
            confirmed.append(result)
        return confirmed

    async def _no_stream_for(self, subject: str) -> bool:
        if self._js is None:
            return False
        try:
            await aio.call(self._js.find_stream_name_by_subject, subject)
        except nats.js.errors.NotFoundError:
            return True
        except Exception as exc:  # noqa: BLE001 - unsure means retry, not give up
            log.warning("could not ask JetStream which stream captures %r: %s", subject, exc)
            return False
        return False
