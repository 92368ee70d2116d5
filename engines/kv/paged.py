"""Tensor-free paged KV accounting: block tables, prefix sharing, copy-on-write, swap.

The same object serves real mode and simulation mode: it never touches tensors. Tensor
work is returned as ``KVOps`` that the executor applies before the step's forward pass.

Sequence ``s`` (block_size 4, 10 token slots) and its block table::

    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .
    table      [  B5   ,   B2    ,  B7   ]     slot(p) = table[p // 4] * 4 + p % 4

Copy-on-write rule. Each block remembers how many of its leading slots have been claimed
(``_claimed``): reserved by some sequence's ``allocate``/``append``. A sequence growing into
slot ``o`` of its partial last block writes in place when nobody else holds the block or
nobody has claimed slot ``o`` yet; otherwise it copies the block to a fresh one first
(``KVOps.copies``). A block registered in the block-hash index counts as held. So after ``fork`` the first sibling to append writes in place and the
second copies, and a radix match ending mid-block copies only if another sequence
already wrote past the match.

Swap: a sequence's blocks that it alone holds (ref count 1) move to host block ids; blocks
it shares (fork siblings, prefix-cache entries held by the radix tree) stay resident and
stay referenced by the swapped sequence, because other holders still read them.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from kvbench.engines.kv import native
from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.prefix_cache import CommitEntry, PrefixIndex, PrefixMatch
from kvbench.engines.kv.protocol import (
    COMMITS_REGISTER_NOTHING,
    NO_OPS,
    AdmissionGuard,
    DecodeRun,
    KVCapacityError,
    KVOps,
    StepCommit,
)
from kvbench.engines.kv.token_ids import TokenPrefix, prefix_of
from kvbench.types import KVUsage, Request

if TYPE_CHECKING:
    from kvbench.engines.sched.sequence import SequenceGroup


class _Seq:
    __slots__ = ("block_ids", "num_tokens", "extra_key", "host_blocks")

    def __init__(self, block_ids: array[int], num_tokens: int, extra_key: str | None) -> None:
        # Device block ids in logical order; while swapped, entries listed in host_blocks
        # are host block ids instead. An int64 array ('q'), not a list: numpy reads and
        # writes it as one buffer (a commit's or a free's ids, a growth's fresh blocks)
        # instead of converting a Python int per block, whose objects lie scattered in
        # memory by the time a long sequence is freed.
        self.block_ids = block_ids
        self.num_tokens = num_tokens  # token slots allocated
        self.extra_key = extra_key
        self.host_blocks: dict[int, int] | None = None  # logical index -> host block; None: resident


def _table_of(block_ids: np.ndarray) -> array[int]:
    """A block table holding ``block_ids`` (int64 [n]), copied. Pure."""
    table = array("q")
    table.frombytes(block_ids.astype(np.int64, copy=False).tobytes())
    return table


# The KVUsage fields a paged manager's ``usage_counts`` determine, in the order
# ``PagedKVManager._count_values`` returns them.
_COUNT_FIELDS = (
    "allocated_bytes",
    "token_bytes",
    "internal_frag_bytes",
    "cached_bytes",
    "num_blocks_in_use",
    "num_blocks_cached_free",
    "num_blocks_free",
)


def usage_columns_of(
    count_fields: Callable[..., dict[str, Any]], counts: Sequence[tuple[int, ...]]
) -> dict[str, list[int]]:
    """``DecodeRunKV.usage_columns`` for a manager whose ``count_fields`` maps its
    ``usage_counts`` (ints, or int64 arrays of one value per step) to KVUsage fields:
    every field, one value per entry of ``counts``, keyed ``kv.<field>``. Pure."""
    columns = (np.array(column, dtype=np.int64) for column in zip(*counts))
    return {f"kv.{name}": values.tolist() for name, values in count_fields(*columns).items()}


def _append_one(append: Callable[[int, int], KVOps], seq_id: int, ops: list[KVOps]) -> bool:
    """``append(seq_id, 1)`` for ``append_decodes``: its KV ops go to ``ops`` unless they
    are ``NO_OPS``; False, changing nothing, where it raises KVCapacityError (misuse
    raises through). Mutates what ``append`` mutates and ``ops``."""
    try:
        new_ops = append(seq_id, 1)
    except KVCapacityError:
        return False
    if new_ops is not NO_OPS:
        ops.append(new_ops)
    return True


def check_sizes(
    owner: str, num_blocks: int, block_size: int, bytes_per_token: int, num_host_blocks: int = 0
) -> None:
    """Raise ValueError naming ``<owner>.<size>`` unless every size is an int >= 1
    (``num_host_blocks`` >= 0): the pool shape every KV manager is built with. Pure."""
    for name, value, low in (
        ("num_blocks", num_blocks, 1),
        ("block_size", block_size, 1),
        ("bytes_per_token", bytes_per_token, 1),
        ("num_host_blocks", num_host_blocks, 0),
    ):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{owner}.{name}: must be an int >= {low}, got {value!r}")


class SeqTable:
    """Per-sequence bookkeeping shared by the KV managers: lookups that name the
    sequence and the operation on misuse, and the plain ``append_decodes``. Subclasses
    keep ``_seqs`` (seq id -> state with ``block_ids``, ``num_tokens`` slots and
    ``host_blocks``, None while on the device) and ``block_size``, and define ``append``."""

    _seqs: dict[int, Any]
    block_size: int
    append: Callable[[int, int], KVOps]  # the subclass's (KVManager.append)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    # A manager whose capacity rule is the block count alone (paged, bounded) rejects no
    # request on its own (the scheduler checks the block count) and ignores the waiting
    # queue; the slab manager overrides all three (``engines/kv/protocol.py``).
    def reject_reason(self, request: Request) -> str | None:
        return None

    def waiting_entered(self, group: SequenceGroup) -> None:
        return None

    def waiting_left(self, group: SequenceGroup) -> None:
        return None

    def is_swapped(self, seq_id: int) -> bool:
        return self._seq(seq_id).host_blocks is not None

    def block_table(self, seq_id: int) -> list[int]:
        """Physical device block ids in logical order (a copy). ValueError if swapped out."""
        return list(self._resident(seq_id, "block_table").block_ids)

    def block_tables(self, seq_ids: Sequence[int]) -> list[list[int]]:
        """See ``KVManager.block_tables``: ``block_table`` for each (a manager with a faster
        way overrides this)."""
        return [self.block_table(seq_id) for seq_id in seq_ids]

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Physical slot ``block * block_size + offset`` for slots ``[start, end)``.

        ValueError when the sequence is swapped out or the range exceeds its slots.
        """
        seq = self._resident(seq_id, "slot_mapping")
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(
                f"slot_mapping: seq {seq_id} range [{start}, {end}) outside its {seq.num_tokens} slots"
            )
        bs = self.block_size
        table = seq.block_ids
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def append_decodes(self, seq_ids: Sequence[int]) -> tuple[int, list[KVOps]]:
        """See ``KVManager.append_decodes``: ``append(seq_id, 1)`` for each in turn (a
        manager with a faster way overrides this)."""
        ops: list[KVOps] = []
        for num_done, seq_id in enumerate(seq_ids):
            if not _append_one(self.append, seq_id, ops):
                return num_done, ops
        return len(seq_ids), ops

    def _check_new(self, seq_id: int, num_new_tokens: int, op: str) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"{op}: seq {seq_id} already exists")
        if num_new_tokens < 0:
            raise ValueError(f"{op}: seq {seq_id} num_new_tokens must be >= 0, got {num_new_tokens}")

    def _seq(self, seq_id: int) -> Any:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"{type(self).__name__}: unknown seq {seq_id}") from None

    def _resident(self, seq_id: int, op: str) -> Any:
        seq = self._seq(seq_id)
        if seq.host_blocks is not None:
            raise ValueError(f"{op}: seq {seq_id} is swapped out (swap_in first)")
        return seq

    def _swapped(self, seq_id: int, op: str) -> Any:
        seq = self._seq(seq_id)
        if seq.host_blocks is None:
            raise ValueError(f"{op}: seq {seq_id} is not swapped out")
        return seq


class PagedKVManager(SeqTable):
    """Block tables for live sequences over one device ``BlockPool`` and a host pool.

    Paired calls: ``can_allocate``/``allocate``, ``can_append``/``append``,
    ``can_swap_out``/``swap_out``, ``can_swap_in``/``swap_in``. A check call returns False
    when memory is short; the act call then raises ``KVCapacityError``. Misuse (unknown or
    duplicate seq id, acting on a swapped sequence, bad ranges) raises ``KeyError`` or
    ``ValueError`` naming the seq id. Allocation may evict prefix-cache blocks (LRU).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_token: int,
        prefix_index: PrefixIndex,
        num_host_blocks: int = 0,
    ) -> None:
        check_sizes("PagedKVManager", num_blocks, block_size, bytes_per_token, num_host_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.num_host_blocks = num_host_blocks
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)
        self.prefix_index = prefix_index
        prefix_index.bind(self.pool, block_size)
        # A commit only registers something when the written length reaches a multiple of
        # this (1 for token-granular indexes; never without a prefix cache, whose commits
        # only check their counts): one-token steps may skip the others.
        if not prefix_index.registers_blocks:
            self.commit_interval = COMMITS_REGISTER_NOTHING
        else:
            self.commit_interval = block_size if prefix_index.registers_full_blocks_only else 1
        self._seqs: dict[int, _Seq] = {}
        # Per device block: block-table references from live sequences, and claimed slots
        # (int64 arrays: the compiled loops in native.py update them for whole tables).
        self._seq_refs = np.zeros(num_blocks, dtype=np.int64)
        self._claimed = np.zeros(num_blocks, dtype=np.int64)
        # The same memory as Python-int views: per-block reads and writes from Python
        # (decode fast paths) cost half a numpy scalar access.
        self._seq_refs_at = memoryview(self._seq_refs)
        self._claimed_at = memoryview(self._claimed)
        # Whether append_decodes and can_append take their fast paths (a claim in the
        # partial last block, one fresh block for a full table) before the general path:
        # the same outcomes; False only for the differential test (tests/test_kv_manager.py).
        self.fast_appends = True
        self._num_blocks_in_use = 0  # blocks with a sequence reference
        self._num_token_slots = 0  # sum of claimed slots over blocks in use
        # Scratch for native.blocks_before_fit: per block its position in a guarded match, -1 between calls.
        self._match_position = np.full(num_blocks, -1, dtype=np.int32)
        # Cumulative counters.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_cow_copies = 0
        self.bytes_swapped_out = 0
        self.bytes_swapped_in = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_evicted_blocks(self) -> int:
        """Cumulative prefix-cache blocks evicted to make room."""
        return self.prefix_index.num_evicted_blocks

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks new allocations can draw on now: free (cached-free included) + reclaimable."""
        return self.pool.num_free + self.pool.num_reclaimable

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_tokens(self, seq_id: int) -> int:
        """Token slots (positions) allocated for the sequence."""
        return self._seq(seq_id).num_tokens

    def num_cached_tokens(self, token_ids: Sequence[int], extra_key: str | None) -> int:
        """Tokens of ``token_ids`` already cached (<= len - 1; block aligned for the hash
        index). Pure: no reference, LRU or counter changes."""
        return self.prefix_index.match(token_ids, extra_key).num_tokens

    # ------------------------------------------------------------------ allocate / append
    def can_allocate(
        self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int, extra_key: str | None
    ) -> bool:
        """Whether ``allocate`` would succeed now. Mutates nothing (but the index's match memo)."""
        self._check_new(seq_id, num_new_tokens, "can_allocate")
        return self._fitting_match(token_ids, num_new_tokens, extra_key) is not None

    def allocate(
        self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int, extra_key: str | None
    ) -> tuple[int, KVOps]:
        """Start ``seq_id``: attach the cached prefix of ``token_ids`` and allocate slots for
        the next ``num_new_tokens`` positions after it (one prefill chunk).

        Returns (number of cached tokens, ops). Mutates: block references, the free list
        (may evict cached blocks), the index (locks, LRU), the prefix query/hit counters.
        Raises KVCapacityError when ``can_allocate`` is False.
        """
        self._check_new(seq_id, num_new_tokens, "allocate")
        match = self._fitting_match(token_ids, num_new_tokens, extra_key)
        if match is None:
            match = self.prefix_index.match(token_ids, extra_key)
            need = self._num_blocks_needed(match.num_tokens, match.blocks, num_new_tokens, held=False)
            raise KVCapacityError(
                f"allocate: seq {seq_id} needs {need} blocks, "
                f"{self.num_allocatable_blocks - match.num_blocks_taken} allocatable"
            )
        self.prefix_index.acquire(seq_id, match)
        # References first: revives cached-free blocks before any allocation can evict them.
        matched = match.block_id_array()
        self.pool.incref_many(matched)
        self._add_seq_refs(matched)
        seq = _Seq(_table_of(matched), match.num_tokens, extra_key)
        self._seqs[seq_id] = seq
        ops = self._grow(seq, num_new_tokens)
        self.num_prefix_query_tokens += len(token_ids)
        self.num_prefix_hit_tokens += match.num_tokens
        return match.num_tokens, ops

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        """Whether ``append`` would succeed now. Mutates nothing."""
        seq = self._seqs.get(seq_id)
        if self.fast_appends and seq is not None and seq.host_blocks is None:
            # Fast path (most decode steps): the slots fit in the partial last block and
            # nobody else claimed them (or it holds the block alone): no new block, no
            # copy (append_decodes claims them in place by the same rule).
            offset = seq.num_tokens % self.block_size
            if offset and offset + num_new_tokens <= self.block_size:
                last = seq.block_ids[-1]
                if self._claimed_at[last] <= offset or self.pool.is_exclusive(last):
                    return True
        seq = self._resident(seq_id, "can_append")
        need = self._num_blocks_needed(seq.num_tokens, seq.block_ids, num_new_tokens, held=True)
        return need <= self.num_allocatable_blocks

    def append_decodes(self, seq_ids: Sequence[int]) -> tuple[int, list[KVOps]]:
        """See ``KVManager.append_decodes``. The fast path (most decode steps), inline per
        sequence because a call per sequence was most of its cost: the slot is claimed in
        place in the partial last block when nobody else claimed it or the sequence holds
        the block alone, or a full table (offset 0: ``check`` keeps ceil(num_tokens /
        block_size) blocks per table) takes one fresh block while the free list has one, so
        nothing is evicted and no check can fail (the pool pops the block
        ``allocate_array(1)`` would, with the same listener call; the block, which no table
        holds yet, gets its first sequence reference and one claimed slot: ``_grow``'s
        counts for one block). Any other sequence (a copy ahead, an empty free list, a
        swapped-out or unknown one) takes the general path (``_append``).
        ``fast_appends=False`` sends every one there (the differential test)."""
        if not self.fast_appends:
            return super().append_decodes(seq_ids)
        seqs = self._seqs
        bs = self.block_size
        claimed_at = self._claimed_at
        pool = self.pool
        ops: list[KVOps] = []
        num_slots = 0  # claimed slots to add to _num_token_slots, added before append reads it
        for num_done, seq_id in enumerate(seq_ids):
            seq = seqs.get(seq_id)
            if seq is not None and seq.host_blocks is None:
                offset = seq.num_tokens % bs
                if offset:
                    last = seq.block_ids[-1]
                    claimed = claimed_at[last]
                    if claimed <= offset or pool.is_exclusive(last):
                        num_slots += offset + 1 - claimed  # a sole holder overwrites stale claims
                        claimed_at[last] = offset + 1
                        seq.num_tokens += 1
                        continue
                elif pool.num_free:
                    block = pool.allocate()
                    self._seq_refs_at[block] = 1
                    claimed_at[block] = 1
                    self._num_blocks_in_use += 1
                    num_slots += 1
                    seq.block_ids.append(block)
                    seq.num_tokens += 1
                    continue
            self._num_token_slots += num_slots
            num_slots = 0
            if not _append_one(self._append, seq_id, ops):
                return num_done, ops
        self._num_token_slots += num_slots
        return len(seq_ids), ops

    def append(self, seq_id: int, num_new_tokens: int) -> KVOps:
        """Grow ``seq_id`` by ``num_new_tokens`` slots (a prefill chunk or a decode token),
        copying its partial last block first if another holder claimed the next slot. One
        slot takes ``append_decodes``' fast path where it can, more the general path.

        Mutates: the block table, references, the free list (may evict cached blocks).
        Raises KVCapacityError when ``can_append`` is False.
        """
        if num_new_tokens == 1 and self.fast_appends:
            num_done, ops = self.append_decodes((seq_id,))
            if num_done:
                return ops[0] if ops else NO_OPS
        return self._append(seq_id, num_new_tokens)  # (raises where append_decodes stopped)

    def _append(self, seq_id: int, num_new_tokens: int) -> KVOps:
        """``append``'s general path (``_grow``), every check made."""
        seq = self._resident(seq_id, "append")
        if num_new_tokens < 0:
            raise ValueError(f"append: seq {seq_id} num_new_tokens must be >= 0, got {num_new_tokens}")
        need = self._num_blocks_needed(seq.num_tokens, seq.block_ids, num_new_tokens, held=True)
        if need > self.num_allocatable_blocks:
            raise KVCapacityError(
                f"append: seq {seq_id} needs {need} blocks, {self.num_allocatable_blocks} allocatable"
            )
        return self._grow(seq, num_new_tokens)

    def block_tables(self, seq_ids: Sequence[int]) -> list[list[int]]:
        """See ``KVManager.block_tables``: ``SeqTable.block_tables`` without a call per
        sequence (the real-mode scheduler reads every chunk's table every step), each
        table converted by the int64 array's ``tolist``. It reads ``_seqs`` itself, not
        through ``block_table``: a subclass changing ``block_table`` must override this
        too. An unknown or swapped-out sequence raises through ``SeqTable.block_tables``,
        naming the first. Pure."""
        seqs = self._seqs
        tables = [
            seq.block_ids.tolist()
            for seq in map(seqs.get, seq_ids)
            if seq is not None and seq.host_blocks is None
        ]
        if len(tables) != len(seq_ids):
            return super().block_tables(seq_ids)  # raises, naming the first it cannot read
        return tables

    def can_decode_together(self, seq_ids: Sequence[int]) -> bool:
        """Whether ``decode_run(seq_ids)`` may start: every sequence is resident, its next
        slot is written in place or into a fresh block (no copy-on-write), and no two share
        a partial last block (the second to write would copy it). Pure."""
        return self.try_decode_run(seq_ids) is not None

    def try_decode_run(
        self, seq_ids: Sequence[int], previous: DecodeRun | None = None, rows: np.ndarray | None = None
    ) -> PagedDecodeRun | None:
        """``decode_run(seq_ids)``, or None when ``can_decode_together`` is False: one pass
        over the sequences for both (the fast path asks once per run). With ``previous``
        (a run of this manager) and ``rows`` (int64 [seq]): sequence ``i`` with ``rows[i] >= 0``
        is row ``rows[i]`` of ``previous``, changed since only by its steps and the
        commits made between them (``DecodeRunKV.try_decode_run``), so its slot count
        and partial last block are taken from there instead of read. Mutates nothing."""
        seqs: list[_Seq] = list(map(self._seqs.get, seq_ids))
        bs = self.block_size
        if previous is None or rows is None:
            if None in seqs:
                return None  # not a live sequence
            if any([seq.host_blocks is not None for seq in seqs]):
                return None  # swapped out
            # One comprehension per column (the batch is read once per decode run).
            residues = np.array([seq.num_tokens for seq in seqs], dtype=np.int64) % bs
            # The last block per sequence (-1: none yet).
            last_blocks = np.array(
                [seq.block_ids[-1] if seq.block_ids else -1 for seq in seqs], dtype=np.int64
            )
        else:
            if not isinstance(previous, PagedDecodeRun) or previous.manager is not self:
                raise ValueError("try_decode_run: previous is not a decode run of this manager")
            residues, last_blocks = previous.rows_now(rows)
            # The carried rows are live (a run's sequences were); the others are read.
            for index in (rows < 0).nonzero()[0].tolist():
                seq = seqs[index]
                if seq is None:
                    return None  # not a live sequence
                if seq.host_blocks is not None:
                    return None  # swapped out
                residues[index] = seq.num_tokens % bs
                last_blocks[index] = seq.block_ids[-1] if seq.block_ids else -1
        if not native.decodes_in_place(self.pool.state, self._claimed, residues, last_blocks, bs):
            return None  # a copy-on-write ahead
        return PagedDecodeRun(self, seqs, residues, last_blocks)

    def admission_guard(
        self,
        token_ids: Sequence[int],
        extra_key: str | None,
        seq_ids: Sequence[int],
        num_tokens: int,
        max_new_tokens: int,
    ) -> AdmissionGuard | None:
        """See ``DecodeRunKV.admission_guard``: the prompt's matched blocks now; None for
        an index whose matches need not be block aligned or that may lengthen this one
        (``PrefixIndex.match_may_grow``). Pure apart from the index's match memo."""
        index = self.prefix_index
        if not index.registers_full_blocks_only or index.match_may_grow(token_ids, extra_key, seq_ids):
            return None
        return AdmissionGuard(index.match(token_ids, extra_key).block_id_array(), num_tokens, max_new_tokens)

    def num_blocks_before_admission(self, guard: AdmissionGuard | None, limit: int) -> int:
        """How many blocks, from the free list's head (the order decode steps take them),
        may go (at most ``limit`` and ``pool.num_free``) with the prompt of ``guard`` (from
        ``admission_guard``, this manager's state unchanged since but for blocks taken
        from the free list) unable to start after each: ``can_allocate`` of its first
        step stays False for whatever its match then holds (each matched block taken cuts
        it there) in the room left. None: no prompt to guard. Pure; O(matched + result)."""
        pool = self.pool
        if guard is None:
            return max(min(limit, pool.num_free), 0)
        return native.blocks_before_fit(
            pool.state,
            guard.match_blocks,
            guard.num_tokens,
            guard.max_new_tokens,
            self.block_size,
            self.num_allocatable_blocks,
            max(limit, 0),
            self._match_position,
        )

    def decode_run(self, seq_ids: Sequence[int]) -> PagedDecodeRun:
        """Start growing ``seq_ids`` by one slot per step (see ``PagedDecodeRun``). Mutates
        nothing yet. ValueError when ``can_decode_together`` is False."""
        run = self.try_decode_run(seq_ids)
        if run is None:
            raise ValueError(
                f"decode_run: seqs {list(seq_ids)} cannot decode together (swapped or copy-on-write)"
            )
        return run

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Register ``token_ids`` (all tokens whose KV is written for the sequence) with the
        prefix index; where the index already holds a full block with the same KV, the
        sequence reads that one and drops its own copy (``PrefixIndex.commit``). Mutates:
        the index, the block table and references. ValueError when more tokens than slots."""
        ((_, _, _, table, extra_key),) = self._commit_rows(((seq_id, token_ids, len(token_ids)),))
        for index, block in self.prefix_index.commit(seq_id, token_ids, table, extra_key):
            # A full block: every slot claimed, so the switch keeps the claimed-slot counts.
            own = table[index]
            table[index] = block
            self.pool.incref(block)
            self._add_seq_ref(block)
            self._drop_seq_ref(own)
            self.pool.decref(own)

    def commit_many(self, entries: Sequence[StepCommit]) -> None:
        """``commit`` each entry's prefix in order. With an index that holds no blocks (whose
        commits switch no table entries) every entry is checked first (its sequence and
        count against the slots: nothing is committed when one fails), then the index
        registers them together (``PrefixIndex.commit_many``; an entry whose ids lack a
        block it completes raises there, the entries before it committed)."""
        index = self.prefix_index
        if index.holds_blocks:
            for seq_id, token_ids, num_tokens in entries:
                self.commit(seq_id, prefix_of(token_ids, num_tokens))
            return
        index.commit_many(self._commit_rows(entries))

    def _commit_rows(self, entries: Sequence[StepCommit], num_later_slots: int = 0) -> list[CommitEntry]:
        """The prefix index's commit entries for ``entries``: each with its block table
        (the live int64 array, not a copy) and extra key. The one home of the commit rule:
        a resident sequence commits between 0 and its slots' count of tokens, less
        ``num_later_slots`` (slots already reserved for later steps, which a step's commit
        may not count: ``PagedDecodeRun.advance_many``). Raises on the first entry breaking
        it (``_refuse_commit``; the index checks a count past the ids). Pure."""
        rows = []
        seqs = self._seqs
        for seq_id, token_ids, num_tokens in entries:
            seq = seqs.get(seq_id)
            if (
                seq is None
                or seq.host_blocks is not None
                or not 0 <= num_tokens <= seq.num_tokens - num_later_slots
            ):
                self._refuse_commit(seq_id, num_tokens, num_later_slots)
            rows.append((seq_id, token_ids, num_tokens, seq.block_ids, seq.extra_key))
        return rows

    def _refuse_commit(self, seq_id: int, num_tokens: int, num_later_slots: int = 0) -> NoReturn:
        """Raise naming why ``seq_id`` may not commit ``num_tokens`` tokens (called only for
        an entry ``_commit_rows`` refused, so a resident one's count is wrong): KeyError
        when unknown, ValueError when swapped out, for a negative count or with fewer
        slots than tokens."""
        seq = self._resident(seq_id, "commit")  # raises for an unknown or swapped-out seq
        num_slots = seq.num_tokens - num_later_slots
        raise ValueError(f"commit: seq {seq_id} commits {num_tokens} tokens but has {num_slots} slots")

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Create ``child_seq_id`` sharing every block of the parent (ref count +1 each).
        Mutates: references, the index's sequence tracking."""
        parent = self._resident(parent_seq_id, "fork")
        if child_seq_id in self._seqs:
            raise ValueError(f"fork: seq {child_seq_id} already exists")
        self.pool.incref_many(parent.block_ids)
        self._add_seq_refs(parent.block_ids)
        self._seqs[child_seq_id] = _Seq(array("q", parent.block_ids), parent.num_tokens, parent.extra_key)
        self.prefix_index.fork(parent_seq_id, child_seq_id)

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id`` (running or swapped). Blocks are released tail first so a long
        prompt's tail is evicted before the head other prompts share; committed blocks stay
        cached. Mutates: references, the free list, the index."""
        seq = self._seq(seq_id)
        self.prefix_index.release(seq_id)
        del self._seqs[seq_id]
        host = seq.host_blocks
        if not host:
            # Resident (the common case): drop the table's sequence references, then the
            # pool references, both tail first.
            tail_first = np.array(seq.block_ids[::-1], dtype=np.int64)
            num_released, num_slots = native.drop_seq_refs(self._seq_refs, self._claimed, tail_first)
            self._num_blocks_in_use -= int(num_released)
            self._num_token_slots -= int(num_slots)
            self.pool.free_many(tail_first)
            return
        for i in range(len(seq.block_ids) - 1, -1, -1):
            b = seq.block_ids[i]
            if i in host:
                self.host_pool.decref(b)
            else:
                self._drop_seq_ref(b)
                self.pool.decref(b)

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, seq_id: int) -> bool:
        """Whether the host pool has room for the blocks the sequence alone holds."""
        seq = self._resident(seq_id, "can_swap_out")
        return len(self._exclusive_indexes(seq)) <= self.host_pool.num_free

    def swap_out(self, seq_id: int) -> KVOps:
        """Move the blocks ``seq_id`` alone holds to host blocks (shared ones stay resident).

        Mutates: the block table, both pools, ``bytes_swapped_out``. Raises KVCapacityError
        when ``can_swap_out`` is False."""
        seq = self._resident(seq_id, "swap_out")
        moved = self._exclusive_indexes(seq)
        if len(moved) > self.host_pool.num_free:
            raise KVCapacityError(
                f"swap_out: seq {seq_id} needs {len(moved)} host blocks, {self.host_pool.num_free} free"
            )
        pairs = []
        host: dict[int, int] = {}
        for i in moved:
            host_block = self.host_pool.allocate()
            pairs.append((seq.block_ids[i], host_block))
            host[i] = host_block
        for i in reversed(moved):  # tail first, as in free
            b = seq.block_ids[i]
            self._drop_seq_ref(b)
            self.pool.decref(b)
            seq.block_ids[i] = host[i]
        seq.host_blocks = host
        self.bytes_swapped_out += len(moved) * self.bytes_per_block
        return KVOps(swap_out=tuple(pairs))

    def can_swap_in(self, seq_id: int) -> bool:
        seq = self._swapped(seq_id, "can_swap_in")
        assert seq.host_blocks is not None
        return len(seq.host_blocks) <= self.num_allocatable_blocks

    def swap_in(self, seq_id: int) -> KVOps:
        """Bring a swapped sequence back to fresh device blocks.

        Mutates: the block table, both pools (may evict cached blocks), ``bytes_swapped_in``.
        Raises KVCapacityError when ``can_swap_in`` is False."""
        seq = self._swapped(seq_id, "swap_in")
        host = seq.host_blocks
        assert host is not None
        if len(host) > self.num_allocatable_blocks:
            raise KVCapacityError(
                f"swap_in: seq {seq_id} needs {len(host)} blocks, {self.num_allocatable_blocks} allocatable"
            )
        self._make_free(len(host))
        bs = self.block_size
        pairs = []
        for i in sorted(host):
            dev = self._new_block()
            self._set_claimed(dev, min(bs, seq.num_tokens - i * bs))
            pairs.append((host[i], dev))
            seq.block_ids[i] = dev
            self.host_pool.decref(host[i])
        seq.host_blocks = None
        self.bytes_swapped_in += len(pairs) * self.bytes_per_block
        return KVOps(swap_in=tuple(pairs))

    # ------------------------------------------------------------------ usage / check
    def usage(self) -> KVUsage:
        """Memory now, in bytes of the device pool (cached = held only by the prefix cache)."""
        return self.usage_of(*self.usage_counts())

    def usage_counts(self) -> tuple[int, ...]:
        """(blocks in use, claimed token slots, free blocks holding no cached KV) now: the
        counts ``usage`` derives its variable figures from. Pure."""
        return self._num_blocks_in_use, self._num_token_slots, self.pool.num_free - self.pool.num_cached_free

    def usage_columns(self, counts: Sequence[tuple[int, ...]]) -> dict[str, list[int]]:
        """The KVUsage fields that ``usage_counts`` determine, one value per entry of
        ``counts`` (several steps at once), keyed ``kv.<field>``. Pure."""
        return usage_columns_of(self._count_fields, counts)

    def usage_of(self, *counts: int) -> KVUsage:
        """KVUsage for these ``usage_counts`` (blocks in use, claimed token slots, free
        uncached blocks) and the host pool now. Pure."""
        in_use, token_slots, free = counts
        allocated, token_bytes, internal_frag, cached_bytes, _, cached, _ = self._count_values(
            in_use, token_slots, free
        )
        per_block = self.bytes_per_block
        # Positional, in KVUsage's field order: keywords cost as much as the build again,
        # and the engine reads usage every step. The order is pinned by test_kv_manager.py's
        # test_usage_names_each_field_of_a_manager_holding_every_kind_of_block.
        return KVUsage(
            self.num_blocks * per_block,  # capacity_bytes
            allocated,
            token_bytes,
            0,  # reserved_unused_bytes
            internal_frag,
            0,  # external_frag_bytes
            cached_bytes,
            (self.num_host_blocks - self.host_pool.num_free) * per_block,  # host_bytes
            self.num_blocks,  # num_blocks_total
            in_use,
            cached,
            free,
        )

    def _count_values(self, in_use: Any, token_slots: Any, free: Any) -> tuple[Any, ...]:
        """KVUsage's count-dependent fields (``_COUNT_FIELDS``, in order) for these
        ``usage_counts``: ints, or int64 arrays (one per step). Pure."""
        per_block = self.bytes_per_block
        cached = self.num_blocks - free - in_use
        allocated = in_use * per_block
        token_bytes = token_slots * self.bytes_per_token
        return allocated, token_bytes, allocated - token_bytes, cached * per_block, in_use, cached, free

    def _count_fields(self, *counts: Any) -> dict[str, Any]:
        """``_count_values`` keyed by field name, for ``usage_columns``. Pure."""
        return dict(zip(_COUNT_FIELDS, self._count_values(*counts), strict=True))

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant. O(blocks + table entries)."""
        self.pool.check()
        self.host_pool.check()
        self.prefix_index.check()
        n = self.num_blocks
        bs = self.block_size
        seq_refs = [0] * n
        host_refs = [0] * self.num_host_blocks
        for seq_id, seq in self._seqs.items():
            assert isinstance(seq.block_ids, array) and seq.block_ids.typecode == "q", (
                f"seq {seq_id}: its block table is a {type(seq.block_ids).__name__}, not an int64 array"
            )
            want = -(-seq.num_tokens // bs)
            assert len(seq.block_ids) == want, (
                f"seq {seq_id}: {len(seq.block_ids)} blocks for {seq.num_tokens} slots, want {want}"
            )
            host = seq.host_blocks or {}
            device = [b for i, b in enumerate(seq.block_ids) if i not in host]
            assert len(set(device)) == len(device), f"seq {seq_id}: a block appears twice in its table"
            for i, b in enumerate(seq.block_ids):
                if i in host:
                    host_refs[b] += 1
                    continue
                seq_refs[b] += 1
                slots = min(bs, seq.num_tokens - i * bs)
                assert self._claimed[b] >= slots, (
                    f"seq {seq_id}: block {b} claims {self._claimed[b]} slots, the seq uses {slots}"
                )
        index_refs = self.prefix_index.block_refs()
        in_use = 0
        cached = 0
        token_slots = 0
        for b in range(n):
            assert self._seq_refs[b] == seq_refs[b], (
                f"block {b}: seq ref counter {self._seq_refs[b]}, block tables hold {seq_refs[b]}"
            )
            ref = self.pool.ref_count(b)
            assert ref == seq_refs[b] + index_refs.get(b, 0), (
                f"block {b}: ref_count={ref} but {seq_refs[b]} block-table refs "
                f"+ {index_refs.get(b, 0)} index refs"
            )
            if seq_refs[b]:
                in_use += 1
                token_slots += self._claimed[b]
            elif ref > 0 or self.pool.is_cached(b):
                cached += 1
        for h in range(self.num_host_blocks):
            assert self.host_pool.ref_count(h) == host_refs[h], (
                f"host block {h}: ref_count={self.host_pool.ref_count(h)}, swapped tables hold {host_refs[h]}"
            )
        assert in_use == self._num_blocks_in_use, (
            f"num_blocks_in_use={self._num_blocks_in_use}, recount {in_use}"
        )
        assert token_slots == self._num_token_slots, (
            f"num_token_slots={self._num_token_slots}, recount {token_slots}"
        )
        free = self.pool.num_free - self.pool.num_cached_free
        assert free + in_use + cached == n, f"free {free} + in use {in_use} + cached {cached} != total {n}"

    # ------------------------------------------------------------------ internals
    def _fitting_match(
        self, token_ids: Sequence[int], num_new_tokens: int, extra_key: str | None
    ) -> PrefixMatch | None:
        """The prefix match ``allocate`` attaches: the index's match when the new slots fit
        after it, else the match cut to its last full block, else None (nothing fits). Pure
        apart from the index's match memo.

        A match ending mid-block that another sequence wrote past is copied on the first
        write, so it costs one block more than no match at all, and it pins the cached
        blocks it revives: in a pool with just room for the request alone that extra block
        may never exist. Without the partial block the request needs no more than it would
        with no cache, so a request that fits the pool alone always gets a match that fits.
        """
        match = self.prefix_index.match(token_ids, extra_key)
        if self._match_fits(match, num_new_tokens):
            return match
        aligned = match.num_tokens - match.num_tokens % self.block_size
        if aligned == match.num_tokens:
            return None
        match = self.prefix_index.match(TokenPrefix(token_ids, aligned + 1), extra_key)
        return match if self._match_fits(match, num_new_tokens) else None

    def _match_fits(self, match: PrefixMatch, num_new_tokens: int) -> bool:
        need = self._num_blocks_needed(match.num_tokens, match.blocks, num_new_tokens, held=False)
        return need <= self.num_allocatable_blocks - match.num_blocks_taken

    def _num_blocks_needed(
        self, num_tokens: int, block_ids: Sequence[int] | np.ndarray, num_new: int, held: bool
    ) -> int:
        """New blocks to grow from ``num_tokens`` by ``num_new`` slots (including a CoW copy).
        ``block_ids``: a block table or a match's blocks (``PrefixMatch.blocks``); ``held``:
        whether the caller already holds a reference on them."""
        if num_new <= 0:
            return 0
        bs = self.block_size
        need = -(-(num_tokens + num_new) // bs) - len(block_ids)
        offset = num_tokens % bs
        if offset and self._must_copy(block_ids[-1], offset, held):
            need += 1
        return need

    def _must_copy(self, block: int, offset: int, held: bool) -> bool:
        """``native.must_copy`` (one definition with the decode run's check) for ``block``,
        a block of some table; ``held``: whether the writer holds a reference to it."""
        return bool(native.must_copy(self.pool.state, self._claimed, block, offset, int(held)))

    def _grow(self, seq: _Seq, num_new: int) -> KVOps:
        if num_new <= 0:
            return NO_OPS
        bs = self.block_size
        table = seq.block_ids
        offset = seq.num_tokens % bs
        self._make_free(self._num_blocks_needed(seq.num_tokens, table, num_new, held=True))
        copies: tuple[tuple[int, int], ...] = ()
        remaining = num_new
        if offset:
            last = table[-1]
            take = min(num_new, bs - offset)
            if self._must_copy(last, offset, held=True):
                dst = self._new_block()
                self._set_claimed(dst, offset + take)
                table[-1] = dst
                self._drop_seq_ref(last)
                self.pool.decref(last)  # others still hold it, so it stays allocated
                copies = ((last, dst),)
                self.num_cow_copies += 1
            else:
                # Sole holder (stale claims are overwritten) or first to claim the next slot.
                self._set_claimed(last, offset + take)
            remaining -= take
        if remaining > 0:
            # Fresh blocks in one pool call; what _new_block + _set_claimed do per block,
            # batched: a fresh block has no sequence reference yet, so each gains its first
            # one and claims a full block's slots (the last one the rest).
            num_fresh = -(-remaining // bs)
            fresh = self.pool.allocate_array(num_fresh)
            native.claim_fresh(self._seq_refs, self._claimed, fresh, bs, remaining - (num_fresh - 1) * bs)
            self._num_blocks_in_use += num_fresh
            self._num_token_slots += remaining
            table.frombytes(fresh.tobytes())
        seq.num_tokens += num_new
        return KVOps(copies=copies) if copies else NO_OPS

    def _make_free(self, num_blocks: int) -> None:
        shortfall = num_blocks - self.pool.num_free
        if shortfall > 0:
            self.prefix_index.evict(shortfall)
        assert self.pool.num_free >= num_blocks, (
            "prefix index evicted fewer blocks than it reported reclaimable"
        )

    def _new_block(self) -> int:
        b = self.pool.allocate()
        self._claimed_at[b] = 0  # fresh KV: nothing claimed (the block has no sequence refs yet)
        self._add_seq_ref(b)
        return b

    def _add_seq_ref(self, b: int) -> None:
        r = self._seq_refs_at[b]
        if r == 0:
            self._num_blocks_in_use += 1
            self._num_token_slots += self._claimed_at[b]
        self._seq_refs_at[b] = r + 1

    def _add_seq_refs(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """``_add_seq_ref`` for each block (a prefix hit attaches hundreds)."""
        num_new, slots = native.add_seq_refs(
            self._seq_refs, self._claimed, np.asarray(block_ids, dtype=np.int64)
        )
        self._num_blocks_in_use += int(num_new)
        self._num_token_slots += int(slots)

    def _drop_seq_ref(self, b: int) -> None:
        r = self._seq_refs_at[b] - 1
        self._seq_refs_at[b] = r
        if r == 0:
            self._num_blocks_in_use -= 1
            self._num_token_slots -= self._claimed_at[b]

    def _set_claimed(self, b: int, num_slots: int) -> None:
        if self._seq_refs_at[b]:
            self._num_token_slots += num_slots - self._claimed_at[b]
        self._claimed_at[b] = num_slots

    def _exclusive_indexes(self, seq: _Seq) -> list[int]:
        return [i for i, b in enumerate(seq.block_ids) if self.pool.ref_count(b) == 1]


class PagedDecodeRun:
    """Sequences that each grow by one KV slot per step: a simulated decode run's KV side.

    Built by ``PagedKVManager.decode_run`` once its preconditions hold (no copy-on-write
    ahead, no shared partial last block). They keep holding while only this run appends
    to these sequences: each writes its partial block in place until it fills, then a
    fresh block it holds alone. So a step needs one new block per sequence whose slots
    fill a block, known from the slot counts modulo the block size without asking the
    manager per sequence. ``advance`` leaves exactly the state of ``append(seq, 1)`` for
    each sequence in order. Appending to these sequences any other way (or freeing,
    forking, swapping them) while the run is in use voids it.
    """

    __slots__ = ("_kv", "_seqs", "_residues", "_lasts", "_at_boundary", "_num_steps", "_scratch")

    def __init__(self, kv: PagedKVManager, seqs: list[_Seq], residues: np.ndarray, lasts: np.ndarray) -> None:
        """``residues``: each sequence's slots modulo the block size now; ``lasts``: its
        last block (int64 arrays in ``seqs`` order)."""
        self._kv = kv
        self._seqs = seqs
        bs = kv.block_size
        self._residues = residues
        # _lasts[i]: sequence i's last block (kept current by advance / advance_many).
        self._lasts = lasts
        # _at_boundary[r]: how many sequences need a fresh block at step k with (-k) % bs == r.
        self._at_boundary: list[int] = np.bincount(residues, minlength=bs).tolist()
        self._num_steps = 0
        # int64 [3, seq] for native.decode_step: the rows crossing into a fresh block, the
        # blocks they take, the cached ones among those.
        self._scratch = np.empty((3, len(residues)), dtype=np.int64)

    @property
    def manager(self) -> PagedKVManager:
        """The manager whose sequences the run grows."""
        return self._kv

    def rows_now(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slot counts modulo the block size and last blocks (int64, own copies) now of
        the run's sequences ``rows`` (int64 [n]; a negative entry gives the last row's
        values, for the caller to overwrite). A full last block's entry may be stale (a
        commit may have switched it for its cached twin) and is never read: the next
        step gives that sequence a fresh block. Pure."""
        residues = (self._residues[rows] + self._num_steps) % self._kv.block_size
        return residues, self._lasts[rows]

    def snapshot(self) -> tuple[Any, ...]:
        """The run's state as plain values (the manager's sequence records by identity,
        slot counts modulo the block size, last blocks of partial ones): two runs with
        equal snapshots take the same steps. Pure."""
        bs = self._kv.block_size
        residues = ((self._residues + self._num_steps) % bs).tolist()
        lasts = [last if residue else -1 for last, residue in zip(self._lasts.tolist(), residues)]
        return tuple(map(id, self._seqs)), tuple(residues), tuple(lasts)

    def num_new_blocks(self) -> int:
        """Fresh blocks the next ``advance`` takes (it fails when more than
        ``num_allocatable_blocks``; check first). Pure."""
        return self._at_boundary[-self._num_steps % self._kv.block_size]

    def can_advance(self) -> bool:
        """Whether the pool can give the next ``advance`` its ``num_new_blocks`` (free or
        evictable). Pure."""
        return self.num_new_blocks() <= self._kv.num_allocatable_blocks

    def advance(self) -> None:
        """Reserve the next slot of every sequence, in order. Mutates the manager (claims,
        block tables, the pool, which may evict cached blocks). Raises KVCapacityError,
        changing nothing, when ``can_advance`` is False."""
        kv = self._kv
        if not self.can_advance():
            raise KVCapacityError("decode run: no block left for the next slot (check can_advance)")
        pool = kv.pool
        scratch = self._scratch
        # In place (the precondition: distinct blocks) and, when the free list has them, the
        # fresh blocks of the sequences crossing into one, in sequence order (the pool's
        # order): what append(seq, 1) does for each, in one compiled pass.
        added, num_fresh, num_reused = native.decode_step(
            pool.state,
            pool.counts,
            kv._claimed,
            kv._seq_refs,
            self._residues,
            self._lasts,
            self._num_steps,
            kv.block_size,
            scratch,
        )
        kv._num_token_slots += added
        seqs = self._seqs
        for seq in seqs:
            seq.num_tokens += 1
        if num_fresh:
            crossing = scratch[0, :num_fresh].tolist()
            if num_reused >= 0:
                # No eviction in between: the blocks _grow(seq, 1) would take one by one,
                # taken in one pop (the same blocks in the same order), each holding one slot.
                if num_reused:  # a copy: the listener may keep it, the scratch is reused
                    pool.tell_reused(scratch[2, :num_reused].copy())
                kv._num_blocks_in_use += num_fresh
                kv._num_token_slots += num_fresh
                for index, block in zip(crossing, scratch[1, :num_fresh].tolist()):
                    seqs[index].block_ids.append(block)
            else:
                for index in crossing:
                    seq = seqs[index]
                    seq.num_tokens -= 1
                    kv._grow(seq, 1)
                    self._lasts[index] = seq.block_ids[-1]
        self._num_steps += 1

    def num_quiet_steps(self, guard: AdmissionGuard | None, max_steps: int) -> int:
        """How many of the next steps (at most ``max_steps``) ``advance_many`` may take at
        once: together they take no more blocks than are free (the prefix index need not
        ``evict``; cached-free blocks reused drop their registrations as usual), and after
        each the prompt of ``guard`` still cannot start
        (``PagedKVManager.num_blocks_before_admission``). 0 when the prefix index holds
        blocks (its commits move references, so steps must interleave with them). Pure;
        O(steps + matched + blocks taken)."""
        kv = self._kv
        if kv.prefix_index.holds_blocks or max_steps <= 0:
            return 0
        bs = kv.block_size
        # Each sequence takes at most one block per bs steps: an upper bound on the walk.
        cap = (max_steps // bs + 1) * len(self._seqs)
        num_safe = kv.num_blocks_before_admission(guard, cap)
        at_boundary = self._at_boundary
        start = self._num_steps
        steps = total = 0
        while steps < max_steps:
            total += at_boundary[-(start + steps) % bs]
            if total > num_safe:
                break
            steps += 1
        return steps

    def advance_many(
        self, num_steps: int, commits: Sequence[Sequence[StepCommit]] = ()
    ) -> list[tuple[int, ...]]:
        """``advance`` ``num_steps`` times: the same blocks (taken step by step in sequence
        order), claims, counters and reuse-listener drops. ``commits[t]`` (empty: none)
        are step ``t``'s commits (``commit_many`` entries), made once the step's blocks are
        taken (the cached ones already dropped from the prefix index) and before step
        ``t + 1``'s, so an index sees drops and registrations interleaved exactly as step
        by step; slot counts already include all ``num_steps`` steps, claims are settled
        at the end. The steps go to the prefix index together
        (``PrefixIndex.allocate_decode_steps``: one compiled pass); a call it declines goes
        one step at a time. Returns, per step, the manager's ``usage_counts`` after it and
        how many cached blocks it reused (evictions). Only for an index that holds no
        blocks and when the steps' blocks are free (``num_quiet_steps``); raises
        KVCapacityError otherwise, changing nothing. ``commits`` for more than
        ``num_steps`` steps raise ValueError, changing nothing, as does an entry stepping
        would refuse (an unknown or swapped-out sequence, a negative count, more tokens
        than the slots after its own step); one whose ids lack a block it completes raises
        ValueError where the index reads them, after the steps before its own (the
        scheduler builds none). Mutates the manager (claims, block tables, the pool, the
        index)."""
        if len(commits) > num_steps:
            raise ValueError(f"advance_many: commits for {len(commits)} steps, {num_steps} taken")
        kv = self._kv
        bs = kv.block_size
        pool = kv.pool
        index = kv.prefix_index
        start = self._num_steps
        at_boundary = self._at_boundary
        needs = [at_boundary[-(start + t) % bs] for t in range(num_steps)]
        total = sum(needs)
        if index.holds_blocks or total > pool.num_free:
            raise KVCapacityError(f"decode run: {total} blocks for {num_steps} steps, {pool.num_free} free")
        in_use, token_slots = kv._num_blocks_in_use, kv._num_token_slots
        seqs = self._seqs
        num_seqs = len(seqs)
        # Per sequence (int64 [seq]): its slots modulo bs before these steps (the run's
        # invariant: nothing else appends to them) and the first of these steps in which
        # it takes a fresh block (then every bs steps).
        offsets = (self._residues + start) % bs
        first_need = -offsets % bs
        # The sequences taking a block in each step, step after step (sequence order
        # within a step: the order the pool hands blocks out, as step by step).
        takers = native.decode_takers(first_need, num_steps, bs)
        assert len(takers) == total, "a decode run's block counts disagree with its slot counts"
        for seq in seqs:
            seq.num_tokens += num_steps  # the slots reserved (what commits check against)
        try:
            # Every step's entries checked before anything else changes, each against the
            # slots after its own step, as stepping checks it: a bad one raises as
            # commit_many does, the slots given back. So an entry of step t completes only
            # blocks taken in step t or before. (They hold the live block tables, which the
            # steps' blocks extend before the index reads them.)
            # (Most steps of a long run commit nothing: no call for them.)
            rows_per_step = [
                kv._commit_rows(entries, num_steps - 1 - t) if entries else []
                for t, entries in enumerate(commits)
            ]
            # Per step: blocks in use and free uncached blocks after it, and cached ones reused.
            steps: list[tuple[int, int, int]] = []
            free, cached = pool.num_free, pool.num_cached_free
            # The blocks the steps take, in the order the pool hands them out (its free
            # list's head), go into the tables first: the prefix index reads a decode
            # commit's block there, so one compiled pass covers every step, commits of
            # blocks taken within it included.
            fresh = pool.next_free(total)  # int64 [total]
            for row, block in zip(takers.tolist(), fresh.tolist()):
                seqs[row].block_ids.append(block)
            try:
                taken = index.allocate_decode_steps(pool, np.array(needs, dtype=np.int64), rows_per_step)
            except BaseException:  # (raised before changing anything: its contract)
                self._take_back(takers)
                raise
        except BaseException:
            for seq in seqs:
                seq.num_tokens -= num_steps
            raise
        if taken is None:
            # Declined (an entry that is no decode commit): the blocks come back out of the
            # tables, then the steps go one at a time, as advance then commit_many (the
            # index's own: its entries are checked, and an index that holds no blocks
            # switches no table entry).
            self._take_back(takers)
            stepped: list[int] = []  # the blocks taken, in order
            at = 0  # the step's first entry of takers
            for t, need in enumerate(needs):
                cached_before = pool.num_cached_free
                if need:
                    blocks = pool.allocate_many(need)
                    for row, b in zip(takers[at : at + need].tolist(), blocks):
                        seqs[row].block_ids.append(b)
                    stepped += blocks
                    in_use += need
                    at += need
                # Read before the commits (which register in-use blocks only, changing neither).
                steps.append(
                    (in_use, pool.num_free - pool.num_cached_free, cached_before - pool.num_cached_free)
                )
                if t < len(rows_per_step) and rows_per_step[t]:  # (commits may stop early)
                    index.commit_many(rows_per_step[t])
            taken_blocks = np.array(stepped, dtype=np.int64)
        else:
            taken_blocks, reused_per_step = taken
            for need, num_reused in zip(needs, reused_per_step.tolist()):
                in_use += need
                free -= need
                cached -= num_reused
                steps.append((in_use, free - cached, num_reused))
        # (The pool pops its free list's head, and commits move no block in or out of it.
        # Compared as bytes, int64 both: np.array_equal's Python-level checks cost more.)
        assert taken_blocks.tobytes() == fresh.tobytes(), "decode run: the pool handed out other blocks"
        # Final claims: what num_steps in-place writes and fresh blocks leave (telescoped);
        # self._lasts becomes current for partial last blocks (rows_now).
        stale = native.settle_decode_claims(
            kv._claimed, kv._seq_refs, offsets, self._lasts, takers, fresh, num_steps, bs
        )
        kv._num_blocks_in_use += total
        kv._num_token_slots += num_steps * num_seqs + stale
        self._num_steps += num_steps
        return [
            (step_in_use, token_slots + (t + 1) * num_seqs + stale, free, num_reused)
            for t, (step_in_use, free, num_reused) in enumerate(steps)
        ]

    def _take_back(self, takers: np.ndarray) -> None:
        """Remove from the tables the blocks ``advance_many`` appended before the prefix
        index's pass: row ``takers[k]`` got one each (int64 [blocks]). Mutates the tables."""
        seqs = self._seqs
        for row, num_taken in enumerate(np.bincount(takers, minlength=len(seqs)).tolist()):
            if num_taken:
                del seqs[row].block_ids[-num_taken:]
