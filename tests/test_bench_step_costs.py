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
    for fit in costs["kinds"]:
        assert sum(fit["shares_ms"].values()) == pytest.approx(fit["total_ms"], rel=1e-6)
    assert sum(fit["total_ms"] for fit in costs["kinds"]) < costs["replay_ms_median"]


def test_the_tool_refuses_zero_replays() -> None:
    with pytest.raises(ValueError, match="--replays"):
        step_costs.measure("sharegpt", 5, "none", 0)
