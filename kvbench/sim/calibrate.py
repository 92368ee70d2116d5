"""Fit the cost model's coefficients to real-mode step times: ``kvbench calibrate``.

Each real-mode step row (``steps.parquet``) gives a measured ``duration_s`` and the
step's composition. The cost model (kvbench.sim.cost_model) predicts::

    duration_s - transfer_s = max(a * memory_bytes, b * flops)
                              + step_overhead_s + per_token_overhead_s * tokens
                              + per_seq_overhead_s * seqs

with ``a = 1 / (bandwidth * memory_efficiency)`` and ``b = 1 / (peak * mfu)``. The ``max``
makes the fit piecewise linear: given which steps are memory-bound, the rest is a
non-negative least-squares problem in which each step keeps only its dominant roofline
column. Every split the model can produce is a threshold on memory_bytes / flops, so the
fit tries the base profile's threshold and 33 quantiles of that ratio, keeps the best,
and then alternates (relabel with the fitted ``a, b``; refit) while the error falls.

Residuals are relative so that short decode steps weigh as much as long prefills, but
relative to the *modeled* time, not the measured one: dividing by a noisy measurement
gives the steps that happened to run fast the most weight and biases the fitted times
low (by about twice the squared coefficient of variation of the step times: ~-5 % at
the ±15 % jitter of a shared 2-core CPU, the sign of the TPOT errors seen before). The
first fit divides by the measured time; then each step is reweighted by 1 / its modeled
time and the fit repeated until the coefficients settle (``REWEIGHT_ITERATIONS`` at
most): iteratively reweighted least squares, whose weighted residuals have mean zero
under multiplicative noise. On exact steps both weightings give the same coefficients.
PCIe bandwidth is a published figure and is not fitted: modeled transfer time is
subtracted first.

A roofline term that no step is bound by (or that fits to 0) cannot be identified; it
keeps the base profile's coefficient and the fit says so in ``notes``. When the fit
implies more than the profile's nominal bandwidth or peak (caches on a CPU), the nominal
figure is raised to the fitted one and the efficiency set to 1, also noted.

A live-server run (``engine=vllm_cpu`` / ``endpoint``: meta ``engine_kind`` "live") has no
server steps in its steps.parquet (its rows are client polls); its steps are reconstructed
from the requests' token arrival times (kvbench.sim.live_steps, which explains how and
when a step cannot be known) and only the reliable ones are fitted.

Step composition comes from the StepStats columns. Columns a richer engine may add are
used when present (``num_prefill_seqs``, ``num_prefill_attention_pairs``,
``num_prefill_context_tokens``, ``num_decode_context_tokens``); otherwise prefill chunks
are taken to start at position 0 in one sequence and decode context to be the KV tokens
held (``kv_token_bytes / kv_bytes_per_token``) minus the prefill tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench.config import user_hardware_dir
from kvbench.sim.cost_model import CostModel, StepShape
from kvbench.specs import HardwareSpec, ModelSpec, SpecError

# Steps shorter than this are clock noise (a perf_counter read is ~100 ns) and would
# dominate a relative-error fit.
MIN_DURATION_S = 1e-6
# Rounds of reweighting by the modeled time after the first fit (it converges in a few).
REWEIGHT_ITERATIONS = 10
# Fewest reliable reconstructed steps a live run must contribute: fewer cannot separate
# the five coefficients (and say that the client did not see the server's iterations).
MIN_LIVE_STEPS = 20
# First line of every profile calibrate writes: --force replaces only files that start so.
HEADER = "# Fitted by `kvbench calibrate"


class CalibrationError(ValueError):
    """Results that cannot be fitted; the message names the run, column or argument."""


@dataclass(frozen=True)
class CalibrationRun:
    """One real-mode run's steps plus the byte sizes its engine used."""

    run_id: str
    steps: pd.DataFrame
    spec: ModelSpec
    kv_bytes_per_token: int
    weight_bytes: int


@dataclass(frozen=True)
class CalibrationFit:
    """A fitted hardware profile and how well it explains the steps it was fitted on.

    ``mean_abs_rel_error`` is mean(|predicted - measured| / measured) over the fitted
    steps; ``notes`` lists terms kept from the base profile or nominal figures raised.
    """

    hardware: HardwareSpec
    num_steps: int
    num_memory_bound: int
    num_compute_bound: int
    mean_abs_rel_error: float
    notes: tuple[str, ...] = ()


def _int_column(row: Mapping[str, Any], name: str, default: int) -> int:
    value = row.get(name, default)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return default
    return int(value)


def shape_from_step(row: Mapping[str, Any], kv_bytes_per_token: int) -> StepShape:
    """The cost model's view of one ``steps.parquet`` row (see the module docstring).

    Pure. Raises CalibrationError naming the column when a required one is missing.
    """
    for name in ("num_prefill_tokens", "num_decode_tokens"):
        if name not in row:
            raise CalibrationError(f"steps column {name!r} is missing")
    prefill = _int_column(row, "num_prefill_tokens", 0)
    decode = _int_column(row, "num_decode_tokens", 0)
    # An engine that does not record a shape column leaves it 0 (the StepStats default);
    # 0 next to tokens of that kind means "not recorded" and the approximation is used.
    prefill_seqs = _int_column(row, "num_prefill_seqs", 0) or (1 if prefill else 0)
    # One chunk per prefilling sequence, each starting at 0 and of equal length, unless
    # the engine recorded the exact figures.
    per_chunk = prefill / prefill_seqs if prefill_seqs else 0
    pairs = _int_column(row, "num_prefill_attention_pairs", 0) or round(
        prefill_seqs * per_chunk * (per_chunk + 1) / 2
    )
    prefill_context = _int_column(row, "num_prefill_context_tokens", 0) or prefill
    held = _int_column(row, "kv_token_bytes", 0) // kv_bytes_per_token
    decode_context = _int_column(row, "num_decode_context_tokens", 0) or max(decode, held - prefill_context)
    host = _int_column(row, "bytes_to_host", 0) + _int_column(row, "bytes_from_host", 0)
    return StepShape(
        prefill, prefill_seqs, pairs, prefill_context, decode, decode_context if decode else 0, host
    )


def nnls(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative least squares: argmin ||matrix @ x - target|| subject to x >= 0.

    Exact for the handful of columns used here: the optimum is the unconstrained
    least-squares solution on its support, so every support is tried (2**k - 1 solves)
    and the best feasible one kept. Columns are scaled to unit norm first for
    conditioning. Raises ValueError for more than 12 columns.
    """
    num_cols = matrix.shape[1]
    if num_cols > 12:
        raise ValueError(f"nnls: {num_cols} columns is too many for the exhaustive solver")
    norms = np.linalg.norm(matrix, axis=0)
    usable = norms > 0
    scaled = matrix / np.where(usable, norms, 1.0)
    best = np.zeros(num_cols)
    best_residual = float(np.sum(target**2))
    candidates = [i for i in range(num_cols) if usable[i]]
    for size in range(1, len(candidates) + 1):
        for support in itertools.combinations(candidates, size):
            cols = list(support)
            solution, *_ = np.linalg.lstsq(scaled[:, cols], target, rcond=None)
            if np.any(solution < 0):
                continue
            residual = float(np.sum((scaled[:, cols] @ solution - target) ** 2))
            if residual < best_residual - 1e-15 * max(best_residual, 1.0):
                best_residual = residual
                best = np.zeros(num_cols)
                best[cols] = solution
    return best / np.where(usable, norms, 1.0)


def fit(
    runs: Sequence[CalibrationRun], base: HardwareSpec, name: str, max_iterations: int = 20
) -> CalibrationFit:
    """Fit ``base``'s cost coefficients to the steps of ``runs`` (see module docstring).

    Pure. Returns a profile named ``name`` keeping base's memory size and PCIe
    bandwidth. Raises CalibrationError when there is no usable step.
    """
    base.validate()
    rows: list[tuple[float, float, int, int, float]] = []  # memory_bytes, flops, tokens, seqs, target_s
    for run in runs:
        model = CostModel(
            base_spec_check(run),
            base,
            kv_bytes_per_token=run.kv_bytes_per_token,
            weight_bytes=run.weight_bytes,
        )
        if "duration_s" not in run.steps:
            raise CalibrationError(f"run {run.run_id}: steps column 'duration_s' is missing")
        for row in run.steps.to_dict("records"):
            duration = float(row["duration_s"])
            features = model.features(shape_from_step(row, run.kv_bytes_per_token))
            target = duration - model.transfer_s(features.host_bytes)
            if not duration >= MIN_DURATION_S or target <= 0:
                continue
            rows.append(
                (features.memory_bytes, features.flops, features.num_tokens, features.num_seqs, target)
            )
    if not rows:
        raise CalibrationError("no usable steps to fit (every step had zero or unknown duration)")
    problem = _Problem(np.array(rows, dtype=np.float64), base, weight=None)
    best = problem.search(max_iterations)
    # Reweight by the modeled time (see module docstring) until the coefficients settle.
    for _ in range(REWEIGHT_ITERATIONS):
        problem = problem.reweighted(best)
        candidate = problem.search(max_iterations)
        settled = np.array_equal(candidate.memory_bound, best.memory_bound) and np.allclose(
            candidate.coefficients(), best.coefficients(), rtol=1e-6, atol=0.0
        )
        best = candidate
        if settled:
            break
    hardware, raised = _to_hardware(base, name, best.s_per_byte, best.s_per_flop, best.overheads)
    # Report what the simulator will do: it labels each step by the max of the two terms.
    final = dataclasses.replace(best, memory_bound=problem.labels(best.s_per_byte, best.s_per_flop))
    predicted = problem.predict(final)
    target = problem.target
    return CalibrationFit(
        hardware=hardware,
        num_steps=len(target),
        num_memory_bound=int(final.memory_bound.sum()),
        num_compute_bound=int((~final.memory_bound & problem.has_tokens).sum()),
        mean_abs_rel_error=float(np.mean(np.abs(predicted - target) / target)),
        notes=(*best.notes, *raised),
    )


@dataclass(frozen=True)
class _Solution:
    memory_bound: np.ndarray  # bool per step
    s_per_byte: float
    s_per_flop: float
    overheads: np.ndarray  # step, per token, per seq (seconds)
    residual: float  # sum of squared weighted errors (the problem's weights)
    notes: tuple[str, ...]

    def coefficients(self) -> np.ndarray:
        """s_per_byte, s_per_flop and the three overheads, as one vector."""
        return np.array([self.s_per_byte, self.s_per_flop, *self.overheads])


class _Problem:
    """The fit's data: per step memory bytes, FLOPs, tokens, sequences and target seconds,
    and the weight of each step's residual (1 / measured seconds unless given)."""

    def __init__(self, data: np.ndarray, base: HardwareSpec, weight: np.ndarray | None) -> None:
        self.data = data
        self.base = base
        self.memory, self.flops, self.tokens, self.seqs, self.target = data.T
        self.has_tokens = self.tokens > 0
        self.weight = 1.0 / self.target if weight is None else weight
        self.base_s_per_byte = 1.0 / (base.hbm_bandwidth_gbps * 1e9 * base.memory_efficiency)
        self.base_s_per_flop = 1.0 / (base.bf16_tflops * 1e12 * base.mfu)

    def reweighted(self, s: _Solution) -> _Problem:
        """The same steps weighted by 1 / the seconds ``s`` models for them (floored at
        MIN_DURATION_S so a step modeled at ~0 s cannot take all the weight)."""
        return _Problem(self.data, self.base, 1.0 / np.maximum(self.predict(s), MIN_DURATION_S))

    def search(self, max_iterations: int) -> _Solution:
        """Best labelling and its solution: thresholds, then relabel-and-refit.

        A step is memory-bound iff memory/flops >= s_per_flop/s_per_byte, so every
        labelling the fit can reach is a threshold on that ratio. Start from the base
        profile's threshold and from quantiles of the ratio, keep the best, then
        alternate (relabel with the fitted coefficients; refit) while the error falls.
        """
        ratio = self.memory / np.maximum(self.flops, 1e-300)
        thresholds = {self.base_s_per_flop / self.base_s_per_byte, np.inf, 0.0}
        thresholds.update(np.quantile(ratio[self.has_tokens], np.linspace(0.0, 1.0, 33)).tolist())
        best = min((self.solve(ratio >= t) for t in sorted(thresholds)), key=lambda s: s.residual)
        for _ in range(max_iterations):
            labels = self.labels(best.s_per_byte, best.s_per_flop)
            if np.array_equal(labels, best.memory_bound):
                break
            candidate = self.solve(labels)
            if candidate.residual >= best.residual:
                break
            best = candidate
        return best

    def labels(self, s_per_byte: float, s_per_flop: float) -> np.ndarray:
        return (self.memory * s_per_byte >= self.flops * s_per_flop) & self.has_tokens

    def solve(self, memory_bound: np.ndarray) -> _Solution:
        """NNLS with each step's dominant roofline column; an unidentifiable term keeps base."""
        memory_bound = memory_bound & self.has_tokens
        compute_bound = ~memory_bound & self.has_tokens
        roofline = {"memory": self.memory * memory_bound, "compute": self.flops * compute_bound}
        base = {"memory": self.base_s_per_byte, "compute": self.base_s_per_flop}
        free = {"memory": True, "compute": True}
        notes: list[str] = []
        while True:
            fixed = sum((roofline[t] * base[t] for t in free if not free[t]), np.zeros_like(self.target))
            columns = [roofline[t] for t in free if free[t]]
            columns += [np.ones_like(self.target), self.tokens, self.seqs]
            matrix = np.column_stack(columns) * self.weight[:, None]
            solution = nnls(matrix, (self.target - fixed) * self.weight)
            coefficient = dict(zip([t for t in free if free[t]], solution))
            dropped = [t for t, c in coefficient.items() if c <= 0]
            if not dropped:
                break
            for term in dropped:
                free[term] = False
                notes.append(f"{term} term not identifiable from these steps: kept the base profile's value")
        s_per_byte = coefficient.get("memory", base["memory"])
        s_per_flop = coefficient.get("compute", base["compute"])
        result = _Solution(memory_bound, s_per_byte, s_per_flop, solution[-3:], 0.0, tuple(notes))
        residual = float(np.sum(((self.predict(result) - self.target) * self.weight) ** 2))
        return dataclasses.replace(result, residual=residual)

    def predict(self, s: _Solution) -> np.ndarray:
        """Modeled seconds under the solution's labelling (what the solve minimised)."""
        roofline = np.where(s.memory_bound, self.memory * s.s_per_byte, self.flops * s.s_per_flop)
        step, per_token, per_seq = s.overheads
        return roofline * self.has_tokens + step + per_token * self.tokens + per_seq * self.seqs


def base_spec_check(run: CalibrationRun) -> ModelSpec:
    """The run's model spec, validated; CalibrationError naming the run when invalid."""
    try:
        run.spec.validate()
    except SpecError as exc:
        raise CalibrationError(f"run {run.run_id}: {exc}") from None
    return run.spec


def _to_hardware(
    base: HardwareSpec, name: str, s_per_byte: float, s_per_flop: float, overheads: np.ndarray
) -> tuple[HardwareSpec, list[str]]:
    """Coefficients -> a HardwareSpec; nominal figures raised when efficiency would exceed 1."""
    notes = []
    bandwidth_gbps, efficiency = base.hbm_bandwidth_gbps, 1.0 / (s_per_byte * base.hbm_bandwidth_gbps * 1e9)
    if efficiency > 1.0:
        bandwidth_gbps, efficiency = 1.0 / (s_per_byte * 1e9), 1.0
        notes.append(
            f"fitted bandwidth exceeds the nominal one: hbm_bandwidth_gbps raised to {bandwidth_gbps:.4g}"
        )
    tflops, mfu = base.bf16_tflops, 1.0 / (s_per_flop * base.bf16_tflops * 1e12)
    if mfu > 1.0:
        tflops, mfu = 1.0 / (s_per_flop * 1e12), 1.0
        notes.append(f"fitted FLOP rate exceeds the nominal peak: bf16_tflops raised to {tflops:.4g}")
    hardware = dataclasses.replace(
        base,
        name=name,
        hbm_bandwidth_gbps=float(bandwidth_gbps),
        memory_efficiency=float(efficiency),
        bf16_tflops=float(tflops),
        mfu=float(mfu),
        step_overhead_s=float(overheads[0]),
        per_token_overhead_s=float(overheads[1]),
        per_seq_overhead_s=float(overheads[2]),
    )
    hardware.validate()
    return hardware, notes


# --------------------------------------------------------------------------- results -> runs
def runs_from_results(results: Any) -> tuple[list[CalibrationRun], HardwareSpec]:
    """Real-mode, successful runs of a ``kvbench.results.Results`` and their common hardware.
    A live-server run contributes its reconstructed steps (``live_run_steps``).

    Raises CalibrationError when there is no such run, the runs were measured on
    different hardware profiles, or a run lacks the meta fields the fit needs.
    """
    runs_frame = results.runs
    selected = runs_frame
    if "mode" in selected:
        selected = selected[selected["mode"] == "real"]
    if "status" in selected:
        selected = selected[selected["status"] == "ok"]
    if selected.empty:
        raise CalibrationError("no successful real-mode runs (run.mode=real) in these results")
    hardware_names = sorted(set(selected.get("hardware.name", pd.Series(["?"])).astype(str)))
    if len(hardware_names) > 1:
        raise CalibrationError(
            f"runs measured with different hardware profiles {hardware_names}: calibrate one at a time"
        )
    model_fields = [f.name for f in dataclasses.fields(ModelSpec)]
    hardware_fields = [f.name for f in dataclasses.fields(HardwareSpec)]
    calibration_runs = []
    base = None
    for row in selected.to_dict("records"):
        run_id = str(row["run_id"])
        live = row.get("engine_kind") == "live"
        # A live server's KV bytes per token are the model's (kvbench.sizing), not an engine's.
        for column in ("weight_bytes",) if live else ("kv_bytes_per_token", "weight_bytes"):
            if row.get(column) is None or pd.isna(row.get(column)):
                raise CalibrationError(f"run {run_id}: meta field {column!r} is missing")
        spec = ModelSpec(**{f: _plain(row[f"model.{f}"]) for f in model_fields if f"model.{f}" in row})
        if base is None:
            base = HardwareSpec(
                **{f: _plain(row[f"hardware.{f}"]) for f in hardware_fields if f"hardware.{f}" in row}
            )
        if live:
            steps, kv_bytes_per_token = live_run_steps(results.requests, row, spec)
        else:
            steps = results.steps[results.steps["run_id"] == run_id]
            kv_bytes_per_token = int(row["kv_bytes_per_token"])
        calibration_runs.append(
            CalibrationRun(run_id, steps, spec, kv_bytes_per_token, int(row["weight_bytes"]))
        )
    assert base is not None
    return calibration_runs, base


def live_run_steps(
    requests: pd.DataFrame, row: Mapping[str, Any], spec: ModelSpec
) -> tuple[pd.DataFrame, int]:
    """The steps of a live-server run (``row``: its runs-frame row) for the fit, and its KV
    bytes per token: the server's steps are not recorded, so they are reconstructed from
    the run's token times (kvbench.sim.live_steps), keeping only the reliable ones.
    Reads the run's run.json and server.log. Raises CalibrationError naming the run."""
    from kvbench.results import ResultsError, read_record
    from kvbench.sim.live_steps import ReconstructionError, reconstruct_steps, reliable_steps, server_limits
    from kvbench.sizing import kv_bytes_per_token

    run_id = str(row["run_id"])
    run_dir = Path(str(row["run_dir"]))
    try:
        record = read_record(run_dir)
        log_path = run_dir / "server.log"
        log = log_path.read_text(errors="replace") if log_path.is_file() else ""
        limits = server_limits(record["meta"], log)
        mine = requests[requests["run_id"] == run_id]
        steps = reconstruct_steps(mine, max_num_batched_tokens=limits.max_num_batched_tokens)
    except (ResultsError, ReconstructionError, OSError) as exc:
        raise CalibrationError(f"run {run_id}: {exc}") from None
    usable = reliable_steps(steps)
    if len(usable) < MIN_LIVE_STEPS:
        reasons = steps["unreliable"].value_counts().to_dict()
        raise CalibrationError(
            f"run {run_id}: only {len(usable)} of its {len(steps)} reconstructed server steps are "
            f"reliable (at least {MIN_LIVE_STEPS} needed; unreliable: {reasons}): the client did not "
            "see the server's iterations one by one (tokens arrived in bursts)"
        )
    run_meta = record["meta"].get("run") or {}
    kv_dtype = run_meta.get("kv_dtype") or run_meta.get("dtype") or spec.dtype
    return usable, kv_bytes_per_token(spec, kv_dtype)


def _plain(value: Any) -> Any:
    """numpy scalars and NaN (from a frame) -> plain Python values / None."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return value.item() if hasattr(value, "item") else value


def to_yaml(result: CalibrationFit, source: str) -> str:
    """The fitted profile as a hardware preset YAML (``hardware=NAME``) with a provenance header."""
    hw = result.hardware
    lines = [
        f"{HEADER} {source}` on {result.num_steps:,} real-mode steps",
        f"# ({result.num_memory_bound:,} memory-bound, {result.num_compute_bound:,} compute-bound); "
        f"mean |relative error| {result.mean_abs_rel_error:.1%}.",
        *(f"# note: {note}" for note in result.notes),
        "# Units: memory_bytes in bytes; *_gbps 1e9 B/s; bf16_tflops 1e12 FLOP/s; *_s seconds.",
    ]
    for field in dataclasses.fields(HardwareSpec):
        value = getattr(hw, field.name)
        lines.append(f"{field.name}: {value!r}" if not isinstance(value, str) else f"{field.name}: {value}")
    return "\n".join(lines) + "\n"


def default_output(name: str) -> Path:
    """``<user hardware dir>/<name>.yaml`` (``$KVBENCH_HOME/hardware``, else the platform's
    config dir; kvbench.config.user_hardware_dir), where ``hardware=<name>`` finds it;
    never the installed package. CalibrationError for a shipped preset's name: the
    shipped preset wins on a clash, so the profile would never be used."""
    shipped = resources.files("kvbench.conf").joinpath("hardware", f"{name}.yaml")
    if shipped.is_file():
        raise CalibrationError(
            f"--name: {name!r} is a shipped hardware preset, which hardware={name} would keep "
            "choosing; pick another name"
        )
    return user_hardware_dir() / f"{name}.yaml"


def check_output(out: Path, force: bool) -> None:
    """Raise CalibrationError unless ``out`` may be written: absent, or (with ``force``) a
    profile an earlier ``kvbench calibrate`` wrote (its first line is ``HEADER``). Shipped
    profiles and any other file are never replaced. Reads only."""
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_file():
        raise CalibrationError(f"{out}: exists and is not a regular file; pick another --name or --out")
    if not force:
        raise CalibrationError(
            f"{out} exists (a shipped or earlier profile); pick another --name or pass --force"
        )
    try:
        with open(out, encoding="utf-8", errors="replace") as f:
            first_line = f.readline()
    except OSError as exc:
        raise CalibrationError(f"{out}: cannot read: {exc.strerror or exc}") from exc
    if not first_line.startswith(HEADER):
        raise CalibrationError(
            f"{out}: exists and was not written by kvbench calibrate (its first line is not "
            f"'{HEADER} ...'), so --force does not replace it; pick another --name or --out"
        )


def main(argv: list[str] | None = None) -> int:
    """``kvbench calibrate RESULTS_DIR [--name NAME] [--out FILE]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="kvbench calibrate",
        description="Fit the simulation cost model (memory efficiency, MFU, overheads) to real-mode "
        "results and write a hardware profile usable as hardware=NAME.",
    )
    parser.add_argument("results_dir", help="a run or sweep directory of real-mode results")
    parser.add_argument("--name", default="calibrated", help="profile name (default: calibrated)")
    parser.add_argument(
        "--out",
        default=None,
        help="output YAML (default: $KVBENCH_HOME/hardware/NAME.yaml, else ~/.config/kvbench/hardware/; "
        "hardware=NAME finds it there)",
    )
    parser.add_argument(
        "--force", action="store_true", help="overwrite a profile an earlier kvbench calibrate wrote"
    )
    args = parser.parse_args(argv)
    from kvbench.results import ResultsError, check_path_component, ensure_writable_dir, load, replace_file

    try:
        out = Path(args.out) if args.out else default_output(check_path_component(args.name, "--name"))
        check_output(out, args.force)
        runs, base = runs_from_results(load(args.results_dir))
        result = fit(runs, base, args.name)
        check_output(out, args.force)  # again: the fit takes a while
        text = to_yaml(result, args.results_dir)
        ensure_writable_dir(out.parent)
        replace_file(out, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    except (CalibrationError, ResultsError, SpecError) as exc:
        print(f"kvbench calibrate: {exc}", file=sys.stderr)
        return 2
    hw = result.hardware
    print(
        f"{hw.name}: memory_efficiency {hw.memory_efficiency:.3g} of {hw.hbm_bandwidth_gbps:.4g} GB/s, "
        f"mfu {hw.mfu:.3g} of {hw.bf16_tflops:.4g} TFLOP/s, overheads {hw.step_overhead_s * 1e3:.3g} ms/step "
        f"+ {hw.per_token_overhead_s * 1e6:.3g} us/token + {hw.per_seq_overhead_s * 1e6:.3g} us/seq; "
        f"{result.num_steps:,} steps, mean |rel. error| {result.mean_abs_rel_error:.1%}"
    )
    for note in result.notes:
        print(f"  note: {note}")
    print(f"wrote {out}")
    return 0
