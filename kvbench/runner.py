"""Replays a workload's arrivals through an engine and records raw events.

The runner never touches KV blocks and computes no metrics: it feeds requests to the
engine when their arrival time comes, calls ``engine.step()`` until everything is
done, and records when each token, first schedule, finish and rejection happened,
plus every step's statistics. ``kvbench.metrics`` derives everything else.

Two clocks share this loop: a wall clock (real mode; synchronises the device before
every read) and a simulated clock that advances by the cost model's step duration and
jumps over idle gaps (simulation mode).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import operator
import sys
import time
import typing
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Protocol

import numpy as np
import pandas as pd

from kvbench.types import ArrivalAwareEngine, CoveredSteps, Engine, StepOutput, Workload, durations_valid

# A step that schedules nothing, emits nothing and retires nothing is "stuck"; this many
# in a row means the engine cannot make progress and the run fails instead of hanging.
MAX_IDLE_STEPS = 1000

# The stall watchdog's default limit, per workload: this many times the most steps any
# one of its requests needs on an engine of its own. A step that runs a request computes
# at least one of its tokens (a prefill chunk, or one decode token per sample or beam),
# so a request alone finishes within prompt + max_new_tokens steps; the factor leaves
# room for requests sharing the token budget and for recomputation after preemption.
STALL_STEPS_FACTOR = 4


def default_max_stall_steps(workload: Workload) -> int:
    """The stall limit ``replay`` uses for ``workload`` when none is given:
    ``STALL_STEPS_FACTOR`` x the longest prompt + max_new_tokens over its requests, and
    at least ``MAX_IDLE_STEPS``. Pure."""
    longest = max((r.num_prompt_tokens + r.max_new_tokens for r in workload.requests), default=0)
    return max(MAX_IDLE_STEPS, STALL_STEPS_FACTOR * longest)


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the run started."""
        ...

    def wait_until(self, t_s: float) -> None:
        """Block (or jump) until ``now() >= t_s``."""
        ...

    def step_begin(self) -> float:
        """Called right before each engine step; returns the step's start time."""
        ...

    def step_done(self, output: StepOutput) -> list[float]:
        """Called after each engine step; returns the end time of each step the output
        covers, in order (one for a single-step output; the last is the output's end)."""
        ...

    def device_time_s(self) -> float:
        """Device time of the last step from CUDA events; NaN where there are none."""
        ...

    def from_perf_s(self, perf_s: float) -> float:
        """This clock's time of a ``time.perf_counter()`` reading (an event an engine
        observed off the step loop, ``StepOutput.*_perf_s``)."""
        ...


class WallClock:
    """perf_counter time; ``sync`` (e.g. torch.cuda.synchronize) runs before every read.

    With ``cuda_events`` each step is also bracketed by CUDA events, whose elapsed time
    (the device's own view, free of host scheduling noise) is recorded per step.
    """

    def __init__(self, sync: Callable[[], None] | None = None, cuda_events: bool = False) -> None:
        self._sync = sync or (lambda: None)
        self._start = time.perf_counter()
        self._events = None
        if cuda_events:
            import torch

            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def step_begin(self) -> float:
        now = self.now()
        if self._events is not None:
            self._events[0].record()
        return now

    def device_time_s(self) -> float:
        if self._events is None:
            return float("nan")
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3

    def now(self) -> float:
        self._sync()
        return time.perf_counter() - self._start

    @property
    def origin_perf_s(self) -> float:
        """The ``time.perf_counter()`` reading this clock counts from (its time 0)."""
        return self._start

    def from_perf_s(self, perf_s: float) -> float:
        return perf_s - self._start

    def wait_until(self, t_s: float) -> None:
        delay = t_s - self.now()
        if delay > 0:
            time.sleep(delay)

    def step_done(self, output: StepOutput) -> list[float]:
        if output.covered_steps is not None:
            raise RuntimeError("wall clock: a multi-step output (covered_steps) needs the simulation clock")
        if self._events is not None:
            self._events[1].record()
        return [self.now()]


class SimClock:
    """Simulated time: advances by each step's modeled duration, jumps over idle gaps."""

    def __init__(self) -> None:
        self._t = 0.0

    def now(self) -> float:
        return self._t

    def wait_until(self, t_s: float) -> None:
        self._t = max(self._t, t_s)

    def step_begin(self) -> float:
        return self._t

    def device_time_s(self) -> float:
        return float("nan")

    def from_perf_s(self, perf_s: float) -> float:
        raise RuntimeError(
            "simulation clock: the engine reported wall-clock event times (a live engine needs run.mode=real)"
        )

    def step_done(self, output: StepOutput) -> list[float]:
        covered = output.covered_steps
        if covered is not None:
            # Step by step, as single-step outputs would advance it (same float sums).
            ends = []
            t = self._t
            for duration_s in covered.durations_s:
                t += duration_s
                ends.append(t)
            self._t = t
            return ends
        duration_s = output.modeled_duration_s
        if duration_s is None:
            raise RuntimeError(
                "simulation clock: the engine returned no modeled_duration_s (is it in sim mode?)"
            )
        if not durations_valid((duration_s,)):
            raise RuntimeError(
                f"simulation clock: modeled_duration_s must be finite and >= 0, got {duration_s}"
            )
        self._t += duration_s
        return [self._t]


@dataclass
class _RequestLog:
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_samples: int
    tags: dict[str, str]
    first_scheduled_s: float = float("nan")
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    token_times_s: list[float] = field(default_factory=list)
    num_generated_tokens: int = 0
    num_output_tokens: int = 0  # sample 0's, when it finishes
    num_cached_tokens: int | None = 0  # None: the engine does not know (NaN in the frame)
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    peak_kv_slots: int = 0
    peak_kv_slots_unshared: int = 0
    rejected_reason: str = ""


@dataclass(frozen=True)
class RawRun:
    """What one replay recorded (frames as described in kvbench.metrics)."""

    requests: pd.DataFrame
    steps: pd.DataFrame
    duration_s: float
    num_steps: int
    # Request id -> token ids per sample, of the requests that finished; empty when
    # ``replay`` ran with keep_outputs=False.
    outputs: dict[str, tuple[tuple[int, ...], ...]]


STEP_COLUMNS = ("step", "start_s", "end_s", "duration_s", "device_time_s")


@functools.cache
def stats_layout(cls: type) -> tuple[tuple[str, ...], tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    """The steps-frame columns of a StepStats class, their attribute paths, and a getter
    of one row's values.

    Fields holding a dataclass (``kv: KVUsage``) are flattened one level, their columns
    prefixed with the field name (``kv_allocated_bytes``, path ``kv.allocated_bytes``).
    The getter is one ``operator.attrgetter`` over the paths: a C-level read per row,
    since one row is recorded per simulated step (hundreds of thousands for a recorded
    trace). Memoised.
    """
    columns: list[str] = []
    paths: list[str] = []
    hints = typing.get_type_hints(cls)  # annotations are strings (postponed evaluation)
    for f in dataclasses.fields(cls):
        nested = hints.get(f.name)
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            for inner in dataclasses.fields(nested):
                columns.append(f"{f.name}_{inner.name}")
                paths.append(f"{f.name}.{inner.name}")
        else:
            columns.append(f.name)
            paths.append(f.name)
    getter = operator.attrgetter(*paths)
    if len(paths) == 1:
        return tuple(columns), tuple(paths), lambda stats: (getter(stats),)
    return tuple(columns), tuple(paths), getter


# What the progress display calls the replay in this context; None: the workload's name.
# A sweep job sets its position and varied overrides ("run 3/12 \u00b7 engine=paged workload=chat").
PROGRESS_LABEL: ContextVar[str | None] = ContextVar("kvbench_progress_label", default=None)

# Without a terminal, run.progress=auto prints a plain progress line this often (wall time).
PLAIN_PROGRESS_INTERVAL_S = 5.0


class _Progress:
    """Progress of one replay on stderr. ``on``: a rich bar; ``auto``: the bar on a
    terminal, else a plain line every ``interval_s`` of wall time (done/total requests,
    tokens/s on the run's clock, wall time elapsed), so a CI log is never silent for
    long; ``off``: nothing."""

    def __init__(
        self, total: int, mode: str, label: str, interval_s: float = PLAIN_PROGRESS_INTERVAL_S
    ) -> None:
        self._label = PROGRESS_LABEL.get() or label
        self._total = total
        self._interval_s = interval_s
        self._plain = mode == "auto" and not sys.stderr.isatty()
        self._start_s = self._last_line_s = time.monotonic()
        self._bar = None
        if mode == "on" or (mode == "auto" and not self._plain):
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} requests"),
                TextColumn("{task.fields[tok_s]:.0f} tok/s"),
                TimeRemainingColumn(),
                transient=True,
            )
            self._task = self._bar.add_task(self._label, total=total, tok_s=0.0)
            self._bar.start()

    def update(self, done: int, tokens: int, elapsed_s: float) -> None:
        """``done`` requests retired and ``tokens`` generated by ``elapsed_s`` on the run's clock."""
        if self._bar is not None:
            self._bar.update(self._task, completed=done, tok_s=tokens / max(elapsed_s, 1e-9))
        elif self._plain:
            now_s = time.monotonic()
            if now_s - self._last_line_s >= self._interval_s:
                self._last_line_s = now_s
                print(
                    f"kvbench: {self._label}: {done}/{self._total} requests, "
                    f"{tokens / max(elapsed_s, 1e-9):.0f} tok/s, {now_s - self._start_s:.0f} s elapsed",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# Objects allocated between automatic young-generation collections during a replay.
# CPython's default (700) runs a collection every few simulated steps; with millions of
# live objects (token lists, block keys) those collections cost ~15 % of a long
# simulated trace. They still run, ~70x less often; little garbage here is cyclic.
REPLAY_GC_THRESHOLD = 50_000


@contextlib.contextmanager
def _fewer_gc_passes() -> Iterator[None]:
    """Raise the young-generation GC threshold for the duration (restored after)."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], REPLAY_GC_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


@_fewer_gc_passes()
def replay(
    engine: Engine,
    workload: Workload,
    clock: Clock,
    progress: str = "off",
    *,
    max_stall_steps: int | None = None,
    keep_outputs: bool = True,
) -> RawRun:
    """Feed ``workload`` to ``engine`` at its arrival times until every request is done.

    Two watchdogs stop a run that would otherwise spin forever, with a RuntimeError
    naming the engine and its queues: MAX_IDLE_STEPS consecutive steps that schedule,
    emit and retire nothing; and ``max_stall_steps`` consecutive steps (each covered step
    of a multi-step output counts) in which no request finishes or is rejected while the
    engine has work (tokens may flow: an engine that never completes anything).
    ``max_stall_steps=None`` uses ``default_max_stall_steps(workload)``.
    ``keep_outputs=False`` leaves ``RawRun.outputs`` empty: the frames never need the
    token ids, which as Python ints cost ~40 bytes a token (a simulated trace of millions
    of requests would hold gigabytes of stand-in tokens). Mutates the engine (it runs the
    whole workload). Raises ValueError for ``max_stall_steps`` < 1.
    """
    if max_stall_steps is None:
        max_stall_steps = default_max_stall_steps(workload)
    elif isinstance(max_stall_steps, bool) or not isinstance(max_stall_steps, int) or max_stall_steps < 1:
        raise ValueError(f"replay: max_stall_steps must be an int >= 1 or None, got {max_stall_steps!r}")
    pending = deque(sorted(workload.requests, key=lambda r: r.arrival_s))
    num_steps = 0
    logs: dict[str, _RequestLog] = {}
    outputs: dict[str, tuple[tuple[int, ...], ...]] = {}
    steps = StepsRecorder(STEPS_CHUNK)
    covered_tokens = _CoveredTokens(logs)
    bar = _Progress(len(pending), progress, workload.name)
    num_done = num_tokens = idle_steps = stall_steps = 0
    limit = workload.max_concurrency
    # A simulated engine may cover several steps per call, never past the next
    # submission (kvbench.types.ArrivalAwareEngine).
    announce = engine.set_next_arrival_s if isinstance(engine, ArrivalAwareEngine) else None
    try:
        while pending or engine.has_unfinished():
            now = clock.now()
            while pending and pending[0].arrival_s <= now and (limit is None or len(logs) - num_done < limit):
                request = pending.popleft()
                logs[request.request_id] = _RequestLog(
                    request.request_id,
                    # Closed loop: the request arrives when it is submitted.
                    request.arrival_s if limit is None else max(request.arrival_s, now),
                    request.num_prompt_tokens,
                    max(request.n, request.beam_width),
                    dict(request.tags),
                )
                # A prompt computed when read (a trace's) stays so: the engine computes its
                # ids when it needs them (Request.prompt_token_ids).
                engine.add_request(request)
            if not engine.has_unfinished():
                stall_steps = 0  # nothing queued: an idle engine is not stalled
                clock.wait_until(pending[0].arrival_s)
                continue
            if announce is not None:
                # Closed loop at its limit: the next submission waits for a finish, which
                # ends any multi-step run anyway.
                blocked = limit is not None and len(logs) - num_done >= limit
                announce(now, pending[0].arrival_s if pending and not blocked else math.inf)
            start_s = clock.step_begin()
            output = engine.step()
            ends = clock.step_done(output)
            end_s = ends[-1]
            covered = output.covered_steps
            if covered is not None:
                starts = [start_s, *ends[:-1]]
                timing = (
                    range(num_steps, num_steps + len(ends)),
                    starts,
                    ends,
                    list(map(operator.sub, ends, starts)),
                    repeat(math.nan, len(ends)),
                )
                steps.add_covered(timing, covered)
                num_steps += len(ends)
                # Every batch sequence produced one token in each covered step: counted
                # into the request logs when it leaves the batch (or the replay ends).
                covered_tokens.add(covered, ends)
                num_tokens += len(ends) * len(covered.request_ids)
            else:
                steps.add((num_steps, start_s, end_s, end_s - start_s, clock.device_time_s()), output.stats)
                num_steps += 1
            # Engines observing events off the step loop time them themselves.
            sent_perf_s = output.first_scheduled_times_perf_s
            token_perf_s = output.token_times_perf_s
            finish_perf_s = output.finish_times_perf_s
            for index, request_id in enumerate(output.first_scheduled):
                log = logs[request_id]
                if log.first_scheduled_s != log.first_scheduled_s:  # NaN: first time
                    log.first_scheduled_s = (
                        start_s if sent_perf_s is None else clock.from_perf_s(sent_perf_s[index])
                    )
            for index, event in enumerate(output.tokens):
                log = logs[event.request_id]
                token_s = (
                    ends[event.step_offset]
                    if token_perf_s is None
                    else clock.from_perf_s(token_perf_s[index])
                )
                log.num_generated_tokens += 1
                if log.first_token_s != log.first_token_s:
                    log.first_token_s = token_s
                if event.sample_index == 0:
                    log.token_times_s.append(token_s)
            for index, finished in enumerate(output.finished):
                log = logs[finished.request_id]
                log.finish_s = end_s if finish_perf_s is None else clock.from_perf_s(finish_perf_s[index])
                log.num_cached_tokens = finished.num_cached_prompt_tokens
                log.num_preemptions = finished.num_preemptions
                log.num_recomputed_tokens = finished.num_recomputed_tokens
                log.peak_kv_slots = finished.peak_kv_slots
                log.peak_kv_slots_unshared = finished.peak_kv_slots_unshared
                samples = finished.output_token_ids
                log.num_output_tokens = len(samples[0]) if samples else 0
                if keep_outputs:
                    outputs[finished.request_id] = samples
            for rejected in output.rejected:
                logs[rejected.request_id].rejected_reason = rejected.reason
            progressed = (
                output.tokens or output.finished or output.rejected or output.stats.num_scheduled_tokens
            )
            idle_steps = 0 if progressed else idle_steps + 1
            if idle_steps >= MAX_IDLE_STEPS:
                raise RuntimeError(
                    f"engine {engine.name!r} made no progress for {MAX_IDLE_STEPS} steps "
                    f"({output.stats.num_waiting} waiting, {output.stats.num_running} running)"
                )
            num_retired = len(output.finished) + len(output.rejected)
            # Requests retire in a multi-step output's last step only (StepOutput): the
            # steps before it retired nothing.
            stall_steps += len(ends) - 1 if num_retired else len(ends)
            if stall_steps >= max_stall_steps:
                raise RuntimeError(
                    f"engine {engine.name!r} stalled: no request finished or was rejected in the last "
                    f"{stall_steps} steps ({output.stats.num_waiting} waiting, "
                    f"{output.stats.num_running} running; {num_done} of {len(logs)} submitted requests "
                    f"done). The stall limit is {max_stall_steps} steps (default: "
                    f"{STALL_STEPS_FACTOR} x the longest prompt + max_new_tokens of the workload); "
                    "raise it with run.stall_steps (replay's max_stall_steps) if the workload needs longer"
                )
            if num_retired:
                stall_steps = 0
            num_done += num_retired
            num_tokens += len(output.tokens)
            bar.update(num_done, num_tokens, end_s)
    finally:
        bar.close()
    covered_tokens.count()
    duration_s = clock.now()
    return RawRun(
        requests=_requests_frame(logs.values()),
        steps=steps.frame(),
        duration_s=duration_s,
        num_steps=num_steps,
        outputs=outputs,
    )


# A batch sequence as _CoveredTokens keys it: its request id (every sample index of the
# batch is 0) or (request id, sample index).
_SeqKey = str | tuple[str, int]


class _CoveredTokens:
    """The tokens of multi-step outputs, counted into the request logs per stretch of
    consecutive outputs whose batch holds a sequence, instead of a Python pass over each
    output's batch per token: a ShareGPT-like replay covers ~200 sequences per output.

    Nothing reads a log's token counts, first-token time or token times before the
    replay ends. A sequence (sample ``s`` of request ``r``) that is in the batch of
    consecutive outputs k..m produced one token in each of their steps, whose end times
    are one slice of ``_ends_s`` (every covered step's end, in order: a normal step in
    between adds nothing there): ``add`` opens that stretch at output k (the slice's
    start) and closes it at the first output without it (or ``count`` at the end), which
    adds the slice's length to the request's generated tokens, its first end as a
    first-token time (the earliest one counts), and, for sample 0, its ends to the
    request's token times, which stay in time order (the clock never goes back).
    Per output: a set difference with the previous batch, O(batch) in C; per stretch, a
    few Python operations."""

    __slots__ = ("_logs", "_ends_s", "_ids", "_samples", "_keys", "_open")

    def __init__(self, logs: dict[str, _RequestLog]) -> None:
        self._logs = logs  # by request id: every request id of an output is there
        # Every covered step's end (the outputs' own float objects, shared with the logs'
        # token times): 8 bytes a step, next to the steps frame's ~45 columns.
        self._ends_s: list[float] = []
        # The last output's batch: request ids and sample indexes (per sequence), and its
        # sequences' keys: the request id where every sample index is 0 (most batches),
        # else (request id, sample index). A sequence keyed both ways in consecutive
        # outputs closes one stretch and opens another, with the same counts.
        self._ids: tuple[str, ...] = ()
        self._samples: tuple[int, ...] = ()
        self._keys: set[_SeqKey] = set()
        self._open: dict[_SeqKey, int] = {}  # key -> its stretch's start in _ends_s

    def add(self, covered: CoveredSteps, ends: list[float]) -> None:
        """Record ``covered``'s batch, whose steps ended at ``ends`` (one per step, in
        order); counts the stretches it ends into the logs. Mutates itself and the logs."""
        at = len(self._ends_s)
        self._ends_s += ends
        ids, samples = covered.request_ids, covered.sample_indexes
        if ids == self._ids and samples == self._samples:
            return  # the same batch: its stretches go on
        single = samples.count(0) == len(samples)  # (count: a C scan, identity first)
        keys: set[_SeqKey] = set(ids if single else zip(ids, samples))
        if len(keys) != len(ids):
            (request_id, sample), _ = Counter(zip(ids, samples)).most_common(1)[0]
            raise ValueError(
                f"CoveredSteps: sample {sample} of request {request_id!r} has two rows in one "
                "batch (one row per batch sequence)"
            )
        for key in self._keys - keys:
            self._close(key, at)
        self._open.update(dict.fromkeys(keys - self._keys, at))
        self._ids, self._samples, self._keys = ids, samples, keys

    def count(self) -> None:
        """Close every open stretch (the replay ended). Mutates the logs; empties itself."""
        at = len(self._ends_s)
        for key in list(self._open):
            self._close(key, at)
        self._ids, self._samples, self._keys = (), (), set()
        self._ends_s = []

    def _close(self, key: _SeqKey, stop: int) -> None:
        """Count the stretch of ``key`` that ends before ``_ends_s[stop]`` into its log."""
        start = self._open.pop(key)
        request_id, sample = (key, 0) if isinstance(key, str) else key
        log = self._logs[request_id]
        log.num_generated_tokens += stop - start
        first = self._ends_s[start]
        if not first >= log.first_token_s:  # NaN (none yet) or later
            log.first_token_s = first
        if sample == 0:
            covered_times = self._ends_s[start:stop]
            times = log.token_times_s
            if not times:
                log.token_times_s = covered_times
            elif times[-1] <= covered_times[0]:
                times += covered_times
            else:  # token events of a normal step taken while the stretch was open
                # Both lists are in time order: the merge is a sort of two runs.
                log.token_times_s = sorted(times + covered_times)


# Steps gathered as Python values before they become numpy columns: a long simulated
# run holds 8 bytes a cell, not an object a cell, plus at most this many steps' objects.
STEPS_CHUNK = 4096

# What a row holds in a cell whose steps take other values (a covered output's timing and
# varying columns): a bool, the kind int64 and float64 absorb, so the cell adds nothing to
# its column's dtype (see StepsRecorder).
_OVERRIDDEN = False
# The dtypes np.array gives Python bools, ints and floats: of these, np.result_type of two
# parts is the dtype np.array gives their values together.
_PROMOTING = (np.dtype(bool), np.dtype(np.int64), np.dtype(np.float64))


class StepsRecorder:
    """The steps frame, built while the run goes: one row per step, the runner's timing
    columns then the stats' flattened fields (``stats_layout``).

    Steps come as single steps (``add``: a timing row and its stats) and multi-step outputs
    (``add_covered``: timing columns and a CoveredSteps, of which only the stats columns
    are kept, so no output's token rows outlive its step call). Consecutive steps with
    one stats class form a run, whose columns are lists of numpy chunks; runs of
    different classes are aligned by column name at the end. Every ``chunk_steps`` steps
    the pending values become one chunk per column, as ``np.array`` of the column's
    values in step order would build it (int, float and bool promote the same piecewise,
    so ``np.concatenate`` of the chunks gives the whole column).

    Pending steps are kept as rows, each with the number of steps it stands for: a single
    step, or a covered output's template (its stats with the timing and varying cells
    set to ``_OVERRIDDEN``), whose steps' own values of those columns go to per-column
    override lists. One output then costs a row and a few list extends, not a Python
    pass over the ~40 columns; a chunk is built column by column in numpy: the rows'
    values repeated by their counts, the overrides written over their steps, in the dtype
    ``np.result_type`` of the two (an ``_OVERRIDDEN`` cell adds nothing to it) where both
    are what Python bools, ints and floats give (``_PROMOTING``), else through the
    values as objects in step order. Mutates itself.
    """

    def __init__(self, chunk_steps: int = STEPS_CHUNK) -> None:
        self._chunk_steps = chunk_steps
        self._runs: list[tuple[type, list[list[np.ndarray]]]] = []
        self._getter: Callable[[Any], tuple[Any, ...]] = tuple
        self._position: dict[str, int] = {}  # stats attribute path -> column index
        self._width = 0  # columns of the current run
        self._rows: list[Sequence[Any]] = []  # pending rows, full width, in step order
        self._counts: list[int] = []  # steps each pending row stands for
        # Per column: the pending rows whose steps take their own values there, and those
        # values (each such row's steps, in order, one after the other).
        self._override_rows: list[list[int]] = []
        self._override_values: list[list[Any]] = []
        self._num_pending = 0

    def add(self, timing: tuple[Any, ...], stats: Any) -> None:
        """Record one step: ``timing`` holds STEP_COLUMNS' values."""
        self._enter(type(stats))
        self._rows.append(timing + self._getter(stats))
        self._counts.append(1)
        self._count(1)

    def add_covered(self, timing: tuple[Iterable[Any], ...], covered: CoveredSteps) -> None:
        """Record every step of a multi-step output: ``timing`` holds STEP_COLUMNS' values
        as one iterable each, ``len(covered)`` values long. Covered steps take the
        template's value in each column, but where ``covered.columns`` varies it."""
        self._enter(type(covered.template))
        num = len(covered)
        values = self._getter(covered.template)
        varying = covered.columns
        if num == 1 and not varying:
            # One step that is its template (an admission step): the row ``add`` records.
            self._rows.append(tuple([next(iter(step_values)) for step_values in timing]) + values)
            self._counts.append(1)
            self._count(1)
            return
        row = [_OVERRIDDEN] * len(STEP_COLUMNS)
        row += values
        at = len(self._rows)
        override_rows, override_values = self._override_rows, self._override_values
        for index, step_values in enumerate(timing):
            override_rows[index].append(at)
            override_values[index].extend(step_values)
        position = self._position
        for path, step_values in varying.items():
            index = position[path]
            row[index] = _OVERRIDDEN
            override_rows[index].append(at)
            override_values[index].extend(step_values)
        self._rows.append(row)
        self._counts.append(num)
        self._count(num)

    def frame(self) -> pd.DataFrame:
        """The steps frame; empties the recorder (its chunks go as they are joined)."""
        self._flush()
        frames = []
        for cls, chunks in self._runs:
            names = STEP_COLUMNS + stats_layout(cls)[0]
            columns = {}
            for index, name in enumerate(names):
                parts, chunks[index] = chunks[index], []
                columns[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
            # The recorder owns the arrays: no copy (nor the copy into consolidated blocks).
            frames.append(pd.DataFrame(columns, copy=False))
        self._runs = []
        if not frames:
            return pd.DataFrame()
        return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)

    def _enter(self, cls: type) -> None:
        """Make ``cls`` the current run's stats class, starting a run when it changes."""
        if self._runs and self._runs[-1][0] is cls:
            return
        self._flush()
        columns, paths, getter = stats_layout(cls)
        self._width = len(STEP_COLUMNS) + len(columns)
        self._runs.append((cls, [[] for _ in range(self._width)]))
        self._getter = getter
        self._position = {path: index for index, path in enumerate(paths, start=len(STEP_COLUMNS))}
        self._override_rows = [[] for _ in range(self._width)]
        self._override_values = [[] for _ in range(self._width)]

    def _count(self, num_steps: int) -> None:
        self._num_pending += num_steps
        if self._num_pending >= self._chunk_steps:
            self._flush()

    def _flush(self) -> None:
        """Turn the pending rows and overrides into one numpy chunk per column of the
        current run."""
        if not self._num_pending:
            return
        counts = np.array(self._counts, dtype=np.int64)
        repeated = len(self._counts) != self._num_pending  # some row stands for several steps
        first_steps = np.cumsum(counts) - counts  # each row's first step in the chunk
        steps_of: dict[tuple[int, ...], np.ndarray] = {}  # override rows -> their steps
        columns = zip(*self._rows)  # transposed in C
        for chunks, values, rows, overrides in zip(
            self._runs[-1][1], columns, self._override_rows, self._override_values
        ):
            column = np.array(values)
            if repeated:
                column = np.repeat(column, counts, axis=0)
            if rows:
                key = tuple(rows)  # columns overridden in the same rows share the steps
                steps = steps_of.get(key)
                if steps is None:
                    steps = steps_of[key] = _steps_of_rows(first_steps, counts, np.array(rows))
                given = np.array(overrides)
                if column.dtype in _PROMOTING and given.dtype in _PROMOTING:
                    column = column.astype(np.result_type(column, given), copy=False)
                    column[steps] = given
                else:
                    # Another kind (None, a string, a numpy scalar of another width, an int
                    # past int64), where the dtype of the parts may not be the whole's: the
                    # values in step order as objects, then the array np.array makes of them.
                    exact = np.array(values, dtype=object)
                    if repeated:
                        exact = np.repeat(exact, counts)
                    exact[steps] = np.array(overrides, dtype=object)
                    column = np.array(exact.tolist())
            chunks.append(column)
        self._rows = []
        self._counts = []
        self._override_rows = [[] for _ in range(self._width)]
        self._override_values = [[] for _ in range(self._width)]
        self._num_pending = 0


def _steps_of_rows(first_steps: np.ndarray, counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The steps of ``rows`` (ascending row indexes, int64), row after row, given each
    row's first step and step count (int64 [rows]). Pure."""
    row_counts = counts[rows]
    # Per step of the rows: its row's first step, plus its place within the row.
    within = np.arange(int(row_counts.sum())) - np.repeat(np.cumsum(row_counts) - row_counts, row_counts)
    return np.repeat(first_steps[rows], row_counts) + within


def _requests_frame(logs: Iterable[_RequestLog]) -> pd.DataFrame:
    rows = []
    for log in logs:
        row = {
            "request_id": log.request_id,
            "arrival_s": log.arrival_s,
            "first_scheduled_s": log.first_scheduled_s,
            "first_token_s": log.first_token_s,
            "finish_s": log.finish_s,
            "token_times_s": log.token_times_s,
            "num_prompt_tokens": log.num_prompt_tokens,
            "num_output_tokens": log.num_output_tokens,
            "num_generated_tokens": log.num_generated_tokens,
            "num_samples": log.num_samples,
            "num_cached_tokens": math.nan if log.num_cached_tokens is None else log.num_cached_tokens,
            "num_preemptions": log.num_preemptions,
            "num_recomputed_tokens": log.num_recomputed_tokens,
            "peak_kv_slots": log.peak_kv_slots,
            "peak_kv_slots_unshared": log.peak_kv_slots_unshared,
            "rejected_reason": log.rejected_reason,
        }
        row.update({f"tag_{key}": str(value) for key, value in log.tags.items()})
        rows.append(row)
    return pd.DataFrame(rows)
