"""``kvbench twin LIVE_RUN_DIR``: replay a live-server run through kvbench's paged engine in
simulation and report predicted against measured, side by side.

The twin is a normal kvbench run (``run.mode=sim``, ``engine=paged``) built from the
live run's own files, never modifying them:

- **Requests**: the live run's workload rebuilt from its config.yaml (workloads are
  seeded and pure, so the same ids token for token), each arriving at the time the
  client *sent* it (requests.parquet ``first_scheduled_s``): the twin sees the server's
  arrivals, not the workload's, so a client-side concurrency cap or send lag is
  replayed as it happened. The workload plug-in ``recorded_arrivals`` does this, so the
  twin's config.yaml names the live run it replays.
- **Engine**: a pool of the server's block size and usable block count, and its
  scheduler limits (``kvbench.sim.live_steps.server_limits``: the server's
  ``cache_config_info``, its launch arguments, vLLM's CPU defaults where none were
  given). vLLM keeps one block of ``num_gpu_blocks`` as its null block
  (vllm/v1/core/block_pool.py), so the twin's pool has ``num_gpu_blocks - 1`` blocks.
  Preemption by recompute, newest victim first, block-hash prefix cache: vLLM v1's
  behaviour (see the README for where the two schedulers still differ).
- **Timing**: the hardware profile given with ``--hardware`` (a preset name, e.g. one
  ``kvbench calibrate`` wrote from another live run against the same server, or a YAML
  file); the live run's own profile otherwise (uncalibrated).

The comparison (terminal table, ``twin.json`` and ``twin.parquet`` next to the twin's run
directory) puts like beside like:

- prefix-cache tokens: vLLM's ``prefix_cache_queries/hits`` counters count each request
  once, at its first admission (a preempted request's re-admission goes to separate
  counters, vllm/v1/metrics/stats.py), so the twin's figures are its first-admission
  lookups: prompt tokens and ``num_cached_prompt_tokens`` of completed requests;
- preemptions: ``server_num_preemptions`` against the twin's ``num_preemptions``;
- KV usage: the server's usage is only known at its scrape times, so the twin's usage
  (blocks held by sequences / usable blocks; cached-free blocks count as free in both)
  is sampled at the same times and summarised the same way (kvbench.metrics
  ``server_summary``); the twin's every-step peak is reported beside it;
- TTFT and TPOT: from the send time on both sides (the twin's arrival is the send time),
  mean / median / p99 over completed requests (kvbench.metrics ``per_request``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from omegaconf import DictConfig, OmegaConf

from kvbench import results
from kvbench.config import ConfigError
from kvbench.metrics import completed_mask, per_request, server_summary
from kvbench.sim.live_steps import ReconstructionError, ServerLimits, server_limits
from kvbench.types import Workload

# The twin's run id inside --out (a kvbench run directory) and its comparison files.
TWIN_RUN_ID = "sim"
COMPARISON_JSON = "twin.json"
COMPARISON_PARQUET = "twin.parquet"
# Key of every twin.json, so that a rerun replaces only a comparison the twin wrote.
MARKER_KEY = "kvbench_twin"
# The goals (relative error), per compared metric; None: reported, no goal.
GOALS: dict[str, float] = {
    "prefix_hit_tokens": 0.05,
    "num_preemptions": 0.20,
    "ttft_ms_mean": 0.15,
    "ttft_ms_median": 0.15,
    "ttft_ms_p99": 0.15,
    "tpot_ms_mean": 0.10,
    "tpot_ms_median": 0.10,
    "tpot_ms_p99": 0.10,
}


class TwinError(ValueError):
    """A live run the twin cannot replay, or output it may not write; names the path or key."""


@dataclass(frozen=True)
class ComparisonRow:
    """One metric, measured on the live server and predicted by the twin.

    ``rel_error`` = (twin - live) / live: 0 when both are 0, +-inf when only live is 0,
    NaN when either is unknown. ``goal``: the largest |rel_error| the issue asks for (NaN:
    none). ``note``: how each side was measured.
    """

    metric: str
    unit: str
    live: float
    twin: float
    rel_error: float
    goal: float
    note: str

    @property
    def within_goal(self) -> bool | None:
        """None without a goal or a figure; else whether |rel_error| <= goal."""
        if math.isnan(self.goal) or math.isnan(self.rel_error):
            return None
        return abs(self.rel_error) <= self.goal


# --------------------------------------------------------------------------- the workload plug-in
def recorded_arrivals(live_run: str) -> Workload:
    """The live run's workload (rebuilt from its config.yaml) with each request arriving
    at its recorded send time (requests.parquet ``first_scheduled_s``; a request never sent
    keeps its workload arrival). A workload ``_target_``; reads the live run only.
    Raises ValueError naming the file when the run cannot be read."""
    from kvbench.execute import build_workload, load_tokenizer_for
    from kvbench.specs import ModelSpec

    run_dir = Path(live_run)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise ValueError(f"live_run: {config_path} is missing (not a kvbench run directory)")
    cfg = OmegaConf.load(config_path)
    spec = ModelSpec(**OmegaConf.to_container(cfg.model, resolve=True))
    inner = build_workload(cfg, load_tokenizer_for(spec))
    send_s = _send_times(run_dir)
    requests = [
        dataclasses.replace(r, arrival_s=send_s[r.request_id])
        if math.isfinite(send_s.get(r.request_id, math.nan))
        else r
        for r in inner.requests
    ]
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(
        inner.name,
        tuple(requests),
        source=f"{inner.source}; arrivals: the send times recorded in {run_dir}",
        counters=dict(inner.counters),
        max_concurrency=None,  # the send times already carry any client-side cap
    )


def _send_times(run_dir: Path) -> dict[str, float]:
    path = run_dir / "requests.parquet"
    try:
        frame = pd.read_parquet(path, columns=["request_id", "first_scheduled_s"])
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"live_run: {path}: cannot read the send times: {exc}") from None
    return dict(zip(frame["request_id"].astype(str), frame["first_scheduled_s"].astype(float)))


# --------------------------------------------------------------------------- configuration
def twin_config(
    live_config: DictConfig,
    live_dir: Path,
    limits: ServerLimits,
    hardware: DictConfig | None,
    kv_dtype: str | None,
    out: Path,
) -> DictConfig:
    """The twin's run config: the live config with the paged engine sized like the server,
    ``recorded_arrivals`` as workload, simulation mode, results at ``out/TWIN_RUN_ID``.
    Pure (reads the shipped paged preset)."""
    cfg = live_config.copy()
    engine = OmegaConf.load(Path(str(resources.files("kvbench.conf").joinpath("engine", "paged.yaml"))))
    engine.name = "twin"
    engine.block_size = limits.block_size
    engine.num_blocks = limits.num_blocks - 1  # vLLM's null block is never usable
    engine.kv_memory_bytes = None
    engine.max_num_seqs = limits.max_num_seqs
    engine.max_num_batched_tokens = limits.max_num_batched_tokens
    engine.chunked_prefill = limits.chunked_prefill
    engine.prefix_cache = "block_hash" if limits.enable_prefix_caching else "none"
    engine.preemption = "recompute"
    engine.victim_policy = "newest"
    engine.register_blocks = "on_schedule"  # vLLM caches a block when it schedules the tokens filling it
    cfg.engine = engine
    cfg.workload = OmegaConf.create({"_target_": f"{__name__}.recorded_arrivals", "live_run": str(live_dir)})
    if hardware is not None:
        cfg.hardware = hardware
    cfg.run.mode = "sim"
    cfg.run.kv_dtype = kv_dtype
    cfg.run.results_dir = str(out.parent)
    cfg.run.sweep_name = out.name
    cfg.run.run_id = TWIN_RUN_ID
    cfg.run.resume = False
    cfg.run.report = False
    cfg.run.progress = "off"
    return cfg


def load_hardware(name_or_path: str) -> DictConfig:
    """A hardware profile: a YAML file, a preset of kvbench.conf/hardware, or a profile
    ``kvbench calibrate`` wrote (``kvbench.config.user_hardware_dir()``; shipped presets win
    on a name clash, as for ``hardware=NAME``). Raises TwinError naming the argument."""
    from kvbench.config import user_hardware_dir

    path = Path(name_or_path)
    if not path.is_file():
        results.check_path_component(name_or_path, "--hardware")
        path = Path(str(resources.files("kvbench.conf").joinpath("hardware", f"{name_or_path}.yaml")))
        if not path.is_file():
            path = user_hardware_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        raise TwinError(
            f"--hardware: {name_or_path!r} is neither a YAML file, a preset in conf/hardware/ "
            f"nor a calibrated profile in {user_hardware_dir()}"
        )
    try:
        node = OmegaConf.load(path)
    except (OSError, ValueError) as exc:
        raise TwinError(f"--hardware: {path}: cannot read: {exc}") from None
    if not isinstance(node, DictConfig):
        raise TwinError(f"--hardware: {path}: not a mapping of HardwareSpec fields")
    return node


# --------------------------------------------------------------------------- comparison
def relative_error(live: float, twin: float) -> float:
    """(twin - live) / live; 0 when both are 0, +-inf when only live is 0, NaN if either is."""
    if math.isnan(live) or math.isnan(twin):
        return math.nan
    if live == 0:
        return 0.0 if twin == 0 else math.copysign(math.inf, twin)
    return (twin - live) / live


def usage_at(steps: pd.DataFrame, t_s: np.ndarray) -> np.ndarray:
    """The twin's KV usage (allocated / capacity bytes: blocks held by sequences over the
    pool) at times ``t_s``: that of the step running at each time, 0 between steps (the
    simulated clock jumps only over time when nothing runs). Pure."""
    t_s = np.asarray(t_s, dtype=float)
    if steps.empty:
        return np.zeros_like(t_s)
    start = steps["start_s"].to_numpy(dtype=float)
    end = steps["end_s"].to_numpy(dtype=float)
    allocated = steps["kv_allocated_bytes"].to_numpy(dtype=float)
    usage = allocated / steps["kv_capacity_bytes"].to_numpy(dtype=float)
    index = np.searchsorted(start, t_s, side="right") - 1
    inside = (index >= 0) & (t_s < end[np.clip(index, 0, None)])
    return np.where(inside, usage[np.clip(index, 0, None)], 0.0)


def latency_figures(requests: pd.DataFrame, sent_column: str) -> dict[str, float]:
    """TTFT and TPOT mean / median / p99 in ms over completed requests, measured from
    ``sent_column`` (kvbench.metrics ``per_request`` with that column as arrival). Pure."""
    frame = requests.assign(arrival_s=requests[sent_column].astype(float))
    latencies = per_request(frame)
    out: dict[str, float] = {}
    for metric in ("ttft_ms", "tpot_ms"):
        values = latencies[metric].to_numpy(dtype=float)
        values = values[np.isfinite(values)]
        for stat, fn in (("mean", np.mean), ("median", np.median), ("p99", lambda v: np.percentile(v, 99))):
            out[f"{metric}_{stat}"] = float(fn(values)) if len(values) else math.nan
    return out


def compare(
    live_summary: Mapping[str, Any],
    live_requests: pd.DataFrame,
    live_server_metrics: pd.DataFrame,
    twin_summary: Mapping[str, Any],
    twin_requests: pd.DataFrame,
    twin_steps: pd.DataFrame,
) -> list[ComparisonRow]:
    """Predicted against measured (see the module docstring for what is compared). Pure."""

    def number(summary: Mapping[str, Any], key: str) -> float:
        value = summary.get(key)
        return math.nan if value is None else float(value)

    done = twin_requests[completed_mask(twin_requests).to_numpy()]
    scrapes = live_server_metrics
    if "error" in scrapes:
        scrapes = scrapes[(scrapes["error"].fillna("").astype(str) == "").to_numpy()]
    t_s = scrapes["t_s"].to_numpy(dtype=float) if "t_s" in scrapes else np.array([])
    sampled = server_summary(
        pd.DataFrame({"t_s": t_s, "kv_usage_fraction": usage_at(twin_steps, t_s), "error": ""})
    ).metrics
    live_latency = latency_figures(live_requests, "first_scheduled_s")
    twin_latency = latency_figures(twin_requests, "arrival_s")
    rows = [
        (
            "prefix_query_tokens",
            "tokens",
            number(live_summary, "server_prefix_query_tokens"),
            float(done["num_prompt_tokens"].sum()),
            "live: vllm:prefix_cache_queries (first admissions); twin: prompt tokens of completed requests",
        ),
        (
            "prefix_hit_tokens",
            "tokens",
            number(live_summary, "server_prefix_hit_tokens"),
            number(twin_summary, "num_cached_prompt_tokens"),
            "live: vllm:prefix_cache_hits (first admissions); twin: num_cached_prompt_tokens",
        ),
        (
            "num_preemptions",
            "count",
            number(live_summary, "server_num_preemptions"),
            number(twin_summary, "num_preemptions"),
            "live: vllm:num_preemptions; twin: num_preemptions",
        ),
        (
            "kv_usage_peak",
            "fraction",
            number(live_summary, "server_kv_usage_peak"),
            sampled.get("server_kv_usage_peak", math.nan),
            f"both at the {len(t_s)} scrape times; twin every step: "
            f"{number(twin_summary, 'kv_peak_utilization'):.3f}",
        ),
        (
            "kv_usage_mean",
            "fraction",
            number(live_summary, "server_kv_usage_mean"),
            sampled.get("server_kv_usage_mean", math.nan),
            "time-weighted over the scrape times, each value held until the next",
        ),
    ]
    rows += [
        (name, "ms", live_latency[name], twin_latency[name], "from the send time, completed requests")
        for name in live_latency
    ]
    return [
        ComparisonRow(metric, unit, live, twin, relative_error(live, twin), GOALS.get(metric, math.nan), note)
        for metric, unit, live, twin, note in rows
    ]


def format_table(rows: Sequence[ComparisonRow]) -> str:
    """The comparison as an aligned text table (what the terminal shows)."""
    lines = [f"{'metric':<22}{'live':>14}{'twin':>14}{'error':>10}{'goal':>8}  within"]
    for row in rows:
        verdict = {None: "-", True: "yes", False: "no"}[row.within_goal]
        goal = "" if math.isnan(row.goal) else f"{row.goal:.0%}"
        lines.append(
            f"{row.metric:<22}{_figure(row.live):>14}{_figure(row.twin):>14}"
            f"{_percent(row.rel_error):>10}{goal:>8}  {verdict}"
        )
    return "\n".join(lines)


def _figure(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if value == int(value) and abs(value) >= 10:
        return f"{int(value):,}"
    return f"{value:.4g}"


def _percent(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "inf"
    return f"{value:+.1%}"


# --------------------------------------------------------------------------- files
def check_comparison_file(path: Path) -> None:
    """Raise TwinError unless ``path`` is absent or a twin.json an earlier twin wrote. Reads only."""
    if not os.path.lexists(path):
        return
    try:
        mine = path.is_file() and not path.is_symlink() and MARKER_KEY in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        mine = False
    if not mine:
        raise TwinError(f"{path}: exists and was not written by kvbench twin; choose another --out")


def write_comparison(out: Path, rows: Sequence[ComparisonRow], meta: Mapping[str, Any]) -> None:
    """``out/twin.json`` (meta + rows) and ``out/twin.parquet`` (rows), each atomically."""
    table = pd.DataFrame([dataclasses.asdict(r) for r in rows])
    document = {
        MARKER_KEY: 1,
        **meta,
        "rows": [{k: _json_value(v) for k, v in dataclasses.asdict(r).items()} for r in rows],
    }
    text = json.dumps(document, indent=2, default=str)
    results.replace_file(out / COMPARISON_JSON, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    results.replace_file(out / COMPARISON_PARQUET, lambda tmp: table.to_parquet(tmp, index=False))


def _json_value(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def run_twin(
    live_dir: Path, out: Path, hardware: str | None = None
) -> tuple[list[ComparisonRow], Path, dict[str, Any]]:
    """Replay ``live_dir`` as the twin into ``out`` and compare. Returns the rows, the twin's
    run directory and the comparison's meta. Raises TwinError, ConfigError or
    results.ResultsError naming the path or key; never writes inside ``live_dir``."""
    from kvbench.sweep import run_job

    live_dir = live_dir.resolve()
    out = out.resolve()
    if out == live_dir or live_dir in out.parents or out in live_dir.parents:
        raise TwinError(f"--out: {out} overlaps the live run {live_dir}; the twin never writes there")
    record = results.read_record(live_dir)
    meta = record["meta"]
    if meta.get("status") != "ok":
        raise TwinError(f"{live_dir}: the live run did not succeed (status {meta.get('status')!r})")
    log_path = live_dir / "server.log"
    log = log_path.read_text(errors="replace") if log_path.is_file() else ""
    try:
        limits = server_limits(meta, log)
    except ReconstructionError as exc:
        raise TwinError(f"{live_dir}: {exc}") from None
    check_comparison_file(out / COMPARISON_JSON)
    results.ensure_writable_dir(out)
    run_meta = meta.get("run") if isinstance(meta.get("run"), Mapping) else {}
    cfg = twin_config(
        OmegaConf.load(live_dir / "config.yaml"),
        live_dir,
        limits,
        load_hardware(hardware) if hardware else None,
        run_meta.get("kv_dtype"),
        out,
    )
    outcome = run_job(cfg)
    if outcome.status != "ok":
        raise TwinError(f"the twin's simulation failed: {outcome.error} (see {outcome.run_dir})")
    live = results.load(live_dir)
    twin = results.load(outcome.run_dir)
    rows = compare(
        record.get("summary", {}),
        live.requests,
        live.server_metrics,
        results.read_record(outcome.run_dir).get("summary", {}),
        twin.requests,
        twin.steps,
    )
    comparison_meta = {
        "live_run": str(live_dir),
        "twin_run": str(outcome.run_dir),
        "hardware": str(cfg.hardware.name),
        "server": {k: v for k, v in dataclasses.asdict(limits).items() if k != "sources"},
        "sources": dict(limits.sources),
        "twin_num_blocks": limits.num_blocks - 1,
    }
    write_comparison(out, rows, comparison_meta)
    return rows, outcome.run_dir, comparison_meta


def main(argv: list[str] | None = None) -> int:
    """``kvbench twin LIVE_RUN_DIR [--hardware NAME_OR_YAML] [--out DIR]``; the exit code."""
    parser = argparse.ArgumentParser(
        prog="kvbench twin",
        description="Replay a live-server run (engine=vllm_cpu / endpoint) through kvbench's paged engine "
        "in simulation, with the server's pool and limits and the recorded send times, and compare "
        "prefix-cache hits, preemptions, KV usage, TTFT and TPOT side by side.",
    )
    parser.add_argument("live_run", help="the live run's directory (results/<sweep>/<run-id>)")
    parser.add_argument(
        "--hardware",
        default=None,
        help="hardware profile for the timing: a preset name (e.g. one kvbench calibrate wrote) or a YAML "
        "file (default: the live run's own profile, uncalibrated)",
    )
    parser.add_argument(
        "--out", default=None, help="output directory (default: results/twin/<live run directory name>)"
    )
    args = parser.parse_args(argv)
    live_dir = Path(args.live_run)
    try:
        default = (
            Path("results") / "twin" / results.check_path_component(live_dir.resolve().name, "LIVE_RUN_DIR")
        )
        out = Path(args.out) if args.out else default
        rows, twin_dir, _ = run_twin(live_dir, out, args.hardware)
    except (TwinError, ConfigError, results.ResultsError) as exc:
        print(f"kvbench twin: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    print(f"twin run: {twin_dir}\nwrote {out / COMPARISON_JSON} and {out / COMPARISON_PARQUET}")
    return 0
