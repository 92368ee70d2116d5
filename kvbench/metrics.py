"""Derived metrics: raw run records (requests, steps, memory frames + meta) -> one summary.

Pure pandas/numpy; nothing here knows about engines or workloads. Serving metrics follow
vLLM's ``benchmarks/serve.py`` definitions; KV metrics follow the PagedAttention paper's
Fig. 2 split of KV memory into token state, reservation and fragmentation.

Every metric is listed in ``METRICS`` (name, unit, which direction is better, definition);
``metrics_markdown()`` renders that table for the README. A metric that cannot be computed
is NaN and ``Summary.missing`` says why -- never 0.

Requests counted as *completed* are those with no ``rejected_reason`` and a finite
``finish_s``; rejected and unfinished requests are excluded from latency statistics and
throughput numerators but counted in ``num_rejected`` / ``num_unfinished``.

Prefix reuse has two run-level figures that share one definition and so compare exactly:
``prefix_hit_rate_first_admission`` (what the engine's cache hit when each request was
first admitted) and ``prefix_reuse_upper_bound`` (what an unbounded cache could have hit
on the same requests, from their prompt token ids: ``prefix_reused_tokens``). The bound
needs the replayed requests (``summarize_run(..., workload_requests=...)``); the records
alone do not hold prompt token ids.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from kvbench.hashing import SeenKeys, prompt_block_keys

if TYPE_CHECKING:
    from kvbench.types import Request

LATENCY_KINDS: dict[str, str] = {
    "ttft": "time to first token: first_token_s - arrival_s",
    "tpot": "time per output token after the first, per request: (e2el - ttft) / (num_output_tokens - 1), "
    "requests with more than one output token only",
    "itl": "inter-token latency: gaps between consecutive token_times_s of a request, pooled over requests",
    "e2el": "end-to-end latency: finish_s - arrival_s",
}
LATENCY_STATS: tuple[str, ...] = ("mean", "median", "p90", "p99")

# Memory-frame columns summarised as their peak over the samples.
MEMORY_COLUMNS: tuple[str, ...] = (
    "rss_bytes",
    "nvml_used_bytes",
    "nvml_process_bytes",
    "torch_allocated_bytes",
    "torch_reserved_bytes",
)

REQUIRED_REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id",
    "arrival_s",
    "first_token_s",
    "finish_s",
    "token_times_s",
    "num_prompt_tokens",
    "num_output_tokens",
    "rejected_reason",
)
REQUIRED_STEP_COLUMNS: tuple[str, ...] = (
    "start_s",
    "end_s",
    "duration_s",
    "num_running",
    "num_prefill_tokens",
    "num_decode_tokens",
    "kv_allocated_bytes",
    "kv_token_bytes",
)


class MetricsError(ValueError):
    """Raw records that cannot be summarised; the message names the frame and column."""


# Where a metric's value comes from, which decides how ``kvbench compare`` judges a change
# (``is_timed``): exactly (within a gate's threshold) when the value is a function of the
# workload, engine and config; with repeats and a bootstrap interval when it is timed.
CONFIG = "config"  # a function of the workload, engine and config in every mode
# A function of the engine's schedule (KV state, hit rates, preemptions, concurrency):
# deterministic when the schedule is (sim mode; real mode with offline arrivals on
# kvbench's own engines), timed when arrivals follow the wall clock or a live server
# schedules on its own.
SCHEDULE = "schedule"
# Read off the run's clock (latencies, throughputs, step durations, duration-weighted
# means): the simulated clock in sim mode (deterministic), the wall clock in real mode.
CLOCK = "clock"
# A measurement of the machine in every mode (sampled process memory, CUDA-event copy
# timings, a live server's own counters): always timed.
HOST = "host"
METRIC_SOURCES: tuple[str, ...] = (CONFIG, SCHEDULE, CLOCK, HOST)


@dataclass(frozen=True)
class MetricDoc:
    """One documented metric. ``better`` is "lower", "higher" or "" (informational);
    ``source`` is one of METRIC_SOURCES."""

    name: str
    unit: str
    better: str
    definition: str
    source: str

    def __post_init__(self) -> None:
        if self.source not in METRIC_SOURCES:
            raise ValueError(
                f"metric {self.name}: source must be one of {METRIC_SOURCES}, got {self.source!r}"
            )


def is_timed(source: str, *, simulated: bool, wall_clock_schedule: bool) -> bool:
    """Whether a metric of ``source`` (METRIC_SOURCES) varies from run to run of one
    configuration, so that judging a change needs repeats.

    ``simulated``: the run used the simulated clock (``mode: sim``). ``wall_clock_schedule``:
    in real mode, the engine's schedule depends on when things happen (arrivals other than
    offline, a closed loop, a live server); ignored in sim mode. Pure.
    """
    if source == CONFIG:
        return False
    if source == HOST:
        return True
    if simulated:
        return False
    return source == CLOCK or wall_clock_schedule


def _latency_docs() -> list[MetricDoc]:
    docs = []
    for kind, definition in LATENCY_KINDS.items():
        for stat in LATENCY_STATS:
            docs.append(MetricDoc(f"{kind}_ms_{stat}", "ms", "lower", f"{stat} of {definition}", CLOCK))
    return docs


def _memory_docs() -> list[MetricDoc]:
    return [
        MetricDoc(f"mem_peak_{col}", "bytes", "lower", f"maximum sampled {col} (memory frame)", HOST)
        for col in MEMORY_COLUMNS
    ]


# From a live server's scraped /metrics (server_metrics.parquet, kvbench.server_metrics):
# counters as this run's deltas (last good scrape - the baseline taken before the first
# request), gauges over the run's scrapes.
SERVER_METRICS: tuple[MetricDoc, ...] = (
    MetricDoc(
        "server_prefix_query_tokens",
        "tokens",
        "",
        "live server: prompt tokens it looked up in its prefix cache during the run (vLLM "
        "vllm:prefix_cache_queries_total, last - first scrape)",
        HOST,
    ),
    MetricDoc(
        "server_prefix_hit_tokens",
        "tokens",
        "higher",
        "live server: of those, tokens found cached (vLLM vllm:prefix_cache_hits_total, last - first scrape)",
        HOST,
    ),
    MetricDoc(
        "server_prefix_hit_rate",
        "fraction",
        "higher",
        "live server: server_prefix_hit_tokens / server_prefix_query_tokens",
        HOST,
    ),
    MetricDoc(
        "server_num_preemptions",
        "count",
        "lower",
        "live server: preemptions during the run (vLLM vllm:num_preemptions_total, last - first scrape)",
        HOST,
    ),
    MetricDoc(
        "server_kv_usage_peak",
        "fraction",
        "",
        "live server: maximum scraped KV pool usage (vLLM vllm:kv_cache_usage_perc, SGLang "
        "sglang:token_usage, llama.cpp llamacpp:kv_cache_usage_ratio; 0..1)",
        HOST,
    ),
    MetricDoc(
        "server_kv_usage_mean",
        "fraction",
        "",
        "live server: time-weighted mean of the scraped KV pool usage (each scrape's value held "
        "until the next scrape)",
        HOST,
    ),
    MetricDoc(
        "server_num_running_peak",
        "count",
        "higher",
        "live server: maximum scraped number of running requests",
        HOST,
    ),
    MetricDoc(
        "server_num_waiting_peak",
        "count",
        "lower",
        "live server: maximum scraped number of queued (waiting) requests",
        HOST,
    ),
    MetricDoc(
        "server_num_counter_resets",
        "count",
        "lower",
        "live server: scrapes at which a cumulative counter fell (the server restarted); the "
        "counter deltas above are then NaN",
        HOST,
    ),
    MetricDoc(
        "server_num_scrape_errors",
        "count",
        "lower",
        "live server: scrapes of /metrics that failed (unreachable, HTTP error, not Prometheus text)",
        HOST,
    ),
)

METRICS: tuple[MetricDoc, ...] = (
    MetricDoc("num_requests", "count", "", "requests in the workload", CONFIG),
    MetricDoc(
        "num_completed", "count", "higher", "requests that finished (not rejected, finite finish_s)", SCHEDULE
    ),
    MetricDoc("num_rejected", "count", "lower", "requests with a non-empty rejected_reason", SCHEDULE),
    MetricDoc(
        "num_unfinished",
        "count",
        "lower",
        "requests neither rejected nor finished when the run ended",
        SCHEDULE,
    ),
    MetricDoc(
        "benchmark_duration_s",
        "s",
        "",
        "first arrival_s of any request to the last finish_s of a completed request",
        CLOCK,
    ),
    MetricDoc("requests_per_s", "1/s", "higher", "num_completed / benchmark_duration_s", CLOCK),
    MetricDoc(
        "output_tokens_per_s",
        "tokens/s",
        "higher",
        "sum of num_generated_tokens (every sample; num_output_tokens when absent) of completed "
        "requests / benchmark_duration_s",
        CLOCK,
    ),
    MetricDoc(
        "total_tokens_per_s",
        "tokens/s",
        "higher",
        "(prompt + generated tokens of completed requests) / benchmark_duration_s",
        CLOCK,
    ),
    MetricDoc(
        "goodput_requests_per_s",
        "1/s",
        "higher",
        "completed requests meeting every SLO in meta['slo'] (ttft_ms, tpot_ms, e2el_ms; a request "
        "with one output token has no TPOT and passes that SLO) / benchmark_duration_s",
        CLOCK,
    ),
    MetricDoc(
        "slo_attained_fraction",
        "fraction",
        "higher",
        "completed requests meeting every SLO / completed",
        CLOCK,
    ),
    *_latency_docs(),
    MetricDoc(
        "peak_num_running",
        "count",
        "higher",
        "maximum num_running over steps (concurrency reached)",
        SCHEDULE,
    ),
    MetricDoc(
        "mean_num_running", "count", "higher", "duration-weighted mean of num_running over steps", CLOCK
    ),
    MetricDoc(
        "kv_capacity_bytes", "bytes", "", "maximum kv_capacity_bytes over steps (the KV pool budget)", CONFIG
    ),
    MetricDoc("kv_peak_allocated_bytes", "bytes", "lower", "maximum kv_allocated_bytes over steps", SCHEDULE),
    MetricDoc(
        "kv_mean_allocated_bytes", "bytes", "lower", "duration-weighted mean of kv_allocated_bytes", CLOCK
    ),
    MetricDoc("kv_peak_token_bytes", "bytes", "", "maximum kv_token_bytes over steps", SCHEDULE),
    MetricDoc("kv_mean_token_bytes", "bytes", "", "duration-weighted mean of kv_token_bytes", CLOCK),
    MetricDoc("kv_peak_utilization", "fraction", "", "kv_peak_allocated_bytes / kv_capacity_bytes", SCHEDULE),
    MetricDoc(
        "kv_token_fraction_mean",
        "fraction",
        "higher",
        "PagedAttention Fig. 2 measure: sum(kv_token_bytes * dt) / sum((kv_allocated_bytes + "
        "kv_external_frag_bytes) * dt) over steps, dt = duration_s: the share of the KV memory the "
        "manager holds (allocated plus unusable holes; usable free memory excluded) that stores real "
        "token state",
        CLOCK,
    ),
    MetricDoc(
        "kv_token_fraction_at_peak",
        "fraction",
        "higher",
        "kv_token_bytes / (kv_allocated_bytes + kv_external_frag_bytes) at the step of peak allocation",
        SCHEDULE,
    ),
    MetricDoc(
        "kv_reserved_unused_bytes_mean",
        "bytes",
        "lower",
        "duration-weighted mean of slots reserved for tokens a sequence will still produce",
        CLOCK,
    ),
    MetricDoc(
        "kv_internal_frag_bytes_mean",
        "bytes",
        "lower",
        "duration-weighted mean of kv_internal_frag_bytes",
        CLOCK,
    ),
    MetricDoc(
        "kv_external_frag_bytes_mean",
        "bytes",
        "lower",
        "duration-weighted mean of kv_external_frag_bytes",
        CLOCK,
    ),
    MetricDoc(
        "kv_reserved_unused_bytes_at_peak",
        "bytes",
        "lower",
        "kv_reserved_unused_bytes at peak allocation",
        SCHEDULE,
    ),
    MetricDoc(
        "kv_internal_frag_bytes_at_peak",
        "bytes",
        "lower",
        "kv_internal_frag_bytes at peak allocation",
        SCHEDULE,
    ),
    MetricDoc(
        "kv_external_frag_bytes_at_peak",
        "bytes",
        "lower",
        "kv_external_frag_bytes at peak allocation",
        SCHEDULE,
    ),
    MetricDoc(
        "kv_peak_host_bytes", "bytes", "", "maximum kv_host_bytes (KV resident in the host tier)", SCHEDULE
    ),
    MetricDoc(
        "kv_sharing_saved_fraction",
        "fraction",
        "higher",
        "1 - sum(peak_kv_slots) / sum(peak_kv_slots_unshared) over completed requests: KV saved by "
        "sharing prompt/prefix blocks between samples or beams (PagedAttention Fig. 15)",
        SCHEDULE,
    ),
    MetricDoc(
        "prefix_hit_rate",
        "fraction",
        "higher",
        "sum(num_prefix_hit_tokens) / sum(num_prefix_query_tokens) over steps, in tokens; every "
        "admission counts, so a request re-admitted after a recompute preemption re-hits its own "
        "prefix and the rate can exceed prefix_reuse_upper_bound",
        SCHEDULE,
    ),
    MetricDoc(
        "prefix_hit_rate_first_admission",
        "fraction",
        "higher",
        "sum(num_cached_tokens) / sum(num_prompt_tokens) over completed requests: prompt tokens the "
        "prefix cache supplied when each request was first admitted (the last prompt token is "
        "always computed); NaN when the run made no prefix lookups. Comparable with "
        "prefix_reuse_upper_bound",
        SCHEDULE,
    ),
    MetricDoc(
        "prefix_reuse_upper_bound",
        "fraction",
        "",
        "the same ratio for an unbounded prefix cache with the engine's block_size: per completed "
        "request, the tokens of its leading full blocks within the first num_prompt_tokens - 1 "
        "whose chained key (tokens and cache_salt) appeared in an earlier-arriving replayed prompt, "
        "summed, / their prompt tokens (prompt blocks only; a radix index, token-granular, may "
        "exceed it by < block_size tokens per request); NaN unless the replayed requests reach "
        "summarize_run",
        CONFIG,
    ),
    MetricDoc(
        "num_cached_prompt_tokens",
        "tokens",
        "higher",
        "sum of num_cached_tokens over completed requests",
        SCHEDULE,
    ),
    MetricDoc("num_preemptions", "count", "lower", "sum of num_preemptions over steps", SCHEDULE),
    MetricDoc(
        "num_recomputed_tokens", "tokens", "lower", "sum of num_recomputed_tokens over steps", SCHEDULE
    ),
    MetricDoc(
        "num_evicted_blocks",
        "count",
        "",
        "prefix-cache blocks evicted to make room (sum over steps)",
        SCHEDULE,
    ),
    MetricDoc(
        "num_evicted_tokens", "tokens", "", "tokens dropped by lossy eviction (H2O, streaming)", SCHEDULE
    ),
    MetricDoc("bytes_to_host", "bytes", "lower", "sum of bytes_to_host over steps", SCHEDULE),
    MetricDoc("bytes_from_host", "bytes", "lower", "sum of bytes_from_host over steps", SCHEDULE),
    MetricDoc(
        "modeled_transfer_s",
        "s",
        "lower",
        "sum of modeled_transfer_s over steps: host<->device bytes over the hardware profile's PCIe "
        "bandwidth (a model, not a measurement)",
        SCHEDULE,
    ),
    MetricDoc(
        "measured_transfer_s",
        "s",
        "lower",
        "sum of measured_transfer_s over steps: host<->device copy time timed with CUDA events (GPU only)",
        HOST,
    ),
    MetricDoc(
        "fetch_recall_mean",
        "fraction",
        "higher",
        "offload: mean over steps that fetched of the recall of the true top attention tokens among "
        "host-resident ones by the speculative fetch",
        SCHEDULE,
    ),
    MetricDoc(
        "decode_roofline_ms_mean",
        "ms",
        "",
        "mean over decode-only steps (no prefill tokens, some decode tokens) of the minimum step time "
        "(weight_bytes + kv_token_bytes) / (hardware.hbm_bandwidth_gbps * 1e9); kv_token_bytes "
        "approximates the KV bytes read that step",
        SCHEDULE,
    ),
    MetricDoc("decode_step_ms_mean", "ms", "lower", "mean duration_s of decode-only steps", CLOCK),
    MetricDoc(
        "decode_roofline_fraction_mean",
        "fraction",
        "higher",
        "mean over decode-only steps of roofline time / measured (or modeled) step duration",
        CLOCK,
    ),
    MetricDoc(
        "decode_achieved_gbps",
        "GB/s",
        "higher",
        "sum of (weight_bytes + kv_token_bytes) over decode-only steps / sum of their durations / 1e9",
        CLOCK,
    ),
    *_memory_docs(),
    *SERVER_METRICS,
)

METRICS_BY_NAME: dict[str, MetricDoc] = {doc.name: doc for doc in METRICS}


def metrics_markdown() -> str:
    """The METRICS table as a GitHub markdown table (for the README)."""
    lines = ["| metric | unit | better | source | definition |", "|---|---|---|---|---|"]
    for doc in METRICS:
        lines.append(f"| `{doc.name}` | {doc.unit} | {doc.better or '-'} | {doc.source} | {doc.definition} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Summary:
    """Summary metrics of one run plus, for every NaN metric, why it could not be computed."""

    metrics: dict[str, float]
    missing: dict[str, str]


# --------------------------------------------------------------------------- per request
def completed_mask(requests: pd.DataFrame) -> pd.Series:
    """Boolean Series: not rejected and finished (finite finish_s)."""
    rejected = requests["rejected_reason"].fillna("").astype(str) != ""
    return ~rejected & np.isfinite(requests["finish_s"].astype(float))


def per_request(requests: pd.DataFrame, *, itl: bool = True) -> pd.DataFrame:
    """Latencies per request: a new frame with ``request_id``, ``completed``, ``ttft_ms``,
    ``tpot_ms`` (NaN when num_output_tokens <= 1), ``e2el_ms`` and, unless ``itl`` is
    False, ``itl_ms`` (list of gaps: a Python float per token, which a run of millions of
    requests cannot afford; ``pooled_itl_ms`` gives them all as one array).

    Does not mutate ``requests``. Rejected / unfinished requests get NaN latencies.
    Raises MetricsError naming a missing column.
    """
    _require(requests, REQUIRED_REQUEST_COLUMNS, "requests")
    done = completed_mask(requests).to_numpy()
    arrival = requests["arrival_s"].to_numpy(dtype=float)
    ttft_ms = (requests["first_token_s"].to_numpy(dtype=float) - arrival) * 1e3
    e2el_ms = (requests["finish_s"].to_numpy(dtype=float) - arrival) * 1e3
    num_out = requests["num_output_tokens"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot_ms = np.where(num_out > 1, (e2el_ms - ttft_ms) / (num_out - 1), np.nan)
    columns = {
        "request_id": requests["request_id"].to_numpy(),
        "completed": done,
        "ttft_ms": np.where(done, ttft_ms, np.nan),
        "tpot_ms": np.where(done, tpot_ms, np.nan),
        "e2el_ms": np.where(done, e2el_ms, np.nan),
    }
    if itl:
        columns["itl_ms"] = [gaps.tolist() for gaps in _itl_gaps_ms(requests, done)]
    return pd.DataFrame(columns)


def pooled_itl_ms(requests: pd.DataFrame) -> np.ndarray:
    """Every completed request's inter-token gaps in ms (float64 [gaps]), request by
    request in frame order: ``per_request``'s ``itl_ms`` lists joined, 8 bytes a gap.
    Pure; raises MetricsError naming a missing column."""
    _require(requests, REQUIRED_REQUEST_COLUMNS, "requests")
    gaps = [g for g in _itl_gaps_ms(requests, completed_mask(requests).to_numpy()) if len(g)]
    return np.concatenate(gaps) if gaps else np.empty(0)


def _itl_gaps_ms(requests: pd.DataFrame, done: np.ndarray) -> Iterator[np.ndarray]:
    """Per request, the gaps between its consecutive ``token_times_s`` in ms (float64;
    empty for a request not ``done`` or without times). Pure."""
    for ok, times in zip(done, requests["token_times_s"]):
        if ok and times is not None:
            yield np.diff(np.asarray(times, dtype=float)) * 1e3
        else:
            yield np.empty(0)


# --------------------------------------------------------------------------- summary
def summarize_run(
    requests: pd.DataFrame,
    steps: pd.DataFrame,
    meta: Mapping[str, Any],
    memory: pd.DataFrame | None = None,
    torch_peaks: Mapping[str, float] | None = None,
    workload_requests: Sequence[Request] | None = None,
    server_metrics: pd.DataFrame | None = None,
) -> Summary:
    """Every metric in METRICS for one run, with a reason for each NaN.

    ``torch_peaks`` (column -> bytes, e.g. ``MemorySampler.peaks()``) raises the sampled
    maxima to the allocator's own peaks, which see spikes between samples.
    ``meta`` supplies ``slo``, ``weight_bytes``, ``hardware.hbm_bandwidth_gbps``,
    ``block_size`` (the engine's, for ``prefix_reuse_upper_bound``) and ``missing``
    (reasons the runner already knows, e.g. why NVML columns are NaN).
    ``workload_requests`` are the requests the run replayed (``Workload.requests``, after
    every cap and scale): their prompt token ids give ``prefix_reuse_upper_bound``, NaN
    without them. ``server_metrics`` is a live server's scrape frame
    (``ServerMetricsScraper.frame()``) for the ``server_*`` metrics; None: not a live
    server run, and they are NaN. Mutates nothing; raises MetricsError naming the frame and column when a
    required column is absent, or naming a completed request absent from
    ``workload_requests``.
    """
    _require(requests, REQUIRED_REQUEST_COLUMNS, "requests")
    if len(steps):
        _require(steps, REQUIRED_STEP_COLUMNS, "steps")
    out: dict[str, float] = {}
    missing: dict[str, str] = {}
    _request_metrics(requests, meta, out, missing)
    _step_metrics(steps, out, missing)
    _roofline_metrics(steps, meta, out, missing)
    live = server_metrics is not None
    if live:
        # A live server's steps are the client's polls: its KV, preemptions and prefix
        # lookups are invisible there (0 would read as measured); the server_* metrics
        # carry them.
        for name in (*_ENGINE_INTERNAL_METRICS, *_ROOFLINE_METRICS):
            out.pop(name, None)
            missing[name] = _LIVE_REASON
    _prefix_reuse_metrics(requests, meta, workload_requests, out, missing, live=live)
    _sharing_metric(requests, out, missing)
    _memory_metrics(memory, meta, out, missing)
    server = server_summary(server_metrics, meta.get("missing"))
    out.update(server.metrics)
    missing.update(server.missing)
    for col, peak in (torch_peaks or {}).items():
        name = f"mem_peak_{col}"
        if peak == peak and (name not in out or not out[name] >= peak):
            out[name] = float(peak)
            missing.pop(name, None)
    known = meta.get("missing") or {}
    for doc in METRICS:  # every documented metric is present, NaN ones explained
        value = out.setdefault(doc.name, math.nan)
        if math.isnan(value):
            missing.setdefault(doc.name, known.get(doc.name) or "not computable from this run's records")
    return Summary(metrics=out, missing=missing)


def _require(frame: pd.DataFrame, columns: tuple[str, ...], name: str) -> None:
    absent = [c for c in columns if c not in frame.columns]
    if absent:
        raise MetricsError(f"{name} frame: missing column(s) {absent}; has {list(frame.columns)}")


def _stats(values: np.ndarray, prefix: str, out: dict[str, float], missing: dict[str, str], why: str) -> None:
    values = values[np.isfinite(values)]
    for stat in LATENCY_STATS:
        name = f"{prefix}_{stat}"
        if values.size == 0:
            out[name] = math.nan
            missing[name] = why
        elif stat == "mean":
            out[name] = float(np.mean(values))
        elif stat == "median":
            out[name] = float(np.median(values))
        else:
            out[name] = float(np.percentile(values, float(stat[1:])))


def _request_metrics(
    requests: pd.DataFrame, meta: Mapping[str, Any], out: dict[str, float], missing: dict[str, str]
) -> None:
    lat = per_request(requests, itl=False)
    done = lat["completed"].to_numpy()
    rejected = requests["rejected_reason"].fillna("").astype(str) != ""
    out["num_requests"] = float(len(requests))
    out["num_completed"] = float(done.sum())
    out["num_rejected"] = float(rejected.sum())
    out["num_unfinished"] = float((~done & ~rejected.to_numpy()).sum())

    no_done = "no completed requests"
    _stats(lat["ttft_ms"].to_numpy(), "ttft_ms", out, missing, no_done)
    _stats(lat["e2el_ms"].to_numpy(), "e2el_ms", out, missing, no_done)
    _stats(
        lat["tpot_ms"].to_numpy(),
        "tpot_ms",
        out,
        missing,
        "no completed request has more than one output token",
    )
    _stats(
        pooled_itl_ms(requests), "itl_ms", out, missing, "no completed request has two or more token times"
    )

    completed = requests[done]
    if len(completed) == 0:
        for name in ("benchmark_duration_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
            out[name] = math.nan
            missing[name] = no_done
    else:
        duration_s = float(completed["finish_s"].max() - requests["arrival_s"].min())
        out["benchmark_duration_s"] = duration_s
        generated_col = "num_generated_tokens" if "num_generated_tokens" in completed else "num_output_tokens"
        num_generated = float(completed[generated_col].sum())
        num_prompt = float(completed["num_prompt_tokens"].sum())
        if duration_s > 0:
            out["requests_per_s"] = len(completed) / duration_s
            out["output_tokens_per_s"] = num_generated / duration_s
            out["total_tokens_per_s"] = (num_generated + num_prompt) / duration_s
        else:
            for name in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
                out[name] = math.nan
                missing[name] = "benchmark duration is zero"
    if "num_cached_tokens" in requests:
        cached = pd.to_numeric(completed["num_cached_tokens"], errors="coerce")
        if cached.isna().any():
            out["num_cached_prompt_tokens"] = math.nan
            missing["num_cached_prompt_tokens"] = (
                f"{int(cached.isna().sum())} completed request(s) have no cached-token count "
                "(a live server that does not report usage.prompt_tokens_details.cached_tokens)"
            )
        else:
            out["num_cached_prompt_tokens"] = float(cached.sum())
    _goodput(lat[done], out, missing, meta.get("slo") or {})


def _goodput(
    lat: pd.DataFrame, out: dict[str, float], missing: dict[str, str], slo: Mapping[str, Any]
) -> None:
    limits = {key: slo.get(key) for key in ("ttft_ms", "tpot_ms", "e2el_ms") if slo.get(key) is not None}
    names = ("goodput_requests_per_s", "slo_attained_fraction")
    if not limits:
        for name in names:
            missing[name] = "no SLO given (meta.slo has none of ttft_ms, tpot_ms, e2el_ms)"
        return
    if len(lat) == 0 or not out.get("benchmark_duration_s", 0) > 0:
        for name in names:
            missing[name] = "no completed requests or zero benchmark duration"
        return
    good = np.ones(len(lat), dtype=bool)
    for key, limit in limits.items():
        values = lat[key].to_numpy()
        # TPOT is undefined for one-token outputs; such a request cannot violate a TPOT SLO.
        good &= np.isnan(values) | (values <= float(limit)) if key == "tpot_ms" else values <= float(limit)
    out["goodput_requests_per_s"] = float(good.sum()) / out["benchmark_duration_s"]
    out["slo_attained_fraction"] = float(good.mean())


def _weights(steps: pd.DataFrame) -> np.ndarray:
    """Per-step weights for time averages: duration_s, or uniform when durations are all zero."""
    dt = np.nan_to_num(steps["duration_s"].to_numpy(dtype=float), nan=0.0)
    return dt if dt.sum() > 0 else np.ones(len(steps))


def _col(steps: pd.DataFrame, name: str) -> np.ndarray:
    """A numeric step column as float; absent optional columns read as zeros."""
    if name not in steps:
        return np.zeros(len(steps))
    return steps[name].to_numpy(dtype=float)


# Step columns whose run total is the metric of the same name.
_SUMMED_STEP_METRICS: tuple[str, ...] = (
    "num_preemptions",
    "num_recomputed_tokens",
    "num_evicted_blocks",
    "num_evicted_tokens",
    "bytes_to_host",
    "bytes_from_host",
    "modeled_transfer_s",
)
_LIVE_REASON = (
    "live server: the client cannot see the server's engine steps (see the server_* metrics "
    "scraped from its /metrics)"
)
# Step metrics that describe the engine's own KV manager and scheduler (every step metric
# but the running counts, which for a live server are the client's requests in flight).
_ENGINE_INTERNAL_METRICS: tuple[str, ...] = (
    "kv_capacity_bytes",
    "kv_peak_allocated_bytes",
    "kv_mean_allocated_bytes",
    "kv_peak_token_bytes",
    "kv_mean_token_bytes",
    "kv_peak_utilization",
    "kv_token_fraction_mean",
    "kv_token_fraction_at_peak",
    "kv_reserved_unused_bytes_mean",
    "kv_internal_frag_bytes_mean",
    "kv_external_frag_bytes_mean",
    "kv_reserved_unused_bytes_at_peak",
    "kv_internal_frag_bytes_at_peak",
    "kv_external_frag_bytes_at_peak",
    "kv_peak_host_bytes",
    "prefix_hit_rate",
    *_SUMMED_STEP_METRICS,
    "measured_transfer_s",
    "fetch_recall_mean",
)
_ROOFLINE_METRICS: tuple[str, ...] = (
    "decode_roofline_ms_mean",
    "decode_step_ms_mean",
    "decode_roofline_fraction_mean",
    "decode_achieved_gbps",
)


def _step_metrics(steps: pd.DataFrame, out: dict[str, float], missing: dict[str, str]) -> None:
    step_names = ["peak_num_running", "mean_num_running", *_ENGINE_INTERNAL_METRICS]
    if len(steps) == 0:
        for name in step_names:
            missing[name] = "the run recorded no engine steps"
        return
    w = _weights(steps)
    running = _col(steps, "num_running")
    out["peak_num_running"] = float(running.max())
    out["mean_num_running"] = float(np.average(running, weights=w))

    allocated = _col(steps, "kv_allocated_bytes")
    token = _col(steps, "kv_token_bytes")
    external = _col(steps, "kv_external_frag_bytes")
    capacity = _col(steps, "kv_capacity_bytes")
    out["kv_capacity_bytes"] = float(capacity.max())
    out["kv_peak_allocated_bytes"] = float(allocated.max())
    out["kv_mean_allocated_bytes"] = float(np.average(allocated, weights=w))
    out["kv_peak_token_bytes"] = float(token.max())
    out["kv_mean_token_bytes"] = float(np.average(token, weights=w))
    if capacity.max() > 0:
        out["kv_peak_utilization"] = float(allocated.max() / capacity.max())
    else:
        missing["kv_peak_utilization"] = "kv_capacity_bytes is zero"
    held = allocated + external
    if (held * w).sum() > 0:
        out["kv_token_fraction_mean"] = float((token * w).sum() / (held * w).sum())
    else:
        missing["kv_token_fraction_mean"] = "the KV manager never held memory"
    peak = int(np.argmax(allocated))  # first step of peak allocation
    if held[peak] > 0:
        out["kv_token_fraction_at_peak"] = float(token[peak] / held[peak])
    else:
        missing["kv_token_fraction_at_peak"] = "the KV manager never held memory"
    for part in ("reserved_unused", "internal_frag", "external_frag"):
        values = _col(steps, f"kv_{part}_bytes")
        out[f"kv_{part}_bytes_mean"] = float(np.average(values, weights=w))
        out[f"kv_{part}_bytes_at_peak"] = float(values[peak])
    out["kv_peak_host_bytes"] = float(_col(steps, "kv_host_bytes").max())

    queries = _col(steps, "num_prefix_query_tokens").sum()
    if queries > 0:
        out["prefix_hit_rate"] = float(_col(steps, "num_prefix_hit_tokens").sum() / queries)
    else:
        missing["prefix_hit_rate"] = "no prefix lookups (prefix caching off or no prompts scheduled)"
    for name in _SUMMED_STEP_METRICS:
        out[name] = float(_col(steps, name).sum())
    for name, source, why in (
        ("measured_transfer_s", "measured_transfer_s", "no host copy was timed (CUDA only, offload engines)"),
        ("fetch_recall_mean", "fetch_recall", "no step fetched host-resident KV (offload engines only)"),
    ):
        values = steps[source].to_numpy(dtype=float) if source in steps else np.array([])
        values = values[~np.isnan(values)]
        if source == "measured_transfer_s" and len(values):
            out[name] = float(values.sum())
        elif len(values):
            out[name] = float(values.mean())
        else:
            missing[name] = why


def prefix_reused_tokens(
    prompts: Iterable[Sequence[int]], block_size: int, cache_salts: Iterable[str | None] | None = None
) -> np.ndarray:
    """Per prompt, in the given (arrival) order: prompt tokens an unbounded prefix cache
    with ``block_size``-token blocks would supply. int64 array [num_prompts], in tokens.

    The definition is the engine's (``BlockHashPrefixIndex``), so a paged engine that
    never evicts and never runs two requests at once hits exactly this at each request's
    first admission: a block is keyed by its parent's key, its tokens and the cache salt
    (vLLM's chained block hash); a prompt of ``L`` tokens can reuse its leading full blocks
    among the first ``L - 1`` tokens (the last prompt token is always computed, for its
    logits) whose keys an earlier prompt registered; every full block of a prompt is
    registered (the block holding its last token included). Blocks of generated tokens,
    which an engine also caches, are not counted: prompts that repeat an earlier request's
    output could be hit beyond this bound.

    ``prompts``: token id sequences (tuples or 1-D numpy integer arrays);
    ``cache_salts``: one per prompt (None: unsalted), or None for all unsalted. O(total
    tokens). Pure. Raises ValueError when ``block_size`` < 1.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: must be an int >= 1, got {block_size!r}")
    prompts = list(prompts)
    salts = list(cache_salts) if cache_salts is not None else [None] * len(prompts)
    # Vectorised over batches of prompts: a block's key is lane 0 of the engine's chained
    # block key (``kvbench.hashing.prompt_block_keys``), computed for many prompts at once,
    # so no Python loop runs per block. A prompt reuses its leading blocks whose keys an
    # earlier prompt added to the set (``SeenKeys``, compiled; a chained key stands for
    # the whole prefix up to its block, so one prompt never repeats one). Distinct
    # prefixes collide with probability ~2**-64 per pair, which could only raise an upper
    # bound.
    reused = np.zeros(len(prompts), dtype=np.int64)
    seen = SeenKeys()
    # Prompts go in batches of about _BOUND_BATCH_TOKENS tokens: per-prompt numpy calls
    # cost more than the arithmetic for 12K prompts, and one batch for all would hold the
    # whole trace as uint64 (1.2 GB for Mooncake).
    parts: list[np.ndarray] = []
    firsts: list[int] = []  # per prompt with blocks in the batch: its first block's index
    batch_salts: list[str | None] = []
    batch_prompts: list[int] = []  # their indexes among the prompts
    reusable: list[int] = []  # their full blocks before the last token
    batch_blocks = 0
    for p, (prompt, salt) in enumerate(zip(prompts, salts)):
        ids = np.asarray(prompt)
        nb = len(ids) // block_size
        if nb:
            parts.append(ids[: nb * block_size])
            firsts.append(batch_blocks)
            batch_salts.append(salt)
            batch_prompts.append(p)
            reusable.append((len(ids) - 1) // block_size)
            batch_blocks += nb
        if parts and (batch_blocks * block_size >= _BOUND_BATCH_TOKENS or p == len(prompts) - 1):
            keys = prompt_block_keys(parts, firsts, batch_salts, block_size)  # uint64 [batch blocks]
            starts = np.array(firsts, dtype=np.int64)
            counts = np.diff(np.append(starts, len(keys)))  # blocks per prompt
            leading = seen.leading_seen_then_add(keys, starts, counts)
            reused[batch_prompts] = np.minimum(leading, reusable) * block_size
            parts, firsts, batch_salts, batch_prompts, reusable, batch_blocks = [], [], [], [], [], 0
    return reused


_BOUND_BATCH_TOKENS = 1 << 22


def _prefix_reuse_metrics(
    requests: pd.DataFrame,
    meta: Mapping[str, Any],
    workload_requests: Sequence[Request] | None,
    out: dict[str, float],
    missing: dict[str, str],
    live: bool = False,
) -> None:
    done = requests[completed_mask(requests)]
    prompt_tokens = float(done["num_prompt_tokens"].sum())
    hit, bound = "prefix_hit_rate_first_admission", "prefix_reuse_upper_bound"
    if len(done) == 0 or prompt_tokens == 0:
        missing[hit] = missing[bound] = "no completed requests with prompt tokens"
        return
    if "num_cached_tokens" not in done:
        missing[hit] = "requests frame has no num_cached_tokens column"
    elif "num_cached_prompt_tokens" in missing:
        missing[hit] = missing["num_cached_prompt_tokens"]
    elif "prefix_hit_rate" in missing and not live:
        # No lookups at all (prefix caching off, dense engine): 0 cached tokens would read
        # as "the cache missed", not "there was no cache".
        missing[hit] = missing["prefix_hit_rate"]
    else:
        out[hit] = float(done["num_cached_tokens"].sum()) / prompt_tokens
    block_size = meta.get("block_size")
    if workload_requests is None:
        missing[bound] = "the replayed requests' prompts were not given (summarize_run workload_requests)"
        return
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        missing[bound] = f"the engine has no KV block size (meta.block_size={block_size!r})"
        return
    # Arrival order, stable among equal times, as the runner submits them. Every replayed
    # request registers its blocks (rejected ones too: an upper bound may over-count).
    ordered = sorted(workload_requests, key=lambda r: r.arrival_s)
    reused = prefix_reused_tokens(
        (r.prompt_token_ids for r in ordered), int(block_size), (r.cache_salt for r in ordered)
    )
    by_id = dict(zip((r.request_id for r in ordered), reused.tolist()))
    absent = [rid for rid in done["request_id"] if rid not in by_id]
    if absent:
        raise MetricsError(
            f"requests frame: completed request(s) {absent[:3]} are not among the workload_requests"
        )
    out[bound] = float(sum(by_id[rid] for rid in done["request_id"])) / prompt_tokens


def _sharing_metric(requests: pd.DataFrame, out: dict[str, float], missing: dict[str, str]) -> None:
    name = "kv_sharing_saved_fraction"
    if "peak_kv_slots" not in requests or "peak_kv_slots_unshared" not in requests:
        missing[name] = "requests frame has no peak_kv_slots / peak_kv_slots_unshared columns"
        return
    done = requests[completed_mask(requests)]
    unshared = float(done["peak_kv_slots_unshared"].sum())
    if unshared > 0:
        out[name] = 1.0 - float(done["peak_kv_slots"].sum()) / unshared
    else:
        missing[name] = "engine reported no per-request KV slots"


def _roofline_metrics(
    steps: pd.DataFrame, meta: Mapping[str, Any], out: dict[str, float], missing: dict[str, str]
) -> None:
    names = _ROOFLINE_METRICS
    weight_bytes = meta.get("weight_bytes")
    bandwidth_gbps = (meta.get("hardware") or {}).get("hbm_bandwidth_gbps")
    reason = ""
    if weight_bytes is None or not math.isfinite(float(weight_bytes)):
        reason = "meta.weight_bytes is unknown"
    elif bandwidth_gbps is None or not float(bandwidth_gbps) > 0:
        reason = "meta.hardware.hbm_bandwidth_gbps is unknown"
    elif len(steps) == 0:
        reason = "the run recorded no engine steps"
    if not reason:
        decode = (_col(steps, "num_prefill_tokens") == 0) & (_col(steps, "num_decode_tokens") > 0)
        duration_s = _col(steps, "duration_s")[decode]
        if not decode.any():
            reason = "no decode-only steps (every step carried prefill tokens)"
        elif not (duration_s > 0).all():
            reason = "decode steps have zero or unknown duration"
    if reason:
        for name in names:
            missing[name] = reason
        return
    bytes_read = float(weight_bytes) + _col(steps, "kv_token_bytes")[decode]
    roofline_s = bytes_read / (float(bandwidth_gbps) * 1e9)
    out["decode_roofline_ms_mean"] = float(roofline_s.mean() * 1e3)
    out["decode_step_ms_mean"] = float(duration_s.mean() * 1e3)
    out["decode_roofline_fraction_mean"] = float((roofline_s / duration_s).mean())
    out["decode_achieved_gbps"] = float(bytes_read.sum() / duration_s.sum() / 1e9)


def _memory_metrics(
    memory: pd.DataFrame | None, meta: Mapping[str, Any], out: dict[str, float], missing: dict[str, str]
) -> None:
    known = meta.get("missing") or {}
    for col in MEMORY_COLUMNS:
        name = f"mem_peak_{col}"
        values = (
            memory[col].to_numpy(dtype=float) if memory is not None and col in memory else np.array([], float)
        )
        values = values[np.isfinite(values)]
        if values.size:
            out[name] = float(values.max())
        else:
            missing[name] = known.get(col) or known.get(name) or "not sampled in this run"


# Live-server summary metric -> the column of the scrape frame (kvbench.server_metrics) it comes from.
_SERVER_DELTAS: dict[str, str] = {
    "server_prefix_query_tokens": "prefix_query_tokens_total",
    "server_prefix_hit_tokens": "prefix_hit_tokens_total",
    "server_num_preemptions": "num_preemptions_total",
}
_SERVER_PEAKS: dict[str, str] = {
    "server_kv_usage_peak": "kv_usage_fraction",
    "server_num_running_peak": "num_running",
    "server_num_waiting_peak": "num_waiting",
}


def server_summary(server: pd.DataFrame | None, known_missing: Mapping[str, str] | None = None) -> Summary:
    """The ``server_*`` metrics (SERVER_METRICS) of one run's scrape frame
    (``ServerMetricsScraper.frame()``: the first good row is the baseline scrape taken
    before any request); NaN ones have a reason. ``known_missing``: column -> why the
    server does not report it (``ServerMetricsScraper.missing()``).

    Counters are cumulative since the server started, so this run's count is last - first
    good scrape. A counter that falls between good scrapes was reset (the server
    restarted): its delta is NaN with the reason, never negative, and the fall is counted
    in ``server_num_counter_resets``. None: not a live server run, every metric NaN. Pure.
    """
    out: dict[str, float] = {}
    missing: dict[str, str] = {}
    names = [doc.name for doc in SERVER_METRICS]
    if server is None:
        for name in names:
            missing[name] = "not a live server run (no server metrics were scraped)"
        return Summary(out, missing)
    known = known_missing or {}
    errors = server["error"].fillna("").astype(str) if "error" in server else pd.Series("", server.index)
    out["server_num_scrape_errors"] = float((errors != "").sum())
    good = server[(errors == "").to_numpy()].sort_values("t_s")
    if len(good) == 0:
        reason = "no scrape of the server's /metrics succeeded"
        if len(server):
            reason += f" (first error: {errors[errors != ''].iloc[0]})"
        for name in names:
            if name != "server_num_scrape_errors":
                missing[name] = reason
        return Summary(out, missing)
    t_s = good["t_s"].to_numpy(dtype=float)

    def absent(column: str) -> str:
        return known.get(column) or f"the server's /metrics did not report {column}"

    resets = np.zeros(len(good), dtype=bool)  # per good scrape: some counter fell since the previous one
    for name, column in _SERVER_DELTAS.items():
        values = good[column].to_numpy(dtype=float) if column in good else np.array([])
        rows = np.flatnonzero(np.isfinite(values))
        if len(rows) == 0:
            missing[name] = absent(column)
            continue
        falls = rows[1:][np.diff(values[rows]) < 0]  # rows whose value is below the previous reading
        resets[falls] = True
        if len(falls):
            before = rows[np.searchsorted(rows, falls[0]) - 1]
            missing[name] = (
                f"{column} fell from {values[before]:g} to {values[falls[0]]:g} at t_s={t_s[falls[0]]:.3f}: "
                "the server restarted during the run (counter reset), so this run's count is unknown"
            )
        else:
            out[name] = float(values[rows[-1]] - values[rows[0]])
    out["server_num_counter_resets"] = float(resets.sum())
    queries, hits = out.get("server_prefix_query_tokens"), out.get("server_prefix_hit_tokens")
    if queries is None or hits is None:
        missing["server_prefix_hit_rate"] = (
            missing.get("server_prefix_query_tokens") or missing["server_prefix_hit_tokens"]
        )
    elif queries > 0:
        out["server_prefix_hit_rate"] = hits / queries
    else:
        missing["server_prefix_hit_rate"] = "the server made no prefix-cache lookups during the run"
    for name, column in _SERVER_PEAKS.items():
        values = good[column].to_numpy(dtype=float) if column in good else np.array([])
        if np.isfinite(values).any():
            out[name] = float(np.nanmax(values))
        else:
            missing[name] = absent(column)
    usage = good["kv_usage_fraction"].to_numpy(dtype=float) if "kv_usage_fraction" in good else np.array([])
    keep = np.isfinite(usage)
    if keep.any():
        out["server_kv_usage_mean"] = _held_mean(t_s[keep], usage[keep])
    else:
        missing["server_kv_usage_mean"] = absent("kv_usage_fraction")
    return Summary(out, missing)


def _held_mean(t_s: np.ndarray, values: np.ndarray) -> float:
    """Time-weighted mean of samples each held until the next one (the last has no weight);
    the plain mean when all samples share one time."""
    dt = np.diff(t_s)
    if len(values) < 2 or not dt.sum() > 0:
        return float(values.mean())
    return float(np.average(values[:-1], weights=dt))
