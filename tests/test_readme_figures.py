"""The README's measured figures are generated (scripts/readme_figures.py), and a stale
deterministic figure fails here: the real-mode tables are checked against fresh runs of
their experiments, gqa_vs_mha's also against its shipped baseline. The simulated
seed_claims* tables take minutes of sweeps, so `python scripts/readme_figures.py --run
--check` checks their figures; here their headers and rows are checked against the
script's declarations."""

from __future__ import annotations

import pandas as pd
import pytest
from experiment_sweeps import ROOT, fresh_sweep, readme_figures

from kvbench import results

README = (ROOT / "README.md").read_text()
BASELINE = ROOT / "results" / "baselines" / "gqa_vs_mha"
FRESH = ("gqa_vs_mha", "paged_vs_slab", "block_size", "parallel_sampling", "prefix_caching")
rf = readme_figures()


def fresh_table(experiment: str):  # -> readme_figures.Table
    figure = rf.FIGURES_BY_NAME[experiment]
    return rf.render_table(figure, results.load(fresh_sweep(experiment)).runs)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", FRESH)
def test_readme_table_matches_a_fresh_run(experiment: str) -> None:
    figure = rf.FIGURES_BY_NAME[experiment]
    assert rf.check_block(README, figure, fresh_table(experiment)) == []


def test_readme_gqa_table_matches_the_shipped_baseline() -> None:
    figure = rf.FIGURES_BY_NAME["gqa_vs_mha"]
    table = rf.render_table(figure, results.load(BASELINE).runs)
    assert rf.check_block(README, figure, table) == []
    assert table.probe_line and "GFLOP/s" in table.probe_line  # timed figures carry the probe


@pytest.mark.slow
@pytest.mark.parametrize("experiment", FRESH)
def test_a_hand_edited_figure_fails_the_check(experiment: str) -> None:
    """Every deterministic figure of every fresh-run table: changing it in a copy of the
    README fails the check, naming the row and column; a timed figure may change."""
    figure = rf.FIGURES_BY_NAME[experiment]
    table = fresh_table(experiment)
    start, stop = rf.block_span(README, experiment)
    block = README[start:stop]
    for row in rf.parse_rows(block)[1:]:
        line = "| " + " | ".join(row) + " |"
        for i, (header, timed) in enumerate(zip(table.headers[1:], table.timed), start=1):
            edited_line = "| " + " | ".join((*row[:i], row[i] + "1", *row[i + 1 :])) + " |"
            edited = README[:start] + block.replace(line, edited_line) + README[stop:]
            problems = rf.check_block(edited, figure, table)
            if timed:
                assert problems == []
            else:
                assert problems == [
                    f"{experiment}: row {row[0]!r}, {header!r}: README.md says {row[i]}1, "
                    f"the results give {row[i]}"
                ]


def test_the_stale_gqa_figures_of_issue_15_fail() -> None:
    figure = rf.FIGURES_BY_NAME["gqa_vs_mha"]
    table = rf.render_table(figure, results.load(BASELINE).runs)
    stale = README.replace("| 23,068,672 |", "| 21,889,024 |")
    assert rf.check_block(stale, figure, table) == [
        "gqa_vs_mha: row 'tiny-mha (8 KV heads)', 'peak KV bytes': README.md says 21,889,024, "
        "the results give 23,068,672"
    ]


@pytest.mark.parametrize("experiment", ["seed_claims", "seed_claims_best_of_8", "seed_claims_mooncake"])
def test_simulated_tables_have_the_declared_headers_and_rows(experiment: str) -> None:
    figure = rf.FIGURES_BY_NAME[experiment]
    start, stop = rf.block_span(README, experiment)
    rows = rf.parse_rows(README[start:stop])
    simulated = pd.DataFrame({"mode": ["sim"]})
    headers = [c.header for c in figure.columns]
    assert all(rf.is_deterministic(c.metric, simulated) for c in figure.columns)
    assert rows[0] == (figure.label_header, *headers)
    assert [row[0] for row in rows[1:]] == [row.label for row in figure.rows]


def test_repeats_that_disagree_on_a_deterministic_figure_are_refused() -> None:
    runs = results.load(BASELINE).runs
    first = runs.index[runs["model.name"] == "tiny-gqa"][0]
    runs.loc[first, "peak_num_running"] += 1
    with pytest.raises(rf.FiguresError, match="repeats disagree on the deterministic peak_num_running"):
        rf.render_table(rf.FIGURES_BY_NAME["gqa_vs_mha"], runs)


def test_a_readme_without_the_markers_is_refused() -> None:
    with pytest.raises(rf.FiguresError, match="no <!-- figures:gqa_vs_mha begin -->"):
        rf.block_span(README.replace("<!-- figures:gqa_vs_mha begin -->", ""), "gqa_vs_mha")


def test_write_then_check_round_trips() -> None:
    """--write's text passes --check's comparison: rendering and parsing agree."""
    figure = rf.FIGURES_BY_NAME["gqa_vs_mha"]
    table = rf.render_table(figure, results.load(BASELINE).runs)
    emptied = rf.replace_block(README, "gqa_vs_mha", "")
    assert rf.check_block(emptied, figure, table) == ["gqa_vs_mha: README.md's block has no table"]
    written = rf.replace_block(emptied, "gqa_vs_mha", rf.markdown(figure, table))
    assert rf.check_block(written, figure, table) == []


# --------------------------------------------------------------------------- sim_speed block
def _bench_json(path, **overrides) -> None:
    """A pytest-benchmark JSON file holding every benchmark the sim_speed block reads,
    with figures 1 / 2 / 3 (scaled per style) and the round context; ``overrides`` replace
    a benchmark's extra_info entries, keyed by benchmark name."""
    import json

    benchmarks = {}
    for figure in rf.BENCH_FIGURES:
        info = benchmarks.setdefault(
            figure.test,
            {
                "rounds": 5,
                "clock": "process_time",
                "load_avg_1m_before": 1.5,
                "load_avg_1m_after": 2.25,
                "probe_compute_gflops": 200.0,
                "probe_memory_gbps": 14.0,
                "probe_python_mops": 40.0 + len(benchmarks),
                "probe_cuda_tflops": None,
            },
        )
        info.update(figure.expect)
        if figure.spread:
            info.update({f"{figure.key}_min": 1.0, f"{figure.key}_median": 2.0, f"{figure.key}_max": 3.0})
        else:
            info[figure.key] = 0.75 * 2**30
    for name, changes in overrides.items():
        benchmarks[name].update(changes)
    data = {
        "machine_info": {"node": "ci"},
        "benchmarks": [
            {"name": name, "fullname": f"x.py::{name}", "extra_info": info}
            for name, info in benchmarks.items()
        ],
    }
    path.write_text(json.dumps(data))


def test_sim_speed_block_renders_medians_spread_rounds_load_and_probe(tmp_path) -> None:
    _bench_json(
        tmp_path / "bench.json", test_sim_sharegpt_like_requests_per_second={"requests_per_cpu_s_max": 5432.1}
    )
    table = rf.render_bench_table(rf.load_benchmarks([tmp_path / "bench.json"]))
    rows = {row[0]: row[1:] for row in table.rows}
    assert len(rows) == len(rf.BENCH_FIGURES)
    sharegpt_mops = 40.0  # the first benchmark _bench_json writes
    assert rows["ShareGPT-like, requests/s of CPU"] == (
        "1", "2", "5,432", "5", "1.50 -> 2.25", f"{sharegpt_mops:.3g}", ">= 5,000",
    )  # fmt: skip
    assert rows["Mooncake conversation, 12,031 requests at 128K: peak RSS GiB"][:3] == ("-", "0.75", "-")
    assert rows["prefix caching at 0 % hits, simulation: CPU overhead"][:3] == (
        "+100.0 %",
        "+200.0 %",
        "+300.0 %",
    )
    assert rows["block pool, revive: per-op cost at 16x the blocks / 1x"][:3] == ("1.000", "2.000", "3.000")
    # Each row carries its own benchmark's Python probe (it differs per benchmark here).
    mops = {test: 40.0 + i for i, test in enumerate(dict.fromkeys(f.test for f in rf.BENCH_FIGURES))}
    for figure in rf.BENCH_FIGURES:
        assert rows[figure.label][5] == f"{mops[figure.test]:.3g}", figure.label
    assert table.probe_line.endswith(
        "Median over the benchmarks of the rest of the probe: 200 GFLOP/s fp32 matmul, 14 GB/s copy."
    )


def test_sim_speed_block_write_then_check_round_trips(tmp_path) -> None:
    _bench_json(tmp_path / "bench.json")
    table = rf.render_bench_table(rf.load_benchmarks([tmp_path / "bench.json"]))
    begin, end = rf.markers(rf.BENCH_BLOCK)
    readme = f"# x\n{begin}\n{end}\n"
    assert rf.check_bench_block(readme, table) == ["sim_speed: README.md's block has no table"]
    written = rf.replace_block(readme, rf.BENCH_BLOCK, rf.bench_markdown(table))
    assert rf.check_bench_block(written, table) == []
    assert (
        written.count("| ShareGPT-like, requests/s of CPU | 1 | 2 | 3 | 5 | 1.50 -> 2.25 | 40 | >= 5,000 |")
        == 1
    )
    # Timed cells may change; a renamed row may not.
    assert rf.check_bench_block(written.replace("| 1 | 2 | 3 |", "| 1 | 9 | 3 |", 1), table) == []
    assert rf.check_bench_block(written.replace("ShareGPT-like", "ShareGPT"), table)


def test_sim_speed_block_refuses_a_run_at_other_settings(tmp_path) -> None:
    sim = "test_sim_mooncake_conversation_llama3_70b"
    _bench_json(tmp_path / "bench.json", **{sim: {"mooncake_12031_num_requests": 300}})
    with pytest.raises(
        rf.FiguresError, match="'mooncake_12031_num_requests' is 300, the figure .* needs 12031"
    ):
        rf.render_bench_table(rf.load_benchmarks([tmp_path / "bench.json"]))


def test_sim_speed_block_refuses_missing_and_duplicate_benchmarks(tmp_path) -> None:
    import json

    _bench_json(tmp_path / "a.json")
    data = json.loads((tmp_path / "a.json").read_text())
    data["benchmarks"] = [b for b in data["benchmarks"] if b["name"] != "test_block_pool_pairs[single]"]
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(rf.FiguresError, match=r"no benchmark 'test_block_pool_pairs\[single\]' in the JSON"):
        rf.render_bench_table(rf.load_benchmarks([tmp_path / "b.json"]))
    with pytest.raises(rf.FiguresError, match="is also in"):
        rf.load_benchmarks([tmp_path / "a.json", tmp_path / "b.json"])
    del data["benchmarks"][0]["extra_info"]["rounds"]
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(rf.FiguresError, match="extra_info has no number 'rounds'"):
        rf.render_bench_table(rf.load_benchmarks([tmp_path / "c.json"]))
    (tmp_path / "d.json").write_text("{}")
    with pytest.raises(rf.FiguresError, match="no 'benchmarks' list"):
        rf.load_benchmarks([tmp_path / "d.json"])


def test_readme_sim_speed_block_is_the_committed_benchmarks_rendered() -> None:
    """Every cell of README.md's sim_speed block, not only its labels: the committed
    benchmark JSON (tests/benchmarks/figures/) is fixed, so the block must be exactly what
    the script renders from it; a typed or hand-edited figure, or JSON re-measured without
    re-rendering, fails here."""
    paths = sorted((ROOT / "tests" / "benchmarks" / "figures").glob("*.json"))
    table = rf.render_bench_table(rf.load_benchmarks(paths))
    start, stop = rf.block_span(README, rf.BENCH_BLOCK)
    assert README[start:stop].strip() == rf.bench_markdown(table).strip()
