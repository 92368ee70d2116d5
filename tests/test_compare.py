"""kvbench compare: matching by config, verdicts, gates and exit codes."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from run_fixtures import base_meta, synthetic_run, write_sweep, write_synthetic

from kvbench import compare, metrics, results


@pytest.fixture
def baseline(tmp_path):
    return write_sweep(tmp_path / "base", "ref", tpot_s=0.02)


def gates(*texts):
    return ["--fail-on", *texts]


def test_identical_results_pass(baseline, tmp_path):
    result = compare.compare(baseline, baseline, ["tpot_ms_p99:+10%"])
    assert result.passed and result.num_matched == 5
    assert set(result.table["verdict"]) <= {"same", ""}
    assert compare.main([str(baseline), str(baseline), "--html", str(tmp_path / "c.html")]) == 0


def test_slower_candidate_fails_its_gates(baseline, tmp_path, capsys):
    slower = write_sweep(tmp_path / "cand", "ref", tpot_s=0.03)  # +50 % TPOT
    html_path = tmp_path / "diff.html"
    code = compare.main(
        [str(baseline), str(slower), *gates("tpot_p99:+10%", "throughput:-5%"), "--html", str(html_path)]
    )
    assert code == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "breaks tpot_p99:+10%" in out
    result = compare.compare(baseline, slower, ["tpot_ms_p99:+10%"])
    tpot = result.table[result.table["metric"] == "tpot_ms_p99"]
    assert len(tpot) == 4  # the failed h2o run has no metrics on either side
    assert tpot["change_pct"].tolist() == pytest.approx([50.0] * 4)
    assert set(tpot["verdict"]) == {"worse"} and tpot["regressed"].all()
    assert len(result.failures) == 4
    page = html_path.read_text()
    assert "FAIL (8)" in page and "REGRESSION" in page and "<script" not in page


def test_improvement_passes_and_reads_better(baseline, tmp_path):
    faster = write_sweep(tmp_path / "cand", "ref", tpot_s=0.015)
    result = compare.compare(baseline, faster, ["tpot_ms_p99:+10%", "output_tokens_per_s:-5%"])
    assert result.passed
    tpot = result.table[result.table["metric"] == "tpot_ms_p99"]
    assert tpot["change_pct"].tolist() == pytest.approx([-25.0] * 4)
    assert set(tpot["verdict"]) == {"better"}
    assert set(result.table.loc[result.table["metric"] == "output_tokens_per_s", "verdict"]) == {"better"}


def test_change_within_threshold_passes(baseline, tmp_path):
    slightly = write_sweep(tmp_path / "cand", "ref", tpot_s=0.021)  # +5 % TPOT
    assert (
        compare.main(
            [str(baseline), str(slightly), *gates("tpot_ms_p99:+10%"), "--html", str(tmp_path / "a.html")]
        )
        == 0
    )
    assert (
        compare.main(
            [str(baseline), str(slightly), *gates("tpot_ms_p99:+4%"), "--html", str(tmp_path / "b.html")]
        )
        == 1
    )
    # an absolute gate in the metric's unit: +1 ms allowed, the change is +1 ms exactly -> passes
    assert compare.compare(baseline, slightly, ["tpot_ms_p99:+1.0001"]).passed
    assert not compare.compare(baseline, slightly, ["tpot_ms_p99:+0.5"]).passed


def test_bad_input_exits_2(baseline, tmp_path, capsys):
    html_out = ["--html", str(tmp_path / "x.html")]
    assert compare.main([str(baseline), str(baseline), *gates("no_such_metric:+5%"), *html_out]) == 2
    assert "unknown metric 'no_such_metric'" in capsys.readouterr().out
    assert compare.main([str(baseline), str(baseline), *gates("tpot_ms_p99=10"), *html_out]) == 2
    assert compare.main([str(baseline), str(tmp_path / "empty"), *html_out]) == 2
    other = tmp_path / "other" / "r"
    write_synthetic(other, "r", "paged", 16, seed=99)  # a configuration the baseline never ran
    assert compare.main([str(baseline), str(other), *html_out]) == 2
    assert "no run of" in capsys.readouterr().out


def test_run_failing_only_in_candidate_is_a_failure(baseline, tmp_path):
    cand = write_sweep(tmp_path / "cand", "ref")
    meta = base_meta("run1", "paged", 16, seed=1, sweep_name="ref")
    results.write_failed_run(cand / "run1", meta, "CUDA out of memory")
    result = compare.compare(baseline, cand)
    assert not result.passed
    assert any("failed in the candidate (CUDA out of memory)" in f for f in result.failures)


def test_runs_missing_from_the_candidate_fail_unless_allowed(baseline, tmp_path):
    # Issue 17 item 8: a candidate missing runs used to exit 0; runs only in the candidate
    # are still listed, not failed.
    cand = tmp_path / "cand"
    write_synthetic(cand / "run0", "run0", "paged", 8, seed=0, sweep_name="ref")
    write_synthetic(cand / "extra", "extra", "paged", 64, seed=7, sweep_name="ref")
    result = compare.compare(baseline, cand, ["tpot_ms_p99:+10%"])
    assert not result.passed and result.num_matched == 1
    assert len(result.unmatched_baseline) == 4 and len(result.unmatched_candidate) == 1
    assert "block_size=64" in result.unmatched_candidate[0]
    missing = [f for f in result.failures if "missing from the candidate" in f]
    assert len(missing) == len(result.failures) == 4
    allowed = compare.compare(baseline, cand, ["tpot_ms_p99:+10%"], allow_missing=True)
    assert allowed.passed and len(allowed.not_judged) == 4
    html_out = ["--html", str(tmp_path / "m.html")]
    assert compare.main([str(baseline), str(cand), *html_out]) == 1
    assert compare.main([str(baseline), str(cand), "--allow-missing", *html_out]) == 0


def test_repeats_compare_by_median(tmp_path):
    base, cand = tmp_path / "base", tmp_path / "cand"
    write_synthetic(base / "a", "a", seed=0, tpot_s=0.02)
    for i, tpot_s in enumerate((0.019, 0.021, 0.05)):  # one outlier among three repeats
        write_synthetic(cand / f"r{i}", f"r{i}", seed=0, tpot_s=tpot_s)
    result = compare.compare(base, cand, ["tpot_ms_median:+10%"])
    assert result.passed
    row = result.table[result.table["metric"] == "tpot_ms_median"].iloc[0]
    assert row["candidate"] == pytest.approx(21.0)


def test_gate_parsing_and_directions():
    gate = compare.parse_gate("tpot_p99:+10%")
    assert (gate.metric, gate.sign, gate.limit, gate.relative) == ("tpot_ms_p99", 1, 0.10, True)
    assert (
        gate.regressed(100.0, 111.0) and not gate.regressed(100.0, 109.0) and not gate.regressed(100.0, 50.0)
    )
    drop = compare.parse_gate("throughput:-5%")
    assert (
        drop.metric == "output_tokens_per_s"
        and drop.regressed(100.0, 94.0)
        and not drop.regressed(100.0, 96.0)
    )
    assert compare.parse_gate("num_preemptions:+0").regressed(0.0, 1.0)
    with pytest.raises(compare.CompareError, match="expected METRIC"):
        compare.parse_gate("tpot_p99:10%")
    assert compare.better_direction("ttft_ms_p99") == "lower"
    assert compare.better_direction("output_tokens_per_s") == "higher"
    assert compare.better_direction("quality_passkey_accuracy") == "higher"
    assert compare.better_direction("quality_perplexity") == "lower"
    assert compare.better_direction("benchmark_duration_s") == ""


def test_gated_metric_missing_in_candidate_fails(tmp_path):
    base, cand = tmp_path / "base", tmp_path / "cand"
    write_synthetic(base / "a", "a", seed=0)
    write_synthetic(cand / "a", "a", seed=0)
    assert compare.compare(base, cand, ["prefix_hit_rate:-10%"]).passed  # measured on both sides
    broken = cand / "a" / "run.json"
    text = broken.read_text().replace('"prefix_hit_rate": 0.0', '"prefix_hit_rate": null')
    broken.write_text(text)
    result = compare.compare(base, cand, ["prefix_hit_rate:-10%"])
    assert not result.passed and "missing in the candidate" in result.failures[0]
    assert math.isnan(result.table.set_index("metric").loc["prefix_hit_rate", "candidate"])


def test_every_gate_on_a_metric_applies(baseline, tmp_path):
    slightly = write_sweep(tmp_path / "cand", "ref", tpot_s=0.021)  # +5 % TPOT, +1 ms
    # The relative gate passes, the absolute one (+0.5 ms) does not: both must be checked.
    result = compare.compare(baseline, slightly, ["tpot_ms_p99:+10%", "tpot_ms_p99:+0.5"])
    assert not result.passed
    assert all("breaks tpot_ms_p99:+0.5" in f for f in result.failures)


# --------------------------------------------------------------------------- issue 17 item 8
def test_gate_on_a_metric_nan_on_both_sides_cannot_judge(baseline, tmp_path, capsys):
    # No SLO in the fixtures: goodput is NaN in every run, on both sides.
    result = compare.compare(baseline, baseline, ["goodput:-5%"])
    assert not result.passed and len(result.failures) == 4
    assert all("cannot be judged by goodput:-5%: missing on both sides" in f for f in result.failures)
    assert all("no SLO given" in f for f in result.failures)  # the reason run.json recorded
    goodput = result.table[result.table["metric"] == "goodput_requests_per_s"]
    assert set(goodput["verdict"]) == {"cannot judge"} and goodput["regressed"].all()
    allowed = compare.compare(baseline, baseline, ["goodput:-5%"], allow_missing=True)
    assert allowed.passed and len(allowed.not_judged) == 4
    assert not allowed.table["regressed"].any()
    html_out = ["--html", str(tmp_path / "nan.html")]
    assert compare.main([str(baseline), str(baseline), *gates("goodput:-5%"), *html_out]) == 1
    assert "CANNOT JUDGE" in capsys.readouterr().out
    assert (
        compare.main([str(baseline), str(baseline), *gates("goodput:-5%"), "--allow-missing", *html_out]) == 0
    )
    assert "NOT JUDGED" in capsys.readouterr().out


def test_gated_metric_missing_in_the_baseline_cannot_judge(tmp_path):
    base, cand = tmp_path / "base", tmp_path / "cand"
    write_synthetic(base / "a", "a", seed=0)
    write_synthetic(cand / "a", "a", seed=0)
    record = base / "a" / "run.json"
    record.write_text(record.read_text().replace('"prefix_hit_rate": 0.0', '"prefix_hit_rate": null'))
    result = compare.compare(base, cand, ["prefix_hit_rate:-10%"])
    assert not result.passed and "missing in the baseline" in result.failures[0]
    assert compare.compare(base, cand, ["prefix_hit_rate:-10%"], allow_missing=True).passed
    assert compare.compare(base, cand, ["tpot_ms_p99:+10%"]).passed  # ungated NaN: no verdict needed


def write_mixed_sweep(sweep_dir):
    """A paged and a slab run whose engine params differ in keys, as the real presets do
    (paged has prefix_cache, slab has reserve): the runs frame of the sweep has NaN holes."""
    params = {
        "paged": {
            "block_size": 16,
            "num_blocks": None,
            "prefix_cache": "block_hash",
            "chunked_prefill": True,
        },
        "slab": {"block_size": 16, "num_blocks": None, "reserve": "max_len", "chunked_prefill": True},
    }
    for i, (engine, engine_params) in enumerate(params.items()):
        requests, steps, memory, meta = synthetic_run(f"{engine}-run", engine, 16, seed=i, sweep_name="mixed")
        meta["engine_params"] = engine_params
        summary = metrics.summarize_run(requests, steps, meta, memory)
        results.write_run(
            sweep_dir / f"{engine}-run",
            requests,
            steps,
            memory,
            meta,
            "x: 1\n",
            summary.metrics,
            summary.missing,
        )
    return sweep_dir


def test_one_run_directory_matches_itself_inside_its_sweep(tmp_path, capsys):
    # Issue 17 item 8: each side's key used to be built from the columns that side had,
    # so a run alone (no 'engine.reserve' column) never matched itself in the sweep.
    sweep = write_mixed_sweep(tmp_path / "mixed")
    html_out = ["--html", str(tmp_path / "one.html")]
    for engine in ("paged", "slab"):
        run_dir = sweep / f"{engine}-run"
        result = compare.compare(run_dir, sweep, ["tpot_ms_p99:+10%"])
        assert result.num_matched == 1 and result.passed, result.failures
        assert len(result.unmatched_candidate) == 1 and result.unmatched_baseline == ()
        assert compare.main([str(run_dir), str(sweep), *gates("tpot_ms_p99:+10%"), *html_out]) == 0
        # The other way round the sweep's other run is missing from the candidate.
        reverse = compare.compare(sweep, run_dir, ["tpot_ms_p99:+10%"])
        assert reverse.num_matched == 1 and not reverse.passed
        assert compare.compare(sweep, run_dir, ["tpot_ms_p99:+10%"], allow_missing=True).passed
    capsys.readouterr()


def test_identity_keys_read_an_absent_column_as_empty():
    alone = pd.DataFrame({"engine": ["slab"], "engine.block_size": [16]})
    in_sweep = pd.DataFrame(
        {
            "engine": ["paged", "slab"],
            "engine.block_size": [16.0, 16.0],
            "engine.prefix_cache": ["radix", None],
        }
    )
    columns = compare.identity_columns(alone, in_sweep)
    assert columns == ["engine", "engine.block_size", "engine.prefix_cache"]
    assert compare.identity_keys(alone, columns)[0] == compare.identity_keys(in_sweep, columns)[1]
    assert compare.identity_keys(in_sweep, columns)[0] != compare.identity_keys(in_sweep, columns)[1]


def test_hostile_metric_names_and_labels_do_not_break_the_terminal_table(tmp_path, capsys):
    # Rich markup in a label or metric name prints as text (an unbalanced "[/x]" would be parsed).
    base, cand = tmp_path / "base", tmp_path / "cand"
    for side, tpot_s in ((base, 0.02), (cand, 0.03)):
        requests, steps, memory, meta = synthetic_run("r[/y]", "[/bold][red]evil", 16, tpot_s=tpot_s)
        summary = metrics.summarize_run(requests, steps, meta, memory)
        values = {**summary.metrics, "quality_[/x]": 0.5}
        results.write_run(side / "r", requests, steps, memory, meta, "x: 1\n", values, summary.missing)
    html_out = ["--html", str(tmp_path / "h.html")]
    assert compare.main([str(base), str(cand), "--all", *gates("tpot_ms_p99:+10%"), *html_out]) == 1
    out = capsys.readouterr().out
    assert "quality_[/x]" in out and "FAIL r[/y]: tpot_ms_p99" in out


def test_compare_html_never_overwrites_a_user_file(baseline, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    planted = tmp_path / "reports" / f"compare-{baseline.name}.html"  # the default output path
    planted.parent.mkdir()
    planted.write_text("<p>my diff notes</p>")
    assert compare.main([str(baseline), str(baseline)]) == 2
    out = capsys.readouterr().out
    assert "refusing to overwrite a file kvbench did not write" in out and planted.name in out
    assert planted.read_text() == "<p>my diff notes</p>"
    mine = tmp_path / "mine.html"
    mine.write_text("<p>mine</p>")
    assert compare.main([str(baseline), str(baseline), "--html", str(mine)]) == 2
    assert mine.read_text() == "<p>mine</p>"
    planted.unlink()
    assert compare.main([str(baseline), str(baseline)]) == 0
    assert compare.main([str(baseline), str(baseline)]) == 0  # its own page is replaced
    assert sorted(p.name for p in planted.parent.iterdir()) == [planted.name]


def test_clock_free_schedule_decides_whether_schedule_metrics_are_timed() -> None:
    """A closed loop of one is clock-free even with Poisson arrivals; chat turns spaced by
    turn_interval_s are not, even with offline first arrivals (run.json clock_free_schedule)."""
    from kvbench.compare import run_timing

    base = {"mode": "real", "engine_kind": "engine", "workload_params.arrival": "offline"}
    assert run_timing(pd.DataFrame([{**base, "clock_free_schedule": False}])) == (False, True)
    closed = {**base, "workload_params.arrival": "poisson", "clock_free_schedule": True}
    assert run_timing(pd.DataFrame([closed])) == (False, False)
    assert run_timing(pd.DataFrame([base])) == (False, False)  # older runs: offline stands for it
    assert run_timing(pd.DataFrame([{**closed, "engine_kind": "live"}])) == (False, True)
