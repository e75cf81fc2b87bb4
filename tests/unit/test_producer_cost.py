import pytest

from relay_tools.bench.producer_cost import paired_ratios, render


def test_each_arrangement_is_compared_with_the_contracts_turn_of_its_own_repetition():
    # The machine slows by half between the first repetition and the last: each
    # arrangement against its own repetition's contract turn keeps the ratio.
    results = {"contract": [12_000.0, 9_000.0, 6_000.0], "installed": [10_800.0, 8_100.0, 5_400.0]}
    assert paired_ratios(results, "installed") == pytest.approx([0.9, 0.9, 0.9])
    assert "installed: 0.900 of the contract's table" in render(results)
    # The medians of each apart would have said the same only by luck of the drift.
    assert paired_ratios(results, "contract") == [1.0, 1.0, 1.0]
