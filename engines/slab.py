"""The slab engine: the paged engine's scheduler, executor and sampler over a
``SlabKVManager`` (``engines/kv/slab.py``: contiguous per-sequence regions of a flat arena,
the pre-PagedAttention baseline). Hydra target ``kvbench.engines.slab.SlabEngine``.
"""

from __future__ import annotations

from typing import Any

from kvbench.engines.config import DEFAULTS, EngineConfig, size_pool
from kvbench.engines.exec.protocol import Executor
from kvbench.engines.kv.slab import PLACEMENTS, SlabKVManager, make_reservation
from kvbench.engines.paged import PagedEngine
from kvbench.sizing import kv_bytes_per_token
from kvbench.types import EngineContext


class SlabEngine(PagedEngine):
    """The paged engine's scheduler, executor and sampler over a ``SlabKVManager``.

    Same parameters as ``PagedEngine`` (``conf/engine/slab.yaml``) plus ``reserve``
    (``max_len`` | ``request``) and ``placement`` (``first_fit`` | ``best_fit``); no prefix
    cache and recompute-only preemption (the slab has no host tier). A request whose
    regions exceed the whole arena is rejected by the next ``step``. Raises ValueError
    naming ``engine.<parameter>`` for an invalid parameter.
    """

    def __init__(
        self,
        ctx: EngineContext,
        *,
        name: str = "slab",
        reserve: str = "max_len",
        placement: str = "first_fit",
        block_size: int = DEFAULTS.block_size,
        num_blocks: int | None = DEFAULTS.num_blocks,
        kv_memory_bytes: int | None = DEFAULTS.kv_memory_bytes,
        gpu_memory_utilization: float = DEFAULTS.gpu_memory_utilization,
        max_num_seqs: int = DEFAULTS.max_num_seqs,
        max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens,
        chunked_prefill: bool = DEFAULTS.chunked_prefill,
        victim_policy: str = DEFAULTS.victim_policy,
        decode_backend: str = DEFAULTS.decode_backend,
        fast_forward: bool = DEFAULTS.fast_forward,
        executor: Executor | None = None,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"engine.placement: must be one of {tuple(PLACEMENTS)}, got {placement!r}")
        reservation = make_reservation(reserve, ctx.spec.max_position_embeddings)
        # The pre-PagedAttention baseline shares nothing and has no host tier.
        config = EngineConfig.from_arguments(locals(), prefix_cache="none", preemption="recompute")
        num_blocks, executor = size_pool(ctx, config, executor)
        self.slab = SlabKVManager(
            num_blocks,
            config.block_size,
            kv_bytes_per_token(ctx.spec, ctx.kv_dtype),
            reservation,
            PLACEMENTS[placement](),
        )
        self._build(ctx, name, config, num_blocks, executor, self.slab, self.slab)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "kv_manager": "slab",
            "slab_reserve": self.slab.reservation.name,
            "slab_placement": self.slab.placement.name,
        }
