"""Derived metrics on hand-built runs whose every number is worked out below."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from run_fixtures import exact_run
from server_fixtures import server_frame

from kvbench import metrics
from kvbench.hashing import SeenKeys, prompt_block_keys


@pytest.fixture
def exact():
    return exact_run()


def summary_of(requests, steps, meta, memory=None):
    return metrics.summarize_run(requests, steps, meta, memory)


def test_latencies_follow_vllm_definitions(exact):
    requests, steps, memory, meta = exact
    m = summary_of(requests, steps, meta, memory).metrics
    # TTFT 100, 200, 150 ms (r3 rejected, excluded)
    assert m["ttft_ms_mean"] == pytest.approx(150.0)
    assert m["ttft_ms_median"] == pytest.approx(150.0)
    assert m["ttft_ms_p90"] == pytest.approx(190.0)  # numpy linear interpolation, as vLLM
    assert m["ttft_ms_p99"] == pytest.approx(199.0)
    # E2EL 500, 400, 150 ms
    assert m["e2el_ms_mean"] == pytest.approx(350.0)
    assert m["e2el_ms_median"] == pytest.approx(400.0)
    # TPOT r0 = (500 - 100) / 3, r1 = (400 - 200) / 1; r2 has one token: no TPOT
    assert m["tpot_ms_mean"] == pytest.approx((400 / 3 + 200) / 2)
    assert m["tpot_ms_p99"] == pytest.approx(400 / 3 + 0.99 * (200 - 400 / 3))
    # ITL gaps pooled: r0 100 100 200, r1 200
    assert m["itl_ms_mean"] == pytest.approx(150.0)
    assert m["itl_ms_median"] == pytest.approx(150.0)
    assert m["itl_ms_p90"] == pytest.approx(200.0)


def test_counts_throughput_and_goodput(exact):
    requests, steps, memory, meta = exact
    m = summary_of(requests, steps, meta, memory).metrics
    assert (m["num_requests"], m["num_completed"], m["num_rejected"], m["num_unfinished"]) == (4, 3, 1, 0)
    assert m["benchmark_duration_s"] == pytest.approx(0.6)  # first arrival 0.0, last finish 0.6
    assert m["requests_per_s"] == pytest.approx(3 / 0.6)
    assert m["output_tokens_per_s"] == pytest.approx((4 + 4 + 1) / 0.6)  # every sample's tokens
    assert m["total_tokens_per_s"] == pytest.approx((9 + 10 + 20 + 5) / 0.6)
    # SLO ttft 160 ms, tpot 150 ms: r0 passes, r1 fails TTFT, r2 passes (no TPOT)
    assert m["goodput_requests_per_s"] == pytest.approx(2 / 0.6)
    assert m["slo_attained_fraction"] == pytest.approx(2 / 3)
    assert m["num_cached_prompt_tokens"] == 8


def test_kv_metrics(exact):
    requests, steps, memory, meta = exact
    m = summary_of(requests, steps, meta, memory).metrics
    # durations 0.1 0.2 0.1 0.2 weight the means
    assert m["peak_num_running"] == 3
    assert m["mean_num_running"] == pytest.approx((0.1 * 1 + 0.2 * 1 + 0.1 * 3 + 0.2 * 2) / 0.6)
    assert m["kv_peak_allocated_bytes"] == 5000
    assert m["kv_mean_allocated_bytes"] == pytest.approx((200 + 200 + 500 + 800) / 0.6)
    assert m["kv_mean_token_bytes"] == pytest.approx((100 + 100 + 300 + 600) / 0.6)
    assert m["kv_peak_utilization"] == pytest.approx(0.5)
    # token * dt = 1100, (allocated + external) * dt = 1800
    assert m["kv_token_fraction_mean"] == pytest.approx(1100 / 1800)
    assert m["kv_token_fraction_at_peak"] == pytest.approx(3000 / 6000)
    assert m["kv_reserved_unused_bytes_at_peak"] == 1000
    assert m["kv_external_frag_bytes_mean"] == pytest.approx(100 / 0.6)
    assert m["prefix_hit_rate"] == pytest.approx(8 / 35)
    assert m["kv_sharing_saved_fraction"] == pytest.approx(1 - 44 / 64)
    assert (m["num_preemptions"], m["num_recomputed_tokens"], m["num_evicted_blocks"]) == (1, 6, 1)
    assert (m["bytes_to_host"], m["bytes_from_host"], m["kv_peak_host_bytes"]) == (4096, 2048, 4096)


def test_decode_roofline(exact):
    requests, steps, memory, meta = exact
    m = summary_of(requests, steps, meta, memory).metrics
    # decode-only steps 1 and 3: (2e6 + 500) and (2e6 + 3000) bytes at 20 GB/s, both 0.2 s long
    roofline_s = np.array([2_000_500, 2_003_000]) / 20e9
    assert m["decode_roofline_ms_mean"] == pytest.approx(roofline_s.mean() * 1e3)
    assert m["decode_step_ms_mean"] == pytest.approx(200.0)
    assert m["decode_roofline_fraction_mean"] == pytest.approx((roofline_s / 0.2).mean())
    assert m["decode_achieved_gbps"] == pytest.approx(4_003_500 / 0.4 / 1e9)


def test_roofline_missing_is_nan_with_reason(exact):
    requests, steps, memory, meta = exact
    s = summary_of(requests, steps, {**meta, "weight_bytes": None}, memory)
    assert math.isnan(s.metrics["decode_roofline_fraction_mean"])
    assert "weight_bytes" in s.missing["decode_roofline_fraction_mean"]
    prefill_only = steps.assign(num_prefill_tokens=5)
    s = summary_of(requests, prefill_only, meta, memory)
    assert "no decode-only steps" in s.missing["decode_roofline_ms_mean"]


def test_memory_peaks_and_reasons(exact):
    requests, steps, memory, meta = exact
    s = summary_of(requests, steps, meta, memory)
    assert s.metrics["mem_peak_rss_bytes"] == 1.5e8
    assert math.isnan(s.metrics["mem_peak_nvml_used_bytes"])
    assert s.missing["mem_peak_nvml_used_bytes"] == meta["missing"]["nvml_used_bytes"]
    assert s.missing["mem_peak_torch_allocated_bytes"] == "not sampled in this run"
    assert math.isnan(summary_of(requests, steps, meta, None).metrics["mem_peak_rss_bytes"])


def test_every_metric_present_and_every_nan_explained(exact):
    requests, steps, memory, meta = exact
    s = summary_of(requests, steps, {**meta, "slo": {}}, memory)
    assert set(s.metrics) == {doc.name for doc in metrics.METRICS}
    nan_names = {k for k, v in s.metrics.items() if math.isnan(v)}
    assert nan_names == set(s.missing)
    assert "no SLO" in s.missing["goodput_requests_per_s"]


def test_rejected_only_run_has_no_latencies(exact):
    requests, steps, memory, meta = exact
    rejected = requests.assign(rejected_reason="too long", finish_s=math.nan)
    s = summary_of(rejected, steps.iloc[0:0], meta)
    assert s.metrics["num_rejected"] == 4
    assert s.metrics["num_completed"] == 0
    assert math.isnan(s.metrics["ttft_ms_p99"]) and s.missing["ttft_ms_p99"] == "no completed requests"
    assert math.isnan(s.metrics["output_tokens_per_s"])
    assert s.missing["kv_peak_allocated_bytes"] == "the run recorded no engine steps"


def test_unfinished_requests_are_counted_not_timed(exact):
    requests, steps, memory, meta = exact
    unfinished = requests.assign(finish_s=[0.5, math.nan, 0.45, math.nan])
    m = summary_of(unfinished, steps, meta).metrics
    assert (m["num_completed"], m["num_unfinished"], m["num_rejected"]) == (2, 1, 1)
    assert m["ttft_ms_mean"] == pytest.approx(125.0)


def test_per_request_columns_and_no_mutation(exact):
    requests, *_ = exact
    before = requests.copy(deep=True)
    lat = metrics.per_request(requests)
    pd.testing.assert_frame_equal(requests, before)
    assert list(lat["request_id"]) == ["r0", "r1", "r2", "r3"]
    assert lat["ttft_ms"].tolist()[:3] == pytest.approx([100, 200, 150])
    assert lat["tpot_ms"].iloc[0] == pytest.approx(400 / 3)
    assert math.isnan(lat["tpot_ms"].iloc[2]) and math.isnan(lat["ttft_ms"].iloc[3])
    assert lat["itl_ms"].iloc[0] == pytest.approx([100, 100, 200])
    assert lat["itl_ms"].iloc[3] == []
    # The pooled gaps summarize_run reads are the lists joined, in frame order, exactly.
    joined = [gap for gaps in lat["itl_ms"] for gap in gaps]
    assert metrics.pooled_itl_ms(requests).tolist() == joined and len(joined) >= 3
    assert "itl_ms" not in metrics.per_request(requests, itl=False)
    pd.testing.assert_frame_equal(metrics.per_request(requests, itl=False), lat.drop(columns="itl_ms"))


def test_missing_column_names_frame_and_column(exact):
    requests, steps, memory, meta = exact
    with pytest.raises(metrics.MetricsError, match=r"requests frame: missing column\(s\) \['finish_s'\]"):
        metrics.summarize_run(requests.drop(columns="finish_s"), steps, meta)
    with pytest.raises(metrics.MetricsError, match="steps frame.*kv_token_bytes"):
        metrics.summarize_run(requests, steps.drop(columns="kv_token_bytes"), meta)


def test_markdown_table_lists_every_metric():
    text = metrics.metrics_markdown()
    for doc in metrics.METRICS:
        assert f"`{doc.name}`" in text
    assert len({doc.name for doc in metrics.METRICS}) == len(metrics.METRICS)
    assert all(doc.better in ("lower", "higher", "") for doc in metrics.METRICS)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 10.0),  # arrival
            st.floats(0.001, 1.0),  # ttft
            st.floats(0.001, 0.5),  # constant gap between tokens
            st.integers(1, 30),  # output tokens
        ),
        min_size=1,
        max_size=12,
    )
)
def test_constant_gaps_give_equal_tpot_and_itl(specs):
    rows = []
    for i, (arrival, ttft, gap, num_out) in enumerate(specs):
        times = [arrival + ttft + gap * k for k in range(num_out)]
        rows.append(
            {
                "request_id": f"r{i}",
                "arrival_s": arrival,
                "first_token_s": times[0],
                "finish_s": times[-1],
                "token_times_s": times,
                "num_prompt_tokens": 8,
                "num_output_tokens": num_out,
                "rejected_reason": "",
            }
        )
    lat = metrics.per_request(pd.DataFrame(rows))
    for (_, ttft, gap, num_out), row in zip(specs, lat.itertuples()):
        assert row.ttft_ms == pytest.approx(ttft * 1e3, rel=1e-6, abs=1e-6)
        if num_out > 1:
            assert row.tpot_ms == pytest.approx(gap * 1e3, rel=1e-6)
            assert row.itl_ms == pytest.approx([gap * 1e3] * (num_out - 1), rel=1e-6)
        else:
            assert math.isnan(row.tpot_ms)
    m = metrics.summarize_run(pd.DataFrame(rows), pd.DataFrame(), {}).metrics
    for kind in ("ttft", "e2el"):
        stats = [m[f"{kind}_ms_{s}"] for s in ("median", "p90", "p99")]
        assert stats == sorted(stats)


# --------------------------------------------------------------------------- prefix reuse
def test_prefix_reused_tokens_definition():
    a = tuple(range(10, 18))  # two 4-token blocks
    reused = metrics.prefix_reused_tokens([a, a, a[:4], a + (1,), (0,) + a, a[:6]], 4)
    # exact repeat: its last block holds the last prompt token -> 4 of 8; a[:4]: 0 (one
    # block, which holds its last token); a + (1,): 8; shifted by one: 0; a[:6]: 4.
    assert reused.tolist() == [0, 4, 0, 8, 0, 4]
    assert reused.dtype == np.int64
    # numpy int32 prompts and tuples are the same tokens
    as_arrays = [np.asarray(p, dtype=np.int32) for p in (a, a + (1,))]
    assert metrics.prefix_reused_tokens(as_arrays, 4).tolist() == [0, 8]
    # a cache salt isolates tenants; the same salt shares
    salted = metrics.prefix_reused_tokens([a, a + (1,), a + (2,)], 4, [None, "t", "t"])
    assert salted.tolist() == [0, 0, 8]
    assert metrics.prefix_reused_tokens([(), (1,)], 4).tolist() == [0, 0]
    with pytest.raises(ValueError, match="block_size"):
        metrics.prefix_reused_tokens([a], 0)


# Keys from a few low-bit classes (they share table slots and probe past each other,
# wrapping at the table's end) and the extremes of the uint64 range.
_SEEN_KEYS = st.one_of(
    st.builds(lambda high, low: (high << 40) | low, st.integers(0, (1 << 24) - 1), st.integers(0, 3)),
    st.sampled_from([0, 1, 2**63, 2**64 - 2, 2**64 - 1]),
)


@settings(max_examples=200, deadline=None)
@given(
    batches=st.lists(st.lists(st.lists(_SEEN_KEYS, max_size=6), max_size=5), max_size=5),
    num_slots=st.sampled_from([1, 2, 8]),
)
def test_seen_keys_match_a_python_set(batches: list[list[list[int]]], num_slots: int) -> None:
    seen = SeenKeys(num_slots)
    reference: set[int] = set()
    for prompts in batches:  # one leading_seen_then_add call per batch, growing the table
        keys = np.array([k for prompt in prompts for k in prompt], dtype=np.uint64)
        counts = np.array([len(prompt) for prompt in prompts], dtype=np.int64)
        firsts = np.cumsum(counts) - counts
        leading = seen.leading_seen_then_add(keys, firsts, counts)
        expected = []
        for prompt in prompts:
            k = 0
            while k < len(prompt) and prompt[k] in reference:
                k += 1
            expected.append(k)
            reference.update(prompt)
        assert leading.tolist() == expected
        assert seen.num_keys == len(reference)


def test_seen_keys_table_size_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        SeenKeys(12)


@settings(max_examples=100, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.integers(0, 5), st.lists(st.integers(3, 9), max_size=20)), min_size=1, max_size=12
    )
)
def test_prefix_reused_tokens_equals_a_set_of_block_keys(turns: list[tuple[int, list[int]]]) -> None:
    # Prompts extend earlier ones (chat histories) or start afresh; the bound is, per
    # prompt, its leading blocks (before the last token) whose chained keys an earlier
    # prompt had, computed here one prompt at a time with a Python set.
    prompts: list[tuple[int, ...]] = []
    for parent, extra in turns:
        base = prompts[parent] if parent < len(prompts) else ()
        prompts.append(base + tuple(extra))
    bs = 4
    seen: set[int] = set()
    expected = []
    for prompt in prompts:
        nb = len(prompt) // bs
        keys = prompt_block_keys([np.asarray(prompt[: nb * bs])], [0], [None], bs).tolist() if nb else []
        k = 0
        while k < nb and keys[k] in seen:
            k += 1
        expected.append(min(k, max(len(prompt) - 1, 0) // bs) * bs)
        seen.update(keys)
    assert metrics.prefix_reused_tokens(prompts, bs).tolist() == expected


def _replayed(requests: pd.DataFrame) -> list[SimpleNamespace]:
    """Stand-in workload requests for the exact run: r1 repeats r0's first 8 tokens."""
    prompts = {
        "r0": tuple(range(100, 110)),
        "r1": tuple(range(100, 108)) + tuple(range(900, 912)),
        "r2": (7,) * 5,
        "r3": tuple(range(100, 110)) * 500,  # rejected: its blocks still count as seen
    }
    arrivals = dict(zip(requests["request_id"], requests["arrival_s"]))
    return [
        SimpleNamespace(request_id=rid, arrival_s=arrivals[rid], prompt_token_ids=ids, cache_salt=None)
        for rid, ids in reversed(prompts.items())  # not in arrival order: the metric sorts
    ]


def test_first_admission_hit_rate_and_reuse_bound(exact):
    requests, steps, memory, meta = exact
    s = metrics.summarize_run(
        requests, steps, {**meta, "block_size": 4}, workload_requests=_replayed(requests)
    )
    # completed r0, r1, r2: 10 + 20 + 5 prompt tokens, 8 cached (r1)
    assert s.metrics["prefix_hit_rate_first_admission"] == pytest.approx(8 / 35)
    # r1 reuses r0's blocks (100..103), (104..107); r0 and r2 reuse nothing
    assert s.metrics["prefix_reuse_upper_bound"] == pytest.approx(8 / 35)
    # the all-admissions rate counts steps, not requests
    assert s.metrics["prefix_hit_rate"] == pytest.approx(8 / 35)


def test_reuse_bound_missing_reasons(exact):
    requests, steps, memory, meta = exact
    s = metrics.summarize_run(requests, steps, meta)
    assert "workload_requests" in s.missing["prefix_reuse_upper_bound"]
    assert s.metrics["prefix_hit_rate_first_admission"] == pytest.approx(8 / 35)
    dense = metrics.summarize_run(
        requests, steps, {**meta, "block_size": None}, workload_requests=_replayed(requests)
    )
    assert "no KV block size" in dense.missing["prefix_reuse_upper_bound"]
    no_lookups = steps.assign(num_prefix_query_tokens=0, num_prefix_hit_tokens=0)
    s = metrics.summarize_run(requests, no_lookups, meta)
    assert math.isnan(s.metrics["prefix_hit_rate_first_admission"])
    assert "no prefix lookups" in s.missing["prefix_hit_rate_first_admission"]
    with pytest.raises(metrics.MetricsError, match=r"\['r0'\] are not among the workload_requests"):
        metrics.summarize_run(requests, steps, meta, workload_requests=_replayed(requests)[:3])


# --------------------------------------------------------------------------- live server
SERVER_NAMES = [doc.name for doc in metrics.SERVER_METRICS]


def test_server_counter_deltas_peaks_and_time_weighted_mean():
    frame = server_frame(
        [0.0, 1.0, 3.0, 4.0],
        kv_usage_fraction=[0.2, 0.6, 1.0, 0.0],
        num_running=[0, 3, 4, 0],
        num_waiting=[0, 2, 5, 0],
        prefix_query_tokens_total=[1000, 1200, 1400, 1500],  # 1000 before the run: not counted
        prefix_hit_tokens_total=[200, 250, 400, 450],
        num_preemptions_total=[3, 3, 5, 5],
    )
    s = metrics.server_summary(frame)
    m = s.metrics
    assert m["server_prefix_query_tokens"] == 500 and m["server_prefix_hit_tokens"] == 250
    assert m["server_prefix_hit_rate"] == pytest.approx(0.5)
    assert m["server_num_preemptions"] == 2
    assert m["server_kv_usage_peak"] == 1.0
    # each value held until the next scrape: (0.2*1 + 0.6*2 + 1.0*1) / 4 (plain mean 0.45, trapezoid 0.625)
    assert m["server_kv_usage_mean"] == pytest.approx(0.6)
    assert m["server_num_running_peak"] == 4 and m["server_num_waiting_peak"] == 5
    assert m["server_num_counter_resets"] == 0 and m["server_num_scrape_errors"] == 0
    assert set(m) == set(SERVER_NAMES) and s.missing == {}


def test_server_counter_reset_is_reported_not_a_negative_delta():
    frame = server_frame(
        [0.0, 1.0, 2.0, 3.0],
        prefix_query_tokens_total=[100, 300, 50, 80],  # restarted between t=1 and t=2
        prefix_hit_tokens_total=[10, 30, 0, 5],
        num_preemptions_total=[1, 1, 1, 1],
        kv_usage_fraction=[0.0, 0.1, 0.0, 0.1],
    )
    s = metrics.server_summary(frame)
    for name in ("server_prefix_query_tokens", "server_prefix_hit_tokens", "server_prefix_hit_rate"):
        assert name not in s.metrics
    assert (
        "prefix_query_tokens_total fell from 300 to 50 at t_s=2.000"
        in s.missing["server_prefix_query_tokens"]
    )
    assert "counter reset" in s.missing["server_prefix_hit_rate"]
    assert s.metrics["server_num_counter_resets"] == 1  # one scrape, however many counters fell
    assert s.metrics["server_num_preemptions"] == 0  # an unchanged counter is still a delta


def test_server_failed_scrapes_are_skipped_and_counted():
    frame = server_frame(
        [0.0, 1.0, 2.0, 3.0],
        errors=["", "", "ReadError: reset", "ConnectError: refused"],
        prefix_query_tokens_total=[10, 40, math.nan, math.nan],
        prefix_hit_tokens_total=[0, 8, math.nan, math.nan],
        kv_usage_fraction=[0.5, 0.7, math.nan, math.nan],
    )
    s = metrics.server_summary(frame)
    assert s.metrics["server_num_scrape_errors"] == 2
    assert s.metrics["server_prefix_query_tokens"] == 30 and s.metrics["server_prefix_hit_tokens"] == 8
    assert s.metrics["server_kv_usage_mean"] == pytest.approx(0.5)  # only the good scrapes
    everything_failed = server_frame([0.0, 1.0], errors=["ConnectError: refused", "ConnectError: refused"])
    s = metrics.server_summary(everything_failed)
    assert s.metrics == {"server_num_scrape_errors": 2}
    assert (
        "no scrape of the server's /metrics succeeded (first error: ConnectError: refused)"
        in (s.missing["server_kv_usage_peak"])
    )


def test_server_metrics_missing_reasons():
    sglang = server_frame(
        [0.0, 1.0],
        kind="sglang",
        kv_usage_fraction=[0.1, 0.3],
        prefix_hit_rate=[0.2, 0.4],
        num_running=[0, 2],
    )
    why = {"prefix_query_tokens_total": "SGLang reports a prefix hit-rate gauge"}
    s = metrics.server_summary(sglang, why)
    assert s.missing["server_prefix_query_tokens"] == why["prefix_query_tokens_total"]
    assert s.missing["server_prefix_hit_rate"] == why["prefix_query_tokens_total"]
    assert "did not report num_preemptions_total" in s.missing["server_num_preemptions"]
    assert s.metrics["server_kv_usage_peak"] == pytest.approx(0.3)
    idle = server_frame([0.0, 1.0], prefix_query_tokens_total=[5, 5], prefix_hit_tokens_total=[1, 1])
    assert "no prefix-cache lookups" in metrics.server_summary(idle).missing["server_prefix_hit_rate"]


def test_summarize_run_takes_the_server_frame(exact):
    requests, steps, memory, meta = exact
    plain = summary_of(requests, steps, meta, memory)
    for name in SERVER_NAMES:
        assert math.isnan(plain.metrics[name])
        assert plain.missing[name] == "not a live server run (no server metrics were scraped)"
    frame = server_frame([0.0, 0.5], prefix_query_tokens_total=[0, 35], prefix_hit_tokens_total=[0, 8])
    live = metrics.summarize_run(requests, steps, meta, memory, server_metrics=frame)
    assert live.metrics["server_prefix_hit_rate"] == pytest.approx(8 / 35)
    assert live.metrics["ttft_ms_mean"] == plain.metrics["ttft_ms_mean"]  # the rest is unchanged
    assert "not a live server run" not in live.missing.get("server_num_preemptions", "")


def test_live_runs_hide_the_clients_step_internals(exact):
    """A live server's steps are the client's polls: their KV and prefix figures are not
    measurements, so they are NaN with a reason, not 0 (a 'peak KV 0 B' summary)."""
    requests, steps, memory, meta = exact
    frame = server_frame([0.0, 0.5], prefix_query_tokens_total=[0, 35], prefix_hit_tokens_total=[0, 8])
    live = metrics.summarize_run(requests, steps, meta, memory, server_metrics=frame)
    for name in ("kv_peak_allocated_bytes", "prefix_hit_rate", "num_preemptions", "decode_roofline_ms_mean"):
        assert math.isnan(live.metrics[name]), name
        assert live.missing[name].startswith("live server: the client cannot see"), name
    plain = summary_of(requests, steps, meta, memory)
    # What the client does see stays: latencies, concurrency, and the server-reported
    # cached tokens per request (first admission).
    assert live.metrics["peak_num_running"] == plain.metrics["peak_num_running"]
    assert live.metrics["prefix_hit_rate_first_admission"] == plain.metrics["prefix_hit_rate_first_admission"]


def test_unknown_cached_tokens_are_not_summed_as_zero(exact):
    requests, steps, memory, meta = exact
    unknown = requests.assign(num_cached_tokens=[math.nan] + list(requests["num_cached_tokens"].iloc[1:]))
    result = summary_of(unknown, steps, meta, memory)
    assert math.isnan(result.metrics["num_cached_prompt_tokens"])
    assert "no cached-token count" in result.missing["num_cached_prompt_tokens"]
    assert math.isnan(result.metrics["prefix_hit_rate_first_admission"])
