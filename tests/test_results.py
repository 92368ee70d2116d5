"""Results on disk: round trip, atomic writes, resume markers, sweep tables, labels."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from run_fixtures import base_meta, exact_run, write_sweep
from server_fixtures import scraped_run, server_frame, write_scraped_run

from kvbench import metrics, results


def write_exact(run_dir, **meta_overrides):
    requests, steps, memory, meta = exact_run()
    meta = {**meta, **meta_overrides}
    summary = metrics.summarize_run(requests, steps, meta, memory)
    path = results.write_run(
        run_dir, requests, steps, memory, meta, "engine: paged\n", summary.metrics, summary.missing
    )
    return path, (requests, steps, memory, meta, summary)


def test_round_trip_keeps_frames_and_lists(tmp_path):
    run_dir, (requests, steps, memory, meta, summary) = write_exact(tmp_path / "sweep" / "run0")
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".kvbench-run",
        "config.yaml",
        "memory.parquet",
        "requests.parquet",
        "run.json",
        "steps.parquet",
    ]
    res = results.load(run_dir)
    assert res.requests["token_times_s"].tolist() == requests["token_times_s"].tolist()
    assert isinstance(res.requests["token_times_s"].iloc[0], list)
    pd.testing.assert_frame_equal(
        res.requests.drop(columns=["run_id", "token_times_s"]),
        requests.drop(columns="token_times_s"),
        check_dtype=False,
    )
    pd.testing.assert_frame_equal(res.steps.drop(columns="run_id"), steps)
    pd.testing.assert_frame_equal(res.memory.drop(columns="run_id"), memory)
    assert (res.requests["run_id"] == "exact").all()
    assert res.configs == {"exact": "engine: paged\n"}


def test_runs_frame_flattens_meta_and_summary(tmp_path):
    run_dir, (*_, meta, summary) = write_exact(tmp_path / "run0")
    runs = results.load(run_dir).runs
    assert len(runs) == 1
    row = runs.iloc[0]
    assert row["run_id"] == "exact" and row["engine"] == "paged" and row["status"] == "ok"
    assert row["engine.block_size"] == 16
    assert row["model.name"] == "tiny-gqa"
    assert row["hardware.hbm_bandwidth_gbps"] == 20.0
    assert row["slo.ttft_ms"] == 160.0
    assert row["env.git_revision"] == "abc"
    assert row["ttft_ms_mean"] == pytest.approx(150.0)
    # NaN is stored as null with its reason and comes back as NaN
    assert math.isnan(row["mem_peak_nvml_used_bytes"])
    assert row["missing.mem_peak_nvml_used_bytes"] == meta["missing"]["nvml_used_bytes"]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["summary"]["mem_peak_nvml_used_bytes"] is None


def test_crash_mid_write_leaves_no_run_dir(tmp_path, monkeypatch):
    requests, steps, memory, meta = exact_run()
    calls = []

    def crash_on_second(self, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return original(self, path, *args, **kwargs)

    original = pd.DataFrame.to_parquet
    monkeypatch.setattr(pd.DataFrame, "to_parquet", crash_on_second)
    with pytest.raises(results.ResultsWriteError, match=r"run0/steps.parquet: cannot write: disk full"):
        results.write_run(tmp_path / "run0", requests, steps, memory, meta, "", {})
    assert list(tmp_path.iterdir()) == []  # neither the run dir nor its temporary sibling


def test_failed_rewrite_keeps_the_previous_run(tmp_path, monkeypatch):
    run_dir, _ = write_exact(tmp_path / "run0")
    before = (run_dir / "run.json").read_text()
    requests, steps, memory, meta = exact_run()

    def killed(path, text):
        raise OSError("killed")

    monkeypatch.setattr(results, "_write_synced", killed)
    with pytest.raises(results.ResultsWriteError, match="run0/run.json: cannot write: killed"):
        results.write_run(run_dir, requests, steps, memory, meta, "", {})
    assert (run_dir / "run.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["run0"]


def test_rewrite_replaces_a_failed_run(tmp_path):
    meta = base_meta("r", "paged", 16)
    results.write_failed_run(tmp_path / "r", meta, "boom")
    assert not results.is_complete(tmp_path / "r", meta["config_hash"])
    write_exact(tmp_path / "r", config_hash=meta["config_hash"])
    assert results.is_complete(tmp_path / "r", meta["config_hash"])
    assert [p.name for p in tmp_path.iterdir()] == ["r"]


def test_is_complete(tmp_path):
    run_dir, (*_, meta, _summary) = write_exact(tmp_path / "run0")
    assert results.is_complete(run_dir, meta["config_hash"])
    assert not results.is_complete(run_dir, "other-hash")
    assert not results.is_complete(tmp_path / "absent", meta["config_hash"])
    (run_dir / "steps.parquet").unlink()
    assert not results.is_complete(run_dir, meta["config_hash"])
    half = tmp_path / "half"
    half.mkdir()
    (half / "requests.parquet").write_bytes(b"")
    assert not results.is_complete(half, meta["config_hash"])


def test_unserialisable_meta_is_a_clear_error(tmp_path):
    requests, steps, memory, meta = exact_run()
    with pytest.raises(results.ResultsError, match=r"run0/run.json: meta/summary is not JSON-serialisable"):
        results.write_run(tmp_path / "run0", requests, steps, memory, {**meta, "bad": object()}, "", {})
    assert list(tmp_path.iterdir()) == []


def test_sweep_load_failed_runs_and_table(tmp_path):
    sweep_dir = write_sweep(tmp_path)
    (sweep_dir / ".run9.tmp-deadbeef").mkdir()  # a crashed writer's leftovers are ignored
    (sweep_dir / ".run9.tmp-deadbeef" / "run.json").write_text("{")
    res = results.load(sweep_dir)
    assert list(res.runs["run_id"]) == ["run0", "run1", "run2", "run3", "run_failed"]
    failed = res.runs.set_index("run_id").loc["run_failed"]
    assert failed["status"] == "failed" and "out of KV blocks" in failed["error"]
    assert set(res.requests["run_id"]) == {"run0", "run1", "run2", "run3"}
    assert res.steps.groupby("run_id").size().min() > 0
    assert res.configs["run_failed"] == "engine: h2o\n"
    table = results.write_sweep_table(sweep_dir)
    assert pd.read_parquet(table)["run_id"].tolist() == list(res.runs["run_id"])
    assert len(pd.read_csv(sweep_dir / "runs.csv")) == 5
    assert results.load(sweep_dir).runs.shape == res.runs.shape  # sweep tables are not runs


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(results.ResultsError, match="no kvbench runs found"):
        results.load(tmp_path)
    (tmp_path / "run0").mkdir()
    (tmp_path / "run0" / "run.json").write_text('{\n  "meta": {,\n}')
    with pytest.raises(results.ResultsError, match=r"run0/run.json:2: invalid JSON"):
        results.load(tmp_path)


def test_run_labels_name_what_varies():
    runs = pd.DataFrame(
        {
            "run_id": ["a", "b", "c", "d"],
            "engine": ["paged", "paged", "slab", "slab"],
            "engine.block_size": [8.0, 16.0, math.nan, math.nan],
            "model.name": ["tiny"] * 4,
            "ttft_ms_mean": [1.0, 2.0, 3.0, 4.0],
        }
    )
    assert results.varying_config_columns(runs) == ["engine", "engine.block_size"]
    assert results.run_labels(runs).tolist() == [
        "engine=paged block_size=8",
        "engine=paged block_size=16",
        "engine=slab [c]",  # same config twice: the run id tells them apart
        "engine=slab [d]",
    ]
    single = runs.iloc[:1]
    assert results.run_labels(single).tolist() == ["a"]


# --------------------------------------------------------------------------- live-server extras
def test_round_trip_with_server_metrics_and_log(tmp_path):
    run_dir = write_scraped_run(tmp_path / "sweep" / "live", "live")
    assert {"server_metrics.parquet", "server.log"} <= {p.name for p in run_dir.iterdir()}
    assert (run_dir / "server.log").read_text() == "INFO server for live <b>started</b>\n"
    *_, server, meta = scraped_run("live")
    res = results.load(tmp_path / "sweep")
    pd.testing.assert_frame_equal(res.server_metrics.drop(columns="run_id"), server)
    assert (res.server_metrics["run_id"] == "live").all()
    assert (
        res.runs["server_prefix_query_tokens"].iloc[0]
        == server["prefix_query_tokens_total"].iloc[-1] - server["prefix_query_tokens_total"].iloc[0]
    )
    assert results.is_complete(run_dir, meta["config_hash"])
    # A rerun replaces the directory although it holds the server files (they are kvbench's).
    write_scraped_run(tmp_path / "sweep" / "live", "live", seed=1)
    assert [p.name for p in (tmp_path / "sweep").iterdir() if not p.name.endswith("-server.log")] == ["live"]


def test_runs_without_server_metrics_load_an_empty_frame(tmp_path):
    run_dir, (*_, meta, _summary) = write_exact(tmp_path / "run0")
    res = results.load(run_dir)
    assert res.server_metrics.empty and list(res.server_metrics.columns) == ["run_id"]
    assert not (run_dir / "server_metrics.parquet").exists()
    assert results.is_complete(run_dir, meta["config_hash"])  # unchanged for runs without extras
    write_scraped_run(tmp_path / "live", "live")
    both = results.load(tmp_path)
    assert set(both.server_metrics["run_id"]) == {"live"} and set(both.runs["run_id"]) == {"exact", "live"}


def test_failed_run_keeps_what_the_server_gave(tmp_path):
    meta = base_meta("dead", "endpoint", None)
    log = tmp_path / "vllm.log"
    log.write_text("engine core died\n")
    frame = server_frame([0.0, 1.0], errors=["", "ConnectError: refused"], num_running=[2, float("nan")])
    run_dir = results.write_failed_run(
        tmp_path / "dead",
        meta,
        "server died",
        "x: 1\n",
        extra_frames={"server_metrics": frame},
        attachments={"server.log": log},
    )
    res = results.load(run_dir)
    assert res.runs["status"].tolist() == ["failed"] and res.requests.empty
    assert res.server_metrics["error"].tolist() == ["", "ConnectError: refused"]
    assert (run_dir / "server.log").read_text() == "engine core died\n"
    assert not results.is_complete(run_dir, meta["config_hash"])


def test_unknown_extras_and_unreadable_attachments_are_refused(tmp_path):
    requests, steps, memory, meta = exact_run()
    write = lambda **extra: results.write_run(  # noqa: E731 - one call, several variants
        tmp_path / "run0", requests, steps, memory, meta, "", {}, **extra
    )
    with pytest.raises(results.ResultsWriteError, match=r"extra_frames: \['notes'\] not among"):
        write(extra_frames={"notes": pd.DataFrame()})
    with pytest.raises(results.ResultsWriteError, match=r"attachments: \['../x.log'\] not among"):
        write(attachments={"../x.log": tmp_path / "a"})
    with pytest.raises(
        results.ResultsWriteError, match=r"run0/server.log: cannot copy .*gone.log: No such file"
    ):
        write(attachments={"server.log": tmp_path / "gone.log"})
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing half-written


def test_a_users_directory_with_a_server_log_is_still_not_replaced(tmp_path):
    mine = tmp_path / "live"
    mine.mkdir()
    (mine / "server.log").write_text("my own notes\n")  # a name kvbench writes, but no marker
    with pytest.raises(results.ResultsWriteError, match="is not a kvbench run directory"):
        write_scraped_run(mine, "live")
    assert (mine / "server.log").read_text() == "my own notes\n"
    assert sorted(p.name for p in mine.iterdir()) == ["server.log"]


def test_server_facts_in_meta_become_columns(tmp_path):
    facts = {"block_size": 32, "num_gpu_blocks": 64, "enable_prefix_caching": True}
    run_dir, _ = write_exact(tmp_path / "run0", server=facts, server_kind="vllm")
    runs = results.load(run_dir).runs
    assert runs["server.block_size"].tolist() == [32] and runs["server.enable_prefix_caching"].tolist() == [
        True
    ]
    assert runs["server_kind"].tolist() == ["vllm"]
