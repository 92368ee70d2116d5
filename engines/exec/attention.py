"""Attention over a paged KV cache in plain torch (CPU and CUDA).

The engine's KV pool is one tensor ``kv: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``;
layer ``l`` passes ``k_cache = kv[l, 0]`` and ``v_cache = kv[l, 1]``. A token's physical slot is
``block * block_size + offset``; ``block_tables`` maps each sequence's logical blocks to physical ones::

    logical positions   0 .. 15 | 16 .. 31 | 32 .. 36
    block_tables[b]     [   7   ,    2    ,    9    , 0, 0 ]   (padded with 0)
    context_lens[b]     37      (includes the token being decoded: its K/V is written first)

Grouped-query attention never repeats K/V heads: query head ``i`` reads KV head ``i // G``, so
``q: [B, Hq, D]`` is viewed as ``[B, Hkv, G, D]`` and the G heads of a group become G query *rows*
against that group's single K/V head.

Decode on CPU (``paged_decode_attention``) gathers the blocks of a few sequences at a time into a
reused :class:`DecodeWorkspace` sized to stay in the CPU cache, then runs one fused
``scaled_dot_product_attention`` (the same kernel the contiguous baseline uses) while the gathered
K/V is still hot. The alternative, a blockwise online-softmax loop over the whole batch
(``paged_decode_attention_blockwise``), is kept because it is the torch mirror of the Triton
split-KV kernel; on CPU it measured 2.6-14x the contiguous time against 1.1-1.7x for the gather
(batch 16, context 1K/2K; numbers in tests/benchmarks/bench_attention.py), so the gather is the
default.
"""

from __future__ import annotations

import math
from typing import NoReturn

import torch
import torch.nn.functional as F

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DecodeWorkspace",
    "contiguous_decode_attention",
    "dense_attention_reference",
    "paged_decode_attention",
    "paged_decode_attention_blockwise",
    "paged_prefill_attention",
    "to_paged_cache",
    "write_kv",
]

# Gathered K+V bytes per CPU decode chunk: a few MiB stays in L2/L3 between the gather and the
# attention read, which is what keeps paged decode close to contiguous (see the module docstring).
DEFAULT_CHUNK_BYTES = 4 << 20

# torch >= 2.5 takes enable_gqa in scaled_dot_product_attention (CPU flash kernel handles it
# without repeating K/V heads); older versions get the grouped reshape.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


class DecodeWorkspace:
    """Scratch buffers kept across decode steps so the hot path does not allocate.

    Buffers are flat, keyed by name, and grow on demand (never shrink); a request with another
    dtype or device replaces the buffer. ``num_allocations`` counts real allocations (tests use
    it to check reuse). Not thread-safe: one workspace per engine / stream.

    ``chunk_bytes`` caps the gathered K+V bytes per chunk of sequences on CPU (at least one
    sequence per chunk, whatever its size); must be > 0.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"DecodeWorkspace.chunk_bytes: must be > 0, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.num_allocations = 0
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of exactly ``numel`` elements (uninitialised), backed by buffer ``name``.

        Mutates the workspace only when the buffer must grow or change dtype/device. The returned
        view aliases earlier views of the same name: use it before asking for that name again.
        """
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
            self.num_allocations += 1
        return buf[:numel]

    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


# --------------------------------------------------------------------------- validation
def input_error(field: str, message: str) -> NoReturn:
    """Raise the ValueError every check here raises: ``"<argument>: <what is wrong>"``."""
    raise ValueError(f"{field}: {message}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a layer's cache pair; returns (num_blocks, block_size, kv_heads, head_dim)."""
    if k_cache.dim() != 4:
        input_error(
            "k_cache",
            f"expected [num_blocks, block_size, kv_heads, head_dim], got shape {tuple(k_cache.shape)}",
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        input_error(
            "v_cache",
            f"must match k_cache (shape {tuple(k_cache.shape)}, {k_cache.dtype}, {k_cache.device}); "
            f"got {tuple(v_cache.shape)}, {v_cache.dtype}, {v_cache.device}",
        )
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, kv_heads, head_dim


def check_query(q: torch.Tensor, q_field: str, kv_heads: int, head_dim: int, cache: torch.Tensor) -> int:
    """Validate a [N, Hq, D] query against the cache; returns the group size G = Hq // Hkv."""
    if q.dim() != 3:
        input_error(q_field, f"expected [tokens, q_heads, head_dim], got shape {tuple(q.shape)}")
    if q.shape[2] != head_dim:
        input_error(q_field, f"head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if q.shape[1] % kv_heads != 0:
        input_error(q_field, f"q_heads {q.shape[1]} is not a multiple of the cache's kv_heads {kv_heads}")
    if q.dtype != cache.dtype or q.device != cache.device:
        input_error(q_field, f"dtype/device {q.dtype}/{q.device} != cache {cache.dtype}/{cache.device}")
    return q.shape[1] // kv_heads


def _check_decode_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, batch: int, block_size: int
) -> list[int]:
    """Validate block tables / lengths; returns context_lens as a Python list (syncs on CUDA)."""
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        input_error(
            "block_tables",
            f"expected [batch={batch}, max_blocks_per_seq], got shape {tuple(block_tables.shape)}",
        )
    if block_tables.dtype not in (torch.int32, torch.int64):
        input_error("block_tables", f"expected an integer tensor (int32), got {block_tables.dtype}")
    if context_lens.shape != (batch,):
        input_error("context_lens", f"expected [batch={batch}], got shape {tuple(context_lens.shape)}")
    lens = [int(n) for n in context_lens.tolist()]
    capacity = block_tables.shape[1] * block_size
    for b, n in enumerate(lens):
        if not 1 <= n <= capacity:
            input_error(
                "context_lens",
                f"sequence {b} has {n} tokens; must be in [1, {capacity}] "
                f"(max_blocks_per_seq {block_tables.shape[1]} x block_size {block_size})",
            )
    return lens


# --------------------------------------------------------------------------- cache writes
def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token t's K/V into physical slot ``slot_mapping[t]`` of this layer's caches.

    k, v: [T, kv_heads, head_dim] (any strides); slot_mapping: int64 [T], slot = block * block_size
    + offset. Mutates ``k_cache`` and ``v_cache`` in place (they must be contiguous, as ``kv[l, 0]``
    is). Raises ValueError on shape/dtype mismatch; an out-of-range slot raises IndexError on CPU
    (a device-side assert on CUDA, where checking values would cost a sync).
    """
    _, _, kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[1:] != (kv_heads, head_dim):
            input_error(name, f"expected [T, {kv_heads}, {head_dim}], got shape {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            input_error(name, f"dtype {t.dtype} != cache dtype {k_cache.dtype}")
    if v.shape[0] != k.shape[0] or slot_mapping.shape != (k.shape[0],):
        input_error(
            "slot_mapping", f"expected [T={k.shape[0]}] matching k and v, got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64:
        input_error("slot_mapping", f"expected int64, got {slot_mapping.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        input_error("k_cache", "must be contiguous (pass kv[layer, 0] of the pool, not a strided slice)")
    # k_slots: [num_blocks * block_size, kv_heads, head_dim], a view of the cache
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


# --------------------------------------------------------------------------- decode
def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    workspace: DecodeWorkspace | None = None,
) -> torch.Tensor:
    """One decode token per sequence attending to its whole paged context.

    q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: int32
    [B, max_blocks_per_seq] (0-padded); context_lens: int32 [B], tokens cached including this one.
    Returns out [B, Hq, D] in q's dtype. Mutates only ``workspace`` buffers (a temporary workspace
    is used when None; pass one to reuse buffers across steps). Raises ValueError naming the
    argument on bad shapes, dtypes or lengths (reads context_lens on the host: a sync on CUDA).

    CPU: sequences are processed in chunks whose gathered K+V fits ``workspace.chunk_bytes``; on
    other devices the whole batch is one chunk.
    """
    _, block_size, kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    group = check_query(q, "q", kv_heads, head_dim, k_cache)
    batch = q.shape[0]
    lens = _check_decode_tables(block_tables, context_lens, batch, block_size)
    ws = workspace if workspace is not None else DecodeWorkspace()

    token_bytes = 2 * kv_heads * head_dim * k_cache.element_size()
    if q.device.type == "cpu":
        max_len = max(lens)
        seqs_per_chunk = max(1, min(batch, ws.chunk_bytes // (token_bytes * max_len)))
    else:
        seqs_per_chunk = batch

    qg = q.reshape(batch, kv_heads, group, head_dim)  # qg: [B, Hkv, G, D] (G query rows per KV head)
    out = torch.empty_like(qg)  # out: [B, Hkv, G, D]
    for b0 in range(0, batch, seqs_per_chunk):
        b1 = min(batch, b0 + seqs_per_chunk)
        n = b1 - b0
        chunk_len = max(lens[b0:b1])
        num_chunk_blocks = -(-chunk_len // block_size)
        padded_len = num_chunk_blocks * block_size
        idx = block_tables[b0:b1, :num_chunk_blocks].reshape(-1).long()
        numel = n * padded_len * kv_heads * head_dim
        # k, v: [n, padded_len, Hkv, D], gathered blocks in logical order
        k = ws.buffer("k", numel, k_cache.dtype, k_cache.device).view(
            n * num_chunk_blocks, block_size, kv_heads, head_dim
        )
        v = ws.buffer("v", numel, v_cache.dtype, v_cache.device).view(
            n * num_chunk_blocks, block_size, kv_heads, head_dim
        )
        torch.index_select(k_cache, 0, idx, out=k)
        torch.index_select(v_cache, 0, idx, out=v)
        k = k.view(n, padded_len, kv_heads, head_dim)
        v = v.view(n, padded_len, kv_heads, head_dim)
        # Slots past a sequence's length hold whatever the pool had (maybe NaN from torch.empty):
        # masking scores is not enough, since 0 * NaN in p @ v is NaN, so zero them.
        for i, length in enumerate(lens[b0:b1]):
            if length < padded_len:
                k[i, length:] = 0
                v[i, length:] = 0
        out[b0:b1] = _grouped_decode_sdpa(qg[b0:b1], k, v, lens[b0:b1], padded_len, scale)
    return out.view(batch, kv_heads * group, head_dim)


def _grouped_decode_sdpa(
    qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], padded_len: int, scale: float
) -> torch.Tensor:
    """qg: [n, Hkv, G, D]; k, v: [n, L, Hkv, D] -> [n, Hkv, G, D]; keys at positions >= lens[b] masked.

    K/V go in as [n, Hkv, L, D] strided views (no copy, no repeated heads).
    """
    mask = None
    if any(n != padded_len for n in lens):
        lens_t = torch.tensor(lens, device=k.device)
        # mask: [n, 1, 1, L], True where the key is part of the context
        mask = (torch.arange(padded_len, device=k.device)[None, :] < lens_t[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )


def paged_decode_attention_blockwise(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    blocks_per_step: int = 8,
) -> torch.Tensor:
    """Same contract as :func:`paged_decode_attention`, computed by online softmax over the batch.

    Each step gathers ``blocks_per_step`` logical blocks of every sequence, scores them in fp32
    and folds them into a running (max, sum, accumulator): the flash-decoding recurrence the Triton
    kernel uses per split. Allocates per step; mutates nothing. Slower than the gather on CPU.
    """
    if blocks_per_step <= 0:
        input_error("blocks_per_step", f"must be > 0, got {blocks_per_step}")
    _, block_size, kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    group = check_query(q, "q", kv_heads, head_dim, k_cache)
    batch = q.shape[0]
    lens = _check_decode_tables(block_tables, context_lens, batch, block_size)
    num_blocks_needed = -(-max(lens) // block_size)
    lens_t = torch.tensor(lens, device=q.device)

    qg = q.reshape(batch, kv_heads, group, head_dim).float() * scale  # qg: [B, Hkv, G, D]
    m = torch.full((batch, kv_heads, group, 1), -math.inf, device=q.device)  # running max
    denom = torch.zeros((batch, kv_heads, group, 1), device=q.device)  # running sum of exp
    acc = torch.zeros((batch, kv_heads, group, head_dim), device=q.device)  # running sum of p * v
    for j0 in range(0, num_blocks_needed, blocks_per_step):
        j1 = min(num_blocks_needed, j0 + blocks_per_step)
        idx = block_tables[:, j0:j1].reshape(-1).long()
        # k, v: [B, C, Hkv, D] for logical positions [j0 * block_size, j1 * block_size)
        k = k_cache.index_select(0, idx).view(batch, -1, kv_heads, head_dim).float()
        v = v_cache.index_select(0, idx).view(batch, -1, kv_heads, head_dim).float()
        pos = torch.arange(j0 * block_size, j1 * block_size, device=q.device)
        invalid = pos[None, :] >= lens_t[:, None]  # invalid: [B, C], slots past the length
        v = v.masked_fill(invalid[:, :, None, None], 0.0)  # unwritten slots may hold NaN; 0 * NaN = NaN
        s = torch.matmul(qg, k.permute(0, 2, 3, 1))  # s: [B, Hkv, G, C]
        s = s.masked_fill(invalid[:, None, None, :], -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        # A sequence already past its length has m_new = -inf; shift by 0 there to avoid inf - inf.
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - shift)
        correction = torch.exp(m - shift)
        denom = denom * correction + p.sum(-1, keepdim=True)
        acc = acc * correction + torch.matmul(p, v.transpose(1, 2))
        m = m_new
    return (acc / denom).to(q.dtype).view(batch, kv_heads * group, head_dim)


def contiguous_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Baseline: decode over per-sequence contiguous caches (the gpt-fast layout, no paging).

    q: [B, Hq, D]; k, v: [B, max_len, Hkv, D]; context_lens: int [B] (keys at positions >= the
    length are ignored, but must be finite). Returns [B, Hq, D]. Same grouped SDPA as the paged path, so the two differ
    only by the gather. Mutates nothing; raises ValueError naming the argument on bad shapes.
    """
    if k.dim() != 4 or v.shape != k.shape:
        input_error(
            "k",
            f"expected k and v [B, max_len, Hkv, D] of equal shape, got {tuple(k.shape)} / {tuple(v.shape)}",
        )
    batch, max_len, kv_heads, head_dim = k.shape
    group = check_query(q, "q", kv_heads, head_dim, k)
    if q.shape[0] != batch:
        input_error("q", f"batch {q.shape[0]} != k batch {batch}")
    if context_lens.shape != (batch,):
        input_error("context_lens", f"expected [batch={batch}], got shape {tuple(context_lens.shape)}")
    lens = [int(n) for n in context_lens.tolist()]
    if not all(1 <= n <= max_len for n in lens):
        input_error("context_lens", f"every length must be in [1, {max_len}], got {lens}")
    qg = q.reshape(batch, kv_heads, group, head_dim)
    out = _grouped_decode_sdpa(qg, k, v, lens, max_len, scale)
    return out.reshape(batch, kv_heads * group, head_dim)


# --------------------------------------------------------------------------- prefill
def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention for one sequence's prefill chunk over its paged cache.

    q: [T, Hq, D] for positions [start_pos, start_pos + T); the K/V of positions
    [0, start_pos + T) (cached prefix plus this chunk) must already be written. block_table: int
    [max_blocks] of this sequence. Returns [T, Hq, D]. Mutates nothing; allocates the gathered
    K/V ([start_pos + T, Hkv, D] each). Raises ValueError naming the argument on bad input.
    """
    _, block_size, kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    group = check_query(q, "q", kv_heads, head_dim, k_cache)
    num_new = q.shape[0]
    if start_pos < 0:
        input_error("start_pos", f"must be >= 0, got {start_pos}")
    if block_table.dim() != 1:
        input_error(
            "block_table", f"expected one sequence's table [max_blocks], got shape {tuple(block_table.shape)}"
        )
    total = start_pos + num_new
    num_blocks = -(-total // block_size)
    if num_blocks > block_table.shape[0]:
        input_error(
            "block_table",
            f"{block_table.shape[0]} blocks hold {block_table.shape[0] * block_size} tokens; "
            f"start_pos {start_pos} + {num_new} new tokens need {num_blocks}",
        )
    idx = block_table[:num_blocks].long()
    # k, v: [total, Hkv, D] in logical order
    k = k_cache.index_select(0, idx).view(-1, kv_heads, head_dim)[:total]
    v = v_cache.index_select(0, idx).view(-1, kv_heads, head_dim)[:total]
    mask = None
    if start_pos > 0:
        # Query t sits at position start_pos + t and sees keys 0 .. start_pos + t (bottom-right causal).
        q_pos = torch.arange(start_pos, total, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]  # mask: [T, total]

    if _SDPA_HAS_GQA:
        # 4-D inputs: the CPU flash kernel only takes [batch, heads, len, D]; 3-D inputs fall back
        # to the math kernel, which repeats K/V heads for GQA.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, Hq, T, D]
            k.transpose(0, 1)[None],  # [1, Hkv, total, D]
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )  # out: [1, Hq, T, D]
        return out[0].transpose(0, 1)
    # Grouped reshape: the G heads of a group become G * T query rows against one K/V head.
    qg = (
        q.view(num_new, kv_heads, group, head_dim)
        .permute(1, 2, 0, 3)
        .reshape(kv_heads, group * num_new, head_dim)
    )
    if mask is None:
        mask = torch.ones(num_new, total, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(
        qg[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask.repeat(group, 1),
        scale=scale,
    )[0]  # out: [Hkv, G * T, D]
    return (
        out.view(kv_heads, group, num_new, head_dim)
        .permute(2, 0, 1, 3)
        .reshape(num_new, kv_heads * group, head_dim)
    )


# --------------------------------------------------------------------------- layouts and reference
def to_paged_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    *,
    num_blocks: int | None = None,
    generator: torch.Generator | None = None,
    fill: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy a contiguous batch cache into a fresh paged one with shuffled blocks (tests, benchmarks).

    k, v: [B, max_len, Hkv, D]; the first ``context_lens[b]`` positions of sequence b are copied.
    Returns (k_cache, v_cache, block_tables): caches [num_blocks, block_size, Hkv, D] filled with
    ``fill`` outside the written slots (NaN proves unwritten slots never leak into results), and
    int32 block tables [B, ceil(max_len / block_size)] padded with 0. Physical blocks are a random
    permutation (seeded by ``generator``), so logical neighbours are not physical neighbours.
    Raises ValueError when ``num_blocks`` is too small. Mutates nothing it was given.
    """
    batch, max_len, kv_heads, head_dim = k.shape
    lens = [int(n) for n in context_lens.tolist()]
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_needed = sum(blocks_per_seq)
    num_blocks = num_needed if num_blocks is None else num_blocks
    if num_blocks < num_needed:
        input_error("num_blocks", f"{num_blocks} blocks cannot hold {num_needed} blocks of context")
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), fill, dtype=k.dtype, device=k.device)
    v_cache = torch.full_like(k_cache, fill)
    block_tables = torch.zeros(batch, -(-max_len // block_size), dtype=torch.int32)
    physical = torch.randperm(num_blocks, generator=generator)[:num_needed].tolist()
    for b, n in enumerate(lens):
        mine, physical = physical[: blocks_per_seq[b]], physical[blocks_per_seq[b] :]
        block_tables[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        pos = torch.arange(n)
        slots = torch.tensor(mine, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        write_kv(k_cache, v_cache, k[b, :n], v[b, :n], slots.to(k.device))
    return k_cache, v_cache, block_tables.to(k.device)


# --------------------------------------------------------------------------- reference
def dense_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int
) -> torch.Tensor:
    """Textbook attention in float64 with materialised repeated K/V heads (tests only).

    q: [T, Hq, D]; k, v: [L, Hkv, D]; query t sees keys 0 .. causal_offset + t (decode: T = 1,
    causal_offset = L - 1). Returns [T, Hq, D] in q's dtype. Mutates nothing.
    """
    num_q, q_heads, _ = q.shape
    group = q_heads // k.shape[1]
    kr = k.double().repeat_interleave(group, dim=1)  # kr: [L, Hq, D]
    vr = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.double(), kr) * scale  # scores: [Hq, T, L]
    visible = torch.arange(k.shape[0])[None, :] <= (causal_offset + torch.arange(num_q))[:, None]
    scores = scores.masked_fill(~visible.to(q.device), -math.inf)
    out = torch.einsum("htl,lhd->thd", scores.softmax(-1), vr)
    return out.to(q.dtype)
