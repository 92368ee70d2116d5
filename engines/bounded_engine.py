"""The two drivers of a bounded (evicting) KV cache, over the same policy code.

1. **Batched engine** (``BoundedCacheEngine``): the shared paged engine with its scheduler,
   a ``BoundedKVManager`` (block counts stop growing at the budget) and a
   ``BoundedExecutor`` that keeps each sequence's ``SequenceSlots`` and stores K/V in the
   paged pool ``kv: [layers, 2, num_blocks, block_size, Hkv, D]`` through the block table
   (logical slot s -> physical ``table[s // bs] * bs + s % bs``, per KV head).
2. **Quality harness** (``BoundedSequenceBackend``): one sequence in a contiguous buffer of
   ``max(budget, prompt)`` slots, driven by ``kvbench.quality.evaluate_quality``.

Budget context. A ratio budget is a share of the context the driver knows when the
sequence starts: in the engine, the tokens at admission (the prompt; H2O sizes its
10 % + 10 % the same way), in the harness, ``max_len`` (the whole scored text, since
the harness feeds a 1-token prompt and then the text token by token).

Attention runs per sequence (``eviction.attend_slots``, torch bmm with per-head key
positions): correct and simple, not the batched paged kernels, so decode throughput
of these engines is not comparable to ``paged``'s; memory and quality are the point.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kvbench.engines.bounded_kv import BoundedKVManager
from kvbench.engines.eviction import (
    EvictedTier,
    EvictionPolicy,
    SequenceSlots,
    TransferCounters,
)
from kvbench.engines.executor import ExecutionResult, Executor, TorchExecutor
from kvbench.engines.paged import PagedEngine
from kvbench.engines.sim_executor import pool_and_executor
from kvbench.model import LlamaModel, torch_dtype
from kvbench.sizing import kv_bytes_per_block
from kvbench.types import EngineContext, RejectedRequest, Request, StepOutput

if TYPE_CHECKING:
    from kvbench.engines.scheduler import SchedulerOutput


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


# --------------------------------------------------------------------------- the engine
class BoundedCacheEngine:
    """A ``PagedEngine`` whose sequences are bounded by ``policy`` (see the module doc).

    Wraps the paged engine (composition): ``add_request`` rejects what bounded caches
    cannot run (n > 1, beam search: an evicting sequence cannot share blocks), ``step``
    adds the eviction and host-traffic figures to ``StepStats``. Engine parameters are
    ``PagedEngine``'s except ``prefix_cache`` (always none). Raises ValueError naming
    ``engine.<parameter>`` for bad parameters.
    """

    def __init__(
        self,
        ctx: EngineContext,
        *,
        policy: EvictionPolicy,
        tier: EvictedTier,
        name: str = "bounded",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = 32 * 1024 * 1024,
        num_host_blocks: int = 0,
        preemption: str = "recompute",
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        chunked_prefill: bool = True,
        victim_policy: str = "newest",
        decode_backend: str = "auto",
        fast_forward: bool = True,
        executor: Executor | None = None,
    ) -> None:
        policy.validate()
        self.policy = policy
        self.tier = tier
        self.name = name
        self.ctx = ctx
        per_block = kv_bytes_per_block(ctx.spec, ctx.kv_dtype, block_size)
        # In simulation mode (no executor given): the cost-model executor, and with no
        # size set, the pool a real engine would get on ctx.hardware (as the paged engine).
        num_blocks, executor = pool_and_executor(
            ctx,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_memory_bytes=kv_memory_bytes,
            executor=executor,
        )
        if preemption == "swap" and num_host_blocks == 0:
            num_host_blocks = num_blocks
        self.bytes_per_token = per_block // block_size
        self.kv = BoundedKVManager(
            num_blocks, block_size, self.bytes_per_token, policy, num_host_blocks, tier.keeps_evicted_kv
        )
        if executor is None:
            if ctx.model is None:
                raise ValueError(
                    f"engine.{name}: ctx.model is None (simulation mode) and no executor was given"
                )
            try:
                torch_dtype(ctx.kv_dtype)
            except ValueError:
                raise ValueError(
                    f"run.kv_dtype: {ctx.kv_dtype!r} cannot be stored (use fp32, bf16 or fp16)"
                ) from None
            executor = BoundedExecutor(
                ctx.model,
                self.kv,
                tier,
                num_blocks=num_blocks,
                block_size=block_size,
                num_host_blocks=num_host_blocks,
                device=ctx.device,
                kv_dtype=ctx.kv_dtype,
            )
        self.executor = executor
        self.paged = PagedEngine(
            ctx,
            name=name,
            block_size=block_size,
            num_blocks=num_blocks,
            prefix_cache="none",
            preemption=preemption,
            num_host_blocks=num_host_blocks,
            executor=executor,
            kv_manager=self.kv,  # type: ignore[arg-type]  # same interface as PagedKVManager
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill=chunked_prefill,
            victim_policy=victim_policy,
            decode_backend=decode_backend,
            fast_forward=fast_forward,
        )
        self._rejected: list[RejectedRequest] = []
        # One record per step (host traffic, fetch recall): what StepStats has no field for.
        self.transfer_log: list[dict[str, float]] = []

    # ------------------------------------------------------------------ Engine protocol
    def unsupported_reason(self, request: Request) -> str | None:
        """n > 1 and beam search: an evicting sequence cannot share blocks with its siblings."""
        if request.n > 1 or request.beam_width > 1:
            return (
                f"engine {self.name}: bounded KV caches cannot share blocks between samples "
                f"(n={request.n}, beam_width={request.beam_width})"
            )
        return None

    def add_request(self, request: Request) -> None:
        """Queue ``request``; an unsupported one is reported as rejected by the next step."""
        reason = self.unsupported_reason(request)
        if reason is not None:
            self._rejected.append(RejectedRequest(request.request_id, reason))
            return
        self.paged.add_request(request)

    def has_unfinished(self) -> bool:
        return bool(self._rejected) or self.paged.has_unfinished()

    def step(self) -> StepOutput:
        """One paged-engine step plus eviction / host-traffic stats. Mutates engine state."""
        kv = self.kv
        evicted0 = kv.num_evicted_tokens
        counters0 = self._counters().snapshot()
        out = self.paged.step()
        if isinstance(self.executor, BoundedExecutor):
            self.executor.drop_released()  # finished this step: free their host stores now
        counters = self._counters()
        evicted = kv.num_evicted_tokens - evicted0
        evicted_bytes = evicted * self.bytes_per_token if kv.keeps_evicted_kv else 0
        fetch_to_host = counters.bytes_to_host - counters0.bytes_to_host
        fetch_from_host = counters.bytes_from_host - counters0.bytes_from_host
        to_host = out.stats.bytes_to_host + evicted_bytes + fetch_to_host
        from_host = out.stats.bytes_from_host + fetch_from_host
        modeled_s = (to_host + from_host) / (self.ctx.hardware.pcie_gbps * 1e9)
        recall_n = counters.num_recall_samples - counters0.num_recall_samples
        self.transfer_log.append(
            {
                "num_evicted_tokens": evicted,
                "entries_fetched": counters.entries_from_host - counters0.entries_from_host,
                "bytes_to_host": to_host,
                "bytes_from_host": from_host,
                "fetch_recall": (counters.recall_sum - counters0.recall_sum) / recall_n
                if recall_n
                else float("nan"),
                "modeled_transfer_s": modeled_s,
                "measured_copy_s": (
                    counters.measured_copy_s - counters0.measured_copy_s
                    if counters.measured
                    else float("nan")
                ),
            }
        )
        record = self.transfer_log[-1]
        stats = replace(
            out.stats,
            num_evicted_tokens=evicted,
            bytes_to_host=to_host,
            bytes_from_host=from_host,
            modeled_transfer_s=modeled_s,
            fetch_recall=record["fetch_recall"],
            num_fetched_entries=record["entries_fetched"],
            measured_transfer_s=record["measured_copy_s"],
        )
        rejected, self._rejected = tuple(self._rejected), []
        duration_s = out.modeled_duration_s
        if duration_s is not None:
            # Simulation: the cost model priced the step's swaps (its shape); the tier's
            # own copies (evictions to the host, fetches) add their PCIe time, as the
            # cost model adds host copies (they do not overlap the forward pass here).
            pcie_bytes_per_s = self.ctx.hardware.pcie_gbps * 1e9
            duration_s += (evicted_bytes + fetch_to_host + fetch_from_host) / pcie_bytes_per_s
        return replace(out, stats=stats, rejected=out.rejected + rejected, modeled_duration_s=duration_s)

    def describe(self) -> dict[str, Any]:
        """Static facts plus cumulative eviction / transfer totals (read after a run)."""
        counters = self._counters()
        policy = self.policy
        facts = self.paged.describe()
        facts.update(
            budget_tokens=policy.budget_tokens,
            budget_ratio=policy.budget_ratio,
            num_sink_tokens=policy.num_sink_tokens,
            heavy_share=policy.heavy_share,
            score_aggregation=policy.score_aggregation,
            num_evicted_tokens=self.kv.num_evicted_tokens,
            host_bytes_to=sum(r["bytes_to_host"] for r in self.transfer_log),
            host_bytes_from=sum(r["bytes_from_host"] for r in self.transfer_log),
            modeled_transfer_s=sum(r["modeled_transfer_s"] for r in self.transfer_log),
            # None (JSON null) where nothing was measured: no fetch, or no CUDA copy timing.
            fetch_recall=(
                counters.recall_sum / counters.num_recall_samples if counters.num_recall_samples else None
            ),
            measured_copy_s=counters.measured_copy_s if counters.measured else None,
            **self.tier.describe(),
        )
        return facts

    # ------------------------------------------------------------------ quality harness
    def sequence_backend_factory(self) -> Callable[[LlamaModel, int], BoundedSequenceBackend]:
        """``(model, max_len) -> SequenceBackend`` with this engine's policy and tier, for
        ``kvbench.quality.evaluate_quality``."""
        return functools.partial(BoundedSequenceBackend, policy=self.policy, tier=self.tier)

    def _counters(self) -> TransferCounters:
        counters = getattr(self.executor, "counters", None)
        return counters if isinstance(counters, TransferCounters) else TransferCounters()
