"""Interleaved rounds: the one way the benchmarks time variants against each other.

A benchmark names its variants, each a ``prepare`` callable that builds fresh state
(untimed) and returns the zero-argument ``work`` to time. ``run_rounds`` runs every
variant once per round, the order rotated by one each round (round r starts with variant
r mod n), so slow drift of a shared machine and any order effect (caches warmed by the
previous variant, allocator state) spread over all variants alike. Each ``work`` call is
timed alone with ``clock``: ``time.process_time`` (CPU time of this process, which other
load disturbs less than wall time) for CPU-bound Python, ``time.perf_counter`` only where
wall time is the point (e.g. attention kernels that may use other threads).

Figures are min / median / max over the rounds; a ratio of two variants is taken per
round (both measured within seconds of each other) and summarised the same way, never as
a ratio of medians. The 1-minute load average before and after and the machine-speed
probe (``kvbench.probe.probe_facts``) go with every result, so a figure can be read
against how fast and how busy the machine was.

A benchmark that checks what its work did (integrity checks, counts) passes ``verify``:
it is called with the variant's name and ``work``'s return value right after each call
(the warm-up's and every round's), after the clock has stopped, so checks cost nothing
on any figure; an exception it raises ends the run.

``KVBENCH_BENCH_ROUNDS`` raises the number of rounds (default and minimum 5).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.probe import probe_facts

ROUNDS_ENV = "KVBENCH_BENCH_ROUNDS"
MIN_ROUNDS = 5


def num_rounds_from_env() -> int:
    """``KVBENCH_BENCH_ROUNDS`` (an integer >= 5), or 5 when unset. Raises ValueError
    naming the variable on anything else."""
    text = os.environ.get(ROUNDS_ENV, str(MIN_ROUNDS))
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{ROUNDS_ENV}: expected an integer >= {MIN_ROUNDS}, got {text!r}") from None
    if value < MIN_ROUNDS:
        raise ValueError(f"{ROUNDS_ENV}: expected an integer >= {MIN_ROUNDS}, got {value}")
    return value


def sizes_from_env(name: str, default: str) -> list[int]:
    """A comma-separated list of positive integers from environment variable ``name``
    (``default`` when unset). Raises ValueError naming the variable."""
    text = os.environ.get(name, default)
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{name}: expected positive integers, got {text!r}")
    return sizes


@dataclass(frozen=True)
class Spread:
    """Min / median / max of one figure over the rounds."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(min(values), statistics.median(values), max(values))

    def as_info(self, key: str) -> dict[str, float]:
        """``{KEY_min, KEY_median, KEY_max}``: the flat ``extra_info`` form that
        scripts/readme_figures.py reads back."""
        return {f"{key}_min": self.min, f"{key}_median": self.median, f"{key}_max": self.max}

    def text(self, fmt: str = ".3g") -> str:
        return f"{self.min:{fmt}} / {self.median:{fmt}} / {self.max:{fmt}}"


@dataclass(frozen=True)
class Rounds:
    """Timings of interleaved rounds: ``seconds[name][r]`` is variant ``name``'s time in
    round r; ``outcomes[name]`` what its ``work`` returned in the last round."""

    num_rounds: int
    clock: str
    seconds: Mapping[str, tuple[float, ...]]
    outcomes: Mapping[str, Any]
    load_avg_1m_before: float
    load_avg_1m_after: float
    probe: Mapping[str, float | None]

    def spread(self, name: str, scale: float = 1.0) -> Spread:
        """``name``'s time per round times ``scale`` (e.g. 1 / operations for a cost per
        operation, 1e6 for microseconds)."""
        return Spread.of([s * scale for s in self.seconds[name]])

    def rate(self, name: str, amount: float) -> Spread:
        """``amount`` per second of ``name``'s time, per round (e.g. requests/s)."""
        return Spread.of([amount / s for s in self.seconds[name]])

    def per_round_ratios(self, numerator: str, denominator: str) -> list[float]:
        return [a / b for a, b in zip(self.seconds[numerator], self.seconds[denominator])]

    def ratio(self, numerator: str, denominator: str) -> Spread:
        """``numerator`` / ``denominator`` per round (same-round pairs), summarised."""
        return Spread.of(self.per_round_ratios(numerator, denominator))

    def slope(self, small: str, large: str, small_work: float, large_work: float) -> Spread:
        """Per round, the log-log slope of time against work between two sizes:
        log(t_large / t_small) / log(large_work / small_work); 1.0 is linear cost."""
        if large_work <= small_work:
            raise ValueError(f"slope: large_work {large_work} must exceed small_work {small_work}")
        scale = math.log(large_work / small_work)
        return Spread.of([math.log(r) / scale for r in self.per_round_ratios(large, small)])

    def info(self) -> dict[str, float | int | str | None]:
        """What every benchmark records besides its figures: rounds, clock, load average
        before / after and the probe (``probe_*`` keys)."""
        context: dict[str, float | int | str | None] = {
            "rounds": self.num_rounds,
            "clock": self.clock,
            "load_avg_1m_before": self.load_avg_1m_before,
            "load_avg_1m_after": self.load_avg_1m_after,
        }
        context.update({key: value for key, value in self.probe.items() if key.startswith("probe_")})
        return context

    def context_line(self) -> str:
        probe = ", ".join(
            f"{key.removeprefix('probe_')} {value:.3g}"
            for key, value in self.probe.items()
            if key.startswith("probe_") and value is not None
        )
        return (
            f"{self.num_rounds} rounds ({self.clock}); load average (1 min) "
            f"{self.load_avg_1m_before:.2f} before, {self.load_avg_1m_after:.2f} after; probe: {probe}"
        )


def run_rounds(
    variants: Mapping[str, Callable[[], Callable[[], Any]]],
    *,
    num_rounds: int | None = None,
    clock: Callable[[], float] = time.process_time,
    warmup: bool = True,
    verify: Callable[[str, Any], None] | None = None,
) -> Rounds:
    """Time every variant once per round in rotated order (see module doc).

    ``variants[name]()`` prepares fresh state, untimed, and returns the ``work`` callable
    whose single call is timed. ``num_rounds`` defaults to ``num_rounds_from_env()``.
    ``warmup`` runs each variant once, untimed, before the rounds (first-call costs:
    imports, JIT compilation, lazily built tables); turn it off only where one call is
    too long to repeat. A garbage collection runs before each timed call so that one
    variant's garbage is not collected on another's clock. Raises ValueError when a
    variant's time is not positive (a clock too coarse for the work, or a broken clock).
    ``verify(name, outcome)``, when given, checks each call's outcome outside the clock.
    """
    rounds = num_rounds_from_env() if num_rounds is None else num_rounds
    if rounds < 1:
        raise ValueError(f"num_rounds: must be >= 1, got {rounds}")
    names = list(variants)
    if not names:
        raise ValueError("run_rounds: no variants")
    probe = probe_facts()
    load_before = os.getloadavg()[0]
    if warmup:
        for name in names:
            outcome = variants[name]()()
            if verify is not None:
                verify(name, outcome)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    outcomes: dict[str, Any] = {}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            # The previous round's outcome goes first: a peak-memory figure then sees one
            # outcome of a variant at a time, not two.
            outcomes.pop(name, None)
            work = variants[name]()
            gc.collect()
            start = clock()
            outcomes[name] = work()
            elapsed = clock() - start
            if not elapsed > 0:
                raise ValueError(
                    f"{name}: round {r} took {elapsed} s on {clock.__name__}; the work is too short"
                )
            seconds[name].append(elapsed)
            if verify is not None:
                verify(name, outcomes[name])
    return Rounds(
        num_rounds=rounds,
        clock=clock.__name__,
        seconds={name: tuple(times) for name, times in seconds.items()},
        outcomes=outcomes,
        load_avg_1m_before=load_before,
        load_avg_1m_after=os.getloadavg()[0],
        probe=probe,
    )
