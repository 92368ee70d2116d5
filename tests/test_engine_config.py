"""One engine configuration and one pool-sizing rule for every scheduler-based engine.

Regression (issue 14): H2O, StreamingLLM and offload sized their pool twice in
simulation, the first time ignoring ``gpu_memory_utilization`` (0.9 instead of the 0.5
asked for: 28,693 blocks where the paged engine got 12,309).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.engines.bounded import BoundedCacheEngine
from kvbench.engines.config import DEFAULTS, EngineConfig, size_pool
from kvbench.engines.h2o import H2OEngine, StreamingEngine
from kvbench.engines.kv.bounded import BoundedKVManager
from kvbench.engines.kv.paged import PagedDecodeRun, PagedKVManager
from kvbench.engines.kv.protocol import DecodeRun, DecodeRunKV, KVManager
from kvbench.engines.kv.slab import SlabDecodeRun, SlabKVManager
from kvbench.engines.offload import OffloadEngine
from kvbench.engines.paged import PagedEngine
from kvbench.engines.slab import SlabEngine
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import EngineContext

CONF = Path(__file__).resolve().parents[1] / "conf"
ENGINES = {
    "paged": PagedEngine,
    "slab": SlabEngine,
    "h2o": H2OEngine,
    "streaming": StreamingEngine,
    "offload": OffloadEngine,
}


def preset(group: str, name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"))


def sim_ctx() -> EngineContext:
    spec = ModelSpec(**preset("model", "llama-3-8b"))
    return EngineContext(spec, HardwareSpec(**preset("hardware", "h100-80gb")), None, "cpu", "bf16", 0, "sim")


def num_blocks(engine: object) -> int:
    return engine.paged.num_blocks if isinstance(engine, BoundedCacheEngine) else engine.num_blocks


@pytest.mark.parametrize("kind", list(ENGINES))
def test_every_engine_sizes_its_simulated_pool_once_with_the_utilization_asked_for(kind, capsys):
    """Llama-3-8B bf16 on an H100-80GB at 0.5: 80 GiB x 0.5 - 14.96 GiB weights - 1 GiB
    = 24.04 GiB -> 12,309 blocks of 16 tokens, for every engine kind (0.9 gives 28,693)."""
    engine = ENGINES[kind](sim_ctx(), kv_memory_bytes=None, gpu_memory_utilization=0.5)
    assert num_blocks(engine) == 12_309
    pool_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("KV pool")]
    assert len(pool_lines) == 1 and " x 0.5 " in pool_lines[0] and "12,309 blocks" in pool_lines[0]
    default = ENGINES[kind](sim_ctx(), kv_memory_bytes=None)
    assert num_blocks(default) == 28_693


@pytest.mark.parametrize("kind", list(ENGINES))
def test_front_doors_take_their_defaults_from_the_engine_config(kind):
    """Each shared parameter's default is written once (EngineConfig); a front door that
    takes it (directly or through **kwargs to the bounded engine) reads DEFAULTS."""
    params = dict(inspect.signature(ENGINES[kind]).parameters)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        params |= inspect.signature(BoundedCacheEngine).parameters
    shared = [f.name for f in dataclasses.fields(EngineConfig) if f.name in params]
    assert {"block_size", "kv_memory_bytes", "gpu_memory_utilization", "max_num_seqs"} <= set(shared)
    for name in shared:
        assert params[name].default == getattr(DEFAULTS, name), name


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"block_size": 12}, r"^engine.block_size: must be a power of two, got 12$"),
        ({"num_blocks": 0}, r"^engine.num_blocks: must be > 0 \(or null\), got 0$"),
        ({"kv_memory_bytes": -1}, r"^engine.kv_memory_bytes: must be > 0 \(or null\), got -1$"),
        ({"gpu_memory_utilization": 1.5}, r"^engine.gpu_memory_utilization: must be in \(0, 1\], got 1.5$"),
        ({"prefix_cache": "lru"}, r"^engine.prefix_cache: must be one of"),
        ({"num_host_blocks": -2}, r"^engine.num_host_blocks: must be >= 0, got -2$"),
        ({"decode_backend": "cuda"}, r"^engine.decode_backend: must be one of"),
        ({"max_num_seqs": 0}, r"^engine.max_num_seqs: must be > 0, got 0$"),
        ({"max_num_batched_tokens": 0}, r"^engine.max_num_batched_tokens: must be > 0, got 0$"),
        ({"preemption": "drop"}, r"^engine.preemption: must be one of"),
        ({"victim_policy": "oldest"}, r"^engine.victim_policy: must be one of"),
    ],
)
def test_engine_config_names_the_bad_key(changes, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**changes)


def test_size_pool_rules():
    ctx = dataclasses.replace(sim_ctx(), mode="real")
    per_block = 16 * 128 * 1024  # llama-3-8b bf16: 128 KiB per token
    assert size_pool(ctx, EngineConfig(num_blocks=7, kv_memory_bytes=None), None) == (7, None)
    assert size_pool(ctx, EngineConfig(kv_memory_bytes=3 * per_block + 1), None) == (3, None)
    with pytest.raises(ValueError, match=r"^engine.kv_memory_bytes: 100 bytes hold no block"):
        size_pool(ctx, EngineConfig(kv_memory_bytes=100), None)
    with pytest.raises(
        ValueError, match=r"^engine.kv_memory_bytes: null sizes the pool .* this run is 'real'"
    ):
        size_pool(ctx, EngineConfig(kv_memory_bytes=None), None)
    assert EngineConfig(preemption="swap").host_blocks_for(40) == 40
    assert EngineConfig(preemption="swap", num_host_blocks=5).host_blocks_for(40) == 5
    assert EngineConfig().host_blocks_for(40) == 0


@pytest.mark.parametrize("manager", [PagedKVManager, BoundedKVManager, SlabKVManager])
def test_every_kv_manager_offers_the_whole_contract(manager):
    """The scheduler calls a manager only through the KV-manager contract: every manager
    defines every method of it (no optional hooks probed with getattr)."""
    methods = [
        name for name, value in vars(KVManager).items() if callable(value) and not name.startswith("_")
    ]
    assert {"reject_reason", "waiting_entered", "waiting_left", "can_allocate", "swap_in"} <= set(methods)
    for name in methods:
        assert callable(getattr(manager, name, None)), name


def test_the_paged_and_slab_managers_offer_decode_runs():
    members = [name for name in vars(DecodeRunKV) if not name.startswith("_")]
    assert {"decode_run", "admission_guard", "usage_of", "usage_columns"} <= set(members)
    for manager in (PagedKVManager, SlabKVManager):
        for name in members:
            assert callable(getattr(manager, name, None)), (manager.__name__, name)
    assert not hasattr(BoundedKVManager, "decode_run")
    run_members = [name for name in vars(DecodeRun) if not name.startswith("_")]
    assert {"can_advance", "advance", "num_quiet_steps", "advance_many"} <= set(run_members)
    for run in (PagedDecodeRun, SlabDecodeRun):
        for name in run_members:
            assert callable(getattr(run, name, None)), (run.__name__, name)
