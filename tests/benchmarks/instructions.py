"""Instructions one simulated replay executes, counted by valgrind: a speed figure that
repeats on any machine, where CPU time on a shared one moves by ±25 % per round and by
3x between days.

Run: python tests/benchmarks/instructions.py [--workload sharegpt|mooncake] [--requests N]
     [--prefix-cache none block_hash ...] [--processes P] [--jobs J] [--json FILE]

Needs ``valgrind`` (Debian package) on PATH. Per prefix cache it runs ``--processes``
replay processes (default 2) under callgrind with ``PYTHONHASHSEED=0``, counting only the
measured replay: callgrind starts with collection off (``--collect-atstart=no``) and
collects inside one C function, ``PyRun_SimpleStringFlags`` (``--toggle-collect``), in
which the process runs the measured replay and which nothing else calls. (The process
calls ``PyRun_SimpleString`` through ctypes, which calls it: callgrind does not see a
function that libffi jumps into as entered.)
Each process first replays 20 other requests (numba's dispatchers load) and the workload
once, uncounted (numba compiles there if its cache is cold, for valgrind's CPU; caches
and interned strings settle); then it collects garbage and disables the collector (a
collection's cost depends on everything allocated before it) and replays the workload
with a fresh engine inside the counted call. Start-up, imports and warm-ups are not
counted, so there is nothing to subtract: one process gives one replay's count (plus a
fixed ~0.1 M for compiling the one-line call). Processes of one checkout with numba's
cache warm agree to the instruction; a process that compiled numba during its warm-up
reads about 0.05 % high, so the first process runs alone (after editing compiled code it
is the one that compiles) and the others after it. Two checkouts in different
directories have differed by up to 0.2 % for the same code (path strings).

Instructions are not time: cache misses and branch mispredictions make some far dearer
than others (prefix caching at 0 % hits adds about 20 % instructions but 25-35 % CPU
time), so a ratio of instructions is not a ratio of CPU time. Use them to compare two
checkouts on one workload (run this in each), not as the issue's speed goals.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import gc
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

WARMUP_REQUESTS = 20
# The C function callgrind collects in, and the one the process calls (through ctypes)
# to enter it: the measured replay runs inside (see the module docstring). Both are
# exported by every CPython build (a stripped one keeps them: the C API is dynamic), and
# nothing in a replay calls them.
COUNTED_FUNCTION = "PyRun_SimpleStringFlags"
_ENTRY_FUNCTION = "PyRun_SimpleString"  # the stable ABI's PyRun_SimpleStringFlags(code, NULL)
_MEASURED_NAME = "_kvbench_measured_replay"  # what the counted call runs, in __main__
_COLLECTED = re.compile(r"^==\d+== Collected\s*:\s*(\d+)\s*$", re.MULTILINE)
_STEPS_LINE = "replay steps "
_NUM_REPLAYS = 2  # per process: the uncounted one, then the counted one


@dataclass(frozen=True)
class ReplayInstructions:
    """One prefix cache's counts: the measured replay's instructions in each process, and
    the steps each replay took."""

    prefix_cache: str
    instructions: tuple[int, ...]
    num_steps: int

    @property
    def low_high(self) -> tuple[int, int]:
        """The smallest and largest count over the processes."""
        return min(self.instructions), max(self.instructions)

    @property
    def spread(self) -> float:
        """The largest count over the smallest, less 1: the processes' disagreement."""
        low, high = self.low_high
        return high / low - 1.0


def parse_instructions(stderr: str) -> int:
    """The instructions callgrind collected (its ``Collected :`` line) in a run's stderr;
    ValueError naming what was wrong when there is none (valgrind failed, or the program
    did) or it is 0 (the counted call never ran)."""
    found = _COLLECTED.findall(stderr)
    tail = "\n".join(stderr.strip().splitlines()[-15:])
    if len(found) != 1:
        raise ValueError(
            f"callgrind: expected one 'Collected :' line, found {len(found)}; stderr ends:\n{tail}"
        )
    collected = int(found[0])
    if collected == 0:
        raise ValueError(
            f"callgrind collected 0 instructions: the measured replay did not run inside "
            f"{COUNTED_FUNCTION}; stderr ends:\n{tail}"
        )
    return collected


def parse_steps(stdout: str, num_replays: int) -> int:
    """The step count every replay of one process printed; ValueError when the replays
    took different steps (the engine is not deterministic) or printed none."""
    steps = [int(line[len(_STEPS_LINE) :]) for line in stdout.splitlines() if line.startswith(_STEPS_LINE)]
    if not steps or len(steps) != num_replays or len(set(steps)) > 1:
        raise ValueError(f"replays printed steps {steps}, expected {num_replays} equal counts")
    return steps[0]


def replay_in_process(workload: str, num_requests: int, prefix_cache: str) -> None:
    """The measured process: warm up, replay once uncounted, stop the garbage collector,
    then replay inside the counted call (``COUNTED_FUNCTION``), each replay on a fresh
    engine and printing its step count. Mutates ``__main__`` (binds the replay as
    ``_MEASURED_NAME``) and leaves the collector disabled. Raises RuntimeError when the
    counted replay failed (its traceback printed above)."""
    from sim_setup import benchmark_workload, replay_all_answered, sharegpt_like, sim_engine

    ctx, requests = benchmark_workload(workload, num_requests)
    warmup = sharegpt_like(WARMUP_REQUESTS, ctx.spec.vocab_size, seed=1)
    replay_all_answered(sim_engine(ctx, prefix_cache=prefix_cache), warmup)

    def replay() -> None:
        raw = replay_all_answered(sim_engine(ctx, prefix_cache=prefix_cache), requests)
        print(f"{_STEPS_LINE}{raw.num_steps}", flush=True)

    replay()
    gc.collect()
    gc.disable()
    # The counted call runs a line of code in __main__'s namespace: the replay goes there.
    setattr(sys.modules["__main__"], _MEASURED_NAME, replay)
    entry = ctypes.pythonapi[_ENTRY_FUNCTION]
    entry.argtypes = (ctypes.c_char_p,)
    entry.restype = ctypes.c_int
    if entry(f"{_MEASURED_NAME}()\n".encode()) != 0:
        raise RuntimeError("the counted replay failed (its traceback is above)")


def count(workload: str, num_requests: int, prefix_cache: str) -> tuple[int, int]:
    """Run one measured process under callgrind: (the counted replay's instructions, steps
    per replay)."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        f"--toggle-collect={COUNTED_FUNCTION}",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--inner",
        "--workload",
        workload,
        "--requests",
        str(num_requests),
        "--prefix-cache",
        prefix_cache,
    ]
    env = dict(os.environ, PYTHONHASHSEED="0")
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return parse_instructions(done.stderr), parse_steps(done.stdout, _NUM_REPLAYS)


def measure(
    workload: str, num_requests: int, prefix_cache: str, processes: int, jobs: int
) -> ReplayInstructions:
    """``processes`` measured processes: the first alone (it compiles numba if the cache
    is cold, and reads about 0.05 % high then), the rest ``jobs`` at a time (instruction
    counts do not depend on what else runs)."""
    results = [count(workload, num_requests, prefix_cache)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        results += pool.map(lambda _: count(workload, num_requests, prefix_cache), range(processes - 1))
    steps = {num_steps for _, num_steps in results}
    if len(steps) != 1:
        raise ValueError(f"{prefix_cache}: processes took different step counts {sorted(steps)}")
    return ReplayInstructions(prefix_cache, tuple(i for i, _ in results), steps.pop())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("sharegpt", "mooncake"), default="sharegpt")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prefix-cache", nargs="+", default=["none", "block_hash"])
    parser.add_argument("--processes", type=int, default=2, help="measured processes per prefix cache")
    parser.add_argument("--jobs", type=int, default=2, help="measured processes at a time")
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the measured process
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.inner:
        replay_in_process(args.workload, args.requests, args.prefix_cache[0])
        return 0
    if args.requests <= 0 or args.processes <= 0 or args.jobs <= 0:
        parser.error("--requests, --processes and --jobs: must be > 0")
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not on PATH (Debian: apt-get install valgrind)")
    results = [
        measure(args.workload, args.requests, cache, args.processes, args.jobs) for cache in args.prefix_cache
    ]
    base = results[0]
    print(
        f"{args.workload}, {args.requests:,} requests: instructions of one warm replay "
        f"(low / high over {args.processes} processes)"
    )
    for result in results:
        low, high = result.low_high
        base_low, base_high = base.low_high
        ratio = f"; x{low / base_low:.4f} / x{high / base_high:.4f} of {base.prefix_cache}"
        print(
            f"  {result.prefix_cache:>10}: {low:,} / {high:,} ({result.spread:+.3%} apart)"
            f"{ratio if result is not base else ''}; {result.num_steps:,} steps"
        )
    if args.json is not None:
        records = [asdict(r) | {"low_high": r.low_high, "spread": r.spread} for r in results]
        payload = {"workload": args.workload, "num_requests": args.requests, "results": records}
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        tmp.replace(args.json)  # nothing half-written
    return 0


if __name__ == "__main__":
    sys.exit(main())
