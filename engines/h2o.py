"""H2O (heavy hitters + recent window) and StreamingLLM (sinks + window) engines.

Both are the bounded paged engine (``engines/bounded.BoundedCacheEngine``) with the
eviction policy of ``eviction.EvictionPolicy`` and evicted K/V dropped. StreamingLLM is
not separate code: it is H2O with ``heavy_share = 0`` and 4 sink tokens by default.
Hydra targets: ``kvbench.engines.h2o.H2OEngine`` and ``kvbench.engines.h2o.StreamingEngine``
(partials taking ``ctx``; ``conf/engine/h2o.yaml``, ``conf/engine/streaming.yaml``).
"""

from __future__ import annotations

from typing import Any

from kvbench.engines.bounded import BoundedCacheEngine
from kvbench.engines.kv.eviction import DropEvicted, EvictionPolicy
from kvbench.types import EngineContext


class H2OEngine(BoundedCacheEngine):
    """H2O over bounded paged storage. ``budget_tokens`` or ``budget_ratio`` (of the prompt)
    sets each sequence's slots; ``heavy_share`` of the non-sink budget goes to heavy
    hitters, the rest to the recent window. Other parameters are the paged engine's.
    Raises ValueError naming ``engine.<parameter>``."""

    def __init__(
        self,
        ctx: EngineContext,
        *,
        name: str = "h2o",
        budget_tokens: int | None = None,
        budget_ratio: float | None = 0.2,
        num_sink_tokens: int = 0,
        heavy_share: float = 0.5,
        score_aggregation: str = "mean",
        **engine_params: Any,
    ) -> None:
        policy = EvictionPolicy(budget_tokens, budget_ratio, num_sink_tokens, heavy_share, score_aggregation)
        super().__init__(ctx, policy=policy, tier=DropEvicted(), name=name, **engine_params)


def StreamingEngine(  # noqa: N802 - a class-like factory name for Hydra targets
    ctx: EngineContext,
    *,
    name: str = "streaming",
    budget_tokens: int | None = None,
    budget_ratio: float | None = 0.2,
    num_sink_tokens: int = 4,
    **engine_params: Any,
) -> H2OEngine:
    """StreamingLLM: ``H2OEngine`` with no heavy hitters (sinks + recent window only)."""
    return H2OEngine(
        ctx,
        name=name,
        budget_tokens=budget_tokens,
        budget_ratio=budget_ratio,
        num_sink_tokens=num_sink_tokens,
        heavy_share=0.0,
        **engine_params,
    )
