"""The `kvbench` command: a thin front that dispatches to subcommands.

Hydra owns configuration for `run`, `sweep`, `size` and `export` (overrides such as
``model=llama-3-70b engine=paged``); the result/report subcommands take ordinary
flags. Nothing here changes the working directory.
"""

from __future__ import annotations

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
    folder = resources.files("kvbench.conf").joinpath(group)
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def _hydra_help(command: str) -> str:
    groups = "\n".join(
        f"  {g:<11}{', '.join(_presets(g))}" for g in ("model", "hardware", "engine", "workload")
    )
    experiments = ", ".join(_presets("experiment"))
    multirun = (
        "Runs a Hydra multirun: comma lists sweep (model=tiny-mha,tiny-gqa) and\n"
        "+experiment=NAME loads a prepared sweep from conf/experiment/.\n"
        if command == "sweep"
        else "Runs one configuration.\n"
    )
    return f"""\
usage: kvbench {command} [KEY=VALUE ...]

{multirun}Results go to results/<run.sweep_name>/<run-id>/ (parquet + config + environment).

config groups (choose with GROUP=NAME):
{groups}
experiments (+experiment=NAME): {experiments}

common keys: seed=0 run.mode=real|sim run.device=cpu|cuda run.dtype=fp32|bf16
  run.results_dir=results run.sweep_name=NAME run.progress=auto|on|off run.resume=true
  slo.ttft_ms=.. slo.tpot_ms=.. engine.<param>=.. workload.<param>=..
Hydra's own flags also work: --cfg job (print the composed config), hydra/launcher=joblib.
"""


def _run_hydra(task: Callable, config_name: str, overrides: list[str], multirun: bool) -> None:
    import hydra

    from kvbench.config import register_schemas

    register_schemas()
    sys.argv = ["kvbench", *overrides] + (["--multirun"] if multirun else [])
    hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)(task)()


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
    if command == "size":
        overrides = [a for a in argv if a != "--json"] + (["format=json"] if "--json" in argv else [])
        _run_hydra(_size_task, "size", overrides, multirun=False)
    elif command == "export":
        _run_hydra(_export_task, "export", argv, multirun=False)
    else:
        _run_hydra(_run_task, "config", argv, multirun=command == "sweep")
    return 0


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
