"""kvbench never deletes or overwrites what it did not write, and fails cleanly on bad paths.

Issue 17 items 1 and 5: run ids and sweep names are single names; an existing directory
is replaced only when it is a kvbench run directory; a process killed mid-replace leaves
the old or the new run loadable; filesystem errors name the path; a run in which nothing
completed is recorded as failed. Library-level cases run in-process; the command-line
cases run ``python -m kvbench`` as a user does (``run_fixtures.run_kvbench``), some with
a failure injected before the CLI starts (``run_patched``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig
from run_fixtures import exact_run, run_kvbench

from kvbench import metrics, results
from kvbench.config import ConfigError, register_schemas
from kvbench.execute import nothing_completed_error
from kvbench.sweep import run_job

BASELINE_RUN = (
    Path(__file__).parent.parent / "results" / "baselines" / "gqa_vs_mha" / "model=tiny-gqa-08c99ff5"
)
BASE = ["model=tiny-mqa", "workload.output_len=2", "run.warmup=false", "run.report=false"]
TINY = [*BASE, "workload.num_requests=1", "workload.prompt_len=8"]


def write_exact(run_dir: Path, **meta_overrides: object) -> dict:
    requests, steps, memory, meta = exact_run()
    meta = {**meta, "run_id": run_dir.name, **meta_overrides}
    summary = metrics.summarize_run(requests, steps, meta, memory)
    results.write_run(
        run_dir, requests, steps, memory, meta, "engine: paged\n", summary.metrics, summary.missing
    )
    return meta


def plant(directory: Path, name: str = "thesis.txt") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    precious = directory / name
    precious.write_text("four years of work\n")
    return precious


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its content (directories implied)."""
    return {str(p.relative_to(root)): p.read_bytes().hex() for p in sorted(root.rglob("*")) if p.is_file()}


def hidden_siblings(directory: Path) -> list[str]:
    return sorted(
        p.name for p in directory.iterdir() if p.name.startswith(".") and p.name != ".kvbench-sweep"
    )


def assert_one_screen_without_traceback(out: subprocess.CompletedProcess[str]) -> str:
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "Error executing job" not in text, text
    assert len(text.strip().splitlines()) <= 25, text
    return text


def run_patched(patch: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``kvbench ARGS`` in a fresh process after running the Python ``patch`` (a failure to inject)."""
    code = textwrap.dedent(patch) + "\nfrom kvbench.cli import main\nraise SystemExit(main(sys.argv[1:]))\n"
    return subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, *args],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


DISK_FULL = """
import errno, os
import pandas as pd

def disk_full(self, path, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

pd.DataFrame.to_parquet = disk_full
"""


# --------------------------------------------------------------------------- names
@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../x", "a\\b", "/abs", "a\0b", ".hidden"])
@pytest.mark.parametrize("key", ["run.run_id", "run.sweep_name"])
def test_names_that_are_not_one_directory_are_refused(bad: str, key: str) -> None:
    with pytest.raises(results.ResultsWriteError, match=rf"^{key}: .+ it must be a single name"):
        results.check_path_component(bad, key)


def test_ordinary_run_ids_are_accepted() -> None:
    for good in ("model=tiny-mqa,workload.num_requests=1-6c2f3a7d", "precious", "a..b", "x.old"):
        assert results.check_path_component(good, "run.run_id") == good


# --------------------------------------------------------------------------- replacing directories
def test_a_users_directory_at_the_run_path_survives(tmp_path: Path) -> None:
    precious = plant(tmp_path / "precious")
    before = snapshot(tmp_path)
    with pytest.raises(
        results.ResultsWriteError, match=r"precious: exists and is not a kvbench run directory"
    ):
        write_exact(tmp_path / "precious")
    assert snapshot(tmp_path) == before and precious.read_text() == "four years of work\n"
    assert hidden_siblings(tmp_path) == []


@pytest.mark.parametrize(
    "setup",
    [
        "user file inside a kvbench run",
        "run.json of another run",
        "config.yaml only",
        "empty directory",
        "a file",
        "a symlink to a user directory",
    ],
)
def test_only_kvbench_run_directories_are_replaced(setup: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "sweep" / "r"
    user = tmp_path / "user"
    plant(user)
    if setup == "user file inside a kvbench run":
        write_exact(run_dir)
        plant(run_dir, "notes.txt")
    elif setup == "run.json of another run":
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(json.dumps({"meta": {"run_id": "other", "status": "ok"}}))
    elif setup == "config.yaml only":
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text("my: project\n")
    elif setup == "empty directory":
        run_dir.mkdir(parents=True)
    elif setup == "a file":
        run_dir.parent.mkdir(parents=True)
        run_dir.write_text("mine\n")
    else:
        run_dir.parent.mkdir(parents=True)
        run_dir.symlink_to(user, target_is_directory=True)
    before = snapshot(tmp_path)
    with pytest.raises(
        results.ResultsWriteError, match="is not a kvbench run directory, so it is left untouched"
    ):
        write_exact(run_dir)
    with pytest.raises(results.ResultsWriteError):
        results.write_failed_run(run_dir, {"run_id": "r"}, "boom")
    assert snapshot(tmp_path) == before
    assert hidden_siblings(run_dir.parent) == []


def test_marked_and_pre_marker_runs_are_replaced(tmp_path: Path) -> None:
    marked = tmp_path / "marked"
    write_exact(marked)
    assert (marked / results.RUN_MARKER).read_text() == results.RUN_MARKER_TEXT
    write_exact(marked, config_hash="new")
    assert results.read_record(marked)["meta"]["config_hash"] == "new"
    # A shipped baseline predates the marker: its run.json names its directory.
    legacy = tmp_path / BASELINE_RUN.name
    shutil.copytree(BASELINE_RUN, legacy)
    assert not (legacy / results.RUN_MARKER).exists()
    results.check_replaceable_run_dir(legacy)
    write_exact(legacy, config_hash="new")
    assert results.read_record(legacy)["meta"]["config_hash"] == "new"
    assert (legacy / results.RUN_MARKER).is_file()
    assert hidden_siblings(tmp_path) == []


def test_shipped_baselines_still_load() -> None:
    runs = results.load(BASELINE_RUN.parent).runs
    assert sorted(set(runs["model.name"])) == ["tiny-gqa", "tiny-mha", "tiny-mqa"]
    assert sorted(set(runs["run.repeat"])) == [0, 1, 2, 3, 4] and len(runs) == 15


# --------------------------------------------------------------------------- killed mid-replace
KILL_BETWEEN_RENAMES = """
import os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from run_fixtures import exact_run
from kvbench import results

run_dir = Path({run_dir!r})
requests, steps, memory, meta = exact_run()
meta = {{**meta, "run_id": run_dir.name, "config_hash": "new"}}
results._exchange = lambda a, b: False  # the rename fallback, as off Linux
calls = []
real_replace = os.replace

def die():
    os._exit(137)  # like SIGKILL: no handler, no cleanup

def replace_then_die(src, dst):
    calls.append(dst)
    if len(calls) == 2 and {die_at!r} == "second-rename":
        die()
    real_replace(src, dst)

os.replace = replace_then_die
if {die_at!r} == "cleanup":
    results.shutil.rmtree = lambda *args, **kwargs: die()
results.write_run(run_dir, requests, steps, memory, meta, "", {{}})
"""


@pytest.mark.parametrize("die_at", ["second-rename", "cleanup"])
def test_a_kill_between_the_renames_leaves_a_loadable_run(die_at: str, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_dir = sweep / "r"
    write_exact(run_dir, config_hash="old")
    script = KILL_BETWEEN_RENAMES.format(
        tests=str(Path(__file__).parent), run_dir=str(run_dir), die_at=die_at
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert killed.returncode == 137, killed.stderr
    # Killed before the new run took the name: the old one, under its hidden name, is the run.
    expected = "old" if die_at == "second-rename" else "new"
    assert os.path.lexists(run_dir) == (die_at == "cleanup")
    runs = results.load(sweep).runs
    assert runs["run_id"].tolist() == ["r"] and runs["config_hash"].tolist() == [expected]
    assert results.load(run_dir).runs["config_hash"].tolist() == [expected]
    assert results.is_complete(run_dir, expected)
    # The next write puts an orphaned old run back under its name, then replaces it.
    write_exact(run_dir, config_hash="third")
    assert results.load(sweep).runs["config_hash"].tolist() == ["third"]
    assert [p.name for p in sweep.iterdir() if not p.name.startswith(".")] == ["r"]
    if die_at == "second-rename":
        assert not any(p.name.startswith(".r.old-") for p in sweep.iterdir())


def test_a_failed_second_rename_puts_the_old_run_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "r"
    write_exact(run_dir, config_hash="old")
    monkeypatch.setattr(results, "_exchange", lambda a, b: False)
    calls = []
    real_replace = os.replace

    def second_fails(src: object, dst: object) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, "I/O error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(results.ResultsWriteError, match="r: cannot write: I/O error"):
        write_exact(run_dir, config_hash="new")
    assert results.read_record(run_dir)["meta"]["config_hash"] == "old"
    assert hidden_siblings(tmp_path) == []


@pytest.mark.skipif(results._renameat2() is None, reason="renameat2 is Linux-only")
def test_rerun_swaps_atomically_when_the_kernel_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "r"
    write_exact(run_dir, config_hash="old")
    monkeypatch.setattr(os, "replace", lambda src, dst: pytest.fail(f"os.replace({src}, {dst}) on a rerun"))
    write_exact(run_dir, config_hash="new")
    assert results.read_record(run_dir)["meta"]["config_hash"] == "new"
    assert hidden_siblings(tmp_path) == []


# --------------------------------------------------------------------------- filesystem errors
def test_results_under_a_file_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "passwd").write_text("root:x:0:0\n")
    with pytest.raises(results.ResultsWriteError, match=r"passwd is a file, not a directory"):
        write_exact(tmp_path / "passwd" / "x" / "single" / "r")
    assert (tmp_path / "passwd").read_text() == "root:x:0:0\n"


def test_permission_denied_names_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_mkdir = Path.mkdir

    def denied(self: Path, *args: object, **kwargs: object) -> None:
        if self.name.startswith("."):  # the probe and the temporary run directory
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(results.ResultsWriteError, match=r"sweep: cannot write: Permission denied"):
        write_exact(tmp_path / "sweep" / "r")
    assert list((tmp_path / "sweep").iterdir()) == []


def test_disk_full_keeps_the_previous_run_and_removes_the_partial_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "r"
    write_exact(run_dir, config_hash="old")

    def disk_full(self: pd.DataFrame, path: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pd.DataFrame, "to_parquet", disk_full)
    with pytest.raises(results.ResultsWriteError, match=r"r/requests.parquet: cannot write: No space left"):
        write_exact(run_dir, config_hash="new")
    assert results.read_record(run_dir)["meta"]["config_hash"] == "old"
    assert hidden_siblings(tmp_path) == []


# --------------------------------------------------------------------------- sweep tables
def test_sweep_tables_replace_only_kvbench_tables(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    write_exact(sweep / "r")
    user_csv = plant(sweep, "runs.csv")
    with pytest.raises(results.ResultsWriteError, match=r"runs.csv: exists and is not a kvbench sweep table"):
        results.write_sweep_table(sweep)
    assert user_csv.read_text() == "four years of work\n"
    assert not (sweep / "runs.parquet").exists() and not (sweep / results.SWEEP_MARKER).exists()
    user_csv.unlink()
    results.write_sweep_table(sweep)  # writes the marker; later sweeps replace the tables
    assert (sweep / results.SWEEP_MARKER).is_file()
    results.write_sweep_table(sweep)
    # Tables written before the marker existed are recognised by their columns.
    legacy = tmp_path / "legacy"
    shutil.copytree(BASELINE_RUN.parent, legacy)
    results.write_sweep_table(legacy)
    assert pd.read_parquet(legacy / "runs.parquet")["run_id"].nunique() == 15


# --------------------------------------------------------------------------- nothing completed
def test_nothing_completed_names_the_counted_reasons() -> None:
    requests = pd.DataFrame({"rejected_reason": ["too long", "too long", "", "no pool", "beams"]})
    summary = {"num_requests": 5.0, "num_completed": 0.0, "num_unfinished": 1.0}
    error = nothing_completed_error(requests, summary)
    assert error.startswith("0 of 5 requests completed; rejected: 2 x 'too long', 1 x ")
    assert "'no pool'" in error and "'beams'" in error and error.endswith("unfinished when the run ended: 1")
    assert nothing_completed_error(requests, {**summary, "num_completed": 1.0}) == ""
    empty = pd.DataFrame({"rejected_reason": pd.Series([], dtype=str)})
    assert "no requests" in nothing_completed_error(empty, {**summary, "num_requests": 0.0})


# --------------------------------------------------------------------------- the command line
def compose_run(overrides: list[str]) -> DictConfig:
    """The config `kvbench run OVERRIDES` gets, composed in-process."""
    register_schemas()
    with initialize_config_module("kvbench.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b"])
@pytest.mark.parametrize("key", ["run.run_id", "run.sweep_name"])
def test_run_job_refuses_names_before_touching_the_filesystem(
    key: str, bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    plant(tmp_path / "D" / "single")
    plant(tmp_path / "D")
    before = snapshot(tmp_path)
    cfg = compose_run([*TINY, "run.results_dir=D", f"{key}={bad}"])
    with pytest.raises(ConfigError, match=rf"^{key}: '{re.escape(bad)}' "):
        run_job(cfg)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "names",
    [
        ["run.sweep_name=mine", "run.run_id=precious"],  # a user's directory at the run path
        ["run.sweep_name=.", "run.run_id=."],  # the "delete everything under D"
        ["run.run_id=.."],
    ],
    ids=lambda names: " ".join(names),
)
def test_run_refuses_and_planted_files_survive(names: list[str], tmp_path: Path) -> None:
    root = tmp_path / "home"
    plant(root / "D" / "mine" / "precious")
    plant(root / "D" / "precious")
    plant(root / "D")
    plant(root)
    before = snapshot(tmp_path)
    out = run_kvbench("run", *TINY, "run.results_dir=D", *names, cwd=root)
    assert out.returncode == 2, (out.stdout, out.stderr)
    text = assert_one_screen_without_traceback(out)
    assert "invalid configuration" in text and ("run.run_id" in text or "run.sweep_name" in text), text
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("names", [["run.sweep_name=.."], ["run.run_id=x,.."]])
def test_sweep_refuses_names_before_hydra_creates_anything(names: list[str], tmp_path: Path) -> None:
    root = tmp_path / "home"
    plant(root)
    before = snapshot(tmp_path)
    out = run_kvbench("sweep", *TINY, "run.results_dir=D", *names, cwd=root)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "cannot run the sweep" in assert_one_screen_without_traceback(out)
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.rglob("*")) == [
        "home",
        "thesis.txt",
    ]


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_results_dir_under_a_file_is_one_clear_error(command: str, tmp_path: Path) -> None:
    (tmp_path / "passwd").write_text("root:x:0:0\n")
    out = run_kvbench(command, *TINY, f"run.results_dir={tmp_path}/passwd/x", cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    text = assert_one_screen_without_traceback(out)
    assert f"{tmp_path}/passwd is a file, not a directory" in text


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_disk_full_while_writing_parquet_is_one_clear_error(command: str, tmp_path: Path) -> None:
    out = run_patched(DISK_FULL, command, *TINY, "run.sweep_name=full", "run.run_id=r", cwd=tmp_path)
    assert out.returncode != 0, (out.stdout, out.stderr)
    text = assert_one_screen_without_traceback(out)
    assert "results/full/r/requests.parquet: cannot write: No space left on device" in text
    sweep = tmp_path / "results" / "full"
    assert hidden_siblings(sweep) in ([], [".hydra"])  # no partial run directory
    record = results.read_record(sweep / "r")  # the failure itself is recorded (no frames)
    assert record["meta"]["status"] == "failed" and "No space left" in record["meta"]["error"]


def test_a_run_where_nothing_completed_is_failed(tmp_path: Path) -> None:
    # Two blocks of 16 tokens cannot hold any prompt: every request is rejected.
    overrides = [*BASE, "engine=paged", "engine.num_blocks=2", "workload.prompt_len=100"]
    out = run_kvbench("run", *overrides, "workload.num_requests=2", "run.run_id=none", cwd=tmp_path)
    assert out.returncode == 1, (out.stdout, out.stderr)
    text = assert_one_screen_without_traceback(out)
    assert "run FAILED" in text and "run ok" not in text
    assert "0 of 2 requests completed; rejected: " in text and "whole pool" in text
    run_dir = tmp_path / "results" / "single" / "none"
    record = results.read_record(run_dir)
    assert record["meta"]["status"] == "failed" and record["meta"]["error"].startswith("0 of 2 requests")
    assert record["summary"]["num_rejected"] == 2
    assert len(pd.read_parquet(run_dir / "requests.parquet")) == 2  # the frames are kept
    assert not results.is_complete(run_dir, record["meta"]["config_hash"])  # resume retries it
    sweep = run_kvbench("sweep", *overrides, "workload.num_requests=2,3", "run.sweep_name=z", cwd=tmp_path)
    assert sweep.returncode == 2, (sweep.stdout, sweep.stderr)  # both runs count as failed
    assert "2 run(s) failed" in sweep.stderr
