"""One bounded sequence's slot state and the attention over its resident slots (torch).

The policy (which tokens to keep) and the evicted-KV tiers are ``engines/kv/eviction.py``;
this module holds the tensors, so only real mode imports it (the bounded executor and the
quality harness, ``engines/exec/bounded.py``).

What a sequence does (``SequenceSlots``; both drivers, the batched engine and the quality
harness's single-sequence backend, run exactly this code):

* ``begin_step``: the driver says how many slots are allocated; if the step's tokens fit,
  they are appended, otherwise (decode at the budget) they replace victims.
* ``store_and_attend`` (per layer): choose victims, hand them to the evicted-KV tier (dropped
  for H2O, moved to host memory for offload), write K/V, let the tier fetch back host
  tokens (offload), attend over the resident slots, add the probabilities to the scores.
* ``end_step(prune=True)`` after a prefill longer than the budget: the prompt was attended
  in full (every token kept while the prompt ran, chunked or not); then, per layer and KV
  head, the policy keeps ``budget`` tokens (sinks, the last W prompt tokens and the top
  H scores), compacts them into slots ``[0, budget)`` in position order, and the tail is
  given back (the engine's KV manager frees those blocks when the step commits).

Storage is behind ``SlotStorage`` (the engine's paged pool via a block table, or the
harness's contiguous buffer); the evicted tier behind ``EvictedStore``.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from kvbench.engines.kv.eviction import EvictedStore, EvictionPolicy


# --------------------------------------------------------------------------- attention
def attend_slots(
    q: Tensor, k: Tensor, v: Tensor, key_positions: Tensor, q_start: int, scale: float, want_probs: bool
) -> tuple[Tensor, Tensor | None]:
    """Attention of one sequence's queries over its resident slots, GQA without repeats.

    q: [T, Hq, D] at positions [q_start, q_start + T); k, v: [N, Hkv, D] (slot order);
    key_positions: int64 [Hkv, N], the position each slot holds in each KV head (-1:
    empty). A query sees a key when the key's position is <= its own (causal; slot order
    is irrelevant because RoPE was applied before caching). Returns the output [T, Hq, D]
    in q's dtype (softmax in fp32) and, if ``want_probs``, probabilities [Hkv, G, T, N].
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * num_tokens, head_dim)  # [Hkv, G*T, D]
    logits = torch.bmm(qg.float(), k.permute(1, 2, 0).float()) * scale  # [Hkv, G*T, N]
    q_pos = torch.arange(q_start, q_start + num_tokens, device=q.device).repeat(group)  # [G*T]
    hidden = (key_positions[:, None, :] > q_pos[None, :, None]) | (key_positions[:, None, :] < 0)
    probs = torch.softmax(logits.masked_fill_(hidden, -math.inf), dim=-1)
    out = torch.bmm(probs, v.permute(1, 0, 2).float())  # [Hkv, G*T, D]
    out = out.reshape(num_kv_heads, group, num_tokens, head_dim).permute(2, 0, 1, 3)
    out = out.reshape(num_tokens, num_q_heads, head_dim).to(q.dtype)
    if not want_probs:
        return out, None
    return out, probs.reshape(num_kv_heads, group, num_tokens, -1)


# --------------------------------------------------------------------------- storage
class SlotStorage(Protocol):
    """Where one sequence's resident K/V live (paged pool or contiguous buffer).

    Slots are the sequence's logical slots ``0 .. capacity - 1``; ``slots`` tensors are
    int64 ``[n, Hkv]``: column h addresses KV head h.
    """

    def read(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """K, V at ``slots``: each [n, Hkv, D]. Mutates nothing."""
        ...

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [n, Hkv, D] at ``slots``. Mutates the storage."""
        ...


# --------------------------------------------------------------------------- one sequence
class SequenceSlots:
    """Slot bookkeeping of one bounded sequence (see the module docstring for the steps).

    ``positions``: int64 [L, Hkv, C], the position slot ``s`` holds (-1: empty);
    ``scores``: fp32 [L, Hkv, G, C]. ``num_filled`` slots (the same count in every layer
    and head) are in use; C grows on demand during a prefill longer than the budget.
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        budget: int,
        num_layers: int,
        num_q_heads: int,
        num_kv_heads: int,
        device: torch.device,
        store: EvictedStore,
    ) -> None:
        self.policy = policy
        self.budget = budget
        self.split = policy.split(budget)
        self.store = store
        self.group = num_q_heads // num_kv_heads
        self.num_kv_heads = num_kv_heads
        self.positions = torch.full((num_layers, num_kv_heads, budget), -1, dtype=torch.int64, device=device)
        self.scores = torch.zeros(num_layers, num_kv_heads, self.group, budget, device=device)
        self.num_filled = 0
        self.num_evicted_tokens = 0  # cumulative, in tokens (one per layer-and-head entry set)
        # This step's plan (set by begin_step).
        self._start = 0
        self._num_new = 0
        self._evicting = False

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def begin_step(self, start_position: int, num_tokens: int, num_allocated_slots: int) -> None:
        """Plan a step of ``num_tokens`` tokens from ``start_position``.

        ``num_allocated_slots``: slots the driver's storage holds for the sequence now.
        Tokens are appended when they fit, otherwise (decode at the budget) each replaces
        a victim. Raises ValueError when neither applies (storage out of step with us).
        """
        self._start = start_position
        self._num_new = num_tokens
        if self.num_filled + num_tokens <= num_allocated_slots:
            self._evicting = False
            self._reserve(self.num_filled + num_tokens)
        elif self.num_filled == num_allocated_slots and num_allocated_slots >= self.budget:
            self._evicting = True
        else:
            raise ValueError(
                f"bounded sequence: {num_tokens} new tokens with {self.num_filled} slots filled and "
                f"{num_allocated_slots} allocated (budget {self.budget})"
            )

    @property
    def num_resident(self) -> int:
        """Slots holding a token right now (this step's appended tokens included)."""
        return self.num_filled + (0 if self._evicting else self._num_new)

    @property
    def is_decode(self) -> bool:
        return self._num_new == 1 and self._start > 0

    @property
    def first_recent_position(self) -> int:
        """First position of the recent window once this step's tokens are in."""
        return self._start + self._num_new - self.split.num_recent

    def new_slots(self, layer: int, storage: SlotStorage) -> Tensor:
        """Slots for this step's tokens in ``layer``: int64 [n, Hkv]. In the evicting case
        the victims' K/V, positions and scores go to the evicted store first."""
        n = self._num_new
        if not self._evicting:
            base = torch.arange(self.num_filled, self.num_filled + n, device=self.device)
            return base[:, None].expand(n, self.num_kv_heads)
        filled = self.num_filled
        victims = self.policy.victims(
            self.positions[layer, :, :filled],
            self.scores[layer, :, :, :filled],
            n,
            self.first_recent_position,
        )  # [Hkv, n]
        slots = victims.t()  # [n, Hkv]
        self._evict(layer, slots, storage)
        return slots

    def store_and_attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, storage: SlotStorage, scale: float
    ) -> Tensor:
        """Write this step's k, v [n, Hkv, D] for ``layer`` and attend q [n, Hq, D] over the
        resident slots. Mutates storage, positions, scores (and the evicted store)."""
        n = self._num_new
        slots = self.new_slots(layer, storage)
        storage.write(layer, slots, k, v)
        new_pos = torch.arange(self._start, self._start + n, device=self.device)
        self.positions[layer].scatter_(1, slots.t(), new_pos[None, :].expand(self.num_kv_heads, n))
        self.scores[layer].scatter_(
            2, slots.t()[:, None, :].expand(-1, self.group, -1), 0.0
        )  # a slot's score restarts with its new token
        if self.is_decode:
            self.store.before_attend(layer, q, self, storage)
        filled = self.num_filled if self._evicting else self.num_filled + n
        all_slots = torch.arange(filled, device=self.device)[:, None].expand(filled, self.num_kv_heads)
        k_all, v_all = storage.read(layer, all_slots)  # [N, Hkv, D]
        out, probs = attend_slots(
            q, k_all, v_all, self.positions[layer, :, :filled], self._start, scale, self.policy.needs_scores
        )
        if probs is not None:
            self.scores[layer, :, :, :filled] += probs.sum(dim=2)  # [Hkv, G, N]: summed over queries
        return out

    def end_step(self, storage: SlotStorage, prune: bool) -> int:
        """Finish the step; with ``prune`` and more than ``budget`` slots filled, keep the
        policy's ``budget`` tokens per layer and head, compacted into slots [0, budget).

        Returns the number of tokens evicted by this step (victim writes or pruning).
        Mutates positions, scores, storage and the evicted store.
        """
        evicted = self._num_new if self._evicting else 0
        if not self._evicting:
            self.num_filled += self._num_new
        self._num_new = 0
        if prune and self.num_filled > self.budget:
            evicted += self._prune(storage)
        self.num_evicted_tokens += evicted
        return evicted

    # ------------------------------------------------------------------ internals
    def _prune(self, storage: SlotStorage) -> int:
        filled, budget = self.num_filled, self.budget
        # The window ends at the newest token present (the prompt's last one).
        first_recent = int(self.positions[:, :, :filled].max()) + 1 - self.split.num_recent
        num_victims = filled - budget
        all_new = torch.arange(budget, device=self.device)[:, None].expand(budget, self.num_kv_heads)
        for layer in range(self.positions.shape[0]):
            positions = self.positions[layer, :, :filled]  # [Hkv, filled]
            scores = self.scores[layer, :, :, :filled]  # [Hkv, G, filled]
            victims, kept = self.policy.partition(positions, scores, num_victims, first_recent)
            self._evict(layer, victims.t(), storage)
            kept = kept.gather(1, torch.argsort(positions.gather(1, kept), dim=1))  # position order
            k, v = storage.read(layer, kept.t())  # read all kept before overwriting slots [0, budget)
            storage.write(layer, all_new, k, v)
            kept_pos = positions.gather(1, kept)
            kept_scores = scores.gather(2, kept[:, None, :].expand(-1, self.group, -1))
            self.positions[layer] = -1
            self.scores[layer] = 0.0
            self.positions[layer, :, :budget] = kept_pos
            self.scores[layer, :, :, :budget] = kept_scores
        self.num_filled = budget
        return num_victims

    def _evict(self, layer: int, slots: Tensor, storage: SlotStorage) -> None:
        """slots: [n, Hkv]. Hands K/V, positions and scores of those slots to the store."""
        k, v = storage.read(layer, slots)
        slots_t = slots.t()  # [Hkv, n]
        positions = self.positions[layer].gather(1, slots_t)
        scores = self.scores[layer].gather(2, slots_t[:, None, :].expand(-1, self.group, -1))
        self.store.on_evict(layer, k, v, positions, scores)

    def _reserve(self, num_slots: int) -> None:
        capacity = self.positions.shape[-1]
        if num_slots <= capacity:
            return
        grow = max(num_slots, 2 * capacity) - capacity
        pad_pos = torch.full((*self.positions.shape[:2], grow), -1, dtype=torch.int64, device=self.device)
        self.positions = torch.cat([self.positions, pad_pos], dim=-1)
        pad_score = torch.zeros((*self.scores.shape[:3], grow), device=self.device)
        self.scores = torch.cat([self.scores, pad_score], dim=-1)
