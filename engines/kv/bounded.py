"""Tensor-free block accounting for bounded (evicting) sequences: the H2O / offload KV manager.

Same interface as ``PagedKVManager`` (the scheduler cannot tell them apart), different
growth rule. A sequence's slots grow with its tokens only while it prefills; once its
prompt is done it holds at most ``budget`` slots, so its block count stops growing::

    prefill (prompt P > budget B)        after the prompt's step commits     decode
    slots  [0 ................ P)   ->   slots [0 .... B)  (tail blocks freed)   [0 .... B)  (victim slots reused)

* ``allocate`` records the sequence's *prefill target*: the tokens known at admission
  (the prompt, or prompt + outputs after a recompute preemption), and sizes its budget
  with ``policy.budget_for(len(token_ids))`` (a ratio budget is a share of that context).
* ``append`` grows slots 1:1 while the sequence is inside its prefill target; after it,
  only up to the budget (a decode token at the budget needs no new slot: it overwrites
  a victim's slot, chosen by the executor).
* ``commit`` of the whole prefill target shrinks a sequence above its budget to the budget
  (the executor has compacted the kept tokens into the first ``budget`` slots during the
  same step) and frees the tail blocks.

No prefix cache (a slot's content stops matching its block's token hash once it is
overwritten) and no forking: parallel sampling and beam search are rejected by the
engine before they reach the scheduler. Swap preemption moves every block of a sequence
to the host pool and back (nothing is shared).

``num_evicted_tokens`` counts lossy evictions in tokens (one token = its K/V in every
layer and KV head); with ``keeps_evicted_kv`` (offload) they also count as host bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.eviction import EvictionPolicy
from kvbench.engines.kv.paged import SeqTable, check_sizes
from kvbench.engines.kv.protocol import NO_OPS, KVCapacityError, KVOps, StepCommit
from kvbench.engines.kv.token_ids import prefix_of
from kvbench.types import KVUsage


class _BoundedSeq:
    __slots__ = ("block_ids", "num_slots", "num_positions", "prefill_target", "budget", "host_blocks")

    def __init__(self, prefill_target: int, budget: int) -> None:
        self.block_ids: list[int] = []
        self.num_slots = 0  # token slots allocated (what the blocks hold)
        self.num_positions = 0  # token positions reserved (slots + evicted)
        self.prefill_target = prefill_target
        self.budget = budget
        self.host_blocks: list[int] | None = None  # set while swapped out

    @property
    def num_tokens(self) -> int:
        """Slots held, the name SeqTable's shared queries read."""
        return self.num_slots


class BoundedKVManager(SeqTable):
    """Block tables of bounded sequences over one device ``BlockPool`` and a host pool.

    Paired calls as in ``PagedKVManager``: a check call returns False when memory is short
    and the act call then raises ``KVCapacityError``; misuse (unknown or duplicate seq id,
    acting on a swapped sequence) raises ``KeyError`` / ``ValueError`` naming the id.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_token: int,
        policy: EvictionPolicy,
        num_host_blocks: int = 0,
        keeps_evicted_kv: bool = False,
    ) -> None:
        check_sizes("BoundedKVManager", num_blocks, block_size, bytes_per_token, num_host_blocks)
        policy.validate()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.commit_interval = 1  # commits register nothing but act (the prefill shrink): never skipped
        self.bytes_per_token = bytes_per_token
        self.num_host_blocks = num_host_blocks
        self.policy = policy
        self.keeps_evicted_kv = keeps_evicted_kv
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)
        self._seqs: dict[int, _BoundedSeq] = {}
        self._released: list[int] = []
        self._num_slots_resident = 0  # sum of num_slots over device-resident sequences
        # Cumulative counters (the engine reads differences per step).
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_evicted_blocks = 0  # prefix-cache evictions: there is no prefix cache
        self.num_evicted_tokens = 0  # lossy evictions, in tokens
        self.num_evicted_tokens_live = 0  # evicted tokens of live sequences (host-resident for offload)
        self.bytes_swapped_out = 0
        self.bytes_swapped_in = 0

    # ------------------------------------------------------------------ queries
    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_tokens(self, seq_id: int) -> int:
        """Token slots allocated (at most the budget once the prefill is done)."""
        return self._seq(seq_id).num_slots

    def budget(self, seq_id: int) -> int:
        """The sequence's budget in token slots per layer and KV head."""
        return self._seq(seq_id).budget

    def num_cached_tokens(self, token_ids: Sequence[int], extra_key: str | None) -> int:
        """Always 0: bounded sequences have no prefix cache."""
        return 0

    def pop_released(self) -> list[int]:
        """Seq ids freed since the last call (the executor drops their slot state). Clears the list."""
        released, self._released = self._released, []
        return released

    # ------------------------------------------------------------------ allocate / append
    def can_allocate(
        self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int, extra_key: str | None
    ) -> bool:
        """Whether ``allocate`` would succeed now. Mutates nothing."""
        self._check_new(seq_id, num_new_tokens, "can_allocate")
        return self._blocks_for(num_new_tokens) <= self.pool.num_free

    def allocate(
        self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int, extra_key: str | None
    ) -> tuple[int, KVOps]:
        """Start ``seq_id`` with slots for its first ``num_new_tokens`` positions.

        Its prefill target is ``len(token_ids)`` and its budget ``policy.budget_for`` of it.
        Returns (0 cached tokens, no ops). Mutates the free list. Raises KVCapacityError
        when ``can_allocate`` is False.
        """
        self._check_new(seq_id, num_new_tokens, "allocate")
        need = self._blocks_for(num_new_tokens)
        if need > self.pool.num_free:
            raise KVCapacityError(f"allocate: seq {seq_id} needs {need} blocks, {self.pool.num_free} free")
        seq = _BoundedSeq(len(token_ids), self.policy.budget_for(len(token_ids)))
        self._seqs[seq_id] = seq
        self._grow(seq, num_new_tokens)
        self.num_prefix_query_tokens += len(token_ids)
        return 0, NO_OPS

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        """Whether ``append`` would succeed now. Mutates nothing."""
        seq = self._resident(seq_id, "can_append")
        return (
            self._blocks_for(self._slots_after(seq, num_new_tokens)) - len(seq.block_ids)
            <= self.pool.num_free
        )

    def append(self, seq_id: int, num_new_tokens: int) -> KVOps:
        """Reserve ``num_new_tokens`` more positions: new slots inside the prefill target or
        below the budget, none past it (those tokens replace victims; counted as evicted).

        Mutates the block table and free list. Raises KVCapacityError when ``can_append``
        is False, ValueError for a negative count.
        """
        seq = self._resident(seq_id, "append")
        if num_new_tokens < 0:
            raise ValueError(f"append: seq {seq_id} num_new_tokens must be >= 0, got {num_new_tokens}")
        slots = self._slots_after(seq, num_new_tokens)
        need = self._blocks_for(slots) - len(seq.block_ids)
        if need > self.pool.num_free:
            raise KVCapacityError(f"append: seq {seq_id} needs {need} blocks, {self.pool.num_free} free")
        evicted = num_new_tokens - (slots - seq.num_slots)
        self._count_evicted(evicted)
        seq.num_positions += num_new_tokens - (slots - seq.num_slots)
        self._grow(seq, slots - seq.num_slots)
        return NO_OPS

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """All of ``token_ids`` now have their K/V computed. When that completes the prefill
        target and the sequence holds more than its budget, shrink it to the budget (the
        executor compacted the kept tokens into the first slots) and free the tail blocks.
        Mutates the block table and the free list."""
        seq = self._resident(seq_id, "commit")
        if len(token_ids) > seq.num_positions:
            raise ValueError(
                f"commit: seq {seq_id} commits {len(token_ids)} tokens but reserved {seq.num_positions} positions"
            )
        if len(token_ids) >= seq.prefill_target and seq.num_slots > seq.budget:
            self._count_evicted(seq.num_slots - seq.budget)
            self._num_slots_resident -= seq.num_slots - seq.budget
            seq.num_slots = seq.budget
            keep = self._blocks_for(seq.budget)
            for b in reversed(seq.block_ids[keep:]):
                self.pool.decref(b)
            del seq.block_ids[keep:]

    def commit_many(self, entries: Sequence[StepCommit]) -> None:
        """``commit`` each entry's prefix in order."""
        for seq_id, token_ids, num_tokens in entries:
            self.commit(seq_id, prefix_of(token_ids, num_tokens))

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Not supported: an evicting sequence overwrites slots in place, so siblings cannot
        share blocks. Raises ValueError (the bounded engines reject n > 1 and beams up front)."""
        raise ValueError(
            f"fork: seq {parent_seq_id} -> {child_seq_id}: bounded (evicting) KV caches do not support "
            "parallel sampling or beam search"
        )

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id`` (running or swapped); its blocks return to the pools (tail first).
        Mutates the pools; the executor learns of it through ``pop_released``."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        self._released.append(seq_id)
        self.num_evicted_tokens_live -= seq.num_positions - seq.num_slots
        if seq.host_blocks is not None:
            for b in reversed(seq.host_blocks):
                self.host_pool.decref(b)
            return
        self._num_slots_resident -= seq.num_slots
        for b in reversed(seq.block_ids):
            self.pool.decref(b)

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, seq_id: int) -> bool:
        return len(self._resident(seq_id, "can_swap_out").block_ids) <= self.host_pool.num_free

    def swap_out(self, seq_id: int) -> KVOps:
        """Move every block of ``seq_id`` to host blocks. Mutates both pools and the table.
        Raises KVCapacityError when ``can_swap_out`` is False."""
        seq = self._resident(seq_id, "swap_out")
        if len(seq.block_ids) > self.host_pool.num_free:
            raise KVCapacityError(
                f"swap_out: seq {seq_id} needs {len(seq.block_ids)} host blocks, {self.host_pool.num_free} free"
            )
        host = [self.host_pool.allocate() for _ in seq.block_ids]
        pairs = tuple(zip(seq.block_ids, host))
        for b in reversed(seq.block_ids):
            self.pool.decref(b)
        seq.host_blocks = host
        self._num_slots_resident -= seq.num_slots
        self.bytes_swapped_out += len(host) * self.bytes_per_block
        return KVOps(swap_out=pairs)

    def can_swap_in(self, seq_id: int) -> bool:
        host = self._swapped(seq_id, "can_swap_in").host_blocks
        assert host is not None
        return len(host) <= self.pool.num_free

    def swap_in(self, seq_id: int) -> KVOps:
        """Bring a swapped sequence back to fresh device blocks. Mutates both pools.
        Raises KVCapacityError when ``can_swap_in`` is False."""
        seq = self._swapped(seq_id, "swap_in")
        host = seq.host_blocks
        assert host is not None
        if len(host) > self.pool.num_free:
            raise KVCapacityError(
                f"swap_in: seq {seq_id} needs {len(host)} blocks, {self.pool.num_free} free"
            )
        seq.block_ids = [self.pool.allocate() for _ in host]
        for b in host:
            self.host_pool.decref(b)
        seq.host_blocks = None
        self._num_slots_resident += seq.num_slots
        self.bytes_swapped_in += len(host) * self.bytes_per_block
        return KVOps(swap_in=tuple(zip(host, seq.block_ids)))

    # ------------------------------------------------------------------ usage / check
    def usage(self) -> KVUsage:
        """Device memory now (bytes of the pool) plus host bytes: swapped blocks and, with
        ``keeps_evicted_kv``, the evicted tokens of live sequences."""
        per_block = self.bytes_per_block
        in_use = self.num_blocks - self.pool.num_free
        allocated = in_use * per_block
        token_bytes = self._num_slots_resident * self.bytes_per_token
        host = (self.num_host_blocks - self.host_pool.num_free) * per_block
        if self.keeps_evicted_kv:
            host += self.num_evicted_tokens_live * self.bytes_per_token
        return KVUsage(
            capacity_bytes=self.num_blocks * per_block,
            allocated_bytes=allocated,
            token_bytes=token_bytes,
            internal_frag_bytes=allocated - token_bytes,
            host_bytes=host,
            num_blocks_total=self.num_blocks,
            num_blocks_in_use=in_use,
            num_blocks_free=self.pool.num_free,
        )

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant. O(blocks)."""
        self.pool.check()
        self.host_pool.check()
        refs = [0] * self.num_blocks
        host_refs = [0] * self.num_host_blocks
        slots = 0
        evicted = 0
        for seq_id, seq in self._seqs.items():
            want = self._blocks_for(seq.num_slots)
            table = seq.host_blocks if seq.host_blocks is not None else seq.block_ids
            assert len(table) == want, (
                f"seq {seq_id}: {len(table)} blocks for {seq.num_slots} slots, want {want}"
            )
            assert seq.num_slots <= max(seq.budget, seq.prefill_target), (
                f"seq {seq_id}: {seq.num_slots} slots exceed budget {seq.budget} and prefill {seq.prefill_target}"
            )
            assert seq.num_positions >= seq.num_slots, f"seq {seq_id}: fewer positions than slots"
            evicted += seq.num_positions - seq.num_slots
            if seq.host_blocks is not None:
                for b in table:
                    host_refs[b] += 1
                continue
            slots += seq.num_slots
            for b in table:
                refs[b] += 1
        for b in range(self.num_blocks):
            assert self.pool.ref_count(b) == refs[b], (
                f"block {b}: ref_count {self.pool.ref_count(b)}, tables {refs[b]}"
            )
        for h in range(self.num_host_blocks):
            assert self.host_pool.ref_count(h) == host_refs[h], f"host block {h}: ref_count mismatch"
        assert slots == self._num_slots_resident, (
            f"resident slots {self._num_slots_resident}, recount {slots}"
        )
        assert evicted == self.num_evicted_tokens_live, (
            f"live evicted {self.num_evicted_tokens_live}, recount {evicted}"
        )

    # ------------------------------------------------------------------ internals
    def _slots_after(self, seq: _BoundedSeq, num_new: int) -> int:
        """Slots after reserving ``num_new`` more positions (see the module docstring)."""
        positions = seq.num_positions + num_new
        if positions <= seq.prefill_target:
            return seq.num_slots + num_new
        grown = seq.num_slots + num_new
        return grown if grown <= seq.budget else max(seq.num_slots, seq.budget)

    def _grow(self, seq: _BoundedSeq, num_new_slots: int) -> None:
        seq.num_slots += num_new_slots
        seq.num_positions += num_new_slots
        self._num_slots_resident += num_new_slots
        while len(seq.block_ids) * self.block_size < seq.num_slots:
            seq.block_ids.append(self.pool.allocate())

    def _count_evicted(self, num_tokens: int) -> None:
        self.num_evicted_tokens += num_tokens
        self.num_evicted_tokens_live += num_tokens

    def _blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)
