"""Results on disk: one directory per run, written atomically, loaded back as DataFrames.

Layout of ``results/<sweep>/<run>/``::

    requests.parquet   one row per request (token_times_s stays a list column)
    steps.parquet      one row per engine step
    memory.parquet     memory samples (may have no rows)
    config.yaml        the resolved config the run was made from
    run.json           {"meta": ..., "summary": ..., "missing": ...}; written last

A run directory is built under a hidden temporary name next to its final place and moved
there with ``os.replace``: after a crash either the whole run exists or none of it does.
``run.json`` is the completion marker; ``status`` in its meta is "ok" or "failed".
NaN summary values are stored as JSON ``null`` with the reason in ``missing``.

``load(path)`` accepts one run directory or a sweep directory (any depth; hidden
directories are skipped) and concatenates runs with a ``run_id`` column.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

RUN_FILE = "run.json"
FRAME_NAMES: tuple[str, ...] = ("requests", "steps", "memory")
# meta entries that are dicts, flattened into "<prefix>.<key>" columns of the runs frame.
FLATTENED_META: dict[str, str] = {
    "engine_params": "engine",
    "model": "model",
    "hardware": "hardware",
    "slo": "slo",
    "workload_counters": "workload",
    "workload_params": "workload_params",
    "environment": "env",
    "missing": "missing",
}


# Columns of the runs frame that describe a run's configuration (dotted ones by prefix).
CONFIG_COLUMNS: tuple[str, ...] = ("engine", "mode", "workload", "seed")
CONFIG_PREFIXES: tuple[str, ...] = ("engine.", "model.", "hardware.", "slo.", "run.", "workload_params.")


class ResultsError(ValueError):
    """A results directory that cannot be read; the message names the file."""


@dataclass(frozen=True)
class Results:
    """Loaded results. Every frame has a ``run_id`` column.

    ``runs``: one row per run, meta flattened (``engine.block_size``, ``model.name``,
    ``env.git_revision``...) plus every summary metric as a column. ``configs`` maps
    run_id to the run's config.yaml text.
    """

    runs: pd.DataFrame
    requests: pd.DataFrame
    steps: pd.DataFrame
    memory: pd.DataFrame
    configs: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- writing
def write_run(
    run_dir: str | os.PathLike[str],
    requests: pd.DataFrame,
    steps: pd.DataFrame,
    memory: pd.DataFrame,
    meta: Mapping[str, Any],
    config_yaml: str,
    summary: Mapping[str, float],
    missing: Mapping[str, str] | None = None,
) -> Path:
    """Write one completed run to ``run_dir`` atomically and return its path.

    ``missing`` gives reasons for NaN summary values (``metrics.Summary.missing``); it is
    merged over ``meta["missing"]``. Replaces an existing run directory of the same name
    (a failed or stale run) only once the new one is fully written. Raises ResultsError
    when meta is not JSON-serialisable; frames are not modified.
    """
    run_dir = Path(run_dir)
    reasons = {**(meta.get("missing") or {}), **(missing or {})}
    record = {
        "meta": {**meta, "status": meta.get("status") or "ok", "error": meta.get("error") or ""},
        "summary": {k: _json_number(v) for k, v in summary.items()},
        "missing": {k: str(v) for k, v in reasons.items()},
    }
    frames = {"requests": requests, "steps": steps, "memory": memory}
    return _write_atomically(run_dir, record, frames, config_yaml)


def write_failed_run(
    run_dir: str | os.PathLike[str],
    meta: Mapping[str, Any],
    error: str,
    config_yaml: str = "",
) -> Path:
    """Record a run that raised: ``run.json`` with status "failed" and ``error``, no frames.

    Atomic like ``write_run``; a failed run is never ``is_complete``, so resume retries it.
    """
    record = {"meta": {**meta, "status": "failed", "error": str(error)}, "summary": {}, "missing": {}}
    return _write_atomically(Path(run_dir), record, {}, config_yaml)


def _json_number(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _write_atomically(
    run_dir: Path, record: dict[str, Any], frames: Mapping[str, pd.DataFrame], config_yaml: str
) -> Path:
    try:
        record_text = json.dumps(record, indent=2, sort_keys=True, allow_nan=False, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise ResultsError(f"{run_dir / RUN_FILE}: meta/summary is not JSON-serialisable: {exc}") from exc
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = run_dir.parent / f".{run_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name, frame in frames.items():
            _parquet_safe(frame).to_parquet(tmp / f"{name}.parquet", index=False)
        (tmp / "config.yaml").write_text(config_yaml)
        _write_synced(tmp / RUN_FILE, record_text)  # last: the completion marker
        if run_dir.exists():
            # os.replace cannot overwrite a non-empty directory: move the old one aside first.
            old = run_dir.parent / f".{run_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(run_dir, old)
            os.replace(tmp, run_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run_dir


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _json_default(value: Any) -> Any:
    # numpy scalars and paths show up in meta built from configs.
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def _parquet_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy whose object columns pyarrow can store: mixed scalar types become strings.

    List columns (token_times_s) are kept as lists.
    """
    fixes = {}
    for name in frame.columns:
        column = frame[name]
        if column.dtype != object:
            continue
        kinds = {type(v) for v in column if v is not None and not (isinstance(v, float) and math.isnan(v))}
        if any(issubclass(k, (list, tuple)) for k in kinds) or len(kinds) <= 1:
            continue
        fixes[name] = column.map(lambda v: None if v is None else str(v))
    return frame.assign(**fixes) if fixes else frame


def is_complete(run_dir: str | os.PathLike[str], config_hash: str) -> bool:
    """True when ``run_dir`` holds a finished "ok" run made from ``config_hash`` (resume).

    Failed, partial, unreadable or differently-configured runs are not complete. Reads only.
    """
    run_dir = Path(run_dir)
    try:
        record = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return False
    meta = record.get("meta", {})
    frames_present = all((run_dir / f"{name}.parquet").is_file() for name in FRAME_NAMES)
    return meta.get("status") == "ok" and meta.get("config_hash") == config_hash and frames_present


def write_sweep_table(sweep_dir: str | os.PathLike[str]) -> Path:
    """Write the combined ``runs.parquet`` and ``runs.csv`` of every run under ``sweep_dir``.

    Each file is written to a temporary name and renamed. Returns the parquet path;
    raises ResultsError when no run is found.
    """
    sweep_dir = Path(sweep_dir)
    runs = load(sweep_dir).runs
    target = sweep_dir / "runs.parquet"
    for path, writer in (
        (target, lambda p: _parquet_safe(runs).to_parquet(p, index=False)),
        (sweep_dir / "runs.csv", lambda p: runs.to_csv(p, index=False)),
    ):
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        writer(tmp)
        os.replace(tmp, path)
    return target


# --------------------------------------------------------------------------- reading
def find_runs(path: str | os.PathLike[str]) -> list[Path]:
    """Run directories at or under ``path`` (those with a run.json), sorted; hidden ones skipped."""
    path = Path(path)
    if (path / RUN_FILE).is_file():
        return [path]
    found = []
    for marker in path.rglob(RUN_FILE):
        relative = marker.parent.relative_to(path)
        if not any(part.startswith(".") for part in relative.parts):
            found.append(marker.parent)
    return sorted(found)


def read_record(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed run.json of one run; raises ResultsError naming the file when unreadable."""
    path = Path(run_dir) / RUN_FILE
    try:
        record = json.loads(path.read_text())
    except OSError as exc:
        raise ResultsError(f"{path}: cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
    if not isinstance(record, dict) or "meta" not in record:
        raise ResultsError(f"{path}: not a kvbench run record (no 'meta' key)")
    return record


def run_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """One runs-frame row from a run record: meta flattened plus summary metrics (None -> NaN)."""
    row: dict[str, Any] = {}
    for key, value in record["meta"].items():
        prefix = FLATTENED_META.get(key)
        if prefix is not None and isinstance(value, Mapping):
            _flatten(value, prefix, row)
        elif isinstance(value, (list, tuple, Mapping)):
            row[key] = json.dumps(value, sort_keys=True)
        else:
            row[key] = value
    for key, value in record.get("summary", {}).items():
        row[key] = math.nan if value is None else value
    for key, value in record.get("missing", {}).items():
        row[f"missing.{key}"] = value
    return row


def _flatten(value: Mapping[str, Any], prefix: str, row: dict[str, Any]) -> None:
    for key, item in value.items():
        name = f"{prefix}.{key}"
        if isinstance(item, Mapping):
            _flatten(item, name, row)
        elif isinstance(item, (list, tuple)):
            row[name] = json.dumps(item)
        else:
            row[name] = item


def load(path: str | os.PathLike[str]) -> Results:
    """Load one run directory or every run under a sweep directory.

    Frames of several runs are concatenated with a leading ``run_id`` column; failed runs
    appear in ``runs`` (status "failed", error) with no rows elsewhere. Reads only.
    Raises ResultsError when ``path`` holds no run or a file is unreadable.
    """
    path = Path(path)
    run_dirs = find_runs(path)
    if not run_dirs:
        raise ResultsError(f"{path}: no kvbench runs found (no {RUN_FILE} at or below it)")
    rows, configs = [], {}
    frames: dict[str, list[pd.DataFrame]] = {name: [] for name in FRAME_NAMES}
    for run_dir in run_dirs:
        record = read_record(run_dir)
        row = run_row(record)
        run_id = str(row.get("run_id") or run_dir.name)
        row["run_id"] = run_id
        row["run_dir"] = str(run_dir)
        rows.append(row)
        config_path = run_dir / "config.yaml"
        configs[run_id] = config_path.read_text() if config_path.is_file() else ""
        for name in FRAME_NAMES:
            file = run_dir / f"{name}.parquet"
            if file.is_file():
                frames[name].append(_read_frame(file, run_id))
    runs = pd.DataFrame(rows)
    runs = runs[["run_id", *[c for c in runs.columns if c != "run_id"]]]
    return Results(
        runs=runs,
        requests=_concat(frames["requests"]),
        steps=_concat(frames["steps"]),
        memory=_concat(frames["memory"]),
        configs=configs,
    )


def _read_frame(file: Path, run_id: str) -> pd.DataFrame:
    try:
        frame = pd.read_parquet(file)
    except Exception as exc:  # pyarrow raises several unrelated types for corrupt files
        raise ResultsError(f"{file}: unreadable parquet: {exc}") from exc
    frame = frame.drop(columns="run_id", errors="ignore")
    if "token_times_s" in frame:
        # pyarrow hands back numpy arrays; lists keep the frame's documented shape.
        frame = frame.assign(
            token_times_s=[list(map(float, v)) if v is not None else [] for v in frame["token_times_s"]]
        )
    return frame.assign(run_id=run_id)[["run_id", *frame.columns]]


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    non_empty = [f for f in frames if len(f)]
    if non_empty:
        return pd.concat(non_empty, ignore_index=True)
    return frames[0].iloc[0:0] if frames else pd.DataFrame({"run_id": pd.Series([], dtype=str)})


# --------------------------------------------------------------------------- run labels
def config_columns(runs: pd.DataFrame) -> list[str]:
    """Columns of ``runs`` that describe configuration (engine, engine.*, model.*, ...)."""
    return [c for c in runs.columns if c in CONFIG_COLUMNS or c.startswith(CONFIG_PREFIXES)]


def varying_config_columns(runs: pd.DataFrame) -> list[str]:
    """Config columns whose value differs between runs (what a sweep varied)."""
    return [c for c in config_columns(runs) if runs[c].map(plain_value).nunique(dropna=False) > 1]


def run_labels(runs: pd.DataFrame) -> pd.Series:
    """A unique readable label per run from its varying config values, e.g. "engine=paged block_size=16".

    Falls back to run_id when nothing varies; duplicates get their run_id appended.
    """
    varying = varying_config_columns(runs)
    if varying:
        labels = pd.Series(
            [
                " ".join(
                    f"{c.split('.')[-1]}={plain_value(row[c])}" for c in varying if plain_value(row[c]) != ""
                )
                for _, row in runs.iterrows()
            ],
            index=runs.index,
        )
    else:
        labels = runs["run_id"].astype(str)
    duplicated = labels.duplicated(keep=False)
    return labels.where(~duplicated, labels + " [" + runs["run_id"].astype(str) + "]")


def plain_value(value: Any) -> str:
    """A config value as text, with 16.0 -> "16" (concat turns int columns with gaps into floats)
    and None/NaN -> ""."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
