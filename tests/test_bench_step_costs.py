"""tests/benchmarks/step_costs.py, the per-call split of a simulated replay's CPU time:
its least-squares split, its wrapper (which must not change the replay) and the tool
end to end on a small workload."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from bench_modules import BENCHMARKS, load_benchmark_module

from kvbench.types import CoveredSteps, KVUsage, StepOutput, StepStats

sim_setup = load_benchmark_module("sim_setup")
step_costs = load_benchmark_module("step_costs")


def test_the_fit_recovers_a_linear_cost_and_its_shares_add_up() -> None:
    rng = np.random.default_rng(0)
    calls = [
        step_costs.Call("decode run", int(steps), int(seqs))
        for steps, seqs in zip(rng.integers(1, 40, 60), rng.integers(1, 256, 60))
    ]
    seqs = np.array([c.num_seqs for c in calls], dtype=np.float64)
    steps = np.array([c.num_steps for c in calls], dtype=np.float64)
    seconds = (120 + 0.2 * seqs + 2.0 * steps + 0.35 * seqs * steps) * 1e-6
    fit = step_costs.fit_kind("decode run", calls, seconds)
    assert fit.coefficients_us == pytest.approx(
        {"fixed": 120.0, "per_seq": 0.2, "per_step": 2.0, "per_seq_step": 0.35}, rel=1e-6
    )
    assert fit.r_squared == pytest.approx(1.0)
    assert sum(fit.shares_ms.values()) == pytest.approx(fit.total_ms, rel=1e-9)
    assert fit.num_calls == 60 and fit.total_ms == pytest.approx(seconds.sum() * 1e3)
    assert fit.mean_us == pytest.approx(seconds.mean() * 1e6)
    assert fit.seqs_p10_p50_p90 == pytest.approx(tuple(np.percentile(seqs, [10, 50, 90])))
    assert fit.mean_steps == pytest.approx(steps.mean())


def _stats(num_running: int, num_prefill_tokens: int) -> StepStats:
    kv = KVUsage(capacity_bytes=0, allocated_bytes=0, token_bytes=0)
    return StepStats(num_running, 0, num_prefill_tokens + num_running, num_prefill_tokens, num_running, kv)


def _covered(num_steps: int, num_seqs: int, stats: StepStats) -> CoveredSteps:
    return CoveredSteps(
        durations_s=(0.01,) * num_steps,
        template=stats,
        columns={},
        request_ids=tuple(f"r{i}" for i in range(num_seqs)),
        sample_indexes=(0,) * num_seqs,
        token_ids=np.zeros((num_seqs, num_steps), dtype=np.int64),
    )


def test_calls_are_told_apart_by_what_the_engine_returned() -> None:
    normal = StepOutput((), ("a",), (), (), _stats(7, 300), 0.02)
    assert step_costs.classify(normal) == step_costs.Call("normal step", 1, 7)
    run_stats = _stats(5, 0)
    run = StepOutput((), (), (), (), run_stats, 0.09, _covered(9, 5, run_stats))
    assert step_costs.classify(run) == step_costs.Call("decode run", 9, 5)
    admitting_stats = _stats(6, 120)  # the batch's decodes next to a prompt's chunk
    admitting = StepOutput((), ("b",), (), (), admitting_stats, 0.01, _covered(1, 5, admitting_stats))
    assert step_costs.classify(admitting) == step_costs.Call("admitting step", 1, 5)
    # A recomputed group admitted again: no first token time, but a prefill.
    again = StepOutput((), (), (), (), admitting_stats, 0.01, _covered(1, 5, admitting_stats))
    assert step_costs.classify(again).kind == "admitting step"


def test_the_split_takes_each_call_at_its_fastest_and_the_replay_as_medians() -> None:
    calls = [step_costs.Call("decode run", 3, 10), step_costs.Call("normal step", 1, 4)] * 3
    replays = [
        step_costs.Replay(calls, [300, 100, 200, 100, 100, 100], 2_000),
        step_costs.Replay(calls, [100, 400, 200, 100, 100, 100], 3_000),
        step_costs.Replay(calls, [200, 200, 200, 900, 100, 100], 4_000),
    ]
    costs = step_costs.split("sharegpt", 3, "none", replays)
    by_kind = {fit.kind: fit for fit in costs.kinds}
    # Fastest per call: runs 100, 200, 100; normal steps 100, 100, 100 (ns).
    assert by_kind["decode run"].total_ms == pytest.approx(400e-6)
    assert by_kind["normal step"].total_ms == pytest.approx(300e-6)
    assert "admitting step" not in by_kind
    assert costs.replay_ms_median == pytest.approx(3_000e-6)
    assert costs.calls_ms_median == pytest.approx(1_000e-6)  # sums 900, 1000, 1700
    assert costs.outside_ms_median == pytest.approx(2_000e-6)  # 1100, 2000, 2300
    with pytest.raises(ValueError, match="different engine calls"):
        step_costs.split("sharegpt", 3, "none", [replays[0], step_costs.Replay(calls[::-1], [1] * 6, 9)])
    with pytest.raises(ValueError, match="no replay"):
        step_costs.split("sharegpt", 3, "none", [])


def test_with_noise_the_shares_still_add_up_to_the_measured_total() -> None:
    """An intercept makes the residuals sum to zero: the split accounts for every µs."""
    rng = np.random.default_rng(1)
    calls = [step_costs.Call("admitting step", 1, int(s)) for s in rng.integers(200, 256, 40)]
    seconds = rng.uniform(150e-6, 450e-6, 40)
    fit = step_costs.fit_kind("admitting step", calls, seconds)
    assert set(fit.coefficients_us) == {"fixed", "per_seq"}
    assert sum(fit.shares_ms.values()) == pytest.approx(fit.total_ms, rel=1e-9)
    assert fit.r_squared < 0.5  # noise: the batch explains little


def test_timing_the_engine_changes_nothing_in_the_replay() -> None:
    ctx, workload = sim_setup.benchmark_workload("sharegpt", 40)
    plain = sim_setup.replay_all_answered(sim_setup.sim_engine(ctx), workload)
    engine = step_costs.TimedEngine(sim_setup.sim_engine(ctx))
    timed = sim_setup.replay_all_answered(engine, workload)
    pd.testing.assert_frame_equal(plain.requests, timed.requests)
    pd.testing.assert_frame_equal(plain.steps, timed.steps)
    assert len(engine.calls) == len(engine.cpu_ns) < plain.num_steps  # runs cover several steps
    covered = sum(call.num_steps for call in engine.calls)
    assert covered == plain.num_steps  # every model step is in exactly one call
    kinds = {call.kind for call in engine.calls}
    assert kinds <= set(step_costs.KINDS) and "decode run" in kinds
    assert all(ns >= 0 for ns in engine.cpu_ns)


def test_the_tool_splits_a_small_replay() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "step_costs.py"),
            "--requests",
            "30",
            "--replays",
            "2",
            "--json",
            "/dev/stdout",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    text, _, _ = done.stdout.partition("{")
    costs = json.loads(done.stdout[len(text) :])
    assert "requests, prefix cache block_hash" in text
    assert costs["num_replays"] == 2 and costs["replay_ms_median"] > 0
    assert 0 <= costs["outside_ms_median"] < costs["replay_ms_median"]
    assert costs["calls_ms_median"] + costs["outside_ms_median"] == pytest.approx(costs["replay_ms_median"])
    for fit in costs["kinds"]:
        assert sum(fit["shares_ms"].values()) == pytest.approx(fit["total_ms"], rel=1e-6)
    assert sum(fit["total_ms"] for fit in costs["kinds"]) <= costs["calls_ms_median"]


def test_only_an_engine_that_hears_of_arrivals_is_timed() -> None:
    with pytest.raises(TypeError, match="object does not hear of arrivals"):
        step_costs.TimedEngine(object())  # type: ignore[arg-type]


def test_the_tool_refuses_zero_replays() -> None:
    with pytest.raises(ValueError, match="--replays"):
        step_costs.measure("sharegpt", 5, "none", 0)
