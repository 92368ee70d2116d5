"""The simulated deployment and traffic the simulation benchmarks share.

Llama-3-70B shapes with FP8 weights and bf16 KV on one H200, the KV pool sized the way
vLLM sizes it (``size_pool``), 256 sequences and 8,192 batched tokens per step: the
README's Mooncake command. ShareGPT-like traffic: log-normal prompts around 250 and
outputs around 200 tokens, Poisson arrivals at 20/s; ``random_requests`` draws every
prompt independently, so no two share a prefix.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import OmegaConf

from kvbench.engines.config import EngineConfig, size_pool
from kvbench.engines.paged import PagedEngine
from kvbench.engines.slab import SlabEngine
from kvbench.runner import RawRun, SimClock, replay
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import Engine, EngineContext, Workload
from kvbench.workloads.synthetic import random_requests
from kvbench.workloads.traces import load_trace

CONF = Path(__file__).resolve().parents[2] / "conf"
ENGINES: dict[str, type[PagedEngine] | type[SlabEngine]] = {"paged": PagedEngine, "slab": SlabEngine}
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192


def llama3_70b_fp8_on_h200(max_positions: int = 8192) -> EngineContext:
    """Simulation context; ``max_positions=131072`` is Llama-3.1-70B's 128K context, which
    serves every Mooncake prompt uncut."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "llama-3-70b.yaml"))
    spec = dataclasses.replace(ModelSpec(**raw), dtype="fp8", max_position_embeddings=max_positions)
    hw = HardwareSpec(**OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / "h200-141gb.yaml")))
    return EngineContext(spec, hw, None, "cpu", "bf16", 0, "sim")


def sim_engine(ctx: EngineContext, engine: str = "paged", **params: object) -> PagedEngine | SlabEngine:
    """A fresh simulation engine (``ENGINES[engine]``) with the pool sized like vLLM's;
    ``params`` go to the engine (e.g. ``prefix_cache``, ``reserve``)."""
    num_blocks, executor = size_pool(ctx, EngineConfig(kv_memory_bytes=None), None, log=None)
    return ENGINES[engine](
        ctx,
        num_blocks=num_blocks,
        executor=executor,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        **params,
    )


def sharegpt_like(num_requests: int, vocab_size: int, seed: int = 0) -> Workload:
    return random_requests(
        num_requests,
        {"kind": "lognormal", "mean": 250, "sigma": 0.8, "max_len": 2048},
        {"kind": "lognormal", "mean": 200, "sigma": 0.8, "max_len": 1024},
        {"kind": "poisson", "rate_per_s": 20.0},
        vocab_size=vocab_size,
        seed=seed,
    )


def benchmark_workload(workload: str, num_requests: int) -> tuple[EngineContext, Workload]:
    """The context and workload the replay tools measure (``instructions.py``,
    ``step_costs.py``): ``sharegpt`` (``sharegpt_like`` at 8K context) or ``mooncake``
    (the first ``num_requests`` of the Mooncake conversation trace at 128K, every prompt
    uncut). ValueError for another name."""
    if workload == "sharegpt":
        ctx = llama3_70b_fp8_on_h200()
        return ctx, sharegpt_like(num_requests, ctx.spec.vocab_size, seed=0)
    if workload == "mooncake":
        ctx = llama3_70b_fp8_on_h200(max_positions=131072)
        trace = load_trace(
            "mooncake_conversation", vocab_size=ctx.spec.vocab_size, seed=0, max_requests=num_requests
        )
        return ctx, trace
    raise ValueError(f"workload: 'sharegpt' or 'mooncake', got {workload!r}")


def replay_all_answered(engine: Engine, workload: Workload) -> RawRun:
    """``replay`` on the simulated clock, keeping no token ids as ``kvbench run`` does;
    fails when a request went unanswered (neither finished nor rejected), which would make
    any per-request rate meaningless."""
    raw = replay(engine, workload, SimClock(), keep_outputs=False)
    done = raw.requests["finish_s"].notna() | (raw.requests["rejected_reason"] != "")
    assert len(raw.requests) == len(workload.requests) and done.all(), (
        f"{type(engine).__name__}: {int((~done).sum())} of {len(workload.requests)} requests unanswered"
    )
    return raw
