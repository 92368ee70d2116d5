"""Scrape a live inference server's Prometheus ``/metrics`` while a run replays requests.

``ServerMetricsScraper`` is a context manager: on entry one baseline scrape (before the
first request; it fails with one screen naming the URL when the server is unreachable or
does not serve Prometheus text), then a background thread scraping every ``interval_s``,
and on exit a final scrape. ``frame()`` holds one row per scrape:

    t_s                        the caller's clock (seconds since the run started) at the
                               midpoint of the HTTP request
    server_kind                "vllm", "sglang" or "llamacpp" (found in the baseline)
    kv_usage_fraction          KV pool in use, 0..1 (vLLM's ``kv_cache_usage_perc`` is a
                               fraction despite its name)
    num_running, num_waiting   requests running / queued
    prefix_query_tokens_total  cumulative prompt tokens looked up in the prefix cache
    prefix_hit_tokens_total    cumulative of those found cached
    num_preemptions_total      cumulative preemptions
    prefix_hit_rate            the server's own hit-rate gauge, for servers that report a
                               rate instead of token counters (SGLang)
    error                      "" for a good scrape; why it failed otherwise (values NaN)

Counters are the server's cumulative values since it started; ``kvbench.metrics`` turns
the first (baseline) and last good scrape into this run's deltas. A column the server
does not report is NaN in every row and ``missing()`` says why.

Several label sets of one metric (vLLM's ``engine`` label: one per data-parallel engine
of the server) are combined into one server-wide value: counts and counters are summed,
fractions (``kv_usage_fraction``, ``prefix_hit_rate``) are averaged, which is the
server-wide fraction when the engines' KV pools are equal (data-parallel replicas).

Name mappings: vLLM from its ``/metrics`` (captured text backs the unit tests); SGLang
and llama.cpp from their documentation (SGLang's production-metrics page, llama.cpp's
``tools/server/README.md``), not from a running server.

A failed scrape mid-run (the server died) becomes a row with NaN values and ``error``
set; the thread never raises, and ``frame()`` returns what was collected.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

# Canonical columns, in frame order after t_s and server_kind.
VALUE_COLUMNS: tuple[str, ...] = (
    "kv_usage_fraction",
    "num_running",
    "num_waiting",
    "prefix_query_tokens_total",
    "prefix_hit_tokens_total",
    "num_preemptions_total",
    "prefix_hit_rate",
)
# Averaged over label sets; every other column is summed.
FRACTION_COLUMNS: frozenset[str] = frozenset({"kv_usage_fraction", "prefix_hit_rate"})
FRAME_COLUMNS: tuple[str, ...] = ("t_s", "server_kind", *VALUE_COLUMNS, "error")
# The longest excerpt of a response body quoted in an error.
_BODY_EXCERPT_CHARS = 200


class ServerMetricsError(RuntimeError):
    """The baseline scrape failed: the message names the URL and what was wrong."""


@dataclass(frozen=True)
class ServerKind:
    """One server's metric names.

    ``sources``: canonical column -> sample names, the first one present wins (older
    releases' names last). ``not_reported``: column -> why this server has no such
    metric. ``info_metric``: a sample whose labels describe the KV cache configuration.
    """

    name: str
    prefix: str
    sources: Mapping[str, tuple[str, ...]]
    not_reported: Mapping[str, str]
    info_metric: str = ""

    def sample_names(self) -> frozenset[str]:
        names = {name for names in self.sources.values() for name in names}
        return frozenset(names | ({self.info_metric} if self.info_metric else set()))


VLLM = ServerKind(
    name="vllm",
    prefix="vllm:",
    sources={
        "kv_usage_fraction": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "num_running": ("vllm:num_requests_running",),
        "num_waiting": ("vllm:num_requests_waiting",),
        "prefix_query_tokens_total": (
            "vllm:prefix_cache_queries_total",
            "vllm:gpu_prefix_cache_queries_total",
        ),
        "prefix_hit_tokens_total": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        "num_preemptions_total": ("vllm:num_preemptions_total",),
    },
    not_reported={
        "prefix_hit_rate": "vLLM reports prefix-cache token counters, not a rate gauge "
        "(the run's rate is the summary metric server_prefix_hit_rate)",
    },
    info_metric="vllm:cache_config_info",
)
SGLANG = ServerKind(
    name="sglang",
    prefix="sglang:",
    sources={
        "kv_usage_fraction": ("sglang:token_usage",),
        "num_running": ("sglang:num_running_reqs",),
        "num_waiting": ("sglang:num_queue_reqs",),
        "prefix_hit_rate": ("sglang:cache_hit_rate",),
    },
    not_reported={
        "prefix_query_tokens_total": "SGLang reports a prefix hit-rate gauge (sglang:cache_hit_rate), "
        "not prefix-cache token counters",
        "prefix_hit_tokens_total": "SGLang reports a prefix hit-rate gauge (sglang:cache_hit_rate), "
        "not prefix-cache token counters",
        "num_preemptions_total": "kvbench maps no SGLang preemption counter",
    },
)
LLAMACPP = ServerKind(
    name="llamacpp",
    prefix="llamacpp:",
    sources={
        "kv_usage_fraction": ("llamacpp:kv_cache_usage_ratio",),
        "num_running": ("llamacpp:requests_processing",),
        "num_waiting": ("llamacpp:requests_deferred",),
    },
    not_reported={
        "prefix_query_tokens_total": "llama.cpp's server exports no prefix-cache metrics",
        "prefix_hit_tokens_total": "llama.cpp's server exports no prefix-cache metrics",
        "num_preemptions_total": "llama.cpp's server exports no preemption counter",
        "prefix_hit_rate": "llama.cpp's server exports no prefix-cache metrics",
    },
)
SERVER_KINDS: tuple[ServerKind, ...] = (VLLM, SGLANG, LLAMACPP)


@dataclass(frozen=True)
class ParsedScrape:
    """One /metrics text reduced to the canonical columns (NaN: not in the text)."""

    kind: ServerKind
    values: dict[str, float]
    facts: dict[str, Any]


def detect_kind(sample_names: Iterable[str]) -> ServerKind | None:
    """The server whose metric prefix the most samples carry; None when no known prefix occurs."""
    counts = {kind.name: 0 for kind in SERVER_KINDS}
    for name in sample_names:
        for kind in SERVER_KINDS:
            if name.startswith(kind.prefix):
                counts[kind.name] += 1
    best = max(SERVER_KINDS, key=lambda kind: counts[kind.name])
    return best if counts[best.name] else None


def parse_metrics(text: str, kind: ServerKind | None = None) -> ParsedScrape:
    """Reduce Prometheus exposition ``text`` to the canonical columns of ``kind``.

    ``kind`` None: detected from the metric prefixes. Raises ValueError when the text is
    not Prometheus exposition format or (``kind`` None) carries no known server's metrics.
    Pure.
    """
    samples = [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]
    if kind is None:
        kind = detect_kind(name for name, _, _ in samples)
        if kind is None:
            shown = sorted({name for name, _, _ in samples})[:5]
            raise ValueError(
                "no vLLM (vllm:*), SGLang (sglang:*) or llama.cpp (llamacpp:*) metrics in the text"
                + (f"; it has e.g. {', '.join(shown)}" if shown else " (it is empty)")
            )
    by_name: dict[str, list[float]] = {}
    facts: dict[str, Any] = {}
    for name, labels, value in samples:
        if name == kind.info_metric and not facts:
            facts = {key: _label_value(text) for key, text in labels.items()}
        by_name.setdefault(name, []).append(float(value))
    values = dict.fromkeys(VALUE_COLUMNS, math.nan)
    for column, names in kind.sources.items():
        found = next((by_name[name] for name in names if name in by_name), None)
        if found:
            values[column] = sum(found) / len(found) if column in FRACTION_COLUMNS else sum(found)
    return ParsedScrape(kind=kind, values=values, facts=facts)


def _label_value(text: str) -> Any:
    """A cache_config_info label as int, float, bool or None where it reads as one, else the text."""
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _filter_lines(text: str, names: frozenset[str]) -> str:
    """Only the sample lines of ``names``: a vLLM /metrics is ~50 KB of histograms whose full
    parse (~6 ms) would hold the GIL the client's event loop needs every interval."""
    kept = []
    for line in text.splitlines():
        if line and line[0] != "#" and line.split("{", 1)[0].split(" ", 1)[0] in names:
            kept.append(line)
    return "\n".join(kept) + "\n"


class ServerMetricsScraper:
    """Scrapes ``metrics_url`` every ``interval_s`` on a background thread inside a ``with`` block.

    ``clock`` returns the caller's time (the runner clock's ``now``: seconds since the run
    started), so rows line up with requests.parquet. ``headers`` (e.g. an Authorization
    header) are sent with every scrape and never stored. One scrape on entry (raises
    ServerMetricsError naming the URL when it fails), one on exit; a scraper runs once.
    """

    def __init__(
        self,
        metrics_url: str,
        *,
        interval_s: float = 0.25,
        headers: Mapping[str, str] | None = None,
        clock: Callable[[], float],
        timeout_s: float = 5.0,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._headers = dict(headers or {})
        self._clock = clock
        self._client: httpx.Client | None = None
        self._kind: ServerKind | None = None
        self._names: frozenset[str] = frozenset()
        self._facts: dict[str, Any] = {}
        self._absent: dict[str, str] = {}
        self._rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._used = False

    # -- lifecycle ---------------------------------------------------------------
    def __enter__(self) -> ServerMetricsScraper:
        if self._used:
            raise RuntimeError("ServerMetricsScraper: already started; create a new scraper per run")
        self._used = True
        self._client = httpx.Client(headers=self._headers, timeout=self.timeout_s)
        try:
            self._baseline()
        except BaseException:
            self._client.close()
            raise
        self._thread = threading.Thread(target=self._run, name="kvbench-server-metrics", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._scrape()
        assert self._client is not None
        self._client.close()

    def _baseline(self) -> None:
        url = self.metrics_url
        start_s = self._clock()
        try:
            response = self._client.get(url)  # type: ignore[union-attr]
        except httpx.HTTPError as exc:
            raise ServerMetricsError(
                f"server metrics: cannot reach {url}: {type(exc).__name__}: {str(exc) or 'no detail'}. "
                "Is the server running, and does it serve Prometheus metrics there (vLLM: /metrics; "
                "SGLang: --enable-metrics; llama.cpp: --metrics)?"
            ) from exc
        end_s = self._clock()
        if response.status_code != 200:
            raise ServerMetricsError(
                f"server metrics: GET {url} returned HTTP {response.status_code}: {_excerpt(response.text)}"
            )
        try:
            parsed = parse_metrics(response.text)
        except ValueError as exc:
            raise ServerMetricsError(
                f"server metrics: {url} is not a supported server's Prometheus text: {_shorten(str(exc))}. "
                f"Body begins: {_excerpt(response.text)}"
            ) from exc
        kind = parsed.kind
        self._kind = kind
        self._names = kind.sample_names()
        self._facts = parsed.facts
        for column in VALUE_COLUMNS:
            if column in kind.not_reported:
                self._absent[column] = kind.not_reported[column]
            elif math.isnan(parsed.values[column]):
                self._absent[column] = f"{url} has none of {', '.join(kind.sources[column])}"
        self._append((start_s + end_s) / 2, parsed.values, "")

    # -- sampling ----------------------------------------------------------------
    def _run(self) -> None:
        # wait() returns True as soon as __exit__ sets the event, so exit is prompt.
        while not self._stop.wait(self.interval_s):
            self._scrape()

    def _scrape(self) -> None:
        """One row; never raises (a failure is the row's ``error``, values NaN)."""
        assert self._client is not None and self._kind is not None
        start_s = self._clock()
        values = dict.fromkeys(VALUE_COLUMNS, math.nan)
        error = ""
        try:
            response = self._client.get(self.metrics_url)
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {_excerpt(response.text)}"
            else:
                values = parse_metrics(_filter_lines(response.text, self._names), self._kind).values
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {str(exc) or 'no detail'}"
        except ValueError as exc:
            error = f"not Prometheus text: {_shorten(str(exc))}"
        self._append((start_s + self._clock()) / 2, values, error)

    def _append(self, t_s: float, values: Mapping[str, float], error: str) -> None:
        assert self._kind is not None
        row = {"t_s": t_s, "server_kind": self._kind.name, **values, "error": error}
        with self._lock:
            self._rows.append(row)

    # -- results -----------------------------------------------------------------
    @property
    def server_kind(self) -> str:
        """The server found by the baseline scrape ("vllm", "sglang", "llamacpp"); "" before it."""
        return self._kind.name if self._kind is not None else ""

    def frame(self) -> pd.DataFrame:
        """One row per scrape (FRAME_COLUMNS), in time order; what was collected so far."""
        with self._lock:
            rows = list(self._rows)
        frame = pd.DataFrame(rows, columns=list(FRAME_COLUMNS))
        return frame.astype({c: float for c in ("t_s", *VALUE_COLUMNS)})

    def server_facts(self) -> dict[str, Any]:
        """The KV cache configuration the server reports (vLLM's cache_config_info labels:
        block_size, num_gpu_blocks, enable_prefix_caching, kv_cache_memory_bytes, ...), with
        numbers and booleans converted; empty when the server reports none."""
        return dict(self._facts)

    def missing(self) -> dict[str, str]:
        """Column -> why it is NaN in every row (the server does not report it)."""
        return dict(self._absent)


def _shorten(text: str) -> str:
    """``text`` on one line, cut to _BODY_EXCERPT_CHARS (an error must fit one screen)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= _BODY_EXCERPT_CHARS else flat[:_BODY_EXCERPT_CHARS] + "..."


def _excerpt(text: str) -> str:
    """The start of a response body, quoted."""
    return repr(_shorten(text))
