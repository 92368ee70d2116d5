"""``commit_many``: one step's commits together, against committing one entry at a time.

The block-hash index keys and registers a step's decode commits in one compiled call
(``native.register_entries``); everything it leaves behind must equal what separate
``commit`` calls leave (the pool, the registrations and each sequence's registered count
and last key; not the token ids' key chains, which a batch leaves behind: see
``BlockKeyChain``), including which of two equal keys wins, chains keyed from the salt, a
sequence committed twice in one step and hash-table rebuilds mid-batch.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.engines.kv import native
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.prefix_cache import (
    _FIRST_ENTRY_ROWS,
    BlockHashPrefixIndex,
    _packed_rows,
    _SeqHashState,
    _StepRegistrations,
)
from kvbench.engines.kv.radix_cache import RadixPrefixIndex
from kvbench.engines.kv.token_ids import ArrayTokenIds, KeyedTokenIds, TokenPrefix

BS = 4

# One step: per live sequence, how many tokens it gains (1: a decode step; more: a chunk),
# whether it also commits a shorter prefix first in the same step, whether it finishes.
step_plan = st.lists(
    st.tuples(st.sampled_from([1, 1, 1, 2, 5]), st.booleans(), st.integers(0, 9)), min_size=1, max_size=6
)


def _state(m: PagedKVManager, tokens: dict[int, KeyedTokenIds], probes: list[list[int]]) -> tuple:
    """What the two managers must agree on: pool arrays, registrations, every live
    sequence's registered count and last key, table, its blocks' claimed slots and what
    its own tokens match (a fresh chain's keys: its blocks were registered under the
    right keys, however a batch keyed them), and what probe prompts match."""
    index = m.prefix_index
    return (
        m.pool.state.tobytes(),
        m.pool.counts.tobytes(),
        index.num_cached_blocks,
        {
            seq_id: (
                index.registration(seq_id),
                index.match(list(ids), ids.key_chain.extra_key if ids.key_chain else None).block_ids,
                m.block_table(seq_id),
                m._claimed[m.block_table(seq_id)].tolist(),  # slots each table block claims
            )
            for seq_id, ids in tokens.items()
        },
        [index.match(probe, salt).block_ids for probe in probes for salt in (None, "s")],
    )


@settings(max_examples=60, deadline=None)
@given(
    # A two-letter alphabet: sequences often write equal blocks, so first-registration-wins
    # decides, and a small pool reuses cached blocks and rebuilds the table often.
    prompts=st.lists(
        st.tuples(st.lists(st.integers(3, 4), min_size=1, max_size=14), st.sampled_from([None, "s"])),
        min_size=2,
        max_size=8,
    ),
    steps=st.lists(step_plan, min_size=1, max_size=12),
    num_blocks=st.integers(12, 40),
    seed=st.integers(0, 2**16),
)
def test_commit_many_equals_one_commit_at_a_time(prompts, steps, num_blocks, seed):
    rng = np.random.default_rng(seed)
    managers = [PagedKVManager(num_blocks, BS, 1, BlockHashPrefixIndex()) for _ in range(2)]
    tokens: list[dict[int, KeyedTokenIds]] = [{}, {}]
    salts: dict[int, str | None] = {}
    probes = [prompt for prompt, _ in prompts]
    waiting = list(enumerate(prompts))
    for plan in steps:
        # Admit what fits (same decision for both: their states are equal).
        while waiting:
            seq_id, (prompt, salt) = waiting[0]
            ids = [KeyedTokenIds(prompt), KeyedTokenIds(prompt)]
            cached = managers[0].num_cached_tokens(ids[0], salt)
            if not managers[0].can_allocate(seq_id, ids[0], len(prompt) - cached, salt):
                break
            waiting.pop(0)
            for m, tok, ids_m in zip(managers, tokens, ids):
                m.allocate(seq_id, ids_m, len(prompt) - m.num_cached_tokens(ids_m, salt), salt)
                tok[seq_id] = ids_m
            salts[seq_id] = salt
        live = sorted(tokens[0])
        if not live:
            break
        # One step: grow each planned sequence, then commit the step's entries.
        entries: list[list[tuple[int, object, int]]] = [[], []]
        for (num_new, twice, _), seq_id in zip(plan, live):
            if not managers[0].can_append(seq_id, num_new):
                continue
            new = rng.integers(3, 5, size=num_new).tolist()
            for m, tok, ents in zip(managers, tokens, entries):
                ids = tok[seq_id]
                m.append(seq_id, num_new)
                before = len(ids)
                ids.extend(new)
                if twice:  # a prefix first: with num_new == 1 the same tokens twice
                    ents.append((seq_id, ids, before + (num_new + 1) // 2))
                ents.append((seq_id, ids, len(ids)))
        for seq_id, ids, num_tokens in entries[0]:
            # The reference commits views of the counted prefixes (the entries' ids run on).
            managers[0].commit(seq_id, TokenPrefix(ids, num_tokens))
        managers[1].commit_many(entries[1])
        for (_, _, finish), seq_id in zip(plan, live):
            if finish == 0:  # about one in ten finishes after its step
                for m, tok in zip(managers, tokens):
                    m.free(seq_id)
                    del tok[seq_id]
        for m in managers:
            m.check()
        assert _state(managers[0], tokens[0], probes) == _state(managers[1], tokens[1], probes)


def test_commit_many_checks_every_entry_before_committing_any():
    m = PagedKVManager(16, BS, 1, BlockHashPrefixIndex())
    good, bad = KeyedTokenIds([5] * 8), KeyedTokenIds([6] * 8)
    m.allocate(0, good, 8, None)
    m.allocate(1, bad, 8, None)
    with pytest.raises(ValueError, match="seq 1 commits 9 tokens but has 8 slots"):
        m.commit_many([(0, good, 8), (1, KeyedTokenIds([6] * 9), 9)])
    with pytest.raises(ValueError, match="seq 1 commits -1 tokens"):
        m.commit_many([(0, good, 8), (1, bad, -1)])
    with pytest.raises(KeyError, match="unknown seq 9"):
        m.commit_many([(0, good, 8), (9, bad, 8)])
    assert m.prefix_index.num_cached_blocks == 0  # seq 0's blocks were not registered either
    m.commit_many([(0, good, 8), (1, bad, 8)])
    assert m.prefix_index.num_cached_blocks == 4
    m.check()


def test_commit_many_refuses_a_swapped_out_sequence():
    m = PagedKVManager(16, BS, 1, BlockHashPrefixIndex(), num_host_blocks=8)
    tokens = KeyedTokenIds([5] * 8)
    m.allocate(0, tokens, 8, None)
    m.swap_out(0)
    with pytest.raises(ValueError, match="commit: seq 0 is swapped out"):
        m.commit_many([(0, tokens, 8)])
    assert m.prefix_index.num_cached_blocks == 0
    m.check()


def _decoding_index(num_seqs: int) -> tuple[PagedKVManager, list[KeyedTokenIds]]:
    """A manager whose sequences 0 .. num_seqs - 1 each registered one full block and hold
    a second one just filled (4 decode tokens written): each one's next commit is a
    decode commit of block 1."""
    m = PagedKVManager(16, BS, 1, BlockHashPrefixIndex())
    ids = []
    for seq_id in range(num_seqs):
        tokens = KeyedTokenIds([3 + seq_id] * BS)
        m.allocate(seq_id, tokens, BS, None)
        m.commit(seq_id, tokens)
        m.append(seq_id, BS)
        tokens.extend([7 + seq_id] * BS)
        ids.append(tokens)
    return m, ids


def test_batches_past_the_packed_rows_buffer_equal_one_commit_at_a_time():
    """The index packs a call's decode registrations into one buffer it keeps
    (``_FIRST_ENTRY_ROWS`` rows at first): a step of more decode commits grows it, and the
    smaller steps after it read only their own rows, not the stale ones past them. Each
    step's commits through ``commit_many`` leave what one ``commit`` at a time leaves."""
    num_seqs = 2 * _FIRST_ENTRY_ROWS + 3
    managers = [PagedKVManager(4 * num_seqs, BS, 1, BlockHashPrefixIndex()) for _ in range(2)]
    tokens: list[dict[int, KeyedTokenIds]] = [{}, {}]
    for seq_id in range(num_seqs):
        for m, tok in zip(managers, tokens):
            ids = tok[seq_id] = KeyedTokenIds([3 + seq_id % 5, 3 + seq_id % 7] * (BS // 2))
            m.allocate(seq_id, ids, BS, None)
            m.commit(seq_id, ids)
    probes = [list(tokens[0][seq_id]) for seq_id in range(0, num_seqs, 17)]
    # Steps of every sequence, then of 2 and of 5 of them: a block's decode tokens each.
    for step, seq_ids in enumerate([range(num_seqs), [4, 9], range(20, 25)]):
        entries: list[list[tuple[int, object, int]]] = [[], []]
        for seq_id in seq_ids:
            for m, tok, ents in zip(managers, tokens, entries):
                ids = tok[seq_id]
                m.append(seq_id, BS)
                ids.extend([5 + (seq_id + step) % 3] * BS)
                ents.append((seq_id, ids, len(ids)))
        for seq_id, ids, num_tokens in entries[0]:
            managers[0].commit(seq_id, TokenPrefix(ids, num_tokens))
        managers[1].commit_many(entries[1])
        for m in managers:
            m.check()
        assert _state(managers[0], tokens[0], probes) == _state(managers[1], tokens[1], probes)
    assert len(managers[1].prefix_index._entry_rows) >= num_seqs  # grown


def test_packed_rows_fill_reuse_and_grow_their_buffer():
    """``_packed_rows`` writes a call's values row by row into the buffer it is given when
    they fit (the same array back), else into a new one of at least twice the rows; a
    value outside int64 raises struct.error."""
    rows = np.full((2, 3), -1, dtype=np.int64)
    same, num_rows = _packed_rows([1, 2, 3], rows, 3)
    assert same is rows and num_rows == 1 and rows.tolist() == [[1, 2, 3], [-1, -1, -1]]
    grown, num_rows = _packed_rows(list(range(9)), rows, 3)
    assert grown is not rows and num_rows == 3 and grown.shape == (4, 3)
    assert grown[:3].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(struct.error):
        _packed_rows([1, 2, 2**63], grown, 3)


def test_registering_more_entries_than_rows_raises_changing_nothing():
    """``native.allocate_steps_registering`` and ``native.register_entries`` read the first
    ``num_entries`` rows of the buffer they are given: a count past its rows (or a
    negative one) raises ValueError before anything changes."""
    m, _ = _decoding_index(1)
    index, pool = m.prefix_index, m.pool
    before = (pool.state.tobytes(), pool.counts.tobytes(), index._keys.tobytes(), index._last_keys.tobytes())
    rows = np.zeros((1, 4 + BS), dtype=np.int64)
    registration = index._registration_arrays(pool)  # both calls' first arguments
    calls = {
        "allocate_steps_registering": lambda num_entries: native.allocate_steps_registering(
            *registration,
            np.zeros(1, dtype=np.int64),
            *native.step_buffers(0, 1),
            index._multipliers,
            rows,
            num_entries,
            index._last_keys,
        ),
        "register_entries": lambda num_entries: native.register_entries(
            *registration, index._multipliers, rows, num_entries, index._last_keys
        ),
    }
    for name, call in calls.items():
        for num_entries in (2, -1):
            with pytest.raises(ValueError, match=f"{name}: num_entries"):
                call(num_entries)
            after = (
                pool.state.tobytes(),
                pool.counts.tobytes(),
                index._keys.tobytes(),
                index._last_keys.tobytes(),
            )
            assert after == before


def test_index_commit_many_commits_the_entries_before_an_unknown_seq():
    """``PrefixIndex.commit_many`` raises on the first bad entry with the entries before it
    committed (its contract): the decode commit batched before an unknown sequence is
    registered, the one after it is not."""
    m, ids = _decoding_index(2)
    index = m.prefix_index
    rows = [(seq_id, ids[seq_id], 2 * BS, m.block_table(seq_id), None) for seq_id in (0, 1)]
    with pytest.raises(KeyError, match="unknown seq 9"):
        index.commit_many([rows[0], (9, ids[1], 2 * BS, m.block_table(1), None), rows[1]])
    assert index.registration(0)[0] == 2  # seq 0's decode block: registered
    assert index.registration(1)[0] == 1  # seq 1's: not
    m.check()


def test_a_count_past_the_ids_raises_where_the_index_reads_them():
    """An entry counting more ids than it holds, whose count completes a block: the batch
    stops there and the plain commit raises ValueError; the decode commit before it is
    registered (the contract: entries before the bad one may be committed)."""
    m, ids = _decoding_index(2)
    short = KeyedTokenIds(ids[1][: 2 * BS - 1])
    with pytest.raises(ValueError, match=rf"ids \[0, {2 * BS}\) asked of {2 * BS - 1}"):
        m.commit_many([(0, ids[0], 2 * BS), (1, short, 2 * BS)])
    assert m.prefix_index.registration(0)[0] == 2
    assert m.prefix_index.registration(1)[0] == 1
    m.check()


def test_an_entry_whose_table_lacks_its_block_raises_where_the_index_reads_it():
    """An entry completing a block its table does not hold (seq 1 hands the index only
    its first block): the batch stops there and the plain commit raises ValueError; the
    decode commit before it is registered, seq 1 registers nothing."""
    m, ids = _decoding_index(2)
    index = m.prefix_index
    rows = [(0, ids[0], 2 * BS, m.block_table(0), None), (1, ids[1], 2 * BS, m.block_table(1)[:1], None)]
    with pytest.raises(ValueError, match=f"commits {2 * BS} tokens but its block table has only 1 blocks"):
        index.commit_many(rows)
    assert index.registration(0)[0] == 2
    assert index.registration(1)[0] == 1
    m.check()


def test_an_entry_completing_no_new_block_is_skipped_in_the_batch():
    """An entry whose count completes no block past the registered ones is skipped by
    the batch, not committed plainly: even with a count past its ids (only block 0's ids
    and one more counted) it raises nothing and registers nothing, and a sequence
    committed twice in one step registers its block once, in the batch (the ids' key
    chain is left behind, as only the batch does)."""
    m, ids = _decoding_index(1)
    m.commit_many([(0, KeyedTokenIds(ids[0][:BS]), BS + 1)])
    assert m.prefix_index.registration(0)[0] == 1
    m.commit_many([(0, ids[0], 2 * BS), (0, ids[0], 2 * BS)])
    assert m.prefix_index.registration(0)[0] == 2
    assert ids[0].key_chain is not None and ids[0].key_chain.num_blocks == 1
    m.check()


def test_decode_steps_refuse_a_bad_commit_changing_nothing():
    """``advance_many`` checks every step's commit entries before it changes anything: a
    count past the slots or a negative one raises ValueError and leaves the run and the
    manager as they were."""
    m, ids = _decoding_index(2)
    run = m.decode_run([0, 1])
    before = (run.snapshot(), m.usage_counts(), m.block_table(0), m.block_table(1))
    for bad in (2 * BS + 3, -1):
        with pytest.raises(ValueError, match=f"seq 1 commits {bad} tokens"):
            run.advance_many(2, [[(0, ids[0], 2 * BS)], [(1, ids[1], bad)]])
        assert (run.snapshot(), m.usage_counts(), m.block_table(0), m.block_table(1)) == before
        m.check()
    run.advance_many(2, [[(0, ids[0], 2 * BS)], [(1, ids[1], 2 * BS)]])
    assert m.prefix_index.registration(0)[0] == m.prefix_index.registration(1)[0] == 2
    m.check()


@pytest.mark.parametrize("empty_steps_before", [0, 2])
def test_allocate_decode_steps_raises_on_an_unknown_seq_changing_nothing(empty_steps_before):
    """Named from the step that holds it, also after steps that commit nothing."""
    m, ids = _decoding_index(1)
    index, pool = m.prefix_index, m.pool
    before = (pool.state.tobytes(), pool.counts.tobytes(), index.registration(0))
    rows = [[] for _ in range(empty_steps_before)] + [
        [(0, ids[0], 2 * BS, m.block_table(0), None), (9, ids[0], 2 * BS, m.block_table(0), None)]
    ]
    needs = np.zeros(len(rows), dtype=np.int64)
    needs[-1] = 1
    with pytest.raises(KeyError, match="unknown seq 9"):
        index.allocate_decode_steps(pool, needs, rows)
    assert (pool.state.tobytes(), pool.counts.tobytes(), index.registration(0)) == before
    m.check()


def test_allocate_decode_steps_declines_a_call_that_stops_in_a_later_step_changing_nothing():
    """A call whose later step holds an entry that is no decode commit (seq 1 completing
    two blocks at once) is declined (None) as a whole: the decode commit of step 0 stays
    unregistered, so the caller can take the steps one at a time. (No step takes a block
    here: blocks the index takes belong to the manager's tables, which this bypasses.)"""
    m, ids = _decoding_index(2)
    index, pool = m.prefix_index, m.pool
    before = (pool.state.tobytes(), pool.counts.tobytes(), index.registration(0), index.registration(1))
    rows = [
        [(0, ids[0], 2 * BS, m.block_table(0), None)],
        [],
        [(1, ids[1], 3 * BS, m.block_table(1), None)],
    ]
    assert index.allocate_decode_steps(pool, np.zeros(3, dtype=np.int64), rows) is None
    assert (
        pool.state.tobytes(),
        pool.counts.tobytes(),
        index.registration(0),
        index.registration(1),
    ) == before
    m.check()
    # Without the last step the same call goes through in one pass.
    assert index.allocate_decode_steps(pool, np.zeros(2, dtype=np.int64), rows[:2]) is not None
    assert index.registration(0)[0] == 2
    m.check()


def test_step_registrations_start_skips_entries_of_the_first_step_only():
    """``_StepRegistrations.add_steps``' ``start`` (where ``commit_many`` resumes after a
    plain commit) skips entries of step 0 only: each later step is read from its first."""
    tokens = [list(range(2 * BS)) for _ in range(3)]
    tables = [[10 + 2 * seq_id, 11 + 2 * seq_id] for seq_id in range(3)]
    states = {seq_id: _SeqHashState(1, object(), seq_id) for seq_id in range(3)}  # any chain
    steps = _StepRegistrations(BS)
    commits = [
        [(seq_id, tokens[seq_id], 2 * BS, tables[seq_id], None) for seq_id in (0, 1)],
        [(2, tokens[2], 2 * BS, tables[2], None)],
    ]
    assert steps.add_steps(commits, states, 1) is None
    assert list(steps.rows) == [1, 2]
    # Per entry: step, slot, block position and id, then the block's ids.
    assert steps.entries == [0, 1, 1, 13, *range(BS, 2 * BS), 1, 2, 1, 15, *range(BS, 2 * BS)]


def test_a_radix_index_commits_one_entry_at_a_time():
    """The radix tree holds blocks, so its commits may switch table entries: the manager
    commits each entry alone, and the index refuses a batch."""
    m = PagedKVManager(16, BS, 1, RadixPrefixIndex())
    ids = [KeyedTokenIds([7] * 8), KeyedTokenIds([7] * 8)]
    for seq_id, tokens in enumerate(ids):
        m.allocate(seq_id, tokens, 8, None)
    m.commit_many([(0, ids[0], 8), (1, ids[1], 8)])
    # Both wrote the same two blocks: the second sequence now reads the first one's.
    assert m.block_table(1) == m.block_table(0)
    m.check()
    with pytest.raises(TypeError, match="commit one entry at a time"):
        m.prefix_index.commit_many([])


def _decode_step_cases(
    *,
    prompt_len: int,
    num_prompts: int,
    warm_len: tuple[int, int],
    max_call: int,
    num_blocks: tuple[int, int],
    block_sizes: tuple[int, int],
    trim: bool,
) -> st.SearchStrategy[dict]:
    """``_decode_steps_against_stepping``'s arguments in one regime: up to ``num_prompts``
    prompts of 1 to ``prompt_len`` two-letter ids, up to four warm-up prompts of
    ``warm_len`` ids, up to four calls of 1 to ``max_call`` steps, pools and block sizes
    in those ranges, and trimmed commits only where ``trim``."""
    return st.fixed_dictionaries(
        {
            "prompts": st.lists(
                st.lists(st.integers(3, 4), min_size=1, max_size=prompt_len), min_size=1, max_size=num_prompts
            ),
            "warm": st.lists(
                st.lists(st.integers(3, 4), min_size=warm_len[0], max_size=warm_len[1]), max_size=4
            ),
            "calls": st.lists(st.integers(1, max_call), min_size=1, max_size=4),
            "num_blocks": st.integers(*num_blocks),
            "seed": st.integers(0, 2**16),
            "uncommitted": st.lists(st.booleans(), min_size=num_prompts, max_size=num_prompts),
            "block_size": st.integers(*block_sizes),
            "trim_commits": st.booleans() if trim else st.just(False),
        }
    )


# The regimes of the one-pass test below (``_decode_step_cases``' arguments).
_DECODE_STEP_REGIMES = {
    # Block size 4 in pools of 14-40 blocks; an uncommitted prompt completes several blocks
    # in its first decode commit, which the index declines to batch.
    "block_size_4": dict(
        prompt_len=13,
        num_prompts=6,
        warm_len=(4, 12),
        max_call=11,
        num_blocks=(14, 40),
        block_sizes=(BS, BS),
        trim=False,
    ),
    # Block sizes 1-3 in pools of 6-14 blocks, where a step often reuses a cached block
    # (dropping its key) that a commit of the same step registers again: the step's drops
    # must come before its registrations, in one pass and stepped alike. Calls may give
    # commits only up to their last committing step.
    "small_blocks_and_pools": dict(
        prompt_len=7,
        num_prompts=5,
        warm_len=(2, 6),
        max_call=9,
        num_blocks=(6, 14),
        block_sizes=(1, 3),
        trim=True,
    ),
}


@pytest.mark.parametrize("regime", sorted(_DECODE_STEP_REGIMES))
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_decode_steps_in_one_pass_equal_stepping_with_commits(regime, data):
    """``PagedDecodeRun.advance_many`` with the steps' commits (the prefix index's compiled pass,
    ``allocate_decode_steps``, one per call; a call it declines one step at a time) against
    ``advance`` then ``commit_many`` step by step: the same blocks, claims, registrations,
    drops, keys and per-step counts, in each of ``_DECODE_STEP_REGIMES``. Two-letter ids make
    sequences write equal blocks, and the warm-up leaves cached blocks in the free list for
    the steps to reuse. A sequence whose prompt was never committed (``uncommitted``)
    completes several blocks in its first decode commit, which the index declines to batch."""
    _decode_steps_against_stepping(**data.draw(_decode_step_cases(**_DECODE_STEP_REGIMES[regime])))


def _one_decoding_seq() -> tuple[PagedKVManager, KeyedTokenIds, object]:
    """Seq 0 with a 5-token prompt committed (block 0), in decode state (6 tokens), its
    run's next 7 tokens appended: (manager, its ids, its decode run). Step t of the run
    leaves it 6 + t slots; block 1 holds slots 4-7, block 2 (taken in step 3) 8-11."""
    m = PagedKVManager(16, BS, 1, BlockHashPrefixIndex())
    ids = KeyedTokenIds([3, 4, 4, 3, 4])
    m.allocate(0, ids, 5, None)
    m.commit(0, ids)
    ids.append(3)
    run = m.decode_run([0])
    ids.extend([4, 3, 3, 4, 4, 3, 4])
    return m, ids, run


def _manager_state(m: PagedKVManager) -> tuple:
    return (m.pool.state.tobytes(), m.block_table(0), m.prefix_index.registration(0), m.usage_counts())


def test_advance_many_checks_each_commit_against_its_own_steps_slots():
    """An entry of step t may count only the slots reserved up to step t, as stepping
    checks it: one counting a later step's is refused, changing nothing (the blocks the
    steps take are already in the tables when the index reads them). In a later step the
    same count goes through, and a block taken in the call (block 2, step 3) registers
    in the same pass."""
    m, ids, run = _one_decoding_seq()
    before = _manager_state(m)
    with pytest.raises(ValueError, match="commits 8 tokens but has 6 slots"):
        run.advance_many(7, [[(0, ids, 8)], [], [], [], [], [], []])
    assert _manager_state(m) == before
    m.check()
    run.advance_many(7, [[], [], [(0, ids, 8)], [], [], [], [(0, ids, 12)]])
    assert m.prefix_index.registration(0)[0] == 3
    assert list(m.prefix_index.match([*ids[:12], 9], None).block_ids) == m.block_table(0)[:3]
    m.check()


def test_advance_many_refuses_commits_for_more_steps_than_it_takes_changing_nothing():
    m, ids, run = _one_decoding_seq()
    before = _manager_state(m)
    with pytest.raises(ValueError, match="commits for 2 steps, 1 taken"):
        run.advance_many(1, [[], [(0, ids, 8)]])
    assert _manager_state(m) == before
    m.check()


def test_advance_many_changes_nothing_when_the_index_raises():
    """A decode block's id outside int64 raises where the index packs it, after the
    steps' blocks went into the tables: they come back out, and the slots are given back."""
    m, ids, run = _one_decoding_seq()
    ids[6] = 2**70
    before = _manager_state(m)
    with pytest.raises(struct.error):
        run.advance_many(7, [[], [], [(0, ids, 8)], [], [], [], []])
    assert _manager_state(m) == before
    m.check()


def test_a_decode_block_across_an_array_prompts_end_is_keyed_from_its_own_ids():
    """A trace prompt (``ArrayTokenIds``) of 6 ids ends inside block 1, which a decode run
    completes: its ids are the prompt array's last 2 and the first 2 appended. Registered
    in the run's compiled pass (``id_list``'s slice across the array's end), it is keyed
    as the same ids in a list key it: the list matches both blocks."""
    m = PagedKVManager(16, BS, 1, BlockHashPrefixIndex())
    ids = ArrayTokenIds(np.array([3, 4, 4, 3, 4, 3], dtype=np.int64))
    m.allocate(0, ids, 6, None)
    m.commit(0, ids)  # block 0
    ids.append(4)  # decode state: the newest token lacks KV
    run = m.decode_run([0])
    assert run.num_quiet_steps(None, 2) == 2
    ids.extend([3, 3])  # the run's tokens; step 1 writes token 7's KV, completing block 1
    run.advance_many(2, [[], [(0, ids, 8)]])
    assert m.prefix_index.registration(0)[0] == 2
    assert m.prefix_index.match([3, 4, 4, 3, 4, 3, 4, 3, 9], None).num_blocks == 2
    m.check()


def test_a_decode_block_in_an_array_prompts_tail_is_batched_under_its_own_ids():
    """A trace prompt (``ArrayTokenIds``) of 4 ids whose decode tokens fill block 1 from
    its appended tail: the commit joins the batch (it leaves the token ids' key chain
    behind, as only the batch does: a plain commit would key the chain to block 1) and
    registers the block under the key of its own ids (a list of the same ids matches
    both blocks; a different tail does not match block 1)."""
    m = PagedKVManager(16, BS, 1, BlockHashPrefixIndex())
    ids = ArrayTokenIds(np.array([3, 4, 4, 3], dtype=np.int64))
    m.allocate(0, ids, BS, None)
    m.commit(0, ids)  # block 0, which keys the chain
    m.append(0, BS)
    ids.extend([4, 3, 3, 4])
    m.commit_many([(0, ids, 2 * BS)])
    assert m.prefix_index.registration(0)[0] == 2
    assert ids.key_chain is not None and ids.key_chain.num_blocks == 1  # batched: chain left behind
    assert m.prefix_index.match([3, 4, 4, 3, 4, 3, 3, 4, 9], None).num_blocks == 2
    assert m.prefix_index.match([3, 4, 4, 3, 3, 4, 3, 4, 9], None).num_blocks == 1
    m.check()


_FOUR_PROMPTS = [[4, 4, 4, 4, 3, 3, 3, 3], [4, 4, 3], [3, 3, 3, 3, 4, 4], [3, 4, 4, 3, 3]]


def _declines(monkeypatch) -> list[bool]:
    """Whether each ``allocate_decode_steps`` call from now on declined (returned None),
    in call order: a list the spy appends to."""
    declined: list[bool] = []
    allocate = BlockHashPrefixIndex.allocate_decode_steps

    def spy(self, pool, needs, commits):
        taken = allocate(self, pool, needs, commits)
        declined.append(taken is None)
        return taken

    monkeypatch.setattr(BlockHashPrefixIndex, "allocate_decode_steps", spy)
    return declined


def test_a_declined_call_is_stepped_with_the_same_outcome(monkeypatch):
    """A call whose steps ``allocate_decode_steps`` declines (a first decode commit that
    completes two blocks) goes one step at a time, its blocks first taken back out of the
    tables, with the same outcome as stepping; the next call is one compiled pass."""
    declined = _declines(monkeypatch)
    # Seqs 0-2 take blocks in steps 0-2, seq 3 in step 3, seq 0 in step 4; seq 0
    # (uncommitted) first commits three blocks in step 3, so the first call (9 steps) is
    # declined: each step must hand its blocks to its own takers.
    uncommitted = [True, False, False, False]
    _decode_steps_against_stepping(_FOUR_PROMPTS, [[3, 4, 3, 4]], [9, 11, 6], 40, 7, uncommitted)
    assert declined[:2] == [True, False]


def test_a_call_registers_blocks_it_takes_in_one_compiled_pass(monkeypatch):
    """A call of three block-lengths of steps registers, in one compiled pass, blocks taken
    within it (each sequence takes a block in steps 0-3 and fills it by step 7), with the
    same outcome as stepping."""
    declined = _declines(monkeypatch)
    taken_steps = _decode_steps_against_stepping(_FOUR_PROMPTS, [[3, 4, 3, 4]], [3 * BS], 40, 7, [False] * 4)
    assert taken_steps == [3 * BS]
    assert declined == [False]


def _decode_steps_against_stepping(
    prompts, warm, calls, num_blocks, seed, uncommitted, block_size=BS, trim_commits=False
):
    """The body of the tests above: ``calls`` the steps asked of each ``advance_many``
    call (fewer when the free blocks cover fewer), ``uncommitted[i]`` leaves prompt ``i``
    uncommitted; ``trim_commits`` leaves out a call's trailing steps that commit nothing
    (``commits`` shorter than the steps). Returns the steps each call took."""
    rng = np.random.default_rng(seed)
    managers = [PagedKVManager(num_blocks, block_size, 1, BlockHashPrefixIndex()) for _ in range(2)]
    for m in managers:  # cached-free blocks from finished requests
        for seq_id, prompt in enumerate(warm, start=100):
            ids = KeyedTokenIds(prompt)
            if m.can_allocate(seq_id, ids, len(prompt) - m.num_cached_tokens(ids, None), None):
                m.allocate(seq_id, ids, len(prompt) - m.num_cached_tokens(ids, None), None)
                m.commit(seq_id, ids)
                m.free(seq_id)
    tokens: list[dict[int, KeyedTokenIds]] = [{}, {}]
    first_token = rng.integers(3, 5, size=len(prompts)).tolist()
    for seq_id, prompt in enumerate(prompts):
        ids = KeyedTokenIds(prompt)
        cached = managers[0].num_cached_tokens(ids, None)
        if not managers[0].can_allocate(seq_id, ids, len(prompt) - cached, None):
            break
        for m, tok in zip(managers, tokens):
            ids = KeyedTokenIds(prompt)
            m.allocate(seq_id, ids, len(prompt) - cached, None)
            if not uncommitted[seq_id]:
                m.commit(seq_id, ids)
            ids.append(first_token[seq_id])  # decode state: the newest token lacks KV
            tok[seq_id] = ids
    live = sorted(tokens[0])
    taken_steps: list[int] = []
    if not live:
        return taken_steps
    runs = [m.decode_run(live) for m in managers]
    for asked in calls:
        num_steps = runs[0].num_quiet_steps(None, asked)
        if num_steps == 0:
            break
        taken_steps.append(num_steps)
        new = rng.integers(3, 5, size=(len(live), num_steps)).tolist()
        commits: list[list[list[tuple[int, object, int]]]] = [
            [[] for _ in range(num_steps)] for _ in range(2)
        ]
        for tok, per_step in zip(tokens, commits):
            for seq_id, row in zip(live, new):
                ids = tok[seq_id]
                first = len(ids)
                ids.extend(row)  # the run's tokens, appended before its slots are reserved
                for step in range(-first % block_size, num_steps, block_size):
                    per_step[step].append((seq_id, ids, first + step))
        given = commits[0]
        while trim_commits and given and not given[-1]:
            given = given[:-1]
        reported = runs[0].advance_many(num_steps, given)
        stepped = managers[1]
        for step, (*counts, num_reused) in enumerate(reported):
            evicted = stepped.num_evicted_blocks
            runs[1].advance()
            assert (tuple(counts), num_reused) == (
                stepped.usage_counts(),
                stepped.num_evicted_blocks - evicted,
            )
            stepped.commit_many(commits[1][step])
        for m in managers:
            m.check()
        assert _state(managers[0], tokens[0], [p for p in prompts]) == _state(stepped, tokens[1], prompts)
    return taken_steps
