"""Simulation outcomes pinned to the token: a change to the simulation core (block pool,
prefix indexes, scheduler, fast-forwarding) must leave every request's cached tokens,
preemptions, recomputed tokens and timestamps, and every step's batch and pool
accounting, exactly as they were.

Each scenario is a real ``kvbench run`` in simulation mode (the README's setups: Llama-3-70B
FP8 on H100/H200 with chat, RAG, best-of-8 and the Mooncake trace; block-hash and radix
prefix caches, recompute and swap preemption, slab). Its fingerprint is a digest of those
columns plus a few readable totals; ``tests/fixtures/sim_golden.json`` holds the values
the code produced before the native core (regenerate with ``KVBENCH_REGEN_GOLDEN=1`` only
for a change that is meant to alter outcomes, and say why in the commit).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from run_fixtures import run_kvbench

GOLDEN = Path(__file__).parent / "fixtures" / "sim_golden.json"

SIM = (
    "run.mode=sim",
    "model=llama-3-70b",
    "model.dtype=fp8",
    "run.dtype=fp8",
    "run.kv_dtype=bf16",
    "run.warmup=false",
    "engine.kv_memory_bytes=null",
    "engine.max_num_seqs=256",
    "engine.max_num_batched_tokens=8192",
)
MOONCAKE = (
    "model.max_position_embeddings=131072",
    "workload.length_scale=1",
    "workload.output_scale=1",
    "workload.max_prompt_tokens=null",
    "workload.max_output_tokens=null",
)
SCENARIOS: dict[str, tuple[str, ...]] = {
    "mooncake_h200": (
        *MOONCAKE,
        "hardware=h200-141gb",
        "workload=mooncake_conversation",
        "workload.max_requests=400",
    ),
    "mooncake_h100_radix": (
        *MOONCAKE,
        "hardware=h100-80gb",
        "engine=paged_radix",
        "workload=mooncake_conversation",
        "workload.max_requests=150",
    ),
    "chat_h100": ("hardware=h100-80gb", "workload=chat_large", "workload.num_conversations=80"),
    "chat_h100_swap": (
        "hardware=h100-80gb",
        "engine=paged_swap",
        "workload=chat_large",
        "workload.num_conversations=60",
    ),
    "rag_h100_radix": (
        "hardware=h100-80gb",
        "engine=paged_radix",
        "workload=rag_large",
        "workload.num_requests=200",
    ),
    "best_of_8_h100": (
        "hardware=h100-80gb",
        "workload=best_of_n",
        "workload.num_requests=24",
        "workload.n=8",
    ),
    "sharegpt_like_h100_noprefix": (
        "hardware=h100-80gb",
        "engine=paged_noprefix",
        "workload=random",
        "workload.num_requests=300",
        "workload.prompt_len.high=2048",
        "workload.output_len.high=1024",
        "workload.arrival.rate_per_s=50",
    ),
    "mooncake_h200_slab": (
        *MOONCAKE,
        "hardware=h200-141gb",
        "engine=slab_request",
        "workload=mooncake_conversation",
        "workload.max_requests=150",
    ),
}
REQUEST_COLUMNS = [
    "request_id",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "num_output_tokens",
    "num_cached_tokens",
    "num_preemptions",
    "num_recomputed_tokens",
    "peak_kv_slots",
    "peak_kv_slots_unshared",
    "rejected_reason",
]
STEP_COLUMNS = [
    "start_s",
    "num_running",
    "num_waiting",
    "num_scheduled_tokens",
    "num_prefill_tokens",
    "kv_num_blocks_in_use",
    "kv_num_blocks_cached_free",
    "num_swapped",
    "num_preemptions",
    "num_prefix_query_tokens",
    "num_prefix_hit_tokens",
    "num_evicted_blocks",
]


def _digest(frame: pd.DataFrame) -> str:
    """sha256 of the frame's values; floats to 12 significant digits (a sum's last bit may
    move with evaluation order; any real change moves far more)."""
    h = hashlib.sha256()
    for name in frame.columns:
        values = frame[name].to_numpy()
        if values.dtype.kind == "f":
            text = np.array2string(values, precision=12, floatmode="maxprec", threshold=1 << 62)
        else:
            text = "\x1f".join(map(str, values.tolist()))
        h.update(name.encode() + b"\x1e" + text.encode() + b"\x1d")
    return h.hexdigest()


def fingerprint(run_dir: Path) -> dict[str, object]:
    requests = pd.read_parquet(run_dir / "requests.parquet")
    steps = pd.read_parquet(run_dir / "steps.parquet")
    return {
        "num_steps": len(steps),
        "num_cached_tokens": int(requests["num_cached_tokens"].sum()),
        "num_preemptions": int(requests["num_preemptions"].sum()),
        "num_rejected": int((requests["rejected_reason"] != "").sum()),
        "requests_sha256": _digest(requests[REQUEST_COLUMNS]),
        "steps_sha256": _digest(steps[STEP_COLUMNS]),
    }


def _run(name: str, tmp_path: Path) -> dict[str, object]:
    out = run_kvbench(
        "run", *SIM, *SCENARIOS[name], f"run.results_dir={tmp_path}", f"run.run_id={name}", cwd=tmp_path
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    (run_dir,) = glob.glob(str(tmp_path / "*" / name))
    return fingerprint(Path(run_dir))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_simulation_outcomes_are_unchanged(name: str, tmp_path: Path) -> None:
    got = _run(name, tmp_path)
    if os.environ.get("KVBENCH_REGEN_GOLDEN") == "1":
        table = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        table[name] = got
        GOLDEN.write_text(json.dumps(dict(sorted(table.items())), indent=2) + "\n")
        return
    want = json.loads(GOLDEN.read_text())[name]
    assert got == want, f"{name}: simulation outcomes changed\n got: {got}\nwant: {want}"
