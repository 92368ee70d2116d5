"""Structured-config schemas and the validation every entry point shares.

Hydra composes YAML from ``conf/``; ``validate_config`` re-merges the result into
``OmegaConf.structured(Config)`` so that unknown keys (``+key=`` additions too) and
wrong types fail with a message that names the key, then checks values that the
types cannot express (kv heads dividing q heads, positive lengths, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from kvbench.quality_config import QualityConfig
from kvbench.sizing import DEFAULT_BLOCK_SIZE
from kvbench.specs import HardwareSpec, ModelSpec, SpecError, dtype_bits


def schema_of(spec_cls: type, extra: tuple[tuple[str, type, Any], ...] = ()) -> type:
    """A mutable dataclass with ``spec_cls``'s fields, types and defaults.

    The specs are frozen (records must not change after construction), but OmegaConf
    turns a frozen dataclass into a read-only node that Hydra cannot override, so the
    config schema is derived from the spec instead of being written twice.
    """
    hints = get_type_hints(spec_cls)
    fields = [(name, kind, field(default=default)) for name, kind, default in extra]
    fields += [(f.name, hints[f.name], field(default=f.default)) for f in dataclasses.fields(spec_cls)]
    return dataclasses.make_dataclass(f"{spec_cls.__name__}Schema", fields)


ModelSchema = schema_of(ModelSpec)
HardwareSchema = schema_of(HardwareSpec)
# `quality.enabled=true` adds the lossy-cache quality harness to a real-mode run; the
# other keys are kvbench.quality_config.QualityConfig's.
QualitySchema = schema_of(QualityConfig, extra=(("enabled", bool, False),))


# Dtypes the real engines compute and store in (kvbench.model.TORCH_DTYPES' keys, named
# here without importing torch).
COMPUTE_DTYPES: tuple[str, ...] = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")


def kvbench_home() -> Path:
    """The user's kvbench directory: ``$KVBENCH_HOME``, else the platform's per-user config
    directory (``$XDG_CONFIG_HOME/kvbench`` or ``~/.config/kvbench`` on Linux,
    ``~/Library/Application Support/kvbench`` on macOS, ``%APPDATA%\\kvbench`` on Windows).
    What kvbench writes for the user (calibrated hardware profiles) lives here, never in
    the installed package. Reads the environment only."""
    if os.environ.get("KVBENCH_HOME"):
        return Path(os.environ["KVBENCH_HOME"])
    if sys.platform == "win32" and os.environ.get("APPDATA"):
        return Path(os.environ["APPDATA"]) / "kvbench"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "kvbench"
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "kvbench"


def user_hardware_dir() -> Path:
    """Where ``kvbench calibrate`` writes profiles and ``hardware=NAME`` also looks
    (after the shipped presets, which win on a name clash): ``kvbench_home()/hardware``."""
    return kvbench_home() / "hardware"


class ConfigError(ValueError):
    """Invalid configuration; ``str()`` is the one-screen message shown to the user."""


@dataclass
class RunOptions:
    mode: str = "real"  # "real": run the model; "sim": cost model, no tensors
    device: str = "cpu"
    dtype: str = "fp32"  # model compute dtype
    kv_dtype: str | None = None  # KV cache dtype; None: same as dtype
    warmup: bool = True  # one throwaway engine warms kernels before the timed run
    results_dir: str = "results"
    sweep_name: str = "single"
    run_id: str | None = None  # None: derived from the overrides and a config hash
    # torch intra-op threads; 0 keeps torch's default. 1 by default: tiny CPU models run
    # faster and far more repeatably single-threaded (no oversubscription jitter).
    num_threads: int = 1
    progress: str = "auto"  # auto (only on a terminal) | on | off
    report: bool = True  # sweeps write their HTML report at the end
    resume: bool = True  # skip runs already complete with the same config
    memory_interval_s: float = 0.05
    # Live-server engines (engine=endpoint, vllm_cpu): how often the server's /metrics is scraped.
    server_metrics_interval_s: float = 0.25
    # The stall watchdog: consecutive engine steps with no request finished or rejected
    # while work is queued before the run stops with an error. None: derived from the
    # workload (kvbench.runner.default_max_stall_steps).
    stall_steps: int | None = None
    # Repeats of timed measurements: `kvbench sweep run.repeats=N` runs every
    # configuration N times, interleaved (repeat 0 of every configuration, then repeat 1,
    # ...), each job with its own run.repeat index (part of the run id and config hash;
    # compare pools a configuration's repeats).
    repeats: int = 1
    repeat: int = 0


@dataclass
class SLO:
    """Service-level objectives for goodput, in milliseconds; None: not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None


@dataclass
class Headline:
    """What an experiment is about: its headline metrics (shown first, in this order, in
    the terminal summary and the report) and the report figure shown first."""

    metrics: list[str] = field(default_factory=list)
    plot: str | None = None


@dataclass
class Config:
    model: Any = field(default_factory=ModelSchema)
    hardware: Any = field(default_factory=HardwareSchema)
    # Plug-ins: Hydra `_target_` mappings, validated by the target's signature.
    engine: Any = None
    workload: Any = None
    seed: int = 0
    run: RunOptions = field(default_factory=RunOptions)
    slo: SLO = field(default_factory=SLO)
    quality: Any = field(default_factory=QualitySchema)
    experiment: str = ""
    headline: Headline = field(default_factory=Headline)


@dataclass
class SizeConfig:
    """`kvbench size`: the KV memory calculator."""

    model: Any = field(default_factory=ModelSchema)
    hardware: Any = field(default_factory=HardwareSchema)
    hf_config: str | None = None  # a Hugging Face config.json on disk; replaces `model`
    num_params: int | None = None  # with hf_config: published parameter count (MLA, MoE)
    seq_len: int = 4096
    batch: int = 1
    kv_dtype: str | None = None  # None: the model's dtype
    weight_dtype: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    gpu_memory_utilization: float = 0.9
    format: str = "table"  # table | json


@dataclass
class ExportConfig:
    """`kvbench export`: the reference model of ``model`` as a Hugging Face directory."""

    model: Any = field(default_factory=ModelSchema)
    seed: int = 0  # random weights' seed (the run's `seed`)
    dtype: str = "fp32"  # weights' dtype: fp32 | bf16 | fp16
    out: str | None = None  # None: the kvbench cache (kvbench.export.exported_model_dir)


def register_schemas() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent; called by the CLI)."""
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    store.store(name="size_schema", node=SizeConfig)
    store.store(name="export_schema", node=ExportConfig)


def _merge_structured(schema: type, cfg: DictConfig) -> DictConfig:
    plain = OmegaConf.to_container(cfg, resolve=False)
    if isinstance(plain, dict):
        plain.pop("hydra", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), plain)
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        hint = ""
        if isinstance(exc, (ConfigAttributeError, ConfigKeyError)) and key != "?":
            # A key the schema lacks (typically a `+key=` typo): suggest from its siblings.
            parent, _, name = key.rpartition(".")
            structured = OmegaConf.structured(schema)
            siblings = OmegaConf.select(structured, parent) if parent else structured
            known = [str(k) for k in siblings] if OmegaConf.is_dict(siblings) else []
            hint = unknown_key_hint(parent, name, known)
        raise ConfigError(f"{key}: {first_line(exc)}{hint}") from None
    return merged


def unknown_key_hint(section: str, key: str, known: Sequence[str]) -> str:
    """``"; did you mean SECTION.CLOSE?"`` for the known key closest to ``key``, else
    ``"; known keys: ..."`` (empty when nothing is known). ``section`` "" is the root. Pure."""
    prefix = f"{section}." if section else ""
    close = difflib.get_close_matches(key, list(known), n=1)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    return f"; known keys: {', '.join(sorted(known))}" if known else ""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def validate_config(cfg: DictConfig) -> DictConfig:
    """Return the resolved, schema-checked run config or raise ConfigError naming the key."""
    merged = _merge_structured(Config, cfg)
    try:
        model = ModelSpec(**OmegaConf.to_container(merged.model))
        model.validate()
        HardwareSpec(**OmegaConf.to_container(merged.hardware)).validate()
        dtype_bits(merged.run.dtype)
        if merged.run.kv_dtype is not None:
            dtype_bits(merged.run.kv_dtype)
    except SpecError as exc:
        raise ConfigError(str(exc)) from None
    if merged.run.mode not in ("real", "sim"):
        raise ConfigError(f"run.mode: must be 'real' or 'sim', got {merged.run.mode!r}")
    if not (merged.run.memory_interval_s > 0 and math.isfinite(merged.run.memory_interval_s)):
        raise ConfigError(
            f"run.memory_interval_s: must be > 0 and finite, got {merged.run.memory_interval_s}"
        )
    interval_s = merged.run.server_metrics_interval_s
    if not (interval_s > 0 and math.isfinite(interval_s)):
        raise ConfigError(f"run.server_metrics_interval_s: must be > 0 and finite, got {interval_s}")
    if merged.run.mode == "real":
        for key in ("dtype", "kv_dtype"):
            value = merged.run[key]
            if value is not None and value not in COMPUTE_DTYPES:
                raise ConfigError(
                    f"run.{key}: {value!r} cannot be computed by the real engines (fp32, bf16, fp16); "
                    "lower-precision KV is sized by `kvbench size` and modeled by run.mode=sim"
                )
        _check_device(merged.run.device)
    if merged.run.progress not in ("auto", "on", "off"):
        raise ConfigError(f"run.progress: must be auto, on or off, got {merged.run.progress!r}")
    if merged.run.repeats < 1:
        raise ConfigError(f"run.repeats: must be >= 1, got {merged.run.repeats}")
    if not 0 <= merged.run.repeat < merged.run.repeats:
        raise ConfigError(
            f"run.repeat: must be in [0, run.repeats={merged.run.repeats}), got {merged.run.repeat}"
        )
    if merged.run.stall_steps is not None and merged.run.stall_steps < 1:
        raise ConfigError(f"run.stall_steps: must be >= 1 or null, got {merged.run.stall_steps}")
    if merged.run.num_threads < 0:
        raise ConfigError(f"run.num_threads: must be >= 0, got {merged.run.num_threads}")
    for section in ("engine", "workload"):
        node = merged.get(section)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(
                f"{section}: missing; choose a preset, e.g. {section}=<name> (see conf/{section}/)"
            )
        check_plugin_params(node, section)
    if merged.quality.enabled:
        if merged.run.mode != "real":
            raise ConfigError("quality.enabled: the quality harness runs the real model (run.mode=real)")
        options = {k: v for k, v in OmegaConf.to_container(merged.quality).items() if k != "enabled"}
        options["passkey_depths"] = tuple(options["passkey_depths"])
        try:
            QualityConfig(**options).validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
        value = merged.slo[key]
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"slo.{key}: must be > 0 and finite, got {value}")
    return merged


def _check_device(device: str) -> None:
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"run.device: {device!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device: {device!r} requested but torch sees no CUDA device")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ConfigError(f"run.device: {device!r} but only {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type != "cpu":
        raise ConfigError(f"run.device: {device!r} is not supported (cpu, cuda, cuda:N)")


def validate_size_config(cfg: DictConfig) -> DictConfig:
    merged = _merge_structured(SizeConfig, cfg)
    try:
        ModelSpec(**OmegaConf.to_container(merged.model)).validate()
        HardwareSpec(**OmegaConf.to_container(merged.hardware)).validate()
        for key in ("kv_dtype", "weight_dtype"):
            if merged[key] is not None:
                dtype_bits(merged[key])
    except SpecError as exc:
        raise ConfigError(str(exc)) from None
    if merged.seq_len <= 0:
        raise ConfigError(f"seq_len: must be > 0, got {merged.seq_len}")
    if merged.batch <= 0:
        raise ConfigError(f"batch: must be > 0, got {merged.batch}")
    if merged.block_size <= 0 or merged.block_size & (merged.block_size - 1):
        raise ConfigError(f"block_size: must be a power of two, got {merged.block_size}")
    if not 0.0 < merged.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got {merged.gpu_memory_utilization}")
    if merged.format not in ("table", "json"):
        raise ConfigError(f"format: must be 'table' or 'json', got {merged.format!r}")
    return merged


# --------------------------------------------------------------------------- plug-in parameters
# Parameters a plug-in receives from the runtime, never from its YAML node.
_INJECTED_PARAMS = frozenset({"ctx", "tokenizer", "executor", "kv_manager", "kv_manager_factory"})


def check_plugin_params(node: DictConfig, section: str) -> None:
    """Check every key of a ``_target_`` node against the target's signature and type hints.

    The target's annotations are the schema of its YAML: ``bool`` takes only true/false
    (``abc`` is not truthy, it is an error), ``int`` only integers, ``float`` numbers,
    ``str`` strings, ``Literal[...]`` its members, ``X | None`` also null. Keys the target
    does not accept fail with a "did you mean". A target that forwards ``**kwargs`` is
    followed to where they go: a class's base ``__init__``, a factory's annotated return
    class. Pure; raises ConfigError naming ``section.key``.
    """
    target_name = str(node._target_)
    try:
        from hydra.utils import get_object

        target = get_object(target_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a bad _target_
        raise ConfigError(f"{section}._target_: cannot import {target_name!r}: {first_line(exc)}") from None
    params, open_ended = accepted_params(target)
    for key in node:
        key = str(key)
        if key.startswith("_"):
            continue
        if key not in params:
            if open_ended:
                continue
            known = plugin_keys(params)
            raise ConfigError(
                f"{section}.{key}: unknown key for {target_name}{unknown_key_hint(section, key, known)}"
            )
        annotation = params[key]
        if annotation is inspect.Parameter.empty:
            continue
        value = OmegaConf.to_container(node[key]) if OmegaConf.is_config(node[key]) else node[key]
        problem = _type_problem(value, annotation)
        if problem is not None:
            raise ConfigError(f"{section}.{key}: expected {problem}, got {value!r}")


def plugin_keys(params: Mapping[str, Any]) -> list[str]:
    """The keys a plug-in's YAML node may set, of ``accepted_params``' names (those the
    runtime injects are not configuration). Pure."""
    return sorted(k for k in params if k not in _INJECTED_PARAMS)


def accepted_params(target: Callable[..., Any]) -> tuple[dict[str, Any], bool]:
    """The keyword parameters ``target`` accepts, with resolved annotations, and whether it
    still takes arbitrary ``**kwargs`` after following every forward (then unknown keys
    cannot be judged). Pure."""
    params: dict[str, Any] = {}
    seen: set[int] = set()
    queue: list[Callable[..., Any]] = [target]
    open_ended = False
    while queue:
        current = queue.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        function = current.__init__ if isinstance(current, type) else current
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            return params, True
        try:
            hints = get_type_hints(function)
        except Exception:  # noqa: BLE001 - unresolvable forward references: no type checks
            hints = {}
        forwards = False
        for name, parameter in signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                forwards = True
            elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL and name != "self":
                params.setdefault(name, hints.get(name, inspect.Parameter.empty))
        if not forwards:
            continue
        # Where do the **kwargs go? A class: its next base that defines __init__; a
        # factory: the class its return annotation names.
        nexts: list[Callable[..., Any]] = []
        if isinstance(current, type):
            nexts = [base for base in current.__mro__[1:] if "__init__" in vars(base) and base is not object]
        elif isinstance(hints.get("return"), type):
            nexts = [hints["return"]]
        if nexts:
            queue.append(nexts[0])
        else:
            open_ended = True
    return params, open_ended


_KIND_NAMES: dict[type, str] = {
    bool: "a boolean (true or false)",
    int: "an integer",
    float: "a finite number",
    str: "a string",
    type(None): "null",
}


def _type_problem(value: Any, annotation: Any) -> str | None:
    """None when ``value`` (plain YAML data) fits ``annotation``, else what was expected."""
    origin = typing.get_origin(annotation)
    if annotation is Any or annotation is object:
        return None
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, arm) for arm in typing.get_args(annotation)]
        if any(p is None for p in problems):
            return None
        return " or ".join(dict.fromkeys(p for p in problems if p))
    if origin is typing.Literal:
        members = typing.get_args(annotation)
        return None if value in members else "one of " + ", ".join(map(repr, members))
    if annotation is bool:
        return None if isinstance(value, bool) else _KIND_NAMES[bool]
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else _KIND_NAMES[int]
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else _KIND_NAMES[float]
    if annotation is str:
        return None if isinstance(value, str) else _KIND_NAMES[str]
    if annotation is type(None):
        return None if value is None else _KIND_NAMES[type(None)]
    base = origin or annotation
    if base in (dict, Mapping) or (isinstance(base, type) and issubclass(base, Mapping)):
        return None if isinstance(value, Mapping) else "a mapping"
    if base in (list, tuple, Sequence):
        return None if isinstance(value, (list, tuple)) else "a list"
    # Other annotations (objects the runtime passes, type aliases it cannot check):
    # the target validates them itself.
    return None


def validate_export_config(cfg: DictConfig) -> DictConfig:
    """Return the schema-checked `kvbench export` config or raise ConfigError naming the key."""
    merged = _merge_structured(ExportConfig, cfg)
    try:
        ModelSpec(**OmegaConf.to_container(merged.model)).validate()
    except SpecError as exc:
        raise ConfigError(str(exc)) from None
    if merged.dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"dtype: {merged.dtype!r} cannot be exported (fp32, bf16 or fp16)")
    return merged
