"""Where one simulated replay's CPU time goes: every engine call timed, by kind, and
fitted to the call's batch and steps.

Run: python tests/benchmarks/step_costs.py [--workload sharegpt|mooncake] [--requests N]
     [--prefix-cache none|block_hash|radix] [--replays R] [--json FILE]

It replays the benchmarks' workload (``sim_setup.py``: ShareGPT-like traffic at 8K
context, or the first N Mooncake conversation requests at 128K) ``--replays`` times,
each on a fresh engine after one untimed warm-up replay, and times each engine ``step``
call in thread CPU time (``time.thread_time_ns``). Every replay takes the same calls
(the simulation is deterministic; it checks that they agree), so each call's figure is
its fastest over the replays, which drops most of a shared machine's noise. A call is
one of three kinds, told apart by its StepOutput:

- ``decode run``: a covered output without prefill (consecutive plain decode steps of
  one batch), fitted as ``fixed + per_seq * seqs + per_step * steps + per_seq_step *
  seqs * steps``;
- ``admitting step``: a covered output with prefill tokens or first-scheduled requests
  (a decode batch's step next to the admission of waiting requests), fitted as
  ``fixed + per_seq * seqs``;
- ``normal step``: a plain output (``schedule`` and ``complete_step``), fitted as
  ``fixed + per_seq * running``.

The fits are least squares with an intercept, so each kind's shares (a coefficient times
its regressor summed over the calls) add up to the kind's measured total. A coefficient
that the data cannot tell apart from another (an admitting step's batch is the full
engine in a saturated replay) is reported as fitted: read it with the spread of its
regressor (``seqs_p10_p50_p90``), and the kind's measured ``mean_us`` per call beside
it. The replay's own figures are medians over the replays: its time, its calls' time and
the rest (``outside``: the runner's records, request bookkeeping, the frames). The kinds'
totals, each call at its fastest, add up to less than the calls' median.

CPU time on a shared machine moves between runs; the split moves far less than the
totals. Use it to see which part of a replay a change can reach, not to compare two
checkouts (``instructions.py`` does that).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.types import ArrivalAwareEngine, Engine, Request, StepOutput

KINDS = ("decode run", "admitting step", "normal step")
# The regressors of each kind's fit, after the intercept ("fixed").
TERMS = {
    "decode run": ("per_seq", "per_step", "per_seq_step"),
    "admitting step": ("per_seq",),
    "normal step": ("per_seq",),
}


@dataclass(frozen=True)
class Call:
    """One engine call: its kind, the model steps it covered and its batch (the sequences
    of a covered output; for a normal step, the running sequences its stats report)."""

    kind: str
    num_steps: int
    num_seqs: int


@dataclass(frozen=True)
class KindFit:
    """One kind's calls, their measured CPU time and its fitted split (µs)."""

    kind: str
    num_calls: int
    total_ms: float
    mean_us: float  # measured, per call
    coefficients_us: dict[str, float]  # "fixed" and the kind's TERMS
    shares_ms: dict[str, float]  # each term's part of total_ms
    r_squared: float
    seqs_p10_p50_p90: tuple[float, float, float]
    mean_steps: float


def classify(output: StepOutput) -> Call:
    """The kind, steps and batch of one engine ``StepOutput``. Pure."""
    covered = output.covered_steps
    if covered is None:
        return Call("normal step", 1, output.stats.num_running)
    admitting = output.stats.num_prefill_tokens > 0 or bool(output.first_scheduled)
    return Call("admitting step" if admitting else "decode run", len(covered), len(covered.request_ids))


def design(kind: str, calls: list[Call]) -> np.ndarray:
    """The fit's regressors for ``calls`` of ``kind``: float64 [calls, 1 + terms]. Pure."""
    seqs = np.array([c.num_seqs for c in calls], dtype=np.float64)
    steps = np.array([c.num_steps for c in calls], dtype=np.float64)
    columns = {"per_seq": seqs, "per_step": steps, "per_seq_step": seqs * steps}
    return np.stack([np.ones(len(calls))] + [columns[term] for term in TERMS[kind]], axis=1)


def fit_kind(kind: str, calls: list[Call], seconds: np.ndarray) -> KindFit:
    """Least-squares split of ``seconds`` (float64 [calls], one per call of ``kind``). Pure."""
    x = design(kind, calls)
    coefficients, *_ = np.linalg.lstsq(x, seconds, rcond=None)
    shares = coefficients * x.sum(axis=0)
    residual = seconds - x @ coefficients
    spread = ((seconds - seconds.mean()) ** 2).sum()
    names = ("fixed", *TERMS[kind])
    seqs = [c.num_seqs for c in calls]
    return KindFit(
        kind=kind,
        num_calls=len(calls),
        total_ms=float(seconds.sum() * 1e3),
        mean_us=float(seconds.mean() * 1e6),
        coefficients_us={name: float(value * 1e6) for name, value in zip(names, coefficients)},
        shares_ms={name: float(value * 1e3) for name, value in zip(names, shares)},
        r_squared=float(1 - (residual**2).sum() / spread) if spread > 0 else float("nan"),
        seqs_p10_p50_p90=tuple(float(v) for v in np.percentile(seqs, [10, 50, 90])),
        mean_steps=float(np.mean([c.num_steps for c in calls])),
    )


class TimedEngine:
    """A simulated engine (one that hears of arrivals: ``ArrivalAwareEngine``) that times
    each ``step`` of the engine it wraps (thread CPU time, ns) and records its ``Call``;
    the other Engine calls go straight to the wrapped engine. Mutates its records.
    TypeError for an engine that does not hear of arrivals (the runner would call this
    one's ``set_next_arrival_s`` all the same)."""

    def __init__(self, engine: Engine) -> None:
        if not isinstance(engine, ArrivalAwareEngine):
            raise TypeError(f"TimedEngine: {type(engine).__name__} does not hear of arrivals")
        self._engine = engine
        self.name = engine.name
        self.calls: list[Call] = []
        self.cpu_ns: list[int] = []

    def add_request(self, request: Request) -> None:
        self._engine.add_request(request)

    def unsupported_reason(self, request: Request) -> str | None:
        return self._engine.unsupported_reason(request)

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished()

    def describe(self) -> dict[str, Any]:
        return self._engine.describe()

    def set_next_arrival_s(self, now_s: float, next_arrival_s: float) -> None:
        self._engine.set_next_arrival_s(now_s, next_arrival_s)

    def step(self) -> StepOutput:
        start = time.thread_time_ns()
        output = self._engine.step()
        self.cpu_ns.append(time.thread_time_ns() - start)
        self.calls.append(classify(output))
        return output


@dataclass(frozen=True)
class Replay:
    """One timed replay: its calls, each call's CPU time (ns) and the whole replay's (ns)."""

    calls: list[Call]
    cpu_ns: list[int]
    replay_ns: int


@dataclass(frozen=True)
class StepCosts:
    """A workload's split: per kind, and the replay's medians."""

    workload: str
    num_requests: int
    prefix_cache: str
    num_replays: int
    replay_ms_median: float
    calls_ms_median: float
    outside_ms_median: float
    kinds: tuple[KindFit, ...]


def split(workload: str, num_requests: int, prefix_cache: str, replays: list[Replay]) -> StepCosts:
    """The split of ``replays`` of one workload: each call at its fastest over the replays,
    fitted per kind; the replay, its calls and the rest as medians. Pure; ValueError when
    there is no replay or two took different calls."""
    if not replays:
        raise ValueError("split: no replay")
    calls = replays[0].calls
    for other in replays[1:]:
        if other.calls != calls:
            raise ValueError("two replays took different engine calls: the simulation is not deterministic")
    fastest = np.min(np.array([r.cpu_ns for r in replays], dtype=np.float64), axis=0) * 1e-9  # s per call
    kinds = []
    for kind in KINDS:
        at = [i for i, call in enumerate(calls) if call.kind == kind]
        if at:
            kinds.append(fit_kind(kind, [calls[i] for i in at], fastest[at]))
    calls_ns = [sum(r.cpu_ns) for r in replays]
    return StepCosts(
        workload=workload,
        num_requests=num_requests,
        prefix_cache=prefix_cache,
        num_replays=len(replays),
        replay_ms_median=statistics.median(r.replay_ns for r in replays) * 1e-6,
        calls_ms_median=statistics.median(calls_ns) * 1e-6,
        outside_ms_median=statistics.median(r.replay_ns - c for r, c in zip(replays, calls_ns)) * 1e-6,
        kinds=tuple(kinds),
    )


def measure(workload: str, num_requests: int, prefix_cache: str, num_replays: int) -> StepCosts:
    """Replay the workload ``num_replays`` times (after one untimed replay), each on a
    fresh engine, and split it. ValueError for fewer than one replay or when two replays
    took different calls."""
    from sim_setup import benchmark_workload, replay_all_answered, sim_engine

    if num_replays < 1:
        raise ValueError(f"--replays: must be >= 1, got {num_replays}")
    ctx, requests = benchmark_workload(workload, num_requests)
    replay_all_answered(sim_engine(ctx, prefix_cache=prefix_cache), requests)
    replays = []
    for _ in range(num_replays):
        engine = TimedEngine(sim_engine(ctx, prefix_cache=prefix_cache))
        start = time.thread_time_ns()
        replay_all_answered(engine, requests)
        replays.append(Replay(engine.calls, engine.cpu_ns, time.thread_time_ns() - start))
    return split(workload, num_requests, prefix_cache, replays)


def report(costs: StepCosts) -> str:
    """The split as text: the replay's medians, one line per kind, then each term's
    coefficient and share."""
    fastest_ms = sum(fit.total_ms for fit in costs.kinds)
    lines = [
        f"{costs.workload}, {costs.num_requests} requests, prefix cache {costs.prefix_cache}: "
        f"replay {costs.replay_ms_median:.0f} ms of thread CPU, the engine's calls "
        f"{costs.calls_ms_median:.0f} ms, outside them {costs.outside_ms_median:.0f} ms "
        f"(medians of {costs.num_replays}); each call at its fastest, {fastest_ms:.0f} ms:",
    ]
    for fit in costs.kinds:
        p10, p50, p90 = fit.seqs_p10_p50_p90
        lines.append(
            f"  {fit.kind}: {fit.num_calls} calls, {fit.total_ms:.1f} ms, {fit.mean_us:.0f} us "
            f"a call, R^2 {fit.r_squared:.2f}, seqs p10/p50/p90 {p10:.0f}/{p50:.0f}/{p90:.0f}, "
            f"steps {fit.mean_steps:.1f} on average"
        )
        for name, us in fit.coefficients_us.items():
            lines.append(f"    {name:13s} {us:9.3f} us  -> {fit.shares_ms[name]:7.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("sharegpt", "mooncake"), default="sharegpt")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prefix-cache", default="block_hash")
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the split here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # sim_setup
    costs = measure(args.workload, args.requests, args.prefix_cache, args.replays)
    print(report(costs))
    if args.json:
        args.json.write_text(json.dumps(asdict(costs), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
