"""Hydra glue: the task every `kvbench run` / `kvbench sweep` job executes, and the
callback that finishes a sweep (combined table, HTML report, exit status).

Failures are caught inside the task and recorded as failed runs, because Hydra
re-raises a failed multirun job after the others and then skips ``on_multirun_end``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from kvbench import results
from kvbench.config import ConfigError, validate_config
from kvbench.execute import RunOutcome, config_hash, execute, run_id_for


def run_job(cfg: DictConfig) -> RunOutcome:
    """Validate, resolve the run directory, skip if already complete, else execute.

    Raises ConfigError only for a single run (``kvbench run``); inside a multirun a bad
    configuration is recorded as a failed run so the other jobs go on.
    """
    multirun = _is_multirun()
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    try:
        cfg = validate_config(cfg)
    except ConfigError as exc:
        if not multirun:
            raise
        return _record_config_failure(cfg, overrides, exc)
    digest = config_hash(cfg)
    run_id = cfg.run.run_id or run_id_for(overrides, digest)
    run_dir = Path(cfg.run.results_dir) / cfg.run.sweep_name / run_id
    if cfg.run.resume and results.is_complete(run_dir, digest):
        print(f"kvbench: {run_dir} already complete with the same config; skipped (run.resume=false reruns)")
        return RunOutcome(run_dir, "skipped", {})
    outcome = execute(cfg, run_dir, digest)
    _print_outcome(outcome)
    return outcome


def _record_config_failure(cfg: DictConfig, overrides: list[str], exc: ConfigError) -> RunOutcome:
    sweep_name = str(cfg.get("run", {}).get("sweep_name", "single"))
    results_dir = str(cfg.get("run", {}).get("results_dir", "results"))
    run_dir = Path(results_dir) / sweep_name / run_id_for(overrides, "invalid")
    meta: dict[str, Any] = {
        "run_id": run_dir.name,
        "sweep_name": sweep_name,
        "status": "failed",
        "error": str(exc),
    }
    results.write_failed_run(run_dir, meta, f"ConfigError: {exc}")
    print(f"kvbench: invalid configuration for job {overrides}: {exc}", file=sys.stderr)
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
    keys = [
        ("output_tokens_per_s", "{:.1f} tok/s"),
        ("tpot_ms_mean", "TPOT {:.2f} ms"),
        ("ttft_ms_mean", "TTFT {:.1f} ms"),
        ("kv_peak_allocated_bytes", "peak KV {:,.0f} B"),
    ]
    shown = ", ".join(fmt.format(s[k]) for k, fmt in keys if k in s and s[k] == s[k])
    print(f"kvbench: run ok: {outcome.run_dir}" + (f"  ({shown})" if shown else ""))


class SweepFinalizer(Callback):
    """At the end of a multirun: combined table, report, and exit status = failed runs."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.run.results_dir) / config.run.sweep_name
        if not sweep_dir.exists():
            return
        table = results.write_sweep_table(sweep_dir)
        print_sweep_summary(sweep_dir)
        print(f"kvbench: sweep table {table}")
        num_failed = 0
        for run_json in sweep_dir.glob("*/run.json"):
            if json.loads(run_json.read_text())["meta"].get("status") == "failed":
                num_failed += 1
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


# What a sweep prints side by side at the end (the full table is in runs.parquet/csv).
SUMMARY_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("kv_bytes_per_token", "KV B/token", "{:,.0f}"),
    ("kv_peak_allocated_bytes", "peak KV B", "{:,.0f}"),
    ("kv_token_fraction_mean", "KV token frac", "{:.3f}"),
    ("peak_num_running", "peak seqs", "{:.0f}"),
    ("output_tokens_per_s", "tok/s", "{:,.1f}"),
    ("ttft_ms_mean", "TTFT ms", "{:,.1f}"),
    ("tpot_ms_mean", "TPOT ms", "{:,.2f}"),
    ("prefix_hit_rate", "prefix hit", "{:.3f}"),
)


def print_sweep_summary(sweep_dir: Path) -> None:
    """A rich table of the sweep's runs, labelled by what varies, key metrics side by side."""
    from rich.console import Console
    from rich.table import Table

    runs = results.load(sweep_dir).runs
    if runs.empty:
        return
    # The run id is the job's own overrides plus a config hash; label each run by the
    # overrides that differ between runs.
    parts = [tuple(str(r).rsplit("-", 1)[0].split(",")) for r in runs["run_id"]]
    common = set.intersection(*(set(p) for p in parts)) if len(parts) > 1 else set()
    labels = [",".join(x for x in p if x not in common) or ",".join(p) for p in parts]
    table = Table(title=f"sweep {sweep_dir.name}: {len(runs)} runs")
    table.add_column("run", overflow="fold")
    table.add_column("status")
    shown = [(col, head, fmt) for col, head, fmt in SUMMARY_COLUMNS if col in runs]
    for _, head, _ in shown:
        table.add_column(head, justify="right")
    for (_, row), label in zip(runs.iterrows(), labels):
        cells = []
        for col, _, fmt in shown:
            value = row[col]
            cells.append("-" if value is None or value != value else fmt.format(value))
        table.add_row(str(label), str(row.get("status", "")), *cells)
    Console(width=160).print(table)
