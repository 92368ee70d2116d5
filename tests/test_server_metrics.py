"""The server-metrics parser on vLLM's real /metrics text, SGLang's and llama.cpp's documented
names, and the scraper's one-screen errors. The live scrape is in test_server_metrics_live.py."""

from __future__ import annotations

import http.server
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbench import server_metrics
from kvbench.server_metrics import (
    LLAMACPP,
    SGLANG,
    VLLM,
    ServerMetricsError,
    ServerMetricsScraper,
    parse_metrics,
)

FIXTURES = Path(__file__).parent / "fixtures" / "server_metrics"

# Hand-written, NOT captured: no SGLang server is installable here. The names, types and
# labels follow SGLang's production-metrics documentation (docs.sglang.io, "Production
# Metrics"), with two data-parallel ranks to exercise the label-set combination.
SGLANG_TEXT = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 0.28
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="1"} 0.12
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 0.5
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="1"} 0.25
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 7.0
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="1"} 3.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 2.0
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="1"} 0.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.35e+06
sglang:time_to_first_token_seconds_bucket{le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
"""

# Hand-written, NOT captured: no llama.cpp server here. The names follow the "Available
# metrics" list of llama.cpp's tools/server/README.md (`llama-server --metrics`), unlabelled.
LLAMACPP_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 3469
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 2.37151
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.375
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 1536
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def _values(text: str) -> dict[str, float]:
    return parse_metrics(text).values


# --------------------------------------------------------------------------- parser
def test_vllm_captured_text_while_requests_ran() -> None:
    parsed = parse_metrics((FIXTURES / "vllm_running.txt").read_text())
    assert parsed.kind is VLLM
    values = parsed.values
    assert values["num_running"] == 4 and values["num_waiting"] == 0
    assert values["kv_usage_fraction"] == pytest.approx(0.0012207776353537758)
    # The four prompts were 100..103 tokens: vLLM counts every prompt token as a query.
    assert values["prefix_query_tokens_total"] == 100 + 101 + 102 + 103
    assert values["prefix_hit_tokens_total"] == 0 and values["num_preemptions_total"] == 0
    assert math.isnan(values["prefix_hit_rate"])  # vLLM reports counters, not a rate
    facts = parsed.facts
    assert facts["block_size"] == 32 and facts["num_gpu_blocks"] == 16384
    assert facts["enable_prefix_caching"] is True and facts["kv_cache_memory_bytes"] == 1 << 30
    assert facts["num_gpu_blocks_override"] is None and facts["cache_dtype"] == "auto"


def test_vllm_captured_text_idle() -> None:
    values = _values((FIXTURES / "vllm_idle.txt").read_text())
    assert values["num_running"] == 0 and values["kv_usage_fraction"] == 0
    assert values["prefix_query_tokens_total"] == 0


def test_filtered_lines_parse_to_the_same_values() -> None:
    text = (FIXTURES / "vllm_running.txt").read_text()
    filtered = server_metrics._filter_lines(text, VLLM.sample_names())
    assert len(filtered) < len(text) // 20
    full, short = parse_metrics(text), parse_metrics(filtered, VLLM)
    assert short.values.keys() == full.values.keys()
    for column, value in full.values.items():
        assert short.values[column] == value or (math.isnan(value) and math.isnan(short.values[column]))
    assert short.facts == full.facts


def test_vllm_label_sets_are_summed_and_fractions_averaged() -> None:
    # Two data-parallel engines; the older V0 name for the KV usage gauge.
    text = """\
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 60.0
"""
    values = _values(text)
    assert values["num_running"] == 5 and values["num_waiting"] == 1
    assert values["kv_usage_fraction"] == pytest.approx(0.375)
    assert values["prefix_query_tokens_total"] == 160
    assert math.isnan(values["prefix_hit_tokens_total"])  # not in the text


def test_sglang_documented_names() -> None:
    parsed = parse_metrics(SGLANG_TEXT)
    assert parsed.kind is SGLANG and parsed.facts == {}
    values = parsed.values
    assert values["kv_usage_fraction"] == pytest.approx(0.2)  # mean of the two ranks
    assert values["prefix_hit_rate"] == pytest.approx(0.375)
    assert values["num_running"] == 10 and values["num_waiting"] == 2
    for column in ("prefix_query_tokens_total", "prefix_hit_tokens_total", "num_preemptions_total"):
        assert math.isnan(values[column]) and column in SGLANG.not_reported


def test_llamacpp_documented_names() -> None:
    parsed = parse_metrics(LLAMACPP_TEXT)
    assert parsed.kind is LLAMACPP
    values = parsed.values
    assert values["kv_usage_fraction"] == 0.375
    assert values["num_running"] == 2 and values["num_waiting"] == 1
    for column in ("prefix_query_tokens_total", "prefix_hit_rate", "num_preemptions_total"):
        assert math.isnan(values[column]) and column in LLAMACPP.not_reported


def test_text_of_no_known_server_or_not_prometheus_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no vLLM .* metrics in the text; it has e.g. process_cpu"):
        parse_metrics("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n")
    with pytest.raises(ValueError, match="it is empty"):
        parse_metrics("")
    with pytest.raises(ValueError):
        parse_metrics("<html><body>Not Found</body></html>")


# --------------------------------------------------------------------------- scraper errors
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Page(http.server.BaseHTTPRequestHandler):
    """A plain web server (not an inference server): a page at / and 404 elsewhere."""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        found = self.path == "/"
        body = b"<html><body><h1>My web site</h1></body></html>" if found else b"no such page"
        self.send_response(200 if found else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def web_page() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_unreachable_server_fails_at_entry_naming_the_url() -> None:
    url = f"http://127.0.0.1:{_free_port()}/metrics"
    start = time.monotonic()
    with pytest.raises(ServerMetricsError) as err, ServerMetricsScraper(url, clock=time.perf_counter):
        pytest.fail("entered without a server")
    message = str(err.value)
    assert url in message and "cannot reach" in message and len(message.splitlines()) == 1
    assert time.monotonic() - start < 5


def test_a_web_page_is_not_metrics(web_page: str) -> None:
    with pytest.raises(ServerMetricsError, match=rf"{web_page}/ is not a supported server's Prometheus"):
        ServerMetricsScraper(f"{web_page}/", clock=time.perf_counter).__enter__()
    with pytest.raises(
        ServerMetricsError, match=rf"GET {web_page}/metrics returned HTTP 404: 'no such page'"
    ):
        ServerMetricsScraper(f"{web_page}/metrics", clock=time.perf_counter).__enter__()


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        ServerMetricsScraper("http://127.0.0.1:1/metrics", interval_s=0, clock=time.perf_counter)
