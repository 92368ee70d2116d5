"""Prefix indexes: the protocol, the null index and the block-hash index (and hit rates vs radix)."""

from __future__ import annotations

import copy as copy_module
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.engines.kv import native
from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.prefix_cache import (
    NO_MATCH,
    BlockHashPrefixIndex,
    NullPrefixIndex,
    PrefixIndex,
    PrefixMatch,
)
from kvbench.engines.kv.radix_cache import RadixPrefixIndex
from kvbench.engines.kv.token_ids import (
    ArrayTokenIds,
    BlockKeyChain,
    KeyedTokenIds,
    TokenPrefix,
    TokenSpan,
    id_list,
)

BS = 4


def bound(index, num_blocks=8):
    pool = BlockPool(num_blocks)
    index.bind(pool, BS)
    return pool, index


@pytest.mark.parametrize("cls", [NullPrefixIndex, BlockHashPrefixIndex, RadixPrefixIndex])
def test_every_index_implements_the_protocol(cls):
    assert isinstance(cls(), PrefixIndex)


def test_null_index_never_matches_and_keeps_nothing():
    m = PagedKVManager(4, BS, 1, NullPrefixIndex())
    tokens = list(range(9))
    m.allocate(0, tokens, 9, None)
    m.commit(0, tokens)
    m.free(0)
    assert m.num_cached_tokens(tokens, None) == 0
    assert m.usage().num_blocks_cached_free == 0 and m.pool.num_cached_free == 0
    assert m.prefix_index.evict(4) == 0
    m.check()


def test_hash_index_matches_hold_their_blocks_as_the_memos_array():
    """A block-hash match keeps its blocks as the index's int64 array (a long match is never
    turned into Python ints on the hot path); every reading agrees with the tuple form,
    and a match compares equal to one holding the same blocks as a tuple."""
    pool, index = bound(BlockHashPrefixIndex())
    blocks = pool.allocate_many(3)
    index.acquire(0, NO_MATCH)
    tokens = KeyedTokenIds([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    index.commit(0, tokens, blocks, None)
    match = index.match(tokens, None)
    assert isinstance(match.blocks, np.ndarray) and match.blocks.dtype == np.int64
    assert match.block_id_array() is match.blocks  # the index's own: no copy
    assert (match.num_blocks, match.block_ids, int(match.blocks[-1])) == (2, (0, 1), 1)
    assert match == PrefixMatch(8, (0, 1), 0, handle=tokens.key_chain)
    assert match != PrefixMatch(8, (0, 2), 0, handle=tokens.key_chain)
    as_tuple = PrefixMatch(8, (0, 1))
    assert as_tuple.num_blocks == 2 and as_tuple.block_id_array().tolist() == [0, 1]
    # The memo's answer holds the same array, cut when a block is reused.
    assert index.match(tokens, None).blocks is match.blocks
    index.release(0)
    pool.free_many(blocks)
    pool.allocate_many(pool.num_free)  # every cached block reused: its registration dropped
    assert index.match(tokens, None).num_blocks == 0
    index.check()


def test_hash_index_registers_only_full_blocks_and_chains_them():
    pool, index = bound(BlockHashPrefixIndex())
    blocks = pool.allocate_many(3)
    index.acquire(0, NO_MATCH)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    index.commit(0, tokens, blocks, None)
    assert index.num_cached_blocks == 2
    assert [pool.is_cached(b) for b in blocks] == [True, True, False]
    match = index.match(tokens, None)
    assert (match.num_tokens, match.block_ids, match.num_blocks_taken) == (8, (0, 1), 0)
    # The second block's tokens behind a different first block do not match (chained key).
    assert index.match([9, 9, 9, 9, 5, 6, 7, 8, 1], None) == NO_MATCH
    # Only the first block matches when the query diverges inside the second.
    assert index.match([1, 2, 3, 4, 5, 6, 0, 8, 1], None).num_tokens == 4
    index.check()


def test_hash_index_match_counts_revived_blocks_and_is_pure():
    pool, index = bound(BlockHashPrefixIndex())
    blocks = pool.allocate_many(2)
    index.acquire(0, NO_MATCH)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    index.commit(0, tokens, blocks, None)
    index.release(0)
    pool.free_many(reversed(blocks))
    before = pool.free_blocks()
    match = index.match(tokens, None)
    assert match.num_blocks_taken == 2
    assert pool.free_blocks() == before  # no LRU change
    index.check()


def test_hash_index_keeps_the_first_block_for_a_duplicate_key():
    pool, index = bound(BlockHashPrefixIndex())
    first, second = pool.allocate(), pool.allocate()
    index.acquire(0, NO_MATCH)
    index.acquire(1, NO_MATCH)
    index.commit(0, [1, 2, 3, 4], [first], None)
    index.commit(1, [1, 2, 3, 4], [second], None)
    assert index.match([1, 2, 3, 4, 5], None).block_ids == (first,)
    assert not pool.is_cached(second)
    index.check()


def test_register_run_keeps_the_first_block_for_a_key_repeated_in_one_call():
    # A chain's keys never repeat within one sequence, but the compiled registration
    # promises "first registration wins" within one call as across calls: it flags each
    # block cached as it registers it, so the second block meets a live entry.
    pool = BlockPool(4)
    keys = np.zeros(64, dtype=np.uint64)
    vals = np.full(64, native.EMPTY, dtype=np.int32)
    used = np.zeros(1, dtype=np.int64)
    block_hash = np.zeros(4, dtype=np.uint64)
    block_check = np.zeros(4, dtype=np.uint64)
    blocks = np.array(pool.allocate_many(3), dtype=np.int64)
    lanes = np.array([7, 7, 9], dtype=np.uint64)
    args = (keys, vals, used, pool.state, pool.counts, block_hash, block_check)
    assert native.register_run(*args, lanes, lanes, blocks, 0) == 2
    assert native.lookup(keys, vals, np.uint64(7)) == blocks[0]
    assert native.lookup(keys, vals, np.uint64(9)) == blocks[2]
    assert [pool.is_cached(int(b)) for b in blocks] == [True, False, True]
    assert int(used[0]) == 2


def test_hash_index_forgets_a_block_when_the_pool_reuses_it():
    pool, index = bound(BlockHashPrefixIndex(), num_blocks=1)
    b = pool.allocate()
    index.acquire(0, NO_MATCH)
    index.commit(0, [1, 2, 3, 4], [b], None)
    index.release(0)
    pool.decref(b)
    assert index.match([1, 2, 3, 4, 5], None).num_tokens == 4
    assert pool.allocate() == b  # reuse evicts the entry
    assert index.match([1, 2, 3, 4, 5], None) == NO_MATCH
    assert index.num_evicted_blocks == 1 and index.num_cached_blocks == 0
    index.check()
    # The dead entry (still in the hash map) does not stop the key registering again.
    index.acquire(1, NO_MATCH)
    index.commit(1, [1, 2, 3, 4], [b], None)
    assert index.match([1, 2, 3, 4, 5], None).block_ids == (b,) and index.num_cached_blocks == 1
    index.check()


def test_hash_index_misuse():
    index = BlockHashPrefixIndex()
    with pytest.raises(ValueError, match="not bound"):
        index.match([1, 2], None)
    pool, index = bound(index)
    with pytest.raises(KeyError, match="unknown seq 3"):
        index.commit(3, [1], [0], None)
    index.acquire(0, NO_MATCH)
    with pytest.raises(ValueError, match="commits 8 tokens but its block table has only 1 blocks"):
        index.commit(0, list(range(8)), [0], None)
    with pytest.raises(ValueError, match="already tracked"):
        index.fork(0, 0)
    # A match whose chain is keyed short of its blocks: refused, nothing tracked.
    short = PrefixMatch(2 * BS, (0, 1), 0, handle=BlockKeyChain(BS, None))
    with pytest.raises(IndexError):
        index.acquire(1, short)
    with pytest.raises(KeyError, match="unknown seq 1"):
        index.registration(1)
    index.check()


def test_hash_index_check_detects_a_stale_cached_flag():
    pool, index = bound(BlockHashPrefixIndex())
    pool.set_cached_many([3])
    with pytest.raises(AssertionError, match="block 3: flagged cached but its key has no hash table entry"):
        index.check()


def test_hash_index_leaves_dead_entries_and_purges_them():
    """A reused block's registration dies with its cached flag (no per-block work on
    reuse); its hash map entry stays until dead entries outnumber the pool, and never
    matches or blocks a later registration of the same key."""
    pool, index = bound(BlockHashPrefixIndex(), num_blocks=2)
    seq_id = 0
    for round_ in range(1100):  # 1,100 distinct prompts through a 2-block pool
        tokens = [round_, round_ + 1, round_ + 2, round_ + 3]
        match = index.match(tokens + [0], None)
        assert match == NO_MATCH
        blocks = pool.allocate_many(1)
        index.acquire(seq_id, match)
        index.commit(seq_id, tokens, blocks, None)
        index.release(seq_id)
        pool.free_many(blocks)
        seq_id += 1
        index.check()  # bounds the hash map: 9 entries per block + 1,024
        assert index.num_cached_blocks == 2 if round_ else 1
    assert index.match([1099, 1100, 1101, 1102, 0], None).num_tokens == 4  # still cached
    # Block of prompt 0 was reused long ago: its dead entry is gone or inert, and the
    # same key registers again.
    assert index.match([0, 1, 2, 3, 0], None) == NO_MATCH
    blocks = pool.allocate_many(1)
    index.acquire(seq_id, NO_MATCH)
    index.commit(seq_id, [0, 1, 2, 3], blocks, None)
    assert index.match([0, 1, 2, 3, 0], None).block_ids == tuple(blocks)
    index.check()


token_lists = st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=14), min_size=1, max_size=6)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=150, deadline=None)
@given(committed=token_lists, query=st.lists(st.integers(1, 3), min_size=1, max_size=14))
def test_hit_counts_equal_the_longest_cached_prefix(committed, query):
    """Without eviction, radix hits the longest common prefix with any committed sequence
    (capped at len - 1) and the hash index the same rounded down to whole blocks."""
    hits = {}
    for name, cls in (("hash", BlockHashPrefixIndex), ("radix", RadixPrefixIndex)):
        m = PagedKVManager(64, BS, 1, cls())
        for seq, tokens in enumerate(committed):
            cached = m.num_cached_tokens(tokens, None)
            m.allocate(seq, tokens, len(tokens) - cached, None)
            m.commit(seq, tokens)
        for seq in range(len(committed)):
            m.free(seq)
        m.check()
        hits[name] = m.num_cached_tokens(query, None)
    best = min(len(query) - 1, max(_lcp(query, t) for t in committed))
    assert hits["radix"] == best
    assert hits["hash"] == best // BS * BS


def test_keyed_token_ids_hash_each_block_once_and_forks_keep_the_keys(monkeypatch):
    m = PagedKVManager(16, BS, 1, BlockHashPrefixIndex())
    tokens = KeyedTokenIds(range(10, 23))  # 13 tokens: 3 full blocks
    hashed = []  # blocks each extend call hashed
    extend = BlockKeyChain.extend

    def counting_extend(self, t, n):
        before = len(self.hashes)
        extend(self, t, n)
        hashed.append(len(self.hashes) - before)

    monkeypatch.setattr(BlockKeyChain, "extend", counting_extend)
    for _ in range(3):  # a waiting sequence re-matched every step: keys computed once
        assert m.num_cached_tokens(tokens, None) == 0
    assert sum(hashed) == 3  # the three full blocks, hashed by the first match only
    m.allocate(0, tokens, 13, None)
    m.commit(0, tokens)
    assert sum(hashed) == 3  # commit continues the same chain: nothing rehashed
    assert len(tokens.key_chain.hashes) == 3 and m.prefix_index.num_cached_blocks == 3
    chain = tokens.key_chain
    child = tokens.copy()
    assert (
        child == tokens
        and child.key_chain is not chain
        and child.key_chain.hashes.tolist() == chain.hashes.tolist()
    )
    # A second sequence with the same prompt (a plain list) attaches the three blocks.
    assert m.num_cached_tokens(list(tokens) + [99], None) == 12
    # Same chain, different salt: a new chain (salted keys never match unsalted blocks).
    assert m.num_cached_tokens(tokens + [99], "salt") == 0
    assert tokens.chain(BS, "salt") is not chain
    m.check()


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**17), min_size=0, max_size=16 * 24),
    cuts=st.lists(st.integers(0, 24), max_size=4),
    salt=st.sampled_from([None, "tenant-a"]),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_block_keys_are_the_same_however_the_chain_grows(tokens, cuts, salt, block_size):
    """Keys computed in one numpy call, block by block in Python, or in any mix of the
    two (a prompt's array, then decode blocks from a list) are the same values, and they
    equal the prefix-reuse bound's (``kvbench.hashing.prompt_block_keys``, the one definition)."""
    from kvbench.hashing import prompt_block_keys

    num_full = len(tokens) // block_size
    whole = BlockKeyChain(block_size, salt)
    whole.extend(np.asarray(tokens, dtype=np.int64), num_full)
    stepped = BlockKeyChain(block_size, salt)
    for n in range(num_full + 1):
        stepped.extend(tokens, n)  # one block at a time: the scalar path
    keyed = ArrayTokenIds(np.asarray(tokens[: block_size * (num_full // 2)], dtype=np.int64))
    keyed.extend(tokens[len(keyed) :])  # the array covers the first half only
    mixed = keyed.chain(block_size, salt)
    for n in sorted(min(c, num_full) for c in cuts) + [num_full]:
        mixed.extend(keyed, n)

    def lanes(chain: BlockKeyChain) -> tuple[list[int], list[int]]:
        return chain.hashes.tolist(), chain.checks.tolist()

    assert lanes(whole) == lanes(stepped) == lanes(mixed)
    assert len(whole.hashes) == num_full
    if num_full:
        bound = prompt_block_keys([np.asarray(tokens[: num_full * block_size])], [0], [salt], block_size)
        assert bound.tolist() == whole.hashes.tolist()
    if num_full > 1:  # a chained key: changing the first token changes every later key
        changed = BlockKeyChain(block_size, salt)
        changed.extend([tokens[0] + 1] + tokens[1:], num_full)
        assert not set(changed.hashes.tolist()) & set(whole.hashes.tolist())
    as_numpy_ints = BlockKeyChain(block_size, salt)  # a tuple of numpy integers: same keys
    for n in range(num_full + 1):
        as_numpy_ints.extend(tuple(np.asarray(tokens, dtype=np.int64)), n)
    assert lanes(as_numpy_ints) == lanes(whole)
    other = BlockKeyChain(block_size, "other" if salt is None else None)
    other.extend(tokens, num_full)
    assert not set(other.hashes.tolist()) & set(whole.hashes.tolist())  # salted chains never meet unsalted


@settings(max_examples=80, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 2**31 - 1), max_size=12),
    appended=st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=4),
    probes=st.lists(st.integers(-20, 20), max_size=6),
    cuts=st.lists(
        st.tuples(
            st.integers(-20, 20) | st.none(),
            st.integers(-20, 20) | st.none(),
            st.sampled_from([None, 1, 2, -1]),
        ),
        max_size=6,
    ),
)
def test_array_token_ids_read_like_the_list(prompt, appended, probes, cuts):
    array = np.asarray(prompt, dtype=np.int64)
    array.setflags(write=False)  # never written: it is the request's own prompt
    ids, reference = ArrayTokenIds(array), list(prompt)
    for tokens in appended:
        if len(tokens) == 1:
            ids.append(tokens[0])
            reference.append(tokens[0])
        else:
            ids.extend(tokens)
            reference.extend(tokens)
        assert len(ids) == len(reference) and list(ids) == reference and ids == reference
    for i in probes:
        if -len(reference) <= i < len(reference):
            assert ids[i] == reference[i] and type(ids[i]) is int
        else:
            with pytest.raises(IndexError):
                ids[i]
    for start, stop, step in cuts:
        assert ids[start:stop:step] == reference[start:stop:step]
        assert all(type(t) is int for t in ids[start:stop:step])
    for copy in (ids.copy(), copy_module.copy(ids), copy_module.deepcopy(ids)):
        copy.append(1)
        assert ids == reference and copy == reference + [1] and copy != ids
    assert TokenPrefix(ids, len(reference)) == reference and ids == TokenPrefix(reference, len(reference))
    # id_list (the registrations' block slices) equals slicing, for every form and range:
    # the usual types by their exact-type paths, subclasses and others by the plain one.
    n = len(reference)
    keyed = KeyedTokenIds(reference)
    forms = (ids, keyed, reference, _SubList(reference), _SubArrayIds(ids.array, ids.tail))
    for start in range(n + 1):
        for stop in range(start, n + 1):
            expected = reference[start:stop]
            for tokens in forms:
                got = id_list(tokens, start, stop)
                assert got == expected and all(type(t) is int for t in got)
                assert id_list(TokenPrefix(tokens, stop), start, stop) == expected
                assert id_list(TokenSpan(tokens, start, n), 0, stop - start) == expected
                assert id_list(_SubSpan(tokens, start, n), 0, stop - start) == expected
    # So do the keys a chain takes from each form (its prompt's array, or a copy of ids).
    num_blocks = n // BS
    keys = set()
    for tokens in forms:
        for view in (tokens, TokenPrefix(tokens, n), _SubSpan(tokens, 0, n)):
            chain = BlockKeyChain(BS, None)
            for upto in range(num_blocks + 1):  # grown block by block: each growth copies
                chain.extend(view, upto)
            keys.add((chain.hashes.tobytes(), chain.checks.tobytes(), chain.last_key))
    assert len(keys) == 1


class _SubList(list):  # type: ignore[type-arg]
    pass


class _SubArrayIds(ArrayTokenIds):
    __slots__ = ()


class _SubSpan(TokenSpan):
    __slots__ = ()


def test_hash_index_compares_the_second_lane_on_a_hash_hit():
    pool, index = bound(BlockHashPrefixIndex())
    blocks = pool.allocate_many(2)
    index.acquire(0, NO_MATCH)
    index.commit(0, [1, 2, 3, 4, 5, 6, 7, 8], blocks, None)
    # Forge a lane-0 collision: the stored lane 1 differs, so the lookup must miss.
    h = index._block_hash[blocks[0]]
    assert native.lookup(index._keys, index._vals, h) == blocks[0]
    index._block_check[blocks[0]] += np.uint64(1)
    assert index.match([1, 2, 3, 4, 5], None) == NO_MATCH
    assert native.lookup(index._keys, index._vals, h) == blocks[0]  # the entry stays


# Token streams over a 2-token alphabet share prefixes often, so matches grow and shrink.
_stream = st.lists(st.integers(3, 4), min_size=1, max_size=24)


def _manager_op(
    m: PagedKVManager, seq_id: int, op: tuple[int, list[int], int], live: dict[int, KeyedTokenIds]
) -> KeyedTokenIds | None:
    """One operation ``(kind, tokens, which)`` of the memo property tests on ``m``: kind 0
    starts sequence ``seq_id`` on ``tokens`` when it fits (allocate and commit; ``live``
    gains its ids), 1 ends a live sequence, 2 decodes up to 6 of ``tokens`` into one,
    committing after each (decode registrations); ``which`` picks the live sequence.
    Returns kind 0's ids (also when they did not fit), else None."""
    kind, tokens, which = op
    if kind == 0:
        keyed = KeyedTokenIds(tokens)
        if m.can_allocate(seq_id, keyed, len(tokens), None):
            m.allocate(seq_id, keyed, len(tokens) - m.num_cached_tokens(keyed, None), None)
            m.commit(seq_id, keyed)
            live[seq_id] = keyed
        return keyed
    if live:
        chosen = list(live)[which % len(live)]
        if kind == 1:
            m.free(chosen)
            del live[chosen]
        else:
            for token in tokens[:6]:
                if not m.can_append(chosen, 1):
                    break
                m.append(chosen, 1)
                live[chosen].append(token)
                m.commit_many([(chosen, live[chosen], len(live[chosen]))])
    return None


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 2), _stream, st.integers(0, 7)), max_size=40),
    num_blocks=st.integers(2, 8),
)
def test_memoised_match_equals_a_fresh_walk(ops, num_blocks):
    """Probes keep their match memo (on their KeyedTokenIds) across evictions, revivals,
    new registrations and decode commits (``commit_many``, registered in one compiled
    pass); each match always equals a fresh walk over the same tokens, also when asked
    again with nothing changed (the memo's answer as is)."""
    m = PagedKVManager(num_blocks, BS, 1, BlockHashPrefixIndex())
    index = m.prefix_index
    probes: list[KeyedTokenIds] = []
    live: dict[int, KeyedTokenIds] = {}
    for seq_id, op in enumerate(ops):
        started = _manager_op(m, seq_id, op, live)
        if started is not None:
            probes.append(started)  # a new sequence is also a probe
        for probe in probes:
            # The fresh walk first (a plain tuple: a throwaway chain, which becomes the
            # index's last answer), so the probe's memo answer is built again here, then
            # returned as is when asked again (the index's last answer).
            fresh, memo = index.match(tuple(probe), None), index.match(probe, None)
            assert (memo.num_tokens, memo.block_ids, memo.num_blocks_taken) == (
                fresh.num_tokens,
                fresh.block_ids,
                fresh.num_blocks_taken,
            )
            again = index.match(probe, None)  # nothing changed: the memo's answer
            assert again is memo
            # The array the manager attaches with is the memo's own: the same blocks.
            for found in (memo, fresh, again):
                array = found.block_id_array()
                assert array.dtype == np.int64 and array.tolist() == list(found.block_ids)
    m.check()


def test_a_grown_match_with_the_same_count_is_a_new_answer():
    """A revalidation whose walk found more blocks answers them, although the count of
    blocks to take stayed the same (the last answer's blocks are another array)."""
    m = PagedKVManager(8, BS, 1, BlockHashPrefixIndex())
    index = m.prefix_index
    writer = KeyedTokenIds([3] * 5)
    m.allocate(0, writer, 5, None)
    m.commit(0, writer)  # block 0 registered
    probe = KeyedTokenIds([3] * 9)
    first = index.match(probe, None)
    assert (first.num_tokens, first.block_ids, first.num_blocks_taken) == (4, (0,), 0)
    m.append(0, 4)
    writer.extend([3] * 4)
    m.commit_many([(0, writer, 9)])  # block 1 registered under the probe's second key
    second = index.match(probe, None)
    assert (second.num_tokens, second.block_ids, second.num_blocks_taken) == (8, (0, 1), 0)


def test_a_match_cut_to_nothing_is_a_new_empty_answer():
    """Every matched block reused by the pool (no match call in between): the answer is
    empty, not the last one."""
    m = PagedKVManager(2, BS, 1, BlockHashPrefixIndex())
    index = m.prefix_index
    writer = KeyedTokenIds([3] * 5)
    m.allocate(0, writer, 5, None)
    m.commit(0, writer)
    m.free(0)  # block 0 cached-free
    probe = KeyedTokenIds([3] * 5)
    first = index.match(probe, None)
    assert (first.num_tokens, first.block_ids, first.num_blocks_taken) == (4, (0,), 1)
    m.pool.allocate_many(2)  # every block reused: block 0's registration dropped
    second = index.match(probe, None)
    assert (second.num_tokens, second.block_ids, second.num_blocks_taken) == (0, (), 0)


def _plain_revalidation(index, pool, memo, valid, since, hashes, checks, stop, taken):
    """``native.revalidate_run`` step by step in Python: cut, walk, count."""
    state = pool.state
    if since >= 0:
        valid = next((i for i in range(valid) if index._dropped_at[memo[i]] > since), valid)
    if valid < len(memo):
        taken = -1
    run = []
    for j in range(valid, stop):
        b = native.lookup(index._keys, index._vals, hashes[j])
        live = b != native.EMPTY and state[native.CACHED, b]
        if not live or index._block_hash[b] != hashes[j] or index._block_check[b] != checks[j]:
            break
        run.append(int(b))
    if taken < 0:
        taken = sum(1 for b in memo[:valid] if state[native.REF, b] == 0)
    return valid, run, taken + sum(1 for b in run if state[native.REF, b] == 0)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 2), _stream, st.integers(0, 7)), max_size=30),
    data=st.data(),
)
def test_revalidate_run_equals_the_plain_cut_walk_and_count(ops, data):
    """The match memo's one compiled revalidation (cut at the first block dropped since,
    walk the keys past it, count the unreferenced blocks) against the same three steps
    in Python, on the states a manager goes through (registrations, frees, reuses) and
    memos of every length, drop count and known or unknown count."""
    m = PagedKVManager(6, BS, 1, BlockHashPrefixIndex())
    index, pool = m.prefix_index, m.pool
    probes: list[KeyedTokenIds] = []
    live: dict[int, KeyedTokenIds] = {}  # seq id -> its ids
    for seq_id, op in enumerate(ops):
        started = _manager_op(m, seq_id, op, live)
        if started is not None:
            probes.append(started)
        for probe in probes:
            chain = index.match(probe, None).handle  # a carried chain, also for no match
            memo = data.draw(st.sampled_from([chain.match_array, np.arange(chain.match_array.size)[::-1]]))
            memo = np.ascontiguousarray(memo, dtype=np.int64)
            valid = data.draw(st.integers(0, len(memo)))
            since = data.draw(st.integers(-1, index._num_drops))
            taken = data.draw(st.integers(-1, 3))
            stop = data.draw(st.integers(valid, max(valid, chain.num_blocks)))
            hashes, checks = chain.hashes, chain.checks
            args = (memo, valid, since, hashes, checks, stop, taken)
            got_valid, got_run, got_taken = native.revalidate_run(
                index._dropped_at, memo, valid, since, index._keys, index._vals, pool.state,
                index._block_hash, index._block_check, hashes, checks, stop, taken,
            )  # fmt: skip
            want_valid, want_run, want_taken = _plain_revalidation(index, pool, *args)
            assert (got_valid, got_run.tolist(), got_taken) == (want_valid, want_run, want_taken)
    m.check()


def test_memoised_answer_follows_a_decode_registration_and_a_silent_reuse():
    """The memo's answer is returned as is only while nothing it read changed: a decode
    commit registering the block a waiting probe needs next (``commit_many``'s compiled
    batch), and a decode step reusing a cached block the probe matched (no registration,
    no reference change: only the pool's reuse listener hears of it) both change it."""
    m = PagedKVManager(4, BS, 1, BlockHashPrefixIndex())
    index = m.prefix_index
    writer = KeyedTokenIds([3, 3, 3, 3, 3])
    m.allocate(0, writer, 5, None)
    m.commit(0, writer)  # block 0: [3, 3, 3, 3]
    probe = KeyedTokenIds([3] * 8 + [4])
    assert index.match(probe, None).num_tokens == 4
    for _ in range(3):  # decode [3, 3, 3]: the writer's second block fills with 3s
        m.append(0, 1)
        writer.append(3)
    m.commit_many([(0, writer, len(writer))])
    assert index.match(probe, None).num_tokens == 8 == index.match(tuple(probe), None).num_tokens
    # Both blocks go cached-free; the probe's memo holds them.
    m.free(0)
    assert index.match(probe, None).block_ids == (0, 1)
    other = KeyedTokenIds([5, 5, 5, 5])
    m.allocate(1, other, 4, None)  # block 2 (never cached): nothing the probe read changed
    assert index.match(probe, None).block_ids == (0, 1)
    m.append(1, 1)  # block 3, then (a fresh block needed) ...
    m.append(1, 4)  # ... block 1 (freed first: tables free tail first): cached, reused
    # and dropped, with no registration and no reference change.
    memo, fresh = index.match(probe, None), index.match(tuple(probe), None)
    assert (memo.num_tokens, memo.block_ids) == (fresh.num_tokens, fresh.block_ids) == (4, (0,))
    m.check()


def test_a_revalidated_match_that_changed_nothing_is_the_same_answer():
    """A revalidation (something changed since the memo: a registration, a reference) that
    finds the same blocks and the same count of blocks to take returns the last answer
    itself; one whose count changed returns a new answer on the same blocks. An empty
    match of a carried chain is kept the same way."""
    m = PagedKVManager(8, BS, 1, BlockHashPrefixIndex())
    index = m.prefix_index
    writer = KeyedTokenIds([3] * 9)
    m.allocate(0, writer, 9, None)
    m.commit(0, writer)  # blocks 0 and 1 registered; block 2 holds one slot
    probe = KeyedTokenIds([3] * 8 + [9])
    first = index.match(probe, None)
    assert (first.num_tokens, first.block_ids, first.num_blocks_taken) == (8, (0, 1), 0)
    m.append(0, 3)
    writer.extend([6, 6, 6])
    m.commit_many([(0, writer, 12)])  # a registration elsewhere: the memo revalidates
    assert index.match(probe, None) is first
    m.append(0, 1)  # a fresh block: the pool's references changed
    assert index.match(probe, None) is first
    m.free(0)  # the probe's blocks go cached-free: attaching them takes two
    second = index.match(probe, None)
    assert second is not first and second.blocks is first.blocks
    assert (second.num_tokens, second.num_blocks_taken) == (8, 2)
    fresh = index.match(tuple(probe), None)
    assert (fresh.num_tokens, fresh.block_ids, fresh.num_blocks_taken) == (8, (0, 1), 2)
    lone = KeyedTokenIds([8] * 9)
    empty = index.match(lone, None)
    assert empty.num_tokens == 0 and empty.handle is lone.key_chain
    m.allocate(1, KeyedTokenIds([5] * 5), 5, None)  # references changed, no registration
    assert index.match(lone, None) is not empty  # another sequence's match came between
    again = index.match(lone, None)
    m.append(1, 4)
    assert index.match(lone, None) is again and again.num_tokens == 0
    m.check()


@pytest.mark.parametrize("copy_fn", [copy_module.copy, copy_module.deepcopy, KeyedTokenIds.copy])
def test_a_copied_keyed_list_keeps_its_own_chain_and_memo(copy_fn):
    """Two copies that diverge after a memoised match must each match their own ids: a
    copy shares no chain (keys, memo) with its original, however it was made."""
    m = PagedKVManager(8, BS, 1, BlockHashPrefixIndex())
    index = m.prefix_index
    writer = KeyedTokenIds([3] * 12 + [9])
    m.allocate(0, writer, 13, None)
    m.commit(0, writer)
    a = KeyedTokenIds([3] * 9)
    index.match(a, None)  # memoised on a's chain
    b = copy_fn(a)
    assert b == a and b.key_chain is not a.key_chain
    a.extend([3] * 3 + [1])
    b.extend([5] * 3 + [1])
    for ids, want in ((a, 12), (b, 8)):
        for _ in range(2):  # the walk, then the memo
            assert index.match(ids, None).num_tokens == want == index.match(list(ids), None).num_tokens
    m.check()


def test_memoised_match_keeps_no_cycle_through_its_chain():
    """A match's handle is the chain carrying the memo: the memo must not hold the match
    back, or every sequence's chain (keys, memo index) would outlive it until a garbage
    collection, which a long replay runs rarely (the full Mooncake trace's peak RSS
    doubled). The index keeps its last answer only (returned again while the memo
    stands), so it holds one chain at most, until it answers another."""
    m = PagedKVManager(4, BS, 1, BlockHashPrefixIndex())
    writer = KeyedTokenIds([3] * 9)
    m.allocate(0, writer, 9, None)
    m.commit(0, writer)
    probe, other = KeyedTokenIds([3] * 9), KeyedTokenIds([4] * 9)
    walked = m.prefix_index.match(probe, None)
    memo = m.prefix_index.match(probe, None)  # the memo's answer: the index's last, as is
    assert memo is walked and memo.handle is probe.key_chain and memo.num_tokens == 8
    m.prefix_index.match(other, None)
    rebuilt = m.prefix_index.match(probe, None)  # the memo's answer, built again
    assert rebuilt is not memo and rebuilt == memo
    del walked, memo, rebuilt
    chain = probe.key_chain
    m.prefix_index.match(other, None)  # the index answers another chain
    # Referenced by the probe's slot, this name and getrefcount's argument only.
    assert sys.getrefcount(chain) == 3


def test_last_answer_is_one_index_s_own():
    """An index returns its last answer again only for the chain whose memo it owns: one
    probe matched through two indexes in turn gets each index's own match."""
    managers = [PagedKVManager(4, BS, 1, BlockHashPrefixIndex()) for _ in range(2)]
    writer = KeyedTokenIds([3] * 9)
    managers[0].allocate(0, writer, 9, None)
    managers[0].commit(0, writer)
    probe = KeyedTokenIds([3] * 9)
    for _ in range(2):
        assert [m.prefix_index.match(probe, None).num_tokens for m in managers] == [8, 0]


def test_memoised_match_drops_blocks_the_pool_reused():
    m = PagedKVManager(3, BS, 1, BlockHashPrefixIndex())
    first, second = KeyedTokenIds([3] * 9), KeyedTokenIds([4] * 9)
    m.allocate(0, first, 9, None)
    m.commit(0, first)
    m.free(0)
    assert m.prefix_index.match(first, None).block_ids == (0, 1)  # memoised on `first`
    m.allocate(1, second, 9, None)  # reuses blocks 0 and 1 (and 2)
    m.commit(1, second)
    memo, fresh = m.prefix_index.match(first, None), m.prefix_index.match(tuple(first), None)
    assert (memo.num_tokens, memo.block_ids) == (fresh.num_tokens, fresh.block_ids) == (0, ())


@settings(max_examples=60, deadline=None)
@given(
    # Enough distinct keys that the 64-slot table of these small pools is rebuilt often.
    prompts=st.lists(st.lists(st.integers(3, 5), min_size=8, max_size=40), min_size=30, max_size=60),
    num_blocks=st.integers(3, 12),
)
def test_compiled_hash_table_equals_a_dict_of_live_registrations(prompts, num_blocks):
    """The compiled hash table (open addressing, dead entries left behind, rebuilt when
    half full: many rebuilds with a pool this small) against a plain dict model of what
    vLLM's index holds: key -> block for registered blocks, an entry dropped when the pool
    reuses its block, the first registration of a key winning. Every sequence is
    allocated, committed and freed in turn; every match equals the model's walk."""
    m = PagedKVManager(num_blocks, BS, 1, BlockHashPrefixIndex())
    index, pool = m.prefix_index, m.pool
    model: dict[int, int] = {}  # lane 0 -> block, live registrations only
    for seq_id, prompt in enumerate(prompts):
        tokens = KeyedTokenIds(prompt)
        chain = BlockKeyChain(BS, None)
        num_full = max(len(prompt) - 1, 0) // BS
        chain.extend(prompt, len(prompt) // BS)
        want = 0
        while want < num_full and model.get(int(chain.hashes[want])) is not None:
            want += 1
        match = index.match(tokens, None)
        assert len(match.block_ids) == want
        assert list(match.block_ids) == [model[int(h)] for h in chain.hashes[:want]]
        if not m.can_allocate(seq_id, tokens, len(prompt) - match.num_tokens, None):
            continue
        m.allocate(seq_id, tokens, len(prompt) - match.num_tokens, None)
        # The pool clears a block's cached flag only when it reuses the block (allocate).
        model = {h: b for h, b in model.items() if pool.is_cached(b)}
        table = m.block_table(seq_id)
        for i, h in enumerate(chain.hashes.tolist()):
            model.setdefault(h, table[i])
        m.commit(seq_id, tokens)
        m.free(seq_id)
        m.check()
        assert index.num_cached_blocks == len(model)


def test_hash_index_last_keys_survive_slot_growth_release_and_reuse(monkeypatch):
    """Each tracked sequence's last key lives in a row of the index's table: 40 sequences
    (the table starts at 16 rows and doubles), every third released, forks into the freed
    rows, plain commits on top, then two rounds of decode commits (the compiled path,
    which chains each from its row in place). ``check`` (every key equals its chain's)
    after each phase; at the end every sequence's registration equals that of a twin
    index that tracked it alone."""
    pool, index = bound(BlockHashPrefixIndex(), num_blocks=1024)
    prompts = {seq_id: [seq_id % 7 + 1] * BS + [seq_id + 100] * (BS + seq_id % 3) for seq_id in range(40)}
    tables = {}
    for seq_id, tokens in prompts.items():
        tables[seq_id] = pool.allocate_many(-(-len(tokens) // BS) + 1)
        index.acquire(seq_id, NO_MATCH)
        index.commit(seq_id, tokens, tables[seq_id], None)
    index.check()
    for seq_id in range(0, 40, 3):
        index.release(seq_id)
        del prompts[seq_id]
    index.check()
    for child, parent in zip(range(100, 110), (1, 2, 4, 5, 7, 8, 10, 11, 13, 14)):
        index.fork(parent, child)
        prompts[child] = list(prompts[parent])
        # The child shares the parent's full blocks; the rest of its table is its own.
        num_full = len(prompts[parent]) // BS
        tables[child] = tables[parent][:num_full] + pool.allocate_many(len(tables[parent]) - num_full)
    index.check()
    for seq_id, tokens in prompts.items():
        tokens += [seq_id + 1000] * (2 * BS - len(tokens) % BS)  # one or two more full blocks
        if len(tables[seq_id]) < len(tokens) // BS:
            tables[seq_id] += pool.allocate_many(len(tokens) // BS - len(tables[seq_id]))
        index.commit(seq_id, tokens, tables[seq_id], None)
    index.check()
    assert len(prompts) > 16  # so rows past the table's first 16 are in use
    monkeypatch.setattr(index, "commit", lambda *args: pytest.fail("a decode entry took the plain path"))
    for round_ in range(2):
        entries = []
        for seq_id, tokens in prompts.items():
            tokens += [seq_id + 2000 + round_] * BS  # exactly the next full block
            tables[seq_id] += pool.allocate_many(len(tokens) // BS - len(tables[seq_id]))
            entries.append((seq_id, tokens, len(tokens), tables[seq_id], None))
        index.commit_many(entries)
        index.check()
    for seq_id, tokens in prompts.items():
        twin_pool, twin = bound(BlockHashPrefixIndex(), num_blocks=16)
        twin.acquire(0, NO_MATCH)
        twin.commit(0, tokens, twin_pool.allocate_many(len(tokens) // BS), None)
        assert index.registration(seq_id) == twin.registration(0)
