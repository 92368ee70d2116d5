"""InfiniGen-style KV offload's host store (``engines/offload.py`` assembles the engine and
holds the tier's settings, ``HostOffload``): a host tier around the same bounded device
budget as H2O. Real mode only (torch); ``HostOffload.new_store`` builds the stores.

The device holds ``budget`` slots per sequence, layer and KV head, exactly as in H2O
(same policy, same storage, same memory). Tokens H2O would drop go to a host store
instead (pinned CPU memory on CUDA, a plain CPU tensor otherwise). Before each decode
step's attention in each layer, the store *speculates* which host tokens the current
query will attend to and swaps the best of them with the coldest device tokens::

    1. channels  top ceil(channel_share * D) channels of |q|, summed over the GQA group
                 (InfiniGen's partial keys; it picks channels offline after an SVD skew,
                 we pick them from the live query, which needs no calibration)
    2. speculate partial logits q[ch] . k[ch] for every host token and every evictable
                 device token (not a sink, not in the recent window), aggregated over the
                 group like the H2O score (mean | max)
    3. fetch     per KV head, pair the top-F host tokens (F = max_fetch_tokens) with the
                 bottom-F device candidates and swap each pair whose host logit is higher:
                 the host token's K/V, position and H2O score move to the device slot, the
                 device token's go to the host (tokens keep their accumulated scores)
    4. attend    over the device slots as usual; later evictions follow H2O scores

The speculation reads only the selected channels of the host keys; it runs where the
host store lives (the CPU), with the query copied there (a few hundred bytes). It is not
counted as transfer; the fetched K/V are (both directions of each swap).

Per step the engine reports (``OffloadEngine.transfer_log`` and ``StepStats``): tokens
and bytes moved each way (evictions to host counted by the KV manager, fetch swaps by
the store), the fetch recall (of the true top-F attention tokens among host-resident
ones, the share the speculation selected; the true logits are computed for this
measurement only), the *modeled* PCIe time from ``hardware.pcie_gbps``, and on CUDA the
copy time measured with events on a side stream (device waits on the copy's event, not a
device-wide sync).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from kvbench.engines.kv.eviction import EvictionPolicy, TransferCounters
from kvbench.engines.kv.slots import SequenceSlots, SlotStorage


class HostKVStore:
    """Host-resident K/V of one sequence, per layer: k, v [Hkv, capacity, D] on the CPU
    (pinned when the device is CUDA), positions int64 [Hkv, capacity], scores fp32
    [Hkv, G, capacity]. Every layer and head holds the same number of entries."""

    def __init__(
        self,
        max_fetch_tokens: int,
        channel_share: float,
        policy: EvictionPolicy,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        counters: TransferCounters,
    ) -> None:
        num_layers, num_q_heads, num_kv_heads, head_dim = shape
        self.max_fetch_tokens = max_fetch_tokens
        self.policy = policy
        self.counters = counters
        self.group = num_q_heads // num_kv_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.bytes_per_entry = 2 * head_dim * torch.empty(0, dtype=dtype).element_size()
        self.num_channels = max(1, math.ceil(channel_share * head_dim))
        self._pin = False  # set by _bind on the first CUDA eviction
        self._side_stream: Any = None
        self.k: list[Tensor] = [self._empty_kv(0) for _ in range(num_layers)]
        self.v: list[Tensor] = [self._empty_kv(0) for _ in range(num_layers)]
        self.positions: list[Tensor] = [
            torch.empty(num_kv_heads, 0, dtype=torch.int64) for _ in range(num_layers)
        ]
        self.scores: list[Tensor] = [torch.empty(num_kv_heads, self.group, 0) for _ in range(num_layers)]
        self.count = [0] * num_layers

    # ------------------------------------------------------------------ EvictedStore
    def on_evict(self, layer: int, k: Tensor, v: Tensor, positions: Tensor, scores: Tensor) -> None:
        """Append evicted entries (k, v [n, Hkv, D]) to the layer's host arrays. Mutates the store."""
        self._bind(k.device)
        n = k.shape[0]
        start = self.count[layer]
        self._reserve(layer, start + n)
        k_host, v_host = self._to_host(k.transpose(0, 1)), self._to_host(v.transpose(0, 1))  # [Hkv, n, D]
        self.k[layer][:, start : start + n] = k_host
        self.v[layer][:, start : start + n] = v_host
        self.positions[layer][:, start : start + n] = positions.cpu()
        self.scores[layer][:, :, start : start + n] = scores.float().cpu()
        self.count[layer] = start + n

    def before_attend(self, layer: int, q: Tensor, slots: SequenceSlots, storage: SlotStorage) -> None:
        """Speculate, measure recall, and swap up to ``max_fetch_tokens`` host tokens per KV
        head into the coldest device candidates (module docstring, steps 1-3).

        q: [1, Hq, D] (the decode token). Mutates the storage, ``slots`` and the store."""
        num_host = self.count[layer]
        if num_host == 0 or self.max_fetch_tokens == 0:
            return
        device = q.device
        hkv, group, dim = self.num_kv_heads, self.group, self.head_dim
        qg = q[0].reshape(hkv, group, dim).float().cpu()  # [Hkv, G, D]
        channels = torch.topk(qg.abs().sum(dim=1), self.num_channels, dim=1).indices  # [Hkv, r]
        q_sel = qg.gather(2, channels[:, None, :].expand(-1, group, -1))  # [Hkv, G, r]
        k_host = self.k[layer][:, :num_host].float()  # [Hkv, M, D]
        k_host_sel = k_host.gather(2, channels[:, None, :].expand(-1, num_host, -1))  # [Hkv, M, r]
        spec_host = self.policy.aggregate(torch.bmm(q_sel, k_host_sel.transpose(1, 2)))  # [Hkv, M]

        filled = slots.num_filled
        positions = slots.positions[layer, :, :filled]  # [Hkv, N]
        candidate = (positions >= slots.split.num_sink) & (positions < slots.first_recent_position)
        num_fetch = min(self.max_fetch_tokens, num_host, int(candidate.sum(dim=1).min()))
        if num_fetch == 0:
            return
        all_slots = torch.arange(filled, device=device)[:, None].expand(filled, hkv)
        k_dev, _ = storage.read(layer, all_slots)  # [N, Hkv, D]
        k_dev_sel = (
            k_dev.permute(1, 0, 2).float().cpu().gather(2, channels[:, None, :].expand(-1, filled, -1))
        )
        spec_dev = self.policy.aggregate(torch.bmm(q_sel, k_dev_sel.transpose(1, 2)))  # [Hkv, N]
        spec_dev = spec_dev.masked_fill(~candidate.cpu(), math.inf)

        host_val, host_idx = torch.topk(spec_host, num_fetch, dim=1)  # [Hkv, F], best first
        dev_val, dev_idx = torch.topk(spec_dev, num_fetch, dim=1, largest=False)  # coldest first
        swap = host_val > dev_val  # [Hkv, F]; monotone along F, so a prefix per head

        true_host = self.policy.aggregate(torch.bmm(qg, k_host.transpose(1, 2)))  # [Hkv, M], metric only
        true_top = torch.topk(true_host, num_fetch, dim=1).indices
        hits = (host_idx[:, :, None] == true_top[:, None, :]).any(dim=2).sum(dim=1)  # [Hkv]
        self.counters.recall_sum += float((hits.float() / num_fetch).sum())
        self.counters.num_recall_samples += hkv

        num_swaps = int(swap.sum())
        if num_swaps == 0:
            return
        self._swap(layer, slots, storage, swap, host_idx, dev_idx.to(device))
        self.counters.entries_from_host += num_swaps
        self.counters.entries_to_host += num_swaps
        self.counters.bytes_from_host += num_swaps * self.bytes_per_entry
        self.counters.bytes_to_host += num_swaps * self.bytes_per_entry

    # ------------------------------------------------------------------ internals
    def _swap(
        self,
        layer: int,
        slots: SequenceSlots,
        storage: SlotStorage,
        swap: Tensor,
        host_idx: Tensor,
        dev_idx: Tensor,
    ) -> None:
        """Exchange host entries ``host_idx`` and device slots ``dev_idx`` ([Hkv, F]) where
        ``swap``; other pairs are rewritten unchanged (keeps it one vectorised write)."""
        dim, group = self.head_dim, self.group
        dev_slots = dev_idx.t()  # [F, Hkv]
        k_dev, v_dev = storage.read(layer, dev_slots)  # [F, Hkv, D]
        gather = host_idx[:, :, None].expand(-1, -1, dim)
        k_fetch = self.k[layer].gather(1, gather)  # [Hkv, F, D]
        v_fetch = self.v[layer].gather(1, gather)
        swap_dev = swap.t()[:, :, None].to(k_dev.device)  # [F, Hkv, 1]
        k_in, v_in = self._to_device(k_fetch.transpose(0, 1), v_fetch.transpose(0, 1), k_dev.device)
        storage.write(
            layer, dev_slots, torch.where(swap_dev, k_in, k_dev), torch.where(swap_dev, v_in, v_dev)
        )
        swap_host = swap[:, :, None]  # [Hkv, F, 1]
        k_out, v_out = self._to_host(k_dev.transpose(0, 1)), self._to_host(v_dev.transpose(0, 1))
        self.k[layer].scatter_(1, gather, torch.where(swap_host, k_out, k_fetch))
        self.v[layer].scatter_(1, gather, torch.where(swap_host, v_out, v_fetch))
        # Positions and H2O scores travel with their tokens.
        dev_pos = slots.positions[layer].gather(1, dev_idx).cpu()
        host_pos = self.positions[layer].gather(1, host_idx)
        slots.positions[layer].scatter_(1, dev_idx, torch.where(swap, host_pos, dev_pos).to(dev_idx.device))
        self.positions[layer].scatter_(1, host_idx, torch.where(swap, dev_pos, host_pos))
        score_idx_dev = dev_idx[:, None, :].expand(-1, group, -1)
        score_idx_host = host_idx[:, None, :].expand(-1, group, -1)
        dev_score = slots.scores[layer].gather(2, score_idx_dev).cpu()
        host_score = self.scores[layer].gather(2, score_idx_host)
        swap_score = swap[:, None, :]
        slots.scores[layer].scatter_(
            2, score_idx_dev, torch.where(swap_score, host_score, dev_score).to(dev_idx.device)
        )
        self.scores[layer].scatter_(2, score_idx_host, torch.where(swap_score, dev_score, host_score))

    def _bind(self, device: torch.device) -> None:
        """On first use: pin host memory and make a side stream when the device is CUDA."""
        if device.type == "cuda" and self._side_stream is None:
            self._pin = True
            self._side_stream = torch.cuda.Stream(device=device)
            self.counters.measured = True

    def _empty_kv(self, capacity: int) -> Tensor:
        return torch.empty(self.num_kv_heads, capacity, self.head_dim, dtype=self.dtype, pin_memory=self._pin)

    def _reserve(self, layer: int, count: int) -> None:
        capacity = self.k[layer].shape[1]
        if count <= capacity:
            return
        new_capacity = max(count, 2 * capacity, 16)
        used = self.count[layer]
        for arrays in (self.k, self.v):
            grown = self._empty_kv(new_capacity)
            grown[:, :used] = arrays[layer][:, :used]
            arrays[layer] = grown
        positions = torch.full((self.num_kv_heads, new_capacity), -1, dtype=torch.int64)
        positions[:, :used] = self.positions[layer][:, :used]
        self.positions[layer] = positions
        scores = torch.zeros(self.num_kv_heads, self.group, new_capacity)
        scores[:, :, :used] = self.scores[layer][:, :, :used]
        self.scores[layer] = scores

    def _to_host(self, x: Tensor) -> Tensor:
        """Device -> host copy; on CUDA on the side stream, timed with events."""
        if x.device.type != "cuda":
            return x.to(self.dtype)
        stream = self._side_stream
        out = torch.empty(x.shape, dtype=self.dtype, pin_memory=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            start.record(stream)
            out.copy_(x, non_blocking=True)
            end.record(stream)
        end.synchronize()  # the CPU reads the host store right after (speculation)
        self.counters.measured_copy_s += start.elapsed_time(end) / 1e3
        return out

    def _to_device(self, k: Tensor, v: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        """Host -> device copy of fetched entries; on CUDA on the side stream, and the
        compute stream waits on the copy's event (no device-wide sync)."""
        if device.type != "cuda":
            return k.to(device), v.to(device)
        stream = self._side_stream
        k_pinned, v_pinned = k.contiguous().pin_memory(), v.contiguous().pin_memory()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            start.record(stream)
            k_dev = k_pinned.to(device, non_blocking=True)
            v_dev = v_pinned.to(device, non_blocking=True)
            end.record(stream)
        torch.cuda.current_stream(device).wait_event(end)
        k_dev.record_stream(torch.cuda.current_stream(device))
        v_dev.record_stream(torch.cuda.current_stream(device))
        end.synchronize()  # elapsed_time needs both events done; the copy is tiny
        self.counters.measured_copy_s += start.elapsed_time(end) / 1e3
        return k_dev, v_dev
