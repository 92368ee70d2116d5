"""A real vLLM server on loopback for the live-server tests, launched once per session.

The server is vLLM's CPU build from ``.venv-vllm`` (``bash scripts/setup_vllm.sh``; or
``$KVBENCH_VLLM_VENV``), serving kvbench's exported tiny-gqa weights with a 1,024-token
vocabulary, launched through the same launcher and preset as ``engine=vllm_cpu`` with a
pool of ``NUM_BLOCKS`` blocks of 32 tokens. Without the venv the live tests skip, saying
why; under ``CI=true`` a missing venv fails them (CI installs it in ``.ci/run``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from kvbench.engines.endpoint.engine import EndpointEngine
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import EngineContext

REPO = Path(__file__).resolve().parents[1]
# Prompt and output lengths of every live test fit these: 32 chat requests stay far below.
NUM_BLOCKS = 1024
BLOCK_SIZE = 32


def vllm_venv() -> Path:
    return Path(os.environ.get("KVBENCH_VLLM_VENV") or REPO / ".venv-vllm")


def require_vllm() -> Path:
    """The vLLM venv's python; skips (fails under CI=true) when it is not installed."""
    python = vllm_venv() / "bin" / "python"
    if python.is_file():
        return python
    why = f"no vLLM venv at {vllm_venv()} (install it: bash scripts/setup_vllm.sh)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: the live-server tests need vLLM: {why}")
    pytest.skip(why)


def tiny_spec() -> ModelSpec:
    """tiny-gqa with vocab_size 1024 (``model=tiny-gqa model.vocab_size=1024``)."""
    fields = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "tiny-gqa.yaml"))
    return ModelSpec(**{**fields, "vocab_size": 1024})


def engine_context(spec: ModelSpec) -> EngineContext:
    hardware = HardwareSpec(**OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "hardware" / "cpu.yaml")))
    return EngineContext(spec, hardware, model=None, seed=0)


def vllm_cpu_engine(spec: ModelSpec, **overrides: object) -> EndpointEngine:
    """An engine from conf/engine/vllm_cpu.yaml (the preset users run), with ``overrides``
    (dotted keys) applied."""
    node = OmegaConf.load(REPO / "conf" / "engine" / "vllm_cpu.yaml")
    node.python = str(require_vllm())
    for key, value in overrides.items():
        OmegaConf.update(node, key, value, force_add=True)
    engine = instantiate(node)(engine_context(spec))
    assert isinstance(engine, EndpointEngine)
    return engine


@dataclass(frozen=True)
class LiveServer:
    url: str
    spec: ModelSpec
    startup_s: float  # launch to /health answering 200
    log_path: Path


@pytest.fixture(scope="session")
def live_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One vLLM server for the whole session, stopped (its process group killed) at the end."""
    spec = tiny_spec()
    engine = vllm_cpu_engine(spec, **{"server_args.num_gpu_blocks_override": NUM_BLOCKS})
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    start_s = time.monotonic()
    try:
        engine.open(log_path, warmup=True)
        yield LiveServer(engine.base_url(), spec, time.monotonic() - start_s, log_path)
    finally:
        engine.close()
