"""The README's twin-vs-live table: calibrate on one live workload, run another under
pressure against the same server configuration, replay it through ``kvbench twin``,
and print the comparison as Markdown.

    python scripts/twin_table.py [--results DIR] [--reuse]

Three live runs of kvbench's exported tiny-gqa (vocab 1,024) on vLLM's CPU server, each
launched by ``kvbench run engine=vllm_cpu`` (so .venv-vllm must exist; see
scripts/setup_vllm.sh), 32-token blocks:

- ``calibration``: ``workload=random`` (no shared prefixes), 32 requests at 16/s, on the
  pressured server configuration below; ``kvbench calibrate`` fits the cost model to its
  reconstructed server steps (kvbench.sim.live_steps). If too few steps can be
  reconstructed (the client received tokens in bursts), the twin runs uncalibrated and
  the table says so.
- ``chat1``: the issue's 32 ``workload=chat`` requests one at a time (large pool).
- ``pressure``: ``workload=prefix_repetition`` at 100 requests/s on 16 blocks.

Every figure printed comes from the runs' twin.json files; nothing is typed in.
``--reuse`` keeps live runs already complete under ``--results`` (kvbench's resume).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

TINY = ("model=tiny-gqa", "model.vocab_size=1024")
PRESSURE = (
    "engine.server_args.num_gpu_blocks_override=16",
    "+engine.server_args.max_model_len=256",
)
RUNS: dict[str, tuple[str, ...]] = {
    "calibration": ("workload=random", "workload.arrival.rate_per_s=16", *PRESSURE),
    "chat1": ("workload=chat", "engine.max_concurrency=1"),
    "pressure": ("workload=prefix_repetition", "workload.arrival.rate_per_s=100", *PRESSURE),
}
LABELS = {
    "prefix_hit_tokens": "prefix-hit tokens",
    "num_preemptions": "preemptions",
    "kv_usage_peak": "KV usage peak (at scrapes)",
    "kv_usage_mean": "KV usage mean (at scrapes)",
    "ttft_ms_mean": "TTFT mean (ms)",
    "ttft_ms_median": "TTFT median (ms)",
    "ttft_ms_p99": "TTFT p99 (ms)",
    "tpot_ms_mean": "TPOT mean (ms)",
    "tpot_ms_median": "TPOT median (ms)",
    "tpot_ms_p99": "TPOT p99 (ms)",
}


def kvbench(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvbench ARGS`` with its output shown on stderr."""
    done = subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True)
    sys.stderr.write(done.stdout + done.stderr)
    return done


def figure(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if float(value).is_integer() and abs(value) >= 10:
        return f"{int(value):,}"
    return f"{value:.3g}"


def error(value: float | None) -> str:
    if value is None:
        return "n/a"
    return "inf" if math.isinf(value) else f"{value:+.1%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results/twin_table", help="where the runs go")
    parser.add_argument("--reuse", action="store_true", help="keep complete live runs (resume)")
    args = parser.parse_args()
    results = Path(args.results)
    live_dirs = {}
    for name, overrides in RUNS.items():
        out = kvbench(
            "run",
            "engine=vllm_cpu",
            *TINY,
            *overrides,
            f"run.results_dir={results}",
            "run.sweep_name=live",
            f"run.run_id={name}",
            "run.progress=off",
            f"run.resume={'true' if args.reuse else 'false'}",
        )
        if out.returncode != 0:
            print(f"twin_table: live run {name} failed", file=sys.stderr)
            return 1
        live_dirs[name] = results / "live" / name
    profile = results / "calibrated.yaml"
    calibrated = kvbench("calibrate", str(live_dirs["calibration"]), "--out", str(profile), "--force")
    hardware = ("--hardware", str(profile)) if calibrated.returncode == 0 else ()
    documents = {}
    for name in ("chat1", "pressure"):
        out_dir = results / "twin" / name
        if kvbench("twin", str(live_dirs[name]), "--out", str(out_dir), *hardware).returncode != 0:
            print(f"twin_table: kvbench twin {name} failed", file=sys.stderr)
            return 1
        documents[name] = json.loads((out_dir / "twin.json").read_text())
    rows = {name: {r["metric"]: r for r in doc["rows"]} for name, doc in documents.items()}
    server = documents["pressure"]["server"]
    print(
        f"| metric | one at a time: vLLM | twin | under pressure ({server['num_blocks']} blocks): vLLM "
        "| twin | error | goal |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for metric, label in LABELS.items():
        a, b = rows["chat1"][metric], rows["pressure"][metric]
        goal = "" if b["goal"] is None else f"{b['goal']:.0%}"
        print(
            f"| {label} | {figure(a['live'])} | {figure(a['twin'])} | {figure(b['live'])} "
            f"| {figure(b['twin'])} | {error(b['rel_error'])} | {goal} |"
        )
    if hardware:
        print(f"\nTiming: hardware profile calibrated on the `calibration` run ({profile}).")
    else:
        reason = (calibrated.stderr.strip().splitlines() or ["?"])[-1]
        print(f"\nTiming: uncalibrated (`hardware=cpu`); calibration refused: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
