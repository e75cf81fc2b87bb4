"""`outbox-relay audit`: prove "published" against the streams.

``published_at`` says JetStream acknowledged a message; the audit checks that the
stream still holds it. For each stream that captures the event types published
in the window, it reads the ``Nats-Msg-Id`` of every message stored since the
window began (headers only, one ephemeral push consumer), then walks the rows
marked published in the window and looks each one up. A row whose message is
gone is *expired* when one of the stream's limits accounts for it, and *missing*
otherwise (deleted, purged, lost by the broker, the stream deleted or recreated).
``repair`` publishes each missing row again, in per-subject order, with its
envelope ``id`` unchanged and a ``Nats-Msg-Id`` of its own, so the stream stores
it even while its duplicate window remembers the first one.

An audit runs whole on the asyncio side (psycopg and nats-py, which it uses
itself, translating their errors into :class:`AuditError` where it knows them):
``asyncio.run`` from the CLI, or one crossing through :mod:`relay.aio` a round from
:func:`run_audits`, the relay's trio task.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.errors
import nats.js.errors
import psycopg
import trio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from relay import aio
from relay.broker import Broker, nats_auth_options
from relay.config import Config, redact_nats_url
from relay.database import connection_string
from relay.envelope import MSG_ID_HEADER, Message, MessageSettings, message_for
from relay.errors import RelayError, first_line
from relay.headers import trace_context
from relay.metrics import Metrics
from relay.model import OutboxRow
from relay.ordering import SubjectQueues
from relay.sqlfiles import Names, partition_statement, query

log = logging.getLogger(__name__)

# A row id is a uuid; its low 64 bits name it in the set of what a stream holds (an
# int instead of a 36-character string). Two ids sharing them by chance, among
# a million rows and a million messages, is a 1 in 10^7 event, and it could only
# hide a loss, never invent one.
_UUID_TEXT_LENGTH = 36  # 8-4-4-4-12 hex digits
REPAIR_MARK = ":repair:"
# How far before the window the stream is read: a row marked published in the
# window may have been stored earlier (its ack lost, a duplicate=true ack later).
_READ_BEFORE = 60.0
_API_TIMEOUT = 5.0
# Rows fetched from the server-side cursor per round trip.
_CURSOR_ROWS = 10_000
# The longest a stream read may go without a message or heartbeat.
_IDLE_LIMIT = 10.0


class AuditError(Exception):
    """The audit could not finish (a stream that cannot be read, NATS gone)."""


def message_key(msg_id: str) -> int | None:
    """The key of the row a ``Nats-Msg-Id`` names (the row id, or a repaired copy's
    ``<id>:repair:<n>``): the low 64 bits of the uuid; None for an id that is not a
    uuid's text (parsed by hand: this runs once per message and per row)."""
    text = msg_id.split(REPAIR_MARK, 1)[0]
    if len(text) != _UUID_TEXT_LENGTH:
        return None
    try:
        return int(text[19:23] + text[24:], 16)
    except ValueError:
        return None


def repair_msg_id(row_id: str, now: float) -> str:
    """A ``Nats-Msg-Id`` for a repaired copy: not the row id, which the stream's
    duplicate window may still remember (it would answer duplicate=true and store
    nothing); stamped, so a second repair is stored too."""
    return f"{row_id}{REPAIR_MARK}{int(now * 1000)}"


@dataclass(frozen=True)
class StreamView:
    """What the audit needs of a stream: its limits and how full it is."""

    name: str
    retention: str  # limits, interest or workqueue
    discard_new: bool
    max_age: float  # seconds; 0: none
    max_msgs: int  # <= 0: none
    max_bytes: int  # <= 0: none
    max_msgs_per_subject: int  # <= 0: none
    duplicate_window: float
    messages: int
    bytes: int
    first_ts: float | None  # the oldest stored message's time; None when empty
    last_seq: int

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> StreamView:
        config, state = info["config"], info["state"]
        messages = int(state.get("messages", 0))
        return cls(
            name=config["name"],
            retention=config.get("retention", "limits"),
            discard_new=config.get("discard", "old") == "new",
            max_age=int(config.get("max_age", 0)) / 1e9,
            max_msgs=int(config.get("max_msgs", -1)),
            max_bytes=int(config.get("max_bytes", -1)),
            max_msgs_per_subject=int(config.get("max_msgs_per_subject", -1)),
            duplicate_window=int(config.get("duplicate_window", 0)) / 1e9,
            messages=messages,
            bytes=int(state.get("bytes", 0)),
            first_ts=parse_time(state["first_ts"]) if messages and "first_ts" in state else None,
            last_seq=int(state.get("last_seq", 0)),
        )

    @property
    def keeps_what_it_stores(self) -> bool:
        """Only a limits stream keeps a message until a limit removes it; interest
        and work-queue streams remove what their consumers acknowledged."""
        return self.retention == "limits"


def parse_time(text: str) -> float:
    """Epoch seconds of JetStream's RFC 3339 times (nanoseconds, "Z")."""
    head, _, fraction = text.rstrip("Z").partition(".")
    stamp = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.UTC).timestamp()
    return stamp + (float(f"0.{fraction}") if fraction else 0.0)


# A row is marked published after its whole batch was acknowledged: up to the
# publish timeout after its message was stored, and a moment more for the mark.
_MARK_AFTER_ACK = 1.0
# A stream at 99% of a count or byte limit is at it (a message's size varies).
_NEAR_LIMIT = 0.99


def removed_by_limits(
    published_at: float,
    now: float,
    stream: StreamView,
    subject_messages: int | None,
    mark_delay: float,
) -> bool:
    """Whether a row's absent message left the stream by one of its limits, not by
    a loss. A limit removes the oldest messages, so the row's message must be older
    than the stream's oldest one, and some limit must account for it: its age past
    ``max_age``, or (discard old) a stream at its ``max_msgs`` or ``max_bytes``. Or
    its subject is at ``max_msgs_per_subject`` (``subject_messages``: how many the
    stream holds of it), which removes that subject's oldest. A purge, a deleted
    message or a lost write fits none of these."""
    per_subject = stream.max_msgs_per_subject
    if per_subject > 0 and subject_messages is not None and subject_messages >= per_subject:
        return True
    if stream.first_ts is not None and published_at >= stream.first_ts + mark_delay:
        return False  # newer than the oldest message kept: taken from the middle
    if stream.max_age > 0 and now - published_at >= stream.max_age:
        return True
    if stream.discard_new:
        return False  # a full stream refuses new messages; it removes none
    if stream.max_msgs > 0 and stream.messages >= stream.max_msgs * _NEAR_LIMIT:
        return True
    return stream.max_bytes > 0 and stream.bytes >= stream.max_bytes * _NEAR_LIMIT


@dataclass(frozen=True)
class MissingRow:
    id: str
    event_type: str
    subject: str
    published_at: float
    stream: str | None  # None: no stream captures the event type now


@dataclass
class AuditReport:
    since: float
    checked: int = 0
    missing: list[MissingRow] = field(default_factory=list)
    expired: int = 0
    unaudited: int = 0  # rows in streams that remove what was consumed
    streams: dict[str, int] = field(default_factory=dict)  # rows checked per stream
    repaired: list[str] = field(default_factory=list)
    repair_failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    # A partitioned table's envelope ids written more than once in the window, and
    # how often: Postgres enforces them unique within a partition only.
    duplicate_ids: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> str:
        return json.dumps(
            {
                "since_seconds": self.since,
                "checked": self.checked,
                "missing": [m.id for m in self.missing],
                "expired": self.expired,
                "unaudited": self.unaudited,
                "streams": self.streams,
                "repaired": self.repaired,
                "repair_failed": self.repair_failed,
                "duplicate_ids": self.duplicate_ids,
                "seconds": round(self.seconds, 3),
            },
            indent=2,
        )

    def summary(self, shown: int = 10) -> str:
        lines = [
            f"checked {self.checked} rows marked published in the last {self.since:.0f}s "
            f"against {len(self.streams)} streams in {self.seconds:.1f}s: "
            f"{len(self.missing)} missing, {self.expired} left by the streams' limits"
            + (
                f", {self.unaudited} in streams that remove consumed messages"
                if self.unaudited
                else ""
            )
        ]
        for row in self.missing[:shown]:
            where = f"stream {row.stream}" if row.stream else "no stream captures it"
            lines.append(f"  missing {row.id}  {row.event_type}  ({where})")
        if len(self.missing) > shown:
            lines.append(f"  ... and {len(self.missing) - shown} more (--json lists them all)")
        if self.repaired or self.repair_failed:
            lines.append(f"repaired {len(self.repaired)} rows (published again)")
            lines += [f"  not repaired {i}: {why}" for i, why in self.repair_failed.items()]
        if self.duplicate_ids:
            lines.append(
                f"{len(self.duplicate_ids)} envelope ids written more than once (consumers "
                "dedupe all but one of each: a producer reused an id)"
            )
            lines += [f"  id {i} {n} times" for i, n in list(self.duplicate_ids.items())[:shown]]
        return "\n".join(lines) + "\n"


async def _stream_info(nc: Client, name: str, subject: str | None = None) -> dict[str, Any]:
    request = {"subjects_filter": subject} if subject else {}
    reply = await nc.request(
        f"$JS.API.STREAM.INFO.{name}", json.dumps(request).encode(), timeout=_API_TIMEOUT
    )
    info: dict[str, Any] = json.loads(reply.data)
    if "error" in info:
        raise AuditError(f"cannot read stream {name}: {info['error'].get('description')}")
    return info


async def _streams_of(nc: Client, event_types: Iterable[str]) -> dict[str, str | None]:
    """The stream that captures each event type now (None: none does)."""
    js = nc.jetstream()
    streams: dict[str, str | None] = {}
    for event_type in event_types:
        try:
            streams[event_type] = await js.find_stream_name_by_subject(event_type)
        except nats.js.errors.NotFoundError:
            streams[event_type] = None
    return streams


async def stored_keys(nc: Client, stream: StreamView, start: float) -> set[int]:
    """The keys of the messages ``stream`` holds from ``start`` (epoch seconds) up to
    its last message when the read began, read as headers only by an ephemeral
    push consumer with flow control."""
    keys: set[int] = set()
    if not stream.messages:
        return keys
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    last_seen = [loop.time()]

    async def on_message(msg: Msg) -> None:
        last_seen[0] = loop.time()
        headers = msg.headers or {}
        if "Status" in headers:  # flow control (answered) or an idle heartbeat
            if msg.reply:
                await nc.publish(msg.reply, b"")
            return
        msg_id = headers.get(MSG_ID_HEADER)
        key = message_key(msg_id) if msg_id else None
        if key is not None:
            keys.add(key)
        meta = msg.metadata
        if (meta.sequence.stream >= stream.last_seq or not meta.num_pending) and not done.done():
            done.set_result(None)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_message, pending_msgs_limit=-1, pending_bytes_limit=-1)
    config = ConsumerConfig(
        deliver_subject=inbox,
        headers_only=True,
        ack_policy=AckPolicy.NONE,
        flow_control=True,
        idle_heartbeat=1.0,
        inactive_threshold=30.0,
        mem_storage=True,
        deliver_policy=DeliverPolicy.ALL,
    )
    if stream.first_ts is not None and start > stream.first_ts:
        config.deliver_policy = DeliverPolicy.BY_START_TIME
        config.opt_start_time = datetime.datetime.fromtimestamp(start, datetime.UTC)
    js = nc.jetstream()
    consumer = None
    try:
        info = await js.add_consumer(stream.name, config, timeout=_API_TIMEOUT)
        consumer = info.name
        if not info.num_pending and not done.done():
            done.set_result(None)
        while not done.done():
            await asyncio.wait([done], timeout=1.0)
            if loop.time() - last_seen[0] > _IDLE_LIMIT:
                raise AuditError(f"reading stream {stream.name}: nothing for {_IDLE_LIMIT:.0f}s")
    finally:
        await sub.unsubscribe()
        if consumer is not None:
            try:
                await js.delete_consumer(stream.name, consumer)
            except Exception as exc:  # noqa: BLE001 - it expires by itself (inactive_threshold)
                log.debug("deleting the audit's consumer on %s: %s", stream.name, exc)
    return keys


async def audit(
    conn: psycopg.AsyncConnection[Any],
    nc: Client,
    names: Names,
    since: float,
    *,
    repair: bool = False,
    publish_timeout: float = 5.0,
    binary: bool = False,
) -> AuditReport:
    """Check every row marked published in the last ``since`` seconds against the
    stream that captures its event type; with ``repair``, publish the missing ones
    again."""
    started = time.monotonic()
    now = time.time()
    report = AuditReport(since=since)
    cursor = await conn.execute(query(names, "audit_window"), {"since": since})
    start, end = await cursor.fetchone() or (None, None)
    window = {"start": start, "end": end}
    cursor = await conn.execute(query(names, "audit_event_types"), window)
    event_types = [event_type for (event_type,) in await cursor.fetchall()]
    await conn.commit()  # no transaction open while the streams are read
    stream_of = await _streams_of(nc, event_types)
    views: dict[str, StreamView] = {}
    keys: dict[str, set[int]] = {}
    for name in sorted({s for s in stream_of.values() if s is not None}):
        view = StreamView.from_info(await _stream_info(nc, name))
        views[name] = view
        if view.keeps_what_it_stores:
            start = now - since - view.duplicate_window - _READ_BEFORE
            keys[name] = await stored_keys(nc, view, start)
        report.streams[name] = 0
    absent: list[MissingRow] = []
    async with conn.cursor(name="outbox_relay_audit") as rows:
        rows.itersize = _CURSOR_ROWS
        await rows.execute(query(names, "audit_published"), window)
        async for row_id, event_type, subject, published_at in rows:
            stream = stream_of.get(event_type)
            report.checked += 1
            if stream is not None:
                report.streams[stream] += 1
                if not views[stream].keeps_what_it_stores:
                    report.unaudited += 1
                    continue
                if message_key(row_id) in keys[stream]:
                    continue
            absent.append(MissingRow(row_id, event_type, subject, published_at, stream))
    await conn.commit()  # the cursor's transaction: hold no snapshot past the read
    report.duplicate_ids = await _duplicate_ids(conn, names, since)
    mark_delay = publish_timeout + _MARK_AFTER_ACK
    await _sort_absent(nc, absent, views, now, report, mark_delay=mark_delay)
    if repair and report.missing:
        await _repair(conn, nc, names, report, binary=binary)
    report.seconds = time.monotonic() - started
    return report


async def _duplicate_ids(
    conn: psycopg.AsyncConnection[Any], names: Names, since: float
) -> dict[str, int]:
    """On a partitioned table, the ids of rows created in the window that another
    row shares (a plain table's primary key refuses them)."""
    cursor = await conn.execute(partition_statement(names, "layout"))
    layout = await cursor.fetchone()
    found: dict[str, int] = {}
    if layout is not None and layout[0] == "p":
        cursor = await conn.execute(partition_statement(names, "duplicate_ids"), {"window": since})
        found = {row_id: int(count) for row_id, count in await cursor.fetchall()}
    await conn.commit()
    return found


async def _sort_absent(
    nc: Client,
    absent: Sequence[MissingRow],
    views: dict[str, StreamView],
    now: float,
    report: AuditReport,
    *,
    mark_delay: float,
) -> None:
    """Each absent row into ``report``: expired (a limit of its stream accounts for
    it) or missing."""
    subject_counts: dict[tuple[str, str], int] = {}
    for row in absent:
        if row.stream is not None:
            stream = views[row.stream]
            key = (stream.name, row.event_type)
            if stream.max_msgs_per_subject > 0 and key not in subject_counts:
                info = await _stream_info(nc, stream.name, row.event_type)
                subject_counts[key] = int((info["state"].get("subjects") or {}).get(key[1], 0))
            count = subject_counts.get(key)
            if removed_by_limits(row.published_at, now, stream, count, mark_delay):
                report.expired += 1
                continue
        report.missing.append(row)


def repair_message(row: OutboxRow, now: float, *, binary: bool = False) -> Message:
    """The row's message as it was first published (its trace context and headers
    too), under the repair's own message id. A row whose headers would now be
    refused was never published with them: it goes without."""
    trace = trace_context(row.traceparent, row.tracestate)
    # No size limit: the row was published once, so it fit the server it went to.
    settings = MessageSettings(max_payload=sys.maxsize, binary=binary)
    built = message_for(row, settings, trace)
    if not isinstance(built, Message):
        built = message_for(row._replace(headers=None), settings, trace)
    # Without the row's headers nothing but its time or subject can refuse it, and a
    # row with either was never published.
    assert isinstance(built, Message), built
    message = built
    return Message(
        message.subject,
        message.body,
        {**message.headers, MSG_ID_HEADER: repair_msg_id(row.id, now)},
    )


async def _repair(
    conn: psycopg.AsyncConnection[Any],
    nc: Client,
    names: Names,
    report: AuditReport,
    *,
    binary: bool = False,
) -> None:
    ids = [m.id for m in report.missing]
    cursor = await conn.execute(query(names, "audit_rows"), {"ids": ids})
    rows = [OutboxRow(*r) for r in await cursor.fetchall()]
    await conn.commit()
    js = nc.jetstream()
    # The relay's waves: the first missing row of every subject, acknowledged, then
    # the second; a subject stops at a row that fails, its later rows untried.
    queues = SubjectQueues(rows)
    now = time.time()
    while queues:
        wave = queues.next_wave()
        messages = [repair_message(r, now, binary=binary) for r in wave]
        results = await asyncio.gather(
            *(js.publish(m.subject, m.body, timeout=_API_TIMEOUT, headers=m.headers)
              for m in messages),
            return_exceptions=True,
        )  # fmt: skip
        for row, result in zip(wave, results, strict=True):
            if isinstance(result, BaseException) or result.duplicate:
                why = (
                    f"{type(result).__name__}: {result}"
                    if isinstance(result, BaseException)
                    else "the stream answered duplicate: nothing stored"
                )
                report.repair_failed[row.id] = why
                for later in queues.stop(row.subject):
                    report.repair_failed[later.id] = (
                        "not tried: an earlier row of its subject failed"
                    )
            else:
                report.repaired.append(row.id)


async def audit_once(
    config: Config, since: float, *, repair: bool = False, nc: Client | None = None
) -> AuditReport:
    """One audit on a database connection of its own, and on ``nc`` (the relay's
    NATS connection) or one of its own (the CLI's)."""
    async with await _connect(config, config.database_url) as conn:
        return await _audit_with(conn, config, since, repair, nc)


async def audit_unless_another_relay_does(
    config: Config, since: float, nc: Client
) -> AuditReport | None:
    """:func:`audit_once` while holding the table's audit lock, so one replica
    audits at a time; None when another holds it."""
    # The lock is a session's: on the session URL, never through a transaction pooler.
    async with await _connect(config, config.session_database_url) as conn:
        cursor = await conn.execute(query(Names.for_config(config), "audit_lock"))
        held = await cursor.fetchone()
        await conn.commit()
        if not (held and held[0]):
            return None
        return await _audit_with(conn, config, since, False, nc)


async def _connect(config: Config, url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(
        connection_string(url),
        application_name="outbox-relay audit",
        # Nothing prepared behind a transaction pooler (a statement psycopg prepares
        # lives on one server connection).
        prepare_threshold=None if config.database_pooler == "transaction" else 5,
    )


async def _audit_with(
    conn: psycopg.AsyncConnection[Any],
    config: Config,
    since: float,
    repair: bool,
    nc: Client | None,
) -> AuditReport:
    names = Names.for_config(config)

    async def audit_on(client: Client) -> AuditReport:
        return await audit(
            conn,
            client,
            names,
            since,
            repair=repair,
            publish_timeout=config.publish_timeout,
            binary=config.envelope == "binary",
        )

    if nc is not None:
        return await audit_on(nc)

    async def quiet(exc: Exception) -> None:  # nats-py logs a traceback per try without it
        log.debug("NATS: %s", exc)

    try:
        own = await nats.connect(
            servers=list(config.nats_urls),
            name="outbox-relay audit",
            connect_timeout=5,
            allow_reconnect=False,
            max_reconnect_attempts=1,  # also bounds the first connect: each server once
            error_cb=quiet,
            **nats_auth_options(config),
        )
    except (nats.errors.Error, OSError) as exc:
        servers = ", ".join(redact_nats_url(u) for u in config.nats_urls)
        raise AuditError(f"cannot connect to NATS at {servers}: {exc}") from exc
    try:
        return await audit_on(own)
    finally:
        await own.close()


async def run_audits(config: Config, broker: Broker, metrics: Metrics) -> None:
    """trio side: ``--audit-interval``. An audit every interval (the first one an
    interval after start), on the relay's NATS connection, unless another replica
    is auditing; its findings as gauges and one log line. It never repairs: that is
    an operator's decision."""
    since = config.audited_window
    while True:
        await trio.sleep(config.audit_interval)
        nc = broker.client
        if nc is None:
            metrics.audit_failures.inc()
            log.warning("audit skipped: not connected to NATS")
            continue
        try:
            report = await aio.call(audit_unless_another_relay_does, config, since, nc)
        except (AuditError, RelayError, psycopg.Error, OSError, nats.errors.Error) as exc:
            metrics.audit_failures.inc()
            log.warning("audit failed, will retry next interval: %s", first_line(exc))
            continue
        if report is None:
            # The replica that audits reports; a finding of this one's from an
            # earlier round would keep paging after a repair.
            metrics.audit_missing.set(0)
            log.info("audit skipped: another relay is auditing the table")
            continue
        metrics.audit_missing.set(len(report.missing))
        metrics.audit_duplicate_ids.set(len(report.duplicate_ids))
        metrics.audit_checked.set(report.checked)
        metrics.audit_expired.set(report.expired)
        metrics.audit_last_success.set(time.time())
        if report.missing:
            log.error(
                "audit: %d rows marked published are missing from their streams (first: %s); "
                "`outbox-relay audit --repair` publishes them again",
                len(report.missing),
                ", ".join(m.id for m in report.missing[:5]),
            )
        else:
            log.info(report.summary().splitlines()[0])
        if report.duplicate_ids:
            log.error(
                "audit: %d envelope ids were written more than once (first: %s): consumers "
                "dedupe all but one row of each; the producer reused an id",
                len(report.duplicate_ids),
                ", ".join(list(report.duplicate_ids)[:5]),
            )
