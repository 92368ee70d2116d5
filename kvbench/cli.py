"""The `kvbench` command: a thin front that dispatches to subcommands.

Hydra owns configuration for `run`, `sweep`, `size` and `export` (overrides such as
``model=llama-3-70b engine=paged``); the result/report subcommands take ordinary
flags. Nothing here changes the working directory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from importlib import resources

USAGE = """\
usage: kvbench <command> [args]

commands:
  run       run one configuration:           kvbench run model=tiny-gqa engine=paged workload=chat
  sweep     run a Hydra multirun / experiment: kvbench sweep +experiment=gqa_vs_mha
  size      KV memory calculator:             kvbench size model=llama-3-70b seq_len=8192 batch=32 hardware=h100-80gb
  report    HTML report of a results folder:  kvbench report results/gqa_vs_mha
  compare   compare two result sets:          kvbench compare BASELINE CANDIDATE --fail-on tpot_ms_p99:+10%
  trace     inspect a trace file:             kvbench trace inspect FILE [--json]
  calibrate fit simulation coefficients:      kvbench calibrate RESULTS_DIR --name my-cpu
  twin      replay a live-server run in simulation: kvbench twin RUN_DIR --hardware my-server
  export    model as a Hugging Face directory: kvbench export model=tiny-gqa seed=0 dtype=fp32 out=DIR

`kvbench <command> --help` explains each command.
"""

CONFIG_PATH = "pkg://kvbench.conf"


def _presets(group: str) -> list[str]:
    """The shipped presets of ``group``, and for hardware also the user's calibrated ones."""
    from kvbench.config import kvbench_home

    folders = [resources.files("kvbench.conf").joinpath(group)]
    if group == "hardware" and (kvbench_home() / group).is_dir():
        folders.append(kvbench_home() / group)
    return sorted(
        {p.name.removesuffix(".yaml") for f in folders for p in f.iterdir() if p.name.endswith(".yaml")}
    )


def _hydra_help(command: str) -> str:
    groups = "\n".join(
        f"  {g:<11}{', '.join(_presets(g))}" for g in ("model", "hardware", "engine", "workload")
    )
    experiments = ", ".join(_presets("experiment"))
    multirun = (
        "Runs a Hydra multirun: comma lists sweep (model=tiny-mha,tiny-gqa) and\n"
        "+experiment=NAME loads a prepared sweep from conf/experiment/. An ad-hoc sweep is\n"
        "named after its overrides (engine=paged,dense-workload=chat), or --name NAME;\n"
        "rerunning it skips the runs already complete. run.repeats=N runs every configuration\n"
        "N times, interleaved (repeat 0 of every configuration, then repeat 1, ...).\n"
        if command == "sweep"
        else "Runs one configuration (engine=paged unless chosen); --name NAME sets run.sweep_name.\n"
    )
    return f"""\
usage: kvbench {command} [--name NAME] [KEY=VALUE ...]

{multirun}Results go to results/<run.sweep_name>/<run-id>/ (parquet + config + environment).

config groups (choose with GROUP=NAME):
{groups}
  (hardware also finds profiles `kvbench calibrate` wrote to $KVBENCH_HOME/hardware/)
experiments (+experiment=NAME): {experiments}

common keys: seed=0 run.mode=real|sim run.device=cpu|cuda run.dtype=fp32|bf16
  run.results_dir=results run.sweep_name=NAME run.progress=auto|on|off run.resume=true
  slo.ttft_ms=.. slo.tpot_ms=.. engine.<param>=.. workload.<param>=..
Hydra's own flags also work: --cfg job (print the composed config), hydra/launcher=joblib.
"""


def _run_hydra(task: Callable, config_name: str, overrides: list[str], multirun: bool, command: str) -> int:
    """Check ``overrides`` (kvbench.overrides) and run ``task`` under Hydra. A configuration
    Hydra refuses is one screen on stderr and exit status 2, as kvbench's own ConfigError."""
    from kvbench import overrides as checks
    from kvbench.config import ConfigError, register_schemas

    register_schemas()
    if not any(o.startswith("hydra.searchpath") for o in overrides):
        overrides = [*checks.user_searchpath(), *overrides]
    passes = [overrides]
    try:
        # Hydra's own flags (--cfg job, --info, ...) skip the check and run.repeats' passes;
        # Hydra still judges them.
        if not any(o.startswith("-") for o in overrides):
            cfg = checks.check_overrides(config_name, overrides, multirun)
            if config_name == "config":
                passes = checks.repeat_passes(overrides, cfg.run.repeats)
    except ConfigError as exc:
        return _invalid(command, str(exc))
    for pass_overrides in passes:
        status = _hydra_main(task, config_name, pass_overrides, multirun, command)
        if status:
            return status
    return 0


def _hydra_main(task: Callable, config_name: str, overrides: list[str], multirun: bool, command: str) -> int:
    """``task`` under ``hydra.main``; Hydra's configuration errors as ``_invalid``."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from kvbench import overrides as checks

    sys.argv = ["kvbench", *overrides] + (["--multirun"] if multirun else [])
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # raise instead of printing Hydra's own message
    try:
        hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)(task)()
    except (HydraException, OmegaConfBaseException) as exc:
        return _invalid(command, checks.explain_outside(exc, config_name, overrides))
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
    return 0


def _invalid(command: str, message: str) -> int:
    """Print a configuration error the way every Hydra command does; exit status 2."""
    prefix = "kvbench" if command in ("run", "sweep") else f"kvbench {command}"
    print(f"{prefix}: invalid configuration\n  {message}", file=sys.stderr)
    return 2


def _named(command: str, argv: list[str]) -> list[str]:
    """``argv`` with ``--name NAME`` as ``run.sweep_name=NAME``; for a sweep without a
    name (no run.sweep_name, no experiment), one made of its overrides
    (kvbench.overrides.sweep_name_for), so an ad-hoc sweep never lands in ``single``.
    ConfigError for a missing or doubled name."""
    from kvbench.config import ConfigError
    from kvbench.overrides import quoted, sweep_name_for

    rest: list[str] = []
    name: str | None = None
    items = iter(argv)
    for item in items:
        if item == "--name" or item.startswith("--name="):
            value = item.partition("=")[2] if "=" in item else next(items, None)
            if not value:
                raise ConfigError("--name: give the sweep's name, e.g. --name paged-vs-dense")
            name = value
        else:
            rest.append(item)
    keys = {o.split("=", 1)[0].lstrip("+~") for o in rest if not o.startswith("-")}
    if name is not None:
        if "run.sweep_name" in keys:
            raise ConfigError("--name: also given as run.sweep_name; give one of them")
        return [*rest, f"run.sweep_name={quoted(name)}"]
    if command == "sweep" and not keys & {"run.sweep_name", "experiment"}:
        return [
            *rest,
            f"run.sweep_name={quoted(sweep_name_for([o for o in rest if not o.startswith('-')]))}",
        ]
    return rest


def _run_task(cfg) -> None:  # noqa: ANN001 - Hydra passes a DictConfig
    from kvbench.config import ConfigError
    from kvbench.sweep import run_job

    try:
        outcome = run_job(cfg)
    except ConfigError as exc:
        print(f"kvbench: invalid configuration\n  {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from hydra.core.hydra_config import HydraConfig

    if outcome.status == "failed" and str(HydraConfig.get().mode) != "RunMode.MULTIRUN":
        if outcome.config_error:
            print(f"kvbench: invalid configuration\n  {outcome.error}", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(1)


def _size_task(cfg) -> None:  # noqa: ANN001
    import json

    from omegaconf import OmegaConf

    from kvbench.config import ConfigError, validate_size_config
    from kvbench.sizing import fit, format_table, report_to_dict
    from kvbench.specs import HardwareSpec, ModelSpec, SpecError

    try:
        cfg = validate_size_config(cfg)
    except ConfigError as exc:
        print(f"kvbench size: invalid configuration\n  {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        if cfg.hf_config:
            from kvbench.hf_config import model_spec_from_hf_config

            spec = model_spec_from_hf_config(cfg.hf_config, num_params=cfg.num_params)
        else:
            spec = ModelSpec(**OmegaConf.to_container(cfg.model))
        report = fit(
            spec,
            HardwareSpec(**OmegaConf.to_container(cfg.hardware)),
            seq_len=cfg.seq_len,
            batch=cfg.batch,
            kv_dtype=cfg.kv_dtype or spec.dtype,
            weight_dtype=cfg.weight_dtype or spec.dtype,
            block_size=cfg.block_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
        )
    except (SpecError, OSError) as exc:
        print(f"kvbench size: invalid input\n  {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if cfg.format == "json":
        print(json.dumps(report_to_dict(report), indent=2))
    else:
        print(format_table(report))


def _export_task(cfg) -> None:  # noqa: ANN001
    from kvbench.config import ConfigError
    from kvbench.export import export_from_config
    from kvbench.tokenizer import MissingModelPackageError

    try:
        out = export_from_config(cfg)
    except ConfigError as exc:
        print(f"kvbench export: invalid configuration\n  {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, MissingModelPackageError, OSError) as exc:  # ExportError is a ValueError
        print(f"kvbench export: cannot export\n  {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(out)


EXPORT_HELP = """\
usage: kvbench export [KEY=VALUE ...]

Writes kvbench's reference model as a Hugging Face Llama directory (config.json,
model.safetensors, generation_config.json; tokenizer.json for models with a tokenizer)
and prints its path, so a server (vLLM, transformers) runs exactly the weights kvbench's
engines use. Repeating an export is a no-op; kvbench replaces only a directory it wrote.

keys: model=NAME (default tiny-gqa) model.<field>=.. (e.g. model.vocab_size=1024)
      seed=0 (random weights' seed, as in `kvbench run`) dtype=fp32|bf16|fp16
      out=DIR (default: a directory in the kvbench cache, $KVBENCH_CACHE_DIR or ~/.cache/kvbench)
"""


def _hydra_command(command: str, argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        if command == "export":
            print(f"{EXPORT_HELP}models: {', '.join(_presets('model'))}")
        elif command == "size":
            print(
                "usage: kvbench size [KEY=VALUE ...] [--json]\n\n"
                "KV-cache memory of a model: bytes per token / sequence / batch, weights, and how many\n"
                "tokens and sequences fit on a GPU after weights (paged and slab layouts).\n\n"
                "keys: model=NAME hardware=NAME seq_len=4096 batch=1 kv_dtype=bf16|fp16|fp32|fp8|int8|int4\n"
                "      weight_dtype=.. block_size=16 gpu_memory_utilization=0.9 format=table|json\n"
                f"models: {', '.join(_presets('model'))}\nhardware: {', '.join(_presets('hardware'))}\n"
                "A Hugging Face config.json on disk instead of a preset: hf_config=/path/to/config.json"
            )
        else:
            print(_hydra_help(command))
        return 0
    from kvbench.config import ConfigError

    if command == "size":
        overrides = [a for a in argv if a != "--json"] + (["format=json"] if "--json" in argv else [])
        return _run_hydra(_size_task, "size", overrides, multirun=False, command=command)
    if command == "export":
        return _run_hydra(_export_task, "export", argv, multirun=False, command=command)
    try:
        overrides = _named(command, argv)
    except ConfigError as exc:
        return _invalid(command, str(exc))
    return _run_hydra(_run_task, "config", overrides, multirun=command == "sweep", command=command)


def _delegate(module: str, function: str) -> Callable[[list[str]], int]:
    def call(argv: list[str]) -> int:
        import importlib

        return int(importlib.import_module(module).__getattribute__(function)(argv) or 0)

    return call


def _trace(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvbench trace inspect FILE [--format F] [--json] [--skip-invalid] [--block-size N]")
        return 0
    if argv[0] != "inspect":
        print(f"kvbench trace: unknown subcommand {argv[0]!r} (expected: inspect)", file=sys.stderr)
        return 2
    return _delegate("kvbench.workloads.inspect", "main")(argv[1:])


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "run": lambda argv: _hydra_command("run", argv),
    "sweep": lambda argv: _hydra_command("sweep", argv),
    "size": lambda argv: _hydra_command("size", argv),
    "export": lambda argv: _hydra_command("export", argv),
    "report": _delegate("kvbench.report", "report_main"),
    "compare": _delegate("kvbench.compare", "main"),
    "trace": _trace,
    "calibrate": _delegate("kvbench.sim.calibrate", "main"),
    "twin": _delegate("kvbench.twin", "main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"kvbench: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[command](rest)


if __name__ == "__main__":
    raise SystemExit(main())
