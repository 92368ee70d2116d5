"""The records that flow between stages: workloads -> engines -> runner -> metrics.

Everything here is a frozen dataclass with units in field names. Engines and
workloads import these types; the core never imports a specific engine or workload.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from kvbench.records import frozen_record
from kvbench.specs import HardwareSpec, ModelSpec


# --------------------------------------------------------------------------- workloads
@runtime_checkable
class ComputedTokenIds(Protocol):
    """Prompt token ids computed when read instead of held: a recorded trace's prompts,
    whose ids follow from a few keys per prompt (the full Mooncake replay's 145M ids
    would hold 0.6 GB as int32 all the run through, and first touching that memory costs
    more CPU than computing the ids).

    ``len`` is free. ``ids()`` returns them all as a new read-only 1-D numpy integer array,
    the same ids every call; indexing and slicing read them through it and ``np.asarray``
    gives them too. Pure.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: Any) -> Any: ...

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray: ...

    def ids(self) -> np.ndarray: ...


def is_computed_token_ids(prompt: object) -> bool:
    """Whether ``prompt``'s class implements ``ComputedTokenIds``: ``issubclass`` of its
    type, which the ABC machinery caches per class (about 0.2 us a call; the engine asks
    once per request of a trace). ``isinstance``'s runtime check costs about 6 us in
    Python 3.11 (a hasattr per member) and would also accept an instance that sets a
    member its class lacks as its own attribute. Pure."""
    return issubclass(type(prompt), ComputedTokenIds)


def durations_valid(durations_s: Sequence[float]) -> bool:
    """Whether every one of ``durations_s`` (at least one) is finite and >= 0: simulated
    time never goes back. ``min`` catches a negative one, the sum a NaN or an infinite
    one (both C loops). Pure."""
    return min(durations_s) >= 0.0 and sum(durations_s) < math.inf


@dataclass(frozen=True, eq=False)
class Request:
    """One user request as a workload produces it.

    ``n > 1`` asks for n parallel samples that share the prompt (best-of-n);
    ``beam_width > 1`` asks for beam search. ``ignore_eos`` (the benchmark default)
    makes the output length exactly ``max_new_tokens``.

    ``prompt_token_ids`` is a tuple of ints, or, for very large traces (the full Mooncake
    replay holds 145M prompt tokens: ~5 GB as Python ints, 0.6 GB as int32), a read-only
    1-D numpy integer array, or ``ComputedTokenIds`` (ids computed when read). Consumers
    index, slice and take ``len`` of it; those that need Python ints call ``.tolist()`` on
    a slice (or ``list(...)``). An engine reads ``ComputedTokenIds`` ids when it needs
    them (``np.asarray``, ``with_prompt_in_memory()``) and holds them only while it holds
    the request, later than queueing where it can (the scheduler's ``ArrayTokenIds``
    computes them when the request is first matched or scheduled), so a trace's prompts
    exist only while their requests are in flight. ``==`` compares prompts by their token
    ids whichever form they take.
    Requests are not hashable.
    """

    request_id: str
    arrival_s: float
    prompt_token_ids: Sequence[int]  # tuple[int, ...], a read-only numpy int array or ComputedTokenIds
    max_new_tokens: int
    n: int = 1
    beam_width: int = 1
    priority: int = 0  # lower is more important (vLLM's convention)
    cache_salt: str | None = None
    ignore_eos: bool = True
    # 0 is greedy. Parallel samples (n > 1) need > 0 to differ; beam search ignores it.
    temperature: float = 0.0
    # Free-form labels: workload kind, conversation id, turn, passkey depth, ...
    tags: Mapping[str, str] = field(default_factory=dict)
    # Tokens a correct model should produce (passkey answers); empty when not scored.
    expected_output_token_ids: tuple[int, ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def with_prompt_in_memory(self) -> Request:
        """This request with its prompt's ids held: itself unless the prompt is
        ``ComputedTokenIds``, else a copy whose prompt is their read-only array. Pure."""
        prompt = self.prompt_token_ids
        if is_computed_token_ids(prompt):
            return replace(self, prompt_token_ids=prompt.ids())
        return self

    def __eq__(self, other: object) -> bool:
        # The generated __eq__ compares field tuples, and numpy's elementwise == of two
        # array prompts has no single truth value; compare prompts by their ids instead.
        if not isinstance(other, Request):
            return NotImplemented
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "prompt_token_ids" and any(
                isinstance(prompt, np.ndarray) or is_computed_token_ids(prompt) for prompt in (mine, theirs)
            ):
                if not np.array_equal(np.asarray(mine), np.asarray(theirs)):
                    return False
            elif mine != theirs:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # as before: the tags mapping was never hashable


@dataclass(frozen=True)
class Workload:
    """A seeded list of requests sorted by arrival, plus what was changed to make it.

    ``counters`` reports every truncation, cap and skip (for example
    ``{"num_skipped_invalid": 2, "num_prompts_truncated": 5}``) so nothing is
    silently dropped; the runner stores them with the run.
    """

    name: str
    requests: tuple[Request, ...]
    source: str = "synthetic"
    counters: Mapping[str, int] = field(default_factory=dict)
    # Closed loop: at most this many requests in flight; the runner submits the next
    # waiting request (its arrival becomes the submit time) when one finishes.
    max_concurrency: int | None = None


# --------------------------------------------------------------------------- engines
@frozen_record
class KVUsage:
    """A KV manager's memory at one instant, in bytes of the (simulated) device pool.

    ``allocated_bytes = token_bytes + reserved_unused_bytes + internal_frag_bytes``:
    token state actually written, slots reserved for tokens the sequence will still
    produce, and slots allocated that it never will (partial blocks, over-reservation).
    ``external_frag_bytes`` is free memory that no waiting request can use (slab holes).
    Prefix-cache blocks no live sequence owns are ``cached_bytes`` (reclaimable, so not
    counted as allocated). Block counts are 0 for managers without blocks.
    """

    capacity_bytes: int
    allocated_bytes: int
    token_bytes: int
    reserved_unused_bytes: int = 0
    internal_frag_bytes: int = 0
    external_frag_bytes: int = 0
    cached_bytes: int = 0
    host_bytes: int = 0  # KV resident in the host tier (offload, swap)
    num_blocks_total: int = 0
    num_blocks_in_use: int = 0
    num_blocks_cached_free: int = 0
    num_blocks_free: int = 0


@frozen_record
class StepStats:
    """What one engine iteration did. Counts are for this step only."""

    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    kv: KVUsage
    num_swapped: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_evicted_blocks: int = 0  # prefix-cache evictions to make room
    num_evicted_tokens: int = 0  # lossy eviction (H2O, streaming)
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    modeled_transfer_s: float = 0.0  # host transfer time from the PCIe model (labelled modeled)
    # The step's composition as the cost model reads it (kvbench.sim.cost_model.StepShape),
    # so calibration fits measured step times against the shapes simulation will price:
    # sequences with a prefill chunk, causal (query, key) pairs of those chunks, KV tokens
    # they read (cached prefix + chunk), and decode context (each decoding sequence's
    # length including the token decoded). 0 with tokens of that kind means not recorded.
    num_prefill_seqs: int = 0
    num_prefill_attention_pairs: int = 0
    num_prefill_context_tokens: int = 0
    num_decode_context_tokens: int = 0
    # Offload: recall of the true top attention tokens among host-resident ones that the
    # fetch picked, and the copy time measured on CUDA (side stream events). NaN when
    # nothing was fetched / measured this step (never 0 for "not measured").
    fetch_recall: float = float("nan")
    num_fetched_entries: int = 0
    measured_transfer_s: float = float("nan")


class TokenEvent(NamedTuple):
    """A token produced this step for sample ``sample_index`` of ``request_id``.

    ``step_offset`` places it in a multi-step output: the token was produced by covered
    step ``step_offset`` (0 for single-step outputs; see ``CoveredSteps.tokens``).
    A NamedTuple (immutable like a frozen dataclass, ~3x cheaper to build): simulation
    emits one per generated token, millions for a recorded trace.
    """

    request_id: str
    sample_index: int
    token_id: int
    step_offset: int = 0


@frozen_record
class FinishedRequest:
    """A request the engine retired this step, with per-request engine counters."""

    request_id: str
    output_token_ids: tuple[tuple[int, ...], ...]  # one tuple per sample / beam
    # None: unknown (a live server that does not report it), never 0 for unknown.
    num_cached_prompt_tokens: int | None = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    # Peak KV token slots this request's sequences held at once (sharing counted once).
    peak_kv_slots: int = 0
    # The same without sharing (sum over samples of their own length): what sharing saved.
    peak_kv_slots_unshared: int = 0


@dataclass(frozen=True)
class RejectedRequest:
    request_id: str
    reason: str


_INT64_MAX = np.iinfo(np.int64).max


@frozen_record(eq=False)  # __eq__ below: the token array compares by value
class CoveredSteps:
    """The iterations a multi-step ``StepOutput`` covers, column-wise: a simulated decode
    run, a fixed batch in which every sequence produces one token per step.

    Step ``i`` took ``durations_s[i]`` (modeled). Its stats are ``template`` with each
    field named in ``columns`` replaced by ``columns[path][i]``; a dotted path names a
    field of a nested record (``kv.token_bytes``). Its tokens: one per batch sequence,
    ``token_ids[j, i]`` for sample ``sample_indexes[j]`` of ``request_ids[j]`` (int64
    [batch sequence, step]; the record keeps a read-only copy of what it is given).
    Column-wise because one StepStats and one TokenEvent per token cost more than
    simulating the step (a recorded trace covers hundreds of thousands of steps).
    Durations are finite and >= 0 (simulated time never goes back); the batch's
    ``request_ids`` and ``sample_indexes`` are kept as tuples, one distinct (request,
    sample) pair per row (the runner checks distinctness, where it builds their set).
    """

    durations_s: tuple[float, ...]
    template: StepStats
    columns: Mapping[str, Sequence[Any]]
    request_ids: tuple[str, ...]
    sample_indexes: tuple[int, ...]
    token_ids: np.ndarray  # int64 [batch sequence, step]

    def __post_init__(self) -> None:
        num_steps = len(self.durations_s)
        if num_steps == 0:
            raise ValueError("CoveredSteps: no step (a single step is a plain StepOutput)")
        if not durations_valid(self.durations_s):
            raise ValueError(f"CoveredSteps: durations_s must be finite and >= 0, got {self.durations_s}")
        # tuple() of a tuple is the same object: no copy in the common case.
        object.__setattr__(self, "request_ids", tuple(self.request_ids))
        object.__setattr__(self, "sample_indexes", tuple(self.sample_indexes))
        for path, values in self.columns.items():
            if len(values) != num_steps:
                raise ValueError(
                    f"CoveredSteps: column {path!r} has {len(values)} values for {num_steps} steps"
                )
        shape = (len(self.request_ids), num_steps)
        try:
            given = np.asarray(self.token_ids)
        except (ValueError, OverflowError):  # ragged rows, or an id beyond 64 bits
            given = None
        # Integer ids only: an int64 copy would truncate floats and wrap big uint64s.
        if (
            given is not None
            and given.size
            and (given.dtype.kind not in "iu" or (given.dtype.kind == "u" and given.max() > _INT64_MAX))
        ):
            raise ValueError(f"CoveredSteps: token ids must be int64 integers, got {given.dtype}")
        tokens = None if given is None else np.array(given, dtype=np.int64)  # a copy: the record's own
        if tokens is not None and tokens.size == 0:
            tokens = tokens.reshape(0, num_steps)  # no row at all
        if tokens is None or tokens.shape != shape or len(self.sample_indexes) != shape[0]:
            raise ValueError(
                f"CoveredSteps: every token row needs {num_steps} tokens, one row (and one sample "
                f"index) per request id ({shape[0]})"
            )
        tokens.flags.writeable = False
        object.__setattr__(self, "token_ids", tokens)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CoveredSteps):
            return NotImplemented
        return (
            self.durations_s == other.durations_s
            and self.template == other.template
            and self.columns == other.columns
            and self.request_ids == other.request_ids
            and self.sample_indexes == other.sample_indexes
            and np.array_equal(self.token_ids, other.token_ids)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable-looking fields (columns, an array)

    def __len__(self) -> int:
        return len(self.durations_s)

    def stats(self, index: int) -> StepStats:
        """Step ``index``'s StepStats (one object; the runner reads the columns instead)."""
        changes: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {}
        for path, values in self.columns.items():
            outer, _, inner = path.partition(".")
            if inner:
                nested.setdefault(outer, {})[inner] = values[index]
            else:
                changes[outer] = values[index]
        for outer, inner_changes in nested.items():
            changes[outer] = replace(getattr(self.template, outer), **inner_changes)
        return replace(self.template, **changes)

    def tokens(self) -> list[TokenEvent]:
        """Every token as a TokenEvent, step by step (``step_offset`` = step index)."""
        rows = self.token_ids.tolist()
        return [
            TokenEvent(request_id, sample, row[step], step)
            for step in range(len(self))
            for request_id, sample, row in zip(self.request_ids, self.sample_indexes, rows)
        ]


@frozen_record
class StepOutput:
    """What one ``Engine.step`` call did: normally one engine iteration.

    Multi-step outputs (simulation fast-forward): a simulated engine may cover several
    consecutive decode iterations in one call. Then ``covered_steps`` describes every
    iteration in order, column-wise, with their tokens (the runner records one steps row
    each and times each token at the end of its step); ``tokens`` is empty, ``stats`` is
    the last covered step's and ``modeled_duration_s`` their sum. Requests finish only in
    the last covered step (the runner times them at its end), and with more than one
    covered step nothing is scheduled first or rejected and ``tokens`` is empty (a single
    covered step may carry all three, as a plain step does). None: a single step.
    """

    tokens: tuple[TokenEvent, ...]
    first_scheduled: tuple[str, ...]
    finished: tuple[FinishedRequest, ...]
    rejected: tuple[RejectedRequest, ...]
    stats: StepStats
    # Simulation mode: the cost model's duration of this step. None for real engines,
    # whose step time the runner reads from the clock.
    modeled_duration_s: float | None = None
    covered_steps: CoveredSteps | None = None
    # Engines that observe events off the step loop (a live server's stream): when each
    # event happened, as time.perf_counter() readings taken on receipt; the runner maps
    # them to its clock (Clock.from_perf_s). Readings, not runner times, because such an
    # engine is built before the runner's clock starts. ``token_times_perf_s[i]`` times
    # ``tokens[i]``, ``first_scheduled_times_perf_s[i]`` ``first_scheduled[i]`` (the
    # request was sent), ``finish_times_perf_s[i]`` ``finished[i]``. None: at the step's
    # end (its start for first_scheduled), as for every engine that computes in ``step``.
    token_times_perf_s: tuple[float, ...] | None = None
    first_scheduled_times_perf_s: tuple[float, ...] | None = None
    finish_times_perf_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for times, events, name in (
            (self.token_times_perf_s, self.tokens, "token_times_perf_s"),
            (self.first_scheduled_times_perf_s, self.first_scheduled, "first_scheduled_times_perf_s"),
            (self.finish_times_perf_s, self.finished, "finish_times_perf_s"),
        ):
            if times is not None and len(times) != len(events):
                raise ValueError(f"StepOutput: {name} has {len(times)} times for {len(events)} events")

    @property
    def num_steps(self) -> int:
        """Engine iterations this output covers (1 unless multi-step)."""
        return len(self.covered_steps) if self.covered_steps is not None else 1


@dataclass(frozen=True)
class EngineContext:
    """What every engine is built from (engine configs are Hydra partials taking it).

    ``model`` is the torch decoder (kvbench.model.LlamaModel) in real mode and None in
    simulation mode, where engines must not touch tensors.
    """

    spec: ModelSpec
    hardware: HardwareSpec
    model: Any | None
    device: str = "cpu"
    kv_dtype: str = "fp32"
    seed: int = 0
    mode: str = "real"


@runtime_checkable
class Engine(Protocol):
    """An inference engine driven by the runner, one iteration per ``step``.

    ``add_request`` only queues (mutates the waiting queue); a request that can never
    run is reported in ``StepOutput.rejected`` by a later step, never raised.
    ``step`` runs one scheduler iteration and returns what happened; on CUDA it
    synchronises before returning so the runner's clock reads finished work.

    An engine that also implements ``ArrivalAwareEngine`` hears before every step when
    the next request will be submitted.
    """

    name: str

    def add_request(self, request: Request) -> None: ...

    def unsupported_reason(self, request: Request) -> str | None:
        """Why this engine can never serve ``request`` whatever its pool, budget or load
        (a feature it lacks: parallel sampling, beam search), or None when it can. Pure.

        The engine rejects such a request at run time with this reason; a run whose every
        request is unsupported is refused before it starts as a configuration error.
        """
        ...

    def step(self) -> StepOutput: ...

    def has_unfinished(self) -> bool: ...

    def describe(self) -> dict[str, Any]:
        """Static facts for the run record: kv bytes per token, pool bytes, block size."""
        ...


@runtime_checkable
class ArrivalAwareEngine(Protocol):
    """An Engine that wants to know, before every step, when the next request comes.

    The runner calls ``set_next_arrival_s(now_s, next_arrival_s)`` before each ``step``:
    the time now and when the next request will be submitted (``math.inf`` when none is
    due), both on the run's clock in seconds. A simulated engine may then cover several
    iterations in one ``step`` (``StepOutput.covered_steps``) as long as each covered
    iteration starts before ``next_arrival_s``, so the result is the same as stepping one
    iteration at a time. Mutates only what the engine keeps for its next ``step``.
    """

    def set_next_arrival_s(self, now_s: float, next_arrival_s: float) -> None: ...


@runtime_checkable
class LiveEngine(Protocol):
    """An Engine whose requests run on a live server (kvbench.engines.endpoint).

    ``kvbench.execute`` opens it before the replay and always closes it after, on failure
    and interruption too. ``open`` launches the server (its output appended to
    ``log_path``) or finds it, waits until it is ready and, with ``warmup``, sends one
    short request; it raises with a one-screen message naming the URL when the server is
    unreachable. ``close`` stops the client and kills a launched server's process group.
    ``metrics_url`` and ``request_headers`` (in memory only: an API key) are where and how
    to scrape the server's Prometheus metrics; ``server_log_path`` the launched server's
    log (None for a server kvbench did not launch). ``server_failure`` says why the server
    failed during the run ("" when it did not): such a run is recorded as failed, with what
    was collected kept.
    """

    def open(self, log_path: Path, *, warmup: bool) -> None: ...

    def close(self) -> None: ...

    def metrics_url(self) -> str: ...

    def request_headers(self) -> dict[str, str]: ...

    def server_log_path(self) -> Path | None: ...

    def server_failure(self) -> str: ...
