"""The table's writers (relay/writers.py) and the bound they give the claims'
start key (relay/claimstart.py): pure state, no server."""

from __future__ import annotations

from relay.claimstart import FROM_FIRST_ENTRY, ClaimStart, ClaimSummary
from relay.writers import UNKNOWN, Writer, WriterPoll, WriterTracker


def test_a_writer_at_the_first_poll_is_bounded_by_its_transactions_start_or_not_at_all():
    poll = WriterTracker().observe("p1", [(10, "x10"), (11, None)])
    assert poll == WriterPoll("p1", (Writer(10, "x10"), Writer(11, UNKNOWN)))


def test_a_writer_first_seen_later_took_the_lock_after_the_last_poll_began():
    tracker = WriterTracker()
    tracker.observe("p1", [(10, "x10")])
    # 12's transaction began long ago ("x12"), but it was not writing to the table
    # when p1 read pg_locks: its rows came after p1 began.
    assert tracker.observe("p2", [(10, "x10"), (12, "x12")]).writers == (
        Writer(10, "x10"),
        Writer(12, "p1"),
    )
    # Kept while it stays; a poll without it forgets it.
    assert tracker.observe("p3", [(12, None)]).writers == (Writer(12, "p1"),)
    assert tracker.observe("p4", []).writers == ()
    # Back (a savepoint rolled back and wrote again): its surviving rows are new.
    assert tracker.observe("p5", [(12, None)]).writers == (Writer(12, "p4"),)


def finished(start: ClaimStart, *xids: int, start_at: str = "t1", xid: int = 500) -> None:
    """A claim sent now, which found ``xids`` finished; a writer holds the xmin."""
    used = start.sending()
    start.observe(ClaimSummary(start_at, 7, "s", 1, xid, finished_writers=frozenset(xids)), used)


def test_the_next_claim_rests_on_the_poll_that_finished_before_the_last_claim_began():
    start = ClaimStart()
    start.offer(WriterPoll("p1", (Writer(10, "w10"),)))
    finished(start)
    # A poll that finished after that claim was sent cannot bound what it saw.
    start.offer(WriterPoll("p2", (Writer(10, "w10"), Writer(11, "p1"))))
    key = start.key()
    assert (key.start_at, key.bound_at) == ("t1", UNKNOWN)  # the snapshots: no bound
    assert (key.locks_at, key.writer_xids, key.writer_since) == ("p1", "{10}", '{"w10"}')
    finished(start)
    assert (start.key().locks_at, start.key().writer_xids) == ("p2", "{10,11}")


def test_a_writer_a_claim_saw_finished_is_not_waited_for_again():
    start = ClaimStart()
    poll = WriterPoll("p1", (Writer(10, "w10"), Writer(11, "w11")))
    start.offer(poll)
    finished(start)
    finished(start, 10)  # its walk from w10 found 10's rows; its first live entry covers them
    assert start.key().writer_xids == "{11}"
    assert start.key().writer_since == '{"w11"}'
    # A poll that read pg_locks before 10 committed, and finished after that claim.
    start.offer(WriterPoll("p2", (Writer(10, "w10"), Writer(11, "w11"))))
    finished(start)
    finished(start)
    assert (start.key().locks_at, start.key().writer_xids) == ("p2", "{11}")


def test_without_a_poll_or_a_snapshot_bound_the_claims_walk_from_the_first_entry():
    start = ClaimStart()
    finished(start)
    assert start.key() == FROM_FIRST_ENTRY
    start.offer(WriterPoll("p1"))
    finished(start)
    assert start.key().locks_at == "p1"
    start.rewind()
    assert start.key() == FROM_FIRST_ENTRY
