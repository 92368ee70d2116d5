"""Triton kernels for paged decode attention (split-KV flash-decoding) and KV cache writes.

Same layout and contracts as :mod:`kvbench.engines.exec.attention` (read its module docstring):
``k_cache``/``v_cache`` ``[num_blocks, block_size, Hkv, D]``, int32 block tables padded with 0,
``context_lens`` including the token being decoded.

Decode runs in two launches::

    stage 1, grid (B, Hkv, S):  program (b, h, s) walks token positions [s * T_s, (s + 1) * T_s) of
        sequence b in tiles of BLOCK_N, loading each K/V row once for all G query heads of KV
        head h (q tile [G_PAD, D] @ k tile [D, BLOCK_N] -> scores [G_PAD, BLOCK_N]), and keeps an
        online softmax; it writes the split's normalised output and log-sum-exp.
    stage 2, grid (B, Hq):      combines the S splits with their log-sum-exp weights.

Tiles are over token positions, not physical blocks: each position's block is looked up in the
block table (``block_tables[b, pos // block_size]``), so any block size works and one tile may
span several blocks. A K row is ``D`` contiguous elements, so loads stay coalesced.

``TRITON_INTERPRET=1`` runs the kernels on CPU tensors, but it must be set before ``import
triton``: Triton reads it whenever a function is decorated with ``@triton.jit``, and its own
language helpers (``tl.zeros``, ``tl.sum``, ``tl.max``) are decorated when triton is imported
(setting it later fails with "Cannot call @triton.jit'd outside of the scope of a kernel").
``import torch._dynamo`` already imports triton, so tests without CUDA run the kernels in a
child process started with the variable set (tests/test_triton_attention.py). Without triton
installed this module still imports and :func:`select_decode_backend` returns the torch path.
"""

from collections.abc import Callable

import torch

from kvbench.engines.exec.attention import (
    DecodeWorkspace,
    check_kv_cache,
    check_query,
    input_error,
    paged_decode_attention,
)

try:  # Triton is an optional dependency (the "gpu" extra); the torch path covers CPU-only installs.
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - exercised by a subprocess test
    triton = None
    tl = None

__all__ = [
    "DecodeFn",
    "default_num_splits",
    "interpreter_active",
    "select_decode_backend",
    "triton_available",
    "triton_paged_decode_attention",
    "triton_write_kv",
]

# (q, k_cache, v_cache, block_tables, context_lens, scale, *, workspace=None) -> out
DecodeFn = Callable[..., torch.Tensor]

# Token positions per split at least this many, so a split's fixed cost (q load, output write,
# reduce) stays small next to its K/V traffic.
_MIN_TOKENS_PER_SPLIT = 256
# Programs in flight to aim for: a few waves over an H100/H200's 132 SMs.
_TARGET_PROGRAMS = 4 * 132
_MAX_SPLITS = 64


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_cslot,
        stride_ch,
        stride_cd,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        H_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
    ):
        # One program per token: copy its [Hkv, D] K and V rows into the slot.
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        dst = slot * stride_cslot + h * stride_ch + d * stride_cd
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)

    @triton.jit
    def _decode_split_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        mid_o_ptr,
        mid_lse_ptr,
        scale_log2e,
        tokens_per_split,
        stride_qb,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_btb,
        stride_mob,
        stride_moh,
        stride_mos,
        stride_mlb,
        stride_mlh,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        G_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + b)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, context_len)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        n = tl.arange(0, BLOCK_N)
        q_heads = kv_head * GROUP + g  # query heads of this KV group
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        # q: [G_PAD, D_PAD], the group's query heads (padded rows are zero)
        q = tl.load(
            q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        for tile_start in range(start, end, BLOCK_N):
            pos = tile_start + n
            n_mask = pos < end
            page = tl.load(block_tables_ptr + b * stride_btb + pos // BLOCK_SIZE, mask=n_mask, other=0).to(
                tl.int64
            )
            offset = pos % BLOCK_SIZE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            # k, v: [BLOCK_N, D_PAD], one row per token position
            k = tl.load(
                k_cache_ptr
                + page[:, None] * stride_kb
                + offset[:, None] * stride_ks
                + kv_head * stride_kh
                + d[None, :] * stride_kd,
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                v_cache_ptr
                + page[:, None] * stride_vb
                + offset[:, None] * stride_vs
                + kv_head * stride_vh
                + d[None, :] * stride_vd,
                mask=kv_mask,
                other=0.0,
            )
            # s: [G_PAD, BLOCK_N] in log2 units (scale * log2(e) folded in; exp2 is the fast path)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # An empty split (start >= context_len) leaves l_i = 0: store lse = -inf so the reduce
        # gives it weight 0, and a zero output instead of 0 / 0.
        has_tokens = l_i > 0.0
        out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(
            mid_o_ptr + b * stride_mob + q_heads[:, None] * stride_moh + split * stride_mos + d[None, :],
            out,
            mask=g_mask[:, None] & d_mask[None, :],
        )
        tl.store(mid_lse_ptr + b * stride_mlb + q_heads * stride_mlh + split, lse, mask=g_mask)

    @triton.jit
    def _decode_reduce_kernel(
        mid_o_ptr,
        mid_lse_ptr,
        out_ptr,
        num_splits,
        stride_mob,
        stride_moh,
        stride_mos,
        stride_mlb,
        stride_mlh,
        stride_ob,
        stride_oh,
        stride_od,
        HEAD_DIM: tl.constexpr,
        S_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        s_mask = s < num_splits
        d_mask = d < HEAD_DIM
        # lse: [S_PAD] (log2 units), o: [S_PAD, D_PAD]
        lse = tl.load(mid_lse_ptr + b * stride_mlb + h * stride_mlh + s, mask=s_mask, other=float("-inf"))
        o = tl.load(
            mid_o_ptr + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        # Split 0 always holds token 0, so the max is finite.
        w = tl.exp2(lse - tl.max(lse, axis=0))
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + d * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=d_mask,
        )


def triton_available() -> bool:
    """True when triton imports (it may still lack a GPU driver or the interpreter)."""
    return triton is not None


def interpreter_active() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 before import)."""
    return triton is not None and isinstance(_decode_split_kernel, InterpretedFunction)


def _require_triton(*tensors: torch.Tensor) -> None:
    """Raise unless triton is installed and can run on these tensors (CUDA, or the interpreter)."""
    if triton is None:
        raise RuntimeError(
            "triton is not installed: use kvbench.engines.exec.attention (install the 'gpu' extra)"
        )
    interpret = interpreter_active()
    for t in tensors:
        if not t.is_cuda and not interpret:
            raise ValueError(
                f"Triton kernels need CUDA tensors (got a tensor on {t.device}); "
                "set TRITON_INTERPRET=1 before triton is imported to run them on CPU, or use the torch path"
            )


def _next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(1, n) - 1).bit_length())


def default_num_splits(batch: int, kv_heads: int, max_context: int) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU, >= 256 tokens per split."""
    by_occupancy = -(-_TARGET_PROGRAMS // max(1, batch * kv_heads))
    by_length = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def triton_write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton version of :func:`kvbench.engines.exec.attention.write_kv` (same contract).

    Mutates ``k_cache`` and ``v_cache``. Slots are not range-checked (that would cost a sync):
    an out-of-range slot writes out of bounds, as in vLLM's reshape_and_cache.
    """
    _, _, kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[1:] != (kv_heads, head_dim) or t.dtype != k_cache.dtype:
            input_error(
                name, f"expected [T, {kv_heads}, {head_dim}] {k_cache.dtype}, got {tuple(t.shape)} {t.dtype}"
            )
    if v.shape[0] != k.shape[0] or slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        input_error(
            "slot_mapping",
            f"expected int64 [T={k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}",
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        input_error("k_cache", "must be contiguous (pass kv[layer, 0] of the pool, not a strided slice)")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _require_triton(k_cache, k, slot_mapping)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        kv_heads * head_dim,  # slot stride of the contiguous cache viewed as [slots, Hkv, D]
        head_dim,
        1,
        NUM_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        H_PAD=_next_pow2(kv_heads),
        D_PAD=_next_pow2(head_dim),
    )


def triton_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    workspace: DecodeWorkspace | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`kvbench.engines.exec.attention.paged_decode_attention` (same contract).

    Mutates only ``workspace`` buffers (split outputs and log-sum-exps). ``num_splits`` overrides
    :func:`default_num_splits`. Shapes and dtypes are validated; context_lens values are not (no
    host sync): each must be in [1, max_blocks_per_seq * block_size]. Softmax runs in fp32.
    """
    _, block_size, kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    group = check_query(q, "q", kv_heads, head_dim, k_cache)
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        input_error(
            "block_tables",
            f"expected int32 [batch={batch}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}",
        )
    if context_lens.shape != (batch,) or context_lens.dtype != torch.int32:
        input_error(
            "context_lens",
            f"expected int32 [batch={batch}], got {context_lens.dtype} {tuple(context_lens.shape)}",
        )
    if num_splits is not None and num_splits <= 0:
        input_error("num_splits", f"must be > 0, got {num_splits}")
    _require_triton(q, k_cache, block_tables, context_lens)
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        input_error("k_cache", "head_dim must be the innermost, contiguous dimension")

    q_heads = kv_heads * group
    # Upper bound from the table's width, so no host sync on context_lens.
    max_context = block_tables.shape[1] * block_size
    splits = num_splits if num_splits is not None else default_num_splits(batch, kv_heads, max_context)
    block_n = 64 if head_dim <= 128 else 32
    tokens_per_split = -(-max_context // splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n  # whole tiles per split

    ws = workspace if workspace is not None else DecodeWorkspace()
    # mid_o: [B, Hq, S, D] per-split normalised outputs; mid_lse: [B, Hq, S] (log2 units)
    mid_o = ws.buffer("mid_o", batch * q_heads * splits * head_dim, torch.float32, q.device)
    mid_o = mid_o.view(batch, q_heads, splits, head_dim)
    mid_lse = ws.buffer("mid_lse", batch * q_heads * splits, torch.float32, q.device).view(
        batch, q_heads, splits
    )
    out = torch.empty_like(q)

    d_pad = _next_pow2(head_dim, 16)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        mid_o,
        mid_lse,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        tokens_per_split,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *mid_o.stride()[:3],
        *mid_lse.stride()[:2],
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        G_PAD=_next_pow2(group, 16),  # tl.dot needs >= 16 rows; padded rows are masked
        D_PAD=d_pad,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    _decode_reduce_kernel[(batch, q_heads)](
        mid_o,
        mid_lse,
        out,
        splits,
        *mid_o.stride()[:3],
        *mid_lse.stride()[:2],
        *out.stride(),
        HEAD_DIM=head_dim,
        S_PAD=_next_pow2(splits),
        D_PAD=d_pad,
        num_warps=4,
    )
    return out


def select_decode_backend(device: str, prefer: str = "auto") -> DecodeFn:
    """The decode function to use on ``device`` ("cpu", "cuda", "cuda:1", ...).

    prefer: "auto" (Triton on CUDA when triton imports, torch otherwise), "torch", or "triton"
    (raises RuntimeError when triton is missing, ValueError when the device is not CUDA and
    TRITON_INTERPRET is unset). Both returned functions share the signature
    ``(q, k_cache, v_cache, block_tables, context_lens, scale, *, workspace=None)``.
    """
    if prefer not in ("auto", "torch", "triton"):
        input_error("prefer", f"expected 'auto', 'torch' or 'triton', got {prefer!r}")
    is_cuda = torch.device(device).type == "cuda"
    if prefer == "torch":
        return paged_decode_attention
    if prefer == "triton":
        if triton is None:
            raise RuntimeError("prefer='triton': triton is not installed (install the 'gpu' extra)")
        if not is_cuda and not interpreter_active():
            input_error(
                "device", f"prefer='triton' needs a CUDA device or TRITON_INTERPRET=1, got {device!r}"
            )
        return triton_paged_decode_attention
    return triton_paged_decode_attention if is_cuda and triton is not None else paged_decode_attention
