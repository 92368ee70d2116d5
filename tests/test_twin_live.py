"""``kvbench twin`` on real vLLM runs, each launched through kvbench itself
(``kvbench run engine=vllm_cpu``): the issue's 32 chat requests one at a time (the twin
must count vLLM's 4,000 hit tokens of 6,138 exactly) and a pressured pool with
concurrent arrivals (the comparison table must be complete and the prefix hits close).
Two server starts in all. Skipped without .venv-vllm, failed under CI=true
(tests/live_server.py). No timing is asserted: this machine's timing is not the point.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from live_server import require_vllm
from run_fixtures import run_kvbench

from kvbench.twin import GOALS

TINY = ("model=tiny-gqa", "model.vocab_size=1024")
METRICS = (
    "prefix_query_tokens",
    "prefix_hit_tokens",
    "num_preemptions",
    "kv_usage_peak",
    "kv_usage_mean",
    "ttft_ms_mean",
    "ttft_ms_median",
    "ttft_ms_p99",
    "tpot_ms_mean",
    "tpot_ms_median",
    "tpot_ms_p99",
)
# Prefix-hit tolerance under pressure (32 prefix_repetition requests at 100/s on 16
# blocks), asymmetric because the error has a direction. vLLM registers a block's hash when
# it schedules the tokens that fill it, so a request admitted in the same step as the one
# computing a shared prefix already hits it; the twin does the same
# (engine.register_blocks=on_schedule, pinned in tests/test_twin.py; the rule itself in
# tests/test_register_blocks.py). How many requests share a step depends on step time:
# a live server slowed by machine load has more requests waiting per step, so more of them
# hit, while the uncalibrated twin models unloaded steps. So the twin may under-count: eleven
# live runs on this 2-core machine measured vLLM 1,824-2,304 hit tokens against the twin's
# 1,696-1,792, errors -3.4 % to -11.3 % and one of -26.4 % (live 2,304) in a CI run. It
# never over-counted; the old symmetric bound (15 %) stays on that side.
PRESSURE_HIT_UNDERCOUNT = 0.30
PRESSURE_HIT_OVERCOUNT = 0.15


def live_then_twin(tmp_path: Path, *overrides: str) -> dict[str, dict[str, object]]:
    """``kvbench run engine=vllm_cpu OVERRIDES`` then ``kvbench twin`` on its run directory;
    returns the twin's rows by metric. The live run directory must be left as it was."""
    python = require_vllm()
    out = run_kvbench(
        "run",
        "engine=vllm_cpu",
        f"engine.python={python}",
        *TINY,
        f"run.results_dir={tmp_path / 'results'}",
        "run.sweep_name=live",
        "run.run_id=live",
        "run.progress=off",
        *overrides,
        cwd=tmp_path,
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    live_dir = tmp_path / "results" / "live" / "live"
    before = {p.name: p.stat().st_mtime_ns for p in live_dir.iterdir()}
    twin = run_kvbench("twin", str(live_dir), "--out", str(tmp_path / "twin"), cwd=tmp_path)
    assert twin.returncode == 0, (twin.stdout, twin.stderr)
    assert {p.name: p.stat().st_mtime_ns for p in live_dir.iterdir()} == before
    document = json.loads((tmp_path / "twin" / "twin.json").read_text())
    assert document["live_run"] == str(live_dir.resolve())
    rows = {row["metric"]: row for row in document["rows"]}
    assert tuple(rows) == METRICS
    assert all(name in twin.stdout for name in METRICS)
    return rows


def test_twin_counts_vllms_hits_on_the_chat_requests_one_at_a_time(tmp_path: Path) -> None:
    rows = live_then_twin(tmp_path, "workload=chat", "engine.max_concurrency=1")
    assert rows["prefix_query_tokens"]["live"] == rows["prefix_query_tokens"]["twin"] == 6138
    assert rows["prefix_hit_tokens"]["live"] == rows["prefix_hit_tokens"]["twin"] == 4000
    assert rows["num_preemptions"]["live"] == rows["num_preemptions"]["twin"] == 0


def test_twin_under_pressure_has_a_complete_table_and_close_prefix_hits(tmp_path: Path) -> None:
    # 16 blocks of 32 tokens (15 usable: vLLM keeps a null block) for prompts of 5 blocks
    # plus 32 output tokens, all 32 requests within ~0.3 s; vLLM needs max_model_len to
    # fit the usable pool.
    rows = live_then_twin(
        tmp_path,
        "workload=prefix_repetition",
        "workload.arrival.rate_per_s=100",
        "engine.server_args.num_gpu_blocks_override=16",
        "+engine.server_args.max_model_len=256",
    )
    for metric in METRICS:
        live, twin = rows[metric]["live"], rows[metric]["twin"]  # null in JSON: NaN
        assert live is not None and twin is not None and math.isfinite(live) and math.isfinite(twin), metric
        assert rows[metric]["goal"] == GOALS.get(metric)
    assert rows["prefix_query_tokens"]["live"] == rows["prefix_query_tokens"]["twin"] == 32 * 160
    live_preemptions = rows["num_preemptions"]["live"]
    assert (
        rows["num_preemptions"]["twin"] > 0
        and live_preemptions >= 0
        and live_preemptions == int(live_preemptions)
    )
    assert -PRESSURE_HIT_UNDERCOUNT <= rows["prefix_hit_tokens"]["rel_error"] <= PRESSURE_HIT_OVERCOUNT, rows
    # Both sampled peaks are bounded here. The live one is vLLM's KV-usage gauge at kvbench's
    # scrapes, which on CI's loaded 2-core machine has read 0 at every scrape while requests
    # ran (a CI run of this test: live peak 0.0, twin 0.93; see the README's "Live servers"
    # limit; tests/test_server_metrics_live.py checks the gauges only as scraped numbers for
    # the same reason). Then the running-requests gauge read 0 too: both come from one
    # scheduler snapshot, in which a running request holds at least one block, so a scrape
    # that saw a request running must see KV in use. The twin is sampled at those same
    # times, and its modeled run can fall between two of them when load spaces the scrapes
    # (a CI run: scrapes at 0.04 s and 0.68 s, every twin step between); its unsampled
    # every-step peak must be positive.
    assert 0 <= rows["kv_usage_peak"]["live"] <= 1 and 0 <= rows["kv_usage_peak"]["twin"] <= 1, rows
    scrapes = pd.read_parquet(tmp_path / "results" / "live" / "live" / "server_metrics.parquet")
    if (scrapes["num_running"] > 0).any():
        assert rows["kv_usage_peak"]["live"] > 0, (rows["kv_usage_peak"], scrapes)
        # vLLM preempted 4-7 times in four quiet runs, and in earlier CI runs. One loaded
        # CI run read 0 preemptions: its gauges read 0 at every scrape (its prefix
        # counters moving: 5,120 queries), three quarters of its 32 requests finished
        # within 25 ms of each other at 2.24 s, and the twin preempted 3 times. Whether
        # that server preempted cannot be told from outside, so only a run whose gauges
        # worked must show preemptions.
        assert live_preemptions > 0, (rows["num_preemptions"], scrapes)
    twin_steps = pd.read_parquet(tmp_path / "twin" / "sim" / "steps.parquet")
    assert 0 < (twin_steps["kv_allocated_bytes"] / twin_steps["kv_capacity_bytes"]).max() <= 1
    # Calibrating on a live run either fits reconstructed steps or says why it cannot.
    live_dir = tmp_path / "results" / "live" / "live"
    fitted = run_kvbench("calibrate", str(live_dir), "--out", str(tmp_path / "hw.yaml"), cwd=tmp_path)
    assert fitted.returncode == 0 or (
        fitted.returncode == 2 and "reconstructed server steps are reliable" in fitted.stderr
    ), (fitted.stdout, fitted.stderr)


@pytest.fixture(autouse=True)
def _needs_vllm() -> None:
    require_vllm()
