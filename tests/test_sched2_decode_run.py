"""The decode run's compiled KV side against the plain per-sequence path.

``PagedKVManager.try_decode_run`` decides in one pass whether a batch may decode together
(no copy-on-write ahead) and ``PagedDecodeRun.advance`` takes a step in one compiled pass
(``native.decode_step``: the in-place claims, then the crossing sequences' fresh blocks).
Both are compared here with appending one slot per sequence in order (``append``), on
random managers with fork siblings, stale claims, cached blocks and every prefix index;
exact scenarios pin ``native.decode_step`` itself.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbench.engines.kv import native
from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.prefix_cache import BlockHashPrefixIndex, NullPrefixIndex
from kvbench.engines.kv.protocol import KVCapacityError
from kvbench.engines.kv.radix_cache import RadixPrefixIndex

BS = 4
INDEXES = {"hash": BlockHashPrefixIndex, "radix": RadixPrefixIndex, "none": NullPrefixIndex}


def _random_manager(index_name: str, seed: int, num_blocks: int = 96) -> tuple[PagedKVManager, list[int]]:
    """A manager in a random state reached through public calls only: prompts sharing
    prefixes (cache hits, registered blocks), forks whose siblings may share a partial
    block or leave stale claims behind when freed, and freed sequences' cached blocks.
    Returns it with its live sequence ids (in a random order)."""
    rng = random.Random(seed)
    m = PagedKVManager(num_blocks, BS, 8, INDEXES[index_name]())
    stems = [[rng.randrange(3, 50) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    live: list[int] = []
    next_id = 0
    for _ in range(rng.randrange(3, 9)):
        tokens = rng.choice(stems) + [rng.randrange(3, 50) for _ in range(rng.randrange(0, 7))]
        m.allocate(next_id, tokens, len(tokens) - m.num_cached_tokens(tokens, None), None)
        m.commit(next_id, tokens)
        live.append(next_id)
        next_id += 1
        action = rng.random()
        if action < 0.4:
            parent = rng.choice(live)
            m.fork(parent, next_id)
            live.append(next_id)
            next_id += 1
            if rng.random() < 0.5:
                m.append(rng.choice((parent, next_id - 1)), 1)  # one sibling writes ahead
        elif action < 0.55 and len(live) > 1:
            m.free(live.pop(rng.randrange(len(live))))  # may leave stale claims or cached blocks
    rng.shuffle(live)
    return m, live


def _appends_copy_nothing(m: PagedKVManager, seq_ids: list[int]) -> bool:
    """The plain answer to "may these decode together": appending one slot to each, in
    order, copies no block. Mutates ``m``."""
    for seq_id in seq_ids:
        if not m.has_seq(seq_id) or m.is_swapped(seq_id):
            return False
        if m.append(seq_id, 1).copies:
            return False
    return True


def _decodable(m: PagedKVManager, seq_ids: list[int]) -> list[int]:
    """The sequences, in order, left after dropping each one that would copy-on-write
    next to those kept. Pure."""
    batch: list[int] = []
    for seq_id in seq_ids:
        if m.can_decode_together(batch + [seq_id]):
            batch.append(seq_id)
    return batch


def _state(m: PagedKVManager, seq_ids: list[int]) -> tuple:
    return (
        [m.block_table(s) for s in seq_ids],
        [m.num_tokens(s) for s in seq_ids],
        m.usage(),
        m.pool.free_blocks(),
        m.num_evicted_blocks,
        m.num_cow_copies,
    )


@pytest.mark.parametrize("index_name", sorted(INDEXES))
@pytest.mark.parametrize("seed", range(40))
def test_try_decode_run_answers_as_appending_in_order(index_name, seed):
    m, live = _random_manager(index_name, seed)
    reference, _ = _random_manager(index_name, seed)
    run = m.try_decode_run(live)
    assert (run is not None) == m.can_decode_together(live) == _appends_copy_nothing(reference, live)
    assert m.try_decode_run(live + [10_000]) is None  # an unknown sequence
    m.check()  # asking changed nothing


def test_random_states_cover_both_answers():
    """The states above include batches that may decode together and ones that may not
    (a shared partial block, claims ahead in a cached or shared block)."""
    answers = {
        _random_manager(index_name, seed)[0].can_decode_together(_random_manager(index_name, seed)[1])
        for index_name in INDEXES
        for seed in range(40)
    }
    assert answers == {True, False}


@pytest.mark.parametrize("index_name", sorted(INDEXES))
@pytest.mark.parametrize("seed", range(25))
def test_advance_equals_appending_one_slot_per_sequence(index_name, seed):
    m, live = _random_manager(index_name, seed, num_blocks=40)
    stepped, _ = _random_manager(index_name, seed, num_blocks=40)
    live = _decodable(m, live)
    run = m.try_decode_run(live)
    assert run is not None
    for _ in range(3 * BS + 1):
        if run.num_new_blocks() > m.num_allocatable_blocks:
            before = _state(m, live)
            with pytest.raises(KVCapacityError):
                run.advance()
            assert _state(m, live) == before  # refused, changing nothing
            break
        for seq_id in live:
            stepped.append(seq_id, 1)
        run.advance()
        m.check()
        assert _state(m, live) == _state(stepped, live)


@pytest.mark.parametrize("seed", range(10))
def test_advance_after_advance_many_follows_the_new_last_blocks(seed):
    """advance_many moves sequences into fresh blocks; a following advance writes in place
    into those (the run keeps each sequence's last block current)."""
    m, live = _random_manager("hash", seed)
    stepped, _ = _random_manager("hash", seed)
    live = _decodable(m, live)
    run = m.try_decode_run(live)
    assert run is not None
    for num_steps in (BS + 1, 1, 2, BS - 1, 1):
        num_steps = run.num_quiet_steps(None, num_steps)
        run.advance_many(num_steps)
        for _ in range(num_steps):
            for seq_id in live:
                stepped.append(seq_id, 1)
        if run.num_new_blocks() > m.num_allocatable_blocks:
            break
        run.advance()
        for seq_id in live:
            stepped.append(seq_id, 1)
        m.check()
        assert _state(m, live) == _state(stepped, live)


@pytest.mark.parametrize("index_name", sorted(INDEXES))
@pytest.mark.parametrize("seed", range(25))
def test_a_carried_run_equals_a_fresh_one(index_name, seed):
    """``try_decode_run(ids, previous, rows)`` takes the rows it is told are unchanged from
    the last run; after steps with commits (a radix index may switch a full last block for
    its cached twin), a reordered batch, a sequence dropped and one new to the run, it is
    the run a fresh read builds."""
    rng = random.Random(seed)
    m, live = _random_manager(index_name, seed, num_blocks=64)
    live = _decodable(m, live)
    tokens = {seq_id: [rng.randrange(3, 9) for _ in range(m.num_tokens(seq_id))] for seq_id in live}
    run = m.try_decode_run(live)
    assert run is not None
    for _ in range(rng.randrange(1, 2 * BS + 2)):
        if not run.can_advance():
            break
        run.advance()
        for seq_id in live:
            tokens[seq_id].append(rng.randrange(3, 9))  # few distinct ids: twins get cached
        m.commit_many([(seq_id, tokens[seq_id], len(tokens[seq_id])) for seq_id in live])
    batch = live[:]
    rng.shuffle(batch)
    if len(batch) > 1:
        batch.pop()  # it left the batch (retired)
    newcomer = 500
    m.allocate(newcomer, [3, 4, 5], 3, None)  # joined the batch since
    batch.insert(rng.randrange(len(batch) + 1), newcomer)
    rows = np.array([live.index(seq_id) if seq_id in live else -1 for seq_id in batch], dtype=np.int64)
    carried = m.try_decode_run(batch, run, rows)
    fresh = m.try_decode_run(batch)
    assert (carried is None) == (fresh is None)
    if fresh is not None:
        assert carried.snapshot() == fresh.snapshot()
    m.check()  # asking changed nothing


def test_a_carried_run_must_come_from_the_same_manager():
    m, live = _random_manager("hash", 0)
    other, _ = _random_manager("hash", 0)
    live = _decodable(m, live)
    run = other.try_decode_run(_decodable(other, live))
    with pytest.raises(ValueError, match="previous is not a decode run of this manager"):
        m.try_decode_run(live, run, np.zeros(len(live), dtype=np.int64))


def _decode_step_on(
    pool: BlockPool, claimed: list[int], residues: list[int], lasts: list[int], num_steps: int
):
    """Run ``native.decode_step`` (block size 4) on a pool and fresh arrays; returns its
    answer, the claims, the table references, the last blocks and the scratch."""
    claimed_array = np.array(claimed, dtype=np.int64)
    seq_refs = np.zeros(len(claimed), dtype=np.int64)
    lasts_array = np.array(lasts, dtype=np.int64)
    scratch = np.full((3, len(residues)), -7, dtype=np.int64)
    answer = native.decode_step(
        pool.state,
        pool.counts,
        claimed_array,
        seq_refs,
        np.array(residues, dtype=np.int64),
        lasts_array,
        num_steps,
        BS,
        scratch,
    )
    return tuple(map(int, answer)), claimed_array.tolist(), seq_refs.tolist(), lasts_array.tolist(), scratch


def test_decode_step_claims_in_place_and_pops_fresh_blocks_for_the_crossing_rows():
    """Exact scenario: rows 0 and 2 write in place (row 2 over a stale claim past its slot:
    a negative change), rows 1 and 3 cross into fresh blocks taken from the free list's
    head in row order; the cached one among them is reported, its flag cleared."""
    pool = BlockPool(8)
    held = pool.allocate_array(3).tolist()  # [0, 1, 2]: the rows' partial last blocks
    pool.set_cached_many([3])  # the free list's head, cached
    head = pool.free_blocks()[:2]
    assert head == [3, 4]
    claimed = [0] * 8
    claimed[held[0]], claimed[held[1]] = 1, 4
    claimed[held[2]] = 4  # stale: a freed fork sibling wrote ahead
    # After 2 steps: row 0 holds 3 slots mod 4 (writes slot 3: claims 4, was 1), row 2
    # holds 1 (claims 2, was 4), rows 1 and 3 hold 0 (crossing).
    answer, claims, refs, lasts, scratch = _decode_step_on(
        pool, claimed, [1, 2, 3, 2], [held[0], held[1], held[2], -1], 2
    )
    assert answer == ((4 - 1) + (2 - 4), 2, 1)
    assert scratch[2, 0] == 3  # the cached block reused
    assert scratch[0, :2].tolist() == [1, 3] and scratch[1, :2].tolist() == head
    assert lasts == [held[0], head[0], held[2], head[1]]
    assert [claims[b] for b in head] == [1, 1] and [refs[b] for b in head] == [1, 1]
    assert claims[held[0]] == 4 and claims[held[2]] == 2
    assert all(pool.ref_count(b) == 1 and not pool.is_cached(b) for b in head)
    assert pool.num_free == 8 - 3 - 2
    pool.check()


def test_decode_step_takes_nothing_when_the_free_list_is_short_and_exactly_k_when_it_holds_k():
    for num_free in (1, 2):
        pool = BlockPool(3 + num_free)
        held = pool.allocate_array(3).tolist()
        free_before = pool.free_blocks()
        answer, claims, refs, lasts, scratch = _decode_step_on(pool, [1] * (3 + num_free), [0, 3, 0], held, 0)
        if num_free == 1:  # two crossing rows (0 and 2), one free block: nothing taken
            assert answer == (4 - 1, 2, -1)
            assert lasts == held and refs == [0] * 4 and pool.free_blocks() == free_before
        else:
            assert answer == (4 - 1, 2, 0)
            assert lasts == [free_before[0], held[1], free_before[1]] and pool.num_free == 0
        assert scratch[0, :2].tolist() == [0, 2]
        pool.check()


def test_decode_step_over_no_rows_changes_nothing():
    pool = BlockPool(4)
    answer, *_ = _decode_step_on(pool, [0] * 4, [], [], 5)
    assert answer == (0, 0, 0) and pool.num_free == 4
