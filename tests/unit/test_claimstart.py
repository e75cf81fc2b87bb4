"""Where a claim's walk starts (relay/claimstart.py): pure state, no server."""

from __future__ import annotations

from relay.claimstart import FROM_FIRST_ENTRY, MAX_SEQ, ClaimStart, ClaimSummary, StartKey


def summary(start_at: str | None, xmin: int, xid: int | None, at: str) -> ClaimSummary:
    return ClaimSummary(start_at, None if start_at is None else 7, at, xmin, xid)


def claim(start: ClaimStart, found: ClaimSummary) -> None:
    """A claim that ran from the key the start gave it."""
    start.observe(found, start.key())


def test_the_first_claim_walks_from_the_first_entry():
    assert ClaimStart().key() == FROM_FIRST_ENTRY


def test_a_claim_still_running_gives_no_bound_yet():
    start = ClaimStart()
    # This claim's own xid (100) is running in its snapshot: xmin <= 100.
    claim(start, summary("t1", xmin=100, xid=100, at="s1"))
    assert start.key() == FROM_FIRST_ENTRY


def test_the_bound_is_the_latest_claim_older_than_every_running_transaction():
    start = ClaimStart()
    claim(start, summary("t1", xmin=100, xid=100, at="s1"))
    claim(start, summary("t2", xmin=101, xid=105, at="s2"))
    # Claim 100 had ended when claim 105 looked: rows committed since came from
    # transactions that took their xid after 100, so after s1.
    assert start.key() == StartKey("t2", 7, "s1")
    claim(start, summary("t3", xmin=120, xid=121, at="s3"))
    assert start.key() == StartKey("t3", 7, "s2")


def test_a_transaction_that_has_written_holds_the_bound_back_until_it_ends():
    start = ClaimStart()
    claim(start, summary("t1", xmin=100, xid=100, at="s1"))
    # A producer took xid 103 and stays open: every later claim's xmin is 103.
    for xid, at in ((110, "s2"), (120, "s3"), (130, "s4")):
        claim(start, summary("t", xmin=103, xid=xid, at=at))
        assert start.key().bound_at == "s1"
    claim(start, summary("t", xmin=131, xid=140, at="s5"))
    assert start.key().bound_at == "s4"


def test_a_snapshot_older_than_every_claim_seen_walks_from_the_first_entry():
    start = ClaimStart()
    claim(start, summary("t1", xmin=100, xid=100, at="s1"))
    claim(start, summary("t2", xmin=101, xid=105, at="s2"))
    claim(start, summary("t3", xmin=90, xid=110, at="s3"))  # an older writer is running
    assert start.key() == FROM_FIRST_ENTRY


def test_a_claim_that_found_no_live_row_starts_at_the_bound():
    start = ClaimStart()
    claim(start, summary("t1", xmin=100, xid=100, at="s1"))
    claim(start, summary(None, xmin=101, xid=None, at="s2"))
    assert start.key() == StartKey("infinity", MAX_SEQ, "s1")


def test_a_claim_that_locked_nothing_adds_no_bound():
    start = ClaimStart()
    claim(start, summary("t1", xmin=100, xid=None, at="s1"))
    claim(start, summary("t1", xmin=101, xid=None, at="s2"))
    assert start.key() == FROM_FIRST_ENTRY


def test_a_rewind_walks_from_the_first_entry_until_such_a_claim_reports():
    start = ClaimStart()
    claim(start, summary("t1", xmin=100, xid=100, at="s1"))
    claim(start, summary("t2", xmin=101, xid=105, at="s2"))
    in_flight = start.key()
    start.rewind()
    assert start.key() == FROM_FIRST_ENTRY
    # A claim that was already in flight from the old key does not undo the rewind.
    start.observe(summary("t3", xmin=106, xid=107, at="s3"), in_flight)
    assert start.key() == FROM_FIRST_ENTRY
    claim(start, summary("t4", xmin=108, xid=109, at="s4"))  # from the first entry
    assert start.key() == StartKey("t4", 7, "s3")
