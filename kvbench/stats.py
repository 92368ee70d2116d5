"""Bootstrap confidence intervals for comparing repeated timed measurements.

``kvbench compare`` pools a configuration's repeats on each side (baseline, candidate) and
asks whether the change of the *median* lies beyond a gate's threshold. The two sides are
independent samples, so each is resampled on its own (the two-sample bootstrap, Efron &
Tibshirani, "An Introduction to the Bootstrap", ch. 8), and the interval is the percentile
interval of the resampled statistic.

Why the percentile interval and not BCa: BCa's acceleration is estimated with the
jackknife, and the jackknife is inconsistent for the median (a non-smooth statistic): with
5 repeats a side the leave-one-out medians take two values, so the acceleration is noise.
Why the median: one preempted repeat on a shared machine moves a mean, not a median.

At 3-5 repeats a side the resampled medians take only a few distinct values, so the
interval is coarse and tends to be wide (a regression is called only when most candidate
repeats lie beyond most baseline repeats by the threshold). ``MIN_REPEATS`` is the least
number of runs per side for which an interval is computed at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_CONFIDENCE = 0.95
DEFAULT_NUM_RESAMPLES = 10_000
DEFAULT_SEED = 0
# With 2 runs a side the resampled median takes 3 values (each run, their mean): no
# estimate of the spread. 3 is the least that gives one.
MIN_REPEATS = 3


@dataclass(frozen=True)
class MedianResamples:
    """Bootstrap distribution of the median of each side: ``baseline`` and ``candidate`` are
    float64 arrays [num_resamples], resample ``i`` of each side drawn independently."""

    baseline: np.ndarray
    candidate: np.ndarray


def resample_medians(
    baseline: np.ndarray,
    candidate: np.ndarray,
    num_resamples: int = DEFAULT_NUM_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> MedianResamples:
    """Medians of ``num_resamples`` resamples (with replacement, same size) of each side.

    ``baseline`` and ``candidate``: 1-D arrays of finite values, each at least one long.
    Seeded: the same inputs and seed give the same resamples. Raises ValueError naming the
    side for an empty or non-finite sample.
    """
    rng = np.random.default_rng(seed)
    sides = []
    for name, values in (("baseline", baseline), ("candidate", candidate)):
        values = np.asarray(values, dtype=float)
        if values.ndim != 1 or values.size == 0 or not np.isfinite(values).all():
            raise ValueError(f"{name}: need a non-empty 1-D sample of finite values, got {values!r}")
        picks = rng.integers(0, values.size, size=(num_resamples, values.size))
        sides.append(np.median(values[picks], axis=1))
    return MedianResamples(sides[0], sides[1])


def percentile_interval(samples: np.ndarray, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """The central ``confidence`` interval of ``samples`` (percentile method), NaNs dropped;
    (nan, nan) when none is left. Raises ValueError unless 0 < confidence < 1."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    samples = np.asarray(samples, dtype=float)
    samples = samples[~np.isnan(samples)]
    if samples.size == 0:
        return (float("nan"), float("nan"))
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return (float(low), float(high))
