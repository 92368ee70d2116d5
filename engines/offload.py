"""InfiniGen-style KV offload: H2O's bounded device budget plus a host tier
(``exec/host_tier.py``: evicted K/V kept on the host, speculated hot tokens fetched back
before each decode step's attention). Hydra target ``kvbench.engines.offload.OffloadEngine``.

``HostOffload`` holds the tier's settings; its host stores (torch) are built by
``new_store``, which only real mode calls, so simulation does not import them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvbench.engines.bounded import BoundedCacheEngine
from kvbench.engines.kv.eviction import EvictionPolicy, TransferCounters
from kvbench.types import EngineContext

if TYPE_CHECKING:
    import torch

    from kvbench.engines.exec.host_tier import HostKVStore


@dataclass(frozen=True)
class HostOffload:
    """The evicted-KV tier of the offload engine: keeps evicted K/V on the host and fetches
    speculated hot tokens back before each decode step's attention (``exec/host_tier.py``).

    ``max_fetch_tokens``: most swaps per decode step, layer and KV head (0: never fetch,
    which makes it H2O with a host copy). ``channel_share``: share of head_dim channels the
    speculation reads. ``validate`` raises ValueError naming ``engine.<field>``.
    """

    max_fetch_tokens: int = 8
    channel_share: float = 0.25
    keeps_evicted_kv: ClassVar[bool] = True  # evicted KV is host-resident (KVUsage.host_bytes)

    def validate(self) -> None:
        if self.max_fetch_tokens < 0:
            raise ValueError(f"engine.max_fetch_tokens: must be >= 0, got {self.max_fetch_tokens}")
        if not 0.0 < self.channel_share <= 1.0:
            raise ValueError(f"engine.channel_share: must be in (0, 1], got {self.channel_share}")

    def new_store(
        self,
        policy: EvictionPolicy,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        counters: TransferCounters,
    ) -> HostKVStore:
        """One sequence's host store; ``shape`` is (layers, q heads, KV heads, head dim).
        Real mode only: imports the torch store here."""
        from kvbench.engines.exec.host_tier import HostKVStore

        return HostKVStore(self.max_fetch_tokens, self.channel_share, policy, shape, dtype, counters)

    def describe(self) -> dict[str, object]:
        return {
            "evicted_tier": "host",
            "max_fetch_tokens": self.max_fetch_tokens,
            "channel_share": self.channel_share,
        }


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
