"""Paged vs contiguous decode attention: ratios from interleaved pairs, never asserted as times.

CPU (project target: paged <= 1.5x contiguous; batch 16, context 1K and 2K, fp32,
single-threaded torch)::

    pytest tests/benchmarks/bench_attention.py -m "not gpu" --benchmark-enable -o python_files='bench_*.py' -s

GPU (target: Triton paged within 15 % of contiguous and >= 70 % of HBM bandwidth at batch >= 16,
context >= 4K; bf16, CUDA-event timing after warm-up)::

    pytest tests/benchmarks/bench_attention.py -m gpu --benchmark-enable -o python_files='bench_*.py' -s

On the CPU, each paged implementation and the contiguous baseline are called in interleaved
rounds (tests/benchmarks/rounds.py; wall time, ``time.perf_counter``, since the kernels are
the point), so a noisy neighbour slows both sides of a pair alike; the figure is the median
of the per-pair ratios paged / contiguous, with min and max. Paged attention does strictly
more work than contiguous attention over the same keys and values (a gather through the
block table, or a blockwise online softmax), so a median ratio below 1.0 cannot be true:
the benchmark fails, calling it a measurement error, rather than report it.

Measured on the 2-core machine (fp32, 1 thread, block size 16, load average 3.6-4.1 from
other jobs), paged / contiguous, min / median / max over 10 pairs (5 for blockwise 7b-layer):

    shape (Hkv, G, D)     context   gather (default)      blockwise online softmax
    tiny-gqa (2, 4, 32)   1024      1.57 / 2.13 / 2.66       3.31 / 5.67 / 7.98
    tiny-gqa (2, 4, 32)   2048      1.74 / 2.28 / 3.23       3.18 / 5.78 / 9.18
    7b-layer (8, 4, 128)  1024      1.36 / 1.50 / 1.70       4.08 / 4.80 / 5.44
    7b-layer (8, 4, 128)  2048      1.18 / 1.34 / 1.41       3.07 / 3.76 / 7.81

GPU: not yet measured (no GPU in the session that wrote this).

Each test prints one line (also stored in the benchmark's extra_info).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest
import torch
from rounds import Rounds, num_rounds_from_env, run_rounds

from kvbench.engines.exec.attention import (
    DecodeWorkspace,
    contiguous_decode_attention,
    paged_decode_attention,
    paged_decode_attention_blockwise,
    to_paged_cache,
)

# name: (kv_heads, group, head_dim)
SHAPES = {"tiny-gqa": (2, 4, 32), "7b-layer": (8, 4, 128)}
# Kernel calls per timed sample: a tiny-gqa call takes about a millisecond, shorter than a
# shared machine's hiccups, so its samples repeat it to tens of milliseconds.
CALLS_PER_SAMPLE = {"tiny-gqa": 10, "7b-layer": 1}
BATCH = 16
BLOCK_SIZE = 16
# Spec HBM bandwidth by device-name fragment, GB/s (field notes section 9).
PEAK_HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def make_decode_case(batch, context, kv_heads, group, head_dim, dtype, device, seed=0):
    """Equal-length batch in both layouts: (q, k, v contiguous, k_cache, v_cache, tables, lens)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, context, kv_heads, head_dim)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    block_order = torch.Generator().manual_seed(seed)  # randperm of physical blocks runs on the CPU
    k_cache, v_cache, tables = to_paged_cache(k, v, lens, BLOCK_SIZE, generator=block_order)
    return q, k, v, k_cache, v_cache, tables, lens


def ratio_vs_contiguous(
    paged: Callable[[], object], contiguous: Callable[[], object], num_rounds: int
) -> Rounds:
    """Interleaved rounds of ``paged`` and ``contiguous`` (wall time). Fails the benchmark
    when the median ratio paged / contiguous is below 1.0: paged does strictly more work,
    so such a figure is a measurement error (the machine's speed changed within pairs)."""
    result = run_rounds(
        {"paged": lambda: paged, "contiguous": lambda: contiguous},
        num_rounds=num_rounds,
        clock=time.perf_counter,
    )
    ratio = result.ratio("paged", "contiguous")
    if ratio.median < 1.0:
        pytest.fail(
            f"measurement error: median paged / contiguous ratio {ratio.median:.2f} < 1.0 over {num_rounds} "
            f"interleaved pairs (min {ratio.min:.2f}, max {ratio.max:.2f}); paged attention does strictly more "
            f"work than contiguous, so the machine's speed moved within pairs; rerun on a quieter machine. "
            f"{result.context_line()}"
        )
    return result


def _repeated(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    def work() -> None:
        for _ in range(calls):
            fn()

    return work


@pytest.fixture
def single_thread():
    """One torch thread: the comparison is of algorithms, not of how well each scales on 2 shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("context", [1024, 2048])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", ["gather", "blockwise", "contiguous"])
def test_cpu_decode(benchmark, single_thread, capsys, impl, shape, context):
    kv_heads, group, head_dim = SHAPES[shape]
    q, k, v, k_cache, v_cache, tables, lens = make_decode_case(
        BATCH, context, kv_heads, group, head_dim, torch.float32, "cpu"
    )
    scale = head_dim**-0.5
    ws = DecodeWorkspace()
    fns = {
        "contiguous": lambda: contiguous_decode_attention(q, k, v, lens, scale),
        "gather": lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, workspace=ws),
        "blockwise": lambda: paged_decode_attention_blockwise(q, k_cache, v_cache, tables, lens, scale),
    }
    benchmark.group = f"cpu-decode-{shape}-ctx{context}"
    if impl != "contiguous":
        base_rounds = num_rounds_from_env()
        num_rounds = base_rounds if impl == "blockwise" and shape == "7b-layer" else 2 * base_rounds
        calls = CALLS_PER_SAMPLE[shape]
        result = ratio_vs_contiguous(
            _repeated(fns[impl], calls), _repeated(fns["contiguous"], calls), num_rounds
        )
        ratio = result.ratio("paged", "contiguous")
        benchmark.extra_info.update(result.info())
        benchmark.extra_info.update(ratio.as_info("ratio_vs_contiguous"))
        benchmark.extra_info.update(result.spread("paged", 1 / calls).as_info("paged_s"))
        benchmark.extra_info.update(result.spread("contiguous", 1 / calls).as_info("contiguous_s"))
        with capsys.disabled():
            print(
                f"\n[cpu decode] {shape} B={BATCH} ctx={context} {impl}: median {result.spread('paged').median * 1e3 / calls:.2f} ms, "
                f"contiguous {result.spread('contiguous').median * 1e3 / calls:.2f} ms, paged/contiguous (min / median / max) "
                f"= {ratio.text('.2f')} (target <= 1.5)\n  {result.context_line()}"
            )
    benchmark.pedantic(fns[impl], rounds=3 if impl == "blockwise" else 10, warmup_rounds=1)


# --------------------------------------------------------------------------- GPU
def _cuda_event_median_s(fn: Callable[[], object], iters: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("context", [4096, 8192])
@pytest.mark.parametrize("batch", [16, 64])
def test_gpu_triton_decode(benchmark, capsys, batch, context):
    from kvbench.engines.exec.triton_attention import triton_available, triton_paged_decode_attention

    if not triton_available():
        pytest.skip("triton is not installed")
    kv_heads, group, head_dim = SHAPES["7b-layer"]
    q, k, v, k_cache, v_cache, tables, lens = make_decode_case(
        batch, context, kv_heads, group, head_dim, torch.bfloat16, "cuda"
    )
    # The same bytes laid out contiguously for the Triton kernel: identity block tables.
    k_ident = k.view(-1, BLOCK_SIZE, kv_heads, head_dim)
    v_ident = v.view(-1, BLOCK_SIZE, kv_heads, head_dim)
    ident_tables = torch.arange(k_ident.shape[0], dtype=torch.int32, device="cuda").view(batch, -1)
    scale = head_dim**-0.5
    ws = DecodeWorkspace()

    def paged():
        return triton_paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, workspace=ws)

    def identity():
        return triton_paged_decode_attention(q, k_ident, v_ident, ident_tables, lens, scale, workspace=ws)

    def sdpa_contiguous():
        return contiguous_decode_attention(q, k, v, lens, scale)

    torch.testing.assert_close(paged().float(), sdpa_contiguous().float(), atol=2e-2, rtol=2e-2)
    paged_s = _cuda_event_median_s(paged)
    ident_s = _cuda_event_median_s(identity)
    sdpa_s = _cuda_event_median_s(sdpa_contiguous)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k.element_size()
    gbps = kv_bytes / paged_s / 1e9
    name = torch.cuda.get_device_name()
    peak = next((bw for frag, bw in PEAK_HBM_GBPS.items() if frag in name), None)
    frac = f"{gbps / peak:.0%} of {peak:.0f} GB/s" if peak else "peak unknown"
    benchmark.group = "gpu-decode"
    benchmark.extra_info.update(
        paged_s=paged_s,
        identity_table_s=ident_s,
        sdpa_contiguous_s=sdpa_s,
        kv_bytes=kv_bytes,
        achieved_gbps=gbps,
        ratio_vs_identity=paged_s / ident_s,
        ratio_vs_sdpa=paged_s / sdpa_s,
    )
    with capsys.disabled():
        print(
            f"\n[gpu decode] {name} bf16 B={batch} ctx={context} Hkv={kv_heads} G={group} D={head_dim}: "
            f"triton paged {paged_s * 1e6:.0f} us ({gbps:.0f} GB/s, {frac}); "
            f"same kernel, contiguous blocks {ident_s * 1e6:.0f} us (paged/contig {paged_s / ident_s:.2f}x); "
            f"torch SDPA contiguous {sdpa_s * 1e6:.0f} us (paged/SDPA {paged_s / sdpa_s:.2f}x)"
        )

    def synced_paged():
        paged()
        torch.cuda.synchronize()

    benchmark.pedantic(synced_paged, rounds=20, warmup_rounds=3)
