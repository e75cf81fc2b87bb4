"""The partition plans: which partitions to create, how far they reach, which
retention may drop; the decisions relay/partitions.py makes from the catalog."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from relay import retention
from relay.config import Config
from relay.database import PartitionLayout
from relay.metrics import Metrics
from relay.partitions import (
    MAX_PARTITIONS_AHEAD,
    Partition,
    capped_ahead,
    expired,
    judge_layout,
    opened_by_claims,
    partition_name,
    partitions_to_create,
    period_of,
    reach,
)
from relay.retention import run_retention
from relay.sqlfiles import Names, mark_statement, migration_statements

ROOT = Path(__file__).resolve().parents[2]

MINUTE = 60.0
HOUR = 3600.0
# 2026-12-06 03:00:00 UTC
T = 1796526000.0


def hourly(*offsets: int, pending: frozenset[int] = frozenset()) -> list[Partition]:
    return [
        Partition(partition_name("outbox_events", T + k * HOUR), T + k * HOUR,
                  T + (k + 1) * HOUR, k in pending)
        for k in offsets
    ]  # fmt: skip


def test_a_partition_is_named_by_its_start_in_utc_and_names_sort_as_starts():
    assert partition_name("outbox_events", T) == "outbox_events_p20261206_0300"
    assert partition_name("outbox_events", T + 30) == "outbox_events_p20261206_030030"
    starts = [T + k * 7 * MINUTE for k in range(50)]
    names = [partition_name("o", s) for s in starts if s % 60 == 0]
    assert names == sorted(names)


def test_a_name_postgres_would_cut_short_is_refused():
    with pytest.raises(ValueError, match="longer than Postgres's 63 bytes"):
        partition_name("x" * 50, T)


def test_the_period_is_the_newest_partitions_width():
    day = Partition("d", T - 86400.0, T)
    assert period_of([day, *hourly(0)]) == HOUR
    assert period_of([Partition("default", None, None)]) is None
    assert period_of([]) is None


def test_partitions_are_created_from_the_newest_end_until_they_reach_ahead():
    created = partitions_to_create(hourly(0, 1), T + 10 * MINUTE, 4 * HOUR, "outbox_events")
    assert [(p.start, p.end) for p in created] == [
        (T + 2 * HOUR, T + 3 * HOUR), (T + 3 * HOUR, T + 4 * HOUR), (T + 4 * HOUR, T + 5 * HOUR)
    ]  # fmt: skip
    assert created[0].name == "outbox_events_p20261206_0500"
    # Reached already: nothing.
    assert partitions_to_create(hourly(0, 1, 2, 3, 4), T + 10 * MINUTE, 4 * HOUR, "o") == []


def test_a_new_table_starts_at_the_period_that_holds_now():
    created = partitions_to_create([], T + 10 * MINUTE, 2 * HOUR, "o", period=HOUR)
    assert [p.start for p in created] == [T, T + HOUR, T + 2 * HOUR]
    # No period known, none given: nothing (a table install has not partitioned).
    assert partitions_to_create([], T, HOUR, "o") == []


def test_after_a_gap_creation_starts_again_at_now_not_in_the_past():
    created = partitions_to_create(hourly(-30), T + 10 * MINUTE, HOUR, "o")
    assert [p.start for p in created] == [T, T + HOUR]


def test_one_round_creates_at_most_its_limit():
    created = partitions_to_create([], T, 1000 * MINUTE, "o", period=MINUTE, limit=5)
    assert len(created) == 5


def test_partitions_are_kept_at_most_a_hundred_ahead_whatever_the_period():
    # Every claim locks every partition, in a lock table the whole server shares.
    assert MAX_PARTITIONS_AHEAD == 100
    assert capped_ahead(3 * 86400.0, HOUR) == 3 * 86400.0  # hourly: 72, all kept
    assert capped_ahead(3 * 86400.0, MINUTE) == 100 * MINUTE
    made: list[Partition] = []
    while created := partitions_to_create(made, T, 3 * 86400.0, "o", period=MINUTE):
        made += [Partition(p.name, p.start, p.end) for p in created]
    assert len(made) == 100
    assert reach(made, T) == 100 * MINUTE


def test_the_relay_exports_and_names_what_its_claims_take_of_the_servers_lock_table(caplog):
    metrics = Metrics(CollectorRegistry())
    warned: set[str] = set()
    config = Config(partitions_ahead=3 * 86400.0)
    few = PartitionLayout("p", True, hourly(*range(-24, 73)), T, 6400)
    judge_layout(config, metrics, few, warned)
    assert metrics.registry.get_sample_value("outbox_relay_partitions_lock_share") == (
        97 * 14 / 6400
    )
    assert metrics.registry.get_sample_value("outbox_relay_partitions_ahead_target_seconds") == (
        3 * 86400.0
    )
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    # A week of hourly partitions behind, three days ahead, a small lock table.
    many = PartitionLayout("p", True, hourly(*range(-168, 73)), T, 6400)
    for _ in range(2):
        judge_layout(config, metrics, many, warned)
    [error] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "has 241 partitions" in error
    assert "holds about 3374 of the server's 6400 lock table entries" in error
    assert "'out of shared memory'" in error
    assert metrics.registry.get_sample_value("outbox_relay_partitions_lock_share") == (
        241 * 14 / 6400
    )
    minutes = PartitionLayout("p", True, [Partition("m", T, T + MINUTE)], T, 6400)
    judge_layout(config, metrics, minutes, warned)
    assert metrics.registry.get_sample_value("outbox_relay_partitions_ahead_target_seconds") == (
        100 * MINUTE
    )
    [cap] = [r.getMessage() for r in caplog.records if "--partitions-ahead" in r.getMessage()]
    assert "would be 4320 partitions of 60s; the relay keeps 100 (6000s ahead)" in cap


def test_the_reach_follows_the_partitions_without_a_gap_from_now():
    now = T + 10 * MINUTE
    assert reach(hourly(0, 1, 2), now) == 3 * HOUR - 10 * MINUTE
    assert reach(hourly(0, 1, 3), now) == 2 * HOUR - 10 * MINUTE  # the gap ends it
    assert reach(hourly(1, 2), now) == 0.0  # nothing holds now: inserts fail
    assert reach(hourly(0, 1, pending=frozenset({1})), now) == HOUR - 10 * MINUTE


def test_retention_may_drop_partitions_whose_every_row_is_older_than_retention():
    partitions = [*hourly(-5, -4, -3, -2, -1, 0), Partition("default", None, None)]
    now = T + 10 * MINUTE
    assert [p.start for p in expired(partitions, now, 3 * HOUR)] == [T - 5 * HOUR, T - 4 * HOUR]
    # A pending detach is finished first, whatever its age.
    pending = hourly(-5, -1, pending=frozenset({-1}))
    assert [p.start for p in expired(pending, now, 3 * HOUR)] == [T - HOUR, T - 5 * HOUR]


def test_a_plain_table_attached_as_the_first_partition_is_followed_from_its_end():
    # MINVALUE to T: the old plain table, after the documented migration.
    before = Partition("outbox_events_before", float("-inf"), T + HOUR)
    assert period_of([before]) is None
    created = partitions_to_create([before], T, 2 * HOUR, "o", period=HOUR)
    assert [p.start for p in created] == [T + HOUR]  # reaching now + 2 h
    assert period_of([before, *hourly(1)]) == HOUR
    assert reach([before, *hourly(1)], T) == 2 * HOUR
    # Expired once its end is older than the retention, like any other.
    assert expired([before], T + 5 * HOUR, 3 * HOUR) == [before]
    assert expired([before], T + 3 * HOUR, 3 * HOUR) == []


def test_nothing_follows_a_maxvalue_partition():
    last = Partition("last", T, float("inf"))
    assert partitions_to_create([*hourly(-1), last], T, 10 * HOUR, "o") == []
    assert reach([*hourly(-1), last], T) == float("inf")


def test_the_documented_migration_is_the_one_in_sql_partitions():
    # docs/partitions.md prints the migration for the default table; the test that
    # runs it (tests/integration/test_partitions.py) composes it from sql/.
    bound = 1796688000.0  # 2026-12-08 00:00 UTC
    docs = " ".join((ROOT / "docs" / "partitions.md").read_text().split())
    for step, statement in migration_statements(Names.for_config(Config()), bound).items():
        text = statement.as_string().replace(f"to_timestamp({bound})", "'2026-12-08 00:00+00'")
        for line in text.split(";"):
            code = " ".join(
                part for part in line.splitlines() if not part.lstrip().startswith("--")
            ).replace('"', "")
            code = " ".join(code.split())
            assert code in docs, f"{step}: {code!r} is not in docs/partitions.md"


def test_only_a_partitioned_tables_marks_carry_the_batchs_created_at_span():
    names = Names.for_config(Config())
    for name in ("mark_published", "mark_failed"):
        plain = mark_statement(names, name, partitioned=False).as_string()
        partitioned = mark_statement(names, name, partitioned=True).as_string()
        assert "created_at between" not in plain
        assert 'and "t".created_at between to_timestamp(%(since)s)' in partitioned
        assert partitioned.rstrip().endswith("to_timestamp(%(until)s)")


def test_claims_open_the_partitions_up_to_their_reach_not_those_ahead_of_it():
    # Hourly: a day of them spent, this hour, three days ahead.
    partitions = hourly(*range(-24, 73))
    now = T + 30 * 60  # half past: the reach (a minute on) stays in this hour
    assert opened_by_claims(partitions, now) == 25
    assert opened_by_claims(partitions, T + HOUR - 30) == 26  # the next hour is in reach


def test_retention_counts_and_names_the_late_rows_keys_it_purges(caplog):
    # Keys left by a TRUNCATE or a partition dropped by hand: harmless, but every claim
    # would walk from them, so retention removes them and says so.
    purges = [2, 0]

    class Database:
        pooled: bool | None = None  # no partitions retired: only the purge runs

        async def partition_layout(self) -> PartitionLayout:
            return PartitionLayout("p", True, hourly(-3, 0, 1), T, 6400)

        async def purge_late_keys(self) -> int:
            return purges.pop(0) if purges else 0

    metrics = Metrics(CollectorRegistry())

    async def two_rounds() -> None:
        with trio.move_on_after(0.05 + 0.02):
            await run_retention(Config(retention_interval=0.05), Database(), metrics)  # type: ignore[arg-type]

    trio.run(two_rounds, clock=trio.testing.MockClock(autojump_threshold=0))
    assert metrics.registry.get_sample_value("outbox_relay_late_keys_purged_total") == 2
    [warning] = [r.getMessage() for r in caplog.records if "late rows' keys" in r.getMessage()]
    assert warning.startswith("retention removed 2 late rows' keys whose rows were gone")


def test_retention_drops_no_partition_before_the_relay_knows_whether_a_pooler_stands_between(
    monkeypatch,
):
    # Until the LISTEN self-check tells, connections carry no lock_timeout, and a detach
    # behind an idle writer would wait as long as the writer stays open.
    rounds: list[bool | None] = []

    class Database:
        pooled: bool | None = None

        async def partition_layout(self) -> PartitionLayout:
            return PartitionLayout("p", True, hourly(-3, 0, 1), T, 6400)

        async def purge_late_keys(self) -> int:
            return 0

    database = Database()

    async def retire(config: Config, db: Database, metrics: object, layout: object) -> None:
        rounds.append(db.pooled)

    async def three_rounds() -> None:
        with trio.move_on_after(3 * 0.05 + 0.02):
            await run_retention(Config(retention_interval=0.05), database, None)  # type: ignore[arg-type]

    monkeypatch.setattr(retention, "retire_partitions", retire)
    trio.run(three_rounds)
    assert rounds == []
    database.pooled = False
    trio.run(three_rounds)
    assert rounds
    assert set(rounds) == {False}
