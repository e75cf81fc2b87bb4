import statistics

import pytest

from relay_tools.bench.producer_cost import paired_ratios, render


def test_each_arrangement_is_compared_with_the_contracts_turn_of_its_own_repetition():
    # The machine slows between repetitions: each arrangement against its own
    # repetition's contract turn keeps the ratio, where the medians of each taken
    # apart would mix the repetitions (8,370 / 10,000 = 0.837 here).
    results = {"contract": [14_000.0, 10_000.0, 9_300.0], "installed": [12_600.0, 8_100.0, 8_370.0]}
    assert paired_ratios(results, "installed") == pytest.approx([0.9, 0.81, 0.9])
    assert statistics.median(results["installed"]) / statistics.median(results["contract"]) == (
        pytest.approx(0.837)
    )
    assert "installed: 0.900 of the contract's table" in render(results)
    assert paired_ratios(results, "contract") == [1.0, 1.0, 1.0]
