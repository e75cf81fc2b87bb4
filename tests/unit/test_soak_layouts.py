"""The soak's comparison of a partitioned table with the plain one
(``bench --soak --partitions``): what it counts as met, from reports made here."""

from __future__ import annotations

from relay_tools.bench.soak import SoakPlan, SoakReport, Window, layout_verdicts, table_sizes

PLAN = SoakPlan(before=60.0, hold=60.0, after=120.0, window=30.0)


def report(sizes: list[float], *, wal: int, deleted: int, p99: float) -> SoakReport:
    windows = [
        Window(start=k * PLAN.window, held=60.0 <= k * PLAN.window < 120.0, table_mb=mb)
        for k, mb in enumerate(sizes)
    ]
    return SoakReport(
        PLAN, windows, committed=1000, arrived=1000, lost=0, inversions=0,
        drained_after_release=0.0, wal_bytes=wal, rows_deleted=deleted, p99_ms=p99,
    )  # fmt: skip


def test_the_sizes_compared_are_the_largest_before_the_hold_and_in_the_last_90_s():
    sawtooth = report([2, 5, 3, 9, 8, 4, 6, 5], wal=0, deleted=0, p99=1)
    assert table_sizes(sawtooth) == (5, 6)


def test_a_partitioned_table_that_meets_every_target():
    plain = report([2, 4, 6, 8, 10, 12, 14, 16], wal=1_000_000, deleted=900, p99=10.0)
    partitioned = report([2, 5, 3, 9, 8, 4, 6, 5], wal=700_000, deleted=0, p99=10.5)
    assert [ok for _, ok in layout_verdicts(plain, partitioned)] == [True, True, True, True]


def test_each_target_missed_is_said():
    plain = report([2, 4, 6, 8, 10, 12, 14, 16], wal=1_000_000, deleted=900, p99=10.0)
    partitioned = report([2, 5, 3, 9, 8, 9, 9, 9], wal=800_000, deleted=3, p99=12.0)
    verdicts = layout_verdicts(plain, partitioned)
    assert [ok for _, ok in verdicts] == [False, False, False, False]
    assert verdicts[1][0] == "WAL per event 800 B <= 0.75 x the plain table's 1,000 B"


def test_the_layouts_plan_outlives_checkpoints_and_lets_the_size_settle():
    plan = SoakPlan().for_layouts(60.0)
    assert (plan.partitions, plan.retention) == (60.0, "90s")
    assert "checkpoint_timeout = 30s" in plan.server_settings
    assert plan.before >= 60.0 + 90.0 + 60.0  # a partition, the retention, a round
    assert plan.after >= plan.before
