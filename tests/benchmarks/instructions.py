"""Instructions one simulated replay executes, counted by valgrind: a speed figure that
repeats to the instruction on any machine, where CPU time on a shared one moves by
±25 % per round and by 3x between days.

Run: python tests/benchmarks/instructions.py [--workload sharegpt|mooncake] [--requests N]
     [--prefix-cache none block_hash ...] [--jobs J] [--json FILE]

Needs ``valgrind`` (Debian package) on PATH. Per prefix cache it runs the replay process
under cachegrind (``--cache-sim=no``: instructions only) with ``PYTHONHASHSEED=0`` four
times: replaying once (a primer: the first valgrind run of a checkout compiles numba's
functions for valgrind's CPU and caches them), once, twice and three times. Each
process replays 20 other requests first (so numba's dispatchers are loaded), then
collects garbage and disables the collector (a collection's cost depends on everything
allocated before it, which moved single counts by up to 30 %), then replays the workload
with a fresh engine each time. Start-up, imports and the warm-up cancel in the
differences: ``2 - 1`` and ``3 - 2`` are one warm replay each. Those two differ by about
1.5 % (a process's second and third replays do not find the same allocator and
dictionary state), which is this method's resolution; the primer's count beside the
second process's says whether numba compiled in it.

Instructions are not time: cache misses and branch mispredictions make some far dearer
than others (prefix caching at 0 % hits adds about 15 % instructions but 25-35 % CPU
time), so a ratio of instructions is not a ratio of CPU time. Use them to compare two
checkouts on one workload (run this in each), not as the issue's speed goals.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
NUM_PROCESS_REPLAYS = (1, 1, 2, 3)  # the first is the primer
_I_REFS = re.compile(r"^==\d+== I\s+refs:\s+([\d,]+)\s*$", re.MULTILINE)
_STEPS_LINE = "replay steps "


@dataclass(frozen=True)
class ReplayInstructions:
    """One prefix cache's counts: each process's total instructions (``num_replays``
    replays each, the primer first) and the steps each replay took."""

    prefix_cache: str
    num_replays: tuple[int, ...]
    instructions: tuple[int, ...]
    num_steps: int

    @property
    def per_replay(self) -> tuple[int, int]:
        """Instructions of one warm replay, twice: processes 2 - 1 and 3 - 2."""
        by_count = dict(zip(self.num_replays[1:], self.instructions[1:]))
        return by_count[2] - by_count[1], by_count[3] - by_count[2]

    @property
    def primer_excess(self) -> float:
        """The primer's count over the same process's second run, less 1 (large: numba
        compiled in the primer)."""
        return self.instructions[0] / self.instructions[1] - 1.0


def parse_instructions(stderr: str) -> int:
    """The ``I refs`` total of a cachegrind run's stderr; ValueError naming what was
    missing when there is none (valgrind failed, or the program did)."""
    found = _I_REFS.findall(stderr)
    if len(found) != 1:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise ValueError(f"cachegrind: expected one 'I refs:' line, found {len(found)}; stderr ends:\n{tail}")
    return int(found[0].replace(",", ""))


def parse_steps(stdout: str, num_replays: int) -> int:
    """The step count every replay of one process printed; ValueError when the replays
    took different steps (the engine is not deterministic) or printed none."""
    steps = [int(line[len(_STEPS_LINE) :]) for line in stdout.splitlines() if line.startswith(_STEPS_LINE)]
    if not steps or len(steps) != num_replays or len(set(steps)) > 1:
        raise ValueError(f"replays printed steps {steps}, expected {num_replays} equal counts")
    return steps[0]


def _context_and_workload(workload: str, num_requests: int):
    """The benchmarks' context and workload (sim_setup.py): ShareGPT-like traffic at 8K
    context, or the first ``num_requests`` of the Mooncake conversation trace at 128K."""
    from sim_setup import llama3_70b_fp8_on_h200, sharegpt_like

    if workload == "sharegpt":
        ctx = llama3_70b_fp8_on_h200()
        return ctx, sharegpt_like(num_requests, ctx.spec.vocab_size, seed=0)
    from kvbench.workloads.traces import load_trace

    ctx = llama3_70b_fp8_on_h200(max_positions=131072)
    trace = load_trace(
        "mooncake_conversation", vocab_size=ctx.spec.vocab_size, seed=0, max_requests=num_requests
    )
    return ctx, trace


def replay_in_process(workload: str, num_requests: int, prefix_cache: str, num_replays: int) -> None:
    """The measured process: warm up, stop the garbage collector, replay ``num_replays``
    times (a fresh engine each), printing each replay's step count."""
    from sim_setup import replay_all_answered, sharegpt_like, sim_engine

    ctx, requests = _context_and_workload(workload, num_requests)
    warmup = sharegpt_like(WARMUP_REQUESTS, ctx.spec.vocab_size, seed=1)
    replay_all_answered(sim_engine(ctx, prefix_cache=prefix_cache), warmup)
    gc.collect()
    gc.disable()
    for _ in range(num_replays):
        raw = replay_all_answered(sim_engine(ctx, prefix_cache=prefix_cache), requests)
        print(f"{_STEPS_LINE}{raw.num_steps}", flush=True)


def count(workload: str, num_requests: int, prefix_cache: str, num_replays: int) -> tuple[int, int]:
    """Run one measured process under cachegrind: (instructions, steps per replay)."""
    command = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--inner",
        str(num_replays),
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
    return parse_instructions(done.stderr), parse_steps(done.stdout, num_replays)


def measure(workload: str, num_requests: int, prefix_cache: str, jobs: int) -> ReplayInstructions:
    """The primer alone (it may compile), then the three measured processes, ``jobs`` at a
    time (instruction counts do not depend on what else runs)."""
    first = count(workload, num_requests, prefix_cache, NUM_PROCESS_REPLAYS[0])
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        rest = list(
            pool.map(lambda n: count(workload, num_requests, prefix_cache, n), NUM_PROCESS_REPLAYS[1:])
        )
    results = [first, *rest]
    steps = {num_steps for _, num_steps in results}
    if len(steps) != 1:
        raise ValueError(f"{prefix_cache}: processes took different step counts {sorted(steps)}")
    return ReplayInstructions(prefix_cache, NUM_PROCESS_REPLAYS, tuple(i for i, _ in results), steps.pop())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("sharegpt", "mooncake"), default="sharegpt")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prefix-cache", nargs="+", default=["none", "block_hash"])
    parser.add_argument("--jobs", type=int, default=2, help="measured processes at a time")
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--inner", type=int, help=argparse.SUPPRESS)  # the measured process
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.inner is not None:
        replay_in_process(args.workload, args.requests, args.prefix_cache[0], args.inner)
        return 0
    if args.requests <= 0 or args.jobs <= 0:
        parser.error("--requests and --jobs: must be > 0")
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not on PATH (Debian: apt-get install valgrind)")
    results = [measure(args.workload, args.requests, cache, args.jobs) for cache in args.prefix_cache]
    base = results[0]
    print(
        f"{args.workload}, {args.requests:,} requests: instructions of one warm replay (processes 2-1, 3-2)"
    )
    for result in results:
        a, b = result.per_replay
        ratio = f"  x{a / base.per_replay[0]:.3f}, x{b / base.per_replay[1]:.3f} of {base.prefix_cache}"
        print(
            f"  {result.prefix_cache:>10}: {a / 1e6:,.0f} M, {b / 1e6:,.0f} M ({b / a - 1:+.1%} apart)"
            f"{ratio if result is not base else ''}; {result.num_steps:,} steps; "
            f"primer {result.primer_excess:+.1%} over a warm process"
        )
    if args.json is not None:
        records = [asdict(r) | {"per_replay": r.per_replay} for r in results]
        payload = {"workload": args.workload, "num_requests": args.requests, "results": records}
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        tmp.replace(args.json)  # nothing half-written
    return 0


if __name__ == "__main__":
    sys.exit(main())
