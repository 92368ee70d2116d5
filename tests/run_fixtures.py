"""Raw run records for the metrics, results, report and compare tests (no conftest magic).

``exact_run()`` is a hand-built run whose every metric is worked out in test_metrics.py.
``synthetic_run()`` makes a consistent, seeded run of any engine/block size so that sweeps
of several runs can be written with ``write_sweep()``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench import metrics, results


def run_kvbench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m kvbench ARGS`` in ``cwd`` (a fresh process, as a user runs it), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def sweep_experiment(experiment: str, *overrides: str, cwd: Path) -> Path:
    """``kvbench sweep +experiment=EXPERIMENT OVERRIDES`` without a report; fails the test
    (showing the output) unless every run succeeded. Returns the sweep's results folder."""
    out = run_kvbench("sweep", f"+experiment={experiment}", "run.report=false", *overrides, cwd=cwd)
    assert out.returncode == 0, (out.stdout, out.stderr)
    return cwd / "results" / experiment


KV_BYTES_PER_TOKEN = 1024  # tiny model: 2 * 4 layers * 2 kv heads * 32 dim * fp32


def base_meta(run_id: str, engine: str, block_size: int | None, **overrides: Any) -> dict[str, Any]:
    """A complete meta dict as the runner writes it."""
    meta: dict[str, Any] = {
        "run_id": run_id,
        "sweep_name": "fixture",
        "mode": "sim",
        "engine": engine,
        "engine_params": {"block_size": block_size, "num_blocks": 64},
        "model": {"name": "tiny-gqa", "num_layers": 4, "num_kv_heads": 2, "head_dim": 32, "dtype": "fp32"},
        "hardware": {"name": "cpu", "hbm_bandwidth_gbps": 20.0, "memory_bytes": 16 * 1024**3},
        "workload": "synthetic",
        "workload_counters": {"num_prompts_truncated": 0},
        "seed": 0,
        "duration_s": 1.0,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "kv_pool_bytes": 64 * 16 * KV_BYTES_PER_TOKEN,
        "block_size": block_size,
        "weight_bytes": 2_000_000,
        "slo": {},
        "environment": {
            "python": "3.11",
            "torch": "2.4",
            "device_name": "cpu",
            "threads": 1,
            "git_revision": "abc",
        },
        "missing": {"nvml_used_bytes": "no NVIDIA driver (NVMLError_LibraryNotFound)"},
        "status": "ok",
        "error": "",
        "config_hash": f"hash-{run_id}",
    }
    meta.update(overrides)
    return meta


def exact_run() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Four requests (one rejected) and four steps with hand-picked numbers.

    r0: arrival 0.0, tokens at 0.1 0.2 0.3 0.5 -> TTFT 100 ms, E2EL 500 ms, TPOT 133.3 ms
    r1: arrival 0.2, tokens at 0.4 0.6 (n=2, 4 generated) -> TTFT 200, E2EL 400, TPOT 200
    r2: arrival 0.3, one token at 0.45 -> TTFT 150, E2EL 150, no TPOT
    r3: rejected
    """
    nan = math.nan
    requests = pd.DataFrame(
        {
            "request_id": ["r0", "r1", "r2", "r3"],
            "arrival_s": [0.0, 0.2, 0.3, 0.4],
            "first_scheduled_s": [0.0, 0.3, 0.35, nan],
            "first_token_s": [0.1, 0.4, 0.45, nan],
            "finish_s": [0.5, 0.6, 0.45, nan],
            "token_times_s": [[0.1, 0.2, 0.3, 0.5], [0.4, 0.6], [0.45], []],
            "num_prompt_tokens": [10, 20, 5, 5000],
            "num_output_tokens": [4, 2, 1, 0],
            "num_generated_tokens": [4, 4, 1, 0],
            "num_samples": [1, 2, 1, 1],
            "num_cached_tokens": [0, 8, 0, 0],
            "num_preemptions": [0, 1, 0, 0],
            "num_recomputed_tokens": [0, 6, 0, 0],
            "peak_kv_slots": [14, 24, 6, 0],
            "peak_kv_slots_unshared": [14, 44, 6, 0],
            "rejected_reason": ["", "", "", "prompt longer than the KV pool"],
            "tag_kind": ["chat", "chat", "rag", "rag"],
        }
    )
    steps = pd.DataFrame(
        {
            "step": [0, 1, 2, 3],
            "start_s": [0.0, 0.1, 0.3, 0.4],
            "end_s": [0.1, 0.3, 0.4, 0.6],
            "duration_s": [0.1, 0.2, 0.1, 0.2],
            "num_running": [1, 1, 3, 2],
            "num_waiting": [1, 1, 0, 0],
            "num_scheduled_tokens": [10, 1, 27, 2],
            "num_prefill_tokens": [10, 0, 25, 0],
            "num_decode_tokens": [0, 1, 2, 2],
            "num_swapped": [0, 0, 0, 0],
            "num_preemptions": [0, 1, 0, 0],
            "num_recomputed_tokens": [0, 6, 0, 0],
            "num_prefix_query_tokens": [10, 0, 25, 0],
            "num_prefix_hit_tokens": [0, 0, 8, 0],
            "num_evicted_blocks": [0, 0, 1, 0],
            "num_evicted_tokens": [0, 0, 0, 0],
            "bytes_to_host": [0, 4096, 0, 0],
            "bytes_from_host": [0, 0, 2048, 0],
            "modeled_transfer_s": [0.0, 0.0, 0.0, 0.0],
            "kv_capacity_bytes": [10_000] * 4,
            "kv_allocated_bytes": [2000, 1000, 5000, 4000],
            "kv_token_bytes": [1000, 500, 3000, 3000],
            "kv_reserved_unused_bytes": [600, 300, 1000, 500],
            "kv_internal_frag_bytes": [400, 200, 1000, 500],
            "kv_external_frag_bytes": [0, 0, 1000, 0],
            "kv_cached_bytes": [0, 0, 0, 0],
            "kv_host_bytes": [0, 4096, 2048, 2048],
            "kv_num_blocks_total": [10] * 4,
            "kv_num_blocks_in_use": [2, 1, 5, 4],
            "kv_num_blocks_cached_free": [0] * 4,
            "kv_num_blocks_free": [8, 9, 5, 6],
        }
    )
    memory = pd.DataFrame(
        {
            "t_s": [0.0, 0.3, 0.6],
            "rss_bytes": [1.0e8, 1.5e8, 1.2e8],
            "nvml_used_bytes": [nan, nan, nan],
            "nvml_process_bytes": [nan, nan, nan],
            "torch_allocated_bytes": [nan, nan, nan],
            "torch_reserved_bytes": [nan, nan, nan],
        }
    )
    meta = base_meta("exact", "paged", 16, slo={"ttft_ms": 160.0, "tpot_ms": 150.0})
    return requests, steps, memory, meta


def synthetic_run(
    run_id: str,
    engine: str = "paged",
    block_size: int | None = 16,
    *,
    seed: int = 0,
    tpot_s: float = 0.02,
    num_requests: int = 12,
    prefix_hit_fraction: float = 0.0,
    num_samples: int = 1,
    quality: float | None = None,
    sweep_name: str = "fixture",
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """A seeded, self-consistent run: requests decode at ``tpot_s`` per token, one step per tpot.

    ``engine="slab"`` reserves each request's whole max length up front (reserved-unused
    waste plus some external fragmentation); other engines round up to ``block_size``.
    """
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.03, num_requests))
    arrivals -= arrivals[0]
    prompt = rng.integers(16, 64, num_requests)
    output = rng.integers(3, 12, num_requests)
    start = arrivals + rng.uniform(0.0, 0.01, num_requests)
    first_token = start + 0.005 + prompt * 2e-4
    token_times = [list(first_token[i] + tpot_s * np.arange(output[i])) for i in range(num_requests)]
    finish = np.array([t[-1] for t in token_times])
    cached = np.floor(prompt * prefix_hit_fraction).astype(int)
    slots = prompt + output
    requests = pd.DataFrame(
        {
            "request_id": [f"{run_id}-r{i}" for i in range(num_requests)],
            "arrival_s": arrivals,
            "first_scheduled_s": start,
            "first_token_s": first_token,
            "finish_s": finish,
            "token_times_s": token_times,
            "num_prompt_tokens": prompt,
            "num_output_tokens": output,
            "num_generated_tokens": output * num_samples,
            "num_samples": np.full(num_requests, num_samples),
            "num_cached_tokens": cached,
            "num_preemptions": np.zeros(num_requests, dtype=int),
            "num_recomputed_tokens": np.zeros(num_requests, dtype=int),
            "peak_kv_slots": prompt + output * num_samples,
            "peak_kv_slots_unshared": slots * num_samples,
            "rejected_reason": [""] * num_requests,
        }
    )
    block = block_size or 1
    capacity = 64 * 16 * KV_BYTES_PER_TOKEN
    rows = []
    edges = np.arange(0.0, finish.max() + tpot_s, tpot_s)
    for step, (t0, t1) in enumerate(zip(edges[:-1], edges[1:])):
        live = (start < t1) & (finish >= t0)
        new = (start >= t0) & (start < t1)
        done_tokens = np.array([sum(1 for x in times if x < t1) for times in token_times])
        tokens = np.where(live, prompt + done_tokens, 0)
        if engine == "slab":
            allocated = np.where(live, slots + 8, 0)
            reserved = np.where(live, slots - tokens, 0)
            internal = np.where(live, 8, 0)
            external = int(live.sum()) * 5 * KV_BYTES_PER_TOKEN
        else:
            allocated = np.where(live, np.ceil(tokens / block) * block, 0)
            reserved = np.zeros(num_requests)
            internal = allocated - tokens
            external = 0
        prefill = int(prompt[new].sum())
        rows.append(
            {
                "step": step,
                "start_s": t0,
                "end_s": t1,
                "duration_s": t1 - t0,
                "num_running": int(live.sum()),
                "num_waiting": int(((arrivals < t1) & (start >= t1)).sum()),
                "num_scheduled_tokens": prefill + int(live.sum()),
                "num_prefill_tokens": prefill,
                "num_decode_tokens": int((live & ~new).sum()),
                "num_swapped": 0,
                "num_preemptions": 0,
                "num_recomputed_tokens": 0,
                "num_prefix_query_tokens": prefill,
                "num_prefix_hit_tokens": int(cached[new].sum()),
                "num_evicted_blocks": 0,
                "num_evicted_tokens": 0,
                "bytes_to_host": 0,
                "bytes_from_host": 0,
                "modeled_transfer_s": 0.0,
                "kv_capacity_bytes": capacity,
                "kv_allocated_bytes": int(allocated.sum()) * KV_BYTES_PER_TOKEN,
                "kv_token_bytes": int(tokens.sum()) * KV_BYTES_PER_TOKEN,
                "kv_reserved_unused_bytes": int(reserved.sum()) * KV_BYTES_PER_TOKEN,
                "kv_internal_frag_bytes": int(internal.sum()) * KV_BYTES_PER_TOKEN,
                "kv_external_frag_bytes": external,
                "kv_cached_bytes": 0,
                "kv_host_bytes": 0,
                "kv_num_blocks_total": 64,
                "kv_num_blocks_in_use": int(allocated.sum() // block),
                "kv_num_blocks_cached_free": 0,
                "kv_num_blocks_free": 64 - int(allocated.sum() // block),
            }
        )
    steps = pd.DataFrame(rows)
    memory = pd.DataFrame(
        {
            "t_s": edges[:5],
            "rss_bytes": 1e8 + rng.uniform(0, 1e7, 5),
            "nvml_used_bytes": [math.nan] * 5,
            "nvml_process_bytes": [math.nan] * 5,
            "torch_allocated_bytes": [math.nan] * 5,
            "torch_reserved_bytes": [math.nan] * 5,
        }
    )
    meta = base_meta(run_id, engine, block_size, seed=seed, sweep_name=sweep_name)
    if quality is not None:
        meta["quality"] = quality
    return requests, steps, memory, meta


def config_yaml(meta: dict[str, Any]) -> str:
    return (
        f"engine:\n  name: {meta['engine']}\n  block_size: {meta['block_size']}\n"
        f"model: {meta['model']['name']}\nworkload: {meta['workload']}\nseed: {meta['seed']}\n"
    )


def write_synthetic(run_dir: Path, *args: Any, **kwargs: Any) -> Path:
    """Build a synthetic run, summarise it and write it; ``quality`` lands in the summary."""
    requests, steps, memory, meta = synthetic_run(*args, **kwargs)
    quality = meta.pop("quality", None)
    summary = metrics.summarize_run(requests, steps, meta, memory)
    values = dict(summary.metrics)
    if quality is not None:
        values["quality_passkey_accuracy"] = quality
    return results.write_run(
        run_dir, requests, steps, memory, meta, config_yaml(meta), values, summary.missing
    )


def write_sweep(
    root: Path, sweep_name: str = "fixture", *, tpot_s: float = 0.02, failed: bool = True
) -> Path:
    """A sweep of paged (block 8/16/32) and slab runs, plus a failed run when ``failed``."""
    sweep_dir = root / sweep_name
    variants = [("paged", 8), ("paged", 16), ("paged", 32), ("slab", None)]
    for i, (engine, block_size) in enumerate(variants):
        write_synthetic(
            sweep_dir / f"run{i}",
            f"run{i}",
            engine,
            block_size,
            seed=i,
            tpot_s=tpot_s,
            prefix_hit_fraction=0.25 * i,
            num_samples=1 + i % 2,
            quality=1.0 - 0.1 * i,
            sweep_name=sweep_name,
        )
    if failed:
        meta = base_meta("run_failed", "h2o", 16, sweep_name=sweep_name)
        results.write_failed_run(
            sweep_dir / "run_failed", meta, "RuntimeError: out of KV blocks", "engine: h2o\n"
        )
    return sweep_dir
