"""A planted regression for the noise-aware compare tests (test-only; production code has no hook).

``SlowPagedEngine`` is the paged engine with every step made ``SLOWDOWN`` longer: after
each step it spins for that fraction of the step's own duration, so the slowdown stays
30 % whatever the machine's load. (It spins rather than sleeps: a millisecond's sleep on a
loaded machine overshoots by a varying amount, which planted about 45 % with a wide spread
rather than 30 %.) A run selects it with
``engine._target_=planted_slowdown.SlowPagedEngine`` and ``tests/`` on PYTHONPATH; its
configuration (engine name, parameters) is the paged engine's, so ``kvbench compare``
matches its runs with the paged engine's, as a nightly matches an unchanged configuration
built from changed code.
"""

from __future__ import annotations

import time

from kvbench.engines.paged import PagedEngine
from kvbench.types import StepOutput

SLOWDOWN = 0.30  # extra time per step, as a fraction of the step's duration


class SlowPagedEngine(PagedEngine):
    """PagedEngine whose ``step`` takes (1 + SLOWDOWN) times as long."""

    def step(self) -> StepOutput:
        start_s = time.perf_counter()
        output = super().step()
        end_s = time.perf_counter()
        until_s = end_s + SLOWDOWN * (end_s - start_s)
        while time.perf_counter() < until_s:
            pass
        return output


class UnchangedPagedEngine(PagedEngine):
    """The paged engine under another class name: an unchanged build for an A/A comparison,
    interleaved in one sweep with the other two."""
