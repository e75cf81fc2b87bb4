"""The checker itself, on hand-made histories."""

from __future__ import annotations

from tests.support.checker import Committed, RowState, Stored, check


def history(*events: tuple[str, str, int]) -> list[Committed]:
    return [Committed(*event) for event in events]


def stored(*messages: tuple[str, str, int]) -> list[Stored]:
    return [Stored(*message) for message in messages]


PUBLISHED = RowState(published=True, attempts=0)


def test_a_clean_history_passes():
    committed = history(("a", "s", 1), ("b", "s", 2), ("c", "t", 1))
    table = {"a": PUBLISHED, "b": PUBLISHED, "c": PUBLISHED}
    verdict = check(
        committed, table, stored(("a", "s", 1), ("c", "t", 1), ("b", "s", 2)), max_attempts=5
    )
    assert verdict.ok, verdict.summary()
    assert (verdict.committed, verdict.stored, verdict.duplicates) == (3, 3, 0)


def test_lost_event_is_reported():
    verdict = check(
        history(("a", "s", 1), ("b", "s", 2)),
        {"a": PUBLISHED, "b": RowState(False, 0)},
        stored(("a", "s", 1)),
        max_attempts=5,
    )
    assert verdict.lost == ["b"]
    assert verdict.stuck == ["b"]
    assert not verdict.ok


def test_a_good_row_at_the_cap_fails_the_verdict():
    # The relay gave up on an event it could have published: that is a loss, even
    # though the relay reported it.
    verdict = check(history(("a", "s", 1)), {"a": RowState(False, 5)}, [], max_attempts=5)
    assert verdict.dead == ["a"]
    assert verdict.lost == ["a"]
    assert verdict.stuck == []
    assert not verdict.ok


def test_a_poison_row_at_the_cap_is_expected():
    verdict = check(
        history(("a", "s", 1), ("p", "s", 2), ("b", "s", 3)),
        {"a": PUBLISHED, "p": RowState(False, 5), "b": PUBLISHED},
        stored(("a", "s", 1), ("b", "s", 3)),
        max_attempts=5,
        poison={"p", "rolled-back-poison"},
    )
    assert verdict.ok, verdict.summary()
    assert (verdict.poison, verdict.poison_dead, verdict.dead) == (1, 1, [])


def test_a_poison_row_dead_then_skipped_is_expected_a_skipped_good_row_is_lost():
    verdict = check(
        history(("p", "s", 1), ("d", "s", 2), ("g", "s", 3), ("b", "s", 4)),
        {
            "p": RowState(False, 5, dead=True, skipped=True),
            "d": RowState(False, 1, dead=True),  # dead for a reason inside it, short of the cap
            "g": RowState(False, 0, dead=True, skipped=True),
            "b": PUBLISHED,
        },
        stored(("b", "s", 4)),
        max_attempts=5,
        poison={"p"},
    )
    assert (verdict.poison, verdict.poison_dead) == (1, 1)
    assert verdict.dead == ["d", "g"]  # given up on, though good: each a failure
    assert verdict.lost == ["d", "g"]
    assert verdict.stuck == []
    assert not verdict.ok


def test_a_published_poison_row_fails_the_verdict():
    verdict = check(
        history(("p", "s", 1)),
        {"p": PUBLISHED},
        stored(("p", "s", 1)),
        max_attempts=5,
        poison={"p"},
    )
    assert verdict.poison_published == ["p"]
    assert not verdict.ok


def test_a_poison_row_short_of_the_cap_is_stuck():
    verdict = check(
        history(("p", "s", 1)), {"p": RowState(False, 2)}, [], max_attempts=5, poison={"p"}
    )
    assert verdict.stuck == ["p"]
    assert verdict.lost == []
    assert not verdict.ok


def test_unexpected_message_from_a_rolled_back_write():
    verdict = check(
        history(("a", "s", 1)),
        {"a": PUBLISHED},
        stored(("a", "s", 1), ("ghost", "s", 2)),
        max_attempts=5,
    )
    assert verdict.unexpected == ["ghost"]
    assert not verdict.ok


def test_marked_but_missing():
    verdict = check(history(("a", "s", 1)), {"a": PUBLISHED}, [], max_attempts=5)
    assert verdict.marked_but_missing == ["a"]
    assert verdict.lost == ["a"]


def test_duplicates_are_counted_not_failed():
    committed = history(("a", "s", 1), ("b", "s", 2))
    verdict = check(
        committed,
        {"a": PUBLISHED, "b": PUBLISHED},
        stored(("a", "s", 1), ("a", "s", 1), ("b", "s", 2), ("a", "s", 1)),
        max_attempts=5,
    )
    assert verdict.duplicates == 2
    assert verdict.ok  # a late duplicate of a is not an inversion: first publication counts


def test_order_inversion_in_first_publication_order():
    committed = history(("a", "s", 1), ("b", "s", 2), ("c", "s", 3), ("x", "t", 1))
    table = dict.fromkeys("abcx", PUBLISHED)
    verdict = check(
        committed,
        table,
        stored(("a", "s", 1), ("c", "s", 3), ("x", "t", 1), ("b", "s", 2)),
        max_attempts=5,
    )
    assert verdict.order_inversions == [("s", 3, 2)]
    assert not verdict.ok


def test_other_subjects_are_unordered():
    committed = history(("a", "s", 1), ("b", "t", 1))
    verdict = check(
        committed,
        {"a": PUBLISHED, "b": PUBLISHED},
        stored(("b", "t", 1), ("a", "s", 1)),
        max_attempts=5,
    )
    assert verdict.ok


def test_a_message_whose_body_is_another_rows_is_caught():
    # Nats-Msg-Id of one row over the body of another: both ids are in the stream,
    # in order, once each; only the bodies say it.
    a, b = Committed("a", "s1", 1), Committed("b", "s2", 1)
    table = {"a": RowState(True, 0), "b": RowState(True, 0)}
    swapped = [Stored("a", "s2", 1, "b"), Stored("b", "s1", 1, "a")]
    verdict = check([a, b], table, swapped, max_attempts=5)
    assert not verdict.ok
    assert verdict.mismatched == ["a", "b"]
    right = [Stored("a", "s1", 1, "a"), Stored("b", "s2", 1, "b")]
    assert check([a, b], table, right, max_attempts=5).ok
