"""Block pool speed: allocate+free pairs per second, and per-op cost at N vs 16N blocks.

Run: pytest tests/benchmarks/bench_block_pool.py --benchmark-enable -o python_files='bench_*.py' -s

Targets (issue 3): >= 1e6 allocate+free pairs/s; per-op cost flat when the pool grows 16x
(``cost_ratio_16x`` near 1). Never asserted as times.

Both sizes run the identical operation mix: the same number of pairs, the same batch
size, and a pool with the same fraction in use (half allocated, every other one of those
freed again: a quarter held, free and held ids interleaved like a pool in service). The
revive mix increfs and decrefs free blocks taken at the same relative positions of the
free list at both sizes (a prefix-cache hit on a block in the middle of the free list),
so every one of its operations is a revival at both sizes. Each round times the small and
the large pool once, interleaved (tests/benchmarks/rounds.py), on fresh pools, with
``time.process_time``; the 16x ratio is the median over rounds of the same-round ratio,
with its min and max.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from rounds import run_rounds

from kvbench.engines.kv.block_pool import BlockPool

SMALL = 4096
LARGE = 16 * SMALL
NUM_PAIRS = 200_000
BATCH = 64
NUM_REVIVE_TARGETS = 997  # a prime: consecutive pairs hit spread-out positions


def _single_pairs(pool: BlockPool) -> Callable[[], None]:
    allocate, decref = pool.allocate, pool.decref

    def work() -> None:
        for _ in range(NUM_PAIRS):
            decref(allocate())

    return work


def _batched_pairs(pool: BlockPool) -> Callable[[], None]:
    def work() -> None:
        for _ in range(NUM_PAIRS // BATCH):
            pool.free_many(pool.allocate_many(BATCH))

    return work


def _revive_pairs(pool: BlockPool) -> Callable[[], None]:
    free = pool.free_blocks()
    # The same relative positions at both sizes; a revived block goes back to the free
    # list's tail, so each target is free again when its next turn comes.
    targets = [free[(i * len(free)) // NUM_REVIVE_TARGETS] for i in range(NUM_REVIVE_TARGETS)]
    incref, decref = pool.incref, pool.decref

    def work() -> None:
        for i in range(NUM_PAIRS):
            b = targets[i % NUM_REVIVE_TARGETS]
            incref(b)
            decref(b)

    return work


def _pool_in_service(num_blocks: int) -> BlockPool:
    pool = BlockPool(num_blocks)
    held = pool.allocate_many(num_blocks // 2)
    pool.free_many(held[::2])  # a quarter held, interleaved with free ids
    return pool


WORKLOADS: dict[str, Callable[[BlockPool], Callable[[], None]]] = {
    "single": _single_pairs,
    "batched64": _batched_pairs,
    "revive": _revive_pairs,
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_block_pool_pairs(benchmark, name):
    workload = WORKLOADS[name]
    pools: dict[str, BlockPool] = {}

    def variant(num_blocks: int) -> Callable[[], Callable[[], None]]:
        def prepare() -> Callable[[], None]:
            pools[str(num_blocks)] = pool = _pool_in_service(num_blocks)
            return workload(pool)

        return prepare

    result = benchmark.pedantic(
        lambda: run_rounds({"small": variant(SMALL), "large": variant(LARGE)}), rounds=1, iterations=1
    )
    for pool in pools.values():
        pool.check()
        # The mix left the pool as it found it: a quarter held at both sizes.
        assert pool.num_free == pool.num_blocks - pool.num_blocks // 4, (name, pool.num_blocks, pool.num_free)
    pairs_per_s = result.rate("small", NUM_PAIRS)
    ratio = result.ratio("large", "small")
    benchmark.extra_info.update(result.info())
    benchmark.extra_info.update(pairs_per_s.as_info("pairs_per_s"))
    benchmark.extra_info.update(result.rate("large", NUM_PAIRS).as_info("pairs_per_s_16x"))
    benchmark.extra_info.update(ratio.as_info("cost_ratio_16x"))
    print(
        f"\n[block_pool {name}] pairs/s at {SMALL} blocks (min / median / max): {pairs_per_s.text(',.0f')}; "
        f"per-op cost at {LARGE} / {SMALL} blocks: {ratio.text('.2f')}\n  {result.context_line()}"
    )
