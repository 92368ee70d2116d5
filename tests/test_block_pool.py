"""BlockPool: LRU free list, reference counts, cached blocks, soft references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbench.engines.kv import native
from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.native import PREV


def test_fresh_pool_hands_out_ids_in_order_and_all_are_usable():
    pool = BlockPool(4)
    assert pool.free_blocks() == [0, 1, 2, 3]
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]  # block 0 is not reserved
    assert pool.num_free == 0
    with pytest.raises(MemoryError, match="no free block"):
        pool.allocate()
    pool.check()


def test_freed_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.allocate_many(4)
    for b in (2, 0, 3):
        pool.decref(blocks[b])
    assert pool.free_blocks() == [2, 0, 3]
    assert pool.allocate() == 2
    pool.check()


def test_incref_revives_a_block_from_the_middle_of_the_free_list():
    pool = BlockPool(5)
    pool.allocate_many(5)
    pool.free_many([0, 1, 2, 3, 4])
    pool.set_cached_many([2])
    assert pool.num_cached_free == 1
    pool.incref(2)
    assert pool.free_blocks() == [0, 1, 3, 4]
    assert pool.ref_count(2) == 1 and pool.num_cached_free == 0
    pool.check()


def test_reusing_a_cached_block_clears_it_and_calls_the_listener():
    pool = BlockPool(2)
    reused = []
    pool.set_reuse_listener(reused.extend)
    a, b = pool.allocate_many(2)
    pool.set_cached_many([a])
    pool.free_many([a, b])
    assert pool.num_cached_free == 1
    assert pool.allocate() == a
    assert reused == [a] and not pool.is_cached(a) and pool.num_cached_free == 0
    assert pool.allocate() == b
    assert reused == [a]
    with pytest.raises(ValueError, match="already set"):
        pool.set_reuse_listener(print)
    pool.check()


def test_soft_references_make_a_block_reclaimable_only_when_all_are_soft():
    pool = BlockPool(3)
    b = pool.allocate()
    pool.incref(b)  # two holders
    pool.soften(b)
    assert pool.num_reclaimable == 0
    pool.decref(b)  # the hard holder leaves
    assert pool.num_reclaimable == 1
    pool.incref(b)  # a new hard holder pins it
    assert pool.num_reclaimable == 0
    pool.decref(b)
    pool.harden(b)
    assert pool.num_reclaimable == 0
    assert pool.decref(b) is True and pool.num_free == 3
    pool.check()


def test_misuse_raises_naming_the_block():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 1 has no hard reference"):
        pool.decref(1)
    b = pool.allocate()
    pool.soften(b)
    with pytest.raises(ValueError, match=f"block {b} has no hard reference"):
        pool.decref(b)
    with pytest.raises(ValueError, match="no hard reference to soften"):
        pool.soften(b)
    with pytest.raises(MemoryError, match="3 blocks requested, 1 free"):
        pool.allocate_many(3)
    assert pool.num_free == 1  # allocate_many allocated nothing
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(-1)


def test_bulk_calls_stopped_midway_leave_a_consistent_pool():
    # Bulk calls keep their counters in locals; a bad id must not strand them.
    pool = BlockPool(4)
    with pytest.raises(IndexError):
        pool.incref_many([0, 99])  # block 0 is revived before the bad id
    pool.check()
    assert pool.num_free == 3 and pool.ref_count(0) == 1
    blocks = pool.allocate_many(2)
    with pytest.raises(ValueError, match="block 3 has no hard reference"):
        pool.free_many([blocks[0], 3])  # block 3 is free already
    pool.check()
    assert pool.num_free == 2 and pool.free_blocks()[-1] == blocks[0]


def test_ref_version_moves_only_when_a_reference_changes():
    # A prefix index keeps a match's count of unreferenced blocks while the version holds.
    pool = BlockPool(3)
    blocks = pool.allocate_many(2)  # allocations leave it (their blocks are returned)
    version = pool.ref_version
    pool.incref_many([])
    pool.free_many([])
    with pytest.raises(IndexError):
        pool.incref_many([99])
    with pytest.raises(ValueError, match="block 2 has no hard reference"):
        pool.free_many([2])
    with pytest.raises(ValueError, match="block 2 has no hard reference"):
        pool.decref(2)
    assert pool.ref_version == version
    pool.incref(blocks[0])
    assert pool.ref_version == version + 1
    with pytest.raises(IndexError):
        pool.incref_many([blocks[1], 99])  # blocks[1] took its reference first
    assert pool.ref_version == version + 2 and pool.ref_count(blocks[1]) == 2
    pool.free_many([blocks[0], blocks[1]])
    pool.decref(blocks[0])
    assert pool.ref_version == version + 4
    pool.check()


def test_check_detects_a_corrupted_free_list():
    pool = BlockPool(3)
    pool.state[PREV, 1] = 2  # break the back pointer of block 1 (the state is writable on purpose)
    with pytest.raises(AssertionError, match="prev pointer of block 1"):
        pool.check()


def test_empty_pool():
    pool = BlockPool(0)
    pool.check()
    assert pool.free_blocks() == [] and pool.num_free == 0


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / incref / decref / soften / harden / cache sequences against a model."""

    NUM_BLOCKS = 6

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.reused: list[int] = []
        self.pool.set_reuse_listener(self.reused.extend)
        self.hard = [0] * self.NUM_BLOCKS
        self.soft = [0] * self.NUM_BLOCKS
        self.cached = [False] * self.NUM_BLOCKS
        self.free_order = list(range(self.NUM_BLOCKS))  # model LRU list

    def _held(self) -> list[int]:
        return [b for b in range(self.NUM_BLOCKS) if self.hard[b] + self.soft[b] > 0]

    @precondition(lambda self: self.free_order)
    @rule()
    def allocate(self):
        b = self.pool.allocate()
        assert b == self.free_order.pop(0)
        if self.cached[b]:
            assert self.reused[-1] == b
            self.cached[b] = False
        self.hard[b] = 1

    @rule(data=st.data())
    def allocate_many(self, data):
        # The batched pop must hand out exactly what repeated single pops would.
        n = data.draw(st.integers(0, len(self.free_order)))
        num_reused = len(self.reused)
        blocks = self.pool.allocate_many(n)
        assert blocks == self.free_order[:n]
        del self.free_order[:n]
        assert self.reused[num_reused:] == [b for b in blocks if self.cached[b]]
        for b in blocks:
            self.cached[b] = False
            self.hard[b] = 1

    @precondition(lambda self: any(self.hard))
    @rule(data=st.data())
    def free_many(self, data):
        held = [b for b in range(self.NUM_BLOCKS) for _ in range(self.hard[b])]
        picked = data.draw(st.lists(st.sampled_from(held), max_size=len(held)))
        counts = {b: picked.count(b) for b in picked}
        if any(counts[b] > self.hard[b] for b in counts):
            return  # more decrefs than hard references: the misuse test covers that
        num_freed = self.pool.free_many(picked)
        expect = 0
        for b in picked:
            self.hard[b] -= 1
            if self.hard[b] + self.soft[b] == 0:
                self.free_order.append(b)
                expect += 1
        assert num_freed == expect

    @rule(data=st.data())
    def set_cached_many(self, data):
        blocks = data.draw(st.lists(st.integers(0, self.NUM_BLOCKS - 1), max_size=self.NUM_BLOCKS))
        self.pool.set_cached_many(blocks)
        for b in blocks:
            self.cached[b] = True

    @rule(data=st.data())
    def incref(self, data):
        b = data.draw(st.integers(0, self.NUM_BLOCKS - 1))
        if self.hard[b] + self.soft[b] == 0:
            self.free_order.remove(b)
        self.pool.incref(b)
        self.hard[b] += 1

    @precondition(lambda self: any(self.hard))
    @rule(data=st.data())
    def decref(self, data):
        b = data.draw(st.sampled_from([b for b in range(self.NUM_BLOCKS) if self.hard[b]]))
        self.hard[b] -= 1
        freed = self.pool.decref(b)
        assert freed == (self.hard[b] + self.soft[b] == 0)
        if freed:
            self.free_order.append(b)

    @precondition(lambda self: any(self.hard))
    @rule(data=st.data())
    def soften(self, data):
        b = data.draw(st.sampled_from([b for b in range(self.NUM_BLOCKS) if self.hard[b]]))
        self.pool.soften(b)
        self.hard[b] -= 1
        self.soft[b] += 1

    @precondition(lambda self: any(self.soft))
    @rule(data=st.data())
    def harden(self, data):
        b = data.draw(st.sampled_from([b for b in range(self.NUM_BLOCKS) if self.soft[b]]))
        self.pool.harden(b)
        self.soft[b] -= 1
        self.hard[b] += 1

    @rule(data=st.data())
    def set_cached(self, data):
        # A flag is only ever set (registration); the pool clears it when it reuses a block.
        b = data.draw(st.integers(0, self.NUM_BLOCKS - 1))
        self.pool.set_cached_many([b])
        self.cached[b] = True

    @invariant()
    def matches_model(self):
        self.pool.check()
        assert self.pool.free_blocks() == self.free_order
        held = self._held()
        assert self.pool.num_free == self.NUM_BLOCKS - len(held)
        assert self.pool.num_reclaimable == sum(1 for b in held if self.hard[b] == 0)
        assert self.pool.num_cached_free == sum(1 for b in self.free_order if self.cached[b])

    def teardown(self):
        # Release every reference: nothing may leak.
        for b in range(self.NUM_BLOCKS):
            for _ in range(self.soft[b]):
                self.pool.harden(b)
            for _ in range(self.hard[b] + self.soft[b]):
                self.pool.decref(b)
        self.pool.check()
        assert self.pool.num_free == self.NUM_BLOCKS


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_the_compiled_step_allocations_refuse_buffers_that_do_not_fit_changing_nothing():
    """The compiled loops write their output arrays unchecked: a caller's buffer shorter
    (or longer) than the blocks asked for is refused before any block moves."""
    pool = BlockPool(8)
    needs = np.array([2, 1], dtype=np.int64)
    before = (pool.state.copy(), pool.counts.copy())
    for num_blocks, num_steps in ((2, 2), (4, 2), (3, 1)):
        out, reused, per_step = native.step_buffers(num_blocks, num_steps)
        with pytest.raises(ValueError, match="do not fit needs"):
            native.allocate_steps_into(pool.state, pool.counts, needs, out, reused, per_step)
    with pytest.raises(ValueError, match="reused is shorter"):
        native.allocate_into(pool.state, pool.counts, np.empty(3, np.int64), np.empty(2, np.int64))
    assert np.array_equal(pool.state, before[0]) and np.array_equal(pool.counts, before[1])
    out, reused, per_step = native.step_buffers(3, 2)
    assert native.allocate_steps_into(pool.state, pool.counts, needs, out, reused, per_step) == 0
    assert out.tolist() == [0, 1, 2] and per_step.tolist() == [0, 0] and pool.num_free == 5
