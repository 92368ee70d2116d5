"""A short machine-speed probe recorded with every run (``environment.collect_environment``).

Timed metrics depend on how fast the machine was while it ran: a shared CI runner under
load, or a different runner type, moves latencies by more than most regressions. The probe
measures three fixed micro-benchmarks right before a run, so ``kvbench compare`` can say how
fast the candidate's machine was relative to the baseline's and, with ``--normalize``,
scale timed metrics by it:

- ``probe_compute_gflops``: a fixed fp32 matmul on one CPU thread (torch), in GFLOP/s;
- ``probe_memory_gbps``: a copy of a buffer larger than typical last-level caches on one
  thread, bytes read + written per second / 1e9;
- ``probe_python_mops``: a fixed pure-Python loop, million iterations per second (kvbench's
  scheduler and runner are Python: on tiny CPU models it dominates a step);
- ``probe_cuda_tflops``: on CUDA only, a fixed bf16 matmul on the current device, TFLOP/s
  (None without CUDA).

Each figure is the median of ``num_reps`` timed repetitions after one untimed warm-up, so a
single preempted repetition does not move it. The whole probe takes about 0.1-0.3 s on a
2-core CI machine. Torch's intra-op thread count is set to 1 for the CPU parts and restored.

Simulation mode never imports torch (``with_torch=False``): its figures that need torch
(compute, memory, CUDA) are None, and ``probe_python_mops``, the speed of the pure-Python
simulator, is what its runs are compared by.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

# Sizes are part of the probe's definition: changing them changes what the figures mean,
# so baselines recorded with other sizes would not compare.
MATMUL_SIZE = 256  # CPU matmul: [256, 256] @ [256, 256] fp32
NUM_MATMULS_PER_REP = 32
COPY_BYTES = 64 * 1024 * 1024  # above the last-level cache a single core sees
NUM_PYTHON_ITERATIONS = 100_000
CUDA_MATMUL_SIZE = 4096  # bf16 [4096, 4096] @ [4096, 4096]
NUM_CUDA_MATMULS_PER_REP = 10
DEFAULT_NUM_REPS = 5


@dataclass(frozen=True)
class MachineSpeed:
    """Probe figures of one moment on one machine; higher is faster. Field names are the
    keys recorded in run.json's environment (runs-frame columns ``env.probe_*``)."""

    probe_compute_gflops: float | None  # None when measured without torch
    probe_memory_gbps: float | None  # None when measured without torch
    probe_python_mops: float
    probe_cuda_tflops: float | None  # None without CUDA or without torch


# The probe figures compare checks, in the order it prints them.
PROBE_KEYS: tuple[str, ...] = tuple(MachineSpeed.__dataclass_fields__)


def measure_machine_speed(num_reps: int = DEFAULT_NUM_REPS, *, with_torch: bool = True) -> MachineSpeed:
    """Run the probe (see module doc) and return its figures; ``with_torch=False`` measures
    only the Python figure and leaves the others None, without importing torch.

    Side effects (with torch): imports torch, allocates ~2 x COPY_BYTES of host memory
    (freed on return), sets torch's intra-op threads to 1 for the CPU parts and restores
    them; on CUDA, allocates and frees two small bf16 matrices on the current device.
    Raises ValueError when ``num_reps`` < 1.
    """
    if num_reps < 1:
        raise ValueError(f"num_reps: must be >= 1, got {num_reps}")
    if not with_torch:
        return MachineSpeed(None, None, _python_mops(num_reps), None)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compute = _cpu_matmul_gflops(num_reps)
        memory = _copy_gbps(num_reps)
    finally:
        torch.set_num_threads(threads)
    python = _python_mops(num_reps)
    cuda = _cuda_matmul_tflops(num_reps) if torch.cuda.is_available() else None
    return MachineSpeed(compute, memory, python, cuda)


def probe_facts(num_reps: int = DEFAULT_NUM_REPS, *, with_torch: bool = True) -> dict[str, float | None]:
    """``measure_machine_speed(num_reps, with_torch=...)`` as environment keys (``probe_*``)
    plus ``load_average_1m`` (the 1-minute load average when the probe ran; None where the
    OS has none)."""
    facts: dict[str, float | None] = dict(asdict(measure_machine_speed(num_reps, with_torch=with_torch)))
    try:
        facts["load_average_1m"] = os.getloadavg()[0]
    except OSError:
        facts["load_average_1m"] = None
    return facts


def _median_seconds(work: Callable[[], object], num_reps: int) -> float:
    """Median wall time of ``work()`` over ``num_reps`` calls after one untimed warm-up."""
    work()
    times = []
    for _ in range(num_reps):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cpu_matmul_gflops(num_reps: int) -> float:
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.rand(MATMUL_SIZE, MATMUL_SIZE, generator=generator)
    b = torch.rand(MATMUL_SIZE, MATMUL_SIZE, generator=generator)
    out = torch.empty(MATMUL_SIZE, MATMUL_SIZE)

    def work() -> None:
        for _ in range(NUM_MATMULS_PER_REP):
            torch.mm(a, b, out=out)

    flops = 2 * MATMUL_SIZE**3 * NUM_MATMULS_PER_REP
    return flops / _median_seconds(work, num_reps) / 1e9


def _copy_gbps(num_reps: int) -> float:
    import torch

    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), num_reps)
    return 2 * COPY_BYTES / seconds / 1e9  # read + write


def _python_mops(num_reps: int) -> float:
    def work() -> int:
        total = 0
        for i in range(NUM_PYTHON_ITERATIONS):
            total += i & 7
        return total

    return NUM_PYTHON_ITERATIONS / _median_seconds(work, num_reps) / 1e6


def _cuda_matmul_tflops(num_reps: int) -> float:
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(0)
    size = CUDA_MATMUL_SIZE
    a = torch.rand(size, size, generator=generator, device=device, dtype=torch.bfloat16)
    b = torch.rand(size, size, generator=generator, device=device, dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def rep_seconds() -> float:
        start.record()
        for _ in range(NUM_CUDA_MATMULS_PER_REP):
            torch.mm(a, b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    rep_seconds()  # warm-up: cuBLAS handle and kernel selection
    seconds = statistics.median(rep_seconds() for _ in range(num_reps))
    return 2 * size**3 * NUM_CUDA_MATMULS_PER_REP / seconds / 1e12
