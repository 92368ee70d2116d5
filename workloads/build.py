"""Shared steps of the synthetic generators: checked counts, counted length draws, and
assembling requests into an arrival-sorted Workload."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvbench.types import Request, Workload
from kvbench.workloads.distributions import LengthDist, length_dist, sample_lengths
from kvbench.workloads.errors import WorkloadConfigError
from kvbench.workloads.tokens import check_seed, check_vocab_size, derive_rng


def check_common(vocab_size: int, seed: int, **counts: int) -> None:
    """Validate the parameters every generator has; each count must be an int >= 1."""
    check_vocab_size(vocab_size)
    check_seed(seed)
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WorkloadConfigError(f"{name}: must be an int >= 1, got {value!r}")


def draw_lengths(
    spec: LengthDist | Mapping[str, Any] | int,
    field: str,
    seed: int,
    stream: int,
    num: int,
    counters: dict[str, int],
) -> np.ndarray:
    """``num`` lengths from ``spec`` on their own stream; adds ``num_<field>_clipped`` to
    ``counters`` (how many draws fell outside ``[min_len, max_len]``; a leading ``num_``
    of the field is not repeated)."""
    lengths, num_clipped = sample_lengths(length_dist(spec, field), derive_rng(seed, stream), num)
    key = f"num_{field.removeprefix('num_')}_clipped"
    counters[key] = counters.get(key, 0) + num_clipped
    return lengths


def sorted_workload(name: str, requests: Iterable[Request], counters: Mapping[str, int]) -> Workload:
    """A synthetic Workload with requests stably sorted by arrival (ties keep build order)."""
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    return Workload(
        name=name,
        requests=tuple(ordered),
        source="synthetic",
        counters=dict(counters),
        max_concurrency=closed_loop_limit(ordered),
    )


def closed_loop_limit(requests: Iterable[Request]) -> int | None:
    """The closed-loop concurrency that ClosedLoopArrivals tagged every request with, or None."""
    limits = {r.tags.get("max_concurrency") for r in requests}
    if len(limits) == 1 and None not in limits:
        return int(limits.pop())
    return None
