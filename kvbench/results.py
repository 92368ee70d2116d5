"""Results on disk: one directory per run, written atomically, loaded back as DataFrames.

Layout of ``results/<sweep>/<run>/``::

    requests.parquet   one row per request (token_times_s stays a list column)
    steps.parquet      one row per engine step
    memory.parquet     memory samples (may have no rows)
    server_metrics.parquet  live-server runs only: the scraped /metrics timeline
    server.log         live-server runs only: the launched server's output
    config.yaml        the resolved config the run was made from
    run.json           {"meta": ..., "summary": ..., "missing": ...}; written last
    .kvbench-run       marker: kvbench wrote this directory (see below)

A run directory is built under a hidden temporary name next to its final place and moved
there with ``os.replace``: after a crash either the whole run exists or none of it does.
``run.json`` is the completion marker; ``status`` in its meta is "ok" or "failed".
NaN summary values are stored as JSON ``null`` with the reason in ``missing``.

kvbench deletes or replaces only what it wrote. ``run_id`` and ``sweep_name`` are single
path components (``check_path_component``). An existing directory at a run's path is
replaced only when it is a kvbench run directory (``check_replaceable_run_dir``): it
holds the ``.kvbench-run`` marker, or (runs written before the marker existed) its
run.json is a kvbench record naming this directory as its ``run_id``; in both cases it
holds nothing but the files listed above. Anything else is refused and left untouched.
A rerun swaps the new directory in with one atomic ``renameat2(RENAME_EXCHANGE)`` on
Linux; where that is unavailable the old run is first renamed to a hidden
``.<run>.old-<suffix>`` sibling, and a process killed before the new one takes its place
leaves that sibling, which ``find_runs``, ``load`` and ``is_complete`` read as the run.
The sweep tables (``runs.parquet``, ``runs.csv``) are replaced only in a directory
carrying the ``.kvbench-sweep`` marker, or when the existing file is a kvbench sweep
table (its columns begin with ``run_id`` and include ``run_dir`` and ``status``).
Filesystem failures while writing raise ``ResultsWriteError`` naming the path; the
partial temporary directory is removed.

``load(path)`` accepts one run directory or a sweep directory (any depth; hidden
directories are skipped) and concatenates runs with a ``run_id`` column.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import errno
import functools
import json
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

RUN_FILE = "run.json"
FRAME_NAMES: tuple[str, ...] = ("requests", "steps", "memory")
# Frames only some runs have (``write_run(extra_frames=...)``); ``load`` gives each as a
# Results field of the same name, an empty frame when no run has it.
EXTRA_FRAME_NAMES: tuple[str, ...] = ("server_metrics",)
# Files copied into a run directory as they are (``write_run(attachments=...)``).
ATTACHMENT_NAMES: tuple[str, ...] = ("server.log",)
RUN_MARKER = ".kvbench-run"
RUN_MARKER_TEXT = (
    "kvbench run directory, written by kvbench (kvbench.results.write_run).\n"
    "kvbench replaces this directory when the run is repeated; it never replaces or deletes\n"
    "a directory that lacks this file or holds files kvbench did not write.\n"
)
# Every name kvbench writes into a run directory; a directory holding anything else is not replaced.
RUN_DIR_FILES: frozenset[str] = frozenset(
    {
        RUN_FILE,
        "config.yaml",
        RUN_MARKER,
        *(f"{name}.parquet" for name in (*FRAME_NAMES, *EXTRA_FRAME_NAMES)),
        *ATTACHMENT_NAMES,
    }
)
SWEEP_MARKER = ".kvbench-sweep"
SWEEP_MARKER_TEXT = (
    "kvbench sweep directory. runs.parquet and runs.csv here are kvbench's combined sweep tables,\n"
    "rewritten at the end of every sweep; kvbench never replaces such files without this marker.\n"
)
SWEEP_TABLES: tuple[str, ...] = ("runs.parquet", "runs.csv")
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
    "server": "server",  # a live server's reported KV cache configuration (server_facts)
    "run": "run",  # run options that change what is measured (device, dtype, threads, repeat)
}


# Columns of the runs frame that describe a run's configuration (dotted ones by prefix).
CONFIG_COLUMNS: tuple[str, ...] = ("engine", "mode", "workload", "seed")
CONFIG_PREFIXES: tuple[str, ...] = ("engine.", "model.", "hardware.", "slo.", "run.", "workload_params.")


class ResultsError(ValueError):
    """A results directory that cannot be read; the message names the file."""


class ResultsWriteError(ResultsError):
    """Results that cannot be written where asked: a name that is not one path component, a
    directory kvbench did not write, or a filesystem error. The message names the key or path."""


@dataclass(frozen=True)
class Results:
    """Loaded results. Every frame has a ``run_id`` column.

    ``runs``: one row per run, meta flattened (``engine.block_size``, ``model.name``,
    ``env.git_revision``...) plus every summary metric as a column. ``configs`` maps
    run_id to the run's config.yaml text. ``server_metrics``: the scraped timeline of
    live-server runs (``kvbench.server_metrics``), empty when no run has one.
    """

    runs: pd.DataFrame
    requests: pd.DataFrame
    steps: pd.DataFrame
    memory: pd.DataFrame
    configs: dict[str, str] = field(default_factory=dict)
    server_metrics: pd.DataFrame = field(default_factory=lambda: _concat([]))


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
    extra_frames: Mapping[str, pd.DataFrame] | None = None,
    attachments: Mapping[str, str | os.PathLike[str]] | None = None,
) -> Path:
    """Write one completed run to ``run_dir`` atomically and return its path.

    ``missing`` gives reasons for NaN summary values (``metrics.Summary.missing``); it is
    merged over ``meta["missing"]``. ``extra_frames`` (name in EXTRA_FRAME_NAMES -> frame)
    are written as ``<name>.parquet``; ``attachments`` (name in ATTACHMENT_NAMES -> source
    file) are copied in under that name, with the rest of the run. Replaces an existing
    run directory of the same name (a failed or stale run) only once the new one is fully
    written. Raises ResultsError when meta is not JSON-serialisable, ResultsWriteError
    naming the key for an unknown extra frame or attachment name and naming the source
    when an attachment cannot be copied; frames are not modified.
    """
    run_dir = Path(run_dir)
    reasons = {**(meta.get("missing") or {}), **(missing or {})}
    record = {
        "meta": {**meta, "status": meta.get("status") or "ok", "error": meta.get("error") or ""},
        "summary": {k: _json_number(v) for k, v in summary.items()},
        "missing": {k: str(v) for k, v in reasons.items()},
    }
    frames = {"requests": requests, "steps": steps, "memory": memory, **_extra(extra_frames)}
    return _write_atomically(run_dir, record, frames, config_yaml, _attachments(attachments))


def write_failed_run(
    run_dir: str | os.PathLike[str],
    meta: Mapping[str, Any],
    error: str,
    config_yaml: str = "",
    extra_frames: Mapping[str, pd.DataFrame] | None = None,
    attachments: Mapping[str, str | os.PathLike[str]] | None = None,
) -> Path:
    """Record a run that raised: ``run.json`` with status "failed" and ``error``, none of
    the main frames; what was collected before the failure (``extra_frames``, e.g. the
    server metrics of a server that died) and ``attachments`` (its log) are kept as in
    ``write_run``.

    Atomic like ``write_run``; a failed run is never ``is_complete``, so resume retries it.
    """
    record = {"meta": {**meta, "status": "failed", "error": str(error)}, "summary": {}, "missing": {}}
    return _write_atomically(
        Path(run_dir), record, _extra(extra_frames), config_yaml, _attachments(attachments)
    )


def _extra(extra_frames: Mapping[str, pd.DataFrame] | None) -> dict[str, pd.DataFrame]:
    """``extra_frames`` checked against EXTRA_FRAME_NAMES (a run directory holding any
    other name would no longer be recognised as kvbench's, so reruns could not replace it)."""
    extra = dict(extra_frames or {})
    unknown = sorted(set(extra) - set(EXTRA_FRAME_NAMES))
    if unknown:
        raise ResultsWriteError(
            f"extra_frames: {unknown} not among the frames a run directory holds {list(EXTRA_FRAME_NAMES)}"
        )
    return extra


def _attachments(attachments: Mapping[str, str | os.PathLike[str]] | None) -> dict[str, Path]:
    """``attachments`` checked against ATTACHMENT_NAMES (as ``_extra``), sources as Paths."""
    files = {name: Path(source) for name, source in (attachments or {}).items()}
    unknown = sorted(set(files) - set(ATTACHMENT_NAMES))
    if unknown:
        raise ResultsWriteError(
            f"attachments: {unknown} not among the files a run directory holds {list(ATTACHMENT_NAMES)}"
        )
    return files


def _json_number(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _write_atomically(
    run_dir: Path,
    record: dict[str, Any],
    frames: Mapping[str, pd.DataFrame],
    config_yaml: str,
    attachments: Mapping[str, Path],
) -> Path:
    try:
        record_text = json.dumps(record, indent=2, sort_keys=True, allow_nan=False, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise ResultsError(f"{run_dir / RUN_FILE}: meta/summary is not JSON-serialisable: {exc}") from exc
    prepare_run_dir(run_dir)
    tmp = _sibling(run_dir, "tmp")
    with _writing(run_dir):
        tmp.mkdir()
    try:
        for name, frame in frames.items():
            with _writing(run_dir / f"{name}.parquet"):
                _parquet_safe(frame).to_parquet(tmp / f"{name}.parquet", index=False)
        for name, source in attachments.items():
            try:
                shutil.copyfile(source, tmp / name)
            except OSError as exc:
                raise ResultsWriteError(
                    f"{run_dir / name}: cannot copy {source}: {_os_reason(exc, source)}"
                ) from exc
        with _writing(run_dir / "config.yaml"):
            (tmp / "config.yaml").write_text(config_yaml)
        with _writing(run_dir / RUN_MARKER):
            (tmp / RUN_MARKER).write_text(RUN_MARKER_TEXT)
        with _writing(run_dir / RUN_FILE):
            _write_synced(tmp / RUN_FILE, record_text)  # last: the completion marker
        with _writing(run_dir):
            install_dir(tmp, run_dir)
    finally:
        # The partial run on failure; after an exchange, the replaced run.
        shutil.rmtree(tmp, ignore_errors=True)
    return run_dir


def install_dir(tmp: Path, run_dir: Path) -> None:
    """Move the finished ``tmp`` to ``run_dir``; a replaced directory ends up at ``tmp``
    (the caller removes ``tmp`` afterwards). The caller has checked that ``run_dir`` is
    kvbench's to replace.

    A process killed at any point leaves the old or the new run loadable: the exchange is
    one atomic rename; without it the old run waits under a hidden ``.old-`` name that
    readers fall back to (``_orphaned_run``) until the new one is in place.
    """
    if not os.path.lexists(run_dir):
        os.replace(tmp, run_dir)
        return
    if _exchange(tmp, run_dir):
        return
    # os.replace cannot overwrite a non-empty directory: move the old one aside first.
    old = _sibling(run_dir, "old")
    os.replace(run_dir, old)
    try:
        os.replace(tmp, run_dir)
    except BaseException:
        with contextlib.suppress(OSError):
            os.replace(old, run_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """glibc's renameat2, or None off Linux or on a C library without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (renameat2 RENAME_EXCHANGE).

    False when the platform, kernel or filesystem cannot; other failures raise OSError.
    """
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _sibling(run_dir: Path, kind: str) -> Path:
    """A fresh hidden sibling of ``run_dir``: ``.<name>.<kind>-<suffix>``, the suffix 8 random hex digits (find_runs skips it)."""
    return run_dir.parent / f".{run_dir.name}.{kind}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Turn a filesystem failure while writing ``path`` into a ResultsWriteError naming it."""
    try:
        yield
    except OSError as exc:
        raise ResultsWriteError(f"{path}: cannot write: {_os_reason(exc, path)}") from exc


def _os_reason(exc: OSError, path: Path) -> str:
    """The error's text, naming the file that is in the way of a directory if there is one."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, (NotADirectoryError, FileExistsError)):
        blocker = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
        if blocker is not None and not blocker.is_dir():
            reason += f" ({blocker} is a file, not a directory)"
    return reason


def check_path_component(value: object, key: str) -> str:
    """``value`` as a single directory name, or ResultsWriteError naming ``key``.

    Refused: empty, ``.``, ``..``, a path separator (``/`` or ``\\``), NUL, and hidden names
    (a leading ``.``: kvbench's temporaries are hidden and ``load`` skips hidden directories).
    """
    text = "" if value is None else str(value)
    if text == "":
        problem = "is empty"
    elif text == ".":
        problem = "means the enclosing directory itself"
    elif text == "..":
        problem = "means the parent directory"
    elif "/" in text or "\\" in text:
        problem = "contains a path separator"
    elif "\0" in text:
        problem = "contains a NUL character"
    elif text.startswith("."):
        problem = "starts with '.' (hidden names are kvbench's temporaries and load() skips them)"
    else:
        return text
    raise ResultsWriteError(f"{key}: {text!r} {problem}; it must be a single name (no '/', not '.' or '..')")


def prepare_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Check, before anything is measured, that a run can be written at ``run_dir``.

    Creates the parent directories and proves them writable, restores a run left under a
    hidden ``.old-`` name by a killed writer, and refuses an existing directory kvbench did
    not write (``check_replaceable_run_dir``). Raises
    ResultsWriteError naming the path; moves or deletes nothing of the user's.
    """
    run_dir = Path(run_dir)
    ensure_writable_dir(run_dir.parent)
    orphan = _orphaned_run(run_dir)
    if orphan is not None:
        check_replaceable_run_dir(orphan, run_id=run_dir.name)
        with _writing(run_dir):
            os.replace(orphan, run_dir)
    check_replaceable_run_dir(run_dir)
    return run_dir


def ensure_writable_dir(path: str | os.PathLike[str]) -> Path:
    """Create directory ``path`` (and parents) and prove that entries can be created in it.

    Raises ResultsWriteError naming the path (a file in the way, permission denied, a
    read-only or full filesystem); leaves nothing behind.
    """
    path = Path(path)
    with _writing(path):
        path.mkdir(parents=True, exist_ok=True)
        # mkdir(exist_ok=True) succeeds on an existing read-only directory: probe it.
        probe = path / f".kvbench-probe-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        probe.rmdir()
    return path


def check_replaceable_run_dir(run_dir: str | os.PathLike[str], run_id: str | None = None) -> None:
    """Raise ResultsWriteError unless ``run_dir`` is absent or a run directory kvbench wrote.

    kvbench's own: a directory holding only kvbench's files (``RUN_DIR_FILES``), with the
    ``.kvbench-run`` marker, or, for runs written before the marker existed, a run.json
    whose meta is a kvbench record (status ok/failed) of run ``run_id`` (default: the
    directory's name). Reads only.
    """
    run_dir = Path(run_dir)
    if not os.path.lexists(run_dir):
        return
    refusal = f"{run_dir}: exists and is not a kvbench run directory, so it is left untouched"
    try:
        problem = foreign_dir_problem(run_dir, RUN_DIR_FILES)
    except OSError as exc:
        raise ResultsWriteError(f"{run_dir}: cannot read: {_os_reason(exc, run_dir)}") from exc
    if problem:
        raise ResultsWriteError(f"{refusal} ({problem}); choose another run id or move it away")
    if (run_dir / RUN_MARKER).is_file() or _is_unmarked_run(run_dir, run_id or run_dir.name):
        return
    raise ResultsWriteError(
        f"{refusal} (no {RUN_MARKER} marker and no kvbench run.json of run {run_id or run_dir.name!r}); "
        "choose another run id or move it away"
    )


def foreign_dir_problem(path: Path, own_files: Collection[str]) -> str:
    """Why the existing ``path`` is not a directory of only kvbench's own plain files
    (``own_files`` by name; empty is fine), as a phrase for an error message ("it is a
    symbolic link", "it holds notes.txt, ..."); "" when it is. Reads only; raises OSError
    when the directory cannot be listed."""
    if path.is_symlink() or not path.is_dir():
        return f"it is {'a symbolic link' if path.is_symlink() else 'not a directory'}"
    foreign = sorted(
        p.name for p in path.iterdir() if p.name not in own_files or p.is_symlink() or not p.is_file()
    )
    if not foreign:
        return ""
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return f"it holds {shown}, which kvbench did not write"


def _is_unmarked_run(run_dir: Path, run_id: str) -> bool:
    """A run written before the marker existed: its run.json is a kvbench record of ``run_id``."""
    try:
        record = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return False
    meta = record.get("meta") if isinstance(record, dict) else None
    return isinstance(meta, dict) and meta.get("run_id") == run_id and meta.get("status") in ("ok", "failed")


def _orphaned_run(run_dir: Path) -> Path | None:
    """The run a writer killed mid-replace left at ``.<name>.old-<suffix>`` while ``run_dir`` is missing.

    None when ``run_dir`` exists or no such sibling holds a run.json; the newest one otherwise.
    """
    if os.path.lexists(run_dir):
        return None
    pattern = re.compile(rf"\.{re.escape(run_dir.name)}\.old-[0-9a-f]{{8}}")
    try:
        found = [
            p for p in run_dir.parent.iterdir() if pattern.fullmatch(p.name) and (p / RUN_FILE).is_file()
        ]
    except OSError:
        return None
    return max(found, key=lambda p: (p / RUN_FILE).stat().st_mtime_ns) if found else None


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

    Failed, partial, unreadable or differently-configured runs are not complete. A run left
    under a hidden ``.old-`` name by a writer killed mid-replace counts. Reads only.
    """
    run_dir = Path(run_dir)
    run_dir = _orphaned_run(run_dir) or run_dir
    try:
        record = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return False
    meta = record.get("meta", {})
    frames_present = all((run_dir / f"{name}.parquet").is_file() for name in FRAME_NAMES)
    return meta.get("status") == "ok" and meta.get("config_hash") == config_hash and frames_present


def write_sweep_table(sweep_dir: str | os.PathLike[str]) -> Path:
    """Write the combined ``runs.parquet`` and ``runs.csv`` of every run under ``sweep_dir``.

    Each file is written to a temporary name and renamed. An existing table is replaced only
    when ``sweep_dir`` carries the ``.kvbench-sweep`` marker or the file is a kvbench sweep
    table (``is_sweep_table``); the marker is written with the tables. Returns the parquet
    path; raises ResultsError when no run is found, ResultsWriteError naming the path when a
    file may not or cannot be written.
    """
    sweep_dir = Path(sweep_dir)
    runs = load(sweep_dir).runs
    marker = sweep_dir / SWEEP_MARKER
    if not marker.is_file():
        for path in (sweep_dir / name for name in SWEEP_TABLES):
            if os.path.lexists(path) and not is_sweep_table(path):
                raise ResultsWriteError(
                    f"{path}: exists and is not a kvbench sweep table (no {SWEEP_MARKER} marker in "
                    f"{sweep_dir}), so it is left untouched; move it away or use another run.sweep_name"
                )
        with _writing(marker):
            marker.write_text(SWEEP_MARKER_TEXT)
    target = sweep_dir / "runs.parquet"
    replace_file(target, lambda p: _parquet_safe(runs).to_parquet(p, index=False))
    replace_file(sweep_dir / "runs.csv", lambda p: runs.to_csv(p, index=False))
    return target


def replace_file(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Write a file atomically: ``write(tmp)`` to a hidden sibling, then rename it to ``path``.

    The caller decides whether an existing ``path`` may be replaced. Raises
    ResultsWriteError naming ``path`` on a filesystem failure, with the temporary removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with _writing(path):
            write(tmp)
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return path


def is_sweep_table(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a runs.parquet / runs.csv written by ``write_sweep_table``
    (columns begin with ``run_id`` and include ``run_dir`` and ``status``). Reads only."""
    path = Path(path)
    try:
        if path.suffix == ".parquet":
            names = list(pq.read_schema(path).names)
        else:
            with open(path, newline="") as f:
                names = next(csv.reader(f), [])
    except (OSError, ValueError, csv.Error, pa.ArrowException):
        return False
    return path.is_file() and bool(names) and names[0] == "run_id" and {"run_dir", "status"} <= set(names)


# --------------------------------------------------------------------------- reading
def find_runs(path: str | os.PathLike[str]) -> list[Path]:
    """Run directories at or under ``path`` (those with a run.json), sorted; hidden ones skipped,
    except a run left under ``.<name>.old-<suffix>`` by a writer killed mid-replace while
    ``<name>`` is missing."""
    path = Path(path)
    path = _orphaned_run(path) or path
    if (path / RUN_FILE).is_file():
        return [path]
    found = []
    for marker in path.rglob(RUN_FILE):
        run_dir = marker.parent
        parts = run_dir.relative_to(path).parts
        if not any(part.startswith(".") for part in parts):
            found.append(run_dir)
        elif parts and not any(part.startswith(".") for part in parts[:-1]):
            # A run a killed writer left under ``.<name>.old-…`` while <name> is missing.
            match = re.fullmatch(r"\.(.+)\.old-[0-9a-f]{8}", parts[-1])
            if match and _orphaned_run(run_dir.parent / match.group(1)) == run_dir:
                found.append(run_dir)
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
    appear in ``runs`` (status "failed", error) with no rows in the main frames (extra
    frames keep what was collected before the failure). Reads only.
    Raises ResultsError when ``path`` holds no run or a file is unreadable.
    """
    path = Path(path)
    run_dirs = find_runs(path)
    if not run_dirs:
        raise ResultsError(f"{path}: no kvbench runs found (no {RUN_FILE} at or below it)")
    rows, configs = [], {}
    frames: dict[str, list[pd.DataFrame]] = {name: [] for name in (*FRAME_NAMES, *EXTRA_FRAME_NAMES)}
    for run_dir in run_dirs:
        record = read_record(run_dir)
        row = run_row(record)
        run_id = str(row.get("run_id") or run_dir.name)
        row["run_id"] = run_id
        row["run_dir"] = str(run_dir)
        rows.append(row)
        config_path = run_dir / "config.yaml"
        configs[run_id] = config_path.read_text() if config_path.is_file() else ""
        for name in frames:
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
        server_metrics=_concat(frames["server_metrics"]),
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
# The presets a user picks by name; a column that varies only together with them (a
# workload preset's derived workload_params.*, an engine preset's defaults) is not a choice.
PRESET_COLUMNS: dict[str, str] = {
    "engine": "engine",
    "workload": "workload",
    "model.name": "model",
    "hardware.name": "hardware",
    "mode": "run.mode",
}
# A job's repeat index (``run.repeat``): repeats of one configuration share its label.
REPEAT_COLUMN = "run.repeat"
# Config-column prefixes as the override a user types: workload_params.x is workload.x.
_OVERRIDE_PREFIXES: tuple[tuple[str, str], ...] = (
    ("workload_params.", "workload."),
    ("engine.", "engine."),
    ("model.", "model."),
    ("hardware.", "hardware."),
    ("run.", "run."),
    ("slo.", "slo."),
)


def config_columns(runs: pd.DataFrame) -> list[str]:
    """Columns of ``runs`` that describe configuration (engine, engine.*, model.*, ...)."""
    return [c for c in runs.columns if c in CONFIG_COLUMNS or c.startswith(CONFIG_PREFIXES)]


def varying_config_columns(runs: pd.DataFrame) -> list[str]:
    """Config columns whose value differs between runs (what a sweep varied, repeats included)."""
    return [c for c in config_columns(runs) if runs[c].map(plain_value).nunique(dropna=False) > 1]


def label_columns(runs: pd.DataFrame) -> list[str]:
    """The config columns that name what the user chose between runs: the presets that
    differ (engine, workload, model.name, hardware.name, mode), then every other column
    that differs between runs of the same presets (an override typed for the sweep, e.g.
    ``engine.block_size`` or ``seed``). Columns that only follow a preset (the ~30
    ``workload_params.*`` of four workload presets) and the repeat index are left out."""
    varying = [c for c in varying_config_columns(runs) if c != REPEAT_COLUMN]
    presets = [c for c in PRESET_COLUMNS if c in runs]
    text = runs[varying].map(plain_value) if varying else runs.iloc[:, :0]
    if presets:
        groups = runs[presets].map(plain_value).apply(tuple, axis=1)
    else:
        groups = pd.Series([()] * len(runs), index=runs.index)
    chosen = [c for c in varying if c in PRESET_COLUMNS]
    for c in varying:
        if c not in PRESET_COLUMNS and (text[c].groupby(groups).nunique(dropna=False) > 1).any():
            chosen.append(c)
    return chosen


def label_names(columns: list[str]) -> dict[str, str]:
    """How each label column is written in a label: presets by their group name
    (``model``), other columns without their section (``block_size``), or as the typed
    override (``engine.block_size``) where two short names would clash."""
    short = {c: PRESET_COLUMNS.get(c, "").split(".")[-1] or _without_section(c) for c in columns}
    clashing = {name for name in short.values() if list(short.values()).count(name) > 1}
    return {c: (_override_key(c) if short[c] in clashing else short[c]) for c in columns}


def _without_section(column: str) -> str:
    for prefix, _ in _OVERRIDE_PREFIXES:
        if column.startswith(prefix):
            return column[len(prefix) :]
    return column


def _override_key(column: str) -> str:
    """The Hydra override key of a config column: workload_params.x -> workload.x, mode -> run.mode."""
    if column in PRESET_COLUMNS:
        return PRESET_COLUMNS[column]
    for prefix, typed in _OVERRIDE_PREFIXES:
        if column.startswith(prefix):
            return typed + column[len(prefix) :]
    return column


def configuration_keys(runs: pd.DataFrame) -> pd.Series:
    """One key per run naming its configuration pool: the repeats of one configuration
    (the same config columns, ``run.repeat`` aside, and distinct repeat indices) share a
    key; every other run gets its own (the same configuration run twice without repeats,
    e.g. two sweeps loaded together, stays two runs)."""
    columns = [c for c in config_columns(runs) if c != REPEAT_COLUMN]
    config = runs[columns].map(plain_value).apply("|".join, axis=1) if columns else runs["run_id"].astype(str)
    keys = config.copy()
    repeat = runs[REPEAT_COLUMN].map(plain_value) if REPEAT_COLUMN in runs else None
    for key, members in config.groupby(config).groups.items():
        pooled = repeat is not None and (repeat[members] != "").all() and repeat[members].is_unique
        if not pooled and len(members) > 1:
            keys[members] = [f"{key}|{run_id}" for run_id in runs.loc[members, "run_id"].astype(str)]
    return keys


def run_labels(runs: pd.DataFrame, sep: str = " ") -> pd.Series:
    """A readable label per run from what the user chose (``label_columns``), e.g.
    "workload=chat prefix_cache=radix"; parts joined by ``sep``.

    Repeats of one configuration share its label. Falls back to run_id when nothing was
    chosen; configurations that would share a label get their first run id appended.
    """
    columns = label_columns(runs)
    names = label_names(columns)
    keys = configuration_keys(runs)
    first_run = runs["run_id"].astype(str).groupby(keys).transform("first")
    if columns:
        labels = pd.Series(
            [
                sep.join(f"{names[c]}={plain_value(row[c])}" for c in columns if plain_value(row[c]) != "")
                or str(first)
                for (_, row), first in zip(runs.iterrows(), first_run)
            ],
            index=runs.index,
        )
    else:
        labels = first_run.copy()
    # Distinct configurations behind one label: tell them apart by their first run id.
    clash = labels.groupby(labels).transform(lambda group: keys[group.index].nunique() > 1)
    return labels.where(~clash.astype(bool), labels + " [" + first_run + "]")


def plain_value(value: Any) -> str:
    """A config value as text, with 16.0 -> "16" (concat turns int columns with gaps into floats)
    and None/NaN -> ""."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
