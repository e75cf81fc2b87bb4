"""The LISTEN task's protocol with the publisher (SAFE, SAFE_OTHER, BUSY, DEAF, held
all along), the pace lock, its keepalive and its reconnects: the real Listener, a
fake connection that models the sleep and pace locks the way Postgres holds them,
and trio's virtual clock."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing
from prometheus_client import CollectorRegistry

from relay.errors import DatabaseUnavailable
from relay.health import Health
from relay.listener import PACE_RETRY, SELF_CHECK_AGAIN, Listener, Sleep
from relay.metrics import Metrics
from relay.wakeup import Wakeup


class LockServer:
    """What Postgres knows: who holds the sleep lock, whether producers are in the
    middle of a transaction (they hold it shared), whether another relay sleeps."""

    def __init__(self) -> None:
        self.holder: FakeConnection | None = None
        self.pacer: object | None = None  # who holds the pace lock (another relay: any object)
        self.pace_tries = 0
        self.producers_in_flight = False
        self.other_relay_sleeps = False
        self.connections: list[FakeConnection] = []
        self.refuse_connections = False
        self.connect_attempts = 0
        self.releases = 0
        # Self-check notifications that reach the LISTEN connection (a transaction
        # pooler delivers none), and every one sent.
        self.delivers = True
        self.delivered: set[str] = set()
        self.sent: list[str] = []


class FakeConnection:
    def __init__(self, server: LockServer) -> None:
        self.server = server
        self.broken = False
        self.listening: str | None = None
        self.probes = 0
        self.hang_on_lock = False
        self._notification = trio.Event()
        self._gone = trio.Event()

    def _check(self) -> None:
        if self.broken:
            raise DatabaseUnavailable("LISTEN connection: the connection is lost")

    async def listen(self, channel: str) -> None:
        self._check()
        self.listening = channel

    async def probe(self) -> None:
        await trio.lowlevel.checkpoint()
        self.probes += 1
        self._check()

    async def try_sleep_lock(self) -> bool:
        self._check()
        if self.hang_on_lock:
            await self._gone.wait()  # answered only by the connection's end
            self._check()
        if self.server.producers_in_flight or self.server.holder not in (None, self):
            await trio.sleep(0.010)  # the lock timeout
            return False
        self.server.holder = self
        return True

    async def another_relay_sleeps(self) -> bool:
        self._check()
        return self.server.other_relay_sleeps

    async def set_listening(self, channel: str, listening: bool) -> None:
        await trio.lowlevel.checkpoint()
        self._check()
        self.listening = channel if listening else None

    async def try_pace_lock(self) -> bool:
        await trio.lowlevel.checkpoint()
        self._check()
        self.server.pace_tries += 1
        if self.server.pacer not in (None, self):
            return False
        self.server.pacer = self
        return True

    async def release_pace_lock(self) -> None:
        self._check()
        assert self.server.pacer is self
        self.server.pacer = None

    async def release_sleep_lock(self) -> None:
        self._check()
        assert self.server.holder is self
        self.server.holder = None
        self.server.releases += 1

    def notify(self) -> None:
        self._notification.set()

    def lose(self) -> None:
        self.broken = True
        self._notification.set()
        self._gone.set()

    async def wait_for_notification(self, seconds: float, notified: Callable[[], None]) -> int:
        with trio.move_on_after(seconds):
            await self._notification.wait()
            self._notification = trio.Event()
            self._check()
            notified()
            return 1
        return 0

    async def hears(self, payload: str, seconds: float, notified: Callable[[], None]) -> bool:
        self._check()
        with trio.move_on_after(seconds):
            while payload not in self.server.delivered:  # noqa: ASYNC110 - plain state, virtual clock
                await trio.sleep(0.001)
            return True
        return False

    async def close(self) -> None:
        # The locks die with their session.
        if self.server.holder is self:
            self.server.holder = None
        if self.server.pacer is self:
            self.server.pacer = None


class World:
    def __init__(self, keepalive: float = 10.0, other_pacer: bool = False) -> None:
        self.server = LockServer()
        if other_pacer:
            self.server.pacer = object()  # another relay's session
        self.wakeup = Wakeup()
        self.health = Health()
        self.metrics = Metrics(CollectorRegistry())
        self.listener = Listener(
            connect=self._connect,
            channel="outbox_events",
            keepalive=keepalive,
            wakeup=self.wakeup,
            health=self.health,
            metrics=self.metrics,
        )

    async def _connect(self) -> FakeConnection:
        await trio.lowlevel.checkpoint()
        self.server.connect_attempts += 1
        if self.server.refuse_connections:
            raise DatabaseUnavailable("LISTEN connection: connection refused")
        conn = FakeConnection(self.server)
        self.server.connections.append(conn)
        return conn

    @property
    def conn(self) -> FakeConnection:
        return self.server.connections[-1]

    async def until(
        self, predicate: Callable[[], bool], limit: float = 60.0, step: float = 0.001
    ) -> None:
        with trio.fail_after(limit):
            while not predicate():  # noqa: ASYNC110 - polling plain state on a virtual clock
                await trio.sleep(step)


def run(test: Callable[[World], Awaitable[None]], **kwargs: float | bool) -> None:
    async def main() -> None:
        world = World(**kwargs)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(world.listener.run)
            await world.until(lambda: world.health.listening)
            await test(world)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_safe_while_this_relay_holds_the_lock_and_the_lock_goes_on_waking():
    async def test(world: World) -> None:
        assert await world.listener.prepare_sleep() is Sleep.SAFE
        assert world.server.holder is world.conn
        world.listener.wake_up()
        await world.until(lambda: world.server.holder is None)
        assert world.server.releases == 1

    run(test)


def test_busy_while_producers_are_in_flight_and_no_relay_sleeps():
    async def test(world: World) -> None:
        world.server.producers_in_flight = True
        assert await world.listener.prepare_sleep() is Sleep.BUSY
        assert world.server.holder is None
        world.server.producers_in_flight = False
        assert await world.listener.prepare_sleep() is Sleep.SAFE

    run(test)


def test_safe_other_while_another_relay_sleeps_holding_the_lock():
    async def test(world: World) -> None:
        world.server.producers_in_flight = True  # the lock is not to be had...
        world.server.other_relay_sleeps = True  # ...because another relay holds it
        assert await world.listener.prepare_sleep() is Sleep.SAFE_OTHER
        assert world.server.holder is None

    run(test)


def test_deaf_at_once_without_a_listen_connection():
    async def test(world: World) -> None:
        world.server.refuse_connections = True
        world.conn.lose()
        await world.until(lambda: not world.health.listening)
        started = trio.current_time()
        assert await world.listener.prepare_sleep() is Sleep.DEAF
        assert trio.current_time() == started

    run(test)


def test_deaf_when_the_connection_is_lost_with_a_request_pending():
    async def test(world: World) -> None:
        world.conn.hang_on_lock = True
        answers: list[tuple[Sleep, float]] = []
        async with trio.open_nursery() as nursery:

            async def ask() -> None:
                answers.append((await world.listener.prepare_sleep(), trio.current_time()))

            nursery.start_soon(ask)
            await trio.sleep(1)
            assert answers == []
            lost_at = trio.current_time()
            world.conn.lose()  # as the real connection's watchdog would break it
        # Heard at once, not after the request's 5 s limit.
        assert answers == [(Sleep.DEAF, lost_at)]

    run(test)


def test_a_request_never_answered_becomes_deaf_after_five_seconds():
    async def test(world: World) -> None:
        world.conn.hang_on_lock = True
        started = trio.current_time()
        assert await world.listener.prepare_sleep() is Sleep.DEAF
        assert trio.current_time() - started == 5

    run(test)


def test_a_second_sleep_asked_before_the_lock_went_is_answered_safe_from_the_held_lock():
    async def test(world: World) -> None:
        assert await world.listener.prepare_sleep() is Sleep.SAFE
        world.listener.wake_up()
        started = trio.current_time()
        # No checkpoint in between: the task has not let the lock go yet.
        assert await world.listener.prepare_sleep() is Sleep.SAFE
        assert trio.current_time() == started  # answered, not left to time out
        assert world.server.releases == 0  # held all along
        assert world.server.holder is world.conn

    run(test)


def test_the_first_relay_paces_the_table_and_a_relay_after_it_stands_by():
    async def test(world: World) -> None:
        # Alone: the pace lock taken before the connection counts as listening.
        assert world.server.pacer is world.conn
        assert not world.listener.stands_by
        assert world.metrics.registry.get_sample_value("outbox_relay_pacing") == 1

    run(test)

    async def another_paces(world: World) -> None:
        assert world.listener.stands_by
        assert world.conn.listening is None  # notifications are for the relay that paces
        assert world.metrics.registry.get_sample_value("outbox_relay_pacing") == 0
        # It tries again every PACE_RETRY, and paces once the other relay has gone.
        tries = world.server.pace_tries
        await trio.sleep(PACE_RETRY * 3 + 0.001)
        assert world.server.pace_tries == tries + 3
        gone_at = trio.current_time()
        world.server.pacer = None
        await world.until(lambda: not world.listener.stands_by)
        assert world.server.pacer is world.conn
        assert trio.current_time() - gone_at <= PACE_RETRY
        assert world.conn.listening == "outbox_events"
        assert "reconnect" in world.wakeup.take()  # a sweep: it was deaf until now
        tries = world.server.pace_tries
        await trio.sleep(PACE_RETRY * 3)
        assert world.server.pace_tries == tries  # pacing: nothing more to try

    run(another_paces, other_pacer=True)


def test_a_relay_that_may_not_pace_lets_the_pace_lock_go_and_takes_it_again_after():
    async def test(world: World) -> None:
        assert world.server.pacer is world.conn
        world.listener.pace(False)  # no broker to publish to
        await world.until(lambda: world.server.pacer is None)
        assert world.conn.listening is None
        assert world.metrics.registry.get_sample_value("outbox_relay_pacing") == 0
        await trio.sleep(PACE_RETRY * 3)
        assert world.server.pacer is None  # not taken again meanwhile
        world.listener.pace(True)
        await world.until(lambda: world.server.pacer is world.conn, limit=0.01)
        assert not world.listener.stands_by
        assert world.conn.listening == "outbox_events"

    run(test)


def test_the_pace_lock_goes_with_a_lost_connection_and_comes_back_with_the_next():
    async def test(world: World) -> None:
        first = world.conn
        world.server.refuse_connections = True
        first.lose()
        await world.until(lambda: not world.health.listening)
        assert world.server.pacer is None
        assert not world.listener.stands_by  # not listening: it runs as a relay alone
        assert world.metrics.registry.get_sample_value("outbox_relay_pacing") == 0
        world.server.refuse_connections = False
        await world.until(lambda: world.health.listening)
        assert world.server.pacer is world.conn is not first

    run(test)


def test_a_notification_wakes_the_publisher():
    async def test(world: World) -> None:
        world.wakeup.take()  # the sweep of the first connect
        world.conn.notify()
        with trio.fail_after(1):
            assert await world.wakeup.wait() == {"notify"}

    run(test)


def test_a_quiet_connection_is_probed_every_keepalive():
    async def test(world: World) -> None:
        await trio.sleep(35)
        assert world.conn.probes == 3
        assert len(world.server.connections) == 1

    run(test, keepalive=10.0)


def test_notifications_do_not_put_the_probe_off():
    # The server ends a session that says nothing for a while (idle_session_timeout,
    # so that a frozen relay's lock goes): a live listener must speak at least every
    # keepalive, however often notifications come.
    async def test(world: World) -> None:
        for _ in range(12):
            await trio.sleep(3)
            world.conn.notify()
        assert world.conn.probes == 3  # at 10, 20 and 30 s
        assert len(world.server.connections) == 1

    run(test, keepalive=10.0)


def test_a_lost_connection_is_replaced_with_a_sweep_and_the_lock_goes_with_it():
    async def test(world: World) -> None:
        assert world.wakeup.take() == {"reconnect"}
        assert await world.listener.prepare_sleep() is Sleep.SAFE
        first = world.conn
        first.lose()
        await world.until(lambda: not world.health.listening)
        assert world.metrics.registry.get_sample_value("outbox_relay_listen_connected") == 0
        assert world.server.holder is None  # the lock died with the session
        await world.until(lambda: world.health.listening and world.conn is not first)
        assert world.wakeup.take() == {"reconnect"}  # rows may have come meanwhile
        assert world.conn.listening == "outbox_events"
        # A new request is served on the new connection.
        assert await world.listener.prepare_sleep() is Sleep.SAFE
        assert world.server.holder is world.conn

    run(test)


def test_reconnects_back_off_while_the_server_refuses():
    async def test(world: World) -> None:
        world.server.refuse_connections = True
        world.conn.lose()
        await trio.sleep(20)
        # Exponential from 0.1 s, capped at 5 s, each delay 0.5 to 1 times that: a
        # handful of tries in 20 s (8 with the longest delays, 12 with the shortest),
        # never a hot loop.
        assert not world.health.listening
        assert 8 <= world.server.connect_attempts - 1 <= 12
        world.server.refuse_connections = False
        await world.until(lambda: world.health.listening, limit=6)
        assert len(world.server.connections) == 2

    run(test)


class CheckedWorld(World):
    """A listener that checks, at its first connect, that it hears a notification
    sent another way."""

    def __init__(self, delivers: bool) -> None:
        super().__init__()
        self.server.delivers = delivers
        self.checked: list[bool] = []
        self.listened = False
        self.listener = Listener(
            connect=self._connect,
            channel="outbox_events",
            keepalive=10.0,
            wakeup=self.wakeup,
            health=self.health,
            metrics=self.metrics,
            self_check=self._send,
            on_checked=self.checked.append,
        )

    async def _send(self, payload: str) -> None:
        await trio.lowlevel.checkpoint()
        self.server.sent.append(payload)
        if self.server.delivers:
            self.server.delivered.add(payload)


def run_checked(delivers: bool) -> CheckedWorld:
    world = CheckedWorld(delivers)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(world.listener.run)
            await world.until(lambda: bool(world.checked))
            await world.until(lambda: world.health.listening or bool(world.health.poll_only))
            world.listened = world.health.listening
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return world


def test_the_self_check_heard_once_and_the_listener_listens():
    world = run_checked(delivers=True)
    assert world.checked == [True]
    assert len(world.server.sent) == 1
    assert world.listened
    assert world.health.poll_only == ""
    assert world.health.ready_detail() == ""


def test_a_self_check_never_heard_leaves_the_relay_on_its_poll():
    world = run_checked(delivers=False)
    assert world.checked == [False]
    assert len(world.server.sent) == 3  # tried three times, a second each
    assert not world.listened
    assert world.health.poll_only == "the LISTEN connection hears no notification"
    assert "LISTEN" not in (world.health.not_ready_reason() or "")
    assert world.metrics.poll_only._value.get() == 1
    assert world.server.holder is None


def test_after_a_check_never_heard_the_listener_connects_again_only_to_check_again():
    world = CheckedWorld(delivers=False)
    connections: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(world.listener.run)
            await world.until(lambda: bool(world.health.poll_only))
            await trio.sleep(SELF_CHECK_AGAIN - 5)
            connections.append(len(world.server.connections))  # none meanwhile
            await world.until(lambda: len(world.checked) == 2, limit=60, step=0.5)
            connections.append(len(world.server.connections))
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert connections == [1, 2]
    assert world.checked == [False, False]


def test_poll_only_never_connects():
    async def main() -> None:
        world = World()
        world.listener = Listener(
            connect=world._connect,
            channel="outbox_events",
            keepalive=10.0,
            wakeup=world.wakeup,
            health=world.health,
            metrics=world.metrics,
            poll_only="--poll-only",
        )
        await world.listener.run()
        assert world.server.connect_attempts == 0
        assert world.health.poll_only == "--poll-only"
        assert await world.listener.prepare_sleep() is Sleep.DEAF

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_failed_self_check_is_tried_again_and_a_heard_one_resumes_listening():
    """A check that failed for a moment's reason does not leave the relay on its
    poll for good: minutes later it checks again, and listens once it hears."""
    world = CheckedWorld(delivers=False)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(world.listener.run)
            await world.until(lambda: bool(world.health.poll_only), limit=30)
            world.server.delivers = True
            started = trio.current_time()
            await world.until(lambda: world.health.listening, limit=SELF_CHECK_AGAIN + 60, step=0.5)
            assert trio.current_time() - started >= SELF_CHECK_AGAIN - 5
            assert world.health.poll_only == ""
            assert world.metrics.poll_only._value.get() == 0
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert world.checked == [False, True]
    assert len(world.server.connections) == 2
