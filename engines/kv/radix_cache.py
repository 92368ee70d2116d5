"""A token-granular radix tree over the paged block pool (SGLang's RadixCache, on blocks).

Each node is an edge of token ids ``key`` starting at absolute position ``start``; children
are keyed by their first token. A node holds one pool reference on every block its token
range overlaps, so a match may end mid-block: the sequence then shares that partial block
and the manager copies it on its first write into a slot someone else already claimed.

Blocks of a path::

    positions   0 1 2 3 | 4 5 6 7 | 8 9
    node X      a a a a | a a          blocks [B0, B1]      (X = positions 0..5)
    child Y               . . y y | y  blocks [B2, B3]      (Y = 6..8; B2 holds copies of a4 a5)
    child Z               . . z      | blocks [B1]          (Z = 6; wrote into B1 in place)

A match takes, for each logical block, the block of the deepest matched node touching it:
that block holds the path's tokens at every earlier position of the block, because the
sequence that created the node wrote (or copied) them there.

Locks: a live sequence locks the node where its cached/committed prefix ends; a lock
counts on every node up to the root. References of unlocked nodes are *soft* in the pool
so ``BlockPool.num_reclaimable`` is exactly what ``evict`` can free. Eviction removes
unlocked leaves in least-recently-used order (a logical clock, for reproducibility) from a
lazy heap; a parent whose last child goes becomes a candidate leaf.

A lock pins only what its sequence reads. Locked blocks cannot be evicted, so a block a
locked node holds but no live sequence reads is memory a sequence alone in the pool never
gets back: a request that fits the pool alone would be rejected. Two rules keep them out:

* De-duplication (``_share_blocks``): a sequence that committed tokens a node already
  holds (it computed them in parallel, before either registered) switches to the node's
  full blocks (``commit`` returns them) instead of the node taking the sequence's, which
  would pin them for the node's other lockers.
* Partial blocks (``_follow_child``): where a node ends mid-block and every lock on it
  comes through its children (no sequence ends at it), each locker reads there the first
  block of the locked child it goes through (its own copy after a copy-on-write: a match
  that ended mid-block, a forked sample). The node then holds one of those blocks in
  place of its own, which nobody may read any more. Locks and unlocks reconcile their
  path bottom up.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.prefix_cache import NO_MATCH, CommitEntry, PrefixMatch


class _Node:
    __slots__ = (
        "parent",
        "children",
        "key",
        "start",
        "end",
        "block_ids",
        "lock_count",
        "last_access",
        "node_id",
        "alive",
        "locked_children",
    )

    def __init__(self, parent: _Node | None, key: list[int], start: int, block_ids: list[int], node_id: int):
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.key = key  # token ids of this edge, positions [start, start + len(key))
        self.start = start
        # start + len(key), kept as a field (read on every commit): only _extend grows a
        # key; a split moves start and drops the key's head by the same count.
        self.end = start + len(key)
        self.block_ids = block_ids  # logical blocks start // bs .. (end - 1) // bs
        self.lock_count = 0
        self.last_access = 0
        self.node_id = node_id
        self.alive = True
        self.locked_children: set[_Node] = set()  # children with lock_count > 0


class _SeqState:
    """The node where a sequence's tree prefix ends (None: no prefix yet), its length, and
    whether the sequence created that node (only then may it grow the node in place)."""

    __slots__ = ("node", "num_tokens", "owns_node")

    def __init__(self, node: _Node | None, num_tokens: int, owns_node: bool = False) -> None:
        self.node = node
        self.num_tokens = num_tokens
        self.owns_node = owns_node


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    if a == b[: len(a)]:
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixPrefixIndex:
    """Token-granular radix-tree prefix index with lock counts and LRU leaf eviction.

    Implements ``prefix_cache.PrefixIndex``. ``extra_key`` (cache salt, adapter) selects a
    separate tree. Matches are capped at ``len(token_ids) - 1`` tokens and are not block
    aligned. Complexity: ``match`` O(prefix length); ``commit`` O(new tokens) when a
    sequence extends its own leaf, else O(new tokens + depth); ``evict`` O(log heap) per node.
    """

    registers_blocks = True
    registers_full_blocks_only = False  # token granular: every commit extends the tree
    holds_blocks = True  # tree nodes hold (lockable) block references

    def __init__(self) -> None:
        self._pool: BlockPool | None = None
        self._block_size = 0
        self._roots: dict[str | None, _Node] = {}
        self._seqs: dict[int, _SeqState] = {}
        self._heap: list[tuple[int, int, _Node]] = []  # (last_access, node_id, node), lazy
        self._clock = 0
        self._next_node_id = 0
        self._num_nodes = 0  # live non-root nodes
        self._num_evicted_blocks = 0

    # ------------------------------------------------------------------ protocol
    def bind(self, pool: BlockPool, block_size: int) -> None:
        if self._pool is not None:
            raise ValueError("RadixPrefixIndex: already bound to a pool (use one index per manager)")
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        self._pool = pool
        self._block_size = block_size

    def match_may_grow(self, token_ids: Sequence[int], extra_key: str | None, seq_ids: Sequence[int]) -> bool:
        """See ``PrefixIndex.match_may_grow``: True (every commit extends the tree, and
        evictions move references, so any step may change a match)."""
        return True

    def match(self, token_ids: Sequence[int], extra_key: str | None) -> PrefixMatch:
        pool = self._bound_pool()
        cap = len(token_ids) - 1
        root = self._roots.get(extra_key)
        if cap <= 0 or root is None:
            return NO_MATCH
        tokens = list(token_ids[:cap])
        bs = self._block_size
        table: list[int] = []
        path: list[tuple[_Node, int]] = []
        node, pos = root, 0
        while pos < cap:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            key = child.key
            c = _common_prefix_len(key, tokens[pos : pos + len(key)])
            first_k = child.start // bs
            num_blocks = (child.start + c - 1) // bs - first_k + 1
            blocks = child.block_ids
            if table and first_k == len(table) - 1:
                table[-1] = blocks[0]  # the deeper node's copy of a block both touch
                table.extend(blocks[1:num_blocks])
            else:
                table.extend(blocks[:num_blocks])
            path.append((child, num_blocks))
            pos += c
            if c < len(key):
                break
            node = child
        if pos == 0:
            return NO_MATCH
        # Blocks that locking this path pins: the reclaimable ones among those the sequence
        # reads. A shadowed partial block of an unlocked ancestor (a deeper node holds a copy)
        # is not pinned: the lock makes that ancestor follow the copy (``_follow_child``).
        pinned = {b for b in table if pool.soft_count(b) == pool.ref_count(b)}
        last, _ = path[-1]
        return PrefixMatch(pos, tuple(table), len(pinned), handle=(last, pos - last.start))

    def acquire(self, seq_id: int, match: PrefixMatch) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"RadixPrefixIndex.acquire: seq {seq_id} already tracked")
        if match.num_tokens == 0:
            self._seqs[seq_id] = _SeqState(None, 0)
            return
        node, num_in_node = match.handle
        if not node.alive:
            raise ValueError("RadixPrefixIndex.acquire: stale match (the tree changed since match)")
        if num_in_node < len(node.key):
            node = self._split(node, num_in_node)
        self._lock(node)
        self._touch_path(node)
        self._seqs[seq_id] = _SeqState(node, match.num_tokens)

    def commit(
        self, seq_id: int, token_ids: Sequence[int], block_ids: Sequence[int], extra_key: str | None
    ) -> tuple[tuple[int, int], ...]:
        state = self._seq(seq_id)
        pos = state.num_tokens
        end = len(token_ids)
        if end <= pos:
            return ()
        if (end - 1) // self._block_size >= len(block_ids):
            raise ValueError(
                f"RadixPrefixIndex.commit: seq {seq_id} commits {end} tokens "
                f"but its block table has only {len(block_ids)} blocks"
            )
        old = state.node
        start_node = old if old is not None else self._root(extra_key)
        new_tokens = token_ids[pos:end]
        if type(new_tokens) is not list:  # a slice of the project's token ids is a new list
            new_tokens = list(new_tokens)
        shared: list[tuple[int, int]] = []
        if old is not None and state.owns_node and self._can_extend(old, block_ids):
            self._extend(old, new_tokens, block_ids)
            target, created = old, True
        else:
            target, created = self._insert(start_node, pos, new_tokens, block_ids, shared)
        if target is not old:
            self._lock(target)
            if old is not None:
                self._unlock(old)
        self._touch_path(target)
        state.node = target
        state.num_tokens = end
        state.owns_node = created
        return tuple(shared) if shared else ()

    def commit_many(self, entries: Sequence[CommitEntry]) -> None:
        raise TypeError(
            "RadixPrefixIndex.commit_many: the tree holds blocks, so its commits may return "
            "blocks to switch to before the next commit; call commit one entry at a time"
        )

    def allocate_decode_steps(
        self, pool: BlockPool, needs: np.ndarray, commits: Sequence[Sequence[CommitEntry]]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        raise TypeError(
            "RadixPrefixIndex.allocate_decode_steps: the tree holds blocks, so a decode run "
            "takes its steps one at a time"
        )

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        if child_seq_id in self._seqs:
            raise ValueError(f"RadixPrefixIndex.fork: seq {child_seq_id} already tracked")
        parent = self._seq(parent_seq_id)
        if parent.node is not None:
            self._lock(parent.node)
        self._seqs[child_seq_id] = _SeqState(parent.node, parent.num_tokens)

    def release(self, seq_id: int) -> None:
        state = self._seq(seq_id)
        del self._seqs[seq_id]
        if state.node is not None:
            self._unlock(state.node)

    def evict(self, num_blocks: int) -> int:
        pool = self._bound_pool()
        num_freed = 0
        heap = self._heap
        while num_freed < num_blocks and heap:
            tick, _, node = heapq.heappop(heap)
            if not node.alive or node.children or node.lock_count or tick != node.last_access:
                continue  # stale entry
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.alive = False
            self._num_nodes -= 1
            for b in node.block_ids:
                pool.harden(b)
                if pool.decref(b):
                    num_freed += 1
            if parent.parent is not None and not parent.children and parent.lock_count == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        self._num_evicted_blocks += num_freed
        return num_freed

    @property
    def num_evicted_blocks(self) -> int:
        return self._num_evicted_blocks

    def block_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for node in self._iter_nodes():
            for b in node.block_ids:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def check(self) -> None:
        pool = self._bound_pool()
        bs = self._block_size
        seq_locks: dict[int, int] = {}
        for seq_id, state in self._seqs.items():
            if state.node is None:
                assert state.num_tokens == 0, f"seq {seq_id}: {state.num_tokens} tokens but no node"
                continue
            assert state.node.alive, f"seq {seq_id} points at an evicted node"
            assert state.node.end == state.num_tokens, (
                f"seq {seq_id}: node ends at {state.node.end}, seq has {state.num_tokens} tokens"
            )
            seq_locks[id(state.node)] = seq_locks.get(id(state.node), 0) + 1
        soft: dict[int, int] = {}
        num_nodes = 0

        def visit(node: _Node) -> int:
            # Returns the number of sequence locks in the subtree (what lock_count must be).
            nonlocal num_nodes
            locks = seq_locks.get(id(node), 0)
            for first, child in node.children.items():
                num_nodes += 1
                assert child.alive and child.parent is node, f"node {child.node_id}: broken parent link"
                assert child.key and child.key[0] == first, f"node {child.node_id}: keyed by wrong token"
                assert child.start == node.end, (
                    f"node {child.node_id}: starts at {child.start}, not {node.end}"
                )
                assert child.end == child.start + len(child.key), (
                    f"node {child.node_id}: ends at {child.end}, its key covers [{child.start}, "
                    f"{child.start + len(child.key)})"
                )
                want = (child.end - 1) // bs - child.start // bs + 1
                assert len(child.block_ids) == want, (
                    f"node {child.node_id}: {len(child.block_ids)} blocks for positions "
                    f"[{child.start}, {child.end}), want {want}"
                )
                assert len(set(child.block_ids)) == len(child.block_ids), (
                    f"node {child.node_id}: repeated block"
                )
                child_locks = visit(child)
                assert child.lock_count == child_locks, (
                    f"node {child.node_id}: lock_count={child.lock_count}, live sequences below: {child_locks}"
                )
                assert (child in node.locked_children) == (child.lock_count > 0), (
                    f"node {child.node_id}: lock_count={child.lock_count} but in its parent's "
                    f"locked_children: {child in node.locked_children}"
                )
                follow = self._block_to_follow(child)
                assert follow is None, (
                    f"node {child.node_id}: locked only through its children, but its partial last "
                    f"block {child.block_ids[-1]} is none of theirs (follow {follow})"
                )
                if child.lock_count == 0:
                    for b in child.block_ids:
                        soft[b] = soft.get(b, 0) + 1
                locks += child_locks
            return locks

        for root in self._roots.values():
            assert root.start == 0 and not root.key and not root.block_ids, "malformed root"
            visit(root)
            assert len(root.locked_children) == sum(1 for c in root.children.values() if c.lock_count), (
                "root: stale locked_children"
            )
        assert num_nodes == self._num_nodes, f"num_nodes={self._num_nodes}, recount {num_nodes}"
        for b in range(pool.num_blocks):
            assert pool.soft_count(b) == soft.get(b, 0), (
                f"block {b}: pool soft refs {pool.soft_count(b)}, unlocked tree refs {soft.get(b, 0)}"
            )

    # ------------------------------------------------------------------ extras
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def leaves_in_eviction_order(self) -> list[tuple[int, tuple[int, ...]]]:
        """(start, key) of unlocked leaves, next evicted first. O(nodes log nodes); for tests."""
        leaves = [n for n in self._iter_nodes() if not n.children and n.lock_count == 0]
        leaves.sort(key=lambda n: (n.last_access, n.node_id))
        return [(n.start, tuple(n.key)) for n in leaves]

    def edges(self, extra_key: str | None = None) -> list[tuple[int, tuple[int, ...], tuple[int, ...], int]]:
        """(start, key, block_ids, lock_count) of every node, depth first; for tests and debugging."""
        out = []
        root = self._roots.get(extra_key)
        stack = [root] if root is not None else []
        while stack:
            node = stack.pop()
            if node is not root:
                out.append((node.start, tuple(node.key), tuple(node.block_ids), node.lock_count))
            stack.extend(sorted(node.children.values(), key=lambda n: n.key[0], reverse=True))
        return out

    # ------------------------------------------------------------------ tree surgery
    def _new_node(self, parent: _Node | None, key: list[int], start: int, block_ids: list[int]) -> _Node:
        node = _Node(parent, key, start, block_ids, self._next_node_id)
        self._next_node_id += 1
        return node

    def _root(self, extra_key: str | None) -> _Node:
        root = self._roots.get(extra_key)
        if root is None:
            root = self._roots[extra_key] = self._new_node(None, [], 0, [])
        return root

    def _split(self, node: _Node, num_upper: int) -> _Node:
        """Cut ``node`` after ``num_upper`` tokens; returns the new upper node (the parent of
        ``node``, which keeps its identity so sequence states and heap entries stay valid)."""
        pool = self._bound_pool()
        bs = self._block_size
        cut = node.start + num_upper
        first_k = node.start // bs
        upper_blocks = node.block_ids[: (cut - 1) // bs - first_k + 1]
        upper = self._new_node(node.parent, node.key[:num_upper], node.start, upper_blocks)
        upper.lock_count = node.lock_count
        upper.last_access = node.last_access
        if node.lock_count:
            upper.locked_children.add(node)
            node.parent.locked_children.discard(node)
            node.parent.locked_children.add(upper)
        node.block_ids = node.block_ids[cut // bs - first_k :]
        if cut % bs:
            shared = upper_blocks[-1]  # the block holding both sides of a mid-block cut
            pool.incref(shared)
            if upper.lock_count == 0:
                pool.soften(shared)
        assert node.parent is not None
        node.parent.children[node.key[0]] = upper
        node.key = node.key[num_upper:]
        node.start = cut
        node.parent = upper
        upper.children[node.key[0]] = node
        self._num_nodes += 1
        return upper

    def _insert(
        self,
        node: _Node,
        pos: int,
        tokens: list[int],
        block_ids: Sequence[int],
        shared: list[tuple[int, int]],
    ) -> tuple[_Node, bool]:
        """Walk/extend the tree below ``node`` (which ends at ``pos``) with ``tokens``;
        returns the node ending exactly at ``pos + len(tokens)`` and whether it is new.
        Existing nodes keep their place and their full blocks; the sequence switches to
        those (appended to ``shared``, see ``_share_blocks``)."""
        pool = self._bound_pool()
        bs = self._block_size
        i = 0
        n = len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                start = pos + i
                blocks = list(block_ids[start // bs : (pos + n - 1) // bs + 1])
                leaf = self._new_node(node, tokens[i:], start, blocks)
                for b in blocks:
                    pool.incref(b)
                    pool.soften(b)  # unlocked until the caller locks it
                node.children[tokens[i]] = leaf
                self._num_nodes += 1
                return leaf, True
            c = _common_prefix_len(child.key, tokens[i : i + len(child.key)])
            if c < len(child.key):
                child = self._split(child, c)
            self._share_blocks(child, block_ids, pos + n, shared)
            i += c
            node = child
        return node, False

    def _share_blocks(
        self, node: _Node, block_ids: Sequence[int], commit_end: int, shared: list[tuple[int, int]]
    ) -> None:
        """A sequence committing through ``node`` (up to ``commit_end`` >= ``node.end``) wrote
        the node's tokens at the same positions after the same path: the same KV. Where its
        blocks differ from the node's, keep one copy read by every locker of the node:

        * a block the node fills to its end: the sequence switches to the node's (appended
          to ``shared`` as (logical index, block)); the node's other lockers read it too;
        * the node's partial last block, where the commit ends: the node takes the
          sequence's (it holds the node's tokens up to ``node.end``; the sequence writes
          on after them, so it cannot switch), keeping its references soft if unlocked;
        * the partial last block with the commit going on past the node: the sequence's
          block goes to the deeper node, which ``_follow_child`` makes this one follow.
        """
        pool = self._bound_pool()
        bs = self._block_size
        first = node.start // bs
        table = node.block_ids
        for j, held in enumerate(table):
            mine = block_ids[first + j]
            if mine == held:
                continue
            if (first + j + 1) * bs <= node.end:
                shared.append((first + j, held))
            elif commit_end == node.end:
                pool.incref(mine)
                if node.lock_count == 0:
                    pool.soften(mine)
                    pool.harden(held)
                pool.decref(held)
                table[j] = mine

    def _block_to_follow(self, node: _Node) -> int | None:
        """The block ``node``'s partial last block should be (``_follow_child``), or None
        when its own is right: it ends on a block boundary, is unlocked, a sequence ends at
        it (and reads it), or a locked child starts in it. Otherwise the first block of
        its locked child created first (deterministic). Pure; O(locked children)."""
        if node.end % self._block_size == 0 or node.lock_count == 0:
            return None
        last = node.block_ids[-1]
        num_locks_below = 0
        follow: _Node | None = None
        for child in node.locked_children:
            if child.block_ids[0] == last:
                return None
            num_locks_below += child.lock_count
            if follow is None or child.node_id < follow.node_id:
                follow = child
        if follow is None or num_locks_below != node.lock_count:
            return None
        return follow.block_ids[0]

    def _follow_child(self, node: _Node) -> None:
        """Point ``node``'s partial last block at a block its lockers read (see the module
        docstring and ``_block_to_follow``). A locked child's first block holds the node's
        tokens at every position of the block up to ``node.end`` (its creator wrote or
        copied them), so matches ending in ``node`` stay valid. The node is locked: its
        references are hard."""
        new = self._block_to_follow(node)
        if new is None:
            return
        pool = self._bound_pool()
        pool.incref(new)
        pool.decref(node.block_ids[-1])
        node.block_ids[-1] = new

    def _can_extend(self, node: _Node, block_ids: Sequence[int]) -> bool:
        # A leaf the caller created and alone locks is private to it: growing it in place
        # keeps decode commits O(new tokens) instead of adding a node per token. (A cached
        # leaf someone else created gets a child instead, keeping LRU granularity.)
        if node.children or node.lock_count != 1:
            return False
        end = node.end
        if end % self._block_size == 0:
            return True
        # The sequence must still write into the node's last block (no copy-on-write since).
        return node.block_ids[-1] == block_ids[end // self._block_size]

    def _extend(self, node: _Node, tokens: list[int], block_ids: Sequence[int]) -> None:
        bs = self._block_size
        old_end = node.end
        node.key.extend(tokens)
        node.end = end = old_end + len(tokens)
        first_new_k = (old_end - 1) // bs + 1
        last_k = (end - 1) // bs
        if first_new_k > last_k:
            return  # the tokens stay within the node's last block (most decode commits)
        pool = self._bound_pool()
        for k in range(first_new_k, last_k + 1):
            b = block_ids[k]
            pool.incref(b)  # hard: the node is locked
            node.block_ids.append(b)

    def _lock(self, node: _Node) -> None:
        pool = self._bound_pool()
        n: _Node | None = node
        while n is not None and n.parent is not None:
            if n.lock_count == 0:
                for b in n.block_ids:
                    pool.harden(b)
                n.parent.locked_children.add(n)
            n.lock_count += 1
            self._follow_child(n)  # bottom up: its children are reconciled already
            n = n.parent

    def _unlock(self, node: _Node) -> None:
        pool = self._bound_pool()
        n: _Node | None = node
        while n is not None and n.parent is not None:
            n.lock_count -= 1
            if n.lock_count == 0:
                for b in n.block_ids:
                    pool.soften(b)
                n.parent.locked_children.discard(n)
                if not n.children:
                    heapq.heappush(self._heap, (n.last_access, n.node_id, n))
            else:
                self._follow_child(n)  # the locks left may all come through one child now
            n = n.parent
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()

    def _touch_path(self, node: _Node) -> None:
        self._clock += 1
        n: _Node | None = node
        while n is not None and n.parent is not None:
            n.last_access = self._clock
            n = n.parent

    def _rebuild_heap(self) -> None:
        # Drop stale entries: keep one per current unlocked leaf.
        self._heap = [
            (n.last_access, n.node_id, n) for n in self._iter_nodes() if not n.children and n.lock_count == 0
        ]
        heapq.heapify(self._heap)

    def _iter_nodes(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def _seq(self, seq_id: int) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"RadixPrefixIndex: unknown seq {seq_id}") from None

    def _bound_pool(self) -> BlockPool:
        if self._pool is None:
            raise ValueError("RadixPrefixIndex: not bound to a pool (PagedKVManager binds it)")
        return self._pool
