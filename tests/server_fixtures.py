"""Scrape frames as ``ServerMetricsScraper.frame()`` returns them, built by hand for the metrics,
results and report tests (the live scrape is tested in test_server_metrics_live.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from run_fixtures import config_yaml, synthetic_run

from kvbench import metrics, results
from kvbench.server_metrics import FRAME_COLUMNS, VALUE_COLUMNS


def server_frame(
    t_s: Sequence[float],
    *,
    kind: str = "vllm",
    errors: Sequence[str] | None = None,
    **columns: Sequence[float],
) -> pd.DataFrame:
    """A scrape frame: ``columns`` (canonical names) per scrape, NaN for the rest."""
    frame = pd.DataFrame({"t_s": np.asarray(t_s, dtype=float)})
    for column in VALUE_COLUMNS:
        frame[column] = np.asarray(columns.get(column, [math.nan] * len(frame)), dtype=float)
    frame["server_kind"] = kind
    frame["error"] = list(errors) if errors is not None else [""] * len(frame)
    return frame[list(FRAME_COLUMNS)]


def scraped_run(run_id: str, seed: int = 0) -> tuple[pd.DataFrame, ...]:
    """A synthetic run with prefix hits and the scrape frame a vLLM would have given over it:
    (requests, steps, memory, server) and its meta as the last element."""
    requests, steps, memory, meta = synthetic_run(run_id, "paged", 32, seed=seed, prefix_hit_fraction=0.5)
    end_s = float(requests["finish_s"].max())
    t_s = np.linspace(0.0, end_s + 0.1, 24)
    in_flight = np.array(
        [((requests["arrival_s"] <= t) & (requests["finish_s"] > t)).sum() for t in t_s], dtype=float
    )
    arrived = np.array([requests.loc[requests["arrival_s"] <= t, "num_prompt_tokens"].sum() for t in t_s])
    hits = np.array([requests.loc[requests["arrival_s"] <= t, "num_cached_tokens"].sum() for t in t_s])
    server = server_frame(
        t_s,
        kv_usage_fraction=in_flight / 16,
        num_running=np.minimum(in_flight, 4),
        num_waiting=np.maximum(in_flight - 4, 0),
        prefix_query_tokens_total=1000 + arrived,  # the server had served 1000 tokens before
        prefix_hit_tokens_total=200 + hits,
        num_preemptions_total=np.zeros(len(t_s)),
    )
    return requests, steps, memory, server, meta


def write_scraped_run(run_dir: Path, run_id: str, seed: int = 0) -> Path:
    """``scraped_run`` summarised and written with its server frame and a server log."""
    requests, steps, memory, server, meta = scraped_run(run_id, seed)
    summary = metrics.summarize_run(requests, steps, meta, memory, server_metrics=server)
    log = run_dir.parent / f"{run_id}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"INFO server for {run_id} <b>started</b>\n")
    return results.write_run(
        run_dir,
        requests,
        steps,
        memory,
        meta,
        config_yaml(meta),
        summary.metrics,
        summary.missing,
        extra_frames={"server_metrics": server},
        attachments={"server.log": log},
    )
