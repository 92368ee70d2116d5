"""One configuration, end to end: build model, workload and engine, replay, store.

This is the body of both ``kvbench run`` and every job of ``kvbench sweep``. A run
that fails is recorded as failed (with its error) instead of raising, so that a sweep
goes on; the caller learns the outcome from the returned ``RunOutcome``. A run in which
no request completed measured nothing and is recorded as failed too, with its frames.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import tempfile
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from kvbench import results
from kvbench.config import ConfigError
from kvbench.environment import collect_environment
from kvbench.memory import MemorySampler
from kvbench.metrics import summarize_run
from kvbench.runner import Clock, RawRun, SimClock, WallClock, replay
from kvbench.sizing import weight_bytes
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import Engine, EngineContext, LiveEngine, Request, Workload

if TYPE_CHECKING:
    from kvbench.model import LlamaModel

# Run options that do not change what is measured: excluded from the config hash so
# that moving results or turning the progress bar on does not defeat resume.
_NON_SEMANTIC_RUN_KEYS = (
    "results_dir",
    "sweep_name",
    "run_id",
    "progress",
    "report",
    "resume",
    "stall_steps",
)


@dataclass(frozen=True)
class Measured:
    """What ``_measure`` collected: the summary, the raw frames, and a live server's
    scrape timeline and log (None for in-process engines)."""

    summary: dict[str, Any]
    raw: RawRun
    memory: pd.DataFrame
    server_metrics: pd.DataFrame | None = None
    server_log: Path | None = None
    # Why the live server failed during the run ("" when it did not): the run is failed,
    # its frames kept.
    server_failure: str = ""


@dataclass(frozen=True)
class RunOutcome:
    run_dir: Path
    status: str  # "ok" | "failed" | "skipped"
    summary: dict[str, Any]
    error: str = ""
    config_error: bool = False  # the failure is a bad configuration, not a crash
    recorded: bool = True  # False: not even the failed run record could be written


def config_hash(cfg: DictConfig) -> str:
    """Stable hash of everything that changes a run's result."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    for key in _NON_SEMANTIC_RUN_KEYS:
        plain["run"].pop(key, None)
    plain.pop("headline", None)  # what a report shows first, not what is measured
    return hashlib.sha256(OmegaConf.to_yaml(OmegaConf.create(plain)).encode()).hexdigest()[:12]


def run_id_for(overrides: list[str], digest: str) -> str:
    """A readable, filesystem-safe run id: the job's overrides plus the config hash."""
    parts = [
        o for o in overrides if not o.lstrip("+~").startswith(("run.", "hydra.", "experiment", "headline"))
    ]
    slug = ",".join(parts) or "default"
    slug = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", slug)[:120]
    return f"{slug}-{digest[:8]}"


def load_model(spec: ModelSpec, cfg: DictConfig) -> LlamaModel:
    """Real-mode weights: seeded random, the SmolLM2 GGUF, or a local safetensors path."""
    from kvbench.export import reference_model

    return reference_model(spec, seed=cfg.seed, dtype=cfg.run.dtype, device=cfg.run.device)[0]


def _config_error(section: str, exc: BaseException, target: object) -> ConfigError | None:
    """Translate a constructor's complaint into a ConfigError naming ``section.key``."""
    text = str(exc)
    match = re.search(r"unexpected keyword argument '(\w+)'", text)
    if match:
        return ConfigError(f"{section}.{match.group(1)}: unknown key for {target}")
    match = re.search(r"missing \d+ required (?:keyword-only |positional )?arguments?: (.+)", text)
    if match:
        return ConfigError(f"{section}: missing required key(s) {match.group(1)}")
    if isinstance(exc, ValueError):
        if text.startswith(f"{section}.") or text.startswith(f"{section}:"):
            return ConfigError(text)
        # "num_requests: must be ..." from a plug-in becomes "workload.num_requests: ..."
        return ConfigError(f"{section}.{text}" if re.match(r"^[\w.\[\]]+: ", text) else f"{section}: {text}")
    return None


def instantiate_plugin(node: DictConfig, section: str, **kwargs: Any) -> Any:
    """Hydra-instantiate ``node``; a bad key becomes a ConfigError naming ``section.key``."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        error = _config_error(section, exc.__cause__ or exc, node.get("_target_"))
        if error is None:
            raise
        raise error from None


def build_engine(factory: Any, ctx: EngineContext, target: object) -> Engine:
    """Call the engine partial; parameter complaints become ConfigErrors naming ``engine.key``."""
    try:
        return factory(ctx)
    except (TypeError, ValueError) as exc:
        error = _config_error("engine", exc, target)
        if error is None:
            raise
        raise error from None


def load_tokenizer_for(spec: ModelSpec) -> Any | None:
    """The model's tokenizer when it has one (the SmolLM2 preset), else None."""
    if spec.weights == "smollm2":
        from kvbench.tokenizer import load_tokenizer

        return load_tokenizer("smollm2")
    return None


def build_workload(cfg: DictConfig, tokenizer: Any | None = None) -> Workload:
    extra = {"tokenizer": tokenizer} if tokenizer is not None else {}
    workload = instantiate_plugin(cfg.workload, "workload", **extra)
    if not isinstance(workload, Workload):
        raise ConfigError(
            f"workload: {cfg.workload._target_} returned {type(workload).__name__}, not a Workload"
        )
    return workload


def _warmup_workload(spec: ModelSpec) -> Workload:
    prompt = tuple(3 + (i * 7) % (spec.vocab_size - 3) for i in range(16))
    return Workload("warmup", (Request("warmup-0", 0.0, prompt, 4), Request("warmup-1", 0.0, prompt[:9], 4)))


def execute(cfg: DictConfig, run_dir: Path, digest: str) -> RunOutcome:
    """Run the validated config ``cfg`` and write its results into ``run_dir`` atomically.

    Never raises for a failing run: the failure is written as a failed run record.
    """
    meta: dict[str, Any] = {
        "run_id": run_dir.name,
        "sweep_name": cfg.run.sweep_name,
        "mode": cfg.run.mode,
        "engine": cfg.engine.get("name", str(cfg.engine._target_).rsplit(".", 1)[-1]),
        "engine_params": {
            k: v for k, v in OmegaConf.to_container(cfg.engine).items() if not k.startswith("_")
        },
        "model": OmegaConf.to_container(cfg.model),
        "hardware": OmegaConf.to_container(cfg.hardware),
        "workload": cfg.workload.get("name", str(cfg.workload._target_).rsplit(".", 1)[-1]),
        # Everything that changes what is measured, so compare/report can match on it.
        "workload_params": {k: v for k, v in OmegaConf.to_container(cfg.workload).items() if k != "_target_"},
        "run": {
            "device": cfg.run.device,
            "dtype": cfg.run.dtype,
            "kv_dtype": cfg.run.kv_dtype or (cfg.model.dtype if cfg.run.mode == "sim" else cfg.run.dtype),
            "num_threads": cfg.run.num_threads,
            "warmup": cfg.run.warmup,
            "repeat": cfg.run.repeat,
        },
        "seed": cfg.seed,
        "slo": OmegaConf.to_container(cfg.slo),
        "config_hash": digest,
        "experiment": cfg.experiment,
        "headline": OmegaConf.to_container(cfg.headline),
    }
    config_yaml = OmegaConf.to_yaml(cfg)
    # A live server's log is written here during the run, then attached to the run.
    with tempfile.TemporaryDirectory(prefix="kvbench-run-") as work_dir:
        return _execute(cfg, run_dir, meta, config_yaml, Path(work_dir))


def _execute(
    cfg: DictConfig, run_dir: Path, meta: dict[str, Any], config_yaml: str, work_dir: Path
) -> RunOutcome:
    try:
        # Simulation runs no tensors, so it never imports torch.
        meta["environment"] = collect_environment(with_torch=cfg.run.mode != "sim")
        measured = _measure(cfg, meta, work_dir)
    except ConfigError as exc:
        meta.update(status="failed", error=f"ConfigError: {exc}")
        return _record_failure(
            run_dir, meta, config_yaml, RunOutcome(run_dir, "failed", {}, str(exc), config_error=True)
        )
    except Exception as exc:  # noqa: BLE001 - a failed run is data, the sweep goes on
        error = f"{type(exc).__name__}: {exc}"
        meta.update(status="failed", error=error, traceback=traceback.format_exc())
        return _record_failure(run_dir, meta, config_yaml, RunOutcome(run_dir, "failed", {}, error))
    summary, raw = measured.summary, measured.raw
    error = "; ".join(
        e for e in (measured.server_failure, nothing_completed_error(raw.requests, summary)) if e
    )
    meta.update(status="failed" if error else "ok", error=error)
    extra_frames = {"server_metrics": measured.server_metrics} if measured.server_metrics is not None else {}
    log = measured.server_log
    attachments = {"server.log": log} if log is not None and log.is_file() else {}
    try:
        results.write_run(
            run_dir,
            raw.requests,
            raw.steps,
            measured.memory,
            meta,
            config_yaml,
            summary,
            missing=meta["missing"],
            extra_frames=extra_frames,
            attachments=attachments,
        )
    except results.ResultsWriteError as exc:
        meta.update(status="failed", error=f"results not written: {exc}")
        return _record_failure(
            run_dir, meta, config_yaml, RunOutcome(run_dir, "failed", summary, meta["error"])
        )
    return RunOutcome(run_dir, "failed" if error else "ok", summary, error)


def _record_failure(run_dir: Path, meta: dict[str, Any], config_yaml: str, outcome: RunOutcome) -> RunOutcome:
    """Write the failed run record of ``outcome``; when even that cannot be written (a full
    disk, a path that is not a directory), the outcome says so and carries both errors."""
    try:
        results.write_failed_run(run_dir, meta, meta["error"], config_yaml)
    except results.ResultsWriteError as exc:
        error = f"{outcome.error}\n  and the failure could not be recorded: {exc}"
        return dataclasses.replace(outcome, error=error, recorded=False)
    return outcome


# Distinct rejection reasons named in a nothing-completed error; more are counted.
_MAX_REASONS_SHOWN = 3
_MAX_REASON_CHARS = 160


def nothing_completed_error(requests: pd.DataFrame, summary: dict[str, Any]) -> str:
    """Why a run in which no request completed is a failure; "" when any request completed.

    E.g. "0 of 8 requests completed; rejected: 8 x 'engine h2o: ...'". ``summary`` is the
    run's metrics (num_requests, num_completed, num_unfinished as kvbench.metrics defines them).
    """
    if summary["num_completed"] > 0:
        return ""
    if summary["num_requests"] == 0:
        return "the workload has no requests: nothing was measured"
    reasons = requests["rejected_reason"].fillna("").astype(str)
    counts = reasons[reasons != ""].value_counts()
    parts = [f"{summary['num_completed']:.0f} of {summary['num_requests']:.0f} requests completed"]
    if len(counts):
        shown = [
            f"{count} x {_shorten(reason)!r}" for reason, count in counts.iloc[:_MAX_REASONS_SHOWN].items()
        ]
        if len(counts) > _MAX_REASONS_SHOWN:
            others = int(counts.iloc[_MAX_REASONS_SHOWN:].sum())
            shown.append(f"{others} x {len(counts) - _MAX_REASONS_SHOWN} other reason(s)")
        parts.append("rejected: " + ", ".join(shown))
    if summary["num_unfinished"] > 0:
        parts.append(f"unfinished when the run ended: {summary['num_unfinished']:.0f}")
    return "; ".join(parts)


def refuse_unservable(engine: Engine, workload: Workload, cfg: DictConfig) -> None:
    """Raise ConfigError naming ``engine=`` and ``workload=`` when the engine lacks a feature
    that every request of the workload needs (H2O and beam search, ...), before any replay.

    A workload only partly unservable runs: those requests are rejected and counted. Pure.
    """
    if not workload.requests:
        return
    reasons = Counter(engine.unsupported_reason(request) for request in workload.requests)
    if None in reasons:
        return
    reason, count = reasons.most_common(1)[0]
    engine_name = cfg.engine.get("name") or cfg.engine._target_
    raise ConfigError(
        f"engine={engine_name} cannot serve any request of workload={workload.name}: {reason} "
        f"({count} of {len(workload.requests)} requests); choose another engine or workload"
    )


def _shorten(text: str) -> str:
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


def _measure(cfg: DictConfig, meta: dict[str, Any], work_dir: Path) -> Measured:
    spec = ModelSpec(**OmegaConf.to_container(cfg.model))
    hardware = HardwareSpec(**OmegaConf.to_container(cfg.hardware))
    sim = cfg.run.mode == "sim"
    # Real mode computes (and stores weights) in run.dtype; simulation models the
    # checkpoint as published (model.dtype). The KV cache defaults to the same dtype.
    compute_dtype = spec.dtype if sim else cfg.run.dtype
    kv_dtype = cfg.run.kv_dtype or compute_dtype
    if not sim:
        _prepare_torch(cfg)
    tokenizer = None if sim else load_tokenizer_for(spec)
    workload = build_workload(cfg, tokenizer)
    model = None if sim else load_model(spec, cfg)
    ctx = EngineContext(spec, hardware, model, cfg.run.device, kv_dtype, cfg.seed, cfg.run.mode)
    factory = instantiate_plugin(cfg.engine, "engine")
    engine = build_engine(factory, ctx, cfg.engine._target_)
    refuse_unservable(engine, workload, cfg)
    if isinstance(engine, LiveEngine):
        return _measure_live(cfg, meta, engine, workload, spec, compute_dtype, work_dir)
    if cfg.run.warmup and not sim:
        # A throwaway engine warms kernels and allocator without priming the measured
        # engine's prefix cache.
        replay(build_engine(factory, ctx, cfg.engine._target_), _warmup_workload(spec), WallClock())
    clock, device_index = (SimClock(), 0) if sim else _wall_clock(cfg)
    sampler = MemorySampler(interval_s=cfg.run.memory_interval_s, device_index=device_index)
    # Simulation samples nothing: the process's memory is the simulator's own, not the
    # modeled GPU's (and a sampling thread only competes for the GIL).
    with contextlib.nullcontext() if sim else sampler:
        raw = _replay(cfg, engine, workload, clock)
    memory = sampler.samples_frame()
    missing = dict(sampler.missing())
    if sim:
        missing = {
            col: "simulation mode: no device memory exists to sample"
            for col in memory.columns
            if col != "t_s"
        }
    meta.update(
        **_replay_meta(workload, raw, spec, compute_dtype),
        missing=missing,
        block_size=None,
        kv_pool_bytes=None,
    )
    meta.update(engine.describe())  # kv_bytes_per_token, kv_pool_bytes, block_size, ...
    summary = summarize_run(
        raw.requests,
        raw.steps,
        meta,
        memory,
        torch_peaks=None if sim else sampler.peaks(),
        workload_requests=workload.requests,
    )
    # Keep only the reasons of metrics that really ended up missing.
    meta["missing"] = dict(summary.missing)
    metrics = dict(summary.metrics)
    if cfg.quality.enabled:
        metrics.update(measure_quality(cfg, model, engine, tokenizer))
    return Measured(metrics, raw, memory)


def _prepare_torch(cfg: DictConfig) -> None:
    """Real mode's process-wide torch settings before anything is built: intra-op threads
    (``run.num_threads``, 0 keeps torch's default) and the global seed. Imports torch;
    simulation never calls it."""
    import torch

    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    torch.manual_seed(cfg.seed)


def _wall_clock(cfg: DictConfig) -> tuple[Clock, int]:
    """Real mode's clock (synchronising CUDA before each read when the run is on a CUDA
    device) and the torch device index whose memory is sampled. Imports torch."""
    import torch

    cuda = cfg.run.device.startswith("cuda") and torch.cuda.is_available()
    clock = WallClock(torch.cuda.synchronize if cuda else None, cuda_events=cuda)
    return clock, torch.device(cfg.run.device).index or 0


def _replay(cfg: DictConfig, engine: Engine, workload: Workload, clock: Clock) -> RawRun:
    """The measured replay of a run (``run.progress``, ``run.stall_steps``), keeping no
    token ids: the frames never need them (millions of simulated requests)."""
    return replay(
        engine,
        workload,
        clock,
        progress=cfg.run.progress,
        max_stall_steps=cfg.run.stall_steps,
        keep_outputs=False,
    )


def _replay_meta(workload: Workload, raw: RawRun, spec: ModelSpec, compute_dtype: str) -> dict[str, Any]:
    """The run.json facts every replay records, live or not: the workload as replayed,
    the replay's duration and step count, and the weights' dtype and bytes. Pure."""
    return {
        "workload": workload.name,
        "workload_source": workload.source,
        "workload_counters": dict(workload.counters),
        "duration_s": raw.duration_s,
        "num_steps": raw.num_steps,
        "weight_dtype": compute_dtype,
        "weight_bytes": weight_bytes(spec, compute_dtype),
        # The schedule ignores the wall clock: every request ready at t = 0, or a closed
        # loop of one (each submission waits for the previous finish; the queue order is
        # fixed). kvbench.compare then judges schedule-derived metrics exactly.
        "clock_free_schedule": bool(
            workload.max_concurrency == 1 or all(r.arrival_s == 0.0 for r in workload.requests)
        ),
    }


def _measure_live(
    cfg: DictConfig,
    meta: dict[str, Any],
    engine: LiveEngine,
    workload: Workload,
    spec: ModelSpec,
    compute_dtype: str,
    work_dir: Path,
) -> Measured:
    """The replay against a live server: open the engine (launching the server when
    configured; ``run.warmup`` sends it one short request), scrape its /metrics around the
    replay, and close it whatever happens (a launched server's process group is killed).
    The server's clock-aligned scrape timeline and log come back with the frames."""
    from kvbench.server_metrics import ServerMetricsScraper

    if cfg.quality.enabled:
        raise ConfigError("quality.enabled: the quality harness runs kvbench's own model, not a live server")
    log_path = work_dir / "server.log"
    try:
        engine.open(log_path, warmup=cfg.run.warmup)
        clock = WallClock()
        scraper = ServerMetricsScraper(
            engine.metrics_url(),
            interval_s=cfg.run.server_metrics_interval_s,
            headers=engine.request_headers(),
            clock=clock.now,
        )
        sampler = MemorySampler(interval_s=cfg.run.memory_interval_s, device_index=0)
        with sampler, scraper:
            raw = _replay(cfg, engine, workload, clock)
        server_failure = engine.server_failure()
    finally:
        engine.close()
    # The client process's memory: the server's is its own (and may be on another host).
    memory = sampler.samples_frame()
    timeline = scraper.frame()
    facts = scraper.server_facts()
    meta.update(
        **_replay_meta(workload, raw, spec, compute_dtype),
        missing={**sampler.missing(), **scraper.missing()},
        kv_pool_bytes=facts.get("kv_cache_memory_bytes"),
        block_size=facts.get("block_size"),
        server_kind=scraper.server_kind,
        server=facts,
    )
    meta.update(engine.describe())  # server URL, served model, client CPU per token, ...
    summary = summarize_run(
        raw.requests,
        raw.steps,
        meta,
        memory,
        workload_requests=workload.requests,
        server_metrics=timeline,
    )
    meta["missing"] = dict(summary.missing)
    return Measured(
        dict(summary.metrics),
        raw,
        memory,
        server_metrics=timeline,
        server_log=engine.server_log_path(),
        server_failure=server_failure,
    )


def measure_quality(
    cfg: DictConfig, model: LlamaModel, engine: Engine, tokenizer: Any | None
) -> dict[str, Any]:
    """Run the quality harness with the engine's single-sequence KV policy.

    Lossy engines expose ``sequence_backend_factory()``; a lossless engine is measured
    with the full cache (perfect scores by construction, the baseline row of a sweep).
    Text: the shipped public-domain passage through the model's tokenizer, or seeded
    random ids for tokenizer-less random-weight models (passkey needs a tokenizer).
    """
    import torch

    from kvbench.quality import (
        FullCacheBackend,
        QualityBackendEngine,
        QualityConfig,
        evaluate_quality,
        load_quality_text,
    )

    options = {k: v for k, v in OmegaConf.to_container(cfg.quality).items() if k != "enabled"}
    options["passkey_depths"] = tuple(options["passkey_depths"]) if tokenizer is not None else ()
    config = QualityConfig(**options)
    spec = model.spec
    limit = min(config.num_text_tokens or spec.max_position_embeddings, spec.max_position_embeddings)
    if tokenizer is not None:
        token_ids = [spec.bos_token_id, *tokenizer.encode(load_quality_text())][:limit]
    else:
        generator = torch.Generator().manual_seed(cfg.seed)
        token_ids = torch.randint(3, spec.vocab_size, (limit,), generator=generator).tolist()
    backend_factory = (
        engine.sequence_backend_factory() if isinstance(engine, QualityBackendEngine) else FullCacheBackend
    )
    report = evaluate_quality(model, backend_factory, token_ids, tokenizer, config, name=engine.name)
    return {k: v for k, v in report.to_dict().items() if k != "quality_backend"}
