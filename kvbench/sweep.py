"""Hydra glue: the task every `kvbench run` / `kvbench sweep` job executes, and the
callback that finishes a sweep (combined table, HTML report, exit status).

Failures are caught inside the task and recorded as failed runs, because Hydra
re-raises a failed multirun job after the others and then skips ``on_multirun_end``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from kvbench import results
from kvbench.config import ConfigError, validate_config
from kvbench.execute import RunOutcome, config_hash, execute, run_id_for
from kvbench.runner import PROGRESS_LABEL
from kvbench.summary_view import (
    CI_CONFIDENCE,
    RUN_LINE_METRICS,
    column,
    format_cell,
    format_value,
    summary_view,
)


def run_job(cfg: DictConfig) -> RunOutcome:
    """Validate, resolve the run directory, skip if already complete, else execute.

    Raises ConfigError only for a single run (``kvbench run``), also for results that
    cannot be written where asked (``run.run_id`` / ``run.sweep_name`` not one directory
    name, a directory kvbench did not write in the way, a filesystem error), checked before
    anything runs. Inside a multirun a bad configuration is recorded as a failed run so the
    other jobs go on.
    """
    multirun = _is_multirun()
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    try:
        cfg = validate_config(cfg)
        digest = config_hash(cfg)
        run_dir = _run_dir(cfg, overrides, digest)
    except ConfigError as exc:
        if not multirun:
            raise
        return _record_config_failure(cfg, overrides, exc)
    label = None
    if multirun:
        label, index = _job_label(cfg, overrides)
        if cfg.run.progress != "off":
            print(f"kvbench: {label}{_PLAN.eta_text(index)}", flush=True)
    if cfg.run.resume and results.is_complete(run_dir, digest):
        print(f"kvbench: {run_dir} already complete with the same config; skipped (run.resume=false reruns)")
        return RunOutcome(run_dir, "skipped", {})
    try:
        results.prepare_run_dir(run_dir)
    except results.ResultsWriteError as exc:
        if not multirun:
            # A directory in the way is the run id's problem; anything else, the results dir's.
            key = "run.run_id" if os.path.lexists(run_dir) else "run.results_dir"
            raise ConfigError(f"{key}: {exc}") from None
        print(f"kvbench: run FAILED: {exc}", file=sys.stderr)
        return _unrecorded(RunOutcome(run_dir, "failed", {}, str(exc), recorded=False))
    started_s = time.monotonic()
    token = PROGRESS_LABEL.set(label)
    try:
        outcome = execute(cfg, run_dir, digest)
    finally:
        PROGRESS_LABEL.reset(token)
    if multirun:
        _PLAN.record_run(time.monotonic() - started_s)
    _print_outcome(outcome)
    return outcome if outcome.recorded else _unrecorded(outcome)


class _SweepPlan:
    """This process's view of the running sweep: jobs per pass, repeats (one pass per
    repeat, see kvbench.cli), which override keys vary, and how long the runs executed so
    far took (for the ETA). Empty in a job launched in another process (joblib,
    submitit): labels then show only the job's number in its pass."""

    def __init__(self) -> None:
        self.start(0, 1, ())

    def start(self, num_jobs_per_pass: int, num_passes: int, swept_keys: tuple[str, ...]) -> None:
        self.num_jobs_per_pass = num_jobs_per_pass
        self.num_passes = num_passes
        self.swept_keys = swept_keys
        self.durations_s: list[float] = []

    def position(self, repeat: int, job_num: int) -> tuple[int, int]:
        """(this job's 0-based index in the whole sweep, number of jobs); (job_num, 0)
        when the plan is unknown here."""
        if not self.num_jobs_per_pass:
            return job_num, 0
        return repeat * self.num_jobs_per_pass + job_num, self.num_jobs_per_pass * self.num_passes

    def record_run(self, duration_s: float) -> None:
        self.durations_s.append(duration_s)

    def eta_text(self, index: int) -> str:
        """`` \u00b7 about 2m 10s left`` from the mean executed run (skipped runs cost
        nothing) times the jobs from ``index`` on; "" before any run finished."""
        _, num_jobs = self.position(0, index)
        if not self.durations_s or not num_jobs:
            return ""
        eta_s = round(sum(self.durations_s) / len(self.durations_s) * (num_jobs - index))
        minutes, seconds = divmod(eta_s, 60)
        return f" \u00b7 about {f'{minutes}m ' if minutes else ''}{seconds}s left in the sweep"


def _plan_of(config: DictConfig) -> tuple[int, tuple[str, ...]]:
    """Jobs per pass and the varying override keys of a multirun, as Hydra's basic sweeper
    expands it: the product of its sweep parameters (``hydra.sweeper.params``, then the
    command line's; a key given twice counts once). (0, ()) when a parameter cannot be
    expanded here (glob needs the config loader) or another sweeper is in use."""
    params = config.hydra.sweeper.get("params") or {}
    texts = [f"{key}={value}" for key, value in params.items()] + [
        str(o) for o in config.hydra.overrides.task
    ]
    try:
        parsed = OverridesParser.create().parse_overrides(texts)
        lengths = {
            o.get_key_element(): len(list(o.sweep_string_iterator())) for o in parsed if o.is_sweep_override()
        }
    except HydraException:
        return 0, ()
    return math.prod(lengths.values()), tuple(lengths)


_PLAN = _SweepPlan()


def _job_label(cfg: DictConfig, overrides: list[str]) -> tuple[str, int]:
    """``run 3/12 \u00b7 engine=paged workload=chat`` (the job's position in the sweep and
    the overrides the sweep varies; all of the job's overrides when the plan is not known
    here) and the job's index in the sweep."""
    index, num_jobs = _PLAN.position(cfg.run.repeat, HydraConfig.get().job.num)
    position = f"run {index + 1}/{num_jobs}" if num_jobs else f"run {index + 1}"
    parsed = OverridesParser.create().parse_overrides(overrides)
    shown = [
        text
        for text, override in zip(overrides, parsed)
        if (
            override.get_key_element() in _PLAN.swept_keys if num_jobs else not text.startswith("run.repeat=")
        )
    ]
    if _PLAN.num_passes > 1:
        shown.append(f"repeat {cfg.run.repeat + 1}/{_PLAN.num_passes}")
    return " \u00b7 ".join([position, " ".join(shown)]) if shown else position, index


def _run_dir(cfg: DictConfig, overrides: list[str], digest: str) -> Path:
    """``results_dir/sweep_name/run_id``; ConfigError naming the key unless both names are
    single directory names."""
    try:
        sweep_name = results.check_path_component(cfg.run.sweep_name, "run.sweep_name")
        # Only null derives the id: an empty run.run_id is a mistake, not a request for one.
        run_id = cfg.run.run_id if cfg.run.run_id is not None else run_id_for(overrides, digest)
        run_id = results.check_path_component(run_id, "run.run_id")
    except results.ResultsWriteError as exc:
        raise ConfigError(str(exc)) from None
    return Path(cfg.run.results_dir) / sweep_name / run_id


# Failed jobs of this process whose failure could not be written as a run record; the
# finalizer counts them with the failed run records (jobs of remote launchers print their
# own error and are not counted here).
_UNRECORDED_FAILURES: list[RunOutcome] = []


def _unrecorded(outcome: RunOutcome) -> RunOutcome:
    """Remember a failed multirun job that left no run record (its error is already printed)."""
    if _is_multirun():
        _UNRECORDED_FAILURES.append(outcome)
    return outcome


def _record_config_failure(cfg: DictConfig, overrides: list[str], exc: ConfigError) -> RunOutcome:
    run_options = cfg.get("run", {})
    results_dir = str(run_options.get("results_dir", "results"))
    try:
        sweep_name = results.check_path_component(run_options.get("sweep_name", "single"), "run.sweep_name")
    except results.ResultsWriteError as name_error:
        print(f"kvbench: invalid configuration for job {overrides}: {exc}; {name_error}", file=sys.stderr)
        return _unrecorded(RunOutcome(Path(results_dir), "failed", {}, str(exc), recorded=False))
    run_dir = Path(results_dir) / sweep_name / run_id_for(overrides, "invalid")
    meta: dict[str, Any] = {
        "run_id": run_dir.name,
        "sweep_name": sweep_name,
        "status": "failed",
        "error": str(exc),
    }
    print(f"kvbench: invalid configuration for job {overrides}: {exc}", file=sys.stderr)
    try:
        results.write_failed_run(run_dir, meta, f"ConfigError: {exc}")
    except results.ResultsWriteError as write_error:
        print(f"kvbench: the failure could not be recorded: {write_error}", file=sys.stderr)
        return _unrecorded(RunOutcome(run_dir, "failed", {}, str(exc), recorded=False))
    return RunOutcome(run_dir, "failed", {}, str(exc))


def _is_multirun() -> bool:
    if not HydraConfig.initialized():
        return False
    return str(HydraConfig.get().mode) == "RunMode.MULTIRUN"


def _print_outcome(outcome: RunOutcome) -> None:
    if outcome.status == "failed" and outcome.config_error and not _is_multirun():
        return  # the CLI prints it as an invalid configuration
    if outcome.status == "failed":
        print(f"kvbench: run FAILED: {outcome.run_dir}\n  {outcome.error}", file=sys.stderr)
        return
    s = outcome.summary
    # The summary's own headers and formats (kvbench.summary_view), so a run's line reads
    # like its row in the sweep summary and the report.
    columns = [column(k, [s[k]]) for k in RUN_LINE_METRICS if k in s and s[k] == s[k]]
    shown = ", ".join(f"{c.header} {format_value(c, s[c.metric])}" for c in columns)
    print(f"kvbench: run ok: {outcome.run_dir}" + (f"  ({shown})" if shown else ""))


class SweepFinalizer(Callback):
    """Before a multirun: refuse names and results directories that cannot hold it. At the
    end: combined table, report, and exit status = failed runs."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Check run.sweep_name and every run.sweep_name / run.run_id the sweep will take,
        and that the sweep directory can be written, before Hydra creates
        ``<results_dir>/<sweep_name>/.hydra``: a bad name or path stops the sweep with one
        screen and exit status 2, with nothing created outside ``run.results_dir``."""
        if config.run.repeat == 0:  # the first pass of run.repeats (kvbench.cli)
            _UNRECORDED_FAILURES.clear()
            num_jobs_per_pass, swept_keys = _plan_of(config)
            _PLAN.start(num_jobs_per_pass, config.run.repeats if _is_repeat_pass(config) else 1, swept_keys)
        try:
            for key, value in _names_to_check(config):
                results.check_path_component(value, key)
            results.ensure_writable_dir(_sweep_dir(config))
        except results.ResultsWriteError as exc:
            print(f"kvbench: cannot run the sweep\n  {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if _is_repeat_pass(config) and config.run.repeat < config.run.repeats - 1:
            return  # table, report and exit status once, after the last repeat's pass
        sweep_dir = _sweep_dir(config)
        num_failed = len(_UNRECORDED_FAILURES)
        if any(results.find_runs(sweep_dir)):
            try:
                table = results.write_sweep_table(sweep_dir)
            except results.ResultsError as exc:
                print(f"kvbench: sweep table not written: {exc}", file=sys.stderr)
                num_failed += 1
            else:
                print_sweep_summary(sweep_dir)
                print(f"kvbench: sweep table {table}")
            for run_dir in results.find_runs(sweep_dir):
                with contextlib.suppress(results.ResultsError):  # already counted: no table
                    num_failed += results.read_record(run_dir)["meta"].get("status") == "failed"
            if config.run.report:
                from kvbench.report import build_report

                try:
                    print(f"kvbench: report {build_report(sweep_dir)}")
                except Exception as exc:  # noqa: BLE001 - a report problem must not hide results
                    print(f"kvbench: report failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    num_failed += 1
        if num_failed:
            print(f"kvbench: {num_failed} run(s) failed in {sweep_dir}", file=sys.stderr)
            raise SystemExit(min(num_failed, 125))


def _is_repeat_pass(config: DictConfig) -> bool:
    """Whether this multirun is one of kvbench.cli's passes of ``run.repeats`` (its command
    line sets run.repeat to one number; a hand-made run.repeat sweep is one multirun)."""
    return any(re.fullmatch(r"run\.repeat=\d+", str(o)) for o in config.hydra.overrides.task)


def _sweep_dir(config: DictConfig) -> Path:
    return Path(str(config.run.results_dir)) / str(config.run.sweep_name)


def _names_to_check(config: DictConfig) -> list[tuple[str, object]]:
    """run.sweep_name, plus every value a sweep override gives run.sweep_name or run.run_id."""
    names: list[tuple[str, object]] = [("run.sweep_name", config.run.sweep_name)]
    if config.run.run_id is not None:
        names.append(("run.run_id", config.run.run_id))
    task = [str(o) for o in config.hydra.overrides.task]
    for override in OverridesParser.create().parse_overrides(task):
        key = override.key_or_group
        if key in ("run.sweep_name", "run.run_id") and override.is_sweep_override():
            try:
                names += [(key, value) for value in override.sweep_string_iterator()]
            except HydraException:
                continue  # glob() sweeps need a config loader; each job checks its own names
    return names


def print_sweep_summary(sweep_dir: Path) -> None:
    """A rich table of the sweep: the report's first-screen summary (``summary_view``: the
    same labels, headline-first columns with units, statistics, pooled repeats and
    formats); every metric is in runs.parquet/csv and the report."""
    from rich.console import Console
    from rich.table import Table

    runs = results.load(sweep_dir).runs
    if runs.empty:
        return
    view = summary_view(runs)
    title = f"sweep {sweep_dir.name}: {len(runs)} runs"
    if view.has_repeats:
        title += (
            f" in {len(view.rows)} configurations (mean \u00b1 half the {CI_CONFIDENCE:.0%} bootstrap CI)"
        )
    table = Table(title=title)
    # Labels never wrap (they are short by construction); the headers wrap at spaces.
    table.add_column("run", no_wrap=True, min_width=max(len(row.label) for row in view.rows))
    table.add_column("status", no_wrap=True)
    if view.has_repeats:
        table.add_column("runs", justify="right")
    for metric_column in view.first:
        table.add_column(metric_column.header, justify="right")
    for row in view.rows:
        repeats = [str(len(row.run_ids))] if view.has_repeats else []
        cells = [format_cell(c, row.cells[c.metric]) for c in view.first]
        table.add_row(row.label, row.status, *repeats, *cells)
    Console(width=160).print(table)
