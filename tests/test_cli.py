"""The `kvbench` command end to end: help, size, validation errors, run, sweep, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from run_fixtures import run_kvbench

SMALL = ["workload.num_requests=3", "workload.prompt_len=24", "workload.output_len=4", "run.warmup=false"]


kvbench = run_kvbench


def test_help_lists_every_subcommand(tmp_path: Path) -> None:
    out = kvbench("--help", cwd=tmp_path)
    assert out.returncode == 0
    for command in ("run", "sweep", "size", "report", "compare", "trace", "calibrate"):
        assert f"  {command}" in out.stdout
    for command in ("run", "sweep", "size", "report", "compare", "trace"):
        sub = kvbench(command, "--help", cwd=tmp_path)
        assert sub.returncode == 0, (command, sub.stderr)
        assert "usage" in sub.stdout.lower(), command


def test_compare_and_report_help_state_what_they_judge_and_write(tmp_path: Path) -> None:
    compare_help = " ".join(kvbench("compare", "--help", cwd=tmp_path).stdout.split())
    assert "--allow-missing" in compare_help and '("cannot judge")' in compare_help
    assert "missing from the candidate" in compare_help
    assert "requests.parquet and steps.parquet are not read" in compare_help  # issue 17 item 8
    report_help = " ".join(kvbench("report", "--help", cwd=tmp_path).stdout.split())
    assert "reports/<name of RESULTS_DIR>.html" in report_help and "only if kvbench wrote it" in report_help


def test_unknown_command_fails(tmp_path: Path) -> None:
    out = kvbench("frobnicate", cwd=tmp_path)
    assert out.returncode == 2 and "unknown command 'frobnicate'" in out.stderr


def test_size_json_is_exact_for_llama3_70b(tmp_path: Path) -> None:
    out = kvbench(
        "size", "model=llama-3-70b", "seq_len=8192", "batch=32", "hardware=h200-141gb", "--json", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["kv_bytes_per_token"] == 327_680
    assert report["kv_bytes_per_sequence"] == 2_684_354_560
    assert report["kv_bytes_per_batch"] == 32 * 2_684_354_560


def test_size_table_names_the_model(tmp_path: Path) -> None:
    out = kvbench("size", "model=mistral-7b", "seq_len=4096", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "mistral-7b" in out.stdout and "131,072" in out.stdout


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("+foo=1", "foo"),
        ("+model.foo=1", "model.foo"),
        ("model.num_layers=abc", "model.num_layers"),
        ("model=no-such-model", "model=no-such-model"),
        ("model.num_kv_heads=3", "model.num_kv_heads"),
        ("engine=paged engine.block_size=12", "engine.block_size"),
        ("+engine.foo=1", "engine.foo"),
        ("workload.num_requests=-5", "workload.num_requests"),
        ("workload.prompt_len=-3", "workload.prompt_len"),
        ("run.mode=fast", "run.mode"),
        ("slo.ttft_ms=-1", "slo.ttft_ms"),
    ],
)
def test_invalid_config_exits_nonzero_naming_the_key(override: str, named: str, tmp_path: Path) -> None:
    out = kvbench("run", *override.split(), "run.warmup=false", cwd=tmp_path)
    assert out.returncode == 2, "a configuration error exits 2, whether Hydra or kvbench finds it"
    text = out.stdout + out.stderr
    assert named in text, text
    assert len(text.strip().splitlines()) <= 25, "the error must fit on one screen"
    assert "Traceback" not in text


def test_size_rejects_bad_block_size(tmp_path: Path) -> None:
    out = kvbench("size", "block_size=24", cwd=tmp_path)
    assert out.returncode == 2 and "block_size" in out.stderr


def test_run_writes_results_without_changing_directory_and_resumes(tmp_path: Path) -> None:
    out = kvbench("run", "model=tiny-mqa", *SMALL, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"], "nothing but results/ may appear in cwd"
    (run_dir,) = (tmp_path / "results" / "single").iterdir()
    assert run_dir.name.startswith("model=tiny-mqa")
    for name in ("requests.parquet", "steps.parquet", "run.json", "config.yaml"):
        assert (run_dir / name).exists(), name
    record = json.loads((run_dir / "run.json").read_text())["meta"]
    assert record["status"] == "ok"
    assert record["environment"]["torch_version"]
    requests = pd.read_parquet(run_dir / "requests.parquet")
    assert list(requests["num_output_tokens"]) == [4, 4, 4]
    again = kvbench("run", "model=tiny-mqa", *SMALL, cwd=tmp_path)
    assert again.returncode == 0 and "already complete" in again.stdout


def test_gqa_vs_mha_sweep_compares_kv_heads(tmp_path: Path) -> None:
    out = kvbench("sweep", "+experiment=gqa_vs_mha", *SMALL, "run.report=false", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    sweep = tmp_path / "results" / "gqa_vs_mha"
    runs = pd.read_parquet(sweep / "runs.parquet").set_index("model.name")
    assert sorted(runs.index) == ["tiny-gqa", "tiny-mha", "tiny-mqa"]
    per_token = runs["kv_bytes_per_token"]
    assert per_token["tiny-mha"] == 4 * per_token["tiny-gqa"] == 8 * per_token["tiny-mqa"]
    assert runs.loc["tiny-mha", "kv_peak_allocated_bytes"] > runs.loc["tiny-mqa", "kv_peak_allocated_bytes"]
    assert (runs["output_tokens_per_s"] > 0).all()


def test_failed_job_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    out = kvbench(
        "sweep",
        "engine=dense",
        "engine.max_num_seqs=0,2",
        *SMALL,
        "run.sweep_name=partial",
        "run.report=false",
        cwd=tmp_path,
    )
    assert out.returncode == 1, (out.stdout, out.stderr)
    statuses = sorted(
        json.loads(p.read_text())["meta"]["status"]
        for p in (tmp_path / "results" / "partial").glob("*/run.json")
    )
    assert statuses == ["failed", "ok"]


@pytest.mark.parametrize("launcher", ["submitit_local", "joblib"])
def test_launcher_plugins_land_in_one_sweep_directory(launcher: str, tmp_path: Path) -> None:
    pytest.importorskip(
        {
            "submitit_local": "hydra_plugins.hydra_submitit_launcher",
            "joblib": "hydra_plugins.hydra_joblib_launcher",
        }[launcher]
    )
    out = kvbench(
        "sweep",
        f"hydra/launcher={launcher}",
        "model=tiny-mha,tiny-mqa",
        *SMALL,
        f"run.sweep_name={launcher}",
        "run.report=false",
        cwd=tmp_path,
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    runs = pd.read_parquet(tmp_path / "results" / launcher / "runs.parquet")
    assert sorted(runs["model.name"]) == ["tiny-mha", "tiny-mqa"]
    assert (runs["status"] == "ok").all()


def test_sim_mode_runs_a_paper_scale_model_without_tensors(tmp_path: Path) -> None:
    out = kvbench(
        "run",
        "run.mode=sim",
        "engine=paged",
        "model=llama-3-8b",
        "hardware=h100-80gb",
        "workload=chat",
        "engine.kv_memory_bytes=null",
        cwd=tmp_path,
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    (run_dir,) = (tmp_path / "results" / "single").iterdir()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["meta"]["mode"] == "sim"
    assert record["summary"]["output_tokens_per_s"] > 0
