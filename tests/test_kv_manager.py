"""PagedKVManager: exact scenarios plus a random-operation state machine per prefix index.

The state machine keeps a shadow KV memory (one token id per slot) and applies the
returned KVOps like an executor would, so it checks contents, not just counts: every
token a live sequence has written must be readable through its block table.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.prefix_cache import BlockHashPrefixIndex, NullPrefixIndex
from kvbench.engines.kv.protocol import COMMITS_REGISTER_NOTHING, KVCapacityError, KVOps
from kvbench.engines.kv.radix_cache import RadixPrefixIndex
from kvbench.engines.kv.token_ids import KeyedTokenIds
from kvbench.types import KVUsage

BS = 4
SYSTEM = [100, 101, 102, 103, 104, 105, 106, 107]  # two full blocks


def make(
    index=None, num_blocks=8, num_host_blocks=0, bytes_per_token=10, fast_appends=True
) -> PagedKVManager:
    m = PagedKVManager(
        num_blocks=num_blocks,
        block_size=BS,
        bytes_per_token=bytes_per_token,
        prefix_index=index if index is not None else BlockHashPrefixIndex(),
        num_host_blocks=num_host_blocks,
    )
    m.fast_appends = fast_appends  # False: the general path only (the append differential)
    return m


def prefill(m: PagedKVManager, seq_id: int, tokens: list[int], extra_key=None) -> tuple[int, KVOps]:
    """Allocate the whole prompt at once and commit it (as a scheduler would after the step)."""
    cached = m.num_cached_tokens(tokens, extra_key)
    result = m.allocate(seq_id, tokens, len(tokens) - cached, extra_key)
    m.commit(seq_id, tokens)
    m.check()
    return result


# --------------------------------------------------------------------------- scenarios
def test_shared_system_prompt_hits_whole_blocks_and_counts_tokens():
    m = make()
    a = SYSTEM + [1, 2, 3]
    b = SYSTEM + [7, 8]
    assert prefill(m, 0, a) == (0, KVOps())
    assert m.block_table(0) == [0, 1, 2]
    assert m.num_cached_tokens(b, None) == 8
    assert prefill(m, 1, b) == (8, KVOps())
    assert m.block_table(1) == [0, 1, 3]  # shares the two system-prompt blocks
    assert m.pool.ref_count(0) == 2 and m.pool.ref_count(1) == 2
    assert (m.num_prefix_query_tokens, m.num_prefix_hit_tokens) == (21, 8)
    usage = m.usage()
    assert usage.num_blocks_in_use == 4  # shared blocks count once
    assert usage.token_bytes == (8 + 3 + 2) * 10
    assert usage.allocated_bytes == 4 * BS * 10
    assert usage.internal_frag_bytes == usage.allocated_bytes - usage.token_bytes


def test_fully_cached_prompt_still_computes_its_last_token():
    m = make()
    prefill(m, 0, SYSTEM)
    m.free(0)
    # 8 tokens all cached, but the hit is capped at 7 and then block aligned: one block.
    assert m.num_cached_tokens(SYSTEM, None) == 4
    assert m.allocate(1, SYSTEM, 4, None) == (4, KVOps())
    m.check()


def test_extra_key_separates_caches():
    m = make()
    prefill(m, 0, SYSTEM + [1], extra_key="salt-a")
    assert m.num_cached_tokens(SYSTEM + [1], "salt-a") == 8
    assert m.num_cached_tokens(SYSTEM + [1], "salt-b") == 0
    assert m.num_cached_tokens(SYSTEM + [1], None) == 0


def test_freed_blocks_stay_cached_and_are_revived_by_a_later_hit():
    m = make()
    prefill(m, 0, SYSTEM + [1])
    m.free(0)
    usage = m.usage()
    assert (usage.num_blocks_in_use, usage.num_blocks_cached_free, usage.num_blocks_free) == (0, 2, 6)
    assert usage.cached_bytes == 2 * BS * 10 and usage.allocated_bytes == 0
    assert prefill(m, 1, SYSTEM + [2])[0] == 8
    assert m.block_table(1)[:2] == [0, 1]
    assert m.usage().num_blocks_cached_free == 0


def test_eviction_under_pressure_takes_the_least_recently_freed_tail_first():
    m = make(num_blocks=6)
    a = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]  # 3 full blocks + 1 partial
    prefill(m, 0, a)
    assert m.block_table(0) == [0, 1, 2, 3]
    m.free(0)  # freed tail first: 3, 2, 1, 0
    assert m.pool.free_blocks() == [4, 5, 3, 2, 1, 0]
    # A new 3-block request takes the never-used blocks, then block 3 (uncached partial).
    prefill(m, 1, [9] * 12)
    assert m.block_table(1) == [4, 5, 3] and m.num_evicted_blocks == 0
    # The next block comes from the cached tail of the old prompt: block 2 is evicted first.
    prefill(m, 2, [8] * 3)
    assert m.block_table(2) == [2] and m.num_evicted_blocks == 1
    # The shared head of the old prompt is still cached.
    assert m.num_cached_tokens(a, None) == 8


def test_fork_then_divergent_append_copies_the_shared_partial_block_once():
    m = make(index=NullPrefixIndex())
    prefill(m, 0, [1, 2, 3, 4, 5, 6])
    assert m.block_table(0) == [0, 1]
    m.fork(0, 1)
    m.check()
    assert m.pool.ref_count(1) == 2
    # The first sibling to write claims slot 2 of block 1 in place ...
    assert m.append(0, 1) == KVOps()
    assert m.block_table(0) == [0, 1]
    # ... the second must copy the block before writing its own token there.
    assert m.append(1, 1) == KVOps(copies=((1, 2),))
    assert m.block_table(1) == [0, 2] and m.num_cow_copies == 1
    # Now each owns its last block: no more copies.
    assert m.append(1, 1) == KVOps() and m.append(0, 1) == KVOps()
    assert m.slot_mapping(1, 4, 8) == [8, 9, 10, 11]
    assert m.slot_mapping(0, 6, 8) == [6, 7]
    m.check()


def test_sibling_left_alone_copies_a_block_its_parent_filled_and_registered():
    m = make()
    prefill(m, 0, [1, 2, 3, 4, 5, 6])
    m.fork(0, 1)
    m.append(0, 2)  # parent fills block 1 in place ...
    m.commit(0, [1, 2, 3, 4, 5, 6, 7, 8])  # ... and registers it
    m.free(0)
    assert m.pool.ref_count(1) == 1 and m.pool.is_cached(1)
    # The child is now the only holder, but overwriting slot 2 would corrupt the cache.
    assert m.append(1, 1) == KVOps(copies=((1, 2),))
    assert m.num_cached_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9], None) == 8
    m.check()


def test_beam_search_fork_and_free_of_dropped_beams_leaks_nothing():
    m = make(index=NullPrefixIndex())
    prefill(m, 0, [1, 2, 3])
    for child in (1, 2, 3):
        m.fork(0, child)
    for seq in (0, 1, 2, 3):
        m.append(seq, 2)
    m.check()
    m.free(2)
    m.free(3)
    m.fork(1, 4)
    m.check()
    for seq in (0, 1, 4):
        m.free(seq)
    m.check()
    assert m.pool.num_free == 8 and m.usage().allocated_bytes == 0


def test_chunked_prefill_allocates_per_chunk_and_registers_full_blocks_on_commit():
    m = make()
    prompt = SYSTEM + [1, 2, 3]
    assert m.allocate(0, prompt, 5, None) == (0, KVOps())
    assert m.num_tokens(0) == 5 and m.block_table(0) == [0, 1]
    m.commit(0, prompt[:5])
    assert m.num_cached_tokens(prompt, None) == 4
    assert m.append(0, 6) == KVOps()
    m.commit(0, prompt)
    assert m.block_table(0) == [0, 1, 2] and m.num_cached_tokens(prompt + [5], None) == 8
    with pytest.raises(ValueError, match="commits 12 tokens but has 11 slots"):
        m.commit(0, [*prompt, 9])
    m.check()


def test_swap_moves_only_sole_owned_blocks_and_back():
    m = make(num_host_blocks=2)
    prefill(m, 0, SYSTEM + [1, 2, 3, 4, 5])  # blocks 0 1 2 3
    prefill(m, 1, SYSTEM + [6])  # shares 0 1, owns 4
    assert m.block_table(1) == [0, 1, 4]
    assert m.can_swap_out(0)
    ops = m.swap_out(0)
    assert ops == KVOps(swap_out=((2, 0), (3, 1)))
    assert m.is_swapped(0) and m.bytes_swapped_out == 2 * BS * 10
    m.check()
    usage = m.usage()
    assert usage.host_bytes == 2 * BS * 10 and usage.num_blocks_in_use == 3
    assert not m.can_swap_out(1)  # host pool full
    with pytest.raises(ValueError, match="swapped out"):
        m.block_table(0)
    assert m.can_swap_in(0)
    ops = m.swap_in(0)
    assert [h for h, _ in ops.swap_in] == [0, 1]
    assert m.block_table(0)[:2] == [0, 1] and m.bytes_swapped_in == 2 * BS * 10
    m.check()
    m.free(0)
    m.free(1)
    m.check()
    assert m.usage().host_bytes == 0


@pytest.mark.parametrize("fast", [True, False])
def test_append_decodes_copies_in_order_and_stops_before_a_sequence_without_room(fast):
    """One slot per sequence in order, as ``append`` one by one: a fork's siblings write
    their shared partial block in place (the first) and by copy (the second); a batch
    stops before the first sequence that has no block left, which stays as it was, with
    the count of those appended; an unknown one raises KeyError after those before it."""
    m = make(index=NullPrefixIndex(), num_blocks=5, fast_appends=fast)
    prefill(m, 0, [1, 2, 3, 4, 5, 6])  # blocks 0 and 1, two slots of 1 claimed
    m.fork(0, 1)
    prefill(m, 2, [7, 8, 9, 10])  # block 2, full
    assert m.append_decodes([0, 1, 2]) == (3, [KVOps(copies=((1, 3),))])
    assert (m.block_table(0), m.block_table(1), m.block_table(2)) == ([0, 1], [0, 3], [2, 4])
    assert [m.num_tokens(s) for s in (0, 1, 2)] == [7, 7, 5]
    m.check()
    m.append(0, 1)  # seq 0's table is full now, and no block is free
    assert m.pool.num_free == 0
    assert m.append_decodes([2, 0, 1]) == (1, [])
    assert [m.num_tokens(s) for s in (0, 1, 2)] == [8, 7, 6]
    assert not m.can_append(0, 1)
    m.check()
    with pytest.raises(KeyError, match="unknown seq 9"):
        m.append_decodes([2, 9])
    assert m.num_tokens(2) == 7
    m.check()


def test_capacity_errors_and_misuse():
    m = make(num_blocks=2)
    assert not m.can_allocate(0, list(range(9)), 9, None)
    with pytest.raises(KVCapacityError, match="seq 0 needs 3 blocks, 2 allocatable"):
        m.allocate(0, list(range(9)), 9, None)
    assert not m.has_seq(0)
    m.allocate(0, [1, 2, 3, 4], 4, None)
    with pytest.raises(ValueError, match="seq 0 already exists"):
        m.allocate(0, [1], 1, None)
    with pytest.raises(KeyError, match="unknown seq 7"):
        m.append(7, 1)
    assert m.can_append(0, 4) and not m.can_append(0, 5)
    with pytest.raises(KVCapacityError):
        m.append(0, 5)
    with pytest.raises(ValueError, match=r"range \[2, 5\) outside its 4 slots"):
        m.slot_mapping(0, 2, 5)
    with pytest.raises(ValueError, match="is not swapped out"):
        m.swap_in(0)
    with pytest.raises(ValueError, match="block_size"):
        PagedKVManager(4, 0, 1, NullPrefixIndex())
    with pytest.raises(ValueError, match="already bound"):
        index = NullPrefixIndex()
        make(index)
        make(index)


def test_check_reports_a_reference_count_that_disagrees_with_block_tables():
    m = make()
    prefill(m, 0, [1, 2, 3])
    m.pool.incref(0)  # a reference nobody accounts for
    with pytest.raises(AssertionError, match="block 0: ref_count=2 but 1 block-table refs"):
        m.check()


def test_commit_interval_skips_the_decode_commits_that_register_nothing():
    # Without a prefix cache none registers anything; block-hash keys register a block
    # once it is full; the radix tree extends with every token.
    intervals = {
        index_cls.__name__: PagedKVManager(8, 4, 2, index_cls()).commit_interval
        for index_cls in (NullPrefixIndex, BlockHashPrefixIndex, RadixPrefixIndex)
    }
    assert intervals == {
        "NullPrefixIndex": COMMITS_REGISTER_NOTHING,
        "BlockHashPrefixIndex": 4,
        "RadixPrefixIndex": 1,
    }


def test_usage_of_an_empty_manager():
    m = make(num_blocks=3, bytes_per_token=7)
    assert m.usage() == KVUsage(
        capacity_bytes=3 * BS * 7,
        allocated_bytes=0,
        token_bytes=0,
        num_blocks_total=3,
        num_blocks_free=3,
    )


def test_usage_names_each_field_of_a_manager_holding_every_kind_of_block():
    """usage_of builds KVUsage positionally and _count_values returns a tuple: a manager
    whose figures all differ (a swapped sequence, a cached free block, a partial block)
    pins each to its field by name, in usage() and in usage_columns."""
    m = make(num_blocks=12, num_host_blocks=3, bytes_per_token=7)
    prefill(m, 0, SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8])  # blocks 0-3, all full
    prefill(m, 1, SYSTEM + [6, 6, 6, 6, 6])  # shares 0 1, owns 4 and 5 (partial): 13 slots
    prefill(m, 2, [9, 9, 9, 9, 9])  # owns 6 and 7 (partial)
    m.free(2)  # 6 (full, committed) stays cached; 7 is free and uncached
    m.swap_out(0)  # its own 2 and 3 go to the host, staying cached on the device
    per_block = BS * 7
    assert m.usage() == KVUsage(
        capacity_bytes=12 * per_block,
        allocated_bytes=4 * per_block,  # 0 1 4 5
        token_bytes=13 * 7,  # seq 1's slots
        internal_frag_bytes=4 * per_block - 13 * 7,
        cached_bytes=3 * per_block,  # 2 3 6
        host_bytes=2 * per_block,
        num_blocks_total=12,
        num_blocks_in_use=4,
        num_blocks_cached_free=3,
        num_blocks_free=5,
    )
    usage = m.usage()
    columns = m.usage_columns([m.usage_counts()])
    assert columns == {path: [getattr(usage, path[len("kv.") :])] for path in columns}
    assert len(columns) == 7 and len({values[0] for values in columns.values()}) == 7


# --------------------------------------------------------------------------- state machine
INDEXES = {"null": NullPrefixIndex, "hash": BlockHashPrefixIndex, "radix": RadixPrefixIndex}
PROMPT_STEMS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 1], [3, 3, 3, 3, 3]]


class ManagerMachine(RuleBasedStateMachine):
    index_cls: type = NullPrefixIndex
    NUM_BLOCKS = 10

    def __init__(self) -> None:
        super().__init__()
        self.m = PagedKVManager(self.NUM_BLOCKS, BS, 2, self.index_cls(), num_host_blocks=3)
        self.device: dict[int, list[int | None]] = {b: [None] * BS for b in range(self.NUM_BLOCKS)}
        self.host: dict[int, list[int | None]] = {b: [None] * BS for b in range(3)}
        self.tokens: dict[int, list[int]] = {}  # full token list (prompt + sampled) per seq
        self.written: dict[int, int] = {}  # positions whose KV is written
        self.next_id = 0

    # executor stand-in
    def _apply(self, ops: KVOps) -> None:
        for src, dst in ops.copies:
            self.device[dst] = list(self.device[src])
        for dev, host in ops.swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in ops.swap_in:
            self.device[dev] = list(self.host[host])

    def _write(self, seq: int, start: int, end: int) -> None:
        for p, slot in zip(range(start, end), self.m.slot_mapping(seq, start, end)):
            self.device[slot // BS][slot % BS] = self.tokens[seq][p]
        self.written[seq] = end
        self.m.commit(seq, self.tokens[seq][:end])

    def _resident(self) -> list[int]:
        return [s for s in self.tokens if not self.m.is_swapped(s)]

    @rule(
        stem=st.sampled_from(PROMPT_STEMS),
        tail=st.lists(st.integers(1, 3), max_size=6),
        chunk=st.integers(1, 9),
    )
    def allocate(self, stem, tail, chunk):
        prompt = stem + tail
        seq = self.next_id
        cached = self.m.num_cached_tokens(prompt, None)
        assert cached <= len(prompt) - 1
        chunk = min(chunk, len(prompt) - cached)
        if not self.m.can_allocate(seq, prompt, chunk, None):
            with pytest.raises(KVCapacityError):
                self.m.allocate(seq, prompt, chunk, None)
            return
        self.next_id += 1
        got, ops = self.m.allocate(seq, prompt, chunk, None)
        # A radix match ending mid-block is cut to its full blocks when only that fits.
        assert got in (cached, cached - cached % self.m.block_size)
        self._apply(ops)
        self.tokens[seq] = list(prompt)
        # The attached prefix must already hold the prompt's tokens.
        for p, slot in zip(range(got), self.m.slot_mapping(seq, 0, got)):
            assert self.device[slot // BS][slot % BS] == prompt[p], f"cached slot {slot} holds wrong token"
        self._write(seq, got, got + chunk)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 5), token=st.integers(1, 3))
    def append(self, data, n, token):
        candidates = self._resident()
        if candidates:
            self._step([data.draw(st.sampled_from(candidates))], n, [token])

    @precondition(lambda self: self.tokens)
    @rule(n=st.integers(1, 5), tokens=st.lists(st.integers(1, 3), min_size=8, max_size=8))
    def step(self, n, tokens):
        # One engine iteration: every resident sequence gets a prefill chunk or a decode token.
        self._step(self._resident(), n, tokens * 4)

    def _step(self, seqs: list[int], n: int, tokens: list[int]) -> None:
        """Scheduler phase (append every sequence), then the executor applies all ops, then
        the forward pass writes every new token: ops must be valid before any write."""
        writes = []
        ops = []
        for seq, token in zip(seqs, tokens):
            done = self.written[seq]
            grow = min(n, len(self.tokens[seq]) - done) if done < len(self.tokens[seq]) else 1
            if not self.m.can_append(seq, grow):
                with pytest.raises(KVCapacityError):
                    self.m.append(seq, grow)
                continue
            ops.append(self.m.append(seq, grow))
            if done + grow > len(self.tokens[seq]):
                self.tokens[seq].append(token)  # decode: the sampled token
            writes.append((seq, done, done + grow))
        for op in ops:
            self._apply(op)
        for seq, start, end in writes:
            self._write(seq, start, end)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        candidates = [s for s in self._resident() if self.written[s] == self.m.num_tokens(s)]
        if not candidates:
            return
        parent = data.draw(st.sampled_from(candidates))
        child = self.next_id
        self.next_id += 1
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.written[child] = self.written[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(seq)
        del self.tokens[seq], self.written[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.m.is_swapped(seq):
            if self.m.can_swap_in(seq):
                self._apply(self.m.swap_in(seq))
        elif self.m.can_swap_out(seq):
            self._apply(self.m.swap_out(seq))

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        before = self.m.pool.num_free
        freed = self.m.prefix_index.evict(n)
        assert self.m.pool.num_free == before + freed

    @invariant()
    def consistent(self):
        self.m.check()
        resident = self._resident()
        # The step's read of every chunk's table (PagedKVManager.block_tables' fast path)
        # is block_table per sequence, in the order asked, as Python ints; a swapped-out
        # or unknown sequence among them raises as block_table does for it.
        tables = self.m.block_tables(resident[::-1])
        assert tables == [self.m.block_table(seq) for seq in resident[::-1]]
        assert all(type(block) is int for table in tables for block in table)
        if resident:  # each entry a copy of its own, even for a sequence named twice
            first, again = self.m.block_tables([resident[0], resident[0]])
            first.append(-1)
            assert again == self.m.block_table(resident[0]) != first
        for seq in self.tokens.keys() - set(resident):
            with pytest.raises(ValueError, match=f"^block_table: seq {seq} is swapped out"):
                self.m.block_tables([*resident, seq])
        with pytest.raises(KeyError, match="unknown seq -1"):
            self.m.block_tables([*resident, -1])
        for seq in resident:
            written = self.written[seq]
            for p, slot in zip(range(written), self.m.slot_mapping(seq, 0, written)):
                assert self.device[slot // BS][slot % BS] == self.tokens[seq][p], (
                    f"seq {seq} position {p}: slot {slot} holds the wrong token"
                )
        usage = self.m.usage()
        assert (
            usage.num_blocks_free + usage.num_blocks_in_use + usage.num_blocks_cached_free == self.NUM_BLOCKS
        )

    def teardown(self):
        for seq in sorted(self.tokens):
            self.m.free(seq)
        self.m.check()
        self.m.prefix_index.evict(self.NUM_BLOCKS)
        self.m.check()
        # No block leaked: everything is free (cached-free counts as free).
        assert self.m.pool.num_free == self.NUM_BLOCKS
        assert self.m.host_pool.num_free == 3
        assert self.m.usage().allocated_bytes == 0


@pytest.mark.parametrize("index_name", sorted(INDEXES))
def test_random_operations_keep_invariants_and_contents(index_name):
    machine = type(f"ManagerMachine_{index_name}", (ManagerMachine,), {"index_cls": INDEXES[index_name]})
    machine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
    machine.TestCase("runTest").runTest()


# One operation of the append differential: (kind, which sequence, how many / which stem).
_append_op_st = st.tuples(
    st.sampled_from(["allocate", "append", "append", "decodes", "decodes", "commit", "fork", "free", "swap"]),
    st.integers(0, 7),
    st.integers(0, 9),
)


@pytest.mark.parametrize("index_name", sorted(INDEXES))
@given(ops=st.lists(_append_op_st, min_size=30, max_size=80), num_blocks=st.integers(3, 8))
@settings(max_examples=60, deadline=None)
def test_append_fast_paths_equal_the_general_path(index_name, ops, num_blocks):
    """``append_decodes`` (also behind ``append`` of one slot) and ``can_append`` with their
    fast paths (``fast_appends``: a claim in the partial last block, one fresh block for
    a full table) leave what the general path leaves: the same answers, counts, KV ops and
    errors, block tables, per-block claims and sequence references, the pool's state and
    counters (its free list's order included), usage and evictions, op by op. Small pools
    run out, so the fresh-block path meets an empty free list (cached-free and, with
    radix, reclaimable blocks) and a batch stops where a sequence has no room; forks make
    claims the partial-block path must copy around; appends of 0 slots and to swapped
    sequences must fail or pass as the general path does, a batch's sequences before a
    swapped one appended. The exact cases are pinned below."""

    fast, plain = (
        make(INDEXES[index_name](), num_blocks, num_host_blocks=4, bytes_per_token=2, fast_appends=fast)
        for fast in (True, False)
    )
    tokens: dict[int, list[int]] = {}
    next_id = 0

    def both(method: str, *args):
        """``method(*args)`` on both managers: the same result or the same error type."""
        results = []
        for m in (fast, plain):
            try:
                results.append(("ok", getattr(m, method)(*args)))
            except (KVCapacityError, MemoryError, ValueError) as error:
                results.append((type(error), None))
        assert results[0] == results[1]
        return results[0]

    for kind, which, n in ops:
        live = sorted(tokens)
        seq = live[which % len(live)] if live else None
        if kind == "allocate" or seq is None:
            prompt = PROMPT_STEMS[n % len(PROMPT_STEMS)] + [1 + n % 3] * (n % 5)
            cached = both("num_cached_tokens", prompt, None)[1]
            outcome = both("allocate", next_id, prompt, len(prompt) - cached, None)
            if outcome[0] == "ok":
                tokens[next_id] = list(prompt)
            next_id += 1
        elif kind == "append":
            grow = n % (2 * BS + 1)  # 0 included
            swapped = fast.is_swapped(seq)
            fits = None if swapped else both("can_append", seq, grow)[1]
            outcome = both("append", seq, grow)[0]
            assert (outcome == "ok") == (fits is True), (fits, outcome)  # can_append is append's answer
            if outcome == "ok":
                tokens[seq] += [1 + (n + i) % 3 for i in range(grow)]
        elif kind == "decodes":
            batch = [live[(which + k) % len(live)] for k in range(1 + n % 3)]
            both("append_decodes", batch)
            for s in set(batch):  # the tokens of the slots each gained (a seq may repeat)
                tokens[s] += [1 + (n + i) % 3 for i in range(fast.num_tokens(s) - len(tokens[s]))]
        elif kind == "commit" and not fast.is_swapped(seq):
            both("commit", seq, tokens[seq][: fast.num_tokens(seq)])
        elif kind == "fork" and not fast.is_swapped(seq):
            both("fork", seq, next_id)
            tokens[next_id] = list(tokens[seq])
            next_id += 1
        elif kind == "free":
            both("free", seq)
            del tokens[seq]
        elif kind == "swap":
            if fast.is_swapped(seq):
                if both("can_swap_in", seq)[1]:
                    both("swap_in", seq)
            elif both("can_swap_out", seq)[1]:
                both("swap_out", seq)
        fast.check()
        plain.check()
        resident = [s for s in sorted(tokens) if not fast.is_swapped(s)]
        assert _decode_state(fast, resident) == _decode_state(plain, resident)
        assert fast._claimed.tolist() == plain._claimed.tolist()
        assert fast._seq_refs.tolist() == plain._seq_refs.tolist()
        assert fast.pool.state.tolist() == plain.pool.state.tolist()
        assert fast.pool.counts.tolist() == plain.pool.counts.tolist()
        assert fast.prefix_index.block_refs() == plain.prefix_index.block_refs()
        assert fast.prefix_index.num_evicted_blocks == plain.prefix_index.num_evicted_blocks


@pytest.mark.parametrize("index_name", ["hash", "radix"])
def test_a_crossing_append_takes_a_cached_block_as_the_general_path_does(index_name):
    """A full table's next slot when only cached blocks are left: the block-hash pool pops a
    cached-free block (the fast path; the index hears of it and drops its registration),
    the radix pool has none free and its index evicts a reclaimable one (the general path
    behind it). Both leave what the general path alone leaves."""

    def run(fast: bool) -> tuple:
        m = make(INDEXES[index_name](), num_blocks=4, fast_appends=fast)
        prefill(m, 9, SYSTEM)
        cached = m.block_table(9)
        m.free(9)  # two cached blocks: cached-free (hash) or reclaimable (radix)
        prefill(m, 0, [7] * BS)  # a full table: its next append crosses
        prefill(m, 1, [8] * BS)  # takes the last block that holds nothing
        assert m.pool.num_free == (2 if index_name == "hash" else 0)
        evicted = m.num_evicted_blocks
        ops = m.append_decodes([0])
        m.check()
        assert ops == (1, [])
        assert m.block_table(0)[-1] in cached
        assert m.num_evicted_blocks > evicted  # hash: the popped block's registration
        return ops, _decode_state(m, [0, 1]), m.pool.state.tolist(), m._claimed.tolist()

    assert run(True) == run(False)


def test_append_of_no_slots_at_a_block_boundary_and_to_a_swapped_sequence():
    """Both paths: 0 slots change nothing; a swapped-out sequence cannot grow, alone or in
    a decode batch."""
    for fast in (True, False):
        m = make(NullPrefixIndex(), num_blocks=4, num_host_blocks=4, fast_appends=fast)
        prefill(m, 0, [7] * BS)
        before = (_decode_state(m, [0]), m._claimed.tolist())
        assert m.can_append(0, 0)
        assert m.append(0, 0) == KVOps()
        assert (_decode_state(m, [0]), m._claimed.tolist()) == before
        m.swap_out(0)
        with pytest.raises(ValueError, match="seq 0 is swapped out"):
            m.append(0, 1)
        with pytest.raises(ValueError, match="seq 0 is swapped out"):
            m.append_decodes([0])
        m.check()


def _decode_state(m: PagedKVManager, seq_ids) -> tuple:
    return (
        [m.block_table(s) for s in seq_ids],
        [m.num_tokens(s) for s in seq_ids],
        m.usage(),
        m.pool.free_blocks(),
        m.num_evicted_blocks,
    )


@pytest.mark.parametrize("index_name", ["hash", "radix", "none"])
def test_decode_run_equals_appending_one_slot_per_sequence_in_order(index_name):
    """A PagedDecodeRun step leaves the state of append(seq, 1) for each sequence in order:
    block ids, claims, the free list and prefix-cache evictions included."""
    indexes = {"hash": BlockHashPrefixIndex, "radix": RadixPrefixIndex, "none": NullPrefixIndex}

    def setup() -> PagedKVManager:
        m = make(indexes[index_name](), num_blocks=14)
        prefill(m, 9, SYSTEM + [1, 2, 3])  # cached blocks to evict later
        m.free(9)
        for seq, length in ((0, 5), (1, 8), (2, 3)):
            prefill(m, seq, [50 + seq] * length)
        return m

    ids = [0, 1, 2]
    stepped, fast = setup(), setup()
    assert fast.can_decode_together(ids)
    run = fast.decode_run(ids)
    for _ in range(40):
        need = run.num_new_blocks()
        before = stepped.num_allocatable_blocks
        if need > before:
            with pytest.raises(KVCapacityError):
                run.advance()
            assert not all(stepped.can_append(s, 1) and stepped.append(s, 1) is not None for s in ids)
            break
        for s in ids:
            stepped.append(s, 1)
        assert before - stepped.num_allocatable_blocks == need  # the blocks the step really took
        run.advance()
        fast.check()
        assert _decode_state(fast, ids) == _decode_state(stepped, ids)
    else:
        pytest.fail("the pool never ran short")


def test_decode_run_refuses_siblings_sharing_a_partial_block():
    m = make()
    prefill(m, 0, [1, 2, 3, 4, 5, 6])  # a partial second block
    m.fork(0, 1)
    # The first sibling to write would claim slot 6; the second must then copy first.
    assert not m.can_decode_together([0, 1])
    with pytest.raises(ValueError, match="cannot decode together"):
        m.decode_run([0, 1])
    m.append(0, 1)
    m.append(1, 1)  # copy-on-write: the siblings now own their partial blocks
    assert m.can_decode_together([0, 1])
    assert not m.can_decode_together([0, 7])  # unknown sequence


def _stale_claim_setup(index, num_blocks: int = 16) -> PagedKVManager:
    """Seqs 0-2 mid-block, seq 0 holding stale claims (a freed fork sibling wrote ahead of
    it), and cached blocks in the free list for the run to evict."""
    m = make(index, num_blocks=num_blocks)
    prefill(m, 9, SYSTEM + [1, 2, 3])
    m.free(9)
    prefill(m, 0, [60] * 6)
    m.fork(0, 7)
    m.append(7, 1)  # the sibling claims slot 6 of seq 0's partial block in place
    m.free(7)
    for seq, length in ((1, 8), (2, 3)):
        prefill(m, seq, [50 + seq] * length)
    return m


@pytest.mark.parametrize("index_name", ["hash", "none"])
def test_advance_many_equals_advancing_step_by_step(index_name):
    """advance_many(k) leaves what k advance() calls leave, and reports each step's usage
    counts and evictions as they were after that step."""
    indexes = {"hash": BlockHashPrefixIndex, "none": NullPrefixIndex}
    ids = [0, 1, 2]
    stepped, fast = _stale_claim_setup(indexes[index_name]()), _stale_claim_setup(indexes[index_name]())
    assert stepped._claimed[stepped.block_table(0)[-1]] > 6 % BS  # the stale claim is there
    stepped_run, fast_run = stepped.decode_run(ids), fast.decode_run(ids)
    num_reused_total = 0
    for num_steps in (1, 3, 5, 2, 7, 7):
        num_steps = fast_run.num_quiet_steps(None, num_steps)  # fewer once the pool runs short
        reported = fast_run.advance_many(num_steps)
        assert len(reported) == num_steps
        for *counts, num_reused in reported:
            evicted = stepped.num_evicted_blocks
            stepped_run.advance()
            assert (tuple(counts), num_reused) == (
                stepped.usage_counts(),
                stepped.num_evicted_blocks - evicted,
            )
            num_reused_total += num_reused
        if reported:  # the counts' columns are the usage figures step by step
            columns = fast.usage_columns([tuple(step[:3]) for step in reported])
            assert {path: values[-1] for path, values in columns.items()} == {
                f"kv.{name}": getattr(stepped.usage(), name) for name in (p[3:] for p in columns)
            }
        fast.check()
        assert _decode_state(fast, ids) == _decode_state(stepped, ids)
    assert fast.pool.num_free < 3  # the steps ran the pool down...
    if index_name == "hash":
        assert num_reused_total == 2  # ...through both cached system-prompt blocks
    # More steps than the free blocks allow are refused, changing nothing.
    with pytest.raises(KVCapacityError):
        fast_run.advance_many(fast_run.num_quiet_steps(None, 40) + 1)
    assert _decode_state(fast, ids) == _decode_state(stepped, ids)


@pytest.mark.parametrize("block_size", [1, 2, 5, 16])
def test_advance_many_equals_advancing_step_by_step_at_any_block_size(block_size):
    """advance_many against advance at block sizes where every step, some steps or few
    steps take blocks; sequences start empty-tailed (a multiple of the block size), mid
    block and one slot short of a full block, and step counts cross block boundaries."""
    lengths = (block_size, 2 * block_size + 1, 3 * block_size - 1, 1)
    managers = []
    for _ in range(2):
        m = PagedKVManager(64, block_size, 1, BlockHashPrefixIndex())
        for seq_id, length in enumerate(lengths):
            prefill(m, seq_id, [10 + seq_id] * length)
        managers.append(m)
    fast, stepped = managers
    ids = list(range(len(lengths)))
    fast_run, stepped_run = fast.decode_run(ids), stepped.decode_run(ids)
    for num_steps in (1, block_size, 2 * block_size + 3, 1, block_size - 1):
        if num_steps == 0:
            continue
        fast_run.advance_many(num_steps)
        for _ in range(num_steps):
            stepped_run.advance()
        fast.check()
        assert _decode_state(fast, ids) == _decode_state(stepped, ids)
        assert fast_run.snapshot()[1:] == stepped_run.snapshot()[1:]
        assert [fast._claimed[fast.block_table(s)].tolist() for s in ids] == [
            stepped._claimed[stepped.block_table(s)].tolist() for s in ids
        ]


def test_num_quiet_steps_counts_steps_whose_blocks_keep_the_guarded_prompt_out():
    m = _stale_claim_setup(BlockHashPrefixIndex())
    run = m.decode_run([0, 1, 2])
    upcoming = m.pool.free_blocks()[:6]
    # Steps take 1, 0, 1, 1, 0, 1, ... blocks here (slot counts 7, 8, 3 with 4-slot blocks).
    needs = [run._at_boundary[-step % BS] for step in range(8)]
    taken_before = [sum(needs[:step]) for step in range(9)]
    head = SYSTEM + [1, 2, 3]  # matches seq 9's two cached-free blocks
    match = m.prefix_index.match(head, None).block_ids
    assert len(match) == 2 and set(match) <= set(m.pool.free_blocks())
    num_free = m.pool.num_free
    for budget in range(0, 2 * BS * num_free):
        if m.can_allocate(99, head, min(len(head) - 2 * BS, budget), None):
            continue  # a guard is only asked for a prompt that cannot start
        guard = m.admission_guard(head, None, [0, 1, 2], len(head), budget)
        assert guard is not None and guard.match_blocks.tolist() == list(match)
        safe = m.num_blocks_before_admission(guard, 6)
        assert run.num_quiet_steps(guard, 8) == max(step for step in range(9) if taken_before[step] <= safe)
    assert run.num_quiet_steps(None, 8) == 8  # nothing to guard: only free blocks bound it
    assert m.pool.free_blocks()[:6] == upcoming  # pure


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 6),
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=5),
    spare_blocks=st.integers(0, 30),
    steps_before=st.integers(0, 9),
    max_steps=st.integers(0, 60),
)
def test_num_quiet_steps_is_the_longest_stretch_of_steps_the_free_blocks_cover(
    block_size, lengths, spare_blocks, steps_before, max_steps
):
    """With nothing to guard, ``num_quiet_steps`` equals stepping a twin run while its next
    step's blocks are free, up to ``max_steps``, at any block size and any point of a run
    (the steps' blocks repeat with period ``block_size``)."""
    num_blocks = sum(-(-(length + steps_before) // block_size) for length in lengths) + spare_blocks
    managers = [PagedKVManager(num_blocks, block_size, 1, BlockHashPrefixIndex()) for _ in range(2)]
    runs = []
    for m in managers:
        for seq_id, length in enumerate(lengths):
            m.allocate(seq_id, [7 + seq_id] * length, length, None)
        runs.append(m.decode_run(list(range(len(lengths)))))
        for _ in range(steps_before):
            runs[-1].advance()
    run, twin = runs
    stepped = 0
    while stepped < max_steps and twin.num_new_blocks() <= managers[1].pool.num_free:
        twin.advance()
        stepped += 1
    assert run.num_quiet_steps(None, max_steps) == stepped


GUARD_SEEDS = 40


def _guarded_pool(seed: int) -> tuple[PagedKVManager, list[int], int]:
    """A nearly full pool whose free list holds finished prompts' cached blocks behind a
    few others, and a waiting prompt sharing a prefix of them that cannot start now:
    (manager, the prompt, its budget). The same for a seed."""
    rng = random.Random(seed)
    while True:
        num_blocks = rng.randint(12, 40)
        m = make(num_blocks=num_blocks)
        cached = [rng.randint(1, 9) for _ in range(BS * rng.randint(3, num_blocks // 3))]
        side_by_side = rng.random() < 0.5
        if side_by_side:
            # Two prompts prefilled side by side compute their shared first blocks twice:
            # the first commit registers them, the second only its own later blocks, and
            # freeing the first one earlier puts the prefix's head ahead of its tail in
            # the free list (taking one cuts the match short: the head may then fit).
            finished = [(0, cached[: BS * rng.randint(1, 2)] + [0]), (1, cached + [0])]
        else:
            finished = [(0, cached + [0])]
        for seq, tokens in finished:
            m.allocate(seq, tokens, len(tokens), None)
        for seq, tokens in finished:
            m.commit(seq, tokens)
        if rng.random() < 0.3:  # a running sequence holds the shared prefix's first blocks
            prefill(m, 1000, cached[: BS * rng.randint(1, len(cached) // BS)] + [77])
        # Running sequences fill the pool but for a few blocks, then the prompts finish.
        num_left = rng.randint(0, 3)
        seq = 2
        while m.pool.num_free > num_left:
            size = min(m.pool.num_free - num_left, rng.randint(1, 3)) * BS
            prefill(m, seq, [rng.randint(10, 19) for _ in range(size)])
            seq += 1
        for seq, _ in finished:
            m.free(seq)
        budget = BS * rng.randint(1, 10) - rng.randint(0, BS - 1)
        shared = len(cached) if side_by_side else BS * rng.randint(0, len(cached) // BS)
        head = cached[:shared] + [rng.randint(20, 29) for _ in range(rng.randint(1, budget + 2 * BS))]
        chunk = min(max(len(head) - m.num_cached_tokens(head, None), 0), budget)
        if not m.can_allocate(99, head, chunk, None):
            return m, head, budget


@pytest.mark.parametrize("seed", range(GUARD_SEEDS))
def test_blocks_before_admission_equal_can_allocate_after_each_block_taken(seed):
    """Differential: the blocks the guard lets go from the free list's head leave
    ``can_allocate`` False for the prompt's first chunk after each (its match losing every
    block taken), and the next one (when there is one) lets it start; checked by taking
    them for real, as a decode step takes them."""
    m, head, budget = _guarded_pool(seed)

    def fits(manager: PagedKVManager) -> bool:
        chunk = min(max(len(head) - manager.num_cached_tokens(head, None), 0), budget)
        return manager.can_allocate(99, head, chunk, None)

    guard = m.admission_guard(head, None, [], len(head), budget)
    assert guard is not None
    limit = m.pool.num_free
    safe = m.num_blocks_before_admission(guard, limit)
    assert 0 <= safe <= limit and m.num_blocks_before_admission(guard, safe // 2) == safe // 2
    for taken in range(1, min(safe + 1, limit) + 1):
        m.pool.allocate_array(1)  # drops the block's registration, cutting the match there
        assert fits(m) == (taken > safe), f"after {taken} blocks (safe: {safe} of {limit})"


def test_blocks_before_admission_cases_are_not_vacuous():
    """The seeds above meet each outcome: a matched block taken lets the prompt start,
    none does, or the free list ends first."""
    outcomes = set()
    for seed in range(GUARD_SEEDS):
        m, head, budget = _guarded_pool(seed)
        guard = m.admission_guard(head, None, [], len(head), budget)
        assert guard is not None
        limit = m.pool.num_free
        safe = m.num_blocks_before_admission(guard, limit)
        outcomes.add(("cut" if len(guard.match_blocks) else "no match", safe < limit))
    assert outcomes == {("cut", True), ("cut", False), ("no match", False)}


def test_match_may_grow_unless_no_sequence_can_extend_the_match():
    m = make(num_blocks=16)
    prefill(m, 0, SYSTEM + [1, 2, 3, 4, 5])  # registers SYSTEM's 2 blocks + [1, 2, 3, 4]
    m.free(0)
    head = SYSTEM + [1, 2, 3, 4, 6, 6, 6, 6, 9]  # matches 3 blocks, wants a 4th
    prefill(m, 1, [70] * 9)  # unrelated content
    index = m.prefix_index
    assert not index.match_may_grow(head, None, [1])
    guard = m.admission_guard(head, None, [1], len(head), 4)
    assert guard is not None and guard.match_blocks.tolist() == list(index.match(head, None).block_ids)
    # Seq 2 holds the head's first 3 blocks and decodes on from there: its next full
    # block could be exactly the key the head is missing.
    prefill(m, 2, SYSTEM + [1, 2, 3, 4, 6])
    assert index.match_may_grow(head, None, [1, 2])
    assert m.admission_guard(head, None, [1, 2], len(head), 4) is None
    # A head whose match is already whole cannot be extended by anyone.
    whole = SYSTEM + [1, 2, 3, 4, 7]
    assert not index.match_may_grow(whole, None, [1, 2])
    assert not NullPrefixIndex().match_may_grow(head, None, [1])
    assert RadixPrefixIndex().match_may_grow(head, None, [1])
    assert make(RadixPrefixIndex()).admission_guard(head, None, [], len(head), 4) is None


def test_a_whole_match_cut_by_a_reused_block_can_grow_back():
    """A match holding every block it may (so no frontier to extend) still may grow: once
    a decode step reuses one of its blocks, a running sequence whose keys equal the
    prompt's up to there can register that key again (here with the same tokens)."""
    m = make(num_blocks=8)
    prompt = list(range(10, 22)) + [99]  # three full blocks and one token
    prefill(m, 0, prompt)
    m.free(0)
    matched = m.prefix_index.match(prompt, None).block_ids
    assert len(matched) == 3  # whole: a match leaves the last token to compute
    prefill(m, 1, prompt[:5])  # attaches the first block, registers nothing new
    assert m.prefix_index.match_may_grow(prompt, None, [1])
    assert m.admission_guard(prompt, None, [1], len(prompt), 64) is None
    while matched[1] in m.pool.free_blocks():  # decode steps reuse the second block
        m.pool.allocate_array(1)
    assert m.num_cached_tokens(prompt, None) == BS
    m.append(1, 3)
    m.commit(1, prompt[: 2 * BS])  # the sequence's own second block, same tokens
    assert m.num_cached_tokens(prompt, None) > BS  # grown back past the cut


def test_admission_guard_of_a_memoised_head_follows_its_growing_match():
    """A head carrying its keys (KeyedTokenIds) keeps its match memo: when a registration
    extends the match, the next guard holds the new block too."""
    m = make(num_blocks=16)
    prefill(m, 0, SYSTEM + [1, 2, 3, 4, 5])  # registers SYSTEM's 2 blocks + [1, 2, 3, 4]
    m.free(0)
    head = KeyedTokenIds(SYSTEM + [1, 2, 3, 4, 6, 6, 6, 6, 9])  # matches 3 blocks, wants a 4th
    prefill(m, 1, [70] * 9)  # unrelated content
    guard = m.admission_guard(head, None, [1], len(head), 4)
    assert guard is not None and guard.match_blocks.tolist() == list(
        m.prefix_index.match(head, None).block_ids
    )
    assert len(guard.match_blocks) == 3
    prefill(m, 2, SYSTEM + [1, 2, 3, 4, 6, 6, 6, 6, 8])  # registers the head's 4th block
    guard = m.admission_guard(head, None, [1], len(head), 4)
    assert guard is not None and guard.match_blocks.tolist() == list(
        m.prefix_index.match(head, None).block_ids
    )
    assert len(guard.match_blocks) == 4
