"""Block pool speed: allocate+free pairs per second, and per-op cost at N vs 16N blocks.

Run: pytest tests/benchmarks/bench_block_pool.py --benchmark-enable -o python_files='bench_*.py' -s
Targets (issue 3): >= 1e6 allocate+free pairs/s; per-op cost flat when the pool grows 16x.
Ratios are measured within one run (min of repeats) and stored in ``extra_info``; nothing
here asserts a time.
"""

from __future__ import annotations

import timeit

import pytest

from kvbench.engines.kv.block_pool import BlockPool

SMALL = 4096
LARGE = 16 * SMALL
PAIRS = 20_000


def _single_pairs(pool: BlockPool, num_pairs: int = PAIRS) -> None:
    allocate, decref = pool.allocate, pool.decref
    for _ in range(num_pairs):
        decref(allocate())


def _batched_pairs(pool: BlockPool, batch: int = 64, num_pairs: int = PAIRS) -> None:
    for _ in range(num_pairs // batch):
        pool.free_many(pool.allocate_many(batch))


def _revive_pairs(pool: BlockPool, num_pairs: int = PAIRS) -> None:
    # incref of a block in the middle of the free list (a prefix-cache hit) and back.
    incref, decref = pool.incref, pool.decref
    step = pool.num_blocks // 3 or 1
    b = 0
    for _ in range(num_pairs):
        b = (b + step) % pool.num_blocks
        incref(b)
        decref(b)


def _pool_with_half_in_use(num_blocks: int) -> BlockPool:
    pool = BlockPool(num_blocks)
    held = pool.allocate_many(num_blocks // 2)
    pool.free_many(held[::2])  # interleave free and used ids, like a pool in service
    return pool


def _seconds_per_pair(workload, num_blocks: int) -> float:
    pool = _pool_with_half_in_use(num_blocks)
    return min(timeit.repeat(lambda: workload(pool), number=1, repeat=7)) / PAIRS


WORKLOADS = {"single": _single_pairs, "batched64": _batched_pairs, "revive": _revive_pairs}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_block_pool_pairs(benchmark, name):
    workload = WORKLOADS[name]
    pool = _pool_with_half_in_use(SMALL)
    benchmark.pedantic(workload, args=(pool,), rounds=20, iterations=1, warmup_rounds=2)
    small = _seconds_per_pair(workload, SMALL)
    large = _seconds_per_pair(workload, LARGE)
    benchmark.extra_info["pairs_per_s"] = 1.0 / small
    benchmark.extra_info["cost_ratio_16x"] = large / small
    print(
        f"\n[block_pool {name}] {1.0 / small:,.0f} pairs/s at {SMALL} blocks; "
        f"per-op cost at {LARGE} / {SMALL} blocks = {large / small:.2f}"
    )
    pool.check()
