"""Roofline cost model and KV pool sizing of simulation mode: hand-computed figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from kvbench.sim.cost_model import CostModel, StepShape
from kvbench.sim.pool import plan_kv_pool, pool_summary
from kvbench.sizing import fit
from kvbench.specs import HardwareSpec, ModelSpec, SpecError

CONF = Path(__file__).resolve().parents[1] / "conf"


def model(name: str, **changes: object) -> ModelSpec:
    return dataclasses.replace(
        ModelSpec(**OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml"))), **changes
    )


def hardware(name: str, **changes: object) -> HardwareSpec:
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / f"{name}.yaml"))
    return dataclasses.replace(HardwareSpec(**raw), **changes)


LLAMA3_70B_PARAMS = 70_553_706_496
LLAMA3_70B_KV_PER_TOKEN = 327_680  # bf16


def test_step_shape_counts_causal_pairs_and_context():
    # chunk at positions 2..4 attends 3 + 4 + 5 keys; chunk 0..1 attends 1 + 2.
    shape = StepShape.build(prefill_chunks=[(2, 3), (0, 2)], decode_context_lens=[10, 7], host_bytes=5)
    assert shape == StepShape(
        num_prefill_tokens=5,
        num_prefill_seqs=2,
        num_prefill_attention_pairs=12 + 3,
        num_prefill_context_tokens=5 + 2,
        num_decode_seqs=2,
        num_decode_context_tokens=17,
        host_bytes=5,
    )
    assert shape.num_tokens == 7 and shape.num_seqs == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefill_chunks": [(-1, 3)]},
        {"prefill_chunks": [(0, 0)]},
        {"decode_context_lens": [0]},
        {"host_bytes": -1},
    ],
)
def test_step_shape_rejects_impossible_parts(kwargs):
    with pytest.raises(ValueError):
        StepShape.build(**kwargs)


def test_llama3_70b_decode_on_h200_is_memory_bound_by_hand():
    cm = CostModel.for_dtypes(model("llama-3-70b"), hardware("h200-141gb"), "bf16", "fp8")
    assert cm.weight_bytes == LLAMA3_70B_PARAMS  # fp8: one byte per parameter
    cost = cm.cost(StepShape.build(decode_context_lens=[1024]))
    # Reads all weights, 1,024 cached tokens and writes 1 new one.
    expected_memory_s = (LLAMA3_70B_PARAMS + 1025 * LLAMA3_70B_KV_PER_TOKEN) / (4800e9 * 0.7)
    attention_flops = 80 * 64 * 4 * 128 * 1024
    expected_compute_s = (2 * LLAMA3_70B_PARAMS + attention_flops) / (989e12 * 0.5)
    assert cost.memory_s == pytest.approx(expected_memory_s, rel=1e-12)
    assert cost.compute_s == pytest.approx(expected_compute_s, rel=1e-12)
    assert cost.bound == "memory"
    assert cost.duration_s == pytest.approx(expected_memory_s, rel=1e-12)
    # The field notes' floor: >= 14.8 ms at full bandwidth (efficiency 1).
    assert expected_memory_s * 0.7 == pytest.approx(0.0148, abs=2e-4)


def test_long_prefill_is_compute_bound_and_overheads_add():
    hw = hardware("h100-80gb", step_overhead_s=1e-3, per_token_overhead_s=1e-6, per_seq_overhead_s=1e-5)
    cm = CostModel.for_dtypes(model("llama-3-70b"), hw, "bf16", "fp8")
    shape = StepShape.build(prefill_chunks=[(0, 2000)], decode_context_lens=[100, 200])
    cost = cm.cost(shape)
    pairs = 2000 * 2001 // 2 + 300
    flops = 2 * LLAMA3_70B_PARAMS * 2002 + 80 * 64 * 4 * 128 * pairs
    assert cost.bound == "compute"
    assert cost.compute_s == pytest.approx(flops / (989e12 * 0.5), rel=1e-12)
    assert cost.overhead_s == pytest.approx(1e-3 + 2002e-6 + 3e-5, rel=1e-12)
    assert cost.duration_s == pytest.approx(cost.compute_s + cost.overhead_s, rel=1e-12)


def test_empty_step_costs_fixed_overhead_and_transfers_use_pcie():
    cm = CostModel.for_dtypes(ModelSpec(), HardwareSpec(step_overhead_s=2e-3, pcie_gbps=10.0), "fp32", "fp32")
    assert cm.duration_s(StepShape()) == 2e-3
    assert cm.duration_s(StepShape(host_bytes=10**9)) == pytest.approx(2e-3 + 0.1)
    assert cm.transfer_s(5 * 10**8) == pytest.approx(0.05)


def test_moe_reads_more_experts_with_more_tokens_and_counts_active_flops():
    cm = CostModel.for_dtypes(model("mixtral-8x7b"), hardware("h100-80gb"), "bf16", "bf16")
    one, many = cm.weight_bytes_read(1), cm.weight_bytes_read(64)
    assert one < many < cm.weight_bytes
    assert cm.weight_bytes - many < 1e-3 * cm.weight_bytes  # 64 tokens touch every expert
    # Mixtral's published active parameters per token: 12.9B.
    assert cm.flops_per_token / 2 == pytest.approx(12.9e9, rel=0.01)


def test_mla_attention_flops_use_latent_width():
    spec = model("deepseek-v2")
    cm = CostModel.for_dtypes(spec, hardware("h200-141gb"), "bf16", "bf16")
    assert cm.flops_per_attention_pair == 60 * 128 * (2 * (512 + 64) + 2 * 512)
    assert cm.kv_bytes_per_token == 60 * (512 + 64) * 2


@settings(max_examples=60, deadline=None)
@given(
    num_seqs=st.integers(1, 300),
    context=st.integers(0, 200_000),
    num_steps=st.integers(1, 50),
    overhead=st.floats(0, 1e-3),
)
def test_decode_run_equals_step_by_step_durations(num_seqs, context, num_steps, overhead):
    hw = hardware(
        "h100-80gb",
        step_overhead_s=overhead,
        per_token_overhead_s=overhead / 7,
        per_seq_overhead_s=overhead / 3,
    )
    cm = CostModel.for_dtypes(model("llama-3-70b"), hw, "bf16", "fp8")
    context = max(context, num_seqs)  # every sequence holds at least its decoded token
    run = cm.decode_run_s(num_seqs, context, num_steps)
    for j in range(num_steps):
        lens = [1] * (num_seqs - 1) + [context + j * num_seqs - (num_seqs - 1)]
        assert run[j] == pytest.approx(cm.duration_s(StepShape.build(decode_context_lens=lens)), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    model_name=st.sampled_from(["llama-3-70b", "mixtral-8x7b", "deepseek-v2", "smollm2-135m", "tiny-gqa"]),
    hardware_name=st.sampled_from(["h200-141gb", "a100-40gb", "l4", "cpu"]),
    num_seqs=st.integers(1, 2000),
    context=st.integers(0, 130_000_000),
    num_steps=st.integers(1, 1100),
    overhead=st.floats(0, 1e-2),
)
def test_decode_run_is_its_numpy_expression_to_the_bit(
    model_name, hardware_name, num_seqs, context, num_steps, overhead
):
    # decode_run_s runs a compiled loop; simulated figures are pinned to the bit, so each
    # element must be exactly the float64 operations of the array expression it replaced
    # (no reordering, no fused multiply-add).
    hw = hardware(hardware_name, step_overhead_s=overhead, per_seq_overhead_s=overhead / 3)
    cm = CostModel.for_dtypes(model(model_name), hw, "bf16", "fp8")
    ctx = context + num_seqs * np.arange(num_steps, dtype=np.float64)
    memory_s = (cm.weight_bytes_read(num_seqs) + (ctx + num_seqs) * cm.kv_bytes_per_token) * cm.s_per_byte
    compute_s = (cm.flops_per_token * num_seqs + cm.flops_per_attention_pair * ctx) * cm.s_per_flop
    overhead_s = hw.step_overhead_s + hw.per_token_overhead_s * num_seqs + hw.per_seq_overhead_s * num_seqs
    expected = np.maximum(memory_s, compute_s) + overhead_s
    assert np.array_equal(cm.decode_run_s(num_seqs, context, num_steps), expected)


def test_decode_run_rejects_empty_batch():
    cm = CostModel.for_dtypes(ModelSpec(), HardwareSpec(), "fp32", "fp32")
    with pytest.raises(ValueError, match="num_seqs"):
        cm.decode_run_s(0, 10, 3)


# --------------------------------------------------------------------------- pool sizing
def test_pool_llama3_70b_fp8_on_h200_by_hand():
    plan = plan_kv_pool(model("llama-3-70b"), hardware("h200-141gb"), kv_dtype="bf16", weight_dtype="fp8")
    usable = 151_397_597_184 * 9 // 10  # 136,257,837,465 (floor of 0.9 x 141 GiB)
    budget = usable - LLAMA3_70B_PARAMS - 1024**3
    assert plan.usable_memory_bytes == usable
    assert plan.kv_budget_bytes == budget == 64_630_389_145
    assert plan.kv_bytes_per_block == 16 * LLAMA3_70B_KV_PER_TOKEN
    assert plan.num_gpu_blocks == budget // (16 * LLAMA3_70B_KV_PER_TOKEN) == 12_327
    assert plan.num_gpu_blocks * plan.kv_bytes_per_block <= plan.kv_budget_bytes
    assert plan.max_tokens_paged == 197_232
    line = pool_summary(plan)
    assert "\n" not in line
    for text in ("llama-3-70b", "h200-141gb", "12,327 blocks", "197,232 tokens", "fp8", "320 KiB/token bf16"):
        assert text in line


@pytest.mark.parametrize(("block_size", "utilization"), [(8, 0.9), (16, 0.95), (32, 0.8)])
def test_pool_agrees_with_the_size_calculator(block_size, utilization):
    spec, hw = model("llama-3-8b"), hardware("a100-80gb")
    plan = plan_kv_pool(
        spec,
        hw,
        kv_dtype="bf16",
        weight_dtype="bf16",
        block_size=block_size,
        gpu_memory_utilization=utilization,
    )
    report = fit(spec, hw, 1, 1, "bf16", "bf16", block_size=block_size, gpu_memory_utilization=utilization)
    assert plan.num_gpu_blocks == report.num_gpu_blocks
    assert plan.kv_budget_bytes == report.kv_budget_bytes


def test_pool_refuses_weights_that_do_not_fit():
    with pytest.raises(SpecError, match=r"hardware\.memory_bytes: llama-3-70b does not fit on h100-80gb"):
        plan_kv_pool(model("llama-3-70b"), hardware("h100-80gb"), kv_dtype="bf16", weight_dtype="bf16")


def test_pool_names_a_bad_block_size():
    with pytest.raises(SpecError, match="block_size"):
        plan_kv_pool(ModelSpec(), HardwareSpec(), kv_dtype="fp32", weight_dtype="fp32", block_size=0)
