"""Fresh sweeps of the shipped experiments, each run once per test process and shared by
the tests that read them (test_readme_figures.py, test_kv_machine_independent.py), plus
the comparison of what a clock-free schedule must reproduce exactly. No conftest magic:
import what you use."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import math
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pandas as pd
from run_fixtures import sweep_experiment

from kvbench import metrics, results
from kvbench.summary_view import RUN_FACTS

ROOT = Path(__file__).resolve().parents[1]
_SWEEPS = Path(tempfile.mkdtemp(prefix="kvbench-experiments-"))
atexit.register(shutil.rmtree, _SWEEPS, ignore_errors=True)


@functools.cache
def fresh_sweep(experiment: str) -> Path:
    """``kvbench sweep +experiment=EXPERIMENT`` at the experiment's own sizes and arrivals,
    once per process; its results folder."""
    return sweep_experiment(experiment, cwd=_SWEEPS)


@functools.cache
def readme_figures() -> ModuleType:
    """scripts/readme_figures.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "scripts" / "readme_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


# Summary metrics a clock-free schedule (offline or closed-loop-1 arrivals, real mode)
# fixes exactly: catalogue sources `config` and `schedule`, and the run facts.
DETERMINISTIC_METRICS: tuple[str, ...] = (
    *(
        doc.name
        for doc in metrics.METRICS
        if not metrics.is_timed(doc.source, simulated=False, wall_clock_schedule=False)
    ),
    *(fact.name for fact in RUN_FACTS),
)


def _same(a: object, b: object) -> bool:
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return both_nan or a == b


def schedule_differences(first: Path, second: Path) -> list[str]:
    """What differs between two sweeps of one experiment that a clock-free schedule fixes:
    the runs (matched by run id, i.e. configuration), every deterministic summary metric,
    and every integer column of each run's steps and requests frames (the schedule step by
    step: tokens scheduled, sequences running, KV bytes and blocks, hits, preemptions;
    per request: cached tokens, output lengths, KV slots). Float columns are clock times."""
    a, b = (results.load(path).runs.set_index("run_id").sort_index() for path in (first, second))
    if list(a.index) != list(b.index):
        return [f"run ids differ: {list(a.index)} vs {list(b.index)}"]
    problems = []
    for run_id in a.index:
        for metric in DETERMINISTIC_METRICS:
            if metric in a and not _same(a.at[run_id, metric], b.at[run_id, metric]):
                problems.append(f"{run_id}: {metric} {a.at[run_id, metric]} vs {b.at[run_id, metric]}")
        for frame in ("steps", "requests"):
            x, y = (pd.read_parquet(Path(runs.at[run_id, "run_dir"]) / f"{frame}.parquet") for runs in (a, b))
            exact = [c for c in x.columns if pd.api.types.is_integer_dtype(x[c])]
            if "request_id" in x:
                exact.append("request_id")
            if len(x) != len(y) or not x[exact].equals(y[exact]):
                problems.append(f"{run_id}: {frame}.parquet differs ({len(x)} vs {len(y)} rows)")
    return problems
