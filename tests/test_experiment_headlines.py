"""Every shipped experiment declares its headline: metrics a run records (catalogue
metrics, run facts, or quality_* from the quality harness) and a report plot that exists."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.metrics import METRICS_BY_NAME
from kvbench.report import PLOT_KEYS
from kvbench.summary_view import RUN_FACTS

EXPERIMENTS = sorted((Path(__file__).resolve().parents[1] / "conf" / "experiment").glob("*.yaml"))
KNOWN = {*METRICS_BY_NAME, *(fact.name for fact in RUN_FACTS)}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_experiment_declares_a_valid_headline(path: Path) -> None:
    headline = OmegaConf.load(path).get("headline")
    assert headline is not None, f"{path.name}: no headline section"
    assert headline.plot in PLOT_KEYS, f"{path.name}: headline.plot {headline.plot!r}"
    assert len(headline.metrics) >= 3, f"{path.name}: headline.metrics {headline.metrics}"
    for metric in headline.metrics:
        assert metric in KNOWN or metric.startswith("quality_"), f"{path.name}: unknown metric {metric!r}"
