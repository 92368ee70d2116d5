"""What a run was measured on: library versions, CPU, GPU, driver, git revision, and how
fast the machine was right before the run (``kvbench.probe``).

``collect_environment()`` returns a flat JSON-serialisable dict stored with every run.
Unknown values are None, never guesses. Every CUDA call is behind
``torch.cuda.is_available()`` (on CPU builds some CUDA queries silently return 0).
Simulation runs collect it with ``with_torch=False``: the same keys, torch not imported,
and the facts only torch can give (its thread count, CUDA, the probe's torch figures) None.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from kvbench.probe import probe_facts

# Distribution names whose versions are recorded (key in the result -> distribution).
_DISTRIBUTIONS = {
    "torch": "torch",
    "triton": "triton",
    "numpy": "numpy",
    "pandas": "pandas",
    "pyarrow": "pyarrow",
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "plotly": "plotly",
    "nvidia_ml_py": "nvidia-ml-py",
    "kvbench": "kvbench",
}

_PACKAGE_DIR = Path(__file__).resolve().parent


def package_version(distribution: str) -> str | None:
    """Installed version of ``distribution`` (e.g. "hydra-core"), or None if not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def cpu_model(cpuinfo_path: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first ``model name`` in ``cpuinfo_path`` (Linux), else platform.processor().

    Reads the file only. Returns None when neither source names the CPU.
    """
    try:
        with cpuinfo_path.open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip() or None
    except OSError:
        pass
    return platform.processor() or None


def git_revision(directory: Path = _PACKAGE_DIR, timeout_s: float = 2.0) -> str | None:
    """``git rev-parse HEAD`` run in ``directory``; None without git, a repo or a commit.

    Runs a subprocess with ``timeout_s`` and never raises for git failures.
    """
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    revision = result.stdout.strip()
    return revision if result.returncode == 0 and revision else None


def git_dirty(directory: Path = _PACKAGE_DIR, timeout_s: float = 2.0) -> bool | None:
    """True when tracked files differ from HEAD (``git status --porcelain -uno``); None if unknown."""
    try:
        result = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(result.stdout.strip()) if result.returncode == 0 else None


# The CUDA facts a run records (all None where torch is not inspected).
_CUDA_KEYS = (
    "cuda_available",
    "cuda_runtime",
    "cuda_device_count",
    "cuda_device_name",
    "cuda_device_capability",
    "cuda_device_memory_bytes",
    "cuda_driver",
)


def _torch_num_threads() -> int:
    import torch

    return torch.get_num_threads()


def _cuda_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = dict.fromkeys(_CUDA_KEYS)
    facts.update(
        cuda_available=False, cuda_runtime=torch.version.cuda, cuda_device_count=0
    )  # runtime: None on CPU builds
    if not torch.cuda.is_available():
        return facts
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    facts.update(
        cuda_available=True,
        cuda_device_count=torch.cuda.device_count(),
        cuda_device_name=props.name,
        cuda_device_capability=f"{props.major}.{props.minor}",
        cuda_device_memory_bytes=int(props.total_memory),
        cuda_driver=_nvml_driver_version(),
    )
    return facts


def _nvml_driver_version() -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def collect_environment(*, with_torch: bool = True) -> dict[str, Any]:
    """Describe this process's machine and software; JSON-serialisable, flat.

    Keys: ``python``, ``python_implementation``, ``platform``, ``machine``,
    ``cpu_model``, ``num_cpus``, ``torch_num_threads``, one ``<name>_version`` per
    recorded distribution (torch, triton, numpy, pandas, pyarrow, hydra, omegaconf,
    plotly, nvidia_ml_py, kvbench; None when not installed), the ``cuda_*`` facts
    (device name, capability, memory, driver, runtime; None / False without CUDA),
    ``git_revision`` and ``git_dirty`` of the repository holding this package, and the
    machine-speed probe (``kvbench.probe.probe_facts``: ``probe_compute_gflops``,
    ``probe_memory_gbps``, ``probe_python_mops``, ``probe_cuda_tflops``, ``load_average_1m``).

    ``with_torch=False`` (simulation mode, which runs no tensors) does not import torch:
    versions still come from the installed distributions' metadata, while
    ``torch_num_threads``, every ``cuda_*`` fact and the probe's ``probe_compute_gflops``,
    ``probe_memory_gbps`` and ``probe_cuda_tflops`` are None (not inspected).

    Side effects: imports torch (unless ``with_torch=False``), runs two short git
    subprocesses, runs the probe (~0.15 s of CPU work, see kvbench.probe), and on CUDA
    initialises NVML briefly. Does not raise for missing optional pieces.
    """
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "num_cpus": os.cpu_count(),
        "torch_num_threads": _torch_num_threads() if with_torch else None,
        "executable": sys.executable,
    }
    for key, distribution in _DISTRIBUTIONS.items():
        env[f"{key}_version"] = package_version(distribution)
    env.update(_cuda_facts() if with_torch else dict.fromkeys(_CUDA_KEYS))
    env["git_revision"] = git_revision()
    env["git_dirty"] = git_dirty() if env["git_revision"] is not None else None
    env.update(probe_facts(with_torch=with_torch))
    return env
