"""tests/benchmarks/instructions.py, the instruction-count comparison: its parsers (on
captured cachegrind text), the arithmetic of one warm replay, the measured process
itself, and one real cachegrind run where valgrind is installed (CI installs it)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from bench_modules import BENCHMARKS, load_benchmark_module

instructions = load_benchmark_module("instructions")
_PATH = BENCHMARKS / "instructions.py"

# The end of a cachegrind run's stderr (valgrind 3.19, --cache-sim=no), as captured.
_CACHEGRIND_TAIL = """==3515== Cachegrind, a cache and branch-prediction profiler
==3515== Command: /usr/bin/python3 script.py
==3515==
==3515==
==3515== I   refs:      8,684,029,286
"""


def test_the_instruction_total_is_read_from_cachegrind_output() -> None:
    assert instructions.parse_instructions(_CACHEGRIND_TAIL) == 8_684_029_286
    with pytest.raises(ValueError, match="found 0"):
        instructions.parse_instructions("==1== Cachegrind\nTraceback (most recent call last):\n")
    with pytest.raises(ValueError, match="found 2"):
        instructions.parse_instructions(_CACHEGRIND_TAIL + _CACHEGRIND_TAIL)


def test_every_replay_of_a_process_must_take_the_same_steps() -> None:
    assert instructions.parse_steps("replay steps 12\nreplay steps 12\n", 2) == 12
    with pytest.raises(ValueError, match="expected 2 equal"):
        instructions.parse_steps("replay steps 12\nreplay steps 13\n", 2)
    with pytest.raises(ValueError, match="expected 3 equal"):
        instructions.parse_steps("replay steps 12\nreplay steps 12\n", 3)


def test_one_warm_replay_is_the_difference_of_processes() -> None:
    # Processes: primer (1 replay), 1, 2 and 3 replays; start-up S, replays R then R'.
    start, replay, later = 5_000, 700, 710
    result = instructions.ReplayInstructions(
        "none",
        (1, 1, 2, 3),
        (start + replay + 300, start + replay, start + 2 * replay, start + 2 * replay + later),
        9,
    )
    assert result.per_replay == (replay, later)
    assert result.primer_excess == pytest.approx(300 / (start + replay))


def test_the_measured_process_replays_the_workload_each_time() -> None:
    done = subprocess.run(
        [sys.executable, str(_PATH), "--inner", "2", "--requests", "12", "--prefix-cache", "block_hash"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert instructions.parse_steps(done.stdout, 2) > 12  # decode steps as well as prefills


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_one_cachegrind_run_counts_a_replay() -> None:
    """The command the tool builds runs under valgrind and its output parses: the
    replay's steps, and billions of instructions (start-up alone imports Python's,
    numpy's, pandas' and numba's modules)."""
    total, steps = instructions.count("sharegpt", 5, "none", 1)
    assert steps > 5
    assert total > 1_000_000_000
