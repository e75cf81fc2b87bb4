"""The LISTEN task: a dedicated connection that turns notifications into wake-ups,
and holds the sleep lock while the scheduler sleeps.

A notification is only a hint. What makes the relay correct is that it always
re-reads the table: after every (re)connect it sweeps at once, because rows may
have committed while nobody listened, and the poll timer covers anything else.

The sleep lock (see ``sql/install/003_notify_trigger.sql``) lives on this
connection on purpose: if the connection dies, the lock goes with it, producers
stop notifying, and the reconnect sweep covers the gap, exactly as for a lost
LISTEN. So does the pace lock: of the relays sharing a table, the one holding it
paces the table, and the others stand by (see relay/scheduler.py); when that relay
goes, its lock goes with its session, and another relay takes it.

This module decides; the connection itself is a port (:class:`ListenConnection`):
Postgres's is :mod:`relay.listen_connection`, and the unit tests drive the same
protocol through a fake, on a virtual clock.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from relay.backoff import ReconnectBackoff
from relay.errors import RelayError, first_line
from relay.health import Health
from relay.metrics import Metrics
from relay.retry import retry
from relay.wakeup import Wakeup

log = logging.getLogger(__name__)


class Sleep(enum.Enum):
    """May the scheduler sleep until it is notified?"""

    SAFE = "safe"  # this relay holds the sleep lock: producers notify
    SAFE_OTHER = "safe-other"  # another relay holds it: producers notify
    BUSY = "busy"  # producers are in flight: claim again, then retry
    DEAF = "deaf"  # no LISTEN connection: only the poll and the reconnect wake us


class ListenConnection(Protocol):
    """The LISTEN connection as the listener uses it (Postgres's is
    :class:`relay.listen_connection.PostgresListenConnection`). Every call raises a
    :class:`~relay.errors.RelayError` when the connection fails or stops answering."""

    async def listen(self, channel: str) -> None: ...

    async def probe(self) -> None: ...

    async def try_sleep_lock(self) -> bool:
        """Take the sleep lock, waiting briefly for producers in flight; False when
        they did not finish in time."""
        ...

    async def another_relay_sleeps(self) -> bool: ...

    async def release_sleep_lock(self) -> None: ...

    async def set_listening(self, channel: str, listening: bool) -> None:
        """LISTEN on ``channel`` again, or UNLISTEN (a relay standing by)."""
        ...

    async def try_pace_lock(self) -> bool: ...

    async def release_pace_lock(self) -> None: ...

    async def wait_for_notification(self, seconds: float, notified: Callable[[], None]) -> int:
        """Up to ``seconds`` for a notification, calling ``notified`` as it comes; how
        many came."""
        ...

    async def hears(self, payload: str, seconds: float, notified: Callable[[], None]) -> bool:
        """Whether a notification carrying ``payload`` comes within ``seconds``
        (``notified`` is called for any other)."""
        ...

    async def close(self) -> None:
        """Close, shielded and bounded: never raises."""
        ...


def server_idle_timeout(keepalive: float) -> float:
    """Seconds after which the server ends a LISTEN session that has said nothing.

    A live listener runs a statement at least every ``keepalive`` (its probe); one
    that stops (frozen, paused, cut off) keeps its session and its sleep lock open,
    and every producer keeps notifying, paying the notification queue's lock, until
    the server ends the session. Twice the keepalive and a margin for a loaded
    machine: never a live listener, and within half a minute at the default."""
    return 2 * keepalive + 5.0


# The self-check at the first connect: a notification sent through another
# connection must come back on this one. Tries, and how long each waits.
SELF_CHECK_TRIES = 3
SELF_CHECK_SECONDS = 1.0
# After a failed check, how long the relay runs on its poll before it checks again
# (a check that failed for a moment's reason, a database too busy to deliver within
# the seconds above, must not leave a relay on its poll for good).
SELF_CHECK_AGAIN = 300.0

# While another relay paces the table, how often to try its pace lock: how long the
# relays stand by after the pacing relay went (they claim meanwhile, every
# STANDBY_PAUSE), for a statement a second on a standing-by relay's connection.
PACE_RETRY = 1.0


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one real error in a race's exception group (the others are cancellations)."""
    for leaf in group.exceptions:
        if isinstance(leaf, BaseExceptionGroup):
            return _first_error(leaf)
        if not isinstance(leaf, trio.Cancelled):
            return leaf
    return group


class Listener:
    def __init__(
        self,
        *,
        connect: Callable[[], Awaitable[ListenConnection]],
        channel: str,
        keepalive: float,
        wakeup: Wakeup,
        health: Health,
        metrics: Metrics,
        self_check: Callable[[str], Awaitable[None]] | None = None,
        on_checked: Callable[[bool], None] = lambda heard: None,
        poll_only: str = "",
    ) -> None:
        """``self_check`` sends a notification with a payload through a connection
        other than this one, for the check at the first connect (None: no check);
        ``on_checked`` hears whether it came back (if not, the relay runs on its
        poll, and checks again after SELF_CHECK_AGAIN). ``poll_only``, when not
        empty, says why the relay listens not at all."""
        self._connect = connect
        self._channel = channel
        self._self_check = self_check
        self._checker = self_check
        self._on_checked = on_checked
        self._poll_only = poll_only
        self._keepalive = keepalive
        self._wakeup = wakeup
        self._health = health
        self._metrics = metrics
        # When this task last ran a statement on its connection.
        self._spoke_at = 0.0
        # The scheduler's requests, carried out by this task on its connection.
        self._want_sleep = False
        self._holding = False
        self._grants = 0  # how many times this task has been granted the sleep lock
        self._answer: trio.MemorySendChannel[Sleep] | None = None
        self._poke = trio.Event()
        self._paces = False  # holds the pace lock
        self._listening_to_channel = False  # LISTEN, not UNLISTEN, was the last said
        self._want_pace = True  # the scheduler can publish, so may pace
        self._pace_tried_at = -math.inf

    # -- the scheduler's side ---------------------------------------------------

    async def prepare_sleep(self) -> Sleep:
        """Ask for the sleep lock; returns once this task has tried."""
        if not self._health.listening:
            return Sleep.DEAF
        send, receive = trio.open_memory_channel[Sleep](1)
        self._answer, self._want_sleep = send, True
        self._poke.set()
        with trio.move_on_after(5):
            async with receive:
                return await receive.receive()
        return Sleep.DEAF

    @property
    def grant(self) -> int:
        return self._grants

    def holds(self, grant: int) -> bool:
        """Whether the sleep lock has been held since ``grant`` without a break: every
        producer that committed since then has notified."""
        return self._holding and self._grants == grant

    @property
    def stands_by(self) -> bool:
        """Whether another relay paces the table: this one listens and does not hold
        the pace lock."""
        return self._health.listening and not self._paces

    def pace(self, wanted: bool) -> None:
        """Whether this relay may pace the table: not while it cannot publish, so that
        another relay paces it meanwhile."""
        if wanted != self._want_pace:
            self._want_pace = wanted
            self._pace_tried_at = -math.inf
            self._poke.set()

    def wake_up(self) -> None:
        """The scheduler is awake: let the lock go, so producers stop notifying."""
        self._want_sleep = False
        self._answer = None
        if self._holding:
            self._poke.set()

    # -- the task ---------------------------------------------------------------

    async def run(self) -> None:
        if self._poll_only:
            self._run_on_the_poll(self._poll_only)
            return
        backoff = ReconnectBackoff(initial=0.1, cap=5.0)

        def describe(exc: BaseException) -> str:
            reason = "connect timed out" if isinstance(exc, trio.TooSlowError) else first_line(exc)
            return f"LISTEN connection lost: {reason}"

        while True:  # _listen_once returns when the connection is lost or not heard
            await retry(
                lambda: self._listen_once(backoff),
                failures=(RelayError, trio.TooSlowError),
                backoff=backoff,
                describe=describe,
                on_failure=lambda _: self._set_state(up=False),
            )
            if self._health.poll_only:
                await trio.sleep(SELF_CHECK_AGAIN)
                self._self_check = self._checker

    def _run_on_the_poll(self, reason: str) -> None:
        self._health.poll_only = reason
        self._metrics.poll_only.set(1)
        self._set_state(up=False)

    async def _listen_once(self, backoff: ReconnectBackoff) -> None:
        with trio.fail_after(10):
            conn = await self._connect()
        try:
            await conn.listen(self._channel)
            self._listening_to_channel = True
            if self._self_check is not None:
                heard = await self._heard_itself(conn)
                self._self_check = None  # at the first connect (and after a failed one)
                self._on_checked(heard)
                if not heard:
                    self._run_on_the_poll("the LISTEN connection hears no notification")
                    return
                if self._health.poll_only:
                    log.info("the LISTEN connection hears notifications now: listening")
                    self._health.poll_only = ""
                    self._metrics.poll_only.set(0)
            self._pace_tried_at = -math.inf
            await self._serve_pace(conn)
            self._set_state(up=True)
            backoff.reset()
            log.info("listening on channel %s", self._channel)
            # Rows may have committed while no one listened: sweep now.
            self._wakeup.set("reconnect")
            self._spoke_at = trio.current_time()
            while True:
                await self._serve_requests(conn)
                await self._serve_pace(conn)
                quiet_until = min(self._spoke_at + self._keepalive, self._next_pace_try())
                if trio.current_time() >= quiet_until:
                    # Nothing said on this connection for a whole keepalive, however many
                    # notifications came: make sure it still works. It also shows the
                    # server this session is alive (see server_idle_timeout).
                    await conn.probe()
                    self._spoke_at = trio.current_time()
                    continue
                await self._wait(conn, quiet_until - trio.current_time())
        finally:
            # Not listening from here on, before the close below awaits: the scheduler
            # asking to sleep meanwhile must hear DEAF at once, not wait for an answer.
            self._set_state(up=False)
            self._holding = False
            self._set_pacing(False)
            self._answer_request(Sleep.DEAF)
            await conn.close()

    async def _heard_itself(self, conn: ListenConnection) -> bool:
        """The self-check: a notification sent through another connection comes back
        on this one (through a transaction pooler it goes to whatever server
        connection was free, and no one hears it)."""
        assert self._self_check is not None
        for _ in range(SELF_CHECK_TRIES):
            token = f"outbox-relay self-check {uuid.uuid4().hex}"
            await self._self_check(token)
            if await conn.hears(token, SELF_CHECK_SECONDS, self._notified):
                return True
        return False

    async def _serve_requests(self, conn: ListenConnection) -> None:
        self._poke = trio.Event()
        if self._want_sleep and self._answer is not None:
            if self._holding:
                # The scheduler woke and asks to sleep again before this task got
                # round to letting the lock go. Held all along, it is as good as new
                # (every producer since it was granted has notified).
                answer = Sleep.SAFE
            else:
                answer = await self._take_sleep_lock(conn)
                self._spoke_at = trio.current_time()
            self._answer_request(answer)
        elif not self._want_sleep and self._holding:
            await conn.release_sleep_lock()
            self._spoke_at = trio.current_time()
            self._holding = False

    def _next_pace_try(self) -> float:
        if self._paces or not self._want_pace:
            return math.inf
        return self._pace_tried_at + PACE_RETRY

    async def _serve_pace(self, conn: ListenConnection) -> None:
        """Take the pace lock when it is free and the scheduler may pace; let it go
        when it may not. Only the relay that paces listens: the others claim on their
        own pace, and notifications would only cost them (and the server, which
        reads its queue for every session listening) for nothing."""
        if self._paces and not self._want_pace:
            await conn.release_pace_lock()
            await conn.set_listening(self._channel, False)
            self._listening_to_channel = False
            self._spoke_at = trio.current_time()
            self._set_pacing(False)
            log.info("no longer pacing the table: NATS is unreachable from this relay")
        elif trio.current_time() >= self._next_pace_try():
            self._pace_tried_at = self._spoke_at = trio.current_time()
            paces = await conn.try_pace_lock()
            if paces != self._listening_to_channel:
                await conn.set_listening(self._channel, paces)
                self._listening_to_channel = paces
            if paces:
                self._set_pacing(True)
                # Rows may have committed while this relay did not listen: sweep.
                self._wakeup.set("reconnect")

    def _set_pacing(self, paces: bool) -> None:
        self._paces = paces
        self._metrics.pacing.set(1 if paces else 0)

    async def _take_sleep_lock(self, conn: ListenConnection) -> Sleep:
        if not await conn.try_sleep_lock():
            return Sleep.SAFE_OTHER if await conn.another_relay_sleeps() else Sleep.BUSY
        self._holding = True
        self._grants += 1
        return Sleep.SAFE

    def _notified(self) -> None:
        self._wakeup.set("notify")

    def _answer_request(self, answer: Sleep) -> None:
        channel, self._answer = self._answer, None
        if channel is not None:
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                channel.send_nowait(answer)

    async def _wait(self, conn: ListenConnection, seconds: float) -> None:
        """Up to ``seconds``, until a notification or a request from the scheduler."""
        try:
            async with trio.open_nursery() as nursery:

                async def notifications() -> None:
                    await conn.wait_for_notification(seconds, self._notified)
                    nursery.cancel_scope.cancel()

                async def requests() -> None:
                    await self._poke.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(notifications)
                nursery.start_soon(requests)
        except BaseExceptionGroup as group:
            raise _first_error(group) from None

    def _set_state(self, *, up: bool) -> None:
        self._health.listening = up
        self._metrics.listen_connected.set(1 if up else 0)
