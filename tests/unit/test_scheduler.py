"""The scheduler loop's states (drain, linger, sleep, busy, deaf, broker down, database
down) and its lanes: the real Scheduler, fakes of the batch, the sleep lock and the
broker link, and trio's virtual clock."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from itertools import pairwise
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from relay.batch import BatchOutcome
from relay.config import Config
from relay.errors import DatabaseUnavailable
from relay.health import Health
from relay.listener import Sleep
from relay.marks import Marks
from relay.metrics import Metrics
from relay.model import Acked, Failed, FailureReason, OutboxRow, PublishResult
from relay.scheduler import (
    BATCHES_IN_FLIGHT,
    LINGER_MAX,
    LINGER_PER_ROW,
    RATE_FAST,
    RATE_SLOW,
    SLEEP_RETRY_MAX,
    STANDBY_PAUSE,
    STANDBY_PAUSE_IDLE,
    Scheduler,
    sleep_retry_pause,
)
from relay.wakeup import Wakeup

BATCH_SIZE = 10
BATCH_TIME = 0.005  # virtual seconds one batch takes


class Table:
    """Rows waiting to be claimed; each batch takes up to BATCH_SIZE and acks them."""

    def __init__(self) -> None:
        self.pending = 0
        self.claims: list[tuple[float, int]] = []  # (time, rows claimed)
        self.in_flight = 0
        self.most_in_flight = 0
        self.failures: list[Exception] = []  # raised by the next batches, in turn
        self.broker_down = False  # every message sent times out
        self.young = False  # rows' created_at now (real time), not long ago
        self.events: list[str] = []

    async def run_batch(self) -> BatchOutcome:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            self.events.append("claim")
            if self.failures:
                await trio.sleep(BATCH_TIME)
                raise self.failures.pop(0)
            taken = min(BATCH_SIZE, self.pending)
            self.claims.append((trio.current_time(), taken))
            await trio.sleep(BATCH_TIME)
            created_at = time.time() if self.young else 0.0
            rows = [
                OutboxRow(
                    str(uuid.uuid4()), "a.b", "s", f"subject-{i}", "t", "{}", created_at, i, 0
                )
                for i in range(taken)
            ]
            if self.broker_down and rows:
                timeout = Failed(FailureReason.TIMEOUT, "no ack")
                results: dict[str, PublishResult] = {row.id: timeout for row in rows}
                return BatchOutcome(rows=rows, results=results, broker_outage=True)
            self.pending -= taken
            return BatchOutcome(
                rows=rows,
                results={row.id: Acked() for row in rows},
                marks=Marks(published=[row.id for row in rows]),
            )
        finally:
            self.in_flight -= 1


class SleepLock:
    """The sleep lock as the listener keeps it: SAFE takes it (a new grant), and it is
    held until the scheduler wakes up (or asks again while still holding it)."""

    def __init__(self, table: Table) -> None:
        self.answers: list[Sleep] = []  # next answers; SAFE once they run out
        self.asked: list[float] = []
        self.woken = 0
        self.held = False
        self.grant = 0
        self.stands_by = False  # another relay paces the table
        self.paced: list[bool] = []  # what the scheduler said, each time round
        self._table = table

    async def prepare_sleep(self) -> Sleep:
        await trio.lowlevel.checkpoint()
        self.asked.append(trio.current_time())
        self._table.events.append("prepare_sleep")
        answer = self.answers.pop(0) if self.answers else Sleep.SAFE
        if answer is Sleep.SAFE and not self.held:
            self.held = True
            self.grant += 1
        return answer

    def wake_up(self) -> None:
        self.woken += 1
        self.held = False
        self._table.events.append("wake_up")

    def holds(self, grant: int) -> bool:
        return self.held and self.grant == grant

    def pace(self, wanted: bool) -> None:
        self.paced.append(wanted)


class BrokerLink:
    connected = True


class World:
    def __init__(self, **settings: Any) -> None:
        self.table = Table()
        self.lock = SleepLock(self.table)
        self.broker = BrokerLink()
        self.wakeup = Wakeup()
        self.health = Health(listening=True, broker=True)  # their tasks are not here
        self.metrics = Metrics(CollectorRegistry())
        self.stopping = trio.Event()
        self.scheduler = Scheduler(
            config=Config(batch_size=BATCH_SIZE, **settings),
            run_batch=self.table.run_batch,
            broker=self.broker,
            metrics=self.metrics,
            health=self.health,
            wakeup=self.wakeup,
            listener=self.lock,
        )

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    async def asleep(self) -> None:
        """Until the scheduler sleeps (counted), and the virtual clock has moved on."""
        sleeps = self.metric("outbox_relay_sleeps_total")
        with trio.fail_after(60):
            while self.metric("outbox_relay_sleeps_total") == sleeps:  # noqa: ASYNC110
                await trio.sleep(0.001)


def run(test: Callable[[World], Awaitable[None]], **settings: Any) -> None:
    async def main() -> None:
        world = World(**settings)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(world.scheduler.run, world.stopping)
            await test(world)
            world.stopping.set()
            world.wakeup.set("stop")

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_at_rest_it_claims_under_the_lock_once_then_sleeps_until_woken():
    async def test(world: World) -> None:
        await world.asleep()
        # One empty claim, the sleep lock, one more claim under it, then asleep.
        assert world.table.events == ["claim", "prepare_sleep", "claim"]
        await trio.sleep(3600)
        assert len(world.table.events) == 3  # nothing at all while asleep
        world.table.pending = 1
        world.wakeup.set("notify")
        await world.asleep()
        # Woken: one claim, and the lock kept (light load: every commit since it was
        # granted has notified, so no claim to confirm and no lock round trip).
        assert world.table.events[3:] == ["claim"]
        assert world.metric("outbox_relay_wakeups_total", reason="notify") == 1
        assert world.table.pending == 0

    run(test)


async def commit_after_each_claim(world: World, rows: int, seconds: float) -> None:
    """A producer that commits ``rows`` rows just after each claim, for ``seconds``;
    its commits notify while the scheduler holds the sleep lock (the trigger's test)."""
    with trio.move_on_after(seconds):
        while True:
            claims = len(world.table.claims)
            while len(world.table.claims) == claims:  # noqa: ASYNC110
                await trio.sleep(0.0001)
            world.table.pending += rows
            if world.lock.held:
                world.wakeup.set("notify")


def per_claim(rate: float) -> int:
    """Rows to commit after each claim (one every BATCH_TIME) for ``rate`` a second."""
    return round(rate * BATCH_TIME)


async def produce(world: World, per_second: float, seconds: float) -> None:
    """A producer that commits a row every 1/``per_second`` seconds for ``seconds``."""
    for _ in range(round(per_second * seconds)):
        await trio.sleep(1 / per_second)
        world.table.pending += 1
        if world.lock.held:
            world.wakeup.set("notify")


def test_at_light_load_it_keeps_the_lock_and_claims_once_per_wake_up():
    async def test(world: World) -> None:
        await world.asleep()
        world.table.pending = 1
        world.wakeup.set("notify")
        assert per_claim(RATE_SLOW) > 1  # one row a claim is light load
        await commit_after_each_claim(world, 1, 1.0)
        # One claim per notification: no empty claim to confirm, no lock round trip.
        # (The first two claims: the one at rest, and the one under the lock.)
        taken = [rows for _, rows in world.table.claims[2:]]
        assert len(taken) > 100
        assert all(taken), taken
        assert world.table.events.count("prepare_sleep") == 1
        assert world.lock.woken == 0
        assert world.metric("outbox_relay_wakeups_total", reason="notify") == len(taken)

    run(test)


def test_while_rows_flow_fast_it_lets_the_lock_go_lingers_and_never_takes_it_again():
    async def test(world: World) -> None:
        await world.asleep()
        asked = len(world.lock.asked)
        rows = per_claim(2 * RATE_FAST)
        world.table.pending = rows
        world.wakeup.set("notify")
        await commit_after_each_claim(world, rows, 1.0)
        assert world.lock.woken == 1
        # Claim after claim, never more than the longest linger apart...
        gaps = [b[0] - a[0] for a, b in pairwise(world.table.claims[1:])]
        assert len(gaps) > 50, world.table.claims
        assert max(gaps) <= BATCH_TIME + LINGER_MAX + 1e-9
        # ...and the sleep lock never taken again, so producers stop notifying.
        assert len(world.lock.asked) == asked
        assert not world.lock.held

    run(test)


@pytest.mark.parametrize("linger", [None, 0.001])
def test_while_rows_flow_fast_it_lingers_at_most_the_linger_setting(linger):
    rows = BATCH_SIZE - 1  # each claim's linger: rows * LINGER_PER_ROW, under the default

    async def test(world: World) -> None:
        await world.asleep()
        world.table.pending = rows
        world.wakeup.set("notify")
        await commit_after_each_claim(world, rows, 1.0)
        gaps = [b[0] - a[0] for a, b in pairwise(world.table.claims[2:])]
        assert len(gaps) > 50, world.table.claims
        longest = rows * LINGER_PER_ROW if linger is None else linger
        assert max(gaps) == pytest.approx(BATCH_TIME + longest, abs=2e-4)

    run(test, **({} if linger is None else {"linger": linger}))


def test_a_burst_at_light_load_keeps_the_lock():
    async def test(world: World) -> None:
        await world.asleep()
        # One producer transaction of many rows, then light load: the way of running
        # follows the rate, not one batch's size.
        world.table.pending = BATCH_SIZE * 3
        world.wakeup.set("notify")
        await commit_after_each_claim(world, 1, 1.0)
        assert world.table.events.count("prepare_sleep") == 1
        assert world.lock.woken == 0

    run(test)


def test_rows_flowing_between_the_two_rates_keep_the_way_the_relay_runs():
    async def test(world: World) -> None:
        await world.asleep()
        between = (RATE_FAST + RATE_SLOW) / 2
        # Below RATE_FAST from rest: the lock is kept throughout...
        await produce(world, between, 2.0)
        assert world.lock.woken == 0
        assert world.table.events.count("prepare_sleep") == 1
        # ...and after a spell above it, the same rate keeps the linger pace.
        await produce(world, 2 * RATE_FAST, 1.0)
        assert world.lock.woken == 1
        asked = len(world.lock.asked)
        await produce(world, between, 2.0)
        assert len(world.lock.asked) == asked
        # Once rows stop, the rate falls, and the relay sleeps under the lock again.
        await world.asleep()
        assert world.lock.held

    run(test)


def test_a_relay_standing_by_claims_now_and_then_deaf_to_notifications():
    async def claims_standing_by(world: World, young: bool) -> list[tuple[float, int]]:
        """A second of claims standing by, rows committed and notifying all along."""
        world.table.young = young
        started = len(world.table.claims)
        pause = STANDBY_PAUSE_IDLE if young else STANDBY_PAUSE
        with trio.move_on_after(1.0):
            while True:  # fewer rows a claim than a batch holds
                await trio.sleep(pause / 5)
                world.table.pending += 1
                world.wakeup.set("notify")
        return world.table.claims[started + 1 :]

    def gaps(claims: list[tuple[float, int]]) -> list[float]:
        return [b[0] - a[0] for a, b in pairwise(claims)]

    async def test(world: World) -> None:
        await world.asleep()
        world.lock.stands_by = True  # another relay took the pace lock
        world.table.pending = 1
        world.wakeup.set("notify")
        asked = len(world.lock.asked)
        # Rows that had waited long (the relay that paces is gone, or behind): a claim
        # every STANDBY_PAUSE, whatever notifications come, and never the sleep lock.
        behind = await claims_standing_by(world, young=False)
        assert not world.lock.held
        assert len(world.lock.asked) == asked
        assert min(gaps(behind)) >= STANDBY_PAUSE
        assert max(gaps(behind)) <= STANDBY_PAUSE + 2 * BATCH_TIME + 1e-9
        assert all(rows for _, rows in behind)  # it takes what it finds
        # Young rows (the relay that paces keeps up): every STANDBY_PAUSE_IDLE.
        keeping_up = await claims_standing_by(world, young=True)
        assert min(gaps(keeping_up[1:])) >= STANDBY_PAUSE_IDLE
        assert max(gaps(keeping_up)) <= STANDBY_PAUSE_IDLE + 2 * BATCH_TIME + 1e-9

    run(test)


def test_a_relay_that_takes_the_pace_lock_runs_as_a_relay_alone():
    async def test(world: World) -> None:
        world.lock.stands_by = True
        await trio.sleep(1.0)
        assert world.metric("outbox_relay_sleeps_total") == 0
        claims = len(world.table.claims)
        assert claims >= 1.0 / (STANDBY_PAUSE_IDLE + BATCH_TIME) - 1
        world.lock.stands_by = False  # the relay that paced has gone
        await world.asleep()
        # Asleep under the sleep lock, woken by notifications again.
        world.table.pending = 1
        world.wakeup.set("notify")
        await world.asleep()
        assert world.table.pending == 0

    run(test)


def test_a_wake_up_that_comes_while_standing_by_is_counted():
    # A LISTEN connection that reconnects while another session still holds the pace
    # lock (the old one's backend not yet gone) stands by, and its reconnect wake-up
    # comes during a standby pause: the claims after the pause answer it, and the
    # wake-ups metric counts it.
    async def test(world: World) -> None:
        await world.asleep()
        world.lock.stands_by = True
        world.wakeup.set("notify")
        claims = len(world.table.claims)
        while len(world.table.claims) == claims:  # noqa: ASYNC110
            await trio.sleep(BATCH_TIME / 10)
        await trio.sleep(2 * BATCH_TIME)  # the drain ended: in the pause
        world.wakeup.set("reconnect")
        with trio.fail_after(1.0):
            while not world.metric("outbox_relay_wakeups_total", reason="reconnect"):  # noqa: ASYNC110
                await trio.sleep(STANDBY_PAUSE / 10)

    run(test)


def test_a_relay_without_a_broker_may_not_pace_the_table():
    async def test(world: World) -> None:
        await world.asleep()
        assert world.lock.paced[-1] is True
        world.broker.connected = False
        world.wakeup.set("notify")
        await trio.sleep(1)
        assert world.lock.paced[-1] is False
        world.broker.connected = True
        world.wakeup.set("reconnect")
        await world.asleep()
        assert world.lock.paced[-1] is True

    run(test)


def test_busy_claims_again_with_a_pause_that_grows_to_a_cap():
    async def test(world: World) -> None:
        world.lock.answers = [Sleep.BUSY] * 12
        await world.asleep()
        asked = world.lock.asked
        assert len(asked) == 13
        # Each try: the pause, a claim, then the ask.
        for streak, (earlier, later) in enumerate(pairwise(asked), start=1):
            assert later - earlier == pytest.approx(sleep_retry_pause(streak) + BATCH_TIME)
        assert sleep_retry_pause(12) == SLEEP_RETRY_MAX
        assert world.metric("outbox_relay_sleeps_total") == 1

    run(test)


def test_deaf_waits_for_a_wake_up_and_claims_nothing_meanwhile():
    async def test(world: World) -> None:
        world.lock.answers = [Sleep.DEAF]
        await trio.sleep(10)
        assert world.table.events == ["claim", "prepare_sleep"]
        assert world.metric("outbox_relay_sleeps_total") == 0  # not asleep: deaf
        world.table.pending = 1
        world.wakeup.set("poll")
        await world.asleep()
        assert world.table.pending == 0
        assert world.metric("outbox_relay_wakeups_total", reason="poll") == 1

    run(test)


def test_no_broker_no_claims_and_no_sleep_lock_until_it_is_back():
    async def test(world: World) -> None:
        await world.asleep()
        events = len(world.table.events)
        world.broker.connected = False
        world.table.pending = 5
        world.wakeup.set("notify")
        await trio.sleep(60)
        # Rows are left alone (their attempts untouched), and the sleep lock goes and
        # is not taken again: producers are not made to notify a relay that could
        # not act on it.
        assert world.table.events[events:] == ["wake_up"]
        assert world.table.pending == 5
        world.broker.connected = True
        world.wakeup.set("reconnect")
        await world.asleep()
        assert world.table.pending == 0

    run(test)


def test_a_deep_backlog_runs_two_batches_at_once_never_more():
    async def test(world: World) -> None:
        await world.asleep()
        world.table.pending = BATCH_SIZE * 50
        world.wakeup.set("notify")
        await world.asleep()
        assert world.table.pending == 0
        assert world.table.most_in_flight == BATCHES_IN_FLIGHT == 2

    run(test)


def test_light_load_stays_on_one_batch_at_a_time():
    async def test(world: World) -> None:
        await world.asleep()
        for _ in range(20):
            world.table.pending = BATCH_SIZE - 1
            world.wakeup.set("notify")
            await world.asleep()
        assert world.table.most_in_flight == 1

    run(test)


def test_a_failing_database_is_retried_with_growing_pauses_and_reported():
    async def test(world: World) -> None:
        await world.asleep()
        world.table.failures = [DatabaseUnavailable("claim: connection refused")] * 5
        world.table.pending = 1
        world.wakeup.set("notify")
        with trio.fail_after(60):
            while world.table.failures:  # noqa: ASYNC110
                await trio.sleep(0.01)
            assert not world.health.database
        await world.asleep()
        assert world.health.database
        assert world.table.pending == 0
        assert world.metric("outbox_relay_database_errors_total", task="publisher") == 5
        starts = [t for t, _ in world.table.claims]
        assert starts  # the retry that worked
        # Backoff from 0.2 s, doubling, half to full jitter: five failures take at
        # least 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s before the claim that works.
        assert starts[-1] >= 3.1

    run(test)


def test_an_unexpected_error_in_a_batch_is_counted_retried_and_never_stops_the_relay(caplog):
    # A bug of the relay's or a library's (here, a row its parser could not read):
    # the batch rolls back, the scheduler logs the traceback and goes on, the rows
    # wait with their attempts untouched, and the next batches publish them.
    async def test(world: World) -> None:
        await world.asleep()
        world.table.failures = [ValueError("number is infinity when parsed as double")] * 3
        world.table.pending = 1
        world.wakeup.set("notify")
        await world.asleep()
        assert world.table.pending == 0
        assert world.metric("outbox_relay_unexpected_errors_total", task="publisher") == 3
        assert world.metric("outbox_relay_database_errors_total", task="publisher") == 0

    with caplog.at_level(logging.WARNING):
        run(test)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 3
    assert tracebacks[0].getMessage() == "a batch failed for a reason the relay did not expect"


def test_a_broker_that_acknowledges_nothing_is_waited_out_not_hammered():
    async def test(world: World) -> None:
        await world.asleep()
        world.table.broker_down = True
        world.table.pending = 3
        world.wakeup.set("notify")
        await trio.sleep(30)
        # Not ready, and saying why; the same rows tried again after pauses that grow
        # to the 10 s cap (about 7 to 12 tries in 30 s), never in a hot loop.
        assert world.health.not_ready_reason() == (
            "NATS acknowledges no publish (timeout x 3): the rows wait, their attempts untouched"
        )
        tries = [t for t, taken in world.table.claims if taken]
        assert 5 <= len(tries) <= 13, tries
        gaps = [b - a for a, b in pairwise(tries)]
        assert max(gaps) <= 10 + BATCH_TIME
        assert world.metric("outbox_relay_broker_outage_batches_total") == len(tries)
        world.table.broker_down = False
        await world.asleep()
        assert world.table.pending == 0
        assert world.health.not_ready_reason() is None

    run(test)


def test_a_broker_outage_ends_in_readiness_when_another_relay_drained_the_rows():
    # While this relay paused after an outage, the broker came back and another
    # replica published every row: this relay's next claim finds nothing, no ack ever
    # comes to it, and it must not stay "not ready" for an outage that is over.
    async def test(world: World) -> None:
        await world.asleep()
        world.table.broker_down = True
        world.table.pending = 3
        world.wakeup.set("notify")
        await trio.sleep(5)
        assert world.health.not_ready_reason() is not None
        world.table.broker_down = False
        world.table.pending = 0  # published by the other replica
        await world.asleep()
        assert world.health.not_ready_reason() is None

    run(test)


def test_stop_interrupts_a_sleep():
    async def main() -> None:
        world = World()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(world.scheduler.run, world.stopping)
            await world.asleep()
            stopped_at = trio.current_time()
            world.stopping.set()
            world.wakeup.set("stop")
        assert trio.current_time() == stopped_at

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
