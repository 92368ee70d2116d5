"""Background sampling of process and device memory while a benchmark runs.

``MemorySampler`` is a context manager owning one thread that, every ``interval_s``,
asks each probe for its metrics and appends one row. Probes are small objects with
one job each (process RSS, NVML device memory, torch allocator); a probe that cannot
measure on this machine is still present and yields NaN, and says why in
``missing()``. Unmeasurable is always NaN, never 0.

    with MemorySampler(start_s=run_start_s) as sampler:
        run_benchmark()
    frame = sampler.samples_frame()   # t_s, rss_bytes, nvml_used_bytes, ...
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pandas as pd

COLUMNS = (
    "t_s",
    "rss_bytes",
    "nvml_used_bytes",
    "nvml_process_bytes",
    "torch_allocated_bytes",
    "torch_reserved_bytes",
)
NAN = float("nan")


class Probe(Protocol):
    """One source of memory figures.

    ``metrics`` names the columns it fills. ``read()`` returns a value (bytes, float)
    per metric, NaN where it could not measure, and must not raise. ``reasons()``
    maps each metric that has been NaN to why. ``close()`` releases resources.
    """

    metrics: tuple[str, ...]

    def read(self) -> dict[str, float]: ...

    def reasons(self) -> dict[str, str]: ...

    def close(self) -> None: ...


@runtime_checkable
class PeakProbe(Probe, Protocol):
    """A Probe that also keeps peaks between reads (the allocator's high-water marks):
    ``peaks()`` maps run-summary names to values, read once when sampling stops. Must
    not raise."""

    def peaks(self) -> dict[str, float]: ...


class _ProbeBase:
    """Shared bookkeeping: remembers the first reason each metric went unmeasured."""

    metrics: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._reasons: dict[str, str] = {}

    def _missing(self, reason: str, metrics: Sequence[str] | None = None) -> dict[str, float]:
        """NaN for ``metrics`` (default: all of this probe's), remembering ``reason``."""
        names = self.metrics if metrics is None else tuple(metrics)
        for metric in names:
            self._reasons.setdefault(metric, reason)
        return dict.fromkeys(names, NAN)

    def reasons(self) -> dict[str, str]:
        return dict(self._reasons)

    def close(self) -> None:
        return None


class RssProbe(_ProbeBase):
    """Resident set size of this process: /proc/self/statm, else psutil, else NaN."""

    metrics = ("rss_bytes",)

    def __init__(self, statm_path: Path = Path("/proc/self/statm")) -> None:
        super().__init__()
        self._statm_path = statm_path
        self._page_bytes = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._psutil_process: Any | None = None
        self._unavailable: str | None = None
        if not statm_path.exists():
            try:
                import psutil
            except ImportError:
                self._unavailable = f"{statm_path} does not exist and psutil is not installed"
            else:
                self._psutil_process = psutil.Process()

    def read(self) -> dict[str, float]:
        if self._unavailable is not None:
            return self._missing(self._unavailable)
        try:
            if self._psutil_process is not None:
                return {"rss_bytes": float(self._psutil_process.memory_info().rss)}
            # statm fields are in pages: size resident shared text lib data dt.
            resident_pages = int(self._statm_path.read_text().split()[1])
            return {"rss_bytes": float(resident_pages * self._page_bytes)}
        except (OSError, ValueError, IndexError) as exc:
            return self._missing(f"reading RSS failed: {exc}")


class NvmlProbe(_ProbeBase):
    """Device used memory and this process's usage from NVML (nvidia-ml-py).

    ``nvml_used_bytes`` is the whole device (all processes, plus the driver's own
    reservation); ``nvml_process_bytes`` is this PID's entry in the device's compute
    process list, NaN when NVML does not list it (e.g. a container PID namespace).
    Initialises NVML in the constructor and shuts it down in ``close()``.
    """

    metrics = ("nvml_used_bytes", "nvml_process_bytes")

    def __init__(self, device_index: int = 0) -> None:
        super().__init__()
        self._pynvml: Any | None = None
        self._handle: Any | None = None
        self._unavailable: str | None = None
        self._pid = os.getpid()
        try:
            import pynvml
        except ImportError:
            self._unavailable = "nvidia-ml-py (pynvml) is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            # No driver: NVMLError_LibraryNotFound. Record the class name: its str()
            # alone ("NVML Shared Library Not Found") does not say it is NVML's error.
            self._unavailable = f"nvmlInit failed: {type(exc).__name__}: {exc}"
            return
        self._pynvml = pynvml
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(_nvml_index(device_index))
        except pynvml.NVMLError as exc:
            self._unavailable = f"no NVML handle for device {device_index}: {exc}"

    def read(self) -> dict[str, float]:
        if self._unavailable is not None or self._pynvml is None:
            return self._missing(self._unavailable or "NVML not initialised")
        nvml = self._pynvml
        values: dict[str, float] = {}
        try:
            values["nvml_used_bytes"] = float(nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        except nvml.NVMLError as exc:
            values.update(self._missing(f"nvmlDeviceGetMemoryInfo failed: {exc}", ["nvml_used_bytes"]))
        try:
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except nvml.NVMLError as exc:
            values.update(
                self._missing(f"nvmlDeviceGetComputeRunningProcesses failed: {exc}", ["nvml_process_bytes"])
            )
            return values
        own = [p.usedGpuMemory for p in processes if p.pid == self._pid]
        if own and own[0] is not None:
            values["nvml_process_bytes"] = float(own[0])
        else:
            reason = (
                f"pid {self._pid} not in NVML's compute process list "
                "(no CUDA context yet, or a container PID namespace)"
            )
            values.update(self._missing(reason, ["nvml_process_bytes"]))
        return values

    def close(self) -> None:
        if self._pynvml is not None:
            # A failed shutdown leaves nothing for this probe to release.
            with contextlib.suppress(self._pynvml.NVMLError):
                self._pynvml.nvmlShutdown()
            self._pynvml = None


def _nvml_index(torch_device_index: int) -> int:
    """NVML index of a torch device: NVML ignores CUDA_VISIBLE_DEVICES, torch does not."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return torch_device_index
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if torch_device_index < len(entries) and entries[torch_device_index].isdigit():
        return int(entries[torch_device_index])
    return torch_device_index  # UUID / MIG entries: fall back to the same index


class TorchCudaProbe(_ProbeBase):
    """torch's caching allocator: bytes allocated to tensors and reserved from the driver.

    Samples are instantaneous; ``peaks()`` adds torch's own maxima, which catch spikes
    between samples. NaN with a reason when CUDA is unavailable. Constructing it
    resets torch's peak statistics for the device (process-wide torch state).
    """

    metrics = ("torch_allocated_bytes", "torch_reserved_bytes")

    def __init__(self, device_index: int = 0) -> None:
        super().__init__()
        import torch

        self._torch = torch
        self._device = device_index
        self._available = torch.cuda.is_available()
        if self._available:
            torch.cuda.reset_peak_memory_stats(device_index)

    def read(self) -> dict[str, float]:
        if not self._available:
            return self._missing("torch.cuda.is_available() is False")
        cuda = self._torch.cuda
        return {
            "torch_allocated_bytes": float(cuda.memory_allocated(self._device)),
            "torch_reserved_bytes": float(cuda.memory_reserved(self._device)),
        }

    def peaks(self) -> dict[str, float]:
        """torch's max allocated / reserved bytes since construction; NaN without CUDA."""
        if not self._available:
            return {"torch_allocated_bytes": NAN, "torch_reserved_bytes": NAN}
        cuda = self._torch.cuda
        return {
            "torch_allocated_bytes": float(cuda.max_memory_allocated(self._device)),
            "torch_reserved_bytes": float(cuda.max_memory_reserved(self._device)),
        }


def default_probes(device_index: int = 0) -> list[Probe]:
    """RSS, NVML and torch-CUDA probes for ``device_index`` (each NaN where unsupported)."""
    return [RssProbe(), NvmlProbe(device_index), TorchCudaProbe(device_index)]


class MemorySampler:
    """Samples memory every ``interval_s`` on a background thread while in a ``with`` block.

    ``start_s`` is the time origin on ``clock`` (default ``time.perf_counter``); rows
    carry ``t_s = clock() - start_s`` so they line up with the caller's other records.
    None means "the moment sampling starts". One row is taken on entry and one on exit,
    so even a block shorter than ``interval_s`` has two rows.

    Mutates only its own rows; the thread is joined on exit, also when the block
    raises. A sampler runs once: entering it again raises RuntimeError.
    """

    def __init__(
        self,
        start_s: float | None = None,
        interval_s: float = 0.05,
        device_index: int = 0,
        probes: Sequence[Probe] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.device_index = device_index
        self._start_s = start_s
        self._clock = clock
        self._probes: list[Probe] | None = list(probes) if probes is not None else None
        self._rows: list[dict[str, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._peaks: dict[str, float] = {}
        self._used = False

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> MemorySampler:
        """Create the probes (unless given), take the first row and start the thread."""
        if self._used:
            raise RuntimeError("MemorySampler: already started; create a new sampler per run")
        self._used = True
        if self._probes is None:
            self._probes = default_probes(self.device_index)
        if self._start_s is None:
            self._start_s = self._clock()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="kvbench-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and join the thread, take a last row, close the probes. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._sample()
        for probe in self._probes or ():
            if isinstance(probe, PeakProbe):
                self._peaks.update(probe.peaks())
            probe.close()
        if self._thread_error is not None:
            raise RuntimeError("MemorySampler: sampling thread failed") from self._thread_error

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- sampling ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            # wait() returns True as soon as stop() sets the event, so exit is prompt.
            while not self._stop.wait(self.interval_s):
                self._sample()
        except BaseException as exc:  # re-raised by stop() in the caller's thread
            self._thread_error = exc

    def _sample(self) -> None:
        assert self._start_s is not None and self._probes is not None
        row = dict.fromkeys(COLUMNS, NAN)
        row["t_s"] = self._clock() - self._start_s
        for probe in self._probes:
            row.update(probe.read())
        with self._lock:
            self._rows.append(row)

    # -- results -----------------------------------------------------------------
    def samples_frame(self) -> pd.DataFrame:
        """Rows so far as a DataFrame with COLUMNS, float64, NaN where unmeasurable.

        Safe to call while running (returns a copy of the rows taken so far).
        """
        with self._lock:
            rows = list(self._rows)
        return pd.DataFrame(rows, columns=list(COLUMNS), dtype="float64")

    def missing(self) -> dict[str, str]:
        """Metric -> reason for every metric that was NaN in at least one row."""
        reasons: dict[str, str] = {}
        for probe in self._probes or ():
            reasons.update(probe.reasons())
        return reasons

    def peaks(self) -> dict[str, float]:
        """Per column (except t_s), the largest sampled value, raised to torch's own
        allocator maxima where known (they see spikes between samples). NaN if never
        measured. Complete after stop()."""
        frame = self.samples_frame()
        result: dict[str, float] = {}
        for column in COLUMNS[1:]:
            series = frame[column].dropna()
            sampled = float(series.max()) if not series.empty else NAN
            exact = self._peaks.get(column, NAN)
            values = [v for v in (sampled, exact) if not math.isnan(v)]
            result[column] = max(values) if values else NAN
        return result
