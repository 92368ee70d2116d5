"""Torch paged attention (kvbench.engines.exec.attention) against a materialised dense reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import profile

from kvbench.engines.exec import attention as attn
from kvbench.engines.exec.attention import (
    DecodeWorkspace,
    contiguous_decode_attention,
    dense_attention_reference,
    paged_decode_attention,
    paged_decode_attention_blockwise,
    paged_prefill_attention,
    to_paged_cache,
    write_kv,
)

DECODE_FNS = [paged_decode_attention, paged_decode_attention_blockwise]


def make_batch(lens, kv_heads, group, head_dim, *, dtype=torch.float32, seed=0):
    """Random q [B, Hq, D] and contiguous k, v [B, max_len, Hkv, D] for the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max(lens)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(len(lens), max_len, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(lens), max_len, kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, torch.tensor(lens, dtype=torch.int32)


def reference_decode(q, k, v, lens, scale):
    """Per-sequence dense attention of one query over its first lens[b] keys -> [B, Hq, D]."""
    rows = []
    for b, n in enumerate(lens.tolist()):
        rows.append(dense_attention_reference(q[b : b + 1], k[b, :n], v[b, :n], scale, causal_offset=n - 1))
    return torch.cat(rows)


# --------------------------------------------------------------------------- write_kv
def test_write_kv_writes_exactly_the_mapped_slots():
    k_cache = torch.zeros(4, 8, 2, 3)  # 32 slots
    v_cache = torch.zeros(4, 8, 2, 3)
    k = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3) + 1
    v = -k
    slots = torch.tensor([0, 13, 31])
    write_kv(k_cache, v_cache, k, v, slots)
    flat_k = k_cache.view(32, 2, 3)
    flat_v = v_cache.view(32, 2, 3)
    assert torch.equal(flat_k[slots], k)
    assert torch.equal(flat_v[slots], v)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].abs().sum() == 0
    assert flat_v[untouched].abs().sum() == 0
    # slot 13 is block 1, offset 5
    assert torch.equal(k_cache[1, 5], k[1])


def test_write_kv_accepts_strided_inputs():
    k_cache, v_cache = torch.zeros(2, 4, 2, 4), torch.zeros(2, 4, 2, 4)
    qkv = torch.randn(3, 3, 2, 4)  # [T, (q, k, v), Hkv, D]: k and v are strided views
    write_kv(k_cache, v_cache, qkv[:, 1], qkv[:, 2], torch.tensor([7, 0, 5]))
    assert torch.equal(k_cache.view(8, 2, 4)[7], qkv[0, 1])
    assert torch.equal(v_cache.view(8, 2, 4)[5], qkv[2, 2])


@pytest.mark.parametrize(
    ("k_shape", "slots", "match"),
    [
        ((3, 2, 5), torch.tensor([0, 1, 2]), "k: expected"),
        ((3, 2, 4), torch.tensor([0, 1]), "slot_mapping: expected"),
        ((3, 2, 4), torch.tensor([0, 1, 2], dtype=torch.int32), "slot_mapping: expected int64"),
    ],
)
def test_write_kv_rejects_bad_input_naming_the_argument(k_shape, slots, match):
    k_cache, v_cache = torch.zeros(2, 4, 2, 4), torch.zeros(2, 4, 2, 4)
    with pytest.raises(ValueError, match=match):
        write_kv(k_cache, v_cache, torch.zeros(k_shape), torch.zeros(k_shape), slots)


def test_write_kv_out_of_range_slot_raises():
    k_cache, v_cache = torch.zeros(2, 4, 2, 4), torch.zeros(2, 4, 2, 4)
    with pytest.raises(IndexError):
        write_kv(k_cache, v_cache, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.tensor([8]))


# --------------------------------------------------------------------------- decode
@pytest.mark.parametrize("decode_fn", DECODE_FNS)
@pytest.mark.parametrize(
    ("kv_heads", "group"),
    [(4, 1), (2, 4), (1, 6)],
    ids=["mha", "gqa", "mqa"],
)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_decode_matches_dense_reference(decode_fn, kv_heads, group, block_size):
    lens = [1, 17, 33, 100, 2]  # odd lengths, partial last blocks, a single-token context
    q, k, v, ctx = make_batch(lens, kv_heads, group, head_dim=16)
    scale = 16**-0.5
    # NaN in every slot no sequence wrote: a gathered-but-masked slot must never reach the output.
    k_cache, v_cache, tables = to_paged_cache(
        k, v, ctx, block_size, num_blocks=200, generator=torch.Generator().manual_seed(1), fill=math.nan
    )
    out = decode_fn(q, k_cache, v_cache, tables, ctx, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out, reference_decode(q, k, v, ctx, scale), atol=2e-6, rtol=1e-5)


def test_contiguous_decode_matches_dense_reference():
    lens = [3, 40, 64]
    q, k, v, ctx = make_batch(lens, kv_heads=2, group=3, head_dim=8)
    out = contiguous_decode_attention(q, k, v, ctx, 0.3)
    torch.testing.assert_close(out, reference_decode(q, k, v, ctx, 0.3), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("decode_fn", DECODE_FNS)
def test_paged_decode_bf16_close_to_reference(decode_fn):
    q, k, v, ctx = make_batch([9, 70], kv_heads=2, group=2, head_dim=32, dtype=torch.bfloat16)
    k_cache, v_cache, tables = to_paged_cache(k, v, ctx, 16, generator=torch.Generator().manual_seed(2))
    out = decode_fn(q, k_cache, v_cache, tables, ctx, 32**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference_decode(q, k, v, ctx, 32**-0.5), atol=2e-2, rtol=2e-2)


def test_gqa_head_mapping_query_head_i_reads_kv_head_i_div_g():
    # Each KV head's V is a constant equal to its index; the output of query head i is then
    # exactly i // G whatever the scores, which pins the grouping (not i % Hkv).
    kv_heads, group, head_dim, length = 3, 4, 8, 20
    q = torch.randn(1, kv_heads * group, head_dim)
    k = torch.randn(1, length, kv_heads, head_dim)
    v = (
        torch.arange(kv_heads, dtype=torch.float32)
        .view(1, 1, kv_heads, 1)
        .expand(1, length, kv_heads, head_dim)
    )
    ctx = torch.tensor([length], dtype=torch.int32)
    k_cache, v_cache, tables = to_paged_cache(
        k, v.contiguous(), ctx, 8, generator=torch.Generator().manual_seed(0)
    )
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.5)
    expected = (torch.arange(kv_heads * group) // group).float().view(1, -1, 1).expand_as(out)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_grouped_decode_never_repeats_kv_heads(monkeypatch):
    """The proof has two halves: SDPA receives K/V with Hkv heads (spy), and SDPA itself runs
    no repeat/expand-copy op (profiler: the CPU flash kernel consumes the grouped layout)."""
    kv_heads, group, head_dim = 2, 4, 16
    q, k, v, ctx = make_batch([30, 45], kv_heads, group, head_dim)
    k_cache, v_cache, tables = to_paged_cache(k, v, ctx, 16, generator=torch.Generator().manual_seed(0))
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q_, k_, v_, **kwargs):
        seen.append((tuple(q_.shape), tuple(k_.shape), tuple(v_.shape), kwargs.get("enable_gqa", False)))
        return real_sdpa(q_, k_, v_, **kwargs)

    monkeypatch.setattr(attn.F, "scaled_dot_product_attention", spy)
    with profile() as prof:
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25)
    assert seen, "decode did not go through scaled_dot_product_attention"
    for q_shape, k_shape, v_shape, enable_gqa in seen:
        assert q_shape[1:] == (kv_heads, group, head_dim)  # G query rows per KV head
        assert k_shape[1] == kv_heads and v_shape[1] == kv_heads
        assert not enable_gqa
    op_names = {e.name for e in prof.events()}
    assert not op_names & {"aten::repeat_interleave", "aten::repeat", "aten::tile", "aten::expand_copy"}
    torch.testing.assert_close(out, reference_decode(q, k, v, ctx, 0.25), atol=2e-6, rtol=1e-5)


def test_workspace_is_reused_across_steps():
    q, k, v, ctx = make_batch([20, 50, 7], kv_heads=2, group=2, head_dim=8)
    k_cache, v_cache, tables = to_paged_cache(k, v, ctx, 4, generator=torch.Generator().manual_seed(0))
    ws = DecodeWorkspace()
    first = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.5, workspace=ws)
    assert ws.num_allocations == 2  # one K and one V buffer
    shorter = ctx - 3
    for _ in range(3):
        second = paged_decode_attention(q, k_cache, v_cache, tables, shorter, 0.5, workspace=ws)
    assert ws.num_allocations == 2
    torch.testing.assert_close(first, reference_decode(q, k, v, ctx, 0.5), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(second, reference_decode(q, k, v, shorter, 0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 3000, 1 << 30])
def test_chunking_does_not_change_results(chunk_bytes):
    # 1 byte forces one sequence per chunk; 3000 bytes a few; 1 GiB the whole batch.
    q, k, v, ctx = make_batch([5, 64, 31, 12, 40], kv_heads=2, group=2, head_dim=8)
    k_cache, v_cache, tables = to_paged_cache(
        k, v, ctx, 8, generator=torch.Generator().manual_seed(3), num_blocks=40, fill=math.nan
    )
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, ctx, 0.4, workspace=DecodeWorkspace(chunk_bytes)
    )
    torch.testing.assert_close(out, reference_decode(q, k, v, ctx, 0.4), atol=2e-6, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([4, 8, 24]),
    block_size=st.integers(1, 17),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_contiguous_property(lens, kv_heads, group, head_dim, block_size, seed):
    q, k, v, ctx = make_batch(lens, kv_heads, group, head_dim, seed=seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = to_paged_cache(
        k, v, ctx, block_size, num_blocks=num_blocks, generator=gen, fill=math.nan
    )
    scale = head_dim**-0.5
    expected = contiguous_decode_attention(q, k, v, ctx, scale)
    ws = DecodeWorkspace(chunk_bytes=512)
    torch.testing.assert_close(
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, workspace=ws),
        expected,
        atol=2e-6,
        rtol=1e-5,
    )
    torch.testing.assert_close(
        paged_decode_attention_blockwise(q, k_cache, v_cache, tables, ctx, scale, blocks_per_step=2),
        expected,
        atol=2e-6,
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"ctx": [0, 5]}, "context_lens: sequence 0 has 0 tokens"),
        ({"ctx": [5, 33]}, r"context_lens: sequence 1 has 33 tokens; must be in \[1, 32\]"),
        ({"q_heads": 3}, "q: q_heads 3 is not a multiple"),
        ({"tables_shape": (3, 4)}, "block_tables: expected"),
        ({"q_dtype": torch.float64}, "q: dtype/device"),
    ],
)
def test_decode_rejects_bad_input_naming_the_argument(change, match):
    k_cache = torch.zeros(8, 8, 2, 4)
    q = torch.zeros(2, change.get("q_heads", 4), 4, dtype=change.get("q_dtype", torch.float32))
    tables = torch.zeros(change.get("tables_shape", (2, 4)), dtype=torch.int32)
    ctx = torch.tensor(change.get("ctx", [5, 6]), dtype=torch.int32)
    for decode_fn in DECODE_FNS:
        with pytest.raises(ValueError, match=match):
            decode_fn(q, k_cache, k_cache.clone(), tables, ctx, 1.0)


# --------------------------------------------------------------------------- prefill
@pytest.mark.parametrize(("kv_heads", "group"), [(3, 1), (2, 3), (1, 4)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(("start_pos", "num_new"), [(0, 13), (16, 5), (21, 11), (7, 1)])
def test_prefill_chunk_matches_causal_reference(kv_heads, group, start_pos, num_new):
    total = start_pos + num_new
    head_dim, block_size = 8, 8
    gen = torch.Generator().manual_seed(start_pos)
    q = torch.randn(num_new, kv_heads * group, head_dim, generator=gen)
    k = torch.randn(1, total, kv_heads, head_dim, generator=gen)
    v = torch.randn(1, total, kv_heads, head_dim, generator=gen)
    k_cache, v_cache, tables = to_paged_cache(
        k, v, torch.tensor([total]), block_size, num_blocks=10, generator=gen, fill=math.nan
    )
    out = paged_prefill_attention(q, k_cache, v_cache, tables[0], start_pos, 0.35)
    expected = dense_attention_reference(q, k[0], v[0], 0.35, causal_offset=start_pos)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_prefill_in_chunks_equals_one_shot_and_last_row_equals_decode():
    kv_heads, group, head_dim, total = 2, 2, 8, 29
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(total, kv_heads * group, head_dim, generator=gen)
    k = torch.randn(1, total, kv_heads, head_dim, generator=gen)
    v = torch.randn(1, total, kv_heads, head_dim, generator=gen)
    ctx = torch.tensor([total], dtype=torch.int32)
    k_cache, v_cache, tables = to_paged_cache(k, v, ctx, 4, generator=gen)
    one_shot = paged_prefill_attention(q, k_cache, v_cache, tables[0], 0, 0.5)
    chunked = torch.cat(
        [
            paged_prefill_attention(q[a:b], k_cache, v_cache, tables[0], a, 0.5)
            for a, b in [(0, 10), (10, 11), (11, 29)]
        ]
    )
    torch.testing.assert_close(chunked, one_shot, atol=2e-6, rtol=1e-5)
    decode = paged_decode_attention(q[-1:], k_cache, v_cache, tables, ctx, 0.5)
    torch.testing.assert_close(decode, one_shot[-1:], atol=2e-6, rtol=1e-5)


def test_prefill_grouped_fallback_matches(monkeypatch):
    """torch < 2.5 has no enable_gqa: the grouped-reshape branch must give the same result."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(6, 8, 8, generator=gen)
    k = torch.randn(1, 20, 2, 8, generator=gen)
    v = torch.randn(1, 20, 2, 8, generator=gen)
    k_cache, v_cache, tables = to_paged_cache(k, v, torch.tensor([20]), 8, generator=gen)
    for start_pos, k_len in [(14, 20), (0, 6)]:
        monkeypatch.setattr(attn, "_SDPA_HAS_GQA", False)
        grouped = paged_prefill_attention(q, k_cache, v_cache, tables[0], start_pos, 0.3)
        monkeypatch.setattr(attn, "_SDPA_HAS_GQA", True)
        native = paged_prefill_attention(q, k_cache, v_cache, tables[0], start_pos, 0.3)
        expected = dense_attention_reference(q, k[0, :k_len], v[0, :k_len], 0.3, causal_offset=start_pos)
        torch.testing.assert_close(grouped, expected, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(native, expected, atol=2e-6, rtol=1e-5)


def test_prefill_never_repeats_kv_heads():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(12, 8, 16, generator=gen)
    k = torch.randn(1, 40, 2, 16, generator=gen)
    k_cache, v_cache, tables = to_paged_cache(k, k.clone(), torch.tensor([40]), 16, generator=gen)
    with profile() as prof:
        paged_prefill_attention(q, k_cache, v_cache, tables[0], 28, 0.25)
    op_names = {e.name for e in prof.events()}
    assert not op_names & {"aten::repeat_interleave", "aten::repeat", "aten::tile", "aten::expand_copy"}


def test_prefill_rejects_a_table_too_short():
    k_cache = torch.zeros(4, 4, 1, 8)
    with pytest.raises(ValueError, match="block_table: 2 blocks hold 8 tokens"):
        paged_prefill_attention(torch.zeros(3, 2, 8), k_cache, k_cache, torch.tensor([0, 1]), 6, 1.0)
