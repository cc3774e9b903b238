"""The one percentile definition of every benchmark report (``bench/stats.py``)."""

from __future__ import annotations

import math

import pytest

from bench.stats import percentile


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5  # mean of the two middle values
    assert percentile([4, 1, 3, 2], 50) == 2.5  # any order
    assert percentile(list(range(101)), 90) == 90
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert percentile([5, 1, 9], 100) == 9 and percentile([5, 1, 9], 0) == 1


def test_percentile_of_no_values_is_the_default():
    assert math.isnan(percentile([], 50))
    assert percentile([], 50, None) is None


@pytest.mark.parametrize("q", [-1, 100.5, 0.5 * 1000])
def test_percentile_refuses_q_outside_0_to_100(q):
    with pytest.raises(ValueError, match="0..100"):
        percentile([1.0, 2.0], q)
