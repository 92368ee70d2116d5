"""Prefix indexes for the paged KV manager: the protocol, a null index and a block-hash index.

A prefix index remembers which pool blocks hold KV for which token prefixes, so that a
new sequence can attach them instead of recomputing. The paged manager talks to it only
through ``PrefixIndex``; "prefix caching off" is ``NullPrefixIndex`` and the token-granular
radix tree (``radix_cache.RadixPrefixIndex``) is a drop-in alternative to
``BlockHashPrefixIndex``.

Who holds what (the manager and the index share one ``BlockPool``):

- The manager holds one hard pool reference per block-table entry of a live sequence.
  It takes the references on a match's blocks itself (``BlockPool.incref``).
- ``BlockHashPrefixIndex`` holds no references: a registered block whose sequences are
  gone sits in the free list flagged *cached* and is evicted lazily when the pool pops it
  for reuse (vLLM v1's scheme).
- ``RadixPrefixIndex`` holds one reference per tree-node block; references of unlocked
  nodes are *soft*, so ``BlockPool.num_reclaimable`` counts what ``evict`` can free (SGLang's
  scheme: the tree owns cached KV and evicts unlocked leaves on demand).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvbench.engines.kv import native
from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.token_ids import (
    NO_BLOCK_IDS,
    ArrayTokenIds,
    BlockKeyChain,
    KeyCarrier,
    KeyedTokenIds,
    id_list,
    prefix_of,
)
from kvbench.hashing import block_multipliers
from kvbench.records import frozen_record

# ``PrefixIndex.commit_many``'s entries: (seq_id, token_ids, num_tokens, block_ids,
# extra_key): ``commit`` of the first ``num_tokens`` of ``token_ids`` (a sequence's own
# ids, which may run past the count: see ``kvbench.engines.kv.protocol.StepCommit``).
CommitEntry = tuple[int, Sequence[int], int, Sequence[int], str | None]


@frozen_record(eq=False)
class PrefixMatch:
    """The cached prefix found for a token sequence (a pure query result).

    ``blocks[i]`` holds positions ``[i * block_size, (i + 1) * block_size)``; the last one
    may be only partly covered when ``num_tokens`` is not block aligned (radix index).
    ``blocks`` is a tuple or the index's own int64 array (read only: the index's memo
    shares it), so that a long match is never converted to Python ints on the hot path:
    read it through ``num_blocks``, ``blocks[i]`` (an ``np.int64`` from an array),
    ``block_id_array()``, or ``block_ids`` (a tuple of ints, built on first read).
    ``num_blocks_taken`` is how many blocks attaching the match removes from what new
    allocations can draw on (cached-free blocks revived from the free list, reclaimable
    blocks pinned by locks); the manager subtracts it when checking capacity. ``handle``
    is private to the index that produced the match.
    """

    num_tokens: int
    blocks: tuple[int, ...] | np.ndarray
    num_blocks_taken: int = 0
    handle: Any = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @cached_property
    def block_ids(self) -> tuple[int, ...]:
        """The blocks as a tuple of ints (built once). Pure."""
        blocks = self.blocks
        return tuple(blocks.tolist()) if isinstance(blocks, np.ndarray) else blocks

    def block_id_array(self) -> np.ndarray:
        """The blocks as int64 [num_blocks]: the index's array when it gave one (do not
        write to it), else a new one. Pure."""
        blocks = self.blocks
        if isinstance(blocks, np.ndarray):
            return blocks
        return np.array(blocks, dtype=np.int64)

    def __eq__(self, other: object) -> bool:
        """Equal fields, the blocks compared as ints whichever form holds them."""
        if not isinstance(other, PrefixMatch):
            return NotImplemented
        return (self.num_tokens, self.block_ids, self.num_blocks_taken, self.handle) == (
            other.num_tokens,
            other.block_ids,
            other.num_blocks_taken,
            other.handle,
        )


NO_MATCH = PrefixMatch(num_tokens=0, blocks=())


@runtime_checkable
class PrefixIndex(Protocol):
    """What the paged KV manager needs from a prefix cache.

    Call order per sequence: ``match`` (any number of times, pure) -> ``acquire`` once
    -> ``commit`` after each step that wrote KV -> optional ``fork`` -> ``release`` once.
    Every method says what it mutates; misuse (unknown sequence, double bind) raises
    ``KeyError`` / ``ValueError`` naming the sequence.
    """

    @property
    def registers_blocks(self) -> bool:
        """Whether ``commit`` registers anything at all. False: prefix caching off (nothing
        is ever registered or matched), so a commit only checks its count and the caller
        may skip every one-token commit (``KVManager.commit_interval``)."""
        ...

    @property
    def registers_full_blocks_only(self) -> bool:
        """Whether ``commit`` only ever registers whole blocks, so a commit that completes no
        new block is a no-op the caller may skip (decode steps commit 15 times in 16 for
        nothing otherwise). False for token-granular indexes."""
        ...

    @property
    def holds_blocks(self) -> bool:
        """Whether the index takes pool references itself (``commit`` and ``evict`` move
        them; radix locks). False when its cache lives in the pool's free list, so that
        commits never touch references or the free list: a simulated decode run may then
        reserve several steps' blocks before committing them (``PagedDecodeRun.advance_many``)."""
        ...

    def bind(self, pool: BlockPool, block_size: int) -> None:
        """Attach to the manager's pool (once). Mutates: the index, the pool's reuse listener."""
        ...

    def match(self, token_ids: Sequence[int], extra_key: str | None) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``, at most ``len(token_ids) - 1`` tokens so the
        last prompt token is always computed. Mutates nothing (not even LRU order)."""
        ...

    def match_may_grow(self, token_ids: Sequence[int], extra_key: str | None, seq_ids: Sequence[int]) -> bool:
        """Whether ``match(token_ids, extra_key)`` could lengthen while only the sequences
        ``seq_ids`` grow and commit (decode) and the pool only allocates (no frees, no
        other acquire): their next registrations could supply a block it lacks, now or
        once it lost one, or the index cannot tell (True). When False, the match only
        loses blocks, each one the pool reuses cutting it before that block. Mutates
        nothing but the match memo and key-chain cache (as ``match``)."""
        ...

    def acquire(self, seq_id: int, match: PrefixMatch) -> None:
        """Start tracking ``seq_id`` from ``match`` (the latest ``match`` result, before any
        other mutation). Mutates: index bookkeeping, LRU order, locks. The manager takes the
        block references itself, after this call."""
        ...

    def commit(
        self, seq_id: int, token_ids: Sequence[int], block_ids: Sequence[int], extra_key: str | None
    ) -> tuple[tuple[int, int], ...]:
        """Register the KV now written for ``seq_id``: ``token_ids`` are all its written tokens
        (a prefix-extension of the previous commit) and ``block_ids`` its block table.

        Returns (logical index, block) pairs: full blocks of the index holding exactly the
        KV the sequence wrote at that index (the same tokens after the same prefix,
        computed by another sequence in parallel). The manager points the sequence's table
        at them and drops its own copies, so that what the index keeps is what its live
        sequences read (de-duplication, as SGLang's radix cache does). Empty for indexes
        that hold no blocks. Mutates: the index and, for indexes that hold blocks, pool
        references."""
        ...

    def commit_many(self, entries: Sequence[CommitEntry]) -> None:
        """``commit(seq_id, token_ids[:num_tokens], block_ids, extra_key)`` for each entry in
        order, with the same effect, for an index that holds no blocks (``holds_blocks``
        False: its commits return no pairs). One step's decode commits go here together,
        so an index may key and register them in one pass. An index that holds blocks
        raises TypeError: its caller must apply each commit's pairs before the next
        commit. Mutates what ``commit`` does; raises as ``commit`` on the first bad entry
        (ValueError also for a count past the ids where the index reads ids the entry
        lacks), the entries before it committed."""
        ...

    def allocate_decode_steps(
        self, pool: BlockPool, needs: np.ndarray, commits: Sequence[Sequence[CommitEntry]]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """A simulated decode run's steps (``PagedDecodeRun.advance_many``), for an index that
        holds no blocks: per step ``t``, take ``needs[t]`` blocks (int64 [steps]) from the
        pool's free-list head, then ``commit_many(commits[t])`` (``commits``: at most one
        list per step). The caller has already appended the blocks the steps take (the
        free list's first ``sum(needs)``, in the order taken) to the tables, and an entry
        of step ``t`` completes only blocks taken in step ``t`` or before. Returns
        ``BlockPool.allocate_steps``' result, or None, changing nothing, when the index
        cannot take these steps in one pass (the caller then takes them one at a time).
        Mutates the pool and what the commits mutate. What it raises it raises before
        changing anything: TypeError for an index that holds blocks, and (block-hash)
        KeyError naming an unknown sequence, MemoryError when fewer than ``sum(needs)``
        blocks are free, struct.error for an id that is no int64."""
        ...

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Track ``child_seq_id`` as a copy of ``parent_seq_id``. Mutates: index bookkeeping."""
        ...

    def release(self, seq_id: int) -> None:
        """Stop tracking ``seq_id`` (before the manager drops its block references); its
        committed KV stays cached. Mutates: index bookkeeping, locks."""
        ...

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` pool blocks held only by the cache, least recently used
        first; returns how many became free (0 for indexes whose cache lives in the free list).
        Mutates: the index, pool references."""
        ...

    @property
    def num_evicted_blocks(self) -> int:
        """Cumulative cached blocks dropped to make room."""
        ...

    def block_refs(self) -> dict[int, int]:
        """Pool references the index holds, by block id (for the manager's ``check``)."""
        ...

    def check(self) -> None:
        """Raise AssertionError naming the first broken internal invariant."""
        ...


class NullPrefixIndex:
    """Prefix caching off: nothing matches, nothing is kept, freed blocks are plain free."""

    registers_blocks = False  # registers nothing at all
    registers_full_blocks_only = True  # (vacuously)
    holds_blocks = False

    def __init__(self) -> None:
        self._pool: BlockPool | None = None

    def bind(self, pool: BlockPool, block_size: int) -> None:
        if self._pool is not None:
            raise ValueError("NullPrefixIndex: already bound to a pool (use one index per manager)")
        self._pool = pool

    def match(self, token_ids: Sequence[int], extra_key: str | None) -> PrefixMatch:
        return NO_MATCH

    def match_may_grow(self, token_ids: Sequence[int], extra_key: str | None, seq_ids: Sequence[int]) -> bool:
        return False  # nothing ever matches

    def acquire(self, seq_id: int, match: PrefixMatch) -> None:
        return None

    def commit(
        self, seq_id: int, token_ids: Sequence[int], block_ids: Sequence[int], extra_key: str | None
    ) -> tuple[tuple[int, int], ...]:
        return ()

    def commit_many(self, entries: Sequence[CommitEntry]) -> None:
        return None

    def allocate_decode_steps(
        self, pool: BlockPool, needs: np.ndarray, commits: Sequence[Sequence[CommitEntry]]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        return pool.allocate_steps(needs)  # commits register nothing

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        return None

    def release(self, seq_id: int) -> None:
        return None

    def evict(self, num_blocks: int) -> int:
        return 0

    @property
    def num_evicted_blocks(self) -> int:
        return 0

    def block_refs(self) -> dict[int, int]:
        return {}

    def check(self) -> None:
        return None


# A full block's key: two 64-bit lanes of a chained sum (``kvbench.hashing``'s block keys).
# Lane 0 keys the hash table; lane 1 is compared on a hit. The block's token ids are not
# kept: a 128-bit key makes a false hit as unlikely as in vLLM's hashed keys.
_SLOTS_PER_BLOCK = 4  # hash table slots per pool block (a power of two at least this)


class _SeqHashState:
    """How far a sequence's full blocks are registered: ``num_blocks``, its tokens' key
    chain, which may lag behind ``num_blocks`` (decode registrations key blocks without
    appending them to it), and ``slot``, its row of the index's ``_last_keys``: both lanes
    of block ``num_blocks - 1``'s key, or the chain's start (what the next block's key
    chains from), set while ``chain`` is not None. ``chain`` is None before the
    sequence's first commit when it was acquired without one (a plain token list that
    matched nothing)."""

    __slots__ = ("num_blocks", "chain", "slot")

    def __init__(self, num_blocks: int, chain: BlockKeyChain | None, slot: int) -> None:
        self.num_blocks = num_blocks
        self.chain = chain
        self.slot = slot


class _StepRegistrations:
    """Decode-block registrations gathered for ``native.allocate_steps_registering`` (or
    ``native.register_entries``: one step taking no blocks): per entry its step, its
    sequence's slot (its row of the index's last keys), its block's position and id, then
    the block's ``block_size`` ids (``entries``, flat: ``4 + block_size`` values an
    entry); per row (sequence, in first-seen order) its state and entries so far."""

    __slots__ = ("block_size", "rows", "states", "num_entries", "entries")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.rows: dict[int, int] = {}  # seq id -> row of states / num_entries (not its slot)
        self.states: list[_SeqHashState] = []
        self.num_entries: list[int] = []
        self.entries: list[int] = []

    def add_steps(
        self, commits: Sequence[Sequence[CommitEntry]], seqs: dict[int, _SeqHashState], start: int = 0
    ) -> tuple[int, int] | None:
        """Add each step's commits in order (step ``t``'s are ``commits[t]``, from position
        ``start`` in step 0's; ``seqs``: the index's states), up to the first entry that is
        no decode commit: one completing exactly the next block of a known sequence
        (counting its entries added before) that has a key chain, from a block in its
        table, with that block's ids among its own (an entry counts its ids: see
        ``CommitEntry``). Such a sequence's entry completing no new block is skipped; an
        unknown sequence, or one without a key chain, stops it. Returns the (step,
        position) of the entry it stopped at, or None when every entry was added or
        skipped. Mutates itself only.

        One call for a decode run's steps (``advance_many``), not one per step: about half
        the steps of a long run commit nothing."""
        bs = self.block_size
        rows, states, num_entries, flat = self.rows, self.states, self.num_entries, self.entries
        for step, entries in enumerate(commits):
            if not entries:
                start = 0
                continue  # a step that commits nothing: about half of a long run's
            for at in range(start, len(entries)):
                seq_id, token_ids, num_tokens, block_ids, _ = entries[at]
                row = rows.get(seq_id)
                if row is None:
                    state = seqs.get(seq_id)
                    if state is None or state.chain is None:
                        return step, at
                    first = state.num_blocks
                else:
                    state = states[row]
                    first = state.num_blocks + num_entries[row]
                if num_tokens // bs != first + 1:
                    if num_tokens // bs <= first:
                        continue  # no new full block
                    return step, at
                try:
                    block = block_ids[first]
                except IndexError:
                    return step, at  # the table lacks block first (first >= 0: no wrap-around)
                begin = first * bs
                # id_list's branches for a sequence's own ids inline (keep the two alike):
                # a decode block within an ArrayTokenIds' appended tail, or of a
                # KeyedTokenIds list (a call per block cost a fifth of this loop).
                cls = type(token_ids)
                if cls is ArrayTokenIds and begin >= token_ids.num_prompt_ids:
                    begin -= token_ids.num_prompt_ids
                    ids = token_ids.tail[begin : begin + bs]
                elif cls is KeyedTokenIds:
                    ids = token_ids[begin : begin + bs]  # list's own slice: a plain list
                else:
                    ids = id_list(token_ids, begin, begin + bs)
                if len(ids) != bs:
                    return step, at  # a count past the ids: the plain commit raises
                if row is None:
                    row = rows[seq_id] = len(states)
                    states.append(state)
                    num_entries.append(1)
                else:
                    num_entries[row] += 1
                flat += (step, state.slot, first, block)
                flat += ids
            start = 0
        return None

    def count_blocks(self) -> None:
        """Count each row's entries into its state's registered blocks, once they are
        registered. Mutates the states."""
        for state, num_entries in zip(self.states, self.num_entries):
            state.num_blocks += num_entries


# Packers of int64 values by count (``_new_packer``): one compiled format per count,
# since building the format string on every call cost as much as packing 20 values.
_PACKERS: dict[int, struct.Struct] = {}
_MAX_PACKERS = 128  # then the dict starts over, as struct's own cache of formats does


def _new_packer(num_values: int) -> struct.Struct:
    """A Struct packing ``num_values`` integers as int64 (native order, 8-byte standard
    size), kept in ``_PACKERS``. Mutates it."""
    if len(_PACKERS) >= _MAX_PACKERS:
        _PACKERS.clear()
    packer = _PACKERS[num_values] = struct.Struct(f"={num_values}q")
    return packer


def _packed_rows(values: list[int], rows: np.ndarray, width: int) -> tuple[np.ndarray, int]:
    """``values`` (integers, a multiple of ``width`` of them) packed row by row into the
    first rows of ``rows`` (int64 [capacity, width], C order), or of a new array of at
    least twice the capacity when they do not fit. Returns (that array, which the caller
    keeps for its next call, and the number of rows filled); rows past those keep stale
    values. ``struct`` packs them in one C loop at about half the instructions per value
    of ``np.fromiter`` (numpy's generic item setter per value) or ``np.array`` (which
    first scans for nesting), and one array reused saves a numpy allocation per call;
    decode registrations convert ``width = 4 + block_size`` values per block, in calls
    of a few blocks. Raises struct.error for a value that is no integer or lies outside
    int64 (then the rows hold part of the values). Mutates ``rows`` and ``_PACKERS``."""
    num_values = len(values)
    num_rows = num_values // width
    if num_rows > len(rows):
        rows = np.empty((max(num_rows, 2 * len(rows)), width), dtype=np.int64)
    (_PACKERS.get(num_values) or _new_packer(num_values)).pack_into(rows, 0, *values)
    return rows, num_rows


_FIRST_SLOTS = 16  # rows of a block-hash index's last-key table when it first grows
_FIRST_ENTRY_ROWS = 64  # rows of a block-hash index's decode-registration buffer at first


class BlockHashPrefixIndex:
    """vLLM-style prefix cache: full blocks keyed by a chained hash of their tokens.

    Key: ``BlockKeyChain``'s two 64-bit lanes of ``kvbench.hashing``'s chained block keys
    (the cache salt as ``extra_key`` starts the chain). Lane 0 keys the hash map, lane 1
    is compared on a hit. The prefix-reuse bound (``metrics.prefix_reused_tokens``) uses
    the same keys.

    Only full blocks are registered, so matches are block aligned and capped at
    ``(len(token_ids) - 1) // block_size`` blocks. Registered blocks stay registered while
    they sit in the free list (cached-free) and are forgotten when the pool reuses them; a
    second block computed for an already registered key stays unregistered (de-duplication
    happens on the next request, which attaches the registered one).
    """

    registers_blocks = True
    registers_full_blocks_only = True
    holds_blocks = False  # cached blocks wait in the pool's free list

    def __init__(self) -> None:
        self._pool: BlockPool | None = None
        self._block_size = 0
        # uint64 [block size]: block_multipliers(block size), set by bind.
        self._multipliers = np.zeros(0, dtype=np.uint64)
        # int64 [capacity, 4 + block size]: a call's decode registrations, packed by
        # _packed_rows (set by bind; _register_in_steps keeps the array it grows into).
        self._entry_rows = np.zeros((0, 0), dtype=np.int64)
        self._entry_width = 0  # its width: 4 + block size, set by bind
        # The hash table (native.py: linear probing, lane 0 -> block). Dropping a
        # registration leaves its entry behind (see _on_blocks_reused): an entry h -> b is
        # live while the pool flags b cached and _block_hash[b] == h; the table is rebuilt
        # from the live blocks when more than half its slots are used.
        self._keys = np.zeros(0, dtype=np.uint64)  # [slots]
        self._vals = np.zeros(0, dtype=np.int32)  # [slots] block, or native.EMPTY
        self._used = np.zeros(1, dtype=np.int64)  # slots used (live and dead entries)
        self._block_hash = np.zeros(0, dtype=np.uint64)  # per block: its key's lane 0 while registered
        self._block_check = np.zeros(0, dtype=np.uint64)  # per block: its key's lane 1 while registered
        self._num_registered = 0
        self._seqs: dict[int, _SeqHashState] = {}
        # uint64 [slots, 2]: per tracked sequence (its state's slot) both lanes of its last
        # key, the rows the compiled decode registrations read and write in place (a
        # Python pair per sequence cost a conversion each way per call); free slots below.
        self._last_keys = np.zeros((0, 2), dtype=np.uint64)  # grown by _track
        self._free_slots: list[int] = []  # popped from the end: lowest slot first
        self._num_evicted_blocks = 0
        # Registrations dropped so far, and per block the count just after its latest drop
        # (0: never dropped): a match memo taken at count n lost block b iff
        # _dropped_at[b] > n.
        self._num_drops = 0
        self._dropped_at = np.zeros(0, dtype=np.int64)  # [num_blocks]
        # Bumped by every registration call and every drop: while unchanged (and the pool's
        # ref_version too), a chain's memoised match is still the answer (match).
        self._version = 0
        # The last match's answer, whose handle is the chain it memoises: returned again
        # while that memo stands, instead of a new PrefixMatch (a frozen dataclass costs
        # ~9K instructions to build; admission asks up to three times per step for the
        # same head). Held here, not on the chain, which the answer already references.
        self._answer: PrefixMatch = NO_MATCH

    # ------------------------------------------------------------------ protocol
    def bind(self, pool: BlockPool, block_size: int) -> None:
        if self._pool is not None:
            raise ValueError("BlockHashPrefixIndex: already bound to a pool (use one index per manager)")
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        self._pool = pool
        self._block_size = block_size
        self._multipliers = block_multipliers(block_size)
        self._entry_width = 4 + block_size  # step, slot, position, block, then the block's ids
        self._entry_rows = np.empty((_FIRST_ENTRY_ROWS, self._entry_width), dtype=np.int64)
        num_slots = 1 << max(_SLOTS_PER_BLOCK * max(pool.num_blocks, 16) - 1, 1).bit_length()
        self._keys = np.zeros(num_slots, dtype=np.uint64)
        self._vals = np.full(num_slots, native.EMPTY, dtype=np.int32)
        self._block_hash = np.zeros(pool.num_blocks, dtype=np.uint64)
        self._block_check = np.zeros(pool.num_blocks, dtype=np.uint64)
        self._dropped_at = np.zeros(pool.num_blocks, dtype=np.int64)
        pool.set_reuse_listener(self._on_blocks_reused)

    def match(self, token_ids: Sequence[int], extra_key: str | None) -> PrefixMatch:
        """See ``PrefixIndex.match``. Pure as far as the cache goes; it memoises the walk on
        the sequence's key chain (the index keeps the last answer, returned again while
        its chain's memo stands: ``_answer``) and revalidates the memo cheaply:

        - memoised blocks stay registered under the same keys unless one was dropped
          (registrations are only dropped when the pool reuses a block). When any block
          was dropped since the memo, the memo is cut at the first block whose latest
          drop came after it (O(memo) compiled).
        - the count of unreferenced matched blocks stays valid while the pool's
          ``ref_version`` is unchanged and no matched block was dropped.
        - only the walk past the memo reads the hash table (compiled): O(new blocks).

        The three are one compiled call (``native.revalidate_run``), made only when one
        of them has work; a chain that matched nothing walks from its first block
        (``native.lookup_run``).
        """
        pool = self._bound_pool()
        bs = self._block_size
        num_full = max(len(token_ids) - 1, 0) // bs
        chain = self._chain(token_ids, extra_key)
        if (
            chain.match_owner is self
            and chain.match_version == self._version
            and chain.match_ref_version == pool.ref_version
            and chain.match_num_full == num_full
        ):
            # Nothing it read changed: the memo's answer (as built at the end).
            if self._answer.handle is not chain:
                array = chain.match_array
                self._answer = PrefixMatch(len(array) * bs, array, chain.match_num_taken, chain)
            return self._answer
        # The matched blocks, int64 [matched]: never converted to Python ints here (a
        # long conversation's match holds thousands).
        array = chain.match_array if chain.match_owner is self else NO_BLOCK_IDS
        num_taken = 0
        if len(array):
            num_taken = chain.match_num_taken if pool.ref_version == chain.match_ref_version else -1
            since = chain.match_num_drops if self._num_drops != chain.match_num_drops else -1
            valid = min(len(array), num_full)
            walk = valid < num_full or valid < len(array) or num_taken < 0 or since >= 0
        else:
            walk = num_full > 0  # nothing matched before (or no memo): from the first block
        if walk:
            # A chain holds keys for every block it matched: only a walk past them keys more.
            chain.extend(token_ids, num_full)  # all at once: commit needs them anyway
            # What a compiled walk reads (lookup_run's arrays, in its order): the hash
            # table, the pool's state, the blocks' registered keys and the chain's keys
            # (read after extend, which may reallocate them).
            table = (
                self._keys,
                self._vals,
                pool.state,
                self._block_hash,
                self._block_check,
                chain.hashes,
                chain.checks,
            )
            if len(array):
                valid, run, num_taken = native.revalidate_run(
                    self._dropped_at, array, valid, since, *table, num_full, num_taken
                )
                if valid < len(array):
                    array = array[:valid]
                if len(run):
                    array = np.concatenate([array, run]) if len(array) else run
            else:
                array, num_taken = native.lookup_run(*table, 0, num_full)
        chain.match_owner, chain.match_array = self, array
        chain.match_num_taken = num_taken
        chain.match_ref_version = pool.ref_version
        chain.match_num_drops = self._num_drops
        chain.match_version = self._version
        chain.match_num_full = num_full
        answer = self._answer
        if not len(array):
            if not isinstance(token_ids, KeyCarrier):
                return NO_MATCH
            # A carried chain goes to acquire, so commit continues it instead of rehashing.
            # (The last answer kept may hold an empty array, as the memo's early return
            # builds it: an equal answer.)
            if answer.handle is not chain or answer.num_tokens:
                self._answer = PrefixMatch(0, (), 0, handle=chain)
        elif answer.handle is not chain or answer.blocks is not array or answer.num_blocks_taken != num_taken:
            self._answer = PrefixMatch(len(array) * bs, array, num_taken, chain)
        # (Else the last answer, for this chain, says the same: a revalidation that found
        # nothing changed, as a waiting head's checks mostly do, builds no new one.)
        return self._answer

    def match_may_grow(self, token_ids: Sequence[int], extra_key: str | None, seq_ids: Sequence[int]) -> bool:
        """See ``PrefixIndex.match_may_grow``. With no frees, a match changes only if the
        pool reuses one of its blocks (the walk then stops before it) or a new registration
        supplies the key at a position ``k`` it does not hold: its frontier (the first
        block that missed) or, once a reused block cut it there, a position it held (the
        key is free again). A sequence registers blocks from its own frontier ``f`` on,
        each key hanging off the previous one, so it can only ever supply key ``k`` when its
        keys so far equal ``token_ids``' first ``f`` blocks' (its last registered key is
        theirs: a chained key covers every block before it) and ``f <= k``: then True (it
        cannot be ruled out; in simulation it needs another request's stand-in outputs in a
        prompt). ``k`` is at most the matched blocks, less one for a whole match (every
        block a match may hold: no frontier), which can only grow back."""
        num_matched = self.match(token_ids, extra_key).num_blocks
        whole = num_matched >= max(len(token_ids) - 1, 0) // self._block_size
        last_position = num_matched - 1 if whole else num_matched  # the largest k
        chain = self._chain(token_ids, extra_key)  # the memo's chain (a KeyCarrier's) or a new one
        chain.extend(token_ids, num_matched)  # no-op for the memo's chain
        hashes = chain.hashes
        for seq_id in seq_ids:
            state = self._seq(seq_id)
            frontier = state.num_blocks
            if frontier <= last_position and (
                frontier == 0 or state.chain is None or self._last_keys[state.slot, 0] == hashes[frontier - 1]
            ):
                return True
        return False

    def acquire(self, seq_id: int, match: PrefixMatch) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"BlockHashPrefixIndex.acquire: seq {seq_id} already tracked")
        chain = match.handle
        if chain is None and not match.num_blocks:
            chain = None  # NO_MATCH: commit starts a chain
        elif not isinstance(chain, BlockKeyChain) or chain.block_size != self._block_size:
            raise ValueError(f"BlockHashPrefixIndex.acquire: seq {seq_id}: the match is not from this index")
        self._track(seq_id, match.num_blocks, chain)

    def commit(
        self, seq_id: int, token_ids: Sequence[int], block_ids: Sequence[int], extra_key: str | None
    ) -> tuple[tuple[int, int], ...]:
        # The hash index holds no block references (registered blocks live on in the free
        # list), so a duplicate pins nothing: the first registration wins, as in vLLM.
        pool = self._bound_pool()
        state = self._seq(seq_id)
        bs = self._block_size
        num_full = len(token_ids) // bs
        if num_full <= state.num_blocks:
            return ()  # no new full block (most decode steps)
        if num_full > len(block_ids):
            raise ValueError(
                f"BlockHashPrefixIndex.commit: seq {seq_id} commits {len(token_ids)} tokens "
                f"but its block table has only {len(block_ids)} blocks"
            )
        chain = state.chain
        if chain is None:  # the state takes it with its last key, below
            chain = self._chain(token_ids, extra_key)
        chain.extend(token_ids, num_full)
        first = state.num_blocks
        new_blocks = np.array(block_ids[first:num_full], dtype=np.int64)
        self._version += 1
        self._num_registered += native.register_run(
            *self._registration_arrays(pool),
            chain.hashes,
            chain.checks,
            new_blocks,
            first,
        )
        state.chain = chain
        state.num_blocks = num_full
        self._last_keys[state.slot] = chain.key_before(num_full)
        return ()

    def commit_many(self, entries: Sequence[CommitEntry]) -> None:
        """See ``PrefixIndex.commit_many``. Decode commits (``_StepRegistrations.add_steps``)
        join a batch keyed and registered in one compiled call (``_register_entries``);
        any other entry is a plain ``commit``, after the batch so far (registration order
        decides which of two equal keys wins)."""
        bs = self._block_size
        batch = _StepRegistrations(bs)
        at = 0
        while True:
            stop = batch.add_steps((entries,), self._seqs, at)
            if stop is None:
                break
            _, at = stop  # step 0: the only one
            if batch.rows:
                self._register_entries(batch)
                batch = _StepRegistrations(bs)
            seq_id, token_ids, num_tokens, block_ids, extra_key = entries[at]
            # A plain commit (KeyError naming an unknown seq; ValueError for a bad count).
            self.commit(seq_id, prefix_of(token_ids, num_tokens), block_ids, extra_key)
            at += 1
        if batch.rows:
            self._register_entries(batch)

    def allocate_decode_steps(
        self, pool: BlockPool, needs: np.ndarray, commits: Sequence[Sequence[CommitEntry]]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """See ``PrefixIndex.allocate_decode_steps``: one compiled pass
        (``_register_in_steps``) when every entry completes exactly the next block of its
        sequence (counting its earlier entries in the call), which has a key chain, from a
        block already in its table; else None."""
        if pool is not self._pool:
            raise ValueError(
                "BlockHashPrefixIndex.allocate_decode_steps: not the pool this index is bound to"
            )
        num_blocks = int(np.add.reduce(needs))  # (ndarray.sum adds a Python-level wrapper)
        if num_blocks > pool.num_free:
            raise MemoryError(
                f"BlockHashPrefixIndex.allocate_decode_steps: {num_blocks} blocks, {pool.num_free} free"
            )
        steps = _StepRegistrations(self._block_size)
        stop = steps.add_steps(commits, self._seqs)
        if stop is not None:
            step, at = stop
            self._seq(commits[step][at][0])  # only to raise, naming an unknown seq
            return None
        return self._register_in_steps(steps, needs, native.step_buffers(num_blocks, len(needs)))

    def _register_in_steps(
        self,
        steps: _StepRegistrations,
        needs: np.ndarray,
        buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Take ``needs[t]`` blocks per step ``t`` (int64 [steps]) into ``buffers``
        (``native.step_buffers`` for them) and key and register ``steps``' entries after
        their steps, in one compiled pass (``native.allocate_steps_registering``), which
        writes each sequence's last key into its slot of ``_last_keys`` (the chains are
        left behind: see ``BlockKeyChain``); the states count the blocks, and the pool's
        reuse listener hears of the cached blocks taken. Returns
        ``BlockPool.allocate_steps``' result. Mutates the pool, index, states and buffers."""
        pool = self._bound_pool()
        num_rows = self._pack(steps)
        taken, reused, reused_per_step = buffers
        num_reused, registered = native.allocate_steps_registering(
            *self._registration_arrays(pool),
            needs,
            taken,
            reused,
            reused_per_step,
            self._multipliers,
            self._entry_rows,  # [capacity, 4 + bs], its first num_rows rows the entries
            num_rows,
            self._last_keys,  # each entry's slot chains from it, then holds the entry's key
        )
        self._num_registered += registered
        steps.count_blocks()
        if num_reused:  # the drops, as the pool's allocations would have told (none on a commit)
            pool.tell_reused(reused[:num_reused])
        return taken, reused_per_step

    def _register_entries(self, steps: _StepRegistrations) -> None:
        """``_register_in_steps`` for one step that takes no blocks (``commit_many``'s
        decode commits): ``native.register_entries``, whose fewer arguments cost less to
        pass. Mutates the pool (cached flags), index and states."""
        pool = self._bound_pool()
        num_rows = self._pack(steps)
        self._num_registered += native.register_entries(
            *self._registration_arrays(pool),
            self._multipliers,
            self._entry_rows,
            num_rows,
            self._last_keys,
        )
        steps.count_blocks()

    def _registration_arrays(self, pool: BlockPool) -> tuple[np.ndarray, ...]:
        """What a compiled registration writes, the first arguments of ``native.register_run``,
        ``register_entries`` and ``allocate_steps_registering`` in their order: the hash
        table (keys, values, used slots), ``pool``'s state and counts, each block's key
        lanes. Pure."""
        return (
            self._keys,
            self._vals,
            self._used,
            pool.state,
            pool.counts,
            self._block_hash,
            self._block_check,
        )

    def _pack(self, steps: _StepRegistrations) -> int:
        """Pack ``steps``' entries into ``_entry_rows`` (grown when short) and count the
        registration into ``_version``; returns how many rows they fill. Done before the
        compiled call: a value that is no int64 raises here, changing nothing else."""
        self._entry_rows, num_rows = _packed_rows(steps.entries, self._entry_rows, self._entry_width)
        self._version += 1
        return num_rows

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        if child_seq_id in self._seqs:
            raise ValueError(f"BlockHashPrefixIndex.fork: seq {child_seq_id} already tracked")
        parent = self._seq(parent_seq_id)
        # The copy shares every full block so far; the chains diverge from the next one.
        child = self._track(child_seq_id, parent.num_blocks, None)
        if parent.chain is not None:
            # The row, not the copied chain's key: the chain may lag behind num_blocks.
            child.chain = parent.chain.copy()
            self._last_keys[child.slot] = self._last_keys[parent.slot]

    def release(self, seq_id: int) -> None:
        self._free_slots.append(self._seq(seq_id).slot)
        del self._seqs[seq_id]

    def evict(self, num_blocks: int) -> int:
        return 0  # cached blocks already count as free; the pool evicts them on reuse

    @property
    def num_evicted_blocks(self) -> int:
        return self._num_evicted_blocks

    def block_refs(self) -> dict[int, int]:
        return {}

    def check(self) -> None:
        pool = self._bound_pool()
        keys, vals, block_hash = self._keys.tolist(), self._vals.tolist(), self._block_hash.tolist()
        entries = {k: v for k, v in zip(keys, vals) if v != native.EMPTY}
        assert len(entries) == int(self._used[0]), (
            f"{len(entries)} hash table entries, {int(self._used[0])} counted"
        )
        assert 2 * len(entries) <= len(keys), f"{len(entries)} entries in {len(keys)} slots"
        num_live = sum(1 for h, b in entries.items() if pool.is_cached(b) and block_hash[b] == h)
        for block in range(pool.num_blocks):
            if pool.is_cached(block):
                assert native.lookup(self._keys, self._vals, self._block_hash[block]) == block, (
                    f"block {block}: flagged cached but its key has no hash table entry for it"
                )
        assert num_live == self._num_registered == sum(map(pool.is_cached, range(pool.num_blocks))), (
            f"{num_live} live hash table entries, {self._num_registered} registrations counted"
        )
        assert int(self._dropped_at.max(initial=0)) <= self._num_drops, (
            f"a drop stamp {int(self._dropped_at.max())} after the {self._num_drops} drops counted"
        )
        slots = [state.slot for state in self._seqs.values()]
        assert sorted(slots + self._free_slots) == list(range(len(self._last_keys))), (
            "last-key slots: a slot shared, lost or both taken and free"
        )
        for seq_id, state in self._seqs.items():
            # A chain keyed that far (it may lag: see _SeqHashState) must agree.
            if state.chain is not None and state.chain.num_blocks >= state.num_blocks:
                assert self._last_key(state) == state.chain.key_before(state.num_blocks), (
                    f"seq {seq_id}: last key differs from its chain's key of block {state.num_blocks - 1}"
                )

    # ------------------------------------------------------------------ extras
    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the hash map (in use or cached-free)."""
        return self._num_registered

    def registration(self, seq_id: int) -> tuple[int, tuple[int, int] | None]:
        """How many of ``seq_id``'s full blocks are registered, and the key (both lanes)
        its next block chains from (None before its first commit when it has no key chain
        yet). Pure; KeyError naming an unknown sequence."""
        state = self._seq(seq_id)
        return state.num_blocks, self._last_key(state)

    def _last_key(self, state: _SeqHashState) -> tuple[int, int] | None:
        """Both lanes of ``state``'s last key as Python ints; None without a key chain. Pure."""
        if state.chain is None:
            return None
        lane_0, lane_1 = self._last_keys[state.slot].tolist()
        return lane_0, lane_1

    def _track(self, seq_id: int, num_blocks: int, chain: BlockKeyChain | None) -> _SeqHashState:
        """Start tracking ``seq_id`` with ``num_blocks`` registered and ``chain`` (None, or
        keyed up to at least ``num_blocks`` blocks: its key there is the last key) in a
        free slot (the table doubles when none is left). Mutates the tracking and slots."""
        key = None if chain is None else chain.key_before(num_blocks)  # may raise: nothing changed yet
        free = self._free_slots
        if not free:  # the table doubles (16 rows at first)
            num_slots = len(self._last_keys)
            grown = max(2 * num_slots, _FIRST_SLOTS)
            self._last_keys = np.concatenate([self._last_keys, np.zeros((grown - num_slots, 2), np.uint64)])
            free.extend(range(grown - 1, num_slots - 1, -1))
        state = self._seqs[seq_id] = _SeqHashState(num_blocks, chain, free.pop())
        if key is not None:
            self._last_keys[state.slot] = key
        return state

    def _on_blocks_reused(self, block_ids: np.ndarray) -> None:
        # The pool is about to overwrite these cached-free blocks (lazy eviction). It has
        # already cleared their cached flags, which kills their hash map entries: no
        # per-block work here but the drop stamp (9M blocks on the full Mooncake trace).
        num = len(block_ids)
        self._num_registered -= num
        self._num_evicted_blocks += num
        self._num_drops += num
        self._dropped_at[block_ids] = self._num_drops
        self._version += 1

    def _chain(self, token_ids: Sequence[int], extra_key: str | None) -> BlockKeyChain:
        """The key chain ``token_ids`` carries (a KeyCarrier), else a throwaway one."""
        if isinstance(token_ids, KeyCarrier):
            return token_ids.chain(self._block_size, extra_key)
        return BlockKeyChain(self._block_size, extra_key)

    def _seq(self, seq_id: int) -> _SeqHashState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"BlockHashPrefixIndex: unknown seq {seq_id}") from None

    def _bound_pool(self) -> BlockPool:
        if self._pool is None:
            raise ValueError("BlockHashPrefixIndex: not bound to a pool (PagedKVManager binds it)")
        return self._pool
