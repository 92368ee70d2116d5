"""Simulation mode end to end: the paged engine driven by the cost-model executor.

Block counts per step must be exactly those of the real engine with the same pool (the
scheduler and KV manager are the same code); latency must follow a calibrated profile.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from run_fixtures import sweep_experiment

from kvbench.engines.config import EngineConfig, size_pool
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.protocol import COMMITS_REGISTER_NOTHING, StepCommit
from kvbench.engines.paged import PagedEngine
from kvbench.engines.sim.executor import CostModelExecutor
from kvbench.metrics import per_request
from kvbench.model import LlamaModel
from kvbench.runner import RawRun, SimClock, WallClock, replay
from kvbench.sim.calibrate import CalibrationRun, fit
from kvbench.sim.cost_model import CostModel, StepShape
from kvbench.sizing import kv_bytes_per_token, weight_bytes
from kvbench.specs import HardwareSpec, ModelSpec, SpecError
from kvbench.types import EngineContext, Workload
from kvbench.workloads.prefixes import chat
from kvbench.workloads.synthetic import random_requests

SPEC = ModelSpec()  # tiny-gqa, fp32
BLOCK_COLUMNS = (
    "num_running",
    "num_waiting",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_preemptions",
    "num_prefix_hit_tokens",
    "kv_num_blocks_in_use",
    "kv_num_blocks_cached_free",
    "kv_num_blocks_free",
    "kv_token_bytes",
)


def offline(workload: Workload) -> Workload:
    """Every request at t=0, so the step sequence does not depend on the clock."""
    return Workload(workload.name, tuple(dataclasses.replace(r, arrival_s=0.0) for r in workload.requests))


def sim_engine(hardware: HardwareSpec, **params: object) -> PagedEngine:
    ctx = EngineContext(SPEC, hardware, None, "cpu", "fp32", 0, "sim")
    return PagedEngine(ctx, executor=CostModelExecutor.from_context(ctx, block_size=16), **params)


def run_sim(workload: Workload, hardware: HardwareSpec, **params: object) -> RawRun:
    return replay(sim_engine(hardware, **params), workload, SimClock())


@pytest.fixture(scope="module")
def tiny_model() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel.random(SPEC, 0)


@pytest.mark.parametrize("prefix_cache", ["block_hash", "radix"])
def test_sim_allocates_exactly_the_blocks_of_the_real_engine(tiny_model, prefix_cache):
    # A shared system prompt (prefix hits) and a pool small enough to preempt.
    workload = offline(
        chat(
            num_conversations=4,
            num_turns=2,
            system_prompt_len=48,
            user_len=24,
            output_len={"kind": "uniform", "low": 8, "high": 20},
            vocab_size=SPEC.vocab_size,
            seed=3,
        )
    )
    params = {"num_blocks": 16, "max_num_seqs": 6, "max_num_batched_tokens": 96, "prefix_cache": prefix_cache}
    ctx = EngineContext(SPEC, HardwareSpec(), tiny_model, "cpu", "fp32", 0, "real")
    real = replay(PagedEngine(ctx, **params), workload, WallClock())
    sim = run_sim(workload, HardwareSpec(), **params)
    assert real.num_steps == sim.num_steps
    assert real.steps["num_preemptions"].sum() > 0  # the small pool really preempted
    assert real.steps["num_prefix_hit_tokens"].sum() > 0
    for column in BLOCK_COLUMNS:
        assert real.steps[column].tolist() == sim.steps[column].tolist(), column
    assert sorted(real.outputs) == sorted(sim.outputs)


@pytest.mark.parametrize("samples", [{}, {"n": 2}, {"beam_width": 2}])
def test_skipping_decode_commits_without_a_prefix_cache_changes_no_step(monkeypatch, samples):
    """Without a prefix cache a commit only checks its count, so the scheduler skips every
    one-token commit (``commit_interval``): the run equals one making a commit at each
    block boundary, as with a block-hash index, preemptions included."""
    workload = offline(random_requests(12, 40, 30, vocab_size=SPEC.vocab_size, seed=2, **samples))
    params = {"num_blocks": 16, "max_num_seqs": 6, "max_num_batched_tokens": 96, "prefix_cache": "none"}
    commits: list[int] = []
    commit_many = PagedKVManager.commit_many

    def counted(self: PagedKVManager, entries: list[StepCommit]) -> None:
        commits.extend(num_tokens for _, _, num_tokens in entries)
        commit_many(self, entries)

    monkeypatch.setattr(PagedKVManager, "commit_many", counted)
    runs = []
    for interval in (COMMITS_REGISTER_NOTHING, 16):
        engine = sim_engine(HardwareSpec(), **params)
        assert engine.kv.commit_interval == COMMITS_REGISTER_NOTHING
        engine.kv.commit_interval = interval
        commits.clear()
        runs.append((replay(engine, workload, SimClock()), sorted(commits)))
    (skipping, skipped), (committing, made) = runs
    assert committing.steps["num_preemptions"].sum() > 0
    # Only chunks of several tokens (prefill) commit when skipping; one-token chunks too
    # at every block boundary otherwise.
    assert skipped and len(skipped) < len(made) and set(skipped) < set(made)
    pd.testing.assert_frame_equal(skipping.steps, committing.steps)
    assert skipping.outputs == committing.outputs


def test_sim_steps_take_the_cost_models_time():
    hw = HardwareSpec(step_overhead_s=1e-3, per_seq_overhead_s=1e-4)
    workload = offline(random_requests(6, 40, 5, vocab_size=SPEC.vocab_size, seed=1))
    engine = sim_engine(hw, num_blocks=64, max_num_batched_tokens=64)
    raw = replay(engine, workload, SimClock())
    cm = CostModel.for_dtypes(SPEC, hw, "fp32", "fp32")
    first = raw.steps.iloc[0]
    # Step 0 is one 64-token chunk of the first prompt (40 tokens) and 24 of the second.
    expected = cm.duration_s(StepShape.build(prefill_chunks=[(0, 40), (0, 24)]))
    assert first["num_prefill_tokens"] == 64
    assert first["duration_s"] == pytest.approx(expected, rel=1e-12)
    assert raw.duration_s == pytest.approx(engine.executor.total_modeled_s, rel=1e-12)
    assert engine.executor.num_steps == raw.num_steps
    assert engine.describe()["executor"] == "cost_model"


def test_calibrated_simulation_predicts_latency_of_an_unseen_workload():
    """Ground truth is an engine timed by a known profile with exact step shapes; the fit
    only sees its steps frame (the composition columns the engine records), then predicts
    another workload."""
    truth = HardwareSpec(
        name="truth",
        hbm_bandwidth_gbps=20.0,
        memory_efficiency=0.5,
        bf16_tflops=0.2,
        mfu=0.4,
        step_overhead_s=2e-3,
        per_token_overhead_s=20e-6,
        per_seq_overhead_s=150e-6,
    )
    params = {"num_blocks": 256, "max_num_seqs": 16}

    def workload(seed: int, num: int, prompt: int, output: int, rate: float) -> Workload:
        return random_requests(
            num,
            {"kind": "uniform", "low": prompt // 2, "high": prompt},
            {"kind": "uniform", "low": output // 2, "high": output},
            {"kind": "poisson", "rate_per_s": rate},
            vocab_size=SPEC.vocab_size,
            seed=seed,
        )

    train = [workload(1, 24, 256, 48, 20.0), workload(2, 24, 64, 64, 40.0)]
    runs = [
        CalibrationRun(
            str(i),
            run_sim(w, truth, **params).steps,
            SPEC,
            kv_bytes_per_token(SPEC, "fp32"),
            weight_bytes(SPEC, "fp32"),
        )
        for i, w in enumerate(train)
    ]
    fitted = fit(runs, HardwareSpec(), "fitted").hardware
    unseen = workload(4, 32, 160, 48, 15.0)
    expected = per_request(run_sim(unseen, truth, **params).requests)
    predicted = per_request(run_sim(unseen, fitted, **params).requests)
    assert predicted["ttft_ms"].mean() == pytest.approx(expected["ttft_ms"].mean(), rel=0.15)
    assert predicted["tpot_ms"].mean() == pytest.approx(expected["tpot_ms"].mean(), rel=0.10)


def test_size_pool_sizes_the_simulated_pool_like_a_real_engine(capsys):
    spec = ModelSpec(
        name="llama-3-70b-fp8", num_layers=80, num_q_heads=64, num_kv_heads=8, head_dim=128,
        hidden_size=8192, intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192, dtype="fp8",
    )  # fmt: skip
    h100 = HardwareSpec(
        name="h100-80gb", memory_bytes=80 * 1024**3, hbm_bandwidth_gbps=3350.0, bf16_tflops=989.0
    )
    ctx = EngineContext(spec, h100, None, "cpu", "bf16", 0, "sim")
    num_blocks, executor = size_pool(ctx, EngineConfig(kv_memory_bytes=None), None)
    assert num_blocks == 1083  # (0.9 x 80 GiB - 70.55 GB fp8 weights - 1 GiB) // 5 MiB blocks
    assert executor.bytes_per_block == 16 * 327_680
    assert "1,083 blocks x 16 tokens" in capsys.readouterr().out
    assert size_pool(ctx, EngineConfig(num_blocks=7), None, log=None)[0] == 7
    with pytest.raises(SpecError, match="does not fit"):
        size_pool(
            dataclasses.replace(ctx, spec=dataclasses.replace(spec, dtype="bf16")),
            EngineConfig(kv_memory_bytes=None),
            None,
        )


def test_seed_claims_best_of_8_shares_the_2000_token_prompt(tmp_path):
    """Best-of-8 on 2,000-token prompts (125 full blocks) with 256 output tokens, H200 pool
    (no preemption): each request holds one prompt plus eight outputs' slots (the last
    sampled token of each sample never gets a KV slot) against eight of each unshared."""
    sweep = sweep_experiment(
        "seed_claims_best_of_8",
        "hydra.sweeper.params.hardware=h200-141gb",
        "workload.num_requests=8",
        cwd=tmp_path,
    )
    [requests_file] = sweep.glob("*/requests.parquet")
    requests = pd.read_parquet(requests_file)
    assert len(requests) == 8 and (requests["num_preemptions"] == 0).all()
    assert (requests["peak_kv_slots"] == 2000 + 8 * 255).all()
    assert (requests["peak_kv_slots_unshared"] == 8 * (2000 + 255)).all()
    runs = pd.read_parquet(sweep / "runs.parquet")
    assert runs["kv_sharing_saved_fraction"].iloc[0] == pytest.approx(1 - 4040 / 18040)
