"""The twin without a server: step reconstruction from token times (checked against
kvbench's own paged engine, whose true steps are known), the calibration fit on
reconstructed steps, the server limits, and the comparison maths. The live path (vLLM,
then ``kvbench twin``) is tests/test_twin_live.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from kvbench.config import validate_config
from kvbench.engines.paged import PagedEngine
from kvbench.runner import RawRun, SimClock, replay
from kvbench.sim.calibrate import CalibrationRun, fit
from kvbench.sim.live_steps import (
    VLLM_CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS,
    VLLM_CPU_DEFAULT_MAX_NUM_SEQS,
    ReconstructionError,
    reconstruct_steps,
    reliable_steps,
    server_limits,
)
from kvbench.sizing import kv_bytes_per_token, weight_bytes
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.twin import (
    TwinError,
    check_comparison_file,
    compare,
    format_table,
    latency_figures,
    recorded_arrivals,
    relative_error,
    run_twin,
    twin_config,
    usage_at,
)
from kvbench.types import EngineContext
from kvbench.workloads.prefixes import chat

REPO = Path(__file__).resolve().parents[1]
SHAPE_COLUMNS = (
    "num_prefill_tokens",
    "num_prefill_seqs",
    "num_prefill_attention_pairs",
    "num_prefill_context_tokens",
    "num_decode_tokens",
    "num_decode_context_tokens",
)


def tiny_spec() -> ModelSpec:
    fields = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "tiny-gqa.yaml"))
    return ModelSpec(**{**fields, "vocab_size": 1024})


def cpu_hardware(**overrides: float) -> HardwareSpec:
    fields = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "hardware" / "cpu.yaml"))
    return HardwareSpec(**{**fields, **overrides})


# A profile with every cost term non-zero, so that a fit on exact steps must recover it.
TRUE_HARDWARE = cpu_hardware(
    memory_efficiency=0.6, mfu=0.3, step_overhead_s=2e-4, per_token_overhead_s=3e-6, per_seq_overhead_s=2e-5
)


def simulate(num_blocks: int, budget: int, hardware: HardwareSpec = TRUE_HARDWARE) -> RawRun:
    """32 concurrent chat requests through kvbench's paged engine in simulation."""
    spec = tiny_spec()
    workload = chat(
        num_conversations=8,
        num_turns=4,
        system_prompt_len=64,
        arrival={"kind": "poisson", "rate_per_s": 50.0},
        turn_interval_s=0.05,
        vocab_size=1024,
        seed=0,
    )
    ctx = EngineContext(spec, hardware, None, "cpu", "fp32", 0, "sim")
    engine = PagedEngine(
        ctx, block_size=32, num_blocks=num_blocks, max_num_seqs=128, max_num_batched_tokens=budget
    )
    return replay(engine, workload, SimClock())


def matched(raw: RawRun, steps: pd.DataFrame) -> pd.DataFrame:
    """The engine's true steps at the reconstructed steps' end times."""
    true = raw.steps.set_index(np.round(raw.steps["end_s"].to_numpy(dtype=float), 12))
    return true.loc[np.round(steps["end_s"].to_numpy(dtype=float), 12)].reset_index(drop=True)


def test_reconstruction_is_exact_without_pressure() -> None:
    raw = simulate(num_blocks=1000, budget=4096)
    steps = reconstruct_steps(raw.requests, max_num_batched_tokens=4096, send_column="arrival_s")
    assert len(steps) == len(raw.steps)
    assert (steps["unreliable"] == "").all()
    true = matched(raw, steps)
    for column in SHAPE_COLUMNS:
        assert steps[column].tolist() == true[column].astype(int).tolist(), column
    np.testing.assert_allclose(steps["duration_s"], true["duration_s"], rtol=1e-9)


def test_reconstruction_flags_what_it_cannot_see_and_is_exact_elsewhere() -> None:
    # 24 blocks and a 256-token budget: preemptions (a request skips steps) and chunked
    # prefills (part of a prompt runs in a step that emits no token for it).
    raw = simulate(num_blocks=24, budget=256)
    assert raw.steps["num_preemptions"].sum() > 0
    steps = reconstruct_steps(raw.requests, max_num_batched_tokens=256, send_column="arrival_s")
    assert len(steps) == len(raw.steps)
    reasons = set(",".join(steps["unreliable"]).split(",")) - {""}
    assert {"skipped", "hidden_prefill"} <= reasons
    usable = reliable_steps(steps)
    assert len(usable) >= 0.25 * len(steps)
    true = matched(raw, usable)
    for column in SHAPE_COLUMNS:
        assert usable[column].tolist() == true[column].astype(int).tolist(), column
    np.testing.assert_allclose(usable["duration_s"], true["duration_s"], rtol=1e-9)


def test_calibration_recovers_the_cost_model_from_reconstructed_steps() -> None:
    spec = tiny_spec()
    raw = simulate(num_blocks=1000, budget=4096)
    usable = reliable_steps(
        reconstruct_steps(raw.requests, max_num_batched_tokens=4096, send_column="arrival_s")
    )
    run = CalibrationRun("r", usable, spec, kv_bytes_per_token(spec, "fp32"), weight_bytes(spec, "fp32"))
    result = fit([run], cpu_hardware(), "fitted")
    assert result.mean_abs_rel_error < 1e-6
    hw = result.hardware
    assert hw.step_overhead_s == pytest.approx(TRUE_HARDWARE.step_overhead_s, rel=1e-4)
    assert hw.per_seq_overhead_s == pytest.approx(TRUE_HARDWARE.per_seq_overhead_s, rel=1e-3)


def frame(rows: list[dict[str, object]]) -> pd.DataFrame:
    base = {"rejected_reason": "", "num_samples": 1, "num_cached_tokens": 0}
    out = pd.DataFrame([{**base, **r} for r in rows])
    out["finish_s"] = [max(t) for t in out["token_times_s"]]
    out["first_token_s"] = [min(t) for t in out["token_times_s"]]
    out["num_output_tokens"] = [len(t) for t in out["token_times_s"]]
    return out


def test_tokens_read_in_one_burst_are_coalesced_not_steps() -> None:
    # Request a streams one token per 5 ms step; b's five tokens reached the client in
    # one read 30 us apart: they are five server steps whose times are unknown.
    requests = frame(
        [
            {
                "request_id": "a",
                "first_scheduled_s": 0.0,
                "num_prompt_tokens": 10,
                "token_times_s": [0.01, 0.015],
            },
            {
                "request_id": "b",
                "first_scheduled_s": 0.1,
                "num_prompt_tokens": 10,
                "token_times_s": [0.2 + 3e-5 * i for i in range(5)],
            },
        ]
    )
    steps = reconstruct_steps(requests, max_num_batched_tokens=2048)
    assert steps["unreliable"].tolist() == ["", "", *["coalesced"] * 5]
    usable = reliable_steps(steps)
    assert usable["num_prefill_tokens"].tolist() == [10, 0]
    assert usable["num_decode_context_tokens"].tolist() == [0, 11]
    assert usable["duration_s"].tolist() == pytest.approx([0.01, 0.005])


def test_reconstruction_names_missing_inputs() -> None:
    requests = frame(
        [{"request_id": "a", "first_scheduled_s": 0.0, "num_prompt_tokens": 4, "token_times_s": [1.0]}]
    )
    with pytest.raises(ReconstructionError, match="first_scheduled_s"):
        reconstruct_steps(requests.drop(columns="first_scheduled_s"), max_num_batched_tokens=8)
    with pytest.raises(ReconstructionError, match="request a: num_cached_tokens is unknown"):
        reconstruct_steps(requests.assign(num_cached_tokens=math.nan), max_num_batched_tokens=8)


def live_meta(server_args: dict[str, object] | None = None) -> dict[str, object]:
    return {
        "run_id": "live",
        "engine_kind": "live",
        "server": {"block_size": 32, "num_gpu_blocks": 40, "enable_prefix_caching": "True"},
        "engine_params": {"server_args": server_args or {}},
    }


def test_server_limits_from_facts_launch_arguments_and_defaults() -> None:
    limits = server_limits(live_meta())
    assert (limits.block_size, limits.num_blocks, limits.enable_prefix_caching) == (32, 40, True)
    assert limits.max_num_seqs == VLLM_CPU_DEFAULT_MAX_NUM_SEQS == 128
    assert limits.max_num_batched_tokens == VLLM_CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS == 2048
    assert dict(limits.sources)["max_num_seqs"].startswith("vLLM's CPU default")
    given = server_limits(
        live_meta({"max_num_seqs": 8, "max_num_batched_tokens": 512}),
        "Initializing a V1 LLM engine ... enable_chunked_prefill=False, ...",
    )
    assert (given.max_num_seqs, given.max_num_batched_tokens, given.chunked_prefill) == (8, 512, False)
    with pytest.raises(ReconstructionError, match="not a live-server run"):
        server_limits({"run_id": "x", "engine_kind": None})
    with pytest.raises(ReconstructionError, match="meta.server.num_gpu_blocks is missing"):
        server_limits({**live_meta(), "server": {"block_size": 32}})


def test_relative_error_edge_cases() -> None:
    assert relative_error(100.0, 95.0) == pytest.approx(-0.05)
    assert relative_error(0.0, 0.0) == 0.0
    assert relative_error(0.0, 3.0) == math.inf
    assert math.isnan(relative_error(math.nan, 1.0))


def test_usage_at_samples_the_running_step_and_zero_when_idle() -> None:
    steps = pd.DataFrame(
        {
            "start_s": [0.0, 1.0, 3.0],
            "end_s": [1.0, 2.0, 4.0],
            "kv_allocated_bytes": [10.0, 20.0, 40.0],
            "kv_capacity_bytes": [100.0, 100.0, 100.0],
        }
    )
    np.testing.assert_allclose(
        usage_at(steps, np.array([-1.0, 0.5, 1.0, 2.5, 3.9, 9.0])), [0, 0.1, 0.2, 0, 0.4, 0]
    )


def test_latencies_are_measured_from_the_send_time() -> None:
    requests = frame(
        [
            {
                "request_id": "a",
                "first_scheduled_s": 1.0,
                "num_prompt_tokens": 4,
                "token_times_s": [1.1, 1.3],
            },
            {
                "request_id": "b",
                "first_scheduled_s": 2.0,
                "num_prompt_tokens": 4,
                "token_times_s": [2.3, 2.4],
            },
        ]
    ).assign(arrival_s=0.0)
    figures = latency_figures(requests, "first_scheduled_s")
    assert figures["ttft_ms_mean"] == pytest.approx(200.0)
    assert figures["ttft_ms_median"] == pytest.approx(200.0)
    assert figures["tpot_ms_mean"] == pytest.approx(150.0)
    assert figures["tpot_ms_p99"] == pytest.approx(199.0)


def test_comparison_puts_like_beside_like() -> None:
    live_requests = frame(
        [{"request_id": "a", "first_scheduled_s": 0.0, "num_prompt_tokens": 64, "token_times_s": [0.1, 0.2]}]
    ).assign(arrival_s=0.0)
    twin_requests = live_requests.assign(token_times_s=[[0.09, 0.19]], first_token_s=0.09, finish_s=0.19)
    scrapes = pd.DataFrame({"t_s": [0.05, 0.15, 0.25], "error": ["", "", ""]})
    twin_steps = pd.DataFrame(
        {"start_s": [0.0], "end_s": [0.2], "kv_allocated_bytes": [30.0], "kv_capacity_bytes": [100.0]}
    )
    live_summary = {
        "server_prefix_query_tokens": 64,
        "server_prefix_hit_tokens": 32,
        "server_num_preemptions": 0,
        "server_kv_usage_peak": 0.25,
        "server_kv_usage_mean": 0.2,
    }
    twin_summary = {"num_cached_prompt_tokens": 32, "num_preemptions": 0, "kv_peak_utilization": 0.3}
    rows = {
        r.metric: r
        for r in compare(live_summary, live_requests, scrapes, twin_summary, twin_requests, twin_steps)
    }
    assert list(rows) == [
        "prefix_query_tokens",
        "prefix_hit_tokens",
        "num_preemptions",
        "kv_usage_peak",
        "kv_usage_mean",
        "ttft_ms_mean",
        "ttft_ms_median",
        "ttft_ms_p99",
        "tpot_ms_mean",
        "tpot_ms_median",
        "tpot_ms_p99",
    ]
    assert (rows["prefix_hit_tokens"].live, rows["prefix_hit_tokens"].twin) == (32, 32)
    assert rows["prefix_hit_tokens"].within_goal is True
    assert rows["kv_usage_peak"].twin == pytest.approx(0.3)  # sampled at 0.05 and 0.15
    assert rows["kv_usage_mean"].twin == pytest.approx(0.3)  # 0.3 held 0.05-0.25 (last sample unweighted)
    assert rows["ttft_ms_mean"].rel_error == pytest.approx(-0.1)
    assert rows["ttft_ms_mean"].within_goal is True
    assert rows["kv_usage_peak"].within_goal is None
    table = format_table(list(rows.values()))
    assert "prefix_hit_tokens" in table and "-10.0%" in table


def test_twin_config_replays_the_recorded_send_times(tmp_path: Path) -> None:
    # A live run directory as the endpoint engine writes it: config.yaml and requests.parquet.
    live_cfg = OmegaConf.load(REPO / "conf" / "config.yaml")
    live_cfg = OmegaConf.merge(
        {k: v for k, v in live_cfg.items() if k not in ("defaults", "hydra")},
        {
            "model": OmegaConf.load(REPO / "conf" / "model" / "tiny-gqa.yaml"),
            "hardware": OmegaConf.load(REPO / "conf" / "hardware" / "cpu.yaml"),
            "engine": OmegaConf.load(REPO / "conf" / "engine" / "vllm_cpu.yaml"),
            "workload": OmegaConf.load(REPO / "conf" / "workload" / "chat.yaml"),
            "run": {"results_dir": "results", "sweep_name": "single", "run_id": None},
        },
    )
    live_cfg.model.vocab_size = 1024
    live_dir = tmp_path / "live"
    live_dir.mkdir()
    (live_dir / "config.yaml").write_text(OmegaConf.to_yaml(live_cfg))
    original = chat(vocab_size=1024, seed=0)
    send_s = {r.request_id: 0.5 + i for i, r in enumerate(original.requests)}
    pd.DataFrame({"request_id": list(send_s), "first_scheduled_s": list(send_s.values())}).to_parquet(
        live_dir / "requests.parquet"
    )
    replayed = recorded_arrivals(str(live_dir))
    assert {r.request_id: r.arrival_s for r in replayed.requests} == send_s
    assert [
        dataclasses.replace(r, arrival_s=0.0) for r in sorted(replayed.requests, key=lambda r: r.request_id)
    ] == [
        dataclasses.replace(r, arrival_s=0.0) for r in sorted(original.requests, key=lambda r: r.request_id)
    ]
    cfg = twin_config(live_cfg, live_dir, server_limits(live_meta()), None, "fp32", tmp_path / "twin")
    merged = validate_config(cfg)
    assert merged.run.mode == "sim" and merged.engine.num_blocks == 39  # vLLM's null block
    assert (merged.engine.block_size, merged.engine.max_num_batched_tokens) == (32, 2048)
    assert merged.workload.live_run == str(live_dir)
    assert merged.engine.register_blocks == "on_schedule"  # vLLM caches blocks as it schedules them


def test_comparison_file_of_another_writer_is_never_replaced(tmp_path: Path) -> None:
    theirs = tmp_path / "twin.json"
    theirs.write_text('{"thesis": 1}')
    with pytest.raises(TwinError, match="not written by kvbench twin"):
        check_comparison_file(theirs)
    theirs.write_text('{"kvbench_twin": 1}')
    check_comparison_file(theirs)


def test_the_twin_never_writes_inside_the_live_run(tmp_path: Path) -> None:
    live_dir = tmp_path / "live"
    live_dir.mkdir()
    for out in (live_dir, live_dir / "twin", tmp_path):
        with pytest.raises(TwinError, match="overlaps the live run"):
            run_twin(live_dir, out)
    assert list(live_dir.iterdir()) == []
