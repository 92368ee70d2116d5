"""A fixed pool of KV block ids with reference counts and an O(1) LRU free list.

Tensor-free: a block is an integer id ``0 .. num_blocks - 1`` (all usable; none is
reserved as a null block because block tables here never need a padding id).

Free blocks sit in an intrusive doubly linked list kept in two int lists
(``_next`` / ``_prev``, with a sentinel at index ``num_blocks``), so that

- ``allocate`` pops the head (least recently freed) in O(1),
- ``decref`` to zero appends at the tail in O(1),
- ``incref`` of a free block removes it from the middle in O(1), which is how a
  cached-free block is revived by a prefix hit. ``collections.deque`` cannot remove
  from the middle in O(1); the lists avoid allocating any object per operation.

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

from collections.abc import Callable, Container, Iterable
from operator import itemgetter


def gather(values: list[int], indexes: tuple[int, ...]) -> tuple[int, ...]:
    """``tuple(values[i] for i in indexes)`` in one C-level call (itemgetter), for the
    1,000-block prefixes of long prompts."""
    if len(indexes) > 1:
        return itemgetter(*indexes)(values)
    return (values[indexes[0]],) if indexes else ()


class BlockPool:
    """Reference-counted block ids with an LRU free list.

    Mutating calls raise ``ValueError`` (naming the block) on misuse: decref of a free
    block, a hard decref when only soft references remain, and so on. ``allocate`` raises
    ``MemoryError`` when the free list is empty; call ``num_free`` first.
    """

    __slots__ = (
        "num_blocks",
        "_ref",
        "_soft",
        "_cached",
        "_next",
        "_prev",
        "_num_free",
        "_num_cached_free",
        "_num_reclaimable",
        "_reuse_listener",
        "_ref_version",
    )

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._soft = [0] * num_blocks
        self._cached = [False] * num_blocks
        sentinel = num_blocks
        # Initially every block is free, in id order: 0 is the head.
        # _next[i] = i + 1 (the last points at the sentinel); _next[sentinel] = head = 0.
        self._next = list(range(1, num_blocks + 1)) + [0 if num_blocks else sentinel]
        # _prev[0] = sentinel, _prev[i] = i - 1; _prev[sentinel] = tail = num_blocks - 1.
        self._prev = [sentinel, *range(num_blocks)]
        self._prev[sentinel] = num_blocks - 1 if num_blocks else sentinel
        self._num_free = num_blocks
        self._num_cached_free = 0
        self._num_reclaimable = 0
        self._reuse_listener: Callable[[list[int]], None] | None = None
        self._ref_version = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks in the free list, cached-free ones included (all can be allocated now)."""
        return self._num_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold reusable KV (reused last-resort, LRU order)."""
        return self._num_cached_free

    @property
    def num_reclaimable(self) -> int:
        """Referenced blocks whose every reference is soft (an index eviction frees them)."""
        return self._num_reclaimable

    @property
    def ref_version(self) -> int:
        """Changes whenever ``incref``, ``decref`` or ``free_many`` moves a block out of or
        into the free list. Allocations do not change it: what they take is in their return
        value and, for cached blocks, the reuse listener. Lets a prefix index keep a count of
        unreferenced blocks in a match valid without re-reading every ref count."""
        return self._ref_version

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def num_unreferenced(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` have no reference (free or cached-free). Pure; one
        C-level pass, since prefix matches of long prompts ask this of 1,000+ blocks."""
        return gather(self._ref, tuple(block_ids)).count(0)

    def soft_count(self, block_id: int) -> int:
        return self._soft[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._cached[block_id]

    @property
    def cached_flags(self) -> list[bool]:
        """The live per-block cached flags (``is_cached`` for all blocks), for a prefix index
        that reads them per block in its hot loops. Read only: mutate through
        ``set_cached_many`` and friends."""
        return self._cached

    def is_exclusive(self, block_id: int) -> bool:
        """Whether exactly one reference holds the block and no prefix index registered it:
        its holder may write any slot in place. The KV manager's decode fast path. Pure."""
        return self._ref[block_id] == 1 and not self._cached[block_id]

    def free_blocks(self) -> list[int]:
        """Free block ids from head (next reused) to tail. O(num_free); for tests and checks."""
        out = []
        sentinel = self.num_blocks
        b = self._next[sentinel]
        while b != sentinel:
            out.append(b)
            b = self._next[b]
        return out

    def num_free_before(self, watch: Container[int], limit: int) -> int:
        """How many blocks from the free list's head (the next allocated) come before the
        first one in ``watch``: at most ``limit`` and ``num_free``. Pure; O(result)."""
        nxt = self._next
        sentinel = self.num_blocks
        b = nxt[sentinel]
        count = 0
        limit = min(limit, self._num_free)
        while count < limit and b not in watch:
            count += 1
            b = nxt[b]
        return count

    @property
    def reuse_listener(self) -> Callable[[list[int]], None] | None:
        return self._reuse_listener

    # ------------------------------------------------------------------ mutations
    def set_reuse_listener(self, listener: Callable[[list[int]], None] | None) -> None:
        """Called with the ids of the cached-free blocks an ``allocate``/``allocate_many`` call
        reused, in allocation order, after they left the free list (one listener)."""
        if listener is not None and self._reuse_listener is not None:
            raise ValueError("BlockPool: a reuse listener is already set (one prefix index per pool)")
        # None clears it (a profiler may then wrap the old one).
        self._reuse_listener = listener

    def allocate(self) -> int:
        """Pop the least recently freed block, set its ref count to 1 and return its id.

        If the block was cached, the cache entry is evicted first (the flag is cleared and
        the reuse listener called). Raises MemoryError when no block is free.
        """
        sentinel = self.num_blocks
        nxt = self._next
        b = nxt[sentinel]
        if b == sentinel:
            raise MemoryError(f"BlockPool: no free block (num_blocks={self.num_blocks})")
        after = nxt[b]
        nxt[sentinel] = after
        self._prev[after] = sentinel
        self._num_free -= 1
        self._ref[b] = 1
        if self._cached[b]:
            self._cached[b] = False
            self._num_cached_free -= 1
            if self._reuse_listener is not None:
                self._reuse_listener([b])
        return b

    def allocate_many(self, num_blocks: int) -> list[int]:
        """``allocate`` ``num_blocks`` times (head first): the same blocks, flags and listener
        calls, in one pass (a long prefill chunk takes hundreds of blocks per step). The
        listener runs after all blocks left the
        free list, in allocation order. Raises MemoryError, allocating nothing, when fewer
        are free."""
        if num_blocks > self._num_free:
            raise MemoryError(f"BlockPool: {num_blocks} blocks requested, {self._num_free} free")
        if num_blocks <= 0:
            return []
        sentinel = self.num_blocks
        nxt, ref, cached = self._next, self._ref, self._cached
        out = []
        reused = []
        b = nxt[sentinel]
        for _ in range(num_blocks):
            out.append(b)
            ref[b] = 1
            if cached[b]:
                cached[b] = False
                reused.append(b)
            b = nxt[b]
        # b is now the first block left in the free list (or the sentinel).
        nxt[sentinel] = b
        self._prev[b] = sentinel
        self._num_free -= num_blocks
        if reused:
            self._num_cached_free -= len(reused)
            listener = self._reuse_listener
            if listener is not None:
                listener(reused)
        return out

    def incref(self, block_id: int) -> None:
        """Add one (hard) reference. A free block leaves the free list (a cached block is
        revived with its KV intact)."""
        r = self._ref[block_id]
        if r == 0:
            self._ref_version += 1
            p = self._prev[block_id]
            n = self._next[block_id]
            self._next[p] = n
            self._prev[n] = p
            self._num_free -= 1
            if self._cached[block_id]:
                self._num_cached_free -= 1
        elif r == self._soft[block_id]:
            self._num_reclaimable -= 1  # a hard reference pins it
        self._ref[block_id] = r + 1

    def incref_many(self, block_ids: Iterable[int]) -> None:
        """``incref`` each block in order (a prefix hit attaches hundreds of blocks at once),
        inlined. Same effect as the loop, including the free-list removals."""
        ref, soft, cached = self._ref, self._soft, self._cached
        nxt, prev = self._next, self._prev
        self._ref_version += 1
        num_revived = num_cached = num_pinned = 0  # counters in locals: hundreds of blocks
        try:
            for b in block_ids:
                r = ref[b]
                if r == 0:
                    p = prev[b]
                    n = nxt[b]
                    nxt[p] = n
                    prev[n] = p
                    num_revived += 1
                    if cached[b]:
                        num_cached += 1
                elif r == soft[b]:
                    num_pinned += 1  # a hard reference pins a reclaimable block
                ref[b] = r + 1
        finally:
            # Written back even when a bad id stops the loop: earlier blocks stay counted.
            self._num_free -= num_revived
            self._num_cached_free -= num_cached
            self._num_reclaimable -= num_pinned

    def decref(self, block_id: int) -> bool:
        """Drop one hard reference; returns True when the block became free.

        A freed block goes to the free-list tail (reused last) and keeps its cached flag.
        Raises ValueError when the block has no hard reference left.
        """
        r = self._ref[block_id] - 1
        s = self._soft[block_id]
        if r < s:
            raise ValueError(
                f"BlockPool.decref: block {block_id} has no hard reference (ref_count={r + 1}, soft={s})"
            )
        self._ref[block_id] = r
        if r == 0:
            self._ref_version += 1
            sentinel = self.num_blocks
            tail = self._prev[sentinel]
            self._next[tail] = block_id
            self._prev[block_id] = tail
            self._next[block_id] = sentinel
            self._prev[sentinel] = block_id
            self._num_free += 1
            if self._cached[block_id]:
                self._num_cached_free += 1
            return True
        if r == s:
            self._num_reclaimable += 1
        return False

    def free_many(self, block_ids: Iterable[int]) -> int:
        """``decref`` each block in the given order; returns how many became free. Same
        effect as a loop of ``decref`` (freed blocks join the tail in that order), inlined
        because freeing a long prompt's table releases thousands of blocks at once. Raises
        ValueError like ``decref``; blocks before the offending one stay released."""
        ref, soft, cached = self._ref, self._soft, self._cached
        nxt, prev = self._next, self._prev
        sentinel = self.num_blocks
        num_freed = num_cached = num_reclaimable = 0
        self._ref_version += 1  # up front: a ValueError midway leaves earlier blocks freed
        tail = prev[sentinel]
        try:
            for b in block_ids:
                r = ref[b] - 1
                s = soft[b]
                if r < s:
                    raise ValueError(
                        f"BlockPool.decref: block {b} has no hard reference (ref_count={r + 1}, soft={s})"
                    )
                ref[b] = r
                if r == 0:
                    # Link b after the tail; the sentinel is relinked once at the end.
                    nxt[tail] = b
                    prev[b] = tail
                    tail = b
                    num_freed += 1
                    if cached[b]:
                        num_cached += 1
                elif r == s:
                    num_reclaimable += 1
        finally:
            # Counters and the tail in locals (thousands of blocks per call), written back
            # even when a misused block stops the loop, so earlier blocks stay released.
            nxt[tail] = sentinel
            prev[sentinel] = tail
            self._num_free += num_freed
            self._num_cached_free += num_cached
            self._num_reclaimable += num_reclaimable
        return num_freed

    def set_cached_many(self, block_ids: Iterable[int]) -> None:
        """Flag each block as holding reusable KV (the block-hash index registers a whole
        prefill chunk's blocks at once); a flag is cleared only when the pool reuses the
        block. Mutates the flags and the cached-free count."""
        cached, ref = self._cached, self._ref
        for b in block_ids:
            if not cached[b]:
                cached[b] = True
                if ref[b] == 0:
                    self._num_cached_free += 1

    def soften(self, block_id: int) -> None:
        """Mark one existing hard reference as soft (its holder will give it up on request)."""
        r = self._ref[block_id]
        s = self._soft[block_id] + 1
        if s > r:
            raise ValueError(f"BlockPool.soften: block {block_id} has no hard reference to soften")
        self._soft[block_id] = s
        if s == r:
            self._num_reclaimable += 1

    def harden(self, block_id: int) -> None:
        """Turn one soft reference back into a hard one (pins the block)."""
        s = self._soft[block_id]
        if s == 0:
            raise ValueError(f"BlockPool.harden: block {block_id} has no soft reference")
        if s == self._ref[block_id]:
            self._num_reclaimable -= 1
        self._soft[block_id] = s - 1

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant. O(num_blocks)."""
        n = self.num_blocks
        sentinel = n
        seen = [False] * n
        b = self._next[sentinel]
        prev = sentinel
        count = 0
        while b != sentinel:
            assert 0 <= b < n, f"free list holds invalid id {b}"
            assert not seen[b], f"free list cycles through block {b}"
            assert self._prev[b] == prev, (
                f"free list prev pointer of block {b} is {self._prev[b]}, not {prev}"
            )
            seen[b] = True
            count += 1
            prev = b
            b = self._next[b]
            assert count <= n, "free list longer than the pool"
        assert self._prev[sentinel] == prev, "free list tail pointer is stale"
        assert count == self._num_free, f"num_free={self._num_free} but the free list holds {count}"
        num_cached_free = 0
        num_reclaimable = 0
        for i in range(n):
            r, s = self._ref[i], self._soft[i]
            assert r >= 0 and 0 <= s <= r, f"block {i}: ref_count={r}, soft={s}"
            assert seen[i] == (r == 0), f"block {i}: ref_count={r} but in_free_list={seen[i]}"
            if r == 0 and self._cached[i]:
                num_cached_free += 1
            if r > 0 and s == r:
                num_reclaimable += 1
        assert num_cached_free == self._num_cached_free, (
            f"num_cached_free={self._num_cached_free}, recount {num_cached_free}"
        )
        assert num_reclaimable == self._num_reclaimable, (
            f"num_reclaimable={self._num_reclaimable}, recount {num_reclaimable}"
        )
