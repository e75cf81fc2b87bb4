"""Where a claim's walk starts (relay/claimstart.py): pure state, no server."""

from __future__ import annotations

from dataclasses import replace

from relay.claimstart import (
    CLAIMS_KEPT,
    FROM_FIRST_ENTRY,
    MAX_SEQ,
    ClaimStart,
    ClaimSummary,
    StartKey,
)


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


def test_the_claims_kept_for_the_bound_stay_bounded_while_a_writer_holds_the_xmin():
    # A transaction that has written holds the xmin at 100: no claim can be let go,
    # and each adds one. Past CLAIMS_KEPT every other one goes.
    start = ClaimStart()
    claims = 5 * CLAIMS_KEPT
    for n in range(claims):
        claim(start, summary("t", xmin=100, xid=101 + n, at=f"s{n:06d}"))
        assert len(start._claims) <= CLAIMS_KEPT
    assert start.key() == FROM_FIRST_ENTRY  # no claim older than the xmin yet
    # The writer ends: the bound is a claim whose xid is older than the new xmin (a
    # sound one), and no later than the latest such claim.
    claim(start, summary("t", xmin=101 + claims - 10, xid=None, at="after"))
    bound = start.key().bound_at
    assert "s000000" <= bound <= f"s{claims - 11:06d}"
    assert bound >= f"s{claims - 11 - 16:06d}"  # thinning left it close to the latest


def test_a_live_row_without_a_relay_seq_rewinds_instead_of_crashing():
    start = ClaimStart()
    claim(start, summary("t1", xmin=100, xid=100, at="s1"))
    start.observe(ClaimSummary("t2", None, "s2", 101, 102), start.key())
    assert start.key() == FROM_FIRST_ENTRY
    assert start.take_rewind_reason() == "a live row has no relay_seq"
    assert start.take_rewind_reason() is None  # said once
    start.rewind()  # the sweep's, which logs its own line
    assert start.take_rewind_reason() is None


def test_a_claim_whose_guard_was_off_rewinds_until_a_claim_from_the_first_entry_sees_it_on():
    start = ClaimStart()
    claim(start, summary("t1", xmin=100, xid=100, at="s1"))
    claim(start, summary("t2", xmin=101, xid=105, at="s2"))
    keyed = start.key()
    assert keyed != FROM_FIRST_ENTRY
    start.observe(ClaimSummary("t3", 7, "s3", 106, 107, guard_off=True), keyed)
    assert start.key() == FROM_FIRST_ENTRY
    # Walking from the first entry while the triggers are still off keeps rewinding.
    start.observe(ClaimSummary("t4", 7, "s4", 108, 109, guard_off=True), FROM_FIRST_ENTRY)
    assert start.key() == FROM_FIRST_ENTRY
    start.observe(ClaimSummary("t5", 7, "s5", 110, 111), FROM_FIRST_ENTRY)
    assert start.key() == StartKey("t5", 7, "s4")


def sent(start: ClaimStart, now: float, beyond: bool | None) -> StartKey:
    """A claim sent at ``now`` whose look beyond the reach (when it looked) found
    ``beyond``; the key it was sent with."""
    key = start.sending(now)
    found = summary("t", xmin=100 + int(now * 10), xid=100 + int(now * 10), at=f"s{now}")
    looked = key.beyond_from == "-infinity"
    start.observe(replace(found, rows_beyond=beyond if looked else None), key)
    return key


def test_walks_from_the_first_entry_reach_the_end_and_look_for_nothing_beyond():
    key = ClaimStart().sending(0.0)
    assert (key.ceiling, key.beyond_from) == ("infinity", "infinity")


def test_claims_look_beyond_their_reach_once_a_second_and_go_to_the_end_while_rows_are_there():
    start = ClaimStart()
    sent(start, 0.0, beyond=False)
    sent(start, 0.1, beyond=False)  # a bound from here on: the walks have a reach
    first = sent(start, 0.2, beyond=False)
    assert (first.ceiling, first.beyond_from) == ("-infinity", "-infinity")
    assert not start.found_beyond
    # Within the second, no look: the summary's answer is not asked for.
    key = sent(start, 0.7, beyond=None)
    assert (key.ceiling, key.beyond_from) == ("-infinity", "infinity")
    # The next look finds a flagged row beyond the reach: claim again, to the end.
    key = sent(start, 1.3, beyond=True)
    assert key.beyond_from == "-infinity"
    assert start.found_beyond
    key = sent(start, 1.4, beyond=None)
    assert key.ceiling == "infinity"
    assert not start.found_beyond  # said once: this claim's walks went to the end
    # A look made while the walks went to the end, still finding one, says nothing new.
    key = sent(start, 2.4, beyond=True)
    assert (key.ceiling, key.beyond_from) == ("infinity", "-infinity")
    assert not start.found_beyond
    # Once a look finds none, the walks end at the reach again.
    sent(start, 3.5, beyond=False)
    assert start.sending(3.6).ceiling == "-infinity"


def test_the_ceiling_is_not_part_of_where_the_walks_start():
    key = StartKey("t", 7, "s")
    assert replace(key, ceiling="-infinity", beyond_from="-infinity") == key


def test_walks_from_a_start_key_begin_at_its_floor_and_a_refused_claim_goes_without():
    start = ClaimStart()
    assert start.sending(0.0).floor_cap == "-infinity"  # from the first entry: no floor
    sent(start, 0.0, beyond=False)
    sent(start, 0.1, beyond=False)
    key = start.sending(0.2)
    assert key != FROM_FIRST_ENTRY
    assert key.floor_cap == "infinity"
    again = ClaimStart.without_floor(key)
    assert again.floor_cap == "-infinity"
    # The same walks from the same start, only without the floor; and the floor is
    # no part of a key's identity.
    assert again == key
    assert (again.start_at, again.bound_at, again.ceiling, again.beyond_from) == (
        key.start_at,
        key.bound_at,
        key.ceiling,
        key.beyond_from,
    )
    # Nothing of the refused claim was observed: the next claim has its floor again.
    assert start.sending(0.3).floor_cap == "infinity"
