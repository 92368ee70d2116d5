"""RadixPrefixIndex through the paged manager: splits, partial-block sharing, locks, LRU eviction."""

from __future__ import annotations

import pytest

from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.protocol import KVOps
from kvbench.engines.kv.radix_cache import RadixPrefixIndex

BS = 4


def make(num_blocks=16) -> tuple[PagedKVManager, RadixPrefixIndex]:
    index = RadixPrefixIndex()
    return PagedKVManager(num_blocks, BS, 1, index), index


def run_prompt(m: PagedKVManager, seq: int, tokens: list[int]) -> tuple[int, KVOps]:
    cached = m.num_cached_tokens(tokens, None)
    result = m.allocate(seq, tokens, len(tokens) - cached, None)
    m.commit(seq, tokens)
    m.check()
    return result


def test_match_mid_block_splits_the_node_and_copies_the_shared_block_on_write():
    m, index = make()
    a = list(range(1, 11))  # 10 tokens: blocks 0 1 2, block 2 partial
    run_prompt(m, 0, a)
    assert index.edges() == [(0, tuple(a), (0, 1, 2), 1)]
    m.append(0, 1)  # seq 0 decodes into slot 2 of block 2
    b = [1, 2, 3, 4, 5, 6, 20, 21]
    assert m.num_cached_tokens(b, None) == 6  # not block aligned
    # Seq 1 shares block 1 up to position 5; position 6 is claimed by seq 0, so it copies.
    assert run_prompt(m, 1, b) == (6, KVOps(copies=((1, 3),)))
    assert m.block_table(1) == [0, 3]
    assert index.edges() == [
        (0, (1, 2, 3, 4, 5, 6), (0, 1), 2),  # split at the match end; block 1 on both sides
        (6, (7, 8, 9, 10), (1, 2), 1),
        (6, (20, 21), (3,), 1),  # seq 1's own copy of block 1 holds positions 4..7
    ]
    assert m.pool.ref_count(1) == 3  # upper node, lower node, seq 0
    # A third prompt through seq 1's branch uses block 3 for positions 4..7.
    assert run_prompt(m, 2, [1, 2, 3, 4, 5, 6, 20, 21, 30]) == (8, KVOps())
    assert m.block_table(2) == [0, 3, 4]


def test_match_mid_block_writes_in_place_when_nobody_wrote_past_the_match():
    m, index = make()
    run_prompt(m, 0, [1, 2, 3, 4, 5, 6])
    m.free(0)
    # Nobody claimed slot 2 of block 1: seq 1 writes its position 6 there without a copy.
    assert run_prompt(m, 1, [1, 2, 3, 4, 5, 6, 7]) == (6, KVOps())
    assert m.block_table(1) == [0, 1]
    # Seq 2 diverges at position 6 after seq 1 wrote it: now a copy is needed.
    assert run_prompt(m, 2, [1, 2, 3, 4, 5, 6, 9]) == (6, KVOps(copies=((1, 2),)))


def test_decode_commits_extend_the_sequence_leaf_in_place():
    m, index = make()
    tokens = [1, 2, 3, 4, 5]
    run_prompt(m, 0, tokens)
    for t in (6, 7, 8, 9):
        m.append(0, 1)
        tokens.append(t)
        m.commit(0, tokens)
        m.check()
    assert index.edges() == [(0, (1, 2, 3, 4, 5, 6, 7, 8, 9), (0, 1, 2), 1)]
    assert index.num_nodes == 1


def test_unlocked_leaves_are_evicted_in_lru_order_and_parents_follow():
    m, index = make()
    stem = [1, 2, 3, 4]
    run_prompt(m, 0, stem + [10] * 4)  # blocks 0 1
    run_prompt(m, 1, stem + [11] * 4)  # shares 0, owns 2
    run_prompt(m, 2, stem + [12] * 4)  # shares 0, owns 3
    for seq in (2, 0, 1):  # release order does not matter, last access does
        m.free(seq)
    m.check()
    assert index.leaves_in_eviction_order() == [(4, (10,) * 4), (4, (11,) * 4), (4, (12,) * 4)]
    # Touch the oldest branch again: it becomes most recently used.
    run_prompt(m, 3, stem + [10] * 4 + [99])  # block 4 for position 8
    m.free(3)
    m.check()
    assert index.leaves_in_eviction_order() == [(4, (11,) * 4), (4, (12,) * 4), (8, (99,))]
    assert m.pool.num_reclaimable == 5
    freed_order = []
    for _ in range(5):
        assert index.evict(1) == 1
        freed_order.append(m.pool.free_blocks()[-1])
        m.check()
    # 11-branch, 12-branch, the 99 leaf, then its parent (now a leaf), then the stem.
    assert freed_order == [2, 3, 4, 1, 0]
    assert index.num_nodes == 0 and index.num_evicted_blocks == 5
    assert index.evict(1) == 0


def test_locked_nodes_are_never_evicted():
    m, index = make(num_blocks=4)
    run_prompt(m, 0, [1, 2, 3, 4, 5, 6, 7, 8])  # blocks 0 1, locked by seq 0
    run_prompt(m, 1, [9, 9, 9, 9])  # block 2
    m.free(1)
    assert m.pool.num_reclaimable == 1
    assert m.usage().num_blocks_cached_free == 1
    assert index.evict(4) == 1  # only seq 1's released leaf
    assert m.pool.ref_count(0) == 2 and m.pool.ref_count(1) == 2
    m.check()


def test_allocation_evicts_lru_leaves_when_the_free_list_is_short():
    m, index = make(num_blocks=3)
    run_prompt(m, 0, [1, 1, 1, 1])
    run_prompt(m, 1, [2, 2, 2, 2])
    m.free(0)
    m.free(1)
    assert m.pool.num_free == 1 and m.num_allocatable_blocks == 3
    assert m.can_allocate(2, [3] * 12, 12, None)
    run_prompt(m, 2, [3] * 12)
    assert m.block_table(2) == [2, 0, 1]  # the free block, then seq 0's leaf (older), then seq 1's
    assert m.num_evicted_blocks == 2


def test_capacity_check_counts_blocks_pinned_by_the_match():
    m, index = make(num_blocks=3)
    run_prompt(m, 0, [1, 1, 1, 1, 1, 1, 1, 1])  # blocks 0 1
    m.free(0)
    assert m.num_allocatable_blocks == 3
    # Matching pins both cached blocks, so only one block is left for new tokens.
    prompt = [1] * 8 + [2] * 5
    assert m.num_cached_tokens(prompt, None) == 8
    assert m.can_allocate(1, prompt, 4, None)
    assert not m.can_allocate(1, prompt, 5, None)
    m.allocate(1, prompt, 4, None)
    m.check()


def test_fork_locks_the_same_node_and_extra_keys_use_separate_trees():
    m, index = make()
    run_prompt(m, 0, [1, 2, 3, 4, 5])
    m.fork(0, 1)
    assert index.edges()[0][3] == 2
    m.free(0)
    assert index.edges()[0][3] == 1
    m.check()
    cached = m.num_cached_tokens([1, 2, 3, 4, 5, 6], "tenant-b")
    assert cached == 0
    m.allocate(2, [1, 2, 3, 4, 5, 6], 6, "tenant-b")
    m.commit(2, [1, 2, 3, 4, 5, 6])
    assert m.num_cached_tokens([1, 2, 3, 4, 5, 6, 7], "tenant-b") == 6
    assert len(index.edges("tenant-b")) == 1
    m.check()


def test_acquire_rejects_a_stale_match():
    m, index = make()
    run_prompt(m, 0, [1, 1, 1, 1, 2])
    m.free(0)
    match = index.match([1, 1, 1, 1, 2, 3], None)
    index.evict(8)
    with pytest.raises(ValueError, match="stale match"):
        index.acquire(5, match)


def test_check_detects_a_wrong_lock_count():
    m, index = make()
    run_prompt(m, 0, [1, 2, 3])
    next(index._iter_nodes()).lock_count = 2
    with pytest.raises(AssertionError, match="lock_count=2, live sequences below: 1"):
        index.check()
