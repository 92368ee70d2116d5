"""kvbench compare: matching by config, verdicts, gates and exit codes."""

from __future__ import annotations

import math

import pytest
from run_fixtures import base_meta, write_sweep, write_synthetic

from kvbench import compare, results


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


def test_unmatched_runs_are_listed_not_failed(baseline, tmp_path):
    cand = tmp_path / "cand"
    write_synthetic(cand / "run0", "run0", "paged", 8, seed=0, sweep_name="ref")
    write_synthetic(cand / "extra", "extra", "paged", 64, seed=7, sweep_name="ref")
    result = compare.compare(baseline, cand, ["tpot_ms_p99:+10%"])
    assert result.passed and result.num_matched == 1
    assert len(result.unmatched_baseline) == 4 and len(result.unmatched_candidate) == 1
    assert "block_size=64" in result.unmatched_candidate[0]


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
