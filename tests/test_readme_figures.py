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
