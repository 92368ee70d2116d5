"""Simulation mode never imports torch; real mode's torch-facing pieces are unchanged.

A sim run or sweep goes through the real CLI entry point in a fresh interpreter and then
checks ``sys.modules``: any module on the simulation path that imports torch at module
level (an engine, the executor interface, the eviction policy, environment capture, the
machine-speed probe) fails it.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kvbench.config import accepted_params
from kvbench.environment import collect_environment
from kvbench.probe import measure_machine_speed

# Runs the CLI in this interpreter, then prints what it loaded as the last line.
_CLI = (
    "import json, sys\n"
    "from kvbench.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))\n"
)


def run_cli(tmp_path: Path, *args: str) -> dict[str, object]:
    """``kvbench ARGS`` through ``kvbench.cli.main`` in a fresh process, with results under
    ``tmp_path``; the exit code and whether torch was imported."""
    done = subprocess.run(
        [sys.executable, "-c", _CLI, *args, f"run.results_dir={tmp_path / 'results'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_records(tmp_path: Path) -> list[dict[str, object]]:
    """The ``meta`` of every run.json written under ``tmp_path``."""
    paths = sorted((tmp_path / "results").rglob("run.json"))
    return [json.loads(path.read_text())["meta"] for path in paths]


def test_sim_run_through_the_cli_does_not_import_torch(tmp_path: Path) -> None:
    outcome = run_cli(
        tmp_path,
        "run",
        "run.mode=sim",
        "engine=paged",
        "model=llama-3-8b",
        "hardware=h100-80gb",
        "workload=random",
        "workload.num_requests=2",
    )
    assert outcome == {"code": 0, "torch": False}
    (record,) = run_records(tmp_path)
    assert record["status"] == "ok"
    env = record["environment"]
    # Versions come from package metadata; facts only torch can give are not inspected.
    assert env["torch_version"] == metadata.version("torch")
    assert env["torch_num_threads"] is None and env["cuda_available"] is None
    assert env["probe_compute_gflops"] is None and env["probe_python_mops"] > 0


def test_sim_sweep_of_every_sim_engine_does_not_import_torch(tmp_path: Path) -> None:
    # paged, slab and the bounded engines (H2O, offload: policy and tiers without tensors);
    # the report at the end of the sweep is included.
    outcome = run_cli(
        tmp_path,
        "sweep",
        "run.mode=sim",
        "engine=paged,slab,h2o,offload",
        "workload=random",
        "workload.num_requests=2",
    )
    assert outcome == {"code": 0, "torch": False}
    records = run_records(tmp_path)
    assert sorted(r["engine"] for r in records) == ["h2o", "offload", "paged", "slab"]
    assert all(r["status"] == "ok" for r in records)
    assert list((tmp_path / "reports").glob("*.html"))


def test_environment_without_torch_keeps_every_key(tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from kvbench.environment import collect_environment\n"
        "env = collect_environment(with_torch=False)\n"
        "print(json.dumps({'env': env, 'torch': 'torch' in sys.modules}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch"] is False
    without = result["env"]
    with_torch = collect_environment()
    assert list(without) == list(with_torch)
    not_inspected = [key for key in with_torch if without[key] is None and with_torch[key] is not None]
    assert set(not_inspected) <= {
        "torch_num_threads",
        "cuda_available",
        "cuda_device_count",
        "cuda_runtime",
        "cuda_device_name",
        "cuda_device_capability",
        "cuda_device_memory_bytes",
        "cuda_driver",
        "probe_compute_gflops",
        "probe_memory_gbps",
        "probe_cuda_tflops",
    }
    assert {"torch_num_threads", "probe_compute_gflops", "probe_memory_gbps"} <= set(not_inspected)
    assert without["torch_version"] == with_torch["torch_version"]


def test_probe_without_torch_measures_python_only() -> None:
    speed = measure_machine_speed(1, with_torch=False)
    assert speed.probe_compute_gflops is None and speed.probe_memory_gbps is None
    assert speed.probe_cuda_tflops is None and speed.probe_python_mops > 0
    with pytest.raises(ValueError, match="num_reps"):
        measure_machine_speed(0, with_torch=False)


@pytest.mark.parametrize(
    "target",
    [
        "kvbench.engines.paged.PagedEngine",
        "kvbench.engines.slab.SlabEngine",
        "kvbench.engines.h2o.H2OEngine",
        "kvbench.engines.h2o.StreamingEngine",
        "kvbench.engines.offload.OffloadEngine",
    ],
)
def test_engine_signatures_resolve_without_type_checking_imports(target: str) -> None:
    # kvbench.config types engine.* keys by the front door's resolved annotations; a name
    # imported only under TYPE_CHECKING would make them unresolvable and silently drop
    # every type check of that engine's YAML.
    from hydra.utils import get_object

    params, _ = accepted_params(get_object(target))
    assert params["block_size"] is int
    assert params["chunked_prefill"] is bool
    assert all(annotation is not inspect.Parameter.empty for annotation in params.values())
