"""Prefix index speed and hit rates: block-hash vs radix on the same inputs.

Run: pytest tests/benchmarks/bench_prefix_cache.py --benchmark-only -o python_files='bench_*.py' -s

- lookup: ``num_cached_tokens`` of a prompt whose prefix is cached; ns per prompt token at
  L and 16L tokens (flat = linear in prompt length).
- workload: one seeded shared-prefix / multi-turn workload driven through the paged manager
  under memory pressure; reports hit rate, evicted blocks and CPU seconds spent evicting
  (the hash index evicts lazily inside ``BlockPool.allocate``, the radix index in ``evict``).
Figures go to ``extra_info``; nothing asserts a time.
"""

from __future__ import annotations

import random
import time
import timeit
from collections.abc import Callable

import pytest

from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.prefix_cache import BlockHashPrefixIndex
from kvbench.engines.kv.radix_cache import RadixPrefixIndex

BLOCK_SIZE = 16
INDEXES: dict[str, Callable[[], object]] = {"hash": BlockHashPrefixIndex, "radix": RadixPrefixIndex}


# --------------------------------------------------------------------------- lookup
def _manager_with_cached(index_name: str, num_tokens: int) -> tuple[PagedKVManager, list[int]]:
    rng = random.Random(1)
    tokens = [rng.randrange(1, 32000) for _ in range(num_tokens)]
    m = PagedKVManager(num_tokens // BLOCK_SIZE + 8, BLOCK_SIZE, 1, INDEXES[index_name]())
    m.allocate(0, tokens, num_tokens, None)
    m.commit(0, tokens)
    m.free(0)
    return m, tokens + [7]


def _ns_per_token(index_name: str, num_tokens: int) -> float:
    m, query = _manager_with_cached(index_name, num_tokens)
    number = max(1, 40_000 // num_tokens)
    best = min(timeit.repeat(lambda: m.num_cached_tokens(query, None), number=number, repeat=5))
    return best / number / len(query) * 1e9


@pytest.mark.parametrize("index_name", sorted(INDEXES))
def test_prefix_lookup(benchmark, index_name):
    m, query = _manager_with_cached(index_name, 1024)
    cached = benchmark(m.num_cached_tokens, query, None)
    assert cached == 1024
    small = _ns_per_token(index_name, 512)
    large = _ns_per_token(index_name, 16 * 512)
    benchmark.extra_info["ns_per_token_512"] = small
    benchmark.extra_info["cost_ratio_16x"] = large / small
    print(
        f"\n[lookup {index_name}] {small:.1f} ns/token at 512 tokens; "
        f"per-token cost at 8192 / 512 tokens = {large / small:.2f}"
    )


# --------------------------------------------------------------------------- workload
def _requests(seed: int = 0, num_requests: int = 240) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs: 6 system prompts with skewed popularity, random user turns,
    and 40 % follow-up turns that extend an earlier conversation (prompt + output + turn)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 32000) for _ in range(rng.choice([100, 350, 1000]))] for _ in range(6)]
    done: list[list[int]] = []
    out = []
    for _ in range(num_requests):
        turn = [rng.randrange(1, 32000) for _ in range(rng.randint(10, 200))]
        if done and rng.random() < 0.4:
            prompt = rng.choice(done) + turn
        else:
            prompt = systems[min(int(rng.expovariate(0.8)), 5)] + turn
        output = [rng.randrange(1, 32000) for _ in range(rng.randint(8, 48))]
        done.append(prompt + output)
        out.append((prompt, output))
    return out


def _run_workload(index_name: str, requests, num_blocks: int = 600, max_running: int = 6) -> dict:
    index = INDEXES[index_name]()
    m = PagedKVManager(num_blocks, BLOCK_SIZE, 1, index)
    evict_s = 0.0

    def timed(fn):
        def wrapper(*args):
            nonlocal evict_s
            t0 = time.perf_counter()
            result = fn(*args)
            evict_s += time.perf_counter() - t0
            return result

        return wrapper

    listener = m.pool.reuse_listener
    if listener is not None:  # lazy evictions of the hash index
        m.pool.set_reuse_listener(None)
        m.pool.set_reuse_listener(timed(listener))
    index.evict = timed(index.evict)  # type: ignore[method-assign]

    pending = list(enumerate(requests))
    running: dict[int, list] = {}  # seq -> [tokens, remaining output]
    t0 = time.perf_counter()
    while pending or running:
        while pending and len(running) < max_running:
            seq, (prompt, output) = pending[0]
            cached = m.num_cached_tokens(prompt, None)
            if not m.can_allocate(seq, prompt, len(prompt) - cached, None):
                break
            pending.pop(0)
            m.allocate(seq, prompt, len(prompt) - cached, None)
            m.commit(seq, prompt)
            running[seq] = [list(prompt), list(output)]
        if not running:
            raise RuntimeError("a request does not fit in the pool")
        for seq in list(running):
            tokens, remaining = running[seq]
            if not remaining or not m.can_append(seq, 1):
                m.free(seq)  # finished (or out of memory: retire early, same for both indexes)
                del running[seq]
                continue
            m.append(seq, 1)
            tokens.append(remaining.pop(0))
            m.commit(seq, tokens)
    total_s = time.perf_counter() - t0
    m.check()
    return {
        "hit_rate": m.num_prefix_hit_tokens / m.num_prefix_query_tokens,
        "evicted_blocks": m.num_evicted_blocks,
        "evict_cpu_s": evict_s,
        "total_cpu_s": total_s,
    }


@pytest.mark.parametrize("index_name", sorted(INDEXES))
def test_shared_prefix_workload(benchmark, index_name):
    requests = _requests()
    result = benchmark.pedantic(_run_workload, args=(index_name, requests), rounds=3, iterations=1)
    benchmark.extra_info.update(result)
    per_block_us = result["evict_cpu_s"] / max(result["evicted_blocks"], 1) * 1e6
    print(
        f"\n[workload {index_name}] hit rate {result['hit_rate']:.3f}, "
        f"evicted {result['evicted_blocks']} blocks, eviction CPU {result['evict_cpu_s'] * 1e3:.2f} ms "
        f"({per_block_us:.2f} us/block), manager total {result['total_cpu_s'] * 1e3:.0f} ms"
    )
