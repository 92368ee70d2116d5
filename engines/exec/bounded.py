"""Tensor side of the bounded (evicting) KV caches: slot storages and the two drivers of
``kv/slots.py``'s per-sequence slots (the policy is ``kv/eviction.py``'s). Real mode only.

1. ``BoundedExecutor``: the executor of the batched bounded engines (``engines/bounded.py``:
   H2O, StreamingLLM, offload). It keeps each sequence's ``SequenceSlots`` and stores K/V
   in the paged pool ``kv: [layers, 2, num_blocks, block_size, Hkv, D]`` through the block
   table (logical slot s -> physical ``table[s // bs] * bs + s % bs``, per KV head).
2. ``BoundedSequenceBackend``: the quality harness's driver of one sequence in a
   contiguous buffer of ``max(budget, prompt)`` slots (``kvbench.quality.evaluate_quality``).

Attention runs per sequence (``kv/slots.attend_slots``, torch bmm with per-head key
positions): correct and simple, not the batched paged kernels, so decode throughput of
these engines is not comparable to ``paged``'s; memory and quality are the point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kvbench.engines.exec.executor import TorchExecutor
from kvbench.engines.exec.protocol import ExecutionResult
from kvbench.engines.kv.bounded import BoundedKVManager
from kvbench.engines.kv.eviction import EvictedTier, EvictionPolicy, TransferCounters
from kvbench.engines.kv.slots import SequenceSlots
from kvbench.model import LlamaModel

if TYPE_CHECKING:
    from kvbench.engines.sched.scheduler import SchedulerOutput


# --------------------------------------------------------------------------- storages
class PagedSlotStorage:
    """``SlotStorage`` of one sequence in the paged pool, addressed through its block table."""

    def __init__(self, kv: Tensor, block_table: Tensor, block_size: int) -> None:
        self.kv = kv  # kv: [num_layers, 2, num_blocks, block_size, Hkv, D]
        self.block_table = block_table  # int64 [num_blocks_of_seq] on kv's device
        self.block_size = block_size
        self.heads = torch.arange(kv.shape[4], device=kv.device)[None, :]  # [1, Hkv]

    def _physical(self, slots: Tensor) -> Tensor:
        return self.block_table[slots // self.block_size] * self.block_size + slots % self.block_size

    def read(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        flat = self.kv[layer].flatten(1, 2)  # [2, num_blocks * block_size, Hkv, D]
        phys = self._physical(slots)  # [n, Hkv]
        return flat[0][phys, self.heads], flat[1][phys, self.heads]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        flat = self.kv[layer].flatten(1, 2)  # a view: writes land in the pool
        phys = self._physical(slots)
        flat[0][phys, self.heads] = k.to(flat.dtype)
        flat[1][phys, self.heads] = v.to(flat.dtype)


class ContiguousSlotStorage:
    """``SlotStorage`` in one buffer: kv [num_layers, 2, capacity, Hkv, D]."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.kv = torch.zeros(num_layers, 2, capacity, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.heads = torch.arange(num_kv_heads, device=device)[None, :]

    def read(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        return self.kv[layer, 0][slots, self.heads], self.kv[layer, 1][slots, self.heads]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        self.kv[layer, 0][slots, self.heads] = k.to(self.kv.dtype)
        self.kv[layer, 1][slots, self.heads] = v.to(self.kv.dtype)


def _model_shape(model: LlamaModel) -> tuple[int, int, int, int]:
    spec = model.spec
    return spec.num_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_dim


# --------------------------------------------------------------------------- engine driver
class _BoundedBackend:
    """``AttentionBackend`` over the step's sequences: (token offset, count, slots, storage)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.items: list[tuple[int, int, SequenceSlots, PagedSlotStorage]] = []

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)  # out: [T, Hq, D]
        for offset, n, slots, storage in self.items:
            rows = slice(offset, offset + n)
            out[rows] = slots.store_and_attend(layer, q[rows], k[rows], v[rows], storage, self.scale)
        return out


class BoundedExecutor:
    """``Executor`` of the bounded engines: the pool tensors of a ``TorchExecutor`` (which
    also applies swap ops), per-sequence ``SequenceSlots``, and the evicted tier's stores.

    ``execute`` mutates the pool, the slot states and ``counters``; it raises ValueError
    when the KV manager and a sequence's slots disagree (a bug, not bad input).
    """

    reads_chunk_contents = True

    def __init__(
        self,
        model: LlamaModel,
        manager: BoundedKVManager,
        tier: EvictedTier,
        *,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        device: str,
        kv_dtype: str,
    ) -> None:
        self.pool = TorchExecutor(
            model,
            num_blocks=num_blocks,
            block_size=block_size,
            num_host_blocks=num_host_blocks,
            device=device,
            kv_dtype=kv_dtype,
            decode_backend="torch",
        )
        self.model = model
        self.manager = manager
        self.policy = manager.policy
        self.tier = tier
        self.block_size = block_size
        self.device = torch.device(device)
        self.counters = TransferCounters()
        self.states: dict[int, SequenceSlots] = {}
        self._backend = _BoundedBackend(model.scale)

    def describe(self) -> dict[str, Any]:
        return {"executor": "bounded", "kv_pool_shape": list(self.pool.kv.shape)}

    def execute(self, output: SchedulerOutput) -> ExecutionResult:
        """Apply swap ops, run the chunks with bounded slots, prune finished prefills.

        Returns fp32 logits [num_sampling_chunks, vocab] in chunk order."""
        self.pool.apply_ops(output.kv_ops)
        self.drop_released()
        chunks = output.chunks
        vocab = self.model.spec.vocab_size
        if not chunks:
            return ExecutionResult(logits=torch.empty(0, vocab, device=self.device))
        device = self.device
        input_ids: list[int] = []
        positions: list[int] = []
        items: list[tuple[int, int, SequenceSlots, PagedSlotStorage]] = []
        for chunk in chunks:
            slots = self._slots_for(chunk.seq_id, chunk.start_pos)
            slots.begin_step(chunk.start_pos, chunk.num_tokens, self.manager.num_tokens(chunk.seq_id))
            table = torch.tensor(chunk.block_table, dtype=torch.int64, device=device)
            items.append(
                (
                    len(input_ids),
                    chunk.num_tokens,
                    slots,
                    PagedSlotStorage(self.pool.kv, table, self.block_size),
                )
            )
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.start_pos + chunk.num_tokens))
        self._backend.items = items
        hidden = self.model(  # hidden: [T, hidden_size]
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self._backend,
        )
        rows = []
        for chunk, (offset, n, slots, storage) in zip(chunks, items):
            slots.end_step(storage, prune=chunk.sample)
            if chunk.sample:
                rows.append(offset + n - 1)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=device)])
        return ExecutionResult(logits=logits)

    def drop_released(self) -> None:
        """Forget the slot state (and host store) of sequences the KV manager freed."""
        for seq_id in self.manager.pop_released():
            self.states.pop(seq_id, None)

    def _slots_for(self, seq_id: int, start_pos: int) -> SequenceSlots:
        if start_pos == 0:  # a new sequence, or one restarting after a recompute preemption
            shape = _model_shape(self.model)
            store = self.tier.new_store(self.policy, shape, self.pool.kv.dtype, self.counters)
            self.states[seq_id] = SequenceSlots(
                self.policy, self.manager.budget(seq_id), shape[0], shape[1], shape[2], self.device, store
            )
        try:
            return self.states[seq_id]
        except KeyError:
            raise ValueError(
                f"bounded executor: seq {seq_id} continues at {start_pos} without slot state"
            ) from None


# --------------------------------------------------------------------------- harness driver
class BoundedSequenceBackend:
    """``kvbench.quality.SequenceBackend`` of one bounded sequence (same policy code as the
    engine). Its budget is ``policy.budget_for(max_len)``; storage is a contiguous buffer
    of ``max(budget, prompt)`` slots in the model's dtype, allocated by ``begin``."""

    def __init__(self, model: LlamaModel, max_len: int, *, policy: EvictionPolicy, tier: EvictedTier) -> None:
        policy.validate()
        param = next(model.parameters())
        self.model = model
        self.policy = policy
        self.tier = tier
        self.budget = policy.budget_for(max_len)
        self.counters = TransferCounters()
        self._device, self._dtype = param.device, param.dtype
        layers, _, hkv, dim = _model_shape(model)
        self._bytes_per_token = 2 * layers * hkv * dim * param.element_size()
        self._slots: SequenceSlots | None = None
        self._storage: ContiguousSlotStorage | None = None
        self._prefill_target = 0

    def begin(self, num_prompt_tokens: int) -> None:
        layers, hq, hkv, dim = _model_shape(self.model)
        store = self.tier.new_store(self.policy, (layers, hq, hkv, dim), self._dtype, self.counters)
        self._slots = SequenceSlots(self.policy, self.budget, layers, hq, hkv, self._device, store)
        capacity = max(self.budget, num_prompt_tokens)
        self._storage = ContiguousSlotStorage(layers, capacity, hkv, dim, self._dtype, self._device)
        self._prefill_target = num_prompt_tokens

    def before_step(self, start_position: int, num_tokens: int) -> None:
        slots = self._require()
        filled = slots.num_filled
        # The engine manager's growth rule: every prompt token kept, then up to the budget.
        if start_position + num_tokens <= self._prefill_target or filled + num_tokens <= self.budget:
            allocated = filled + num_tokens
        else:
            allocated = max(filled, self.budget)
        slots.begin_step(start_position, num_tokens, allocated)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        slots = self._require()
        assert self._storage is not None
        return slots.store_and_attend(layer, q, k, v, self._storage, self.model.scale)

    def after_step(self, num_tokens_seen: int) -> None:
        assert self._storage is not None
        self._require().end_step(self._storage, prune=True)

    def kv_tokens_resident(self) -> int:
        return self._require().num_resident

    def kv_bytes_resident(self) -> int:
        return self.kv_tokens_resident() * self._bytes_per_token

    def _require(self) -> SequenceSlots:
        if self._slots is None:
            raise RuntimeError("BoundedSequenceBackend: call begin() first")
        return self._slots
