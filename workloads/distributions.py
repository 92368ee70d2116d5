"""Length distributions and arrival processes for synthetic workloads.

Both come as small frozen dataclasses with a ``sample``/``times`` method, and a parser
that turns a config mapping (``{kind: uniform, low: 32, high: 256}``, as Hydra passes
it) or a plain int (a fixed length) into one, naming the field on bad input.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvbench.workloads.errors import TraceError, WorkloadConfigError
from kvbench.workloads.trace_formats import MAX_TRACE_TOKENS
from kvbench.workloads.trace_io import check_utf8, open_text

# --------------------------------------------------------------------------- lengths


@runtime_checkable
class LengthDist(Protocol):
    """A distribution of token counts. ``draw`` returns raw values (maybe non-integer,
    maybe out of range); ``sample_lengths`` rounds and clips them."""

    min_len: int
    max_len: int | None

    def draw(self, rng: np.random.Generator, num: int) -> np.ndarray: ...


@dataclass(frozen=True)
class FixedLength:
    value: int
    min_len: int = 1
    max_len: int | None = None

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(self.value >= 1, "value", f"must be >= 1, got {self.value}")

    def draw(self, rng: np.random.Generator, num: int) -> np.ndarray:
        return np.full(num, self.value, dtype=np.int64)


@dataclass(frozen=True)
class UniformLength:
    """Integers uniform on ``[low, high]``, both ends included."""

    low: int
    high: int
    min_len: int = 1
    max_len: int | None = None

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(self.low >= 1, "low", f"must be >= 1, got {self.low}")
        _require(self.high >= self.low, "high", f"must be >= low={self.low}, got {self.high}")

    def draw(self, rng: np.random.Generator, num: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=num, dtype=np.int64)


@dataclass(frozen=True)
class NormalLength:
    """Normal with ``mean`` and ``std`` tokens, rounded, clipped to ``[min_len, max_len]``."""

    mean: float
    std: float
    min_len: int = 1
    max_len: int | None = None

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(self.mean > 0, "mean", f"must be > 0, got {self.mean}")
        _require(self.std >= 0, "std", f"must be >= 0, got {self.std}")

    def draw(self, rng: np.random.Generator, num: int) -> np.ndarray:
        return rng.normal(self.mean, self.std, size=num)


@dataclass(frozen=True)
class LogNormalLength:
    """Log-normal with the given ``mean`` (in tokens) and log-space ``sigma``.

    Parametrised by the mean rather than log-space mu because the mean is what a user
    knows about a workload: mu = ln(mean) - sigma^2 / 2.
    """

    mean: float
    sigma: float
    min_len: int = 1
    max_len: int | None = None

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(self.mean > 0, "mean", f"must be > 0, got {self.mean}")
        _require(self.sigma >= 0, "sigma", f"must be >= 0, got {self.sigma}")

    def draw(self, rng: np.random.Generator, num: int) -> np.ndarray:
        mu = math.log(self.mean) - self.sigma**2 / 2
        return rng.lognormal(mu, self.sigma, size=num)


@dataclass(frozen=True)
class EmpiricalLength:
    """Resamples (with replacement) a list of observed lengths, e.g. read from a file."""

    values: tuple[int, ...]
    min_len: int = 1
    max_len: int | None = None

    def __post_init__(self) -> None:
        _check_bounds(self)
        _require(len(self.values) > 0, "values", "must not be empty")
        _require(min(self.values) >= 1, "values", f"must all be >= 1, got {min(self.values)}")

    def draw(self, rng: np.random.Generator, num: int) -> np.ndarray:
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=num, replace=True)

    @classmethod
    def from_file(
        cls, path: str | Path, column: str | None = None, min_len: int = 1, max_len: int | None = None
    ) -> EmpiricalLength:
        """Read lengths from ``path`` (``.gz`` allowed): one int per line (``#`` comments and
        blank lines ignored) or, with ``column``, that column of a CSV with a header.
        Raises TraceError naming the line for a value that is not a positive int (at most
        MAX_TRACE_TOKENS) or a byte that is not UTF-8."""
        values: list[int] = []
        with open_text(path) as handle:
            if column is None:
                for line_no, line in enumerate(handle, start=1):
                    check_utf8(path, line_no, line)
                    text = line.split("#", 1)[0].strip()
                    if text:
                        values.append(_positive_int(text, path, line_no, "length"))
            else:
                reader = csv.DictReader(handle)
                if reader.fieldnames is None or column not in reader.fieldnames:
                    raise TraceError(path, 1, column, f"no such column (header: {reader.fieldnames})")
                for row in reader:
                    values.append(_positive_int(row[column], path, reader.line_num, column))
        if not values:
            raise TraceError(path, 0, column or "length", "no lengths in file (empty)")
        return cls(tuple(values), min_len=min_len, max_len=max_len)


def _positive_int(text: str | None, path: str | Path, line_no: int, field: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise TraceError(path, line_no, field, f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise TraceError(path, line_no, field, f"must be >= 1, got {value}")
    if value > MAX_TRACE_TOKENS:
        raise TraceError(path, line_no, field, f"must be <= {MAX_TRACE_TOKENS}, got {value}")
    return value


def sample_lengths(dist: LengthDist, rng: np.random.Generator, num: int) -> tuple[np.ndarray, int]:
    """Draw ``num`` lengths, rounded and clipped to ``[min_len, max_len]``.

    Returns ``(lengths int64 [num], num_clipped)``; the count is reported in the
    workload's counters so that clipping a wide distribution is never silent.
    """
    raw = np.rint(dist.draw(rng, num)).astype(np.int64)
    upper = dist.max_len if dist.max_len is not None else np.iinfo(np.int64).max
    clipped = np.clip(raw, dist.min_len, upper)
    return clipped, int(np.count_nonzero(clipped != raw))


# --------------------------------------------------------------------------- arrivals


@runtime_checkable
class ArrivalProcess(Protocol):
    """Arrival times in seconds from the start, non-decreasing, the first at 0."""

    def times(self, rng: np.random.Generator, num: int) -> np.ndarray: ...

    def request_tags(self) -> dict[str, str]:
        """Tags every request carries (closed loop: its concurrency), else empty."""
        ...


@dataclass(frozen=True)
class OfflineArrivals:
    """Everything at t = 0 (an offline batch)."""

    def times(self, rng: np.random.Generator, num: int) -> np.ndarray:
        return np.zeros(num)

    def request_tags(self) -> dict[str, str]:
        return {}


@dataclass(frozen=True)
class GammaArrivals:
    """Renewal process with gamma inter-arrival gaps: mean gap 1/rate, CV 1/sqrt(burstiness).

    ``burstiness = 1`` is Poisson; below 1 is burstier, above 1 more regular (vLLM's
    benchmark convention: shape = burstiness, scale = 1 / (rate * burstiness)).
    """

    rate_per_s: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        _require(self.rate_per_s > 0, "rate_per_s", f"must be > 0, got {self.rate_per_s}")
        _require(self.burstiness > 0, "burstiness", f"must be > 0, got {self.burstiness}")

    def times(self, rng: np.random.Generator, num: int) -> np.ndarray:
        gaps = rng.gamma(self.burstiness, 1.0 / (self.rate_per_s * self.burstiness), size=num)
        gaps[:1] = 0.0  # the first request opens the run
        return np.cumsum(gaps)

    def request_tags(self) -> dict[str, str]:
        return {}


@dataclass(frozen=True)
class RampArrivals:
    """Rate rising (or falling) linearly with the request index from start to end rate.

    Request i's gap is drawn at rate ``start + (end - start) * i / (num - 1)``, as in
    vLLM's linear ramp-up; ``burstiness`` shapes the gaps as in GammaArrivals.
    """

    start_rate_per_s: float
    end_rate_per_s: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        for name in ("start_rate_per_s", "end_rate_per_s", "burstiness"):
            value = getattr(self, name)
            _require(value > 0, name, f"must be > 0, got {value}")

    def times(self, rng: np.random.Generator, num: int) -> np.ndarray:
        rates = np.linspace(self.start_rate_per_s, self.end_rate_per_s, num)
        gaps = rng.gamma(self.burstiness, 1.0, size=num) / (rates * self.burstiness)
        gaps[:1] = 0.0
        return np.cumsum(gaps)

    def request_tags(self) -> dict[str, str]:
        return {}


@dataclass(frozen=True)
class ClosedLoopArrivals:
    """A fixed number of requests in flight: all are ready at t = 0 and each request
    carries ``tags['max_concurrency']`` so the runner admits a new one only when one
    finishes (arrival times cannot express completion-driven load)."""

    concurrency: int

    def __post_init__(self) -> None:
        _require(self.concurrency >= 1, "concurrency", f"must be >= 1, got {self.concurrency}")

    def times(self, rng: np.random.Generator, num: int) -> np.ndarray:
        return np.zeros(num)

    def request_tags(self) -> dict[str, str]:
        return {"max_concurrency": str(self.concurrency)}


# --------------------------------------------------------------------------- parsing

_LENGTH_KINDS: dict[str, type] = {
    "fixed": FixedLength,
    "uniform": UniformLength,
    "normal": NormalLength,
    "lognormal": LogNormalLength,
    "empirical": EmpiricalLength,
}

_ARRIVAL_KINDS: dict[str, type] = {
    "offline": OfflineArrivals,
    "poisson": GammaArrivals,  # with burstiness 1 (exponential gaps)
    "gamma": GammaArrivals,
    "ramp": RampArrivals,
    "closed_loop": ClosedLoopArrivals,
}


def length_dist(spec: LengthDist | Mapping[str, Any] | int, field: str) -> LengthDist:
    """A LengthDist from an int (fixed), a mapping with ``kind``, or a LengthDist.

    ``{kind: empirical, path: FILE[, column: NAME]}`` reads lengths from a file. Raises
    WorkloadConfigError whose message starts with ``field``.
    """
    if isinstance(spec, bool):
        raise WorkloadConfigError(f"{field}: expected an int or a mapping with 'kind', got {spec!r}")
    if isinstance(spec, int):
        return _build(FixedLength, {"value": spec}, field)
    if not isinstance(spec, Mapping):
        if isinstance(spec, LengthDist):
            return spec
        raise WorkloadConfigError(
            f"{field}: expected an int, a mapping with 'kind', or a LengthDist (min_len, max_len "
            f"and draw), got {spec!r}"
        )
    params = dict(spec)
    kind = params.pop("kind", None)
    if kind not in _LENGTH_KINDS:
        raise WorkloadConfigError(f"{field}.kind: expected one of {sorted(_LENGTH_KINDS)}, got {kind!r}")
    if kind == "empirical":
        if "path" in params:
            path = params.pop("path")
            _check_keys(params, {"column", "min_len", "max_len"}, field)
            return EmpiricalLength.from_file(path, **params)
        if "values" in params:
            params["values"] = tuple(int(v) for v in params["values"])
    return _build(_LENGTH_KINDS[kind], params, field)


def arrival_process(
    spec: ArrivalProcess | Mapping[str, Any] | str | None, field: str = "arrival"
) -> ArrivalProcess:
    """An ArrivalProcess from a mapping with ``kind`` (offline, poisson, gamma, ramp,
    closed_loop), a bare kind name, None (offline) or an ArrivalProcess."""
    if spec is None:
        return OfflineArrivals()
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, Mapping):
        if isinstance(spec, ArrivalProcess):
            return spec
        raise WorkloadConfigError(
            f"{field}: expected a mapping with 'kind', a kind name, or an ArrivalProcess (times "
            f"and request_tags), got {spec!r}"
        )
    params = dict(spec)
    kind = params.pop("kind", None)
    if kind not in _ARRIVAL_KINDS:
        raise WorkloadConfigError(f"{field}.kind: expected one of {sorted(_ARRIVAL_KINDS)}, got {kind!r}")
    if kind == "poisson":
        _check_keys(params, {"rate_per_s"}, field)
    return _build(_ARRIVAL_KINDS[kind], params, field)


def _build(cls: type, params: dict[str, Any], field: str) -> Any:
    """``cls(**params)`` with config errors prefixed by ``field``."""
    _check_keys(params, {f.name for f in fields(cls)}, field)
    for f in fields(cls):
        if f.default is MISSING and f.name not in params:
            raise WorkloadConfigError(f"{field}.{f.name}: required")
    try:
        return cls(**params)
    except WorkloadConfigError as exc:
        raise WorkloadConfigError(f"{field}.{exc}") from None


def _check_keys(params: Mapping[str, Any], allowed: set[str], field: str) -> None:
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise WorkloadConfigError(f"{field}.{unknown[0]}: unknown parameter (allowed: {sorted(allowed)})")


def _check_bounds(dist: LengthDist) -> None:
    _require(dist.min_len >= 1, "min_len", f"must be >= 1, got {dist.min_len}")
    if dist.max_len is not None:
        _require(
            dist.max_len >= dist.min_len, "max_len", f"must be >= min_len={dist.min_len}, got {dist.max_len}"
        )


def _require(ok: bool, name: str, problem: str) -> None:
    """Validation inside the dataclasses; ``_build`` prefixes the config path."""
    if not ok:
        raise WorkloadConfigError(f"{name}: {problem}")
