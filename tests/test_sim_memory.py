"""What keeps a long simulated trace small and quick to load: the steps frame built in
numpy chunks as the run goes (no step output kept to the end), trace prompts computed
when read (ids exist only while their request is in flight), and the compiled keyed-id
pass that computes them. Each is checked against the plain definition it replaces.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbench.runner as runner
from kvbench.engines.paged import PagedEngine
from kvbench.engines.sim.executor import CostModelExecutor
from kvbench.runner import STEP_COLUMNS, SimClock, StepsRecorder, replay
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import (
    ComputedTokenIds,
    CoveredSteps,
    EngineContext,
    KVUsage,
    Request,
    StepOutput,
    StepStats,
    Workload,
)
from kvbench.workloads.replay import HashBlockPrompt, ReplayOptions
from kvbench.workloads.replay import replay as replay_trace
from kvbench.workloads.synthetic import random_requests
from kvbench.workloads.tokens import (
    FLOAT_QUOTIENT_MIN_DIVISOR,
    keyed_block_bases,
    keyed_block_ids_into,
    keyed_ids_from_bases,
    mod_by_float_quotient,
)
from kvbench.workloads.traces import load_trace, parse_trace

MOONCAKE_HEAD = Path(__file__).parent / "fixtures" / "traces" / "mooncake_conversation_head200.jsonl"


@dataclasses.dataclass(frozen=True)
class TimedStepStats(StepStats):
    """A second stats class with one more column (an engine reporting extra fields)."""

    host_wait_s: float = 0.0


# --------------------------------------------------------------------------- steps frame
def reference_steps_frame(entries: list[tuple[Any, Any]]) -> pd.DataFrame:
    """The steps frame by its plain definition: one row per step (a covered step's stats
    from ``CoveredSteps.stats``), fields of nested records flattened as ``outer_inner``,
    consecutive steps of one stats class as one frame of np.array columns, the frames
    concatenated (columns aligned by name)."""
    rows: list[tuple[type, dict[str, Any]]] = []
    for timing, item in entries:
        if isinstance(item, CoveredSteps):
            columns = [list(values) for values in timing]
            steps = [([column[i] for column in columns], item.stats(i)) for i in range(len(item))]
        else:
            steps = [(list(timing), item)]
        for values, stats in steps:
            row = dict(zip(STEP_COLUMNS, values))
            for f in dataclasses.fields(stats):
                value = getattr(stats, f.name)
                if dataclasses.is_dataclass(value):
                    row.update(
                        {f"{f.name}_{g.name}": getattr(value, g.name) for g in dataclasses.fields(value)}
                    )
                else:
                    row[f.name] = value
            rows.append((type(stats), row))
    frames = [
        pd.DataFrame({name: np.array([row[name] for row in group]) for name in group[0]})
        for _, group in (
            (cls, [row for _, row in run]) for cls, run in itertools.groupby(rows, key=lambda r: r[0])
        )
    ]
    return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)


def recorded_steps_frame(entries: list[tuple[Any, Any]], chunk_steps: int) -> pd.DataFrame:
    """The steps frame ``StepsRecorder`` builds of ``entries`` (as ``reference_steps_frame``
    takes them) with chunks of ``chunk_steps`` steps."""
    recorder = StepsRecorder(chunk_steps)
    for timing, item in entries:
        if isinstance(item, CoveredSteps):
            recorder.add_covered(timing, item)
        else:
            recorder.add(timing, item)
    return recorder.frame()


# Values of mixed kinds in one column: ints, floats (NaN too) and bools promote as one array.
scalar = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=False, width=64),
    st.booleans(),
)


@st.composite
def step_entries(draw: st.DrawFn) -> list[tuple[Any, Any]]:
    entries: list[tuple[Any, Any]] = []
    step = 0
    for _ in range(draw(st.integers(1, 12))):
        cls = draw(st.sampled_from([StepStats, TimedStepStats]))
        kv = KVUsage(capacity_bytes=draw(scalar), allocated_bytes=draw(scalar), token_bytes=draw(scalar))
        extra = {"host_wait_s": draw(scalar)} if cls is TimedStepStats else {}
        stats = cls(draw(scalar), 0, draw(scalar), 0, 1, kv, fetch_recall=draw(scalar), **extra)
        num = draw(st.integers(1, 5))
        starts = [draw(st.floats(0, 1e6)) for _ in range(num)]
        ends = [start + draw(st.floats(0, 1.0)) for start in starts]
        if draw(st.booleans()) and num > 0:
            varying = draw(st.sets(st.sampled_from(["num_running", "kv.token_bytes", "fetch_recall"])))
            covered = CoveredSteps(
                durations_s=tuple(e - s for s, e in zip(starts, ends)),
                template=stats,
                columns={path: [draw(scalar) for _ in range(num)] for path in sorted(varying)},
                request_ids=("r",),
                sample_indexes=(0,),
                token_ids=(tuple(range(num)),),
            )
            timing = (
                range(step, step + num),
                starts,
                ends,
                [e - s for s, e in zip(starts, ends)],
                [math.nan] * num,
            )
            entries.append((timing, covered))
            step += num
        else:
            entries.append(((step, starts[0], ends[0], ends[0] - starts[0], math.nan), stats))
            step += 1
    return entries


@settings(max_examples=150, deadline=None)
@given(entries=step_entries(), chunk_steps=st.integers(1, 9))
def test_steps_recorder_builds_the_frame_of_the_plain_definition(
    entries: list[tuple[Any, Any]], chunk_steps: int
) -> None:
    pd.testing.assert_frame_equal(
        recorded_steps_frame(entries, chunk_steps), reference_steps_frame(entries), check_exact=True
    )


@pytest.mark.parametrize(
    ("row_values", "step_values", "chunk_sizes"),
    [
        (["x"], ["ab", "cd"], (1, 2, 100)),  # strings
        ([-1], [2**63, 1], (1, 2, 100)),  # an int past int64 next to a negative one
        ([2**64], [1, 2], (1, 2, 100)),
        ([1], [2**64, -1], (1, 2, 100)),
        # In one chunk only: chunks are built apart and concatenated, which keeps the
        # dtype of Python bools, ints and floats but not of these. A chunk of 0 and 0.5
        # is float64, so beside a chunk holding None its 0 becomes 0.0; int8, uint8 and
        # float16 chunks concatenate to float16 where their values together make float32.
        ([None], [0, 0.5], (100,)),  # an object column
        ([np.int8(1), np.uint8(2)], [np.float16(1.5), np.float16(2.5)], (100,)),  # numpy widths
    ],
)
def test_steps_recorder_keeps_the_plain_dtype_of_other_kinds_of_values(
    row_values: list[Any], step_values: list[Any], chunk_sizes: tuple[int, ...]
) -> None:
    """Values that are not Python bools, ints or floats (which no engine reports today)
    still give the column np.array gives them in step order."""
    kv = KVUsage(capacity_bytes=0, allocated_bytes=0, token_bytes=0)
    entries: list[tuple[Any, Any]] = []
    for step, value in enumerate(row_values):
        entries.append(((step, 0.0, 0.0, 0.0, math.nan), StepStats(0, 0, 0, 0, 0, kv, fetch_recall=value)))
    num = len(step_values)
    first = len(row_values)
    covered = CoveredSteps(
        durations_s=(0.0,) * num,
        template=StepStats(0, 0, 0, 0, 0, kv, fetch_recall=row_values[0]),
        columns={"fetch_recall": step_values},
        request_ids=("r",),
        sample_indexes=(0,),
        token_ids=(tuple(range(num)),),
    )
    entries.append(
        ((range(first, first + num), [0.0] * num, [0.0] * num, [0.0] * num, [math.nan] * num), covered)
    )
    for chunk_steps in chunk_sizes:
        got, want = recorded_steps_frame(entries, chunk_steps), reference_steps_frame(entries)
        pd.testing.assert_frame_equal(got, want, check_exact=True)
        # An object column holds the values themselves (an int stays an int beside a float).
        assert [type(v) for v in got["fetch_recall"]] == [type(v) for v in want["fetch_recall"]]


def test_steps_recorder_without_steps_gives_an_empty_frame() -> None:
    assert StepsRecorder().frame().empty


class RecordingEngine(PagedEngine):
    """A simulated paged engine that keeps every StepOutput and every request it was given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: list[StepOutput] = []
        self.added: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.added.append(request)
        super().add_request(request)

    def step(self) -> StepOutput:
        output = super().step()
        self.outputs.append(output)
        return output


def mooncake_head_workload() -> Workload:
    """60 requests of the Mooncake head fixture, scaled for the tiny model."""
    return load_trace(
        str(MOONCAKE_HEAD),
        vocab_size=ModelSpec().vocab_size,
        length_scale=1 / 64,
        output_scale=1 / 4,
        max_requests=60,
    )


def run_mooncake_head(monkeypatch: pytest.MonkeyPatch, chunk_steps: int) -> tuple[Any, RecordingEngine]:
    monkeypatch.setattr(runner, "STEPS_CHUNK", chunk_steps)
    spec = ModelSpec()  # tiny-gqa
    ctx = EngineContext(spec, HardwareSpec(step_overhead_s=5e-3), None, "cpu", "fp32", 0, "sim")
    workload = mooncake_head_workload()
    engine = RecordingEngine(
        ctx, executor=CostModelExecutor.from_context(ctx, block_size=16), num_blocks=400, max_num_seqs=16
    )
    return replay(engine, workload, SimClock()), engine


def test_a_sim_run_records_its_steps_across_chunks_as_the_plain_definition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw, engine = run_mooncake_head(monkeypatch, chunk_steps=7)
    covered = [output.covered_steps for output in engine.outputs if output.covered_steps is not None]
    assert covered and any(len(c) > 1 for c in covered)  # multi-step outputs and single steps
    assert len(covered) < len(engine.outputs) and raw.num_steps > 7 * 10  # many chunks
    entries = [
        (
            [[math.nan] * len(output.covered_steps)] * len(STEP_COLUMNS)
            if output.covered_steps is not None
            else [math.nan] * len(STEP_COLUMNS),
            output.covered_steps if output.covered_steps is not None else output.stats,
        )
        for output in engine.outputs
    ]
    expected = reference_steps_frame(entries)
    stats_columns = [name for name in expected.columns if name not in STEP_COLUMNS]
    pd.testing.assert_frame_equal(raw.steps[stats_columns], expected[stats_columns], check_exact=True)
    assert raw.steps["step"].tolist() == list(range(raw.num_steps))
    starts, ends = raw.steps["start_s"].to_numpy(), raw.steps["end_s"].to_numpy()
    assert (ends >= starts).all() and (starts[1:] >= ends[:-1]).all()
    # The same run recorded in one chunk gives the same frame.
    whole, _ = run_mooncake_head(monkeypatch, chunk_steps=1 << 30)
    pd.testing.assert_frame_equal(raw.steps, whole.steps, check_exact=True)


# --------------------------------------------------------------------------- what a replay keeps
def random_sim_run(num_requests: int, keep_outputs: bool) -> Any:
    """A simulated replay of ``num_requests`` random requests (tiny-gqa, paged, block-hash)."""
    spec = ModelSpec()  # tiny-gqa
    ctx = EngineContext(spec, HardwareSpec(step_overhead_s=5e-3), None, "cpu", "fp32", 0, "sim")
    workload = random_requests(
        num_requests,
        {"kind": "uniform", "low": 16, "high": 96},
        {"kind": "uniform", "low": 100, "high": 300},
        {"kind": "poisson", "rate_per_s": 50.0},
        vocab_size=spec.vocab_size,
        seed=0,
    )
    engine = PagedEngine(
        ctx, executor=CostModelExecutor.from_context(ctx, block_size=16), num_blocks=2000, max_num_seqs=32
    )
    return replay(engine, workload, SimClock(), keep_outputs=keep_outputs)


def test_a_replay_without_outputs_records_the_same_frames() -> None:
    kept, dropped = random_sim_run(60, keep_outputs=True), random_sim_run(60, keep_outputs=False)
    assert dropped.outputs == {} and len(kept.outputs) == 60
    pd.testing.assert_frame_equal(kept.requests, dropped.requests, check_exact=True)
    pd.testing.assert_frame_equal(kept.steps, dropped.steps, check_exact=True)
    lengths = {request_id: len(samples[0]) for request_id, samples in kept.outputs.items()}
    assert dict(zip(kept.requests["request_id"], kept.requests["num_output_tokens"])) == lengths
    assert min(lengths.values()) >= 100


def retained_bytes_per_token(keep_outputs: bool, sizes: tuple[int, int] = (40, 160)) -> float:
    """Bytes a replay's result holds per generated token: the traced memory a replay of
    ``sizes[1]`` requests leaves over one of ``sizes[0]`` (the engine gone: a difference,
    so numba's and the caches' one-time allocations cancel), over the extra tokens."""
    retained, tokens = [], []
    random_sim_run(sizes[0], keep_outputs)  # compiles and warms what a first run allocates
    for num_requests in sizes:
        gc.collect()
        tracemalloc.start()
        raw = random_sim_run(num_requests, keep_outputs)
        gc.collect()
        retained.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
        tokens.append(int(raw.requests["num_generated_tokens"].sum()))
        del raw
    return (retained[1] - retained[0]) / (tokens[1] - tokens[0])


def test_a_replay_without_outputs_keeps_a_few_bytes_per_token() -> None:
    """What a replay of millions of simulated requests may hold: sample 0's token times (a
    pointer to a shared float a token) and a row per request, ~20 bytes a token at ~200
    tokens a request; not the tokens as Python ints (~40 bytes more a token), which
    ``keep_outputs=True`` keeps (measured 19.8 against 58.6 here)."""
    assert retained_bytes_per_token(keep_outputs=False) <= 30
    assert retained_bytes_per_token(keep_outputs=True) > 40


# --------------------------------------------------------------------------- trace prompts
def test_engines_compute_trace_prompts_only_when_they_need_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine gets each trace prompt as ComputedTokenIds and computes its ids when it
    first matches or schedules the request (once), so a queue holds none; the run equals
    the same run with every prompt held from the start."""
    computed: list[int] = []
    ids = HashBlockPrompt.ids

    def counting_ids(prompt: HashBlockPrompt) -> np.ndarray:
        computed.append(len(prompt))
        return ids(prompt)

    monkeypatch.setattr(HashBlockPrompt, "ids", counting_ids)
    raw, engine = run_mooncake_head(monkeypatch, chunk_steps=4096)
    assert len(engine.added) == 60 and all(
        isinstance(r.prompt_token_ids, ComputedTokenIds) for r in engine.added
    )
    assert len(computed) == 60  # each prompt's ids once, for the whole run
    # A fresh engine given every request at once computes ids for what it schedules and
    # the queue's head (matched while it waits), not for the queue.
    computed.clear()
    spec = ModelSpec()
    ctx = EngineContext(spec, HardwareSpec(step_overhead_s=5e-3), None, "cpu", "fp32", 0, "sim")
    fresh = PagedEngine(
        ctx, executor=CostModelExecutor.from_context(ctx, block_size=16), num_blocks=400, max_num_seqs=4
    )
    for request in engine.added:
        fresh.add_request(request)
    assert computed == []
    fresh.step()
    assert 1 <= len(computed) <= 4 + 1
    # The run with every prompt in memory from the start: the same requests and steps.
    monkeypatch.setattr(HashBlockPrompt, "ids", ids)
    held = dataclasses.replace(
        mooncake_head_workload(),
        requests=[r.with_prompt_in_memory() for r in mooncake_head_workload().requests],
    )
    engine_held = RecordingEngine(
        ctx, executor=CostModelExecutor.from_context(ctx, block_size=16), num_blocks=400, max_num_seqs=16
    )
    raw_held = replay(engine_held, held, SimClock())
    pd.testing.assert_frame_equal(raw.requests, raw_held.requests, check_exact=True)
    pd.testing.assert_frame_equal(raw.steps, raw_held.steps, check_exact=True)


def test_computed_prompts_read_like_their_ids_and_compare_equal_across_forms() -> None:
    trace = parse_trace(MOONCAKE_HEAD)
    workload = replay_trace(
        trace, ReplayOptions(length_scale=1 / 16, max_requests=20), vocab_size=50_000, seed=3
    )
    for request in workload.requests:
        computed = request.prompt_token_ids
        held = request.with_prompt_in_memory()
        ids = held.prompt_token_ids
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int32 and not ids.flags.writeable
        assert held == request and request == held and held is not request
        assert held.with_prompt_in_memory() is held
        assert np.array_equal(computed[3:40], ids[3:40]) and computed[-1] == ids[-1]
        assert np.array_equal(np.asarray(computed, dtype=np.int64), ids.astype(np.int64))
        assert np.array_equal(computed.ids(), ids)  # the same ids every call
        different = dataclasses.replace(held, prompt_token_ids=tuple(ids[:-1].tolist()) + (int(ids[-1]) + 1,))
        assert request != different and different != request


@pytest.mark.parametrize("cap", [1, 511, 512, 513, 1800])
def test_capped_computed_prompts_are_the_uncapped_prompts_cut(cap: int) -> None:
    trace = parse_trace(MOONCAKE_HEAD)
    full = replay_trace(trace, ReplayOptions(max_requests=30), vocab_size=50_000, seed=1)
    capped = replay_trace(
        trace, ReplayOptions(max_requests=30, max_prompt_tokens=cap), vocab_size=50_000, seed=1
    )
    num_cut = 0
    for a, b in zip(full.requests, capped.requests):
        assert b.request_id == a.request_id and len(b.prompt_token_ids) == min(cap, len(a.prompt_token_ids))
        assert np.array_equal(np.asarray(b.prompt_token_ids), np.asarray(a.prompt_token_ids)[:cap])
        num_cut += len(a.prompt_token_ids) > cap
    assert capped.counters["num_prompts_truncated"] == num_cut > 0


# --------------------------------------------------------------------------- keyed ids
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    blocks=st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 40)), max_size=12),
    vocab_size=st.integers(4, 2**31 - 1),
    dtype=st.sampled_from([np.int32, np.int64]),
)
def test_compiled_keyed_block_ids_equal_the_numpy_definition(
    seed: int, blocks: list[tuple[int, int]], vocab_size: int, dtype: type
) -> None:
    keys = [key for key, _ in blocks]
    lengths = np.array([n for _, n in blocks], dtype=np.int64)
    bases = keyed_block_bases(seed, np.array(keys, dtype=np.int64))
    out = np.full(int(lengths.sum()), -1, dtype=dtype)
    keyed_block_ids_into(bases, lengths, vocab_size, out)
    ends = np.cumsum(lengths)
    offsets = np.arange(int(lengths.sum())) - np.repeat(ends - lengths, lengths)
    expected = keyed_ids_from_bases(np.repeat(bases, lengths), offsets, vocab_size)
    assert np.array_equal(out, expected)


def _edge_dividends(n: int) -> list[int]:
    """Dividends where a float quotient is most likely off by one: 0, around multiples
    of ``n`` (small, near 2**53 and near 2**64) and the top of the uint64 range."""
    top = (2**64 - 1) // n
    values = {0, 1, 2**53 - 1, 2**53, 2**53 + 1, 2**63, 2**64 - 2, 2**64 - 1}
    for k in (1, 2, 3, 2**53 // n, 2**53 // n + 1, 2**63 // n, top - 1, top):
        for delta in (-2, -1, 0, 1, 2):
            values.add(k * n + delta)
    return sorted(v for v in values if 0 <= v < 2**64)


@pytest.mark.parametrize(
    "divisor",
    [
        FLOAT_QUOTIENT_MIN_DIVISOR,
        FLOAT_QUOTIENT_MIN_DIVISOR + 1,
        31997,
        50254,
        128253,
        151933,
        2**24 + 1,
        2**31 - 4,
    ],
)
def test_float_quotient_mod_is_exact_at_the_edges(divisor: int) -> None:
    inv = 1.0 / divisor
    for y in _edge_dividends(divisor):
        assert int(mod_by_float_quotient(np.uint64(y), divisor, inv)) == y % divisor, (y, divisor)


@settings(max_examples=300, deadline=None)
@given(y=st.integers(0, 2**64 - 1), divisor=st.integers(FLOAT_QUOTIENT_MIN_DIVISOR, 2**31 - 4))
def test_float_quotient_mod_is_exact(y: int, divisor: int) -> None:
    assert int(mod_by_float_quotient(np.uint64(y), divisor, 1.0 / divisor)) == y % divisor
