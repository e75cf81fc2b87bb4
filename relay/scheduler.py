"""The scheduler loop: run batches while there is work, then sleep until woken.

What one batch does (claim, publish in order, mark, commit) is :mod:`relay.batch`;
this module decides when batches run, rides out outages, and keeps the sleep
protocol with the LISTEN task.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Set
from dataclasses import dataclass
from typing import Protocol

import trio

from relay.backoff import ReconnectBackoff
from relay.batch import BatchOutcome
from relay.config import Config
from relay.errors import DatabaseUnavailable, RelayError, UnexpectedError, first_line
from relay.health import Health
from relay.listener import Sleep
from relay.metrics import Metrics
from relay.model import Acked, Failed, FailureReason, PublishResult
from relay.retry import retry
from relay.wakeup import Wakeup

log = logging.getLogger(__name__)

# Beyond the publish timeout, how long one pass may spend in the database. A pass
# that takes longer is stuck on a connection that died without telling anyone (a
# path that drops packets): it is abandoned, rolled back by the server, and retried.
DATABASE_BUDGET = 15.0

# After a drain that found rows, wait a little for more before claiming again (or
# going to sleep): in proportion to how many rows came, up to a cap (--linger). A
# lone row (light load) costs a fraction of a millisecond and the scheduler soon
# sleeps, so the next row wakes it by notification. Under heavy load the scheduler
# polls at the capped pace instead, in batches large enough to be cheap, and never
# takes the sleep lock, so producers never notify.
LINGER_PER_ROW = 0.0002
LINGER_MAX = 0.01  # --linger's default


# Of the relays sharing a table, the one holding its pace lock (relay/listener.py)
# claims as a relay alone would; the others stand by, claiming only now and then:
# each relay claiming on its own pace, or all of them on every notification, cost
# several times one relay's CPU for the same rows (docs/performance.md). A standby's
# claims take what the pacing relay leaves: the rows beyond what it can take alone,
# and all of them while it is gone, until another relay takes its pace lock (within
# the listener's PACE_RETRY). While the rows a standby finds are young, the pacing
# relay keeps up, and the standby claims every STANDBY_PAUSE_IDLE; once it finds a
# row that has waited longer than half that, every STANDBY_PAUSE.
STANDBY_PAUSE = 0.05
STANDBY_PAUSE_IDLE = 0.2


def standby_pause(longest_wait: float) -> float:
    """How long a relay standing by waits before it claims again, after a drain whose
    rows had waited at most ``longest_wait`` seconds since their transaction began."""
    return STANDBY_PAUSE if longest_wait > STANDBY_PAUSE_IDLE / 2 else STANDBY_PAUSE_IDLE


def linger_for(claimed: int, longest: float = LINGER_MAX) -> float:
    """Seconds to wait for more rows after a drain that claimed ``claimed``, at most
    ``longest`` (--linger)."""
    return min(longest, claimed * LINGER_PER_ROW)


# While rows come slower than RATE_FAST a second the relay keeps the sleep lock as it
# works: every producer then notifies, and each wake-up is one claim, with no
# confirming claim and no lock round trip. Faster than that, a claim per commit costs
# more CPU than claims at the linger pace, and every commit's notify takes the
# notification queue's lock: the lock goes, producers stop notifying, and the
# scheduler claims at the linger pace until the rate falls below RATE_SLOW. Decided
# by the rate, not by one batch's size, so that the way the relay runs at a given
# load does not depend on its history (docs/performance.md, *Two ways of running*).
RATE_FAST = 600.0
RATE_SLOW = 400.0
# Rows claimed a second are averaged over about this long.
RATE_WINDOW = 0.5


class ClaimRate:
    """Rows claimed a second, decayed exponentially over RATE_WINDOW, and whether they
    come fast: above RATE_FAST, and until the rate falls below RATE_SLOW."""

    def __init__(self) -> None:
        self._rows = 0.0  # decayed to _at
        self._at = 0.0
        self.fast = False

    def observe(self, now: float, rows: int) -> bool:
        """Count ``rows`` claimed at ``now``; whether rows come fast."""
        self._rows = self._rows * math.exp(min(0.0, self._at - now) / RATE_WINDOW) + rows
        self._at = max(self._at, now)
        per_second = self._rows / RATE_WINDOW
        self.fast = per_second >= RATE_SLOW if self.fast else per_second > RATE_FAST
        return self.fast

    def gap(self, longest: float = LINGER_MAX) -> float:
        """How long to wait after a claim that found nothing while rows come fast: about
        two rows' worth at the last rate, up to ``longest`` (--linger)."""
        per_second = self._rows / RATE_WINDOW
        return longest if per_second <= 0 else min(longest, 2.0 / per_second)


# How soon to claim again when producers were mid-transaction as the scheduler
# tried to sleep (they may have skipped their notify): at once, then after a pause
# that doubles up to this while a long transaction keeps the sleep lock from us.
SLEEP_RETRY_MAX = 0.02


def sleep_retry_pause(busy_streak: int) -> float:
    """Seconds to wait before claiming again after the ``busy_streak``-th failed try
    in a row to take the sleep lock: 0, 1 ms, 2 ms, 4 ms, ... up to 20 ms."""
    if busy_streak <= 1:
        return 0.0
    return min(0.001 * 2.0 ** min(busy_streak - 2, 30), SLEEP_RETRY_MAX)


# When every claimed row had to wait for another relay's batch, try again after this
# long rather than at once: the other batch is done within publish_timeout, and
# re-claiming in a tight loop would only burn both databases' CPU.
CONTENTION_PAUSE = 0.05

# How many batches may be in flight at once while the backlog is deep. A batch spends
# most of its time waiting: for its claim, for the broker's acks, for its marks and
# commit. A second batch, claimed as soon as the first one's claim is in, fills those
# waits; its rows of a subject the first batch also holds go out after the first
# batch's acks (relay.batch). Two drain faster than one; three gained nothing
# (docs/performance.md).
BATCHES_IN_FLIGHT = 2


def failure_summary(results: Iterable[PublishResult]) -> str:
    """The failures among ``results``, counted by reason: "no_responders x 12"."""
    reasons = Counter(r.reason.value for r in results if isinstance(r, Failed))
    return ", ".join(f"{reason} x {count}" for reason, count in reasons.most_common())


class StreamlessSubjects:
    """The NATS subjects (event types) this relay met that no stream captures: a
    warning the first time each is met, and again when a stream takes it, and a
    gauge of how many there are now. Their rows wait; they are the operator's to
    fix, by adding the subject to a stream."""

    def __init__(self, set_gauge: Callable[[float], None]) -> None:
        self._subjects: set[str] = set()
        self._set_gauge = set_gauge

    def record(self, published: Iterable[str], without_stream: Set[str]) -> None:
        """One batch: the subjects it published (a stream captures them now) and those
        JetStream said no stream captures."""
        if not self._subjects and not without_stream:
            return  # the common case: nothing to track, nothing to say
        before = set(self._subjects)
        self._subjects = (self._subjects | without_stream) - set(published)
        for subject in sorted(self._subjects - before):
            log.warning(
                "no stream captures subject %r: its rows wait, their attempts untouched, "
                "until a stream's subjects include it",
                subject,
                extra={"event_type": subject},
            )
        for subject in sorted(before - self._subjects):
            log.info(
                "subject %r is captured by a stream now", subject, extra={"event_type": subject}
            )
        self._set_gauge(len(self._subjects))


class _PassesOver(Exception):
    """The relay is stopping, or NATS is gone: no more passes for now."""


@dataclass(frozen=True)
class PassResult:
    claimed: int
    settled: int  # rows acked or marked failed
    held: int
    acked: int = 0
    broker_outage: bool = False
    # How the broker failed an outage batch: "no_responders x 12, timeout x 3".
    broker_problem: str = ""
    # The claim found rows beyond where its walks ended (relay/claimstart.py).
    found_beyond: bool = False

    def more_work_likely(self, batch_size: int) -> bool:
        return self.found_beyond or (self.claimed == batch_size and self.settled > 0)


class SleepLock(Protocol):
    """The LISTEN task's side of the sleep protocol (:class:`relay.listener.Listener`)."""

    async def prepare_sleep(self) -> Sleep: ...

    def wake_up(self) -> None: ...

    @property
    def grant(self) -> int:
        """Which grant of the sleep lock this relay holds (a new number each time it
        is taken), or the last one it held."""
        ...

    def holds(self, grant: int) -> bool:
        """Whether this relay has held the sleep lock since ``grant`` without a break."""
        ...

    @property
    def stands_by(self) -> bool:
        """Whether another relay sharing the table paces it (holds its pace lock)."""
        ...

    def pace(self, wanted: bool) -> None:
        """Whether this relay may pace the table (not while it cannot publish)."""
        ...


class BrokerLink(Protocol):
    """Whether there is a broker to publish to (:class:`relay.broker.Broker`)."""

    @property
    def connected(self) -> bool: ...


class Scheduler:
    """Decides when batches run. ``run_batch`` runs one batch (claim, publish, mark,
    commit: :class:`relay.batch.Batch`) and may be called again before the previous
    call returns, up to BATCHES_IN_FLIGHT at once."""

    def __init__(
        self,
        *,
        config: Config,
        run_batch: Callable[[], Awaitable[BatchOutcome]],
        broker: BrokerLink,
        metrics: Metrics,
        health: Health,
        wakeup: Wakeup,
        listener: SleepLock,
    ) -> None:
        self._config = config
        self._run_batch = run_batch
        self._broker = broker
        self._metrics = metrics
        self._health = health
        self._wakeup = wakeup
        self._listener = listener
        self.heartbeat = 0.0
        self._woken = False
        # The grant of the sleep lock kept while rows come slowly (see RATE_FAST).
        self._kept: int | None = None
        self._rate = ClaimRate()
        # Of the rows the last drain published, how long the oldest had waited.
        self._longest_wait = 0.0
        self._streamless = StreamlessSubjects(metrics.subjects_without_stream.set)

    async def run(self, stopping: trio.Event) -> None:
        """Drain, then sleep until woken, until ``stopping`` is set. A stop request
        interrupts a sleep, never a batch in flight.

        Before it sleeps the scheduler takes the sleep lock, which waits out every
        producer that skipped its notify, and claims once more: anything committed
        before the lock is found now, anything after it notifies."""
        busy_streak = 0
        while not stopping.is_set():
            self._longest_wait = 0.0
            claimed = await self.drain(stopping)
            if not self._lock_kept():
                self._awake()  # if the drain ran no batch
            if stopping.is_set():
                break
            self._listener.pace(self._broker.connected)
            if not self._broker.connected or self._listener.stands_by:
                await self._stand_aside(stopping)
                continue
            if self._lock_kept():
                # Light load, the sleep lock held since before this drain's claims:
                # every commit since has notified, so a notification is all there is
                # to wait for.
                await self._sleep_until_woken()
                continue
            if claimed or self._wakeup.pending or self._rate.fast:
                # Rows are flowing: look again in a moment instead of taking the sleep
                # lock, which would make every producer notify (and so take the
                # notification queue's lock at commit) until we woke again.
                found = claimed or self._wakeup.pending
                longest = self._config.linger
                with trio.move_on_after(
                    linger_for(claimed, longest) if found else self._rate.gap(longest)
                ):
                    await self._wakeup.wait_pending()
                self._count(self._wakeup.take())
                continue
            sleep = await self._listener.prepare_sleep()
            busy_streak = busy_streak + 1 if sleep is Sleep.BUSY else 0
            if sleep is Sleep.SAFE:
                # Ours: kept through the claim under it, and through light load after.
                self._kept = self._listener.grant
                await self.drain(stopping)
                if self._lock_kept():
                    await self._sleep_until_woken()
                continue
            if sleep is Sleep.SAFE_OTHER:
                if await self.drain(stopping):
                    self._listener.wake_up()  # rows came in: not asleep after all
                    continue
                self._metrics.sleeps.inc()
                reasons = await self._wakeup.wait()
            elif sleep is Sleep.BUSY:
                # Producers are mid-transaction and may have skipped their notify:
                # claim again soon instead of sleeping through their commit. The
                # pause grows while one long transaction keeps the lock from us.
                with trio.move_on_after(sleep_retry_pause(busy_streak)):
                    await self._wakeup.wait_pending()
                reasons = self._wakeup.take()
            else:
                reasons = await self._wakeup.wait()
            # The sleep lock goes after the first batch (see _awake).
            self._woken = True
            self._count(reasons)

    async def _stand_aside(self, stopping: trio.Event) -> None:
        """Wait without the sleep lock, so that producers do not notify this relay:
        while there is no broker to publish to, until the reconnect (or the poll)
        wakes it; while another relay sharing the table paces it, as a relay alone
        would, for a standby's pause, deaf to notifications, to claim the rows that
        relay leaves (more than it can take, or all of them while it is gone and
        before this one takes over its pace lock)."""
        self._let_lock_go()
        if not self._broker.connected:
            self._count(await self._wakeup.wait())
            return
        with trio.move_on_after(standby_pause(self._longest_wait)):
            await stopping.wait()
        # The claims after the pause answer whatever woke it meanwhile; counted, so
        # that a reconnect while standing by shows (the pace lock of a LISTEN session
        # that died stays taken until its backend has exited).
        self._count(self._wakeup.take())

    def _lock_kept(self) -> bool:
        return self._kept is not None and self._listener.holds(self._kept)

    def _let_lock_go(self) -> None:
        """Rows come faster than light load (or cannot be published): let the sleep
        lock go, so that producers stop notifying."""
        if self._kept is not None:
            self._kept = None
            self._listener.wake_up()

    async def _sleep_until_woken(self) -> None:
        self._metrics.sleeps.inc()
        self._count(await self._wakeup.wait())

    def _awake(self) -> None:
        """Just woken: let the sleep lock go, so that producers stop notifying.

        Not before the first batch after a wake-up: the unlock is a statement on the
        LISTEN connection, and it would compete with that batch for the CPU, on the
        path from a commit to the broker. Until then producers still notify, for
        one batch."""
        if self._woken:
            self._woken = False
            self._listener.wake_up()

    def _count(self, reasons: frozenset[str]) -> None:
        self.heartbeat = trio.current_time()
        for reason in reasons & {"notify", "poll", "reconnect"}:
            self._metrics.wakeups.labels(reason=reason).inc()

    async def drain(self, stopping: trio.Event) -> int:
        """Claim passes until the backlog is empty, riding out database errors; the
        number of rows claimed.

        One lane of passes at first; each full batch brings in another lane, up to
        BATCHES_IN_FLIGHT, so that while one batch waits for its claim, acks or
        marks, the next is claimed and published. Light load stays on one lane."""
        claimed = 0
        lanes = 1  # the first one, run below in this task
        async with trio.open_nursery() as nursery:

            async def lane() -> None:
                nonlocal claimed, lanes
                try:
                    claimed += await self._drain_lane(stopping, more_work)
                finally:
                    lanes -= 1

            def more_work() -> None:
                nonlocal lanes
                if lanes < BATCHES_IN_FLIGHT:
                    lanes += 1
                    nursery.start_soon(lane)

            await lane()  # here, not spawned: no trip through the scheduler
        return claimed

    async def _drain_lane(self, stopping: trio.Event, more_work: Callable[[], None]) -> int:
        """Passes until one finds no more work; ``more_work`` is told of each full
        batch."""
        claimed = 0
        backoff = ReconnectBackoff(initial=0.2, cap=10.0)
        broker_backoff = ReconnectBackoff(initial=0.2, cap=10.0)

        async def bounded_pass() -> PassResult:
            self.heartbeat = trio.current_time()
            if stopping.is_set() or not self._broker.connected:
                # Nothing to publish to: leave the rows alone rather than burn their
                # attempts. The reconnect callback wakes the loop again.
                raise _PassesOver
            try:
                with trio.fail_after(self._config.publish_timeout + DATABASE_BUDGET):
                    return await self.run_pass()
            except trio.TooSlowError:
                raise DatabaseUnavailable("a batch took too long: database unresponsive") from None

        def pass_failed(failure: BaseException) -> None:
            if isinstance(failure, UnexpectedError):
                return  # counted where it was met
            self._metrics.database_errors.labels(task="publisher").inc()
            if isinstance(failure, DatabaseUnavailable):
                self._health.database = False

        async def pause(delay: float) -> None:
            with trio.move_on_after(delay):
                await stopping.wait()

        while True:
            try:
                result = await retry(
                    bounded_pass,
                    failures=(RelayError,),
                    backoff=backoff,
                    describe=lambda exc: f"batch failed: {exc}",
                    on_failure=pass_failed,
                    pause=pause,
                )
            except _PassesOver:
                return claimed
            self._health.database = True
            backoff.reset()
            claimed += result.claimed
            if result.broker_outage:
                # The broker's fault, not the rows': they were left as they were. Try
                # again after a pause that grows, as for any dependency that is down.
                self._health.broker_acking = False
                self._health.broker_problem = result.broker_problem
                self._metrics.broker_outage_batches.inc()
                delay = broker_backoff.next_delay()
                log.warning(
                    "NATS acknowledged none of a batch of %d rows (%s): they wait with their "
                    "attempts untouched; retrying in %.1fs",
                    result.claimed,
                    result.broker_problem,
                    delay,
                )
                await pause(delay)
                continue
            if result.acked or not result.claimed:
                # An ack; or nothing left to publish (another replica drained what this
                # one waited on): no outage to report either way.
                self._health.broker_acking = True
                self._health.broker_problem = ""
                broker_backoff.reset()
            if result.more_work_likely(self._config.batch_size):
                more_work()
                continue
            if result.held and not result.settled:
                await pause(CONTENTION_PAUSE)
                continue
            return claimed

    async def run_pass(self) -> PassResult:
        """One batch (see :mod:`relay.batch`)."""
        try:
            outcome = await self._run_batch()
        except RelayError:
            self._let_lock_go()
            raise
        except Exception as exc:
            # A bug of the relay's or a library's: the batch's transaction rolled
            # back, its rows wait with their attempts untouched, and the relay keeps
            # serving rather than stop into the same batch again.
            self._let_lock_go()
            log.exception("a batch failed for a reason the relay did not expect")
            self._metrics.unexpected_errors.labels(task="publisher").inc()
            raise UnexpectedError(f"unexpected {first_line(exc)}") from exc
        finally:
            self._awake()
        if self._rate.observe(trio.current_time(), len(outcome.rows)):
            self._let_lock_go()
        if outcome.from_first_entry:
            self._metrics.claims_from_first_entry.inc()
        self._metrics.claims_bounded.set(0 if outcome.from_first_entry else 1)
        self._metrics.claims_past_reach.set(1 if outcome.past_reach else 0)
        if outcome.below_floor:
            self._metrics.claims_below_floor.inc()
        if outcome.rows:
            self._record(outcome)
        acked = sum(1 for result in outcome.results.values() if isinstance(result, Acked))
        return PassResult(
            len(outcome.rows),
            len(outcome.results),
            len(outcome.held),
            acked,
            outcome.broker_outage,
            failure_summary(outcome.results.values()) if outcome.broker_outage else "",
            outcome.found_beyond,
        )

    def _record(self, outcome: BatchOutcome) -> None:
        """Metrics and logs for a committed batch: only what the table now says."""
        self._metrics.batch_size.observe(len(outcome.rows))
        if outcome.held:
            self._metrics.held.inc(len(outcome.held))
        by_id = {row.id: row for row in outcome.rows}
        results, marks = outcome.results, outcome.marks
        dead = {row.id for row, _ in marks.newly_dead}
        now = time.time()
        published: Counter[str] = Counter()
        without_stream: set[str] = set()
        latencies: list[float] = []
        longest_wait = self._longest_wait
        duplicates = 0
        for row_id, result in results.items():
            row = by_id[row_id]
            if isinstance(result, Acked):
                published[row.event_type] += 1
                duplicates += result.duplicate
                latency = now - row.created_at
                longest_wait = max(longest_wait, latency)
                if latency < math.inf:  # a created_at of -infinity has no latency
                    latencies.append(max(latency, 0.0))
                continue
            self._metrics.publish_failures.labels(
                event_type=self._metrics.event_type(row.event_type),
                reason=result.reason.value,
            ).inc()
            if result.reason is FailureReason.NO_STREAM:
                without_stream.add(row.event_type)
            if row_id in dead or outcome.broker_outage or result.reason.broker_fault:
                continue  # logged below: as a dead row, or once for the batch
            log.warning(
                "publish failed: %s",
                result.detail,
                extra={
                    "row_id": row.id,
                    "event_type": row.event_type,
                    "reason": result.reason.value,
                    "attempts": row.attempts + 1,
                },
            )
        self._streamless.record(published, without_stream)
        if marks.broker_faults:
            event_types = sorted({row.event_type for row, _ in marks.broker_faults})
            log.warning(
                "%d rows failed for the broker's reason (%s): they wait, their attempts "
                "untouched, and hold their subjects back",
                len(marks.broker_faults),
                failure_summary(failure for _, failure in marks.broker_faults),
                extra={"event_types": event_types[:10]},
            )
        self._metrics.publish_latency.observe_many(latencies)
        self._longest_wait = longest_wait
        for event_type, count in published.items():
            self._metrics.published.labels(event_type=self._metrics.event_type(event_type)).inc(
                count
            )
        if duplicates:
            self._metrics.duplicates.inc(duplicates)
        for row, failure in marks.newly_dead:
            self._metrics.dead_marked.labels(
                event_type=self._metrics.event_type(row.event_type),
                reason=failure.reason.value,
            ).inc()
            log.error(
                "row is at the attempt cap and is left alone until requeued: %s",
                failure.detail,
                extra={
                    "row_id": row.id,
                    "event_type": row.event_type,
                    "reason": failure.reason.value,
                },
            )
