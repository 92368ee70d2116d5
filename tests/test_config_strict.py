"""Plug-in parameters are typed by their targets' signatures: nonsense is an error naming the key.

Covers issue 17 item 6 (``engine.chunked_prefill=abc`` ran as if true; ``max_num_seqs=abc``
and friends failed mid-run with a TypeError naming no key) and the CLI half of its fuzzing:
random override strings end in a composed, validated, buildable config or in one of the
errors the CLI prints as one screen, never in another exception.
"""

from __future__ import annotations

import itertools

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from omegaconf.errors import OmegaConfBaseException
from run_fixtures import run_kvbench

from kvbench.cli import _presets
from kvbench.config import ConfigError, register_schemas, validate_config
from kvbench.execute import build_engine, build_workload, instantiate_plugin
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import EngineContext


@pytest.fixture(scope="module", autouse=True)
def _hydra() -> None:
    register_schemas()
    with initialize_config_module("kvbench.conf", version_base="1.3"):
        yield


def validated(*overrides: str):
    return validate_config(compose("config", overrides=list(overrides)))


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        validated(*overrides)
    return str(info.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("engine.chunked_prefill=abc", "engine.chunked_prefill: expected a boolean"),
        ("engine.chunked_prefill=1", "engine.chunked_prefill: expected a boolean"),
        ("engine.max_num_seqs=abc", "engine.max_num_seqs: expected an integer"),
        ("engine.max_num_batched_tokens=abc", "engine.max_num_batched_tokens: expected an integer"),
        ("engine.num_blocks=abc", "engine.num_blocks: expected an integer or null"),
        ("engine.num_blocks=2.5", "engine.num_blocks: expected an integer or null"),
        ("engine.kv_memory_bytes=abc", "engine.kv_memory_bytes: expected an integer or null"),
        ("engine.gpu_memory_utilization=abc", "engine.gpu_memory_utilization: expected a finite number"),
        ("engine.gpu_memory_utilization=nan", "engine.gpu_memory_utilization: expected a finite number"),
        ("engine.prefix_cache=7", "engine.prefix_cache: expected a string"),
    ],
)
def test_paged_engine_params_are_typed(override: str, expected: str) -> None:
    assert expected in config_error("engine=paged", override)


@pytest.mark.parametrize(
    ("engine", "override", "expected"),
    [
        ("h2o", "engine.heavy_share=abc", "engine.heavy_share: expected a finite number"),
        # Forwarded through **kwargs to the bounded engine and on to the paged one.
        ("h2o", "engine.max_num_seqs=abc", "engine.max_num_seqs: expected an integer"),
        ("streaming", "engine.max_num_seqs=abc", "engine.max_num_seqs: expected an integer"),
        ("offload", "engine.chunked_prefill=abc", "engine.chunked_prefill: expected a boolean"),
        ("slab", "engine.max_num_seqs=abc", "engine.max_num_seqs: expected an integer"),
        ("dense", "engine.max_num_seqs=abc", "engine.max_num_seqs: expected an integer"),
    ],
)
def test_forwarded_engine_params_are_typed(engine: str, override: str, expected: str) -> None:
    assert expected in config_error(f"engine={engine}", override)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("workload.turn_interval_s=abc", "workload.turn_interval_s: expected a finite number"),
        ("workload.system_prompt_len=abc", "workload.system_prompt_len: expected an integer"),
        ("workload.num_conversations=true", "workload.num_conversations: expected an integer"),
        ("workload.turn_interval_s=inf", "workload.turn_interval_s: expected a finite number"),
    ],
)
def test_workload_params_are_typed(override: str, expected: str) -> None:
    assert expected in config_error("workload=chat", override)


@pytest.mark.parametrize("override", ["slo.ttft_ms=nan", "slo.tpot_ms=inf", "run.memory_interval_s=nan"])
def test_core_numbers_must_be_finite(override: str) -> None:
    assert config_error(override).startswith(override.split("=")[0] + ": must be > 0 and finite")


def test_unknown_plugin_key_suggests_the_close_one() -> None:
    # A key the YAML node has but the target does not take (here added with +).
    message = config_error("engine=slab", "+engine.prefix_cache=block_hash")
    assert message.startswith("engine.prefix_cache: unknown key for kvbench.engines.slab.SlabEngine")
    message = config_error("engine=paged", "+engine.max_num_seq=4")
    assert "did you mean engine.max_num_seqs?" in message


def test_every_preset_pair_validates() -> None:
    """The strict check accepts everything the shipped presets say, in both modes."""
    for engine, workload in itertools.product(_presets("engine"), _presets("workload")):
        for mode in ("real", "sim"):
            validated(f"engine={engine}", f"workload={workload}", f"run.mode={mode}")


def test_cli_names_the_key_and_fails(tmp_path) -> None:
    out = run_kvbench("run", "engine=paged", "engine.chunked_prefill=abc", cwd=tmp_path)
    assert out.returncode != 0
    assert "engine.chunked_prefill: expected a boolean (true or false), got 'abc'" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "results").exists()


# --------------------------------------------------------------------------- fuzzing
_KEYS = (
    "engine.block_size",
    "engine.num_blocks",
    "engine.kv_memory_bytes",
    "engine.max_num_seqs",
    "engine.max_num_batched_tokens",
    "engine.chunked_prefill",
    "engine.prefix_cache",
    "engine.preemption",
    "engine.victim_policy",
    "engine.num_host_blocks",
    "workload.num_requests",
    "workload.prompt_len",
    "workload.output_len",
    "workload.prompt_len.high",
    "workload.arrival",
    "workload.arrival.kind",
    "workload.arrival.rate_per_s",
    "seed",
    "run.mode",
    "run.progress",
    "run.num_threads",
    "slo.ttft_ms",
    "model.num_kv_heads",
    "model.max_position_embeddings",
)
_VALUES = st.one_of(
    st.sampled_from(
        [
            "abc",
            "-1",
            "0",
            "1",
            "2.5",
            "nan",
            "inf",
            "-inf",
            "1e309",
            "true",
            "null",
            "[]",
            "[1,2]",
            "{}",
            "{kind:fixed,value:3}",
            "{kind:uniform,low:9,high:2}",
            "''",
            "${seed}",
            "${nope}",
            "\\",
        ]
    ),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
)
_OVERRIDE = st.one_of(
    st.tuples(st.sampled_from(_KEYS), _VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=20),
)
# What the CLI prints as a one-screen message (Hydra's override and composition errors,
# OmegaConf's typed-merge errors, kvbench's ConfigError).
_CLEAN_ERRORS = (ConfigError, HydraException, OmegaConfBaseException)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    engine=st.sampled_from(["paged", "paged_swap", "slab", "h2o", "dense"]),
    workload=st.sampled_from(["random", "chat", "best_of_n"]),
    overrides=st.lists(_OVERRIDE, max_size=3),
)
@example(engine="paged", workload="random", overrides=["engine.num_blocks=1e309"])
@example(engine="paged", workload="random", overrides=["workload.prompt_len={kind:uniform,low:9,high:2}"])
@example(engine="h2o", workload="chat", overrides=["workload.arrival.kind=abc"])
def test_random_overrides_end_in_a_config_or_a_clean_error(
    engine: str, workload: str, overrides: list[str]
) -> None:
    try:
        cfg = validated(f"engine={engine}", f"workload={workload}", "run.mode=sim", *overrides)
        if cfg.run.mode != "sim":
            return  # building the real model is the slow part and not what is fuzzed
        # What execute() does before the replay: build the workload and the engine.
        spec = ModelSpec(**cfg.model)
        ctx = EngineContext(spec, HardwareSpec(**cfg.hardware), None, "cpu", spec.dtype, cfg.seed, "sim")
        build_workload(cfg)
        build_engine(instantiate_plugin(cfg.engine, "engine"), ctx, cfg.engine._target_)
    except _CLEAN_ERRORS as exc:
        text = str(exc)
        assert text and len(text.splitlines()) <= 12, text


# --------------------------------------------------------------------------- impossible pairs
@pytest.mark.parametrize(
    ("engine", "workload", "reason"),
    [
        ("h2o", "beam_search", "bounded KV caches cannot share blocks between samples"),
        ("streaming", "best_of_n", "bounded KV caches cannot share blocks between samples"),
        ("dense", "beam_search", "beam search is not supported by the dense reference engine"),
    ],
)
def test_an_engine_that_can_serve_no_request_is_refused_before_the_run(
    tmp_path, engine: str, workload: str, reason: str
) -> None:
    """Issue 17 item 9: h2o + beam_search printed "run ok (peak KV 0 B)" with every request rejected."""
    out = run_kvbench(
        "run",
        f"engine={engine}",
        f"workload={workload}",
        "workload.num_requests=2",
        "run.warmup=false",
        f"run.mode={'real' if engine == 'dense' else 'sim'}",
        cwd=tmp_path,
    )
    assert out.returncode != 0
    assert f"engine={engine} cannot serve any request of workload={workload}: " in out.stderr
    assert reason in out.stderr and "(2 of 2 requests)" in out.stderr
    assert "run ok" not in out.stdout + out.stderr


def test_a_partly_servable_workload_runs_and_counts_its_rejections() -> None:
    from kvbench.types import Request, Workload

    spec = ModelSpec(**validated("engine=h2o", "run.mode=sim").model)
    ctx = EngineContext(spec, HardwareSpec(**validated().hardware), None, "cpu", spec.dtype, 0, "sim")
    cfg = validated("engine=h2o", "run.mode=sim")
    engine = build_engine(instantiate_plugin(cfg.engine, "engine"), ctx, cfg.engine._target_)
    prompt = tuple(range(3, 40))
    workload = Workload("mixed", (Request("a", 0.0, prompt, 4), Request("b", 0.0, prompt, 4, n=2)))
    from kvbench.execute import refuse_unservable

    refuse_unservable(engine, workload, cfg)  # one request is servable: no error
    assert engine.unsupported_reason(workload.requests[1]) is not None
    assert engine.unsupported_reason(workload.requests[0]) is None


def test_stall_steps_reaches_the_watchdog(tmp_path) -> None:
    """run.stall_steps is the runner's max_stall_steps: a limit below what the work needs stops the run."""
    out = run_kvbench(
        "run",
        "engine=paged",
        "workload.num_requests=2",
        "workload.output_len=64",
        "run.warmup=false",
        "run.mode=sim",
        "run.stall_steps=5",
        cwd=tmp_path,
    )
    assert out.returncode != 0
    assert "raise it with run.stall_steps" in out.stderr + out.stdout
    assert "run.stall_steps: must be >= 1 or null, got 0" in config_error("run.stall_steps=0")
