"""The gate between two batches in flight: the real Batch, on the asyncio side as in
the relay (trio-asyncio, trio's virtual clock), with fakes of the transaction and the
broker whose acks the test releases by hand.

The rule: a batch claimed while an earlier one is in flight sends its rows of the
subjects the earlier batch holds only once that batch has heard from the broker,
and only for the subjects it settled (every row acked, or failed for good)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

import pytest
import trio
import trio.testing

from relay import aio
from relay.batch import Batch, BatchOutcome
from relay.config import Config
from relay.database import Claim
from relay.envelope import Message
from relay.failpoints import Failpoints
from relay.marks import Marks
from relay.model import Acked, Failed, FailureReason, OutboxRow, PublishResult
from relay.streams import PublishMode

MAX_PAYLOAD = 1024 * 1024


def row(subject: str, created_at: float, event_type: str = "orders.placed") -> OutboxRow:
    return OutboxRow(
        str(uuid.uuid4()),
        event_type,
        "shop",
        subject,
        "2026-01-01T00:00:00Z",
        "{}",
        created_at,
        0,
        0,
    )


class Answer:
    """One message's ack, as the test gives it."""

    def __init__(self) -> None:
        self.given = trio.Event()
        self.result: PublishResult = Acked()

    async def wait(self) -> PublishResult:
        await self.given.wait()
        return self.result


class Broker:
    """Records every wave; each message waits for the test to answer it. Waves are
    awaited from trio, as the relay's are."""

    max_payload = MAX_PAYLOAD

    def __init__(self) -> None:
        self.sent: list[str] = []  # row ids, in the order they reached the broker
        self.answers: dict[str, Answer] = {}
        self.arrived = trio.Event()
        # Rows whose publish overruns its budget (a bug, a stuck client): answered
        # only when the test answers them.
        self.overrun: set[str] = set()

    async def publish_modes(self, subjects: Iterable[str]) -> dict[str, tuple[PublishMode, str]]:
        return dict.fromkeys(subjects, (PublishMode.MESSAGE, ""))

    async def publish_batch(
        self, mode: PublishMode, messages: Sequence[Message], budget: float
    ) -> list[PublishResult | None] | None:
        raise AssertionError("every subject goes per message here")

    async def publish_wave(self, messages: Sequence[Message], budget: float) -> list[PublishResult]:
        ids = [m.headers["Nats-Msg-Id"] for m in messages]
        for row_id in ids:
            self.sent.append(row_id)
            self.answers[row_id] = Answer()
        self.arrived.set()
        self.arrived = trio.Event()
        if self.overrun & set(ids):
            return [await self.answers[row_id].wait() for row_id in ids]
        with trio.move_on_after(budget):
            return [await self.answers[row_id].wait() for row_id in ids]
        return [
            self.answers[i].result
            if self.answers[i].given.is_set()
            else Failed(FailureReason.TIMEOUT, "no ack before the publish timeout")
            for i in ids
        ]

    def answer(self, row_id: str, result: PublishResult | None = None) -> None:
        self.answers[row_id].result = result or Acked()
        self.answers[row_id].given.set()


class Transaction:
    def __init__(self, database: Database) -> None:
        self._database = database

    async def claim(self, batch_size: int, max_attempts: int, ours=frozenset()) -> Claim:
        self._database.ours.append(set(ours))
        rows = self._database.claims.pop(0)
        return Claim(rows, {})

    async def mark_and_commit(self, marks: Marks, crash_before_commit=None) -> None:
        if self._database.fail_marks:
            raise self._database.fail_marks.pop(0)
        self._database.marked.append(marks)

    async def commit(self) -> None:
        pass


class Database:
    def __init__(self, *claims: list[OutboxRow]) -> None:
        self.claims = list(claims)
        self.ours: list[set[str]] = []
        self.marked: list[Marks] = []
        self.fail_marks: list[Exception] = []

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        yield Transaction(self)


def run(database: Database, test: Callable[[Batch, Broker], Awaitable[None]]) -> None:
    async def main() -> None:
        broker = Broker()
        batch = Batch(
            config=Config(publish_timeout=5.0),
            database=database,
            broker=broker,
            failpoints=Failpoints(frozenset()),
        )
        async with aio.open_loop():
            await test(batch, broker)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def start(nursery: trio.Nursery, batch: Batch, into: list[BatchOutcome]) -> None:
    async def one() -> None:
        into.append(await batch.run())

    nursery.start_soon(one)


async def until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(60):
        while not predicate():  # noqa: ASYNC110 - polling plain state on a virtual clock
            await trio.sleep(0.001)


def test_the_second_batch_sends_shared_subjects_only_after_the_first_is_acked():
    a1, a2 = row("account-1", 1.0), row("account-2", 2.0)
    b1, b3 = row("account-1", 3.0), row("account-3", 4.0)
    database = Database([a1, a2], [b1, b3])

    async def test(batch: Batch, broker: Broker) -> None:
        outcomes: list[BatchOutcome] = []
        async with trio.open_nursery() as nursery:
            await start(nursery, batch, outcomes)
            await until(lambda: broker.sent == [a1.id, a2.id])
            await start(nursery, batch, outcomes)
            # Claimed beside the first, told its rows are ours rather than blockers.
            await until(lambda: b3.id in broker.sent)
            assert database.ours == [set(), {a1.id, a2.id}]
            broker.answer(b3.id)
            await trio.sleep(1)
            assert b1.id not in broker.sent  # account-1 waits for the first batch
            broker.answer(a1.id)
            await trio.sleep(1)
            assert b1.id not in broker.sent  # ...for all of it, not one ack
            broker.answer(a2.id)
            await until(lambda: b1.id in broker.sent)
            broker.answer(b1.id)
        assert broker.sent.index(a1.id) < broker.sent.index(b1.id)
        assert [sorted(m.published) for m in database.marked] == [
            sorted([a1.id, a2.id]),
            sorted([b1.id, b3.id]),
        ]

    run(database, test)


def test_a_subject_the_first_batch_did_not_settle_is_not_sent_by_the_second():
    a1, a2 = row("account-1", 1.0), row("account-2", 2.0)
    b1, b2 = row("account-1", 3.0), row("account-2", 4.0)
    database = Database([a1, a2], [b1, b2])

    async def test(batch: Batch, broker: Broker) -> None:
        outcomes: list[BatchOutcome] = []
        async with trio.open_nursery() as nursery:
            await start(nursery, batch, outcomes)
            await until(lambda: len(broker.sent) == 2)
            await start(nursery, batch, outcomes)
            await trio.sleep(1)
            # account-1's row fails in a way a retry may fix: it backs off, and the
            # later row of its subject must not overtake it.
            broker.answer(a1.id, Failed(FailureReason.TIMEOUT, "no ack"))
            broker.answer(a2.id)
            await until(lambda: b2.id in broker.sent)
            broker.answer(b2.id)
        assert b1.id not in broker.sent
        second = next(o for o in outcomes if b1 in o.rows)
        assert b1.id not in second.results  # never sent: left exactly as it was
        assert second.results[b2.id] == Acked()

    run(database, test)


@pytest.mark.parametrize("behind_in_its_batch", [True, False])
def test_a_row_that_cannot_be_published_holds_its_subject(behind_in_its_batch):
    # A row rejected before sending goes dead, and a dead row holds its subject: the
    # later rows of it, in its own batch and in the next one, are not sent.
    bad = row("account-1", 1.0, event_type="orders.*")  # never publishable: dead
    a1, a2 = row("account-1", 2.0), row("account-2", 2.5)
    b1, b2 = row("account-1", 3.0), row("account-2", 3.5)
    first_claim = [bad, a1, a2] if behind_in_its_batch else [bad, a2]
    database = Database(first_claim, [b1, b2])

    async def test(batch: Batch, broker: Broker) -> None:
        outcomes: list[BatchOutcome] = []
        async with trio.open_nursery() as nursery:
            await start(nursery, batch, outcomes)
            await until(lambda: broker.sent == [a2.id])
            await start(nursery, batch, outcomes)
            await until(lambda: not database.claims)  # the second batch is claimed
            broker.answer(a2.id)
            await until(lambda: b2.id in broker.sent)
            broker.answer(b2.id)
        names = {bad.id: "bad", a1.id: "a1", a2.id: "a2", b1.id: "b1", b2.id: "b2"}
        assert [names[i] for i in broker.sent] == ["a2", "b2"]
        first = next(o for o in outcomes if bad in o.rows)
        failure = first.results[bad.id]
        assert isinstance(failure, Failed)
        assert failure.reason is FailureReason.INVALID_SUBJECT
        assert [d.id for d, _ in first.marks.newly_dead] == [bad.id]
        assert a1.id not in first.results  # never sent: left exactly as it was
        second = next(o for o in outcomes if b1 in o.rows)
        assert b1.id not in second.results

    run(database, test)


def test_a_first_batch_whose_marks_fail_after_its_acks_keeps_the_order():
    a1 = row("account-1", 1.0)
    b1, b3 = row("account-1", 2.0), row("account-3", 3.0)
    database = Database([a1], [b1, b3])
    database.fail_marks = [RuntimeError("the connection broke at the marks")]

    async def test(batch: Batch, broker: Broker) -> None:
        outcomes: list[BatchOutcome] = []
        failures: list[BaseException] = []

        async def first() -> None:
            try:
                await batch.run()
            except RuntimeError as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await until(lambda: broker.sent == [a1.id])
            await start(nursery, batch, outcomes)
            await until(lambda: b3.id in broker.sent)
            broker.answer(b3.id)
            # Its ack comes, then its marks fail and it rolls back.
            broker.answer(a1.id)
            await until(lambda: failures != [])
            await until(lambda: b1.id in broker.sent)
            broker.answer(b1.id)
        # Settled by its acks, the first batch released account-1 before its marks
        # failed: b1 went out after a1's ack. That is in order; a1 is republished
        # later (same Nats-Msg-Id) as the crash-window comments say.
        assert broker.sent.index(a1.id) < broker.sent.index(b1.id)

    run(database, test)


def test_a_first_batch_abandoned_before_it_published_holds_back_its_subjects():
    a1 = row("account-1", 1.0)
    b1, b3 = row("account-1", 2.0), row("account-3", 3.0)
    database = Database([a1], [b1, b3])

    async def test(batch: Batch, broker: Broker) -> None:
        outcomes: list[BatchOutcome] = []
        async with trio.open_nursery() as nursery:
            first_scope = trio.CancelScope()

            async def first() -> None:
                with first_scope:
                    await batch.run()

            nursery.start_soon(first)
            await until(lambda: broker.sent == [a1.id])
            await start(nursery, batch, outcomes)
            await until(lambda: b3.id in broker.sent)
            first_scope.cancel()  # the first batch ends without a word from the broker
            await trio.sleep(1)
            broker.answer(b3.id)
        assert b1.id not in broker.sent
        [second] = outcomes
        assert b1.id not in second.results

    run(database, test)


def test_the_publish_timeout_bounds_the_wait_for_the_earlier_batch():
    a1 = row("account-1", 1.0)
    b1 = row("account-1", 2.0)
    database = Database([a1], [b1])

    async def test(batch: Batch, broker: Broker) -> None:
        outcomes: list[BatchOutcome] = []
        # The first batch's publish overruns its budget and never settles: the second
        # gives up waiting for it at its own publish timeout, sends nothing of
        # account-1, and ends.
        broker.overrun = {a1.id}
        async with trio.open_nursery() as nursery:
            await start(nursery, batch, outcomes)
            await until(lambda: broker.sent == [a1.id])
            started = trio.current_time()
            await start(nursery, batch, outcomes)
            await until(lambda: len(outcomes) == 1)
            assert trio.current_time() - started <= 5.0 + 0.01
            [second] = outcomes
            assert b1.id not in second.results
            broker.answer(a1.id)  # lets the first one end
        assert broker.sent == [a1.id]

    run(database, test)
