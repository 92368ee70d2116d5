"""The batched bounded (evicting) KV engine that H2O, StreamingLLM and offload assemble.

The paged engine with its scheduler, a ``BoundedKVManager`` (``kv/bounded.py``: block
counts stop growing at the budget) and a ``BoundedExecutor`` (``exec/bounded.py``) that
keeps each sequence's slots. The same policy code drives the quality harness
(``exec/bounded.BoundedSequenceBackend``).

Budget context. A ratio budget is a share of the context the driver knows when the
sequence starts: in the engine, the tokens at admission (the prompt; H2O sizes its
10 % + 10 % the same way), in the harness, ``max_len`` (the whole scored text, since
the harness feeds a 1-token prompt and then the text token by token).

Simulation imports no torch: the bounded executor and the harness backend (exec/bounded.py)
are imported by ``bounded_executor`` and ``sequence_backend_factory``, which only real mode
calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvbench.engines.config import DEFAULTS, EngineConfig, size_pool
from kvbench.engines.exec.protocol import Executor
from kvbench.engines.kv.bounded import BoundedKVManager
from kvbench.engines.kv.eviction import EvictedTier, EvictionPolicy, TransferCounters
from kvbench.engines.paged import PagedEngine
from kvbench.sizing import kv_bytes_per_token
from kvbench.types import EngineContext, RejectedRequest, Request, StepOutput

if TYPE_CHECKING:
    from kvbench.engines.exec.bounded import BoundedExecutor, BoundedSequenceBackend
    from kvbench.model import LlamaModel


def bounded_executor(
    model: LlamaModel,
    ctx: EngineContext,
    kv: BoundedKVManager,
    tier: EvictedTier,
    *,
    num_blocks: int,
    block_size: int,
    num_host_blocks: int,
) -> BoundedExecutor:
    """Real mode's executor of a bounded engine: ``model`` over a torch pool of
    ``num_blocks`` blocks with ``kv``'s per-sequence slots and ``tier``'s stores. Imports
    torch and the model here, so simulation, which never calls this, never loads them.
    Raises ValueError naming ``run.kv_dtype`` when torch cannot store it."""
    from kvbench.engines.exec.bounded import BoundedExecutor
    from kvbench.model import torch_dtype

    try:
        torch_dtype(ctx.kv_dtype)
    except ValueError:
        raise ValueError(
            f"run.kv_dtype: {ctx.kv_dtype!r} cannot be stored (use fp32, bf16 or fp16)"
        ) from None
    return BoundedExecutor(
        model,
        kv,
        tier,
        num_blocks=num_blocks,
        block_size=block_size,
        num_host_blocks=num_host_blocks,
        device=ctx.device,
        kv_dtype=ctx.kv_dtype,
    )


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
        block_size: int = DEFAULTS.block_size,
        num_blocks: int | None = DEFAULTS.num_blocks,
        kv_memory_bytes: int | None = DEFAULTS.kv_memory_bytes,
        gpu_memory_utilization: float = DEFAULTS.gpu_memory_utilization,
        num_host_blocks: int = DEFAULTS.num_host_blocks,
        preemption: str = DEFAULTS.preemption,
        max_num_seqs: int = DEFAULTS.max_num_seqs,
        max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens,
        chunked_prefill: bool = DEFAULTS.chunked_prefill,
        victim_policy: str = DEFAULTS.victim_policy,
        decode_backend: str = DEFAULTS.decode_backend,
        fast_forward: bool = DEFAULTS.fast_forward,
        executor: Executor | None = None,
    ) -> None:
        policy.validate()
        self.policy = policy
        self.tier = tier
        self.name = name
        self.ctx = ctx
        # An evicting sequence shares no blocks: no prefix cache.
        config = EngineConfig.from_arguments(locals(), prefix_cache="none")
        # The pool is sized once, here; the paged assembly below reuses it.
        num_blocks, executor = size_pool(ctx, config, executor)
        num_host_blocks = config.host_blocks_for(num_blocks)
        self.bytes_per_token = kv_bytes_per_token(ctx.spec, ctx.kv_dtype)
        self.kv = BoundedKVManager(
            num_blocks,
            config.block_size,
            self.bytes_per_token,
            policy,
            num_host_blocks,
            tier.keeps_evicted_kv,
        )
        # The torch executor this engine built (real mode): its transfer counters and
        # released-sequence cleanup; None with a given executor or the cost model.
        self._bounded: BoundedExecutor | None = None
        if executor is None:
            if ctx.model is None:
                raise ValueError(
                    f"engine.{name}: ctx.model is None (simulation mode) and no executor was given"
                )
            executor = self._bounded = bounded_executor(
                ctx.model,
                ctx,
                self.kv,
                tier,
                num_blocks=num_blocks,
                block_size=config.block_size,
                num_host_blocks=num_host_blocks,
            )
        self.executor = executor
        self.paged = PagedEngine.assemble(
            ctx, name=name, config=config, num_blocks=num_blocks, executor=executor, kv=self.kv
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
        if self._bounded is not None:
            self._bounded.drop_released()  # finished this step: free their host stores now
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
        ``kvbench.quality.evaluate_quality`` (real mode: imports the torch backend here)."""
        from kvbench.engines.exec.bounded import BoundedSequenceBackend

        return functools.partial(BoundedSequenceBackend, policy=self.policy, tier=self.tier)

    def _counters(self) -> TransferCounters:
        """The evicted tier's transfer counters: the bounded executor's; none (zeros) for
        the cost model, which moves no tensors."""
        return self._bounded.counters if self._bounded is not None else TransferCounters()
