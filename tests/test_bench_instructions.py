"""tests/benchmarks/instructions.py, the instruction-count comparison: its parsers (on
captured callgrind text), the spread over processes, the measured process itself, and
real callgrind runs where valgrind is installed (CI installs it)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from bench_modules import BENCHMARKS, load_benchmark_module

instructions = load_benchmark_module("instructions")
_PATH = BENCHMARKS / "instructions.py"

# The end of a callgrind run's stderr (valgrind 3.19, --collect-atstart=no), as captured.
_CALLGRIND_TAIL = """==7713== Events    : Ir
==7713== Collected : 462766
==7713==
==7713== I   refs:      462,766
"""


def test_the_counted_instructions_are_read_from_callgrind_output() -> None:
    assert instructions.parse_instructions(_CALLGRIND_TAIL) == 462_766
    with pytest.raises(ValueError, match="found 0"):
        instructions.parse_instructions("==1== Callgrind\nTraceback (most recent call last):\n")
    with pytest.raises(ValueError, match="found 2"):
        instructions.parse_instructions(_CALLGRIND_TAIL + _CALLGRIND_TAIL)
    with pytest.raises(ValueError, match="collected 0 instructions"):
        instructions.parse_instructions(_CALLGRIND_TAIL.replace("462766", "0"))


def test_every_replay_of_a_process_must_take_the_same_steps() -> None:
    assert instructions.parse_steps("replay steps 12\nreplay steps 12\n", 2) == 12
    with pytest.raises(ValueError, match="expected 2 equal"):
        instructions.parse_steps("replay steps 12\nreplay steps 13\n", 2)
    with pytest.raises(ValueError, match="expected 3 equal"):
        instructions.parse_steps("replay steps 12\nreplay steps 12\n", 3)


def test_the_spread_is_the_processes_disagreement() -> None:
    result = instructions.ReplayInstructions("none", (1_000_500, 1_000_000, 1_000_200), 9)
    assert result.low_high == (1_000_000, 1_000_500)
    assert result.spread == pytest.approx(0.0005)


def test_the_measured_process_replays_the_workload_twice() -> None:
    """Outside valgrind the counted call still runs the replay (ctypes calls the C function)."""
    done = subprocess.run(
        [sys.executable, str(_PATH), "--inner", "--requests", "12", "--prefix-cache", "block_hash"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert instructions.parse_steps(done.stdout, 2) > 12  # decode steps as well as prefills


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_callgrind_counts_the_replay_alone() -> None:
    """The command the tool builds runs under valgrind, and callgrind counts the replay
    only: tens of millions of instructions for 5 requests, where start-up alone (imports
    of Python's, numpy's, pandas' and numba's modules) takes billions."""
    counted, steps = instructions.count("sharegpt", 5, "none")
    assert steps > 5
    assert 1_000_000 < counted < 1_000_000_000
