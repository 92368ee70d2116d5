"""``engine.register_blocks``: when a prefill chunk's KV becomes visible to prefix matches.

``on_completion`` (the default) registers it when the step completes; ``on_schedule``
registers it when the chunk is scheduled, as vLLM's ``KVCacheManager.allocate_slots``
does (``cache_blocks`` up to the tokens scheduled), so a request admitted later in the
same scheduling pass hits blocks that are still being computed.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_driver import drive_engine
from shadow_executor import SPEC

from kvbench.engines.config import DEFAULTS
from kvbench.engines.paged import PagedEngine
from kvbench.engines.sim.executor import CostModelExecutor
from kvbench.model import LlamaModel
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import EngineContext, Request


def sim_engine(**params) -> PagedEngine:
    ctx = EngineContext(SPEC, HardwareSpec(), None, "cpu", "fp32", 0, "sim")
    block_size = params.get("block_size", 16)
    return PagedEngine(ctx, executor=CostModelExecutor.from_context(ctx, block_size=block_size), **params)


def shared_prefix_pair(prefix_len: int = 96) -> list[Request]:
    """Two requests arriving together whose prompts share ``prefix_len`` tokens."""
    rng = random.Random(0)
    prefix = tuple(rng.randrange(3, SPEC.vocab_size) for _ in range(prefix_len))
    return [
        Request(name, 0.0, prefix + tuple(rng.randrange(3, SPEC.vocab_size) for _ in range(20)), 8)
        for name in ("first", "second")
    ]


@pytest.mark.parametrize("prefix_cache", ["block_hash", "radix"])
@pytest.mark.parametrize(("register_blocks", "num_cached"), [("on_completion", 0), ("on_schedule", 96)])
def test_second_request_hits_the_prefix_being_computed_only_on_schedule(
    prefix_cache, register_blocks, num_cached
):
    # The twin's measured divergence from vLLM: both arrive together with a shared
    # 96-token prefix (6 blocks of 16). vLLM's second request hits all 96 tokens, which the
    # first computes in the same step; kvbench's default registers them only afterwards.
    engine = sim_engine(prefix_cache=prefix_cache, register_blocks=register_blocks, num_blocks=64)
    first, second = shared_prefix_pair()
    engine.add_request(first)
    engine.add_request(second)
    out = engine.step()
    assert out.first_scheduled == ("first", "second")  # one pass admits both
    assert out.stats.num_prefill_tokens == 2 * 116 - num_cached
    finished, rejected, _ = drive_engine(engine)  # invariants checked after every step
    assert not rejected
    assert finished["first"].num_cached_prompt_tokens == 0
    assert finished["second"].num_cached_prompt_tokens == num_cached
    assert engine.kv.usage().num_blocks_in_use == 0


def mixed_requests(vocab_size: int, seed: int) -> list[Request]:
    """Requests arriving together, some sharing a 40-token prefix, one with n=3 samples."""
    rng = random.Random(seed)

    def prompt(length: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab_size) for _ in range(length))

    system = prompt(40)
    requests = [
        Request(f"r{i}", 0.0, (system if shared else ()) + prompt(length), max_new)
        for i, (length, max_new, shared) in enumerate(
            [(5, 7, False), (33, 5, True), (17, 9, False), (50, 4, True), (1, 6, False), (21, 8, True)]
        )
    ]
    requests.append(Request("sampled", 0.0, system + prompt(9), 6, n=3, temperature=0.8))
    return requests


@pytest.mark.parametrize("prefix_cache", ["block_hash", "radix"])
def test_on_schedule_is_token_exact_in_real_mode(prefix_cache):
    # Real mode is exact: the executor writes every chunk's K/V of a layer before any
    # attention of that layer, so a request reading blocks another request writes in the
    # same step reads the right KV. Outputs equal on_completion's, which equal the dense
    # reference (tests/test_paged_engine.py); on_schedule hits more.
    spec = ModelSpec()
    torch.set_num_threads(1)
    model = LlamaModel.random(spec, seed=0)
    requests = mixed_requests(spec.vocab_size, seed=1)
    outputs, hits = {}, {}
    for register_blocks in ("on_completion", "on_schedule"):
        ctx = EngineContext(spec, HardwareSpec(), model, "cpu", "fp32", 0)
        engine = PagedEngine(
            ctx,
            block_size=8,
            num_blocks=64,
            prefix_cache=prefix_cache,
            decode_backend="torch",
            register_blocks=register_blocks,
        )
        finished, rejected, steps = drive_engine(engine, requests)
        assert not rejected
        outputs[register_blocks] = {rid: f.output_token_ids for rid, f in finished.items()}
        hits[register_blocks] = sum(step.stats.num_prefix_hit_tokens for step in steps)
    assert outputs["on_schedule"] == outputs["on_completion"]
    assert hits["on_completion"] == 0  # every request arrives in the first step
    assert hits["on_schedule"] >= 3 * 40  # three requests hit the shared 40-token prefix


@pytest.mark.parametrize("prefix_cache", ["block_hash", "radix"])
@pytest.mark.parametrize("max_num_batched_tokens", [24, 512])
def test_fast_forward_gives_the_same_steps_with_on_schedule(prefix_cache, max_num_batched_tokens):
    # The simulation fast path (decode runs) registers decode blocks on completion, like
    # stepping one by one; prefill chunks register at schedule in both. Same step figures.
    requests = mixed_requests(SPEC.vocab_size, seed=2) + [
        Request(f"late{i}", 0.0, tuple(range(3, 60)), 12, ignore_eos=True) for i in range(3)
    ]
    figures = {}
    for fast_forward in (True, False):
        engine = sim_engine(
            prefix_cache=prefix_cache,
            register_blocks="on_schedule",
            num_blocks=40,
            block_size=8,
            max_num_batched_tokens=max_num_batched_tokens,
            fast_forward=fast_forward,
        )
        finished, rejected, steps = drive_engine(engine, requests)
        assert not rejected
        figures[fast_forward] = (
            {rid: (f.num_cached_prompt_tokens, f.num_preemptions) for rid, f in finished.items()},
            sum(step.stats.num_prefix_hit_tokens for step in steps),
            sum(step.stats.num_prefill_tokens for step in steps),
        )
    assert figures[True] == figures[False]
    assert figures[True][1] > 0


@pytest.mark.parametrize("prefix_cache", ["block_hash", "radix"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_on_schedule_under_pressure_serves_every_request(prefix_cache, preemption):
    # A small pool and a small token budget: chunks registered at schedule, then preempted
    # groups, copies and swaps. Invariants hold after every step; nothing is rejected.
    engine = sim_engine(
        prefix_cache=prefix_cache,
        register_blocks="on_schedule",
        num_blocks=14,
        block_size=4,
        max_num_batched_tokens=16,
        preemption=preemption,
    )
    rng = random.Random(3)
    shared = tuple(rng.randrange(3, 60) for _ in range(13))
    requests = [
        Request(
            f"r{i}", 0.0, shared + tuple(rng.randrange(3, 60) for _ in range(i % 5)), 6 + i % 4, n=1 + i % 2
        )
        for i in range(8)
    ]
    finished, rejected, steps = drive_engine(engine, requests)
    assert not rejected and set(finished) == {r.request_id for r in requests}
    assert sum(step.stats.num_preemptions for step in steps) > 0
    assert sum(step.stats.num_prefix_hit_tokens for step in steps) > 0
    assert engine.kv.usage().num_blocks_in_use == 0


def test_register_blocks_default_and_check():
    assert DEFAULTS.register_blocks == "on_completion"  # every existing figure stays the same
    with pytest.raises(ValueError, match=r"engine\.register_blocks: must be one of"):
        sim_engine(register_blocks="eventually")
