"""Bounded KV caches: the H2O / StreamingLLM eviction policy and one sequence's slot state.

A bounded sequence holds at most ``budget`` token slots per layer and KV head. Once it is
full, each new token is written into the slot of a token it evicts, so its memory stops
growing (FlexGen's fixed buffer with argmin-slot writes, field notes §4). RoPE is applied
before caching, so a slot's content does not depend on where it sits: slot ``s`` of layer
``l`` may hold position 17 in KV head 0 and position 90 in KV head 1.

The budget splits into three parts (``EvictionPolicy.split``)::

    positions   0 1 2 3 | ........ heavy hitters (top scores) ........ | p-W+1 ... p
                sinks S                       H                          recent window W

* **Score** (H2O): per layer, per query head, the post-softmax attention probability a
  key received, summed over every query that has seen it so far (prefill rows and one
  row per decode step), never normalised. Scoring is causal: a key only collects from
  queries at or after its position. Scores are kept per query head
  (``[layers, kv_heads, group, slots]``) and aggregated over the GQA group (``mean`` as
  kvpress does, or ``max``) when a victim is chosen.
* **Victim**: among resident tokens that are neither sinks nor inside the window that the
  step's newest token closes, the lowest aggregated score (ties: the oldest position).
* **StreamingLLM** is the same policy with ``heavy_share = 0``: the only candidate is the
  token leaving the window, so it keeps exactly sinks + window and needs no scores
  (``needs_scores`` is False and attention skips accumulating them).

One sequence's slots and the attention over them are tensors (``engines/kv/slots.py``,
``SequenceSlots``). This module imports no torch (the policy's victim choice calls only
methods of the tensors it is given), so simulation's bounded managers use the policy and
the tiers without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from kvbench.engines.kv.slots import SequenceSlots, SlotStorage

SCORE_AGGREGATIONS = ("mean", "max")


@dataclass(frozen=True)
class BudgetSplit:
    """How a budget of ``num_sink + num_heavy + num_recent`` token slots is used."""

    num_sink: int
    num_heavy: int
    num_recent: int

    @property
    def budget(self) -> int:
        return self.num_sink + self.num_heavy + self.num_recent


@dataclass(frozen=True)
class EvictionPolicy:
    """Which tokens a bounded cache keeps; pure functions of positions and scores.

    ``budget_tokens`` (absolute; wins when set) or else ``budget_ratio`` (share of the
    context length the driver passes to ``budget_for``) sets the per-sequence budget. ``heavy_share`` is the share of the non-sink budget given to heavy hitters (the
    rest is the recent window, at least one token: the newest). ``score_aggregation``
    combines the query heads of a GQA group per KV head. ``validate`` raises ValueError
    naming ``engine.<field>``.
    """

    budget_tokens: int | None = None
    budget_ratio: float | None = 0.2
    num_sink_tokens: int = 0
    heavy_share: float = 0.5
    score_aggregation: str = "mean"

    def validate(self) -> None:
        if self.budget_tokens is None and self.budget_ratio is None:
            raise ValueError("engine.budget_tokens / engine.budget_ratio: set one of them (both are null)")
        if self.budget_tokens is not None and self.budget_tokens <= self.num_sink_tokens:
            raise ValueError(
                f"engine.budget_tokens: must exceed engine.num_sink_tokens={self.num_sink_tokens} "
                f"(room for the newest token), got {self.budget_tokens}"
            )
        if self.budget_ratio is not None and not 0.0 < self.budget_ratio <= 1.0:
            raise ValueError(f"engine.budget_ratio: must be in (0, 1], got {self.budget_ratio}")
        if self.num_sink_tokens < 0:
            raise ValueError(f"engine.num_sink_tokens: must be >= 0, got {self.num_sink_tokens}")
        if not 0.0 <= self.heavy_share < 1.0:
            raise ValueError(f"engine.heavy_share: must be in [0, 1), got {self.heavy_share}")
        if self.score_aggregation not in SCORE_AGGREGATIONS:
            raise ValueError(
                f"engine.score_aggregation: must be one of {SCORE_AGGREGATIONS}, got {self.score_aggregation!r}"
            )

    @property
    def needs_scores(self) -> bool:
        """False for StreamingLLM (no heavy hitters): attention need not accumulate scores."""
        return self.heavy_share > 0.0

    def budget_for(self, context_len: int) -> int:
        """Token slots per layer and KV head for a sequence whose context is ``context_len``.

        A ratio budget is ``ceil(ratio * context_len)``, raised to ``num_sink_tokens + 1``
        when smaller (sinks plus the newest token is the least that can work).
        """
        if self.budget_tokens is not None:
            return self.budget_tokens
        assert self.budget_ratio is not None
        return max(math.ceil(self.budget_ratio * context_len), self.num_sink_tokens + 1)

    def split(self, budget: int) -> BudgetSplit:
        """Sinks, heavy hitters and recent window of ``budget`` (window >= 1)."""
        rest = budget - self.num_sink_tokens
        if rest < 1:
            raise ValueError(f"budget {budget} leaves no slot beyond {self.num_sink_tokens} sinks")
        heavy = min(math.floor(self.heavy_share * rest), rest - 1)
        return BudgetSplit(self.num_sink_tokens, heavy, rest - heavy)

    def aggregate(self, scores: Tensor) -> Tensor:
        """scores: [Hkv, G, N] per query head -> [Hkv, N] per KV head (mean or max over G)."""
        if self.score_aggregation == "max":
            return scores.amax(dim=1)
        return scores.mean(dim=1)

    def victims(
        self, positions: Tensor, scores: Tensor, num_victims: int, first_recent_position: int
    ) -> Tensor:
        """Slots to evict, per KV head: int64 [Hkv, num_victims].

        positions: int64 [Hkv, N] (the position each slot holds); scores: [Hkv, G, N].
        Candidates are slots with ``num_sink_tokens <= position < first_recent_position``
        (``first_recent_position`` is the first position of the window that must stay);
        the lowest aggregated score goes first, ties broken by the older position.
        Raises ValueError when a head has fewer candidates than ``num_victims``.
        Mutates nothing.
        """
        return self.partition(positions, scores, num_victims, first_recent_position)[0]

    def partition(
        self, positions: Tensor, scores: Tensor, num_victims: int, first_recent_position: int
    ) -> tuple[Tensor, Tensor]:
        """(victims [Hkv, num_victims], kept [Hkv, N - num_victims]) slot indices; see ``victims``."""
        candidates = (positions >= self.num_sink_tokens) & (positions < first_recent_position)
        fewest = int(candidates.sum(dim=1).min()) if positions.numel() else 0
        if num_victims > fewest:
            raise ValueError(
                f"evict {num_victims} tokens: only {fewest} candidates outside the "
                f"{self.num_sink_tokens} sinks and the window starting at position {first_recent_position}"
            )
        order = self.eviction_order(positions, scores, first_recent_position)
        return order[:, :num_victims], order[:, num_victims:]

    def eviction_order(self, positions: Tensor, scores: Tensor, first_recent_position: int) -> Tensor:
        """All slots per head, most evictable first (candidates by score then age, then the
        protected ones): int64 [Hkv, N]. Mutates nothing."""
        candidates = (positions >= self.num_sink_tokens) & (positions < first_recent_position)
        key = self.aggregate(scores.float()).masked_fill(~candidates, math.inf)  # [Hkv, N]
        by_age = positions.argsort(dim=1, stable=True)
        by_score = key.gather(1, by_age).argsort(dim=1, stable=True)
        return by_age.gather(1, by_score)


# --------------------------------------------------------------------------- tiers
@dataclass
class TransferCounters:
    """Host-tier traffic of one driver, cumulative (the engine reads differences per step).

    Entries are (token, layer, KV head) K/V pairs; ``bytes_*`` count K and V. Fetch recall
    sums, per (decode step, layer, KV head) with host-resident tokens, the share of the
    true top-k attention tokens among host-resident ones that the speculation picked
    (k = the fetch width). ``measured_copy_s`` is the copy time measured on a CUDA side
    stream (stays 0 on CPU, where ``measured`` is False).
    """

    entries_to_host: int = 0
    entries_from_host: int = 0
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    recall_sum: float = 0.0
    num_recall_samples: int = 0
    measured_copy_s: float = 0.0
    measured: bool = False

    def snapshot(self) -> TransferCounters:
        return TransferCounters(**vars(self))


class EvictedStore(Protocol):
    """What happens to one sequence's evicted K/V (dropped, or kept in host memory)."""

    def on_evict(self, layer: int, k: Tensor, v: Tensor, positions: Tensor, scores: Tensor) -> None:
        """Take evicted entries: k, v [n, Hkv, D]; positions int64 [Hkv, n]; scores [Hkv, G, n]."""
        ...

    def before_attend(self, layer: int, q: Tensor, slots: SequenceSlots, storage: SlotStorage) -> None:
        """Decode steps only, after this layer's new K/V are written and before attention:
        may swap device slots with kept entries (mutates ``slots`` and ``storage``)."""
        ...


class EvictedTier(Protocol):
    """Makes one ``EvictedStore`` per sequence; shared by every sequence of a driver."""

    keeps_evicted_kv: bool  # True: evicted KV stays in host memory (counted as host bytes)

    def new_store(
        self,
        policy: EvictionPolicy,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        counters: TransferCounters,
    ) -> EvictedStore: ...

    def describe(self) -> dict[str, object]: ...


class DropEvicted:
    """H2O / StreamingLLM: evicted K/V are gone (no host tier)."""

    keeps_evicted_kv = False

    def new_store(
        self,
        policy: EvictionPolicy,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        counters: TransferCounters,
    ) -> EvictedStore:
        """A store for one sequence; ``shape`` is (layers, q heads, KV heads, head dim)."""
        return _DroppedStore()

    def describe(self) -> dict[str, object]:
        return {"evicted_tier": "drop"}


class _DroppedStore:
    def on_evict(self, layer: int, k: Tensor, v: Tensor, positions: Tensor, scores: Tensor) -> None:
        pass

    def before_attend(self, layer: int, q: Tensor, slots: SequenceSlots, storage: SlotStorage) -> None:
        pass
