"""Environment facts and the background memory sampler."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
from importlib import metadata
from pathlib import Path

import pandas as pd
import pytest
import torch

from kvbench.environment import collect_environment, cpu_model, git_dirty, git_revision
from kvbench.memory import COLUMNS, MemorySampler, NvmlProbe, RssProbe, TorchCudaProbe

CUDA = torch.cuda.is_available()


# --------------------------------------------------------------------------- environment
def test_collect_environment_is_json_and_reports_versions() -> None:
    env = collect_environment()
    assert json.loads(json.dumps(env)) == env
    assert env["torch_version"] == metadata.version("torch")
    assert env["pandas_version"] == pd.__version__
    assert env["hydra_version"] == metadata.version("hydra-core")
    assert env["python"].count(".") == 2
    assert env["torch_num_threads"] == torch.get_num_threads()
    assert env["cuda_available"] is CUDA
    if CUDA:
        assert env["cuda_device_name"] == torch.cuda.get_device_name(torch.cuda.current_device())
        assert env["cuda_device_memory_bytes"] > 0
    else:
        assert env["cuda_device_name"] is None and env["cuda_driver"] is None
    revision = env["git_revision"]
    assert revision is None or (len(revision) == 40 and int(revision, 16) >= 0)


def test_cpu_model_parses_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz\n"
        "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz\n"
    )
    assert cpu_model(cpuinfo) == "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz"


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_revision_in_a_scratch_repository(tmp_path: Path) -> None:
    assert git_revision(tmp_path) is None  # not a repository
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    assert git_revision(tmp_path) is None  # a repository without commits
    (tmp_path / "f.txt").write_text("a")
    identity = ["-c", "user.name=kvbench-test", "-c", "user.email=test@example.invalid"]
    subprocess.run(["git", "add", "f.txt"], cwd=tmp_path, check=True)
    subprocess.run(["git", *identity, "commit", "-q", "-m", "m"], cwd=tmp_path, check=True)
    expected = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert git_revision(tmp_path) == expected
    assert git_dirty(tmp_path) is False
    (tmp_path / "f.txt").write_text("b")
    assert git_dirty(tmp_path) is True


# --------------------------------------------------------------------------- sampler
class FakeProbe:
    """A probe whose value the test controls; counts reads."""

    metrics = ("rss_bytes",)

    def __init__(self) -> None:
        self.value = 100.0
        self.num_reads = 0
        self.closed = False

    def read(self) -> dict[str, float]:
        self.num_reads += 1
        return {"rss_bytes": self.value}

    def reasons(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        self.closed = True


def test_sampler_times_are_relative_to_the_given_start() -> None:
    ticks = iter(range(10, 1000))
    probe = FakeProbe()
    sampler = MemorySampler(start_s=5.0, interval_s=0.001, probes=[probe], clock=lambda: float(next(ticks)))
    with sampler:
        deadline = time.monotonic() + 5
        while len(sampler.samples_frame()) < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
    frame = sampler.samples_frame()
    assert list(frame.columns) == list(COLUMNS)
    # The fake clock ticks 10, 11, 12, ... and the origin is 5.
    assert frame["t_s"].tolist() == [float(t - 5) for t in range(10, 10 + len(frame))]
    assert (frame["rss_bytes"] == 100.0).all()
    assert frame[list(COLUMNS[2:])].isna().all().all()  # columns no probe fills stay NaN
    assert probe.closed
    assert len(frame) == probe.num_reads


def test_sampler_sees_rss_grow_and_reports_missing_metrics() -> None:
    start_s = time.perf_counter()
    with MemorySampler(start_s=start_s, interval_s=0.01) as sampler:
        block = b"\x01" * (64 * 1024 * 1024)  # every byte written, so every page is resident
        time.sleep(0.1)
        del block
    frame = sampler.samples_frame()
    assert len(frame) >= 3
    assert (frame["t_s"] >= 0).all() and frame["t_s"].is_monotonic_increasing
    rss = frame["rss_bytes"]
    assert rss.notna().all() and (rss > 0).all()
    assert rss.max() - rss.iloc[0] >= 48 * 1024 * 1024
    assert frame.dtypes.eq("float64").all()
    missing = sampler.missing()
    if CUDA:
        assert frame["torch_allocated_bytes"].notna().all()
    else:
        # Unmeasurable is NaN with a reason, never 0.
        for column in ("torch_allocated_bytes", "torch_reserved_bytes"):
            assert frame[column].isna().all()
            assert missing[column] == "torch.cuda.is_available() is False"
        assert math.isnan(sampler.peaks()["torch_allocated_bytes"])
    for column in ("nvml_used_bytes", "nvml_process_bytes"):
        assert frame[column].isna().all() == (column in missing)
    assert "rss_bytes" not in missing
    assert sampler.peaks()["rss_bytes"] == rss.max()


def test_nvml_probe_without_driver_records_the_reason() -> None:
    probe = NvmlProbe()
    try:
        values = probe.read()
        if "nvml_used_bytes" in probe.reasons():
            assert math.isnan(values["nvml_used_bytes"])
            assert probe.reasons()["nvml_used_bytes"]
        else:
            assert values["nvml_used_bytes"] > 0
    finally:
        probe.close()


def test_rss_probe_without_proc_or_psutil(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_psutil(name: str, *args, **kwargs):
        if name == "psutil":
            raise ImportError("psutil hidden by the test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    probe = RssProbe(statm_path=tmp_path / "absent")
    assert math.isnan(probe.read()["rss_bytes"])
    assert "psutil is not installed" in probe.reasons()["rss_bytes"]


def test_thread_stops_when_the_block_raises() -> None:
    sampler = MemorySampler(interval_s=0.005, probes=[FakeProbe()])
    with pytest.raises(KeyError), sampler:
        assert sampler.running
        raise KeyError("boom")
    assert not sampler.running
    assert not any(t.name == "kvbench-memory-sampler" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="already started"):
        sampler.start()


def test_sampler_rejects_bad_interval() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        MemorySampler(interval_s=0)


def test_stop_is_prompt_with_a_long_interval() -> None:
    sampler = MemorySampler(interval_s=30.0, probes=[FakeProbe()])
    begin = time.perf_counter()
    with sampler:
        pass
    # Waiting on an Event, not sleeping: exit does not wait for the 30 s interval.
    assert time.perf_counter() - begin < 5.0
    assert len(sampler.samples_frame()) == 2  # entry and exit rows


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_sampler_on_cuda_tracks_allocations() -> None:
    torch.cuda.synchronize()
    with MemorySampler(interval_s=0.01) as sampler:
        x = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # 256 MiB
        torch.cuda.synchronize()
        time.sleep(0.05)
        del x
        torch.cuda.synchronize()
    frame = sampler.samples_frame()
    peaks = sampler.peaks()
    assert peaks["torch_allocated_bytes"] >= 256 * 1024 * 1024
    assert peaks["torch_reserved_bytes"] >= peaks["torch_allocated_bytes"]
    assert frame["torch_allocated_bytes"].notna().all()
    if "nvml_used_bytes" not in sampler.missing():
        assert frame["nvml_used_bytes"].max() >= 256 * 1024 * 1024
    probe = TorchCudaProbe()
    assert probe.read()["torch_allocated_bytes"] >= 0
