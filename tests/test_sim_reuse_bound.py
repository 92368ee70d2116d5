"""The first-admission prefix hit rate against the workload's own reuse upper bound.

Both figures share one definition (``kvbench.metrics.prefix_reused_tokens``: chained full
blocks, the last prompt token always computed), so a simulated paged engine that never
evicts and never runs two requests at once must hit exactly the bound, request by
request; with a pool too small to keep the history it can only hit less.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from kvbench.engines.paged import PagedEngine
from kvbench.engines.sim.executor import CostModelExecutor
from kvbench.metrics import prefix_reused_tokens, summarize_run
from kvbench.runner import SimClock, replay
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import EngineContext, Request, Workload
from kvbench.workloads.inspect import inspect_workload
from kvbench.workloads.prefixes import chat
from kvbench.workloads.replay import ReplayOptions
from kvbench.workloads.replay import replay as replay_trace
from kvbench.workloads.traces import parse_trace

SPEC = ModelSpec()  # tiny-gqa: 2048 positions, 4096-token vocabulary
BLOCK_SIZE = 16
# Simulated seconds between arrivals: each request finishes (a few simulated ms at this
# size) long before the next arrives, so no request can miss blocks still being computed.
GAP_S = 1000.0
MOONCAKE = Path(__file__).parent / "fixtures" / "traces" / "mooncake_conversation_head200.jsonl"


def spaced(workload: Workload) -> Workload:
    """The same requests in the same order, one every GAP_S seconds."""
    requests = tuple(dataclasses.replace(r, arrival_s=i * GAP_S) for i, r in enumerate(workload.requests))
    return dataclasses.replace(workload, requests=requests, max_concurrency=None)


def mooncake_slice() -> Workload:
    # 512-token hash blocks become 32 tokens (two engine blocks), prompts fit the tiny
    # model; the hash-id structure, hence the reuse, survives the scaling.
    options = ReplayOptions(
        length_scale=1 / 16,
        output_scale=1 / 16,
        max_prompt_tokens=1536,
        max_output_tokens=32,
        max_requests=120,
    )
    return replay_trace(parse_trace(MOONCAKE), options, vocab_size=SPEC.vocab_size, seed=0, name="mooncake")


def shared_prefix_chat() -> Workload:
    return chat(
        num_conversations=6,
        num_turns=3,
        system_prompt_len=100,  # not block aligned: the partial block is never a hit
        user_len={"kind": "uniform", "low": 5, "high": 40},
        output_len={"kind": "uniform", "low": 4, "high": 12},
        vocab_size=SPEC.vocab_size,
        seed=5,
    )


def simulate(workload: Workload, num_blocks: int) -> tuple[dict[str, float], object]:
    ctx = EngineContext(SPEC, HardwareSpec(), None, "cpu", "fp32", 0, "sim")
    engine = PagedEngine(
        ctx,
        executor=CostModelExecutor.from_context(ctx, block_size=BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_num_seqs=8,
        max_num_batched_tokens=512,
    )
    raw = replay(engine, workload, SimClock())
    meta = {"block_size": engine.describe()["block_size"]}
    summary = summarize_run(raw.requests, raw.steps, meta, workload_requests=workload.requests)
    return summary.metrics, raw


def repeats() -> Workload:
    """Edge cases of the definition: block-aligned prompts wholly seen before (their last
    block holds the last prompt token, so it is never a hit), exact repeats, a salted copy."""
    base = tuple(range(7, 7 + 80))  # 5 blocks
    prompts = [
        (base, None),
        (base[:64], None),  # 4 blocks seen; 3 reusable (48 tokens), not 4
        (base, None),  # 64 of 80
        (base + (3, 1, 4), None),  # 80 of 83
        (base[:32] + (9,) * 40, None),  # 32
        (base, "tenant-b"),  # another salt: nothing
        (base + (5,), "tenant-b"),  # 80
    ]
    return Workload(
        "repeats",
        tuple(
            Request(f"q{i}", float(i), ids, max_new_tokens=3, cache_salt=salt)
            for i, (ids, salt) in enumerate(prompts)
        ),
    )


WORKLOADS = {"mooncake": mooncake_slice, "chat": shared_prefix_chat, "repeats": repeats}
EXPECTED_REUSED = {"repeats": [0, 48, 64, 80, 32, 0, 80]}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_unbounded_pool_without_overlap_hits_exactly_the_bound(name: str) -> None:
    workload = spaced(WORKLOADS[name]())
    m, raw = simulate(workload, num_blocks=1 << 16)  # far more than every block of the run
    assert m["num_completed"] == len(workload.requests)
    assert m["num_evicted_blocks"] == 0 and m["num_preemptions"] == 0
    bound = m["prefix_reuse_upper_bound"]
    # The workload really shares prefixes (the trace's head: thousands of tokens, mostly
    # between turns of one conversation), so the equality says something.
    assert bound > {"mooncake": 0.03, "chat": 0.2, "repeats": 0.5}[name]
    assert m["prefix_hit_rate_first_admission"] == bound
    # Request by request, not only in sum.
    reused = prefix_reused_tokens(
        (r.prompt_token_ids for r in workload.requests), BLOCK_SIZE, (r.cache_salt for r in workload.requests)
    )
    cached = raw.requests.set_index("request_id")["num_cached_tokens"]
    assert [int(cached[r.request_id]) for r in workload.requests] == reused.tolist()
    if name in EXPECTED_REUSED:
        assert reused.tolist() == EXPECTED_REUSED[name]
    # The same bound as ``kvbench trace inspect`` reports for the replayed workload.
    assert inspect_workload(workload, BLOCK_SIZE)["prefix_reuse_upper_bound"] == pytest.approx(bound, abs=0)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_small_pool_hits_at_most_the_bound(name: str) -> None:
    workload = spaced(WORKLOADS[name]())
    # Room for the largest request and a little history, not for the whole history.
    largest = max(r.num_prompt_tokens + r.max_new_tokens for r in workload.requests)
    m, _ = simulate(workload, num_blocks=math.ceil(largest / BLOCK_SIZE) + 4)
    assert m["num_evicted_blocks"] > 0
    hit, bound = m["prefix_hit_rate_first_admission"], m["prefix_reuse_upper_bound"]
    assert hit <= bound
    if name == "chat":
        # Six conversations take turns: the shared system prompt and each history are
        # evicted before the next turn comes. (The Mooncake head reuses mostly the
        # previous request's prefix, which the small pool still holds.)
        assert hit < bound


def test_overlapping_arrivals_hit_at_most_the_bound() -> None:
    # The trace's own arrival times with a mid-size pool: requests run concurrently, some
    # are admitted in the same step as the request that would have supplied their prefix.
    workload = mooncake_slice()
    m, _ = simulate(dataclasses.replace(workload, max_concurrency=None), num_blocks=400)
    assert m["num_completed"] == len(workload.requests)
    assert 0 < m["prefix_hit_rate_first_admission"] <= m["prefix_reuse_upper_bound"]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_bound_is_the_same_whatever_the_batching(name: str, monkeypatch) -> None:
    # Prompts are hashed in batches (global indices inside each); any cut gives the same keys.
    import kvbench.metrics

    requests = WORKLOADS[name]().requests
    prompts = [r.prompt_token_ids for r in requests]
    salts = [r.cache_salt for r in requests]
    whole = prefix_reused_tokens(prompts, BLOCK_SIZE, salts)
    for batch_tokens in (1, 40, 333):
        monkeypatch.setattr(kvbench.metrics, "_BOUND_BATCH_TOKENS", batch_tokens)
        assert prefix_reused_tokens(prompts, BLOCK_SIZE, salts).tolist() == whole.tolist()
    if name == "repeats":
        assert whole.tolist() == EXPECTED_REUSED["repeats"]
