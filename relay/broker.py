"""The relay's door to NATS for publishing: connect, publish a wave of messages
pipelined or a batch, read the streams' publish modes. (The audit reads the streams
through its own connection: relay/audit.py.)

nats-py errors are translated into :class:`~relay.model.Failed` values, one per
message (relay/replies.py), or :class:`~relay.errors.BrokerUnavailable`; the frames
and inboxes of a wave or a batch are in relay/inboxes.py.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import nats
import nats.errors
import nats.js.errors
import trio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from relay import aio
from relay.batchreplies import (
    AtomicBatch,
    FastBatch,
    Reply,
    decode,
    decode_failure,
)
from relay.config import Config, redact_nats_url
from relay.envelope import Message
from relay.errors import BrokerUnavailable
from relay.inboxes import (
    AckInbox,
    BatchInbox,
    Wave,
    atomic_batch_headers,
    batch_outcome,
    fast_batch_reply,
    hpub_frame,
)
from relay.logs import RepeatedWarnings
from relay.model import Failed, FailureReason, PublishResult
from relay.natsinternals import bound_unacknowledged_data, queue_frames, send_queued
from relay.natsinternals import check as check_nats_internals
from relay.replies import NO_STREAM, NO_STREAM_QUESTION_TIMEOUT, api_error, denied_subject
from relay.streams import (
    PublishMode,
    StreamModes,
    StreamModesCache,
    choose_mode,
    describe_modes,
    stream_for,
)

log = logging.getLogger(__name__)

# The stream changes heard as they happen (relay/streams.py StreamModesCache says
# how long a read is trusted otherwise), and how long a read may take.
STREAM_ADVISORIES = ("CREATED", "UPDATED", "DELETED")
STREAM_MODES_READ_TIMEOUT = 1.0


def nats_auth_options(config: Config) -> dict[str, Any]:
    """nats-py's connect options for how the relay proves who it is to NATS and
    checks who NATS is (a user and password in the URLs nats-py reads by itself)."""
    options: dict[str, Any] = {}
    if config.nats_creds:
        options["user_credentials"] = config.nats_creds
    if config.nats_nkey:
        options["nkeys_seed"] = config.nats_nkey
    if config.nats_token:
        options["token"] = config.nats_token
    if config.nats_tls_ca or config.nats_tls_cert:
        # Verifies the server's certificate and its host name, as the default does.
        context = ssl.create_default_context(cafile=config.nats_tls_ca)
        if config.nats_tls_cert:
            context.load_cert_chain(config.nats_tls_cert, config.nats_tls_key)
        options["tls"] = context
    return options


class Broker:
    def __init__(
        self,
        urls: Sequence[str],
        on_connection_change: Callable[[bool], None],
        *,
        name: str = "outbox-relay",
        auth_options: Mapping[str, Any] | None = None,
        publish_mode: str = "auto",
        on_modes_change: Callable[[Mapping[str, PublishMode]], None] | None = None,
        on_batch: Callable[[PublishMode, str], None] | None = None,
    ) -> None:
        self._urls = list(urls)
        self._name = name
        self._auth_options = dict(auth_options or {})
        self._on_change = on_connection_change
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._acks: AckInbox | None = None
        self._batch_replies: BatchInbox | None = None
        self._warnings = RepeatedWarnings(log)
        self._publish_mode = publish_mode
        self._on_modes_change = on_modes_change
        self._on_batch = on_batch or (lambda mode, outcome: None)
        self._stream_modes = StreamModesCache()
        self._server_version: tuple[int, int, int] | None = None
        self._modes: dict[str, PublishMode] = {}
        self._streams_reading: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def client(self) -> Client | None:
        """The connection, for the audit's reads (asyncio side); None while down."""
        return self._nc if self.connected else None

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
            log.info("NATS reconnected to %s", redact_nats_url(url.geturl()) if url else "?")
            self._stream_modes.changed()  # a change while away sent no advisory here
            self._server_version = None  # perhaps another server of the cluster
            if self._nc is not None:
                bound_unacknowledged_data(self._nc)  # the new connection's socket
            self._on_change(True)

        async def error(exc: Exception) -> None:
            subject = denied_subject(str(exc))
            if subject is not None and self._acks is not None:
                self._acks.deny(subject)
            self._warnings.warn(f"NATS client error: {exc}")

        async def closed() -> None:
            self._on_change(False)

        self._server_version = None
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
                **self._auth_options,
            )
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            servers = ", ".join(redact_nats_url(u) for u in self._urls)
            raise BrokerUnavailable(f"cannot connect to NATS at {servers}: {exc}") from exc
        check_nats_internals(self._nc)
        if not bound_unacknowledged_data(self._nc):
            log.warning(
                "cannot bound unacknowledged data on the NATS socket (this nats-py hides "
                "it): a path that drops packets may take minutes to notice"
            )
        self._js = self._nc.jetstream()
        await aio.call(self._watch_streams, self._nc)
        self._on_change(True)

    async def _watch_streams(self, nc: Client) -> None:
        """asyncio side: a stream created, changed or deleted makes the next batch
        read the streams' modes first, instead of up to STREAM_MODES_TTL later (a
        stream scaled to three replicas must stop getting fast batches at once).
        Without the permission to subscribe, the server refuses, the client error
        is logged, and the periodic read remains."""

        async def changed(msg: Msg) -> None:
            stream = msg.subject.rsplit(".", 1)[-1]
            action = msg.subject.split(".")[-2].lower()
            log.info("stream %s %s: reading the streams' publish modes again", stream, action)
            self._stream_modes.changed()

        for action in STREAM_ADVISORIES:
            await nc.subscribe(f"$JS.EVENT.ADVISORY.STREAM.{action}.*", cb=changed)

    async def duplicate_windows(self) -> list[tuple[str, float]]:
        """Every stream this connection can see, with its duplicate window in seconds."""
        try:
            configs = await aio.call(self._stream_configs)
        except Exception as exc:
            raise BrokerUnavailable(f"cannot list the JetStream streams: {exc}") from exc
        return [(c.name or "?", c.duplicate_window or 0.0) for c in configs]

    async def _stream_configs(self) -> list[Any]:
        """asyncio side: every stream's configuration (STREAM.LIST, pages of 256)."""
        js = self._js
        if js is None:
            raise BrokerUnavailable("not connected to NATS")
        found: list[Any] = []
        while page := await js.streams_info(offset=len(found)):
            found += [info.config for info in page]
        return found

    @property
    def server_version(self) -> tuple[int, int, int]:
        """The connected server's version, read once a connection: nats-py parses the
        server's version string with a regular expression at every ask, and each batch
        asks."""
        nc = self._nc
        if nc is None:
            return (0, 0, 0)
        if self._server_version is None:
            try:
                version = nc.connected_server_version
                self._server_version = (version.major, version.minor, version.patch)
            except Exception:  # noqa: BLE001 - an unparsable version: assume the oldest
                self._server_version = (0, 0, 0)
        return self._server_version

    async def publish_modes(self, subjects: Iterable[str]) -> dict[str, tuple[PublishMode, str]]:
        """trio side: for each subject, the mode to publish it with and the stream
        that captures it ("" for none), from what was last read of the streams. Once
        that is STREAM_MODES_TTL seconds old, it is read again beside the batch, not
        in its way: a batch holds its row locks, and a read can take up to
        STREAM_MODES_READ_TIMEOUT. After a (re)connect or a stream's change a batch
        waits for a read; until one succeeds, every subject goes per message. Only a
        read crosses into asyncio."""
        cache = self._stream_modes
        now = trio.current_time()
        if cache.must_read_first(now):
            # Nothing read since connect or since a stream changed: read now, or a
            # stream that takes batches would get its first rows per message.
            await aio.call(self._read_stream_modes_now)
        elif cache.may_refresh(now) and (
            self._streams_reading is None or self._streams_reading.done()
        ):
            await aio.call(self._refresh_stream_modes)
        streams = cache.known()
        version = self.server_version
        plan: dict[str, tuple[PublishMode, str]] = {}
        for subject in subjects:
            stream = stream_for(subject, streams)
            mode = choose_mode(stream, version, self._publish_mode)
            plan[subject] = (mode, stream.name if stream else "")
        return plan

    async def _refresh_stream_modes(self) -> None:
        """asyncio side: read the streams' modes in a task of its own."""
        loop = asyncio.get_running_loop()
        self._streams_reading = loop.create_task(self._read_stream_modes(loop))

    def forget_stream_modes(self) -> None:
        """Read the streams' modes again before the next batch (one turned a batch down)."""
        self._stream_modes.forget()

    async def read_publish_modes(self) -> None:
        """Read the streams' publish modes now (at connect, so the log says them at
        start); a failure is logged at debug level and the first batch reads again."""
        await aio.call(self._read_stream_modes_now)

    async def _read_stream_modes_now(self) -> None:
        await self._read_stream_modes(asyncio.get_running_loop())

    async def _read_stream_modes(self, loop: asyncio.AbstractEventLoop) -> None:
        cache = self._stream_modes
        token = cache.read_started()
        try:
            configs = await asyncio.wait_for(self._stream_configs(), STREAM_MODES_READ_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - keep what was known, try again soon
            log.warning("could not read the streams' publish modes: %s", exc)
            cache.read_failed(loop.time())
            return
        streams = [
            StreamModes(
                name=c.name or "?",
                subjects=tuple(c.subjects or ()),
                allow_batched=bool(getattr(c, "allow_batched", False)),
                allow_atomic=bool(getattr(c, "allow_atomic", False)),
                replicas=c.num_replicas or 1,
            )
            for c in configs
        ]
        if not cache.read_done(token, streams, loop.time()):
            return  # a stream changed while this read ran: the next batch reads again
        version = self.server_version
        modes = {s.name: choose_mode(s, version, self._publish_mode) for s in streams}
        if modes != self._modes:
            self._modes = modes
            log.info(
                "publish modes (server %s, --publish-mode %s): %s",
                ".".join(map(str, version)),
                self._publish_mode,
                describe_modes(modes),
            )
            for stream in streams:
                if stream.allow_batched and not stream.fast_batches_safe:
                    log.info(
                        "stream %s allows fast batches but has %d replicas: its rows go "
                        "%s (a replicated stream can ack a fast batch it has not stored)",
                        stream.name,
                        stream.replicas,
                        modes[stream.name],
                    )
            if self._on_modes_change is not None:
                self._on_modes_change(modes)

    async def close(self) -> None:
        if self._nc is not None:
            nc, self._nc = self._nc, None
            try:
                await aio.call(nc.close)
            except Exception as exc:  # noqa: BLE001 - closing is best effort
                log.debug("closing NATS: %s", exc)

    async def publish_wave(self, messages: Sequence[Message], budget: float) -> list[PublishResult]:
        """trio side: publish ``messages`` pipelined and wait up to ``budget`` seconds
        for their acks. One result per message, in order; never raises for a message.

        Sent by writing nats-py's transport directly and waited on as a trio event
        that the acks' callbacks set (relay.inboxes.Wave): no crossing into asyncio,
        but to make the ack inbox once, and to ask JetStream about "no responders".
        The budget is explicit, not a cancellation, because cancelling would throw
        away the acks that did arrive; each of those is a row to mark."""
        nc = self._nc
        if nc is None or self._js is None or not self.connected:
            return [Failed(FailureReason.DISCONNECTED, "not connected to NATS")] * len(messages)
        deadline = trio.current_time() + budget
        acks = self._acks if self._acks is not None else (await aio.call(self._inboxes, nc))[0]
        wave = Wave(len(messages))
        # Frames of our own, as a batch's: nats-py's publish checks each header name
        # with a regular expression and encodes it apart, which cost a traced row
        # (five headers) more than all else the relay does for it (docs/performance.md).
        # Subjects, sizes and headers were checked when each row's message was built.
        frames = [
            hpub_frame(
                message.subject,
                acks.expect(wave, index, message.subject),
                message.headers,
                message.body,
            )
            for index, message in enumerate(messages)
        ]
        try:
            if not queue_frames(nc, frames):
                for index in range(len(messages)):
                    wave.settle(index, Failed(FailureReason.DISCONNECTED, "not connected to NATS"))
            send_queued(nc)
            if wave.pending:
                with trio.move_on_at(deadline):
                    await wave.done.wait()
        finally:
            acks.forget(wave)  # also when the batch is cancelled: no ack is waited for
        if wave.pending:
            missing = self._unanswered()
            results = [missing if result is None else result for result in wave.results]
        else:
            results = cast("list[PublishResult]", wave.results)
        if not any(
            isinstance(r, Failed) and r.reason is FailureReason.NO_RESPONDERS for r in results
        ):
            return results
        return await aio.call(self._confirm_no_stream, messages, results, deadline)

    async def publish_batch(
        self, mode: PublishMode, messages: Sequence[Message], budget: float
    ) -> list[PublishResult | None] | None:
        """asyncio side: publish ``messages``, all captured by one stream and in the
        order they must be stored, as one batch in ``mode``, waiting up to ``budget``
        seconds. One result per message (None: not stored, nothing to say), or None
        when the stream turned the batch down as a batch: then the caller sends the
        messages one by one, each getting its own verdict."""
        nc = self._nc
        if nc is None or not self.connected:
            return [Failed(FailureReason.DISCONNECTED, "not connected to NATS")] * len(messages)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        _, replies = await self._inboxes(nc)
        batch_id = uuid.uuid4().hex
        woken = asyncio.Event()
        state: FastBatch | AtomicBatch
        if mode is PublishMode.BATCH:
            state = fast = FastBatch(len(messages))

            def on_fast_reply(seq: int, msg: Msg) -> None:
                fast.on_reply(seq, self._decode(msg))
                woken.set()

            replies.open(batch_id, on_fast_reply)
        else:
            state = atomic = AtomicBatch(len(messages))

            def on_atomic_reply(seq: int, msg: Msg) -> None:
                atomic.on_reply(self._decode(msg))
                woken.set()

            replies.open(batch_id, on_atomic_reply)

        def reply_to(seq: int) -> str:
            return fast_batch_reply(replies.prefix, batch_id, seq, len(messages))

        try:
            if isinstance(state, FastBatch):
                await self._send_fast(nc, state, reply_to, messages)
            else:
                await self._send_atomic(nc, state, replies.prefix, batch_id, messages)
            while not state.over and (remaining := deadline - loop.time()) > 0:
                woken.clear()
                try:
                    await asyncio.wait_for(woken.wait(), remaining)
                except TimeoutError:
                    break
                if isinstance(state, FastBatch):
                    await self._send_fast(nc, state, reply_to, messages)
        finally:
            replies.close(batch_id)
        if isinstance(state, FastBatch) and state.batch_refused is not None:
            self._turned_down(mode, state.batch_refused.failure)
            return None
        if isinstance(state, AtomicBatch) and state.send_per_message:
            self._turned_down(mode, state.error.failure if state.error else None)
            return None
        unanswered = self._unanswered()
        results = list(state.results(unanswered))
        self._on_batch(mode, batch_outcome(results))
        if any(isinstance(r, Failed) and r.reason is FailureReason.NO_RESPONDERS for r in results):
            sent = [(m, r) for m, r in zip(messages, results, strict=True) if r is not None]
            confirmed = iter(
                await self._confirm_no_stream([m for m, _ in sent], [r for _, r in sent], deadline)
            )
            results = [None if r is None else next(confirmed) for r in results]
        return results

    def _unanswered(self) -> Failed:
        """A sent message whose ack did not come: the broker's failure, either way."""
        if self.connected:
            return Failed(FailureReason.TIMEOUT, "no ack before the publish timeout")
        return Failed(FailureReason.DISCONNECTED, "connection lost before the ack")

    def _turned_down(self, mode: PublishMode, failure: Failed | None) -> None:
        log.info(
            "the stream turned a %s batch down (%s); its messages go one by one",
            mode,
            failure.detail if failure else "?",
        )
        if failure is not None and "disabled" in failure.detail:
            self.forget_stream_modes()
        self._on_batch(mode, "turned_down")

    def _decode(self, msg: Msg) -> Reply:
        return decode(msg.headers.get("Status") if msg.headers else None, msg.data, api_error)

    async def _send_fast(
        self,
        nc: Client,
        state: FastBatch,
        reply_to: Callable[[int], str],
        messages: Sequence[Message],
    ) -> None:
        """Send what flow control lets go now: the first message alone, then while
        fewer than FAST_BATCH_OUTSTANDING_ACKS acks are outstanding."""
        last = len(messages)
        frames: list[bytes] = []
        while state.sent < last and state.may_send(state.sent):
            message = messages[state.sent]
            state.sent += 1
            frames.append(
                hpub_frame(message.subject, reply_to(state.sent), message.headers, message.body)
            )
        if frames and not queue_frames(nc, frames):
            state.broker_failure = Failed(FailureReason.DISCONNECTED, "not connected to NATS")
        send_queued(nc)

    async def _send_atomic(
        self,
        nc: Client,
        state: AtomicBatch,
        prefix: str,
        batch_id: str,
        messages: Sequence[Message],
    ) -> None:
        """Send the whole batch: replies only on the first message (an error there
        says the batch will not be taken) and on the commit."""
        last = len(messages)
        frames = [
            hpub_frame(
                message.subject,
                f"{prefix}{batch_id}.{seq}" if seq in (1, last) else "",
                atomic_batch_headers(message.headers, batch_id, seq, last),
                message.body,
            )
            for seq, message in enumerate(messages, 1)
        ]
        if not queue_frames(nc, frames):
            state.on_reply(decode_failure(Failed(FailureReason.DISCONNECTED, "not connected")))
        send_queued(nc)

    async def _inboxes(self, nc: Client) -> tuple[AckInbox, BatchInbox]:
        """The reply subscriptions, made on first use: one for the acks of single
        messages (``<inbox>.a.<token>``), one for the replies of batches
        (``<inbox>.b.<batch id>...``)."""
        if self._acks is None or self._batch_replies is None:
            inbox = nc.new_inbox()
            acks, replies = AckInbox(inbox + ".a."), BatchInbox(inbox + ".b.")
            await nc.subscribe(acks.prefix + "*", cb=acks.on_reply)
            await nc.subscribe(replies.prefix + ">", cb=replies.on_reply)
            self._acks, self._batch_replies = acks, replies
        return self._acks, self._batch_replies

    async def _confirm_no_stream(
        self, messages: Sequence[Message], results: list[PublishResult], deadline: float
    ) -> list[PublishResult]:
        """asyncio side. "No responders" means no stream captures the subject, or one
        does and has no leader to answer (an election, a cluster without quorum). Both
        are the broker's; asking JetStream which one tells the operator what to fix
        (NO_STREAM names a subject to add to a stream). One question per subject,
        and none once JetStream cannot answer (without a meta leader every question
        would wait out its timeout)."""
        verdicts: dict[str, bool] = {}
        answering = True
        loop = asyncio.get_running_loop()
        confirmed: list[PublishResult] = []
        for message, result in zip(messages, results, strict=True):
            if isinstance(result, Failed) and result.reason is FailureReason.NO_RESPONDERS:
                subject = message.subject
                if subject not in verdicts and answering:
                    budget = min(NO_STREAM_QUESTION_TIMEOUT, deadline - loop.time())
                    verdict = await self._no_stream_for(subject, budget) if budget > 0 else None
                    answering = verdict is not None
                    verdicts[subject] = bool(verdict)
                if verdicts.get(subject):
                    confirmed.append(NO_STREAM)
                    continue
            confirmed.append(result)
        return confirmed

    async def _no_stream_for(self, subject: str, budget: float) -> bool | None:
        """Whether no stream captures ``subject``; None when JetStream did not say."""
        if self._js is None:
            return None
        try:
            await asyncio.wait_for(self._js.find_stream_name_by_subject(subject), budget)
        except nats.js.errors.NotFoundError:
            return True
        except Exception as exc:  # noqa: BLE001 - unsure: the broker's, not the row's
            log.debug("could not ask JetStream which stream captures %r: %s", subject, exc)
            return None
        return False
