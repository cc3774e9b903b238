"""Summary statistics shared by the benchmarks, the A/B harness, the soak and the simulator.

One percentile definition for every reported ``p50`` / ``p90`` / ``p99``: linear
interpolation between the closest ranks (numpy's default ``method="linear"``,
Hyndman & Fan's type 7): the ``q``-th percentile of ``n`` sorted values ``x`` is
``x[k] + (x[k + 1] - x[k]) * f`` where ``k + f = (n - 1) * q / 100``. The p50 of an
even count is the mean of the two middle values; the p100 is the maximum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, overload

import numpy as np

__all__ = ["percentile"]

_D = TypeVar("_D", float, None)


@overload
def percentile(values: Sequence[float] | np.ndarray, q: float) -> float: ...
@overload
def percentile(values: Sequence[float] | np.ndarray, q: float, default: _D) -> float | _D: ...
def percentile(values: Sequence[float] | np.ndarray, q: float, default: float | None = float("nan")) -> float | None:
    """The ``q``-th percentile of ``values``, linearly interpolated (see the module doc).

    Args:
        values: the samples, any order, in any unit (the result has the same unit).
        q: the percentile, 0..100 (50 = median).
        default: returned when ``values`` is empty (NaN unless given; None for JSON).

    Raises:
        ValueError: ``q`` outside 0..100.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in 0..100, got {q}")
    if len(values) == 0:
        return default
    return float(np.percentile(values, q))
