"""Triton paged decode and cache-write kernels against the torch path.

Where the kernels run:
- with CUDA, on the GPU (fp32, fp16, bf16);
- without CUDA, in Triton's CPU interpreter, which needs TRITON_INTERPRET=1 *before* triton is
  imported (triton decorates tl.zeros / tl.sum / tl.max at import). Earlier imports in the same
  pytest session (torch._dynamo, engines) usually import triton first, so then
  ``test_kernels_in_interpreter_child`` reruns this file in one child process started with the
  variable set, and the in-process kernel tests are skipped with a reason that says so. Running
  the whole suite with TRITON_INTERPRET=1 exported runs them in-process instead.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbench.engines.exec import triton_attention as ta
from kvbench.engines.exec.attention import (
    DecodeWorkspace,
    dense_attention_reference,
    paged_decode_attention,
    to_paged_cache,
    write_kv,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
CHILD_ENV = "KVBENCH_TRITON_INTERPRETER_CHILD"
# fp32: the interpreter computes like torch on CPU; GPU kernels may order sums differently.
FP32_ATOL = 1e-5 if HAS_CUDA else 2e-6
KERNELS_RUN_HERE = ta.triton_available() and (HAS_CUDA or ta.interpreter_active())

needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN_HERE,
    reason="no CUDA and triton was imported without TRITON_INTERPRET=1: "
    "these run in a child process (test_kernels_in_interpreter_child)",
)
needs_triton = pytest.mark.skipif(not ta.triton_available(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def make_case(lens, kv_heads, group, head_dim, block_size, *, dtype=torch.float32, seed=0):
    """q [B, Hq, D], paged caches (NaN in unwritten slots), tables, lengths, and the contiguous k, v."""
    gen = torch.Generator().manual_seed(seed)
    batch, max_len = len(lens), max(lens)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, max_len, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, max_len, kv_heads, head_dim, generator=gen).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k_cache, v_cache, tables = to_paged_cache(
        k, v, ctx, block_size, num_blocks=num_blocks, generator=gen, fill=math.nan
    )
    to = {"device": DEVICE}
    return q.to(**to), k_cache.to(**to), v_cache.to(**to), tables.to(**to), ctx.to(**to), k, v


# --------------------------------------------------------------------------- kernels
@needs_kernels
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (2, 4), (1, 5)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [3, 16, 32])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_triton_decode_matches_torch(kv_heads, group, block_size, num_splits):
    lens = [1, 17, 64, 100]  # odd lengths; with 3 splits some splits hold no tokens at all
    q, k_cache, v_cache, tables, ctx, _, _ = make_case(lens, kv_heads, group, 16, block_size)
    scale = 16**-0.5
    out = ta.triton_paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=num_splits)
    expected = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, expected, atol=FP32_ATOL, rtol=1e-5)


@needs_kernels
def test_triton_decode_matches_dense_reference_with_padded_head_dim():
    # head_dim 24 is not a power of two: the kernel pads D to 32 and masks.
    q, k_cache, v_cache, tables, ctx, k, v = make_case([5, 40], 2, 2, 24, 8, seed=4)
    out = ta.triton_paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, num_splits=2)
    expected = torch.cat(
        [
            dense_attention_reference(q[b : b + 1].cpu(), k[b, :n], v[b, :n], 0.2, n - 1)
            for b, n in enumerate([5, 40])
        ]
    )
    torch.testing.assert_close(out.cpu(), expected, atol=FP32_ATOL, rtol=1e-5)


@needs_kernels
def test_triton_decode_reuses_workspace():
    q, k_cache, v_cache, tables, ctx, _, _ = make_case([9, 30], 2, 2, 16, 16)
    ws = DecodeWorkspace()
    first = ta.triton_paged_decode_attention(
        q, k_cache, v_cache, tables, ctx, 0.25, workspace=ws, num_splits=2
    )
    second = ta.triton_paged_decode_attention(
        q, k_cache, v_cache, tables, ctx, 0.25, workspace=ws, num_splits=2
    )
    assert ws.num_allocations == 2  # mid_o and mid_lse, once
    torch.testing.assert_close(first, second, atol=0, rtol=0)


@needs_kernels
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 8), (3, 20)])
def test_triton_write_kv_matches_torch(kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 3, kv_heads, head_dim, generator=gen).to(DEVICE)  # k, v: strided views
    slots = torch.tensor([0, 7, 8, 23, 30], device=DEVICE)
    caches = [torch.zeros(4, 8, kv_heads, head_dim, device=DEVICE) for _ in range(4)]
    ta.triton_write_kv(caches[0], caches[1], qkv[:, 1], qkv[:, 2], slots)
    write_kv(caches[2], caches[3], qkv[:, 1], qkv[:, 2], slots)
    assert torch.equal(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])


def test_child_process_runs_the_kernels():
    """In the interpreter child, the kernel tests must run, not skip (else the parent proves nothing)."""
    if os.environ.get(CHILD_ENV) != "1":
        pytest.skip("only meaningful inside the interpreter child process")
    assert KERNELS_RUN_HERE


@needs_triton
@pytest.mark.skipif(KERNELS_RUN_HERE, reason="kernels already run in this process")
def test_kernels_in_interpreter_child():
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD_ENV: "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        __file__,
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "not interpreter_child and not without_triton",
    ]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"interpreter child failed:\n{report}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 20, f"interpreter child ran too few tests:\n{report}"


# --------------------------------------------------------------------------- GPU-only dtypes and sizes
@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_decode_half_precision_on_gpu(dtype, block_size):
    lens = [4096, 1, 3000, 777] * 4
    q, k_cache, v_cache, tables, ctx, _, _ = make_case(lens, 8, 4, 128, block_size, dtype=dtype, seed=1)
    out = ta.triton_paged_decode_attention(q, k_cache, v_cache, tables, ctx, 128**-0.5)
    expected = paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, ctx, 128**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------- selection and import
def test_select_decode_backend_cpu_and_torch_preference():
    assert ta.select_decode_backend("cpu") is paged_decode_attention
    assert ta.select_decode_backend("cuda", prefer="torch") is paged_decode_attention
    assert ta.select_decode_backend("cuda:0", prefer="torch") is paged_decode_attention


@needs_triton
def test_select_decode_backend_prefers_triton_on_cuda():
    assert ta.select_decode_backend("cuda") is ta.triton_paged_decode_attention
    assert ta.select_decode_backend("cuda:1", prefer="triton") is ta.triton_paged_decode_attention


def test_select_decode_backend_rejects_unknown_preference():
    with pytest.raises(ValueError, match="prefer: expected 'auto', 'torch' or 'triton'"):
        ta.select_decode_backend("cpu", prefer="flashinfer")


@needs_triton
@pytest.mark.skipif(ta.interpreter_active(), reason="the interpreter runs Triton on CPU")
def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    with pytest.raises(ValueError, match="device: prefer='triton' needs a CUDA device"):
        ta.select_decode_backend("cpu", prefer="triton")
    if not HAS_CUDA:
        q, k_cache, v_cache, tables, ctx, _, _ = make_case([3], 1, 1, 8, 4)
        with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
            ta.triton_paged_decode_attention(q, k_cache, v_cache, tables, ctx, 1.0)


@pytest.mark.parametrize(
    ("tables_dtype", "ctx_dtype", "match"),
    [(torch.int64, torch.int32, "block_tables: expected int32"), (torch.int32, torch.int64, "context_lens")],
)
def test_triton_decode_validates_before_launch(tables_dtype, ctx_dtype, match):
    k_cache = torch.zeros(4, 4, 1, 8)
    q = torch.zeros(2, 2, 8)
    tables = torch.zeros(2, 2, dtype=tables_dtype)
    ctx = torch.ones(2, dtype=ctx_dtype)
    with pytest.raises(ValueError, match=match):
        ta.triton_paged_decode_attention(q, k_cache, k_cache, tables, ctx, 1.0)


def test_default_num_splits_fills_the_gpu_but_keeps_splits_long():
    assert ta.default_num_splits(batch=1, kv_heads=8, max_context=8192) == 32  # 8192 / 256 tokens
    assert ta.default_num_splits(batch=64, kv_heads=8, max_context=8192) == 2  # 1024 programs already
    assert ta.default_num_splits(batch=4, kv_heads=2, max_context=100) == 1  # too short to split


def test_module_imports_and_falls_back_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "from kvbench.engines.exec import triton_attention as ta\n"
        "from kvbench.engines.exec.attention import paged_decode_attention\n"
        "assert not ta.triton_available()\n"
        "assert ta.select_decode_backend('cuda') is paged_decode_attention\n"
        "try:\n"
        "    ta.select_decode_backend('cuda', prefer='triton')\n"
        "except RuntimeError as e:\n"
        "    assert 'triton is not installed' in str(e)\n"
        "else:\n"
        "    raise AssertionError('prefer=triton without triton must raise')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
