"""Command-line overrides before Hydra runs: checked, with kvbench's one-screen errors in
place of Hydra's, and completed with what kvbench adds (the user's config directory on
the search path, an ad-hoc sweep's name).

Hydra's own messages name the problem but not the fix: "Key 'block_sizee' is not in
struct ... To append to your config use +engine.block_sizee=24" (kvbench's schema
refuses unknown `+key`s anyway) or, for a preset typo, a dump of every search path.
``check_overrides`` composes the configuration the overrides ask for (every value of a
sweep once) and turns any failure into a ConfigError naming the override, with a "did
you mean" from the known keys and presets.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Iterator

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from kvbench.config import (
    ConfigError,
    accepted_params,
    first_line,
    kvbench_home,
    plugin_keys,
    register_schemas,
    unknown_key_hint,
    user_hardware_dir,
)

CONFIG_MODULE = "kvbench.conf"

# Plug-in sections: their keys are the `_target_`'s parameters, not only the preset's YAML.
_PLUGIN_SECTIONS = ("engine", "workload")

# Run options that say where and how to run a sweep, not what it measures: left out of
# an ad-hoc sweep's name (run.repeats too, so more repeats later resume in the same
# directory and skip the repeats already complete).
_UNNAMED_RUN_KEYS = frozenset(
    {
        "run.results_dir",
        "run.sweep_name",
        "run.run_id",
        "run.progress",
        "run.report",
        "run.resume",
        "run.repeats",
        "run.stall_steps",
    }
)
_MAX_SWEEP_NAME_CHARS = 100


def user_searchpath() -> list[str]:
    """The override adding ``kvbench_home()`` to Hydra's config search path, so that
    ``hardware=NAME`` finds profiles ``kvbench calibrate`` wrote; [] while it holds none.
    Hydra searches it after the shipped presets, which win on a name clash."""
    if not user_hardware_dir().is_dir():
        return []
    return [f"hydra.searchpath=[{quoted('file://' + str(kvbench_home().resolve()))}]"]


def quoted(value: str) -> str:
    """``value`` as a quoted string of Hydra's override grammar (commas and ``=`` stay text). Pure."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def parse(overrides: list[str]) -> list[Override]:
    """Each override parsed; ConfigError naming the first one that is not valid syntax."""
    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.append(parser.parse_override(text))
        except HydraException as exc:
            raise ConfigError(
                f"{text}: not an override ({first_line(exc)}); write KEY=VALUE, GROUP=PRESET or "
                "+KEY=VALUE, quoting values with spaces or commas: KEY='a,b'"
            ) from None
    return parsed


def check_overrides(config_name: str, overrides: list[str], multirun: bool) -> DictConfig:
    """Compose ``config_name`` with ``overrides`` (for a sweep: once per value of each
    sweep parameter) and raise ConfigError naming the first override Hydra refuses: an
    unknown key or preset (with a "did you mean"), a value of the wrong type, a sweep
    given to a single run. Values the schema checks later (kvbench.config) are not judged
    here. Returns the configuration of the first job (every sweep at its first value).
    Leaves Hydra's global state as it found it."""
    parsed = parse(overrides)
    if not multirun:
        for text, override in zip(overrides, parsed):
            if override.is_sweep_override():
                raise ConfigError(
                    f"{text}: a comma list, range() or glob() is a sweep: run it with `kvbench sweep`, "
                    "or write a list as KEY=[a,b] and a string with a comma as KEY='a,b'"
                )
    register_schemas()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        composed = [_composed(config_name, variant) for variant in _variants(overrides, parsed)]
    return composed[0]


def _composed(config_name: str, overrides: list[str]) -> DictConfig:
    try:
        return compose(config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(explain(exc, config_name, overrides)) from None


def repeat_passes(overrides: list[str], repeats: int) -> list[list[str]]:
    """The override lists of ``run.repeats``' passes: ``[overrides + ["run.repeat=R"]]`` for
    R in 0..repeats-1, run one after the other, so that a sweep runs repeat 0 of every
    configuration, then repeat 1, ... (interleaved: a slow spell of the machine hits
    every configuration alike). ``[overrides]`` for one repeat, and when the overrides
    set run.repeat themselves (a hand-made ``run.repeat=0,1,2`` sweep parameter).
    ConfigError for a swept run.repeats. Pure.

    Passes rather than a ``run.repeat`` sweep parameter: Hydra's basic sweeper varies the
    last parameter fastest and puts an experiment's ``hydra.sweeper.params`` before the
    command line's, which no override can reorder, and Hydra instantiates sweepers only
    from the ``hydra_plugins`` package."""
    for text, override in zip(overrides, parse(overrides)):
        key = override.get_key_element().lstrip("+~")
        if key == "run.repeats" and override.is_sweep_override():
            raise ConfigError(f"{text}: run.repeats is one number (how often every configuration runs)")
        if key == "run.repeat":
            return [overrides]
    if repeats <= 1:
        return [overrides]
    return [[*overrides, f"run.repeat={repeat}"] for repeat in range(repeats)]


def _variants(overrides: list[str], parsed: list[Override]) -> Iterator[list[str]]:
    """Single-run override lists that together use every value of every sweep parameter:
    each sweep at its first value, then one value changed at a time (sum, not product,
    of the sweep lengths). A sweep whose values need the config loader (glob) is left to
    Hydra."""
    choices: list[list[str]] = []
    for text, override in zip(overrides, parsed):
        if not override.is_sweep_override():
            choices.append([text])
            continue
        try:
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        except HydraException:
            choices.append([])
    base = [values[0] for values in choices if values]
    yield base
    position = 0
    for values in choices:
        if not values:
            continue
        for value in values[1:]:
            yield [*base[:position], value, *base[position + 1 :]]
        position += 1


def explain(exc: BaseException, config_name: str, overrides: list[str]) -> str:
    """Hydra's composition error ``exc`` (for ``overrides``) as one screen: the override,
    what is wrong, and the closest known key or preset. Composes the configuration
    without the offending override to list the keys it has (inside an initialized
    Hydra)."""
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, name = exc.missing_cfg_file.rpartition("/")
        options = list(exc.options or [])
        close = difflib.get_close_matches(name, options, n=1)
        hint = f"; did you mean {group}={close[0]}?" if close else ""
        listed = f" (presets: {', '.join(options)})" if options else ""
        return f"{group}={name}: no {group} preset named {name!r}{hint}{listed}"
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    full_key = getattr(cause, "full_key", None) if isinstance(cause, OmegaConfBaseException) else None
    if not full_key:
        return first_line(exc)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return _unknown_key(str(full_key), config_name, overrides)
    return f"{full_key}: {first_line(cause)}"


def _unknown_key(full_key: str, config_name: str, overrides: list[str]) -> str:
    """``engine.block_sizee: unknown key; did you mean engine.block_size?``, from the
    keys the configuration has there (and a plug-in's parameters). A parameter the
    plug-in takes that its preset does not set is added with ``+KEY=VALUE``."""
    parent, _, name = full_key.rpartition(".")
    others = [o for o in overrides if _key_of(o) != full_key]
    try:
        cfg = compose(config_name, overrides=others)
    except (HydraException, OmegaConfBaseException):
        return f"{full_key}: unknown key"
    node = OmegaConf.select(cfg, parent) if parent else cfg
    known = [str(k) for k in node if not str(k).startswith("_")] if isinstance(node, DictConfig) else []
    if parent in _PLUGIN_SECTIONS and isinstance(node, DictConfig) and "_target_" in node:
        from hydra.utils import get_object

        target = str(node._target_)
        params = plugin_keys(accepted_params(get_object(target))[0])
        if name in params:
            value = next((o.split("=", 1)[1] for o in overrides if _key_of(o) == full_key), "VALUE")
            return (
                f"{full_key}: {target} takes it, but the {parent} preset does not set it: "
                f"add it with +{full_key}={value}"
            )
        known = sorted(set(known) | set(params))
    return f"{full_key}: unknown key{unknown_key_hint(parent, name, known)}"


def explain_outside(exc: BaseException, config_name: str, overrides: list[str]) -> str:
    """``explain`` for an error Hydra raised while running (Hydra's global state reset)."""
    GlobalHydra.instance().clear()
    register_schemas()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return explain(exc, config_name, overrides)


def _key_of(override: str) -> str:
    """The key an override text sets (without ``+``/``~``), "" for none."""
    return override.split("=", 1)[0].lstrip("+~")


def sweep_name_for(overrides: list[str]) -> str:
    """An ad-hoc sweep's directory name, from the overrides that choose what it measures,
    as typed: ``engine=paged,dense-workload=chat,random``. Where and how to run
    (``_UNNAMED_RUN_KEYS``, ``hydra.*``) are left out; "sweep" when nothing is left.
    Filesystem-safe; a long name is cut and ends in a hash of the whole. Pure."""
    parts = [
        re.sub(r"[^A-Za-z0-9._=,+-]+", "_", text)
        for text in overrides
        if not _key_of(text).startswith("hydra") and _key_of(text) not in _UNNAMED_RUN_KEYS
    ]
    name = "-".join(parts).lstrip(".") or "sweep"
    if len(name) > _MAX_SWEEP_NAME_CHARS:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[: _MAX_SWEEP_NAME_CHARS - 9]}-{digest}"
    return name
