"""The runner's replay loop with a scripted engine: arrivals, clocks, records, limits."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pandas as pd
import pytest

from kvbench.runner import (
    MAX_IDLE_STEPS,
    STALL_STEPS_FACTOR,
    SimClock,
    WallClock,
    default_max_stall_steps,
    replay,
)
from kvbench.types import (
    CoveredSteps,
    FinishedRequest,
    KVUsage,
    Request,
    StepOutput,
    StepStats,
    TokenEvent,
    Workload,
)


class ScriptedEngine:
    """Admits everything at once; each step emits one token per running request.

    ``step_s`` is the modeled duration (sim mode). ``stuck`` makes it never progress.
    """

    name = "scripted"

    def __init__(self, step_s: float = 0.5, stuck: bool = False) -> None:
        self.waiting: deque[Request] = deque()
        self.running: dict[str, list[int]] = {}
        self.requests: dict[str, Request] = {}
        self.step_s = step_s
        self.stuck = stuck
        self.max_running_seen = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def describe(self) -> dict:
        return {}

    def step(self) -> StepOutput:
        first = []
        if not self.stuck:
            while self.waiting:
                request = self.waiting.popleft()
                self.requests[request.request_id] = request
                self.running[request.request_id] = []
                first.append(request.request_id)
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        tokens, finished = [], []
        for request_id, out in list(self.running.items()):
            out.append(7)
            tokens.append(TokenEvent(request_id, 0, 7))
            if len(out) == self.requests[request_id].max_new_tokens:
                finished.append(FinishedRequest(request_id, (tuple(out),), num_cached_prompt_tokens=2))
                del self.running[request_id]
        stats = StepStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_scheduled_tokens=len(tokens),
            num_prefill_tokens=0,
            num_decode_tokens=len(tokens),
            kv=KVUsage(capacity_bytes=100, allocated_bytes=10, token_bytes=8),
        )
        return StepOutput(
            tuple(tokens), tuple(first), tuple(finished), (), stats, modeled_duration_s=self.step_s
        )


def _workload(arrivals: list[float], max_new: int = 3, limit: int | None = None) -> Workload:
    requests = tuple(Request(f"r{i}", t, (5, 6, 7), max_new) for i, t in enumerate(arrivals))
    return Workload("w", requests, max_concurrency=limit)


def test_sim_clock_advances_by_modeled_time_and_jumps_idle_gaps() -> None:
    raw = replay(ScriptedEngine(step_s=0.5), _workload([0.0, 10.0]), SimClock())
    rows = raw.requests.set_index("request_id")
    # r0 runs steps [0, 0.5), [0.5, 1.0), [1.0, 1.5); the clock then jumps to r1's arrival.
    assert rows.loc["r0", "token_times_s"] == [0.5, 1.0, 1.5]
    assert rows.loc["r0", "first_token_s"] == 0.5 and rows.loc["r0", "finish_s"] == 1.5
    assert rows.loc["r1", "first_scheduled_s"] == 10.0
    assert rows.loc["r1", "token_times_s"] == [10.5, 11.0, 11.5]
    assert rows.loc["r1", "num_cached_tokens"] == 2
    assert raw.num_steps == 6 and raw.duration_s == pytest.approx(11.5)
    assert list(raw.steps["duration_s"]) == [0.5] * 6
    assert raw.steps["device_time_s"].isna().all(), "no CUDA events on the simulated clock"


def test_closed_loop_limit_bounds_requests_in_flight() -> None:
    engine = ScriptedEngine(step_s=1.0)
    raw = replay(engine, _workload([0.0] * 5, max_new=2, limit=2), SimClock())
    assert engine.max_running_seen == 2
    arrivals = sorted(raw.requests["arrival_s"])
    assert arrivals == [0.0, 0.0, 2.0, 2.0, 4.0], "a closed-loop request arrives when it is submitted"


def test_engine_that_makes_no_progress_fails_instead_of_hanging() -> None:
    with pytest.raises(RuntimeError, match=f"no progress for {MAX_IDLE_STEPS} steps"):
        replay(ScriptedEngine(stuck=True), _workload([0.0]), SimClock())


def test_sim_clock_needs_a_modeled_duration() -> None:
    with pytest.raises(RuntimeError, match="modeled_duration_s"):
        replay(ScriptedEngine(step_s=None), _workload([0.0]), SimClock())  # type: ignore[arg-type]


def test_wall_clock_waits_for_arrivals() -> None:
    raw = replay(ScriptedEngine(), _workload([0.0, 0.05], max_new=1), WallClock())
    rows = raw.requests.set_index("request_id")
    assert rows.loc["r1", "first_scheduled_s"] >= 0.05
    assert all(not math.isnan(v) for v in raw.steps["end_s"])


class CoveringEngine:
    """One request of 6 tokens: a first step, then 4 steps in one CoveredSteps output (or,
    with ``split``, the same 4 steps one per call from ``CoveredSteps.stats``/``tokens``),
    then a last step that finishes it."""

    name = "covering"

    def __init__(self, split: bool) -> None:
        self.split = split
        self.request: Request | None = None
        self.calls = 0
        self.pending: list[StepOutput] = []

    def add_request(self, request: Request) -> None:
        self.request = request

    def has_unfinished(self) -> bool:
        return self.calls < 3 or bool(self.pending)

    def describe(self) -> dict:
        return {}

    def _stats(self, token_bytes: int, evicted: int = 0) -> StepStats:
        kv = KVUsage(capacity_bytes=100, allocated_bytes=40, token_bytes=token_bytes)
        return StepStats(1, 0, 1, 0, 1, kv, num_evicted_blocks=evicted)

    def step(self) -> StepOutput:
        if self.pending:
            return self.pending.pop(0)
        self.calls += 1
        rid = self.request.request_id
        if self.calls == 1:
            return StepOutput(
                (TokenEvent(rid, 0, 7),), (rid,), (), (), self._stats(8), modeled_duration_s=0.5
            )
        if self.calls == 3:
            done = FinishedRequest(rid, ((7, 8, 9, 10, 11, 12),))
            return StepOutput(
                (TokenEvent(rid, 0, 12),), (), (done,), (), self._stats(13), modeled_duration_s=0.5
            )
        covered = CoveredSteps(
            durations_s=(0.25, 0.25, 0.3, 0.1),
            template=self._stats(12, evicted=1),
            columns={"kv.token_bytes": [9, 10, 11, 12], "num_evicted_blocks": [0, 2, 0, 1]},
            request_ids=(rid,),
            sample_indexes=(0,),
            token_ids=((8, 9, 10, 11),),
        )
        if not self.split:
            return StepOutput((), (), (), (), covered.template, modeled_duration_s=0.9, covered_steps=covered)
        events = covered.tokens()
        self.pending = [
            StepOutput((event._replace(step_offset=0),), (), (), (), covered.stats(i), covered.durations_s[i])
            for i, event in enumerate(events)
        ]
        return self.pending.pop(0)


def test_covered_steps_record_like_the_same_steps_one_per_call() -> None:
    workload = _workload([0.0], max_new=6)
    together = replay(CoveringEngine(split=False), workload, SimClock())
    apart = replay(CoveringEngine(split=True), workload, SimClock())
    assert together.num_steps == apart.num_steps == 6
    pd.testing.assert_frame_equal(together.steps, apart.steps, check_exact=True)
    pd.testing.assert_frame_equal(together.requests, apart.requests, check_exact=True)
    assert together.steps["kv_token_bytes"].tolist() == [8, 9, 10, 11, 12, 13]
    assert together.steps["num_evicted_blocks"].tolist() == [0, 0, 2, 0, 1, 0]
    assert together.requests["token_times_s"][0] == pytest.approx([0.5, 0.75, 1.0, 1.3, 1.4, 1.9])


class RandomCoveringEngine:
    """A scripted replay of ``num_outputs`` outputs (``seed``) over every request's samples
    (request ``i`` has ``1 + i % 3``): multi-step outputs whose batch keeps most sequences
    of the one before and gains or loses others (a preempted one comes back), some in
    consecutive outputs with the very same batch; single covered steps that also carry
    token events for sequences outside their batch (an admission step); plain steps with
    token events between them. With ``split``, every covered step is returned as its own
    plain step with the same tokens (``CoveredSteps.stats`` / ``tokens``). The last step
    finishes every request."""

    name = "random-covering"

    def __init__(self, seed: int, split: bool, num_outputs: int = 60) -> None:
        self.rng = np.random.default_rng(seed)
        self.split = split
        self.num_outputs = num_outputs
        self.requests: list[Request] = []
        self.script: list[StepOutput] | None = None

    def add_request(self, request: Request) -> None:
        self.requests.append(request)

    def has_unfinished(self) -> bool:
        return self.script is None or bool(self.script)

    def describe(self) -> dict:
        return {}

    @staticmethod
    def _stats(num_tokens: int) -> StepStats:
        kv = KVUsage(capacity_bytes=100, allocated_bytes=10, token_bytes=8)
        return StepStats(num_tokens, 0, num_tokens, 0, num_tokens, kv)

    @staticmethod
    def _events(seqs: list[tuple[str, int]]) -> tuple[TokenEvent, ...]:
        return tuple(TokenEvent(rid, sample, 7) for rid, sample in seqs)

    def _build(self) -> list[StepOutput]:
        rng = self.rng
        seqs = [(r.request_id, s) for i, r in enumerate(self.requests) for s in range(1 + i % 3)]
        batch: list[tuple[str, int]] = []
        outputs = []
        for _ in range(self.num_outputs):
            kind = rng.random()
            if kind < 0.2:  # a plain step: events for some sequences
                chosen = [seqs[i] for i in sorted(rng.choice(len(seqs), rng.integers(1, 5), replace=False))]
                outputs.append(StepOutput(self._events(chosen), (), (), (), self._stats(len(chosen)), 0.125))
                continue
            if kind > 0.35 or not batch:  # else the very same batch again
                kept = [seq for seq in batch if rng.random() < 0.8]
                joined = [seq for seq in seqs if seq not in batch and rng.random() < 0.3]
                batch = kept + joined
                if rng.random() < 0.5:
                    batch = [batch[i] for i in rng.permutation(len(batch))]
                if rng.random() < 0.05:
                    batch = []  # a batch of no sequence at all
            num_steps = int(rng.integers(1, 5))
            # Some steps take no time (equal end times), some a non-binary fraction.
            durations_s = tuple(float(d) for d in rng.choice([0.25, 0.5, 0.125, 0.0, 0.1], num_steps))
            covered = CoveredSteps(
                durations_s=durations_s,
                template=self._stats(len(batch)),
                # Now and then a column that varies, a single step's too.
                columns={"num_evicted_blocks": list(range(7, 7 + num_steps))} if rng.random() < 0.2 else {},
                request_ids=tuple(rid for rid, _ in batch),
                sample_indexes=tuple(sample for _, sample in batch),
                token_ids=rng.integers(3, 50, (len(batch), num_steps)),
            )
            # An admission step: one covered step with the first tokens of others.
            outside = [seq for seq in seqs if seq not in batch]
            events = self._events(outside[:2]) if num_steps == 1 and outside and rng.random() < 0.5 else ()
            if not self.split:
                outputs.append(
                    StepOutput(
                        events, (), (), (), covered.template, sum(covered.durations_s), covered_steps=covered
                    )
                )
                continue
            per_step = covered.tokens()
            for step in range(num_steps):
                tokens = tuple(e._replace(step_offset=0) for e in per_step if e.step_offset == step)
                outputs.append(
                    StepOutput(tokens + events, (), (), (), covered.stats(step), covered.durations_s[step])
                )
        done = tuple(FinishedRequest(r.request_id, ((7,),)) for r in self.requests)
        outputs.append(StepOutput((), (), done, (), self._stats(0), 0.5))
        return outputs

    def step(self) -> StepOutput:
        if self.script is None:
            self.script = self._build()
        return self.script.pop(0)


@pytest.mark.parametrize("seed", range(12))
def test_covered_tokens_count_like_the_same_tokens_one_step_at_a_time(seed: int) -> None:
    """Token counts, first-token times and sample 0's token times of requests whose
    sequences join, leave and rejoin covered batches, next to plain token events, read the
    same as when every covered step is returned alone with its tokens as events; so do
    the steps, single covered steps (recorded as plain rows) included."""
    workload = _workload([0.0] * 6, max_new=1000)
    together = replay(RandomCoveringEngine(seed, split=False), workload, SimClock())
    apart = replay(RandomCoveringEngine(seed, split=True), workload, SimClock())
    assert together.num_steps == apart.num_steps
    pd.testing.assert_frame_equal(together.requests, apart.requests, check_exact=True)
    pd.testing.assert_frame_equal(together.steps, apart.steps, check_exact=True)
    assert together.requests["num_generated_tokens"].sum() > 0


def test_covered_steps_with_a_sequence_twice_in_one_batch_are_refused() -> None:
    class TwiceEngine(RandomCoveringEngine):
        def _build(self) -> list[StepOutput]:
            rid = self.requests[0].request_id
            covered = CoveredSteps((0.5,), self._stats(2), {}, (rid, rid), (0, 0), [[5], [6]])
            return [StepOutput((), (), (), (), covered.template, 0.5, covered_steps=covered)]

    with pytest.raises(ValueError, match="sample 0 of request 'r0' has two rows in one batch"):
        replay(TwiceEngine(0, split=False), _workload([0.0]), SimClock())


def test_simulated_durations_are_finite_and_not_negative() -> None:
    stats = RandomCoveringEngine._stats(1)
    for bad in (-0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="durations_s must be finite and >= 0"):
            CoveredSteps((0.25, bad), stats, {}, ("r",), (0,), [[5, 6]])
        with pytest.raises(RuntimeError, match="modeled_duration_s must be finite and >= 0"):
            replay(ScriptedEngine(step_s=bad), _workload([0.0]), SimClock())
    # The batch's columns are tuples whatever sequence they are given as.
    covered = CoveredSteps((0.0, 0.25), stats, {}, ["r"], np.array([0]), [[5, 6]])
    assert covered.request_ids == ("r",) and covered.sample_indexes == (0,)
    assert type(covered.request_ids) is tuple and type(covered.sample_indexes) is tuple


def test_covered_steps_check_their_shape() -> None:
    stats = StepStats(1, 0, 1, 0, 1, KVUsage(capacity_bytes=1, allocated_bytes=0, token_bytes=0))
    with pytest.raises(ValueError, match="no step"):
        CoveredSteps((), stats, {}, (), (), ())
    with pytest.raises(ValueError, match="column 'kv.token_bytes' has 1 values for 2 steps"):
        CoveredSteps((1.0, 1.0), stats, {"kv.token_bytes": [3]}, ("r",), (0,), ((5, 6),))
    with pytest.raises(ValueError, match="every token row"):
        CoveredSteps((1.0, 1.0), stats, {}, ("r",), (0,), ((5,),))
    with pytest.raises(ValueError, match="every token row"):
        CoveredSteps((1.0, 1.0), stats, {}, ("r",), (0,), ((5, 6), (7,)))  # ragged
    with pytest.raises(ValueError, match="one row"):
        CoveredSteps((1.0, 1.0), stats, {}, ("r",), (0,), ((5, 6), (7, 8)))  # a row too many
    with pytest.raises(ValueError, match="one row"):
        CoveredSteps((1.0,), stats, {}, ("r", "s"), (0, 0), ((5, 6),))  # 2 tokens, not 2 rows of 1
    for ids in ([[5.0, 6.0]], np.array([[2**63, 6]], dtype=np.uint64)):  # no silent truncation or wrap
        with pytest.raises(ValueError, match="token ids must be int64 integers"):
            CoveredSteps((1.0, 1.0), stats, {}, ("r",), (0,), ids)
    tokens = np.array([[5, 6]])
    covered = CoveredSteps((1.0, 1.0), stats, {}, ("r",), (0,), tokens)
    tokens[0, 0] = 9  # the record holds its own read-only copy
    assert not covered.token_ids.flags.writeable
    assert [event.token_id for event in covered.tokens()] == [5, 6]
    # Records compare by value, the token array included (as when it was a tuple).
    assert covered == CoveredSteps((1.0, 1.0), stats, {}, ("r",), (0,), [[5, 6]])
    assert covered != CoveredSteps((1.0, 1.0), stats, {}, ("r",), (0,), [[5, 7]])
    assert covered != CoveredSteps((1.0, 2.0), stats, {}, ("r",), (0,), [[5, 6]])


# --------------------------------------------------------------------------- stall watchdog
class NeverFinishingEngine:
    """Admits every request and emits one token per running request each step, but never
    finishes one (an end condition that is never reached)."""

    name = "looping"

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.running: list[str] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def describe(self) -> dict:
        return {}

    def step(self) -> StepOutput:
        first, self.waiting = tuple(self.waiting), []
        self.running.extend(first)
        tokens = tuple(TokenEvent(request_id, 0, 7) for request_id in self.running)
        kv = KVUsage(capacity_bytes=100, allocated_bytes=10, token_bytes=8)
        stats = StepStats(len(self.running), 0, len(tokens), 0, len(tokens), kv)
        return StepOutput(tokens, first, (), (), stats, modeled_duration_s=0.5)


def test_an_engine_that_never_finishes_is_stopped_with_its_state() -> None:
    workload = _workload([0.0, 0.0, 5.0], max_new=2)
    with pytest.raises(RuntimeError) as error:
        replay(NeverFinishingEngine(), workload, SimClock(), max_stall_steps=40)
    message = str(error.value)
    assert "engine 'looping' stalled: no request finished or was rejected in the last 40 steps" in message
    assert "(0 waiting, 3 running; 0 of 3 submitted requests done)" in message
    assert "stall limit is 40 steps" in message and "run.stall_steps" in message


def test_an_engine_that_never_schedules_is_stopped_by_the_stall_limit_first() -> None:
    with pytest.raises(RuntimeError, match=r"'scripted' stalled: .* last 25 steps \(1 waiting, 0 running"):
        replay(ScriptedEngine(stuck=True), _workload([0.0]), SimClock(), max_stall_steps=25)


@pytest.mark.parametrize("max_stall_steps, stalls", [(6, False), (5, True)])
def test_stall_limit_counts_steps_since_the_last_finish(max_stall_steps: int, stalls: bool) -> None:
    # r0 needs 6 steps and finishes in the 6th: 5 steps without a finish before it.
    workload = _workload([0.0], max_new=6)
    if stalls:
        with pytest.raises(RuntimeError, match="last 5 steps"):
            replay(ScriptedEngine(), workload, SimClock(), max_stall_steps=max_stall_steps)
    else:
        raw = replay(ScriptedEngine(), workload, SimClock(), max_stall_steps=max_stall_steps)
        assert raw.num_steps == 6


@pytest.mark.parametrize("max_stall_steps, stalls", [(6, False), (5, True)])
def test_covered_steps_count_as_steps_for_the_stall_limit(max_stall_steps: int, stalls: bool) -> None:
    # One step, then 4 covered steps in one output, then the finishing step.
    workload = _workload([0.0], max_new=6)
    if stalls:
        with pytest.raises(RuntimeError, match="last 5 steps"):
            replay(CoveringEngine(split=False), workload, SimClock(), max_stall_steps=max_stall_steps)
    else:
        assert (
            replay(
                CoveringEngine(split=False), workload, SimClock(), max_stall_steps=max_stall_steps
            ).num_steps
            == 6
        )


def test_default_stall_limit_comes_from_the_longest_request() -> None:
    long_one = Workload("w", (Request("a", 0.0, (5,) * 40, 900), Request("b", 0.0, (5,) * 3, 10)))
    assert default_max_stall_steps(long_one) == STALL_STEPS_FACTOR * 940
    assert default_max_stall_steps(_workload([0.0], max_new=3)) == MAX_IDLE_STEPS
    assert default_max_stall_steps(Workload("empty", ())) == MAX_IDLE_STEPS
    # A request that runs 1,500 steps without any finish passes under the default (6,012).
    raw = replay(ScriptedEngine(step_s=0.01), _workload([0.0], max_new=1500), SimClock())
    assert raw.num_steps == 1500
    with pytest.raises(RuntimeError, match="stall limit is 1000 steps"):
        replay(ScriptedEngine(step_s=0.01), _workload([0.0], max_new=1500), SimClock(), max_stall_steps=1000)


def test_idle_gaps_reset_the_stall_count() -> None:
    # r0 finishes at step 3, r1 arrives later: each stretch is 2 steps without a finish.
    raw = replay(ScriptedEngine(), _workload([0.0, 10.0, 20.0], max_new=3), SimClock(), max_stall_steps=3)
    assert raw.num_steps == 9


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "10"])
def test_stall_limit_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="max_stall_steps must be an int >= 1"):
        replay(ScriptedEngine(), _workload([0.0]), SimClock(), max_stall_steps=bad)  # type: ignore[arg-type]
