"""One batch, whole: claim, publish in per-subject order, mark, commit.

The scheduler decides when a batch runs and how long it may take; the batch runs in
trio. Its statements are waited on by trio itself (:class:`relay.database.Transaction`
on :class:`relay.pgtrio.TrioConnection`), and so are its waves: the broker writes
their frames to nats-py's transport and the acks, which arrive in nats-py's asyncio
callbacks, set a trio event (:class:`relay.broker.Broker.publish_wave`). Only a
stream's fast or atomic batch, a read of the streams' modes and a question about
"no responders" cross into asyncio. Its decisions are pure functions (the order,
:func:`relay.envelope.message_for`, the marks); beside them it reads the wall clock
once, opens tracing spans, logs and hits the failpoints.

Why trio and not asyncio: psycopg's own wait under trio-asyncio costs 2.3-2.5 times
the CPU of trio's wait for the same round trip, a crossing about 60 us, and an
asyncio timer and future a pass of the scheduler each; a batch at steady load is
two round trips and one wave (docs/performance.md, *Steady load*).

This is also where the table and the broker could disagree, so the crash windows
are marked where they are.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

import trio

from relay import aio, failpoints
from relay.config import Config
from relay.database import Claim
from relay.envelope import Message, MessageSettings, message_for
from relay.failpoints import Failpoints
from relay.headers import TraceContext, trace_context
from relay.logs import RepeatedWarnings
from relay.marks import Marks, decide_marks
from relay.model import Acked, Failed, OutboxRow, PublishResult, RowId
from relay.ordering import SubjectQueues, held_behind_blockers, unsettled_subjects
from relay.schemas import SchemaCheck
from relay.streams import ATOMIC_BATCH_LIMIT, ATOMIC_HEADER_BYTES, PublishMode, worth_a_batch
from relay.tracing import NoTracing, PublishedRow, Tracing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchOutcome:
    """What a committed batch did: the rows it claimed, those it left for a blocker,
    what the broker said for the rows it sent, and what it wrote back."""

    rows: list[OutboxRow] = field(default_factory=list)
    held: set[RowId] = field(default_factory=set)
    results: dict[RowId, PublishResult] = field(default_factory=dict)
    marks: Marks = field(default_factory=Marks)
    # The broker acknowledged none of what was sent (relay.marks.broker_outage): the
    # rows it failed were left as they were, not counted against them.
    broker_outage: bool = False
    # Its claim walked the claim index from the first entry (relay/claimstart.py).
    from_first_entry: bool = False
    # Its claim found live rows beyond where its walks ended, for the next claim.
    found_beyond: bool = False
    # Its claim's walks went past their reach, to the end (relay/claimstart.py).
    past_reach: bool = False
    # Its claim ran again without its walks' floor (relay/claimstart.py).
    below_floor: bool = False


def published_rows(
    rows: Sequence[OutboxRow],
    results: Mapping[RowId, PublishResult],
    traces: Mapping[RowId, TraceContext | None],
) -> list[PublishedRow]:
    """The acked rows that carry a producer's trace context, for their own spans."""
    return [
        PublishedRow(row.id, row.event_type, row.created_at, trace)
        for row in rows
        if (trace := traces.get(row.id)) is not None and isinstance(results.get(row.id), Acked)
    ]


def split_by_publish_mode(
    rows: Sequence[OutboxRow],
    plan: Mapping[str, tuple[PublishMode, str]],
    alone: Set[str] = frozenset(),
) -> tuple[list[OutboxRow], list[tuple[PublishMode, list[OutboxRow]]]]:
    """The rows to publish one message each, and per stream the rows to publish as
    batches (in ``plan``'s mode for the event type: the NATS subject). Order is kept
    per row subject, which may span event types and so streams: a row subject with
    rows in two streams, or in a stream published per message, or in ``alone`` (a
    row of it does not fit in a batch), goes one message each, whose waves keep its
    order across streams; so do a stream's rows too few to be worth a batch. Each
    list keeps ``rows``' order."""
    targets = set(plan.values())
    if len(targets) == 1 and not alone:  # one stream: no row subject spans two
        [(mode, _)] = targets
        if not worth_a_batch(mode, len(rows)):
            return list(rows), []
        return [], [(mode, list(rows))]
    streams_of: dict[str, set[tuple[PublishMode, str]]] = {}
    for row in rows:
        streams_of.setdefault(row.subject, set()).add(plan[row.event_type])
    groups: dict[tuple[PublishMode, str], list[OutboxRow]] = {}
    for row in rows:
        target = plan[row.event_type]
        if len(streams_of[row.subject]) == 1 and row.subject not in alone:
            groups.setdefault(target, []).append(row)
    batched = [
        (mode, group) for (mode, _), group in groups.items() if worth_a_batch(mode, len(group))
    ]
    in_batches = {row.id for _, group in batched for row in group}
    return [row for row in rows if row.id not in in_batches], batched


class BatchTransaction(Protocol):
    """One batch's transaction (:class:`relay.database.Transaction`)."""

    async def claim(
        self, batch_size: int, max_attempts: int, ours: Set[RowId] = frozenset()
    ) -> Claim: ...

    async def mark_and_commit(
        self, marks: Marks, crash_before_commit: Callable[[], None] | None = None
    ) -> None: ...

    async def commit(self) -> None: ...


class BatchDatabase(Protocol):
    """Where batch transactions come from (:class:`relay.database.Database`)."""

    def transaction(self) -> AbstractAsyncContextManager[BatchTransaction]: ...


class BatchBroker(Protocol):
    """Where a batch's messages go (:class:`relay.broker.Broker`): its publish modes
    and waves awaited from trio, its batches from asyncio (through the door)."""

    @property
    def max_payload(self) -> int: ...

    async def publish_wave(
        self, messages: Sequence[Message], budget: float
    ) -> list[PublishResult]: ...

    async def publish_modes(
        self, subjects: Iterable[str]
    ) -> Mapping[str, tuple[PublishMode, str]]: ...

    async def publish_batch(
        self, mode: PublishMode, messages: Sequence[Message], budget: float
    ) -> list[PublishResult | None] | None: ...


class _Flight:
    """One of this relay's batches between its claim and the end of its transaction.

    A batch claimed while another is in flight sees that batch's rows as unpublished
    blockers of their subjects (they are, until it commits). It does not hold its
    rows behind them: it waits until the earlier batch has heard from the broker and
    then sends the rows of every subject the earlier batch settled, so a subject's
    rows still reach the broker in claim order."""

    def __init__(self, rows: list[OutboxRow]) -> None:
        self.rows = rows
        self.ids = frozenset(row.id for row in rows)
        self.subjects = frozenset(row.subject for row in rows)
        # Set once the batch is done publishing; until then every subject it holds
        # is unsettled.
        self.settled = trio.Event()
        self.unsettled = self.subjects

    def published(self, results: dict[RowId, PublishResult]) -> None:
        if not self.settled.is_set():
            self.unsettled = unsettled_subjects(self.rows, results)
            self.settled.set()

    def abandoned(self) -> None:
        """The batch ends without saying what it published: nothing after it may
        pass any of its subjects."""
        if not self.settled.is_set():
            self.settled.set()


class Batch:
    """Runs batches, one call to :meth:`run` each, up to a few at once.

    Claims take turns (a lock), so batches are claimed in order; a batch may claim
    while an earlier one waits for its acks or its marks, which is where a single
    batch spends most of its time."""

    def __init__(
        self,
        *,
        config: Config,
        database: BatchDatabase,
        broker: BatchBroker,
        failpoints: Failpoints,
        schema_check: SchemaCheck | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._config = config
        self._db = database
        self._broker = broker
        self._failpoints = failpoints
        self._schema_check = schema_check or SchemaCheck(None)
        self._warnings = RepeatedWarnings(log)
        self._tracing = tracing or NoTracing()
        self._binary = config.envelope == "binary"
        self._claiming = trio.Lock()
        self._in_flight: list[_Flight] = []

    async def run(self) -> BatchOutcome:
        """One claim-publish-mark transaction. Raises the relay's errors for the
        database; a publish failure is a result, never an error."""
        config = self._config
        flight: _Flight | None = None
        try:
            async with self._db.transaction() as tx:
                async with self._claiming:
                    earlier = list(self._in_flight)
                    ours = frozenset().union(*(f.ids for f in earlier))
                    claim = await tx.claim(config.batch_size, config.max_attempts, ours)
                    if not claim.rows:
                        await tx.commit()
                        return BatchOutcome(
                            from_first_entry=claim.from_first_entry,
                            found_beyond=claim.found_beyond,
                            past_reach=claim.past_reach,
                            below_floor=claim.below_floor,
                        )
                    flight = _Flight(claim.rows)
                    self._in_flight.append(flight)
                rows = claim.rows
                held = held_behind_blockers(rows, claim.blockers)
                results = await self._publish_after(
                    [row for row in rows if row.id not in held], earlier
                )
                flight.published(results)
                # Crash window: the broker has acked some messages and the table does
                # not say so yet. A crash here rolls the claim back; the rows are
                # claimed again and republished with the same Nats-Msg-Id, which the
                # stream drops inside its duplicate window and consumers dedupe on
                # after it.
                self._failpoints.hit(failpoints.CRASH_AFTER_PUBLISH)
                marks = decide_marks(
                    {row.id: row for row in rows},
                    results,
                    now=time.time(),
                    max_attempts=config.max_attempts,
                    backoff_base=config.backoff_base,
                    backoff_max=config.backoff_max,
                )
                # Crash window: marked but not committed (the marks and the COMMIT
                # travel in one round trip; the failpoint splits them). Same as above:
                # the marks roll back with the claim and the rows are republished.
                crash = failpoints.CRASH_AFTER_MARK
                await tx.mark_and_commit(
                    marks,
                    (lambda: self._failpoints.hit(crash))
                    if self._failpoints.enabled(crash)
                    else None,
                )
            return BatchOutcome(
                rows,
                held,
                results,
                marks,
                marks.broker_outage,
                claim.from_first_entry,
                claim.found_beyond,
                claim.past_reach,
                claim.below_floor,
            )
        finally:
            # Out of flight only once its transaction is over: until then a later
            # claim sees its rows as unpublished.
            if flight is not None:
                flight.abandoned()
                self._in_flight.remove(flight)

    async def _publish_after(
        self, rows: list[OutboxRow], earlier: list[_Flight]
    ) -> dict[RowId, PublishResult]:
        """Publish ``rows``, those of subjects an earlier batch in flight also holds
        only once it has settled them, all within the publish timeout from now."""
        deadline = trio.current_time() + self._config.publish_timeout
        waiting = frozenset().union(*(f.subjects for f in earlier))
        results = await self._publish([r for r in rows if r.subject not in waiting], deadline)
        later = [r for r in rows if r.subject in waiting]
        if later:
            # Each earlier batch settles within its own publish timeout, which began
            # before ours; waiting is bounded by ours all the same (a publish that
            # overran its budget). An earlier batch not settled by then holds back
            # every subject it has.
            with trio.move_on_at(deadline):
                for flight in earlier:
                    await flight.settled.wait()
            unsettled = frozenset().union(*(f.unsettled for f in earlier))
            results.update(
                await self._publish([r for r in later if r.subject not in unsettled], deadline)
            )
        return results

    async def _publish(self, rows: list[OutboxRow], deadline: float) -> dict[RowId, PublishResult]:
        """Publish ``rows`` in per-subject order until ``deadline`` (trio's clock, which
        is also the asyncio loop's). Rows without a result were not sent and stay
        exactly as they were. With tracing on, inside a span of its own
        (relay/tracing.py)."""
        # Each row's trace context, read once for its message and the span's links.
        traces = {
            row.id: trace_context(row.traceparent, row.tracestate)
            for row in rows
            if row.traceparent is not None
        }
        if not self._tracing.enabled:
            return await self._publish_rows(rows, deadline, traces, None)
        span = self._tracing.publish_span(
            [row.event_type for row in rows],
            [context for context in traces.values() if context is not None],
        )
        results: dict[RowId, PublishResult] = {}
        try:
            results = await self._publish_rows(rows, deadline, traces, span.context)
        finally:
            span.end(
                Counter(r.reason.value for r in results.values() if isinstance(r, Failed)),
                published_rows(rows, results, traces) if self._tracing.row_spans else (),
            )
        return results

    async def _publish_rows(
        self,
        rows: list[OutboxRow],
        deadline: float,
        traces: Mapping[RowId, TraceContext | None],
        hop: TraceContext | None,
    ) -> dict[RowId, PublishResult]:
        results: dict[RowId, PublishResult] = {}
        messages: dict[RowId, Message] = {}
        max_payload = self._broker.max_payload
        settings = MessageSettings(max_payload, self._binary, self._schema_check.problem)
        sendable: list[OutboxRow] = []
        stopped: set[str] = set()  # subjects with an earlier row that cannot go now
        for row in sorted(rows, key=lambda r: r.order_key):
            if row.subject in stopped:
                continue  # behind a row rejected here: unsent, left as it is
            trace = traces.get(row.id)
            built = message_for(row, settings, trace, hop)
            if isinstance(built, Message):
                if row.traceparent is not None and trace is None:
                    self._warnings.warn(
                        f"row {row.id}: traceparent {row.traceparent[:80]!r} is not W3C "
                        "Trace Context: published without it",
                        key="traceparent not W3C",
                    )
                messages[row.id] = built
                sendable.append(row)
            else:
                results[row.id] = Failed(*built)
                stopped.add(row.subject)  # it goes dead and holds its subject
        self._failpoints.hit(failpoints.CRASH_BEFORE_PUBLISH)
        if sendable:
            results.update(await self._send(sendable, messages, deadline))
        return results

    async def _send(
        self, sendable: list[OutboxRow], messages: Mapping[RowId, Message], deadline: float
    ) -> dict[RowId, PublishResult]:
        """Send the messages of ``sendable``, in per-subject order, each stream's in
        its publish mode, until ``deadline``."""
        max_payload = self._broker.max_payload
        plan = await self._broker.publish_modes({row.event_type for row in sendable})
        # A message that fits alone but not with an atomic batch's headers goes on its
        # own, and so do the other rows of its subject (their order).
        alone = {
            row.subject
            for row in sendable
            if plan[row.event_type][0] is PublishMode.ATOMIC
            and messages[row.id].wire_size + ATOMIC_HEADER_BYTES > max_payload
        }
        one_by_one, batched = split_by_publish_mode(sendable, plan, alone)
        if not batched:  # the common case at steady load: no task to start
            return await self._publish_waves(one_by_one, messages, deadline)
        results: dict[RowId, PublishResult] = {}

        async def waves() -> None:
            results.update(await self._publish_waves(one_by_one, messages, deadline))

        async def batches(mode: PublishMode, rows: list[OutboxRow]) -> None:
            results.update(await self._publish_batches(mode, rows, messages, deadline))

        # No row subject spans two of these, so they go at once, in any order.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waves)
            for mode, rows in batched:
                nursery.start_soon(batches, mode, rows)
        return results

    async def _publish_waves(
        self, rows: list[OutboxRow], messages: Mapping[RowId, Message], deadline: float
    ) -> dict[RowId, PublishResult]:
        """Publish ``rows`` one message each, the rows of a subject in waves (the next
        only after the previous one's ack)."""
        results: dict[RowId, PublishResult] = {}
        queues = SubjectQueues(rows)
        # The deadline bounds how long this transaction holds its row locks.
        while queues:
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                break
            wave = queues.next_wave()
            acks = await self._broker.publish_wave([messages[r.id] for r in wave], remaining)
            for row, result in zip(wave, acks, strict=True):
                results[row.id] = result
                if isinstance(result, Failed):
                    # Later rows of this subject must not overtake it: they stay
                    # unsent, and the claim skips them while it waits or is dead.
                    queues.stop(row.subject)
        return results

    async def _publish_batches(
        self,
        mode: PublishMode,
        rows: list[OutboxRow],
        messages: Mapping[RowId, Message],
        deadline: float,
    ) -> dict[RowId, PublishResult]:
        """Publish ``rows``, all of one stream, in order, as batches (each through the
        door: nats-py's batch replies are asyncio's).

        The stream stores a batch's messages in order and stops at the first it
        cannot store, so a subject's rows keep their order. After a message the
        stream refused, the rows of other subjects that came after it go in the
        next batch; the refused row's subject stops here, as in waves."""
        results: dict[RowId, PublishResult] = {}
        pending = rows
        while pending and (remaining := deadline - trio.current_time()) > 0:
            if not worth_a_batch(mode, len(pending)):
                results.update(await self._publish_waves(pending, messages, deadline))
                break
            chunk = pending[:ATOMIC_BATCH_LIMIT] if mode is PublishMode.ATOMIC else pending
            found = await aio.call(
                self._broker.publish_batch, mode, [messages[row.id] for row in chunk], remaining
            )
            if found is None:  # turned down as a batch: each message on its own
                results.update(await self._publish_waves(pending, messages, deadline))
                break
            if all(result is None for result in found):
                break  # nothing stored and nothing said: try again next pass
            stopped: set[str] = set()
            for row, result in zip(chunk, found, strict=True):
                if result is not None:
                    results[row.id] = result
                    if isinstance(result, Failed):
                        stopped.add(row.subject)
            if any(isinstance(r, Failed) and r.reason.broker_fault for r in found):
                break  # the broker's trouble: the rest waits for the next pass
            pending = [r for r in pending if r.id not in results and r.subject not in stopped]
        return results
