"""A fixed pool of KV block ids with reference counts and an O(1) LRU free list.

Tensor-free: a block is an integer id ``0 .. num_blocks - 1`` (all usable; none is
reserved as a null block because block tables here never need a padding id).

Free blocks sit in an intrusive doubly linked list kept in two int32 rows
(``NEXT`` / ``PREV`` of ``native``'s pool state, with a sentinel at index ``num_blocks``),
so that

- ``allocate`` pops the head (least recently freed) in O(1),
- ``decref`` to zero appends at the tail in O(1),
- ``incref`` of a free block removes it from the middle in O(1), which is how a
  cached-free block is revived by a prefix hit. ``collections.deque`` cannot remove
  from the middle in O(1).

The per-block loops of the batch calls (``allocate_many``, ``incref_many``,
``free_many``) run compiled (``engines/kv/native.py``); single-block calls stay in
Python over the same arrays.

Two optional block properties serve the prefix indexes:

- *cached*: a free block that still holds reusable KV (block-hash index). It stays
  in the free list; when ``allocate`` pops it for reuse, the pool clears the flag and
  calls the reuse listener with the reused ids so the index can forget them (lazy
  eviction; one call per allocation, since a long prefill chunk reuses hundreds).
- *soft references*: references the holder gives up on request (unlocked radix-tree
  nodes). A block whose every reference is soft is *reclaimable*: not free yet, but an
  index ``evict`` can free it. ``num_reclaimable`` is kept exact in O(1) per call.

Free list picture (head is reused first)::

    sentinel <-> b7 <-> b2 <-> b9 <-> sentinel
                 ^ head (oldest free)  ^ tail (freed last)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvbench.engines.kv import native
from kvbench.engines.kv.native import (
    CACHED,
    NEXT,
    NUM_CACHED_FREE,
    NUM_FREE,
    NUM_RECLAIMABLE,
    PREV,
    REF,
    REF_VERSION,
    SOFT,
)


def _ids(block_ids: Iterable[int]) -> np.ndarray:
    """Block ids as an int64 array for the compiled loops (a list, tuple or array)."""
    if isinstance(block_ids, np.ndarray):
        return block_ids.astype(np.int64, copy=False)
    return np.array(block_ids if isinstance(block_ids, Sequence) else list(block_ids), dtype=np.int64)


class BlockPool:
    """Reference-counted block ids with an LRU free list.

    Mutating calls raise ``ValueError`` (naming the block) on misuse: decref of a free
    block, a hard decref when only soft references remain, and so on; an id outside the
    pool raises ``IndexError``. ``allocate`` raises ``MemoryError`` when the free list is
    empty; call ``num_free`` first.
    """

    __slots__ = ("num_blocks", "_st", "_ref_at", "_cached_at", "_counts", "_counts_at", "_reuse_listener")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        sentinel = num_blocks
        # Rows REF, SOFT, CACHED, NEXT, PREV (native.py); column num_blocks is the sentinel.
        st = np.zeros((5, num_blocks + 1), dtype=np.int32)
        # Initially every block is free, in id order: 0 is the head.
        # NEXT[i] = i + 1 (the last points at the sentinel); NEXT[sentinel] = head = 0.
        st[NEXT, :num_blocks] = np.arange(1, num_blocks + 1)
        st[NEXT, sentinel] = 0 if num_blocks else sentinel
        # PREV[0] = sentinel, PREV[i] = i - 1; PREV[sentinel] = tail = num_blocks - 1.
        st[PREV, 1 : num_blocks + 1] = np.arange(num_blocks)
        st[PREV, 0] = sentinel
        st[PREV, sentinel] = num_blocks - 1 if num_blocks else sentinel
        self._st = st
        # Rows REF and CACHED as Python-int views of the same memory, for per-block
        # queries from Python (half the cost of a numpy scalar read).
        self._ref_at = memoryview(st[REF])
        self._cached_at = memoryview(st[CACHED])
        # NUM_FREE, NUM_CACHED_FREE, NUM_RECLAIMABLE, REF_VERSION.
        self._counts = np.array([num_blocks, 0, 0, 0], dtype=np.int64)
        # The same counters as Python ints (the queries below read them every step).
        self._counts_at = memoryview(self._counts)
        self._reuse_listener: Callable[[np.ndarray], None] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks in the free list, cached-free ones included (all can be allocated now)."""
        return self._counts_at[NUM_FREE]

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold reusable KV (reused last-resort, LRU order)."""
        return self._counts_at[NUM_CACHED_FREE]

    @property
    def num_reclaimable(self) -> int:
        """Referenced blocks whose every reference is soft (an index eviction frees them)."""
        return self._counts_at[NUM_RECLAIMABLE]

    @property
    def ref_version(self) -> int:
        """Changes whenever ``incref``, ``decref`` or ``free_many`` moves a block out of or
        into the free list. Allocations do not change it: what they take is in their return
        value and, for cached blocks, the reuse listener. Lets a prefix index keep a count of
        unreferenced blocks in a match valid without re-reading every ref count."""
        return self._counts_at[REF_VERSION]

    def ref_count(self, block_id: int) -> int:
        return self._ref_at[self._id(block_id)]

    def soft_count(self, block_id: int) -> int:
        return int(self._st[SOFT, self._id(block_id)])

    def is_cached(self, block_id: int) -> bool:
        return self._cached_at[self._id(block_id)] != 0

    @property
    def state(self) -> np.ndarray:
        """The live pool state (``native``'s int32 rows REF, SOFT, CACHED, NEXT, PREV), for
        a prefix index whose compiled loops read the flags and counts. Read only: mutate
        through ``set_cached_run`` and the other calls."""
        return self._st

    @property
    def counts(self) -> np.ndarray:
        """The live counters (``native``'s int64 NUM_FREE .. REF_VERSION), for the same
        compiled loops (``native.register_run`` keeps NUM_CACHED_FREE). Read only otherwise."""
        return self._counts

    def is_exclusive(self, block_id: int) -> bool:
        """Whether exactly one reference holds the block and no prefix index registered it:
        its holder may write any slot in place. The KV manager's decode fast path. Pure."""
        return self._ref_at[block_id] == 1 and not self._cached_at[block_id]

    def free_blocks(self) -> list[int]:
        """Free block ids from head (next reused) to tail. O(num_free); for tests and checks."""
        # One past num_free: a list longer than its count shows in the checks.
        return native.free_list_head(self._st, self.num_free + 1).tolist()

    def next_free(self, num_blocks: int) -> np.ndarray:
        """The blocks the next allocations take, in order: the free list's first
        ``num_blocks`` (all of it when shorter), head first, int64 [n]. O(n). Pure."""
        return native.free_list_head(self._st, max(num_blocks, 0))

    @property
    def reuse_listener(self) -> Callable[[np.ndarray], None] | None:
        return self._reuse_listener

    # ------------------------------------------------------------------ mutations
    def set_reuse_listener(self, listener: Callable[[np.ndarray], None] | None) -> None:
        """Called with the ids of the cached-free blocks an ``allocate``/``allocate_many`` call
        reused (int64 [reused], in allocation order), after they left the free list (one listener)."""
        if listener is not None and self._reuse_listener is not None:
            raise ValueError("BlockPool: a reuse listener is already set (one prefix index per pool)")
        # None clears it (a profiler may then wrap the old one).
        self._reuse_listener = listener

    def allocate(self) -> int:
        """Pop the least recently freed block, set its ref count to 1 and return its id.

        If the block was cached, the cache entry is evicted first (the flag is cleared and
        the reuse listener called). Raises MemoryError when no block is free.
        """
        if self._counts_at[NUM_FREE] == 0:
            raise MemoryError(f"BlockPool: no free block (num_blocks={self.num_blocks})")
        b, was_cached = native.allocate_one(self._st, self._counts)
        if was_cached and self._reuse_listener is not None:
            self._reuse_listener(np.array([b], dtype=np.int64))
        return b

    def allocate_many(self, num_blocks: int) -> list[int]:
        """``allocate`` ``num_blocks`` times (head first): the same blocks, flags and listener
        calls, in one pass (a long prefill chunk takes hundreds of blocks per step). The
        listener runs after all blocks left the free list, in allocation order. Raises
        MemoryError, allocating nothing, when fewer are free."""
        return self.allocate_array(num_blocks).tolist()

    def allocate_array(self, num_blocks: int) -> np.ndarray:
        """``allocate_many`` returning the ids as an int64 array [num_blocks] (for callers
        that hand them on to other compiled loops)."""
        if num_blocks > self._counts_at[NUM_FREE]:
            raise MemoryError(f"BlockPool: {num_blocks} blocks requested, {self.num_free} free")
        if num_blocks <= 0:
            return np.empty(0, dtype=np.int64)
        out = np.empty(num_blocks, dtype=np.int64)
        reused = np.empty(num_blocks, dtype=np.int64)
        num_reused = native.allocate_into(self._st, self._counts, out, reused)
        self.tell_reused(reused[:num_reused])
        return out

    def allocate_steps(self, needs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``allocate_array(needs[t])`` for each step ``t`` (int64 [steps]) in one call: the
        same blocks in the same order, the listener told once, after all of them, of the
        cached blocks reused in order. Returns (the blocks int64 [sum(needs)], how many of
        each step's blocks were cached int64 [steps]). Raises MemoryError, allocating
        nothing, when fewer than ``sum(needs)`` are free."""
        total = int(needs.sum())
        if total > self._counts_at[NUM_FREE]:
            raise MemoryError(f"BlockPool: {total} blocks requested, {self.num_free} free")
        out, reused, reused_per_step = native.step_buffers(total, len(needs))
        num_reused = native.allocate_steps_into(self._st, self._counts, needs, out, reused, reused_per_step)
        self.tell_reused(reused[:num_reused])
        return out, reused_per_step

    def tell_reused(self, reused: np.ndarray) -> None:
        """Tell the reuse listener (if any) that these cached blocks (int64, in order) left
        the free list to be overwritten: for callers whose compiled loops pop blocks
        themselves (``native.allocate_steps_registering``)."""
        if len(reused) and self._reuse_listener is not None:
            self._reuse_listener(reused)

    def incref(self, block_id: int) -> None:
        """Add one (hard) reference. A free block leaves the free list (a cached block is
        revived with its KV intact)."""
        if not native.incref_one(self._st, self._counts, block_id):
            self._id(block_id)

    def incref_many(self, block_ids: Iterable[int]) -> None:
        """``incref`` each block in order (a prefix hit attaches hundreds of blocks at once).
        Same effect as the loop, including the free-list removals; an id outside the pool
        raises IndexError, the blocks before it keeping their new references."""
        ids = _ids(block_ids)
        bad = native.incref_many(self._st, self._counts, ids)
        if bad >= 0:
            raise IndexError(f"BlockPool.incref: block {int(ids[bad])} outside 0..{self.num_blocks - 1}")

    def decref(self, block_id: int) -> bool:
        """Drop one hard reference; returns True when the block became free.

        A freed block goes to the free-list tail (reused last) and keeps its cached flag.
        Raises ValueError when the block has no hard reference left.
        """
        freed = native.decref_one(self._st, self._counts, block_id)
        if freed < 0:
            self._no_hard_reference(block_id)
        return freed == 1

    def free_many(self, block_ids: Iterable[int]) -> int:
        """``decref`` each block in the given order; returns how many became free (they join
        the tail in that order). Raises ValueError like ``decref`` (IndexError for an id
        outside the pool); blocks before the offending one stay released."""
        ids = _ids(block_ids)
        num_freed, bad = native.free_many(self._st, self._counts, ids)
        if bad >= 0:
            self._no_hard_reference(int(ids[bad]))
        return int(num_freed)

    def set_cached_many(self, block_ids: Iterable[int]) -> None:
        """Flag each block as holding reusable KV; a flag is cleared only when the pool
        reuses the block. Mutates the flags and the cached-free count (the loop the
        block-hash index runs inside ``native.register_run``). IndexError for an id outside
        the pool, the blocks before it flagged."""
        ids = _ids(block_ids)
        bad = native.set_cached(self._st, self._counts, ids)
        if bad >= 0:
            self._id(int(ids[bad]))

    def soften(self, block_id: int) -> None:
        """Mark one existing hard reference as soft (its holder will give it up on request)."""
        b = self._id(block_id)
        r = self._st[REF, b]
        s = self._st[SOFT, b] + 1
        if s > r:
            raise ValueError(f"BlockPool.soften: block {block_id} has no hard reference to soften")
        self._st[SOFT, b] = s
        if s == r:
            self._counts[NUM_RECLAIMABLE] += 1

    def harden(self, block_id: int) -> None:
        """Turn one soft reference back into a hard one (pins the block)."""
        b = self._id(block_id)
        s = self._st[SOFT, b]
        if s == 0:
            raise ValueError(f"BlockPool.harden: block {block_id} has no soft reference")
        if s == self._st[REF, b]:
            self._counts[NUM_RECLAIMABLE] -= 1
        self._st[SOFT, b] = s - 1

    def _no_hard_reference(self, block_id: int) -> None:
        """Raise for a decref the pool refused: IndexError outside the pool, else ValueError."""
        b = self._id(block_id)
        r, s = int(self._st[REF, b]), int(self._st[SOFT, b])
        raise ValueError(f"BlockPool.decref: block {b} has no hard reference (ref_count={r}, soft={s})")

    def _id(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"BlockPool: block {block_id} outside 0..{self.num_blocks - 1}")
        return block_id

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant. O(num_blocks)."""
        n = self.num_blocks
        sentinel = n
        ref, soft, cached, nxt, prv = (row.tolist() for row in self._st)
        seen = [False] * n
        b = nxt[sentinel]
        prev = sentinel
        count = 0
        while b != sentinel:
            assert 0 <= b < n, f"free list holds invalid id {b}"
            assert not seen[b], f"free list cycles through block {b}"
            assert prv[b] == prev, f"free list prev pointer of block {b} is {prv[b]}, not {prev}"
            seen[b] = True
            count += 1
            prev = b
            b = nxt[b]
            assert count <= n, "free list longer than the pool"
        assert prv[sentinel] == prev, "free list tail pointer is stale"
        assert count == self.num_free, f"num_free={self.num_free} but the free list holds {count}"
        num_cached_free = 0
        num_reclaimable = 0
        for i in range(n):
            r, s = ref[i], soft[i]
            assert r >= 0 and 0 <= s <= r, f"block {i}: ref_count={r}, soft={s}"
            assert seen[i] == (r == 0), f"block {i}: ref_count={r} but in_free_list={seen[i]}"
            assert cached[i] in (0, 1), f"block {i}: cached flag {cached[i]}"
            if r == 0 and cached[i]:
                num_cached_free += 1
            if r > 0 and s == r:
                num_reclaimable += 1
        assert num_cached_free == self.num_cached_free, (
            f"num_cached_free={self.num_cached_free}, recount {num_cached_free}"
        )
        assert num_reclaimable == self.num_reclaimable, (
            f"num_reclaimable={self.num_reclaimable}, recount {num_reclaimable}"
        )
