"""The memory experiments measure the KV state independently of how fast the machine runs:
each runs at its own sizes and arrivals once on a quiet machine and once beside a busy
loop on every core, and every deterministic figure, step by step, is the same."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
from experiment_sweeps import fresh_sweep, schedule_differences
from run_fixtures import sweep_experiment

from kvbench import results

BUSY_LOOP = "while True:\n    pass\n"


@contextmanager
def busy_cores() -> Iterator[None]:
    """One spinning Python process per core for the duration of the block (killed by their
    own handles on exit), so the run under test shares its core and runs slower."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait()


def _speed(sweep: Path) -> tuple[float, float]:
    """A sweep's total benchmark seconds and its median machine-speed probe (Python loop,
    M iterations/s, measured right before each run)."""
    runs = results.load(sweep).runs
    return float(runs["benchmark_duration_s"].sum()), float(
        pd.to_numeric(runs["env.probe_python_mops"]).median()
    )


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["gqa_vs_mha", "paged_vs_slab", "block_size"])
def test_kv_metrics_are_identical_under_a_busy_loop(experiment: str) -> None:
    quiet = fresh_sweep(experiment)
    with tempfile.TemporaryDirectory() as tmp, busy_cores():
        loaded = sweep_experiment(experiment, cwd=Path(tmp))
        (quiet_s, quiet_mops), (loaded_s, loaded_mops) = _speed(quiet), _speed(loaded)
        print(
            f"{experiment}: quiet {quiet_s:.1f} s at probe {quiet_mops:.3g} M it/s, "
            f"loaded {loaded_s:.1f} s at probe {loaded_mops:.3g} M it/s"
        )
        assert schedule_differences(quiet, loaded) == []


def test_schedule_differences_sees_a_changed_step(tmp_path: Path) -> None:
    """The comparison the test above relies on does notice a changed KV figure."""
    quiet = fresh_sweep("gqa_vs_mha")
    copy = tmp_path / "gqa_vs_mha"
    shutil.copytree(quiet, copy)
    run_dir = sorted(copy.glob("*/run.json"))[0].parent
    steps = pd.read_parquet(run_dir / "steps.parquet")
    steps.loc[len(steps) // 2, "kv_allocated_bytes"] += 1
    steps.to_parquet(run_dir / "steps.parquet")
    problems = schedule_differences(quiet, copy)
    assert problems == [f"{run_dir.name}: steps.parquet differs ({len(steps)} vs {len(steps)} rows)"]
