"""The README stays true: its metric table is the code's, its commands name real presets."""

from __future__ import annotations

import re
from pathlib import Path

from kvbench.metrics import metrics_markdown

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_metric_table_matches_the_code() -> None:
    assert metrics_markdown().strip() in README, "regenerate the README table from kvbench.metrics"


def test_first_lines_are_the_install_and_test_commands() -> None:
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert (
        block[0].startswith("pip install torch==2.13.0")
        and "kvbench sweep +experiment=gqa_vs_mha" in block[0]
    )
    assert block[1] == "python -m pytest -q"
    assert '"$PY" -m pytest -q' in (ROOT / ".ci" / "run").read_text(), (
        ".ci/run must run the README test command"
    )


def test_presets_named_in_the_readme_exist() -> None:
    conf = ROOT / "conf"
    for group in ("model", "hardware", "engine", "workload"):
        names = {p.stem for p in (conf / group).glob("*.yaml")}
        for used in set(re.findall(rf"\b{group}=([a-z0-9_.-]+)", README)):
            if "," in used or used in ("NAME", "null"):
                continue
            assert used in names, f"README uses {group}={used}, which conf/{group}/ does not have"
    experiments = {p.stem for p in (conf / "experiment").glob("*.yaml")}
    for used in set(re.findall(r"\+experiment=([a-z0-9_]+)", README)):
        if used != "NAME":
            assert used in experiments, used
