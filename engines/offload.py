"""InfiniGen-style KV offload: H2O's bounded device budget plus a host tier
(``exec/host_tier.py``: evicted K/V kept on the host, speculated hot tokens fetched back
before each decode step's attention). Hydra target ``kvbench.engines.offload.OffloadEngine``.
"""

from __future__ import annotations

from typing import Any

from kvbench.engines.bounded import BoundedCacheEngine
from kvbench.engines.exec.host_tier import HostOffload
from kvbench.engines.kv.eviction import EvictionPolicy
from kvbench.types import EngineContext


class OffloadEngine(BoundedCacheEngine):
    """H2O's bounded device budget plus the host tier (``HostOffload``); see the module doc.

    Parameters are H2OEngine's plus ``max_fetch_tokens`` and ``channel_share``
    (``conf/engine/offload.yaml``). Raises ValueError naming ``engine.<parameter>``.
    """

    def __init__(
        self,
        ctx: EngineContext,
        *,
        name: str = "offload",
        budget_tokens: int | None = None,
        budget_ratio: float | None = 0.2,
        num_sink_tokens: int = 0,
        heavy_share: float = 0.5,
        score_aggregation: str = "mean",
        max_fetch_tokens: int = 8,
        channel_share: float = 0.25,
        **engine_params: Any,
    ) -> None:
        policy = EvictionPolicy(budget_tokens, budget_ratio, num_sink_tokens, heavy_share, score_aggregation)
        tier = HostOffload(max_fetch_tokens=max_fetch_tokens, channel_share=channel_share)
        tier.validate()
        super().__init__(ctx, policy=policy, tier=tier, name=name, **engine_params)
