"""Simulation fast-forward: a decode run covered in one ``step`` call must give exactly
what stepping one iteration per call gives (steps rows, token times, outputs, counters).

Each scenario runs the same workload through two simulated paged engines, one with
``fast_forward=False``, and compares the runner's frames cell by cell. The scenarios
are chosen so that runs are cut by every event: arrivals (Poisson), finishes, block
boundaries, prefix hits and evictions, preemptions (small pools), admissions blocked on
the pool, parallel samples (copy-on-write after the fork) and beams (never fast-forwarded). The
slab engine's runs (its regions reserved at admission) are compared the same way.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_workloads import mooncake_head

from kvbench.engines.kv.paged import PagedDecodeRun, PagedKVManager
from kvbench.engines.kv.slab import SlabKVManager
from kvbench.engines.paged import PagedEngine
from kvbench.engines.sched.scheduler import REGISTER_BLOCKS, Scheduler, is_decode_ready, may_follow_decodes
from kvbench.engines.sim import fast_forward
from kvbench.engines.sim.executor import CostModelExecutor
from kvbench.engines.sim.fast_forward import FastForward
from kvbench.engines.slab import SlabEngine
from kvbench.runner import RawRun, SimClock, replay
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import EngineContext, Request, Workload
from kvbench.workloads.prefixes import chat
from kvbench.workloads.synthetic import best_of_n, random_requests

SPEC = ModelSpec()  # tiny-gqa
# Slow steps (5 ms + per-sequence costs), so Poisson arrivals land inside decode runs.
SLOW = HardwareSpec(step_overhead_s=5e-3, per_seq_overhead_s=2e-4)


@pytest.fixture(autouse=True)
def verify_carried_batches(monkeypatch):
    """Every run here that carries its batch from the last one also reads it fresh and
    requires the same columns and KV run (``FastForward.verify_carry``); and a run takes a
    prefilling tail behind a batch of any size (``FastForward.min_seqs_before_tail``: the
    scenarios here run a few sequences)."""
    monkeypatch.setattr(FastForward, "verify_carry", True)
    monkeypatch.setattr(FastForward, "min_seqs_before_tail", 1)


class StepCounting:
    """Counts step() calls, to show the fast-forwarding engine really covered runs."""

    num_calls = 0

    def step(self):  # type: ignore[no-untyped-def]
        self.num_calls += 1
        return super().step()  # type: ignore[misc]


class CountingEngine(StepCounting, PagedEngine):
    pass


class CountingSlabEngine(StepCounting, SlabEngine):
    pass


def run(
    workload: Workload,
    fast: bool,
    spec: ModelSpec = SPEC,
    engine_cls: type[PagedEngine] = CountingEngine,
    **params: object,
) -> tuple[RawRun, PagedEngine]:
    ctx = EngineContext(spec, SLOW, None, "cpu", "fp32", 0, "sim")
    block_size = int(params.get("block_size", 16))  # type: ignore[call-overload]
    engine = engine_cls(
        ctx,
        executor=CostModelExecutor.from_context(ctx, block_size=block_size),
        fast_forward=fast,
        **params,
    )
    raw = replay(engine, workload, SimClock())
    engine.scheduler.check()
    engine.kv.check()
    return raw, engine


def assert_identical(
    workload: Workload,
    min_covered_share: float = 0.0,
    spec: ModelSpec = SPEC,
    engine_cls: type[PagedEngine] = CountingEngine,
    **params: object,
) -> float:
    """Run both ways, compare everything; returns the share of steps covered by runs."""
    slow, slow_engine = run(workload, False, spec, engine_cls, **params)
    fast, fast_engine = run(workload, True, spec, engine_cls, **params)
    assert slow_engine.num_calls == slow.num_steps
    pd.testing.assert_frame_equal(slow.steps, fast.steps, check_exact=True)
    pd.testing.assert_frame_equal(
        slow.requests.drop(columns="token_times_s"),
        fast.requests.drop(columns="token_times_s"),
        check_exact=True,
    )
    assert slow.requests["token_times_s"].tolist() == fast.requests["token_times_s"].tolist()
    assert slow.outputs == fast.outputs
    assert slow.duration_s == fast.duration_s
    assert slow_engine.executor.num_steps == fast_engine.executor.num_steps
    covered = 1 - fast_engine.num_calls / fast.num_steps
    assert covered >= min_covered_share, f"only {covered:.0%} of steps were fast-forwarded"
    return covered


def three_turn_chats(
    num_conversations: int,
    max_user_len: int,
    output_len: tuple[int, int],
    rate_per_s: float,
    turn_interval_s: float,
) -> Workload:
    """Conversations of three turns on a shared 64-token system prompt: user turns of 10 to
    ``max_user_len`` tokens, outputs uniform in ``output_len``, Poisson starts."""
    return chat(
        num_conversations=num_conversations,
        num_turns=3,
        system_prompt_len=64,
        user_len={"kind": "uniform", "low": 10, "high": max_user_len},
        output_len={"kind": "uniform", "low": output_len[0], "high": output_len[1]},
        arrival={"kind": "poisson", "rate_per_s": rate_per_s},
        turn_interval_s=turn_interval_s,
        vocab_size=SPEC.vocab_size,
        seed=5,
    )


def test_chat_with_shared_prefixes_and_poisson_arrivals():
    workload = three_turn_chats(6, 60, (20, 120), 8.0, 0.3)
    assert_identical(
        workload, min_covered_share=0.5, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=128
    )


def with_mixed_priorities(workload: Workload) -> Workload:
    """``workload`` with request ``i`` at priority ``7 i mod 4``."""
    return Workload(
        workload.name,
        tuple(dataclasses.replace(r, priority=(7 * i) % 4) for i, r in enumerate(workload.requests)),
    )


def priority_arrivals() -> Workload:
    """Poisson arrivals of mixed priorities: under the priority policy a later arrival
    that matters more joins ``running`` ahead of groups already there (not at its end)."""
    workload = random_requests(
        24,
        {"kind": "uniform", "low": 10, "high": 60},
        {"kind": "uniform", "low": 10, "high": 60},
        {"kind": "poisson", "rate_per_s": 60.0},
        vocab_size=SPEC.vocab_size,
        seed=9,
    )
    return with_mixed_priorities(Workload("priorities", workload.requests))


def test_priority_admissions_ahead_of_running_groups_as_stepping():
    assert_identical(
        priority_arrivals(), min_covered_share=0.3, num_blocks=48, max_num_seqs=8, victim_policy="priority"
    )


def test_small_pool_preempts_and_blocks_admission():
    workload = random_requests(
        12,
        {"kind": "uniform", "low": 20, "high": 90},
        {"kind": "uniform", "low": 30, "high": 150},
        {"kind": "poisson", "rate_per_s": 30.0},
        vocab_size=SPEC.vocab_size,
        seed=2,
    )
    slow, _ = run(workload, False, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=64)
    assert slow.steps["num_preemptions"].sum() > 0  # the scenario really preempts
    assert_identical(
        workload, min_covered_share=0.3, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=64
    )


def test_unchunked_prompts_wait_for_a_decoding_batch_as_stepping():
    """Without chunked prefill a prompt longer than the budget left waits while any other
    piece is planned: prompts of up to the whole budget arrive while batches decode, and
    both paths agree (the property test below draws chunked prefill both ways, over far
    smaller workloads)."""
    workload = random_requests(
        16,
        {"kind": "uniform", "low": 40, "high": 64},
        {"kind": "uniform", "low": 10, "high": 60},
        {"kind": "poisson", "rate_per_s": 40.0},
        vocab_size=SPEC.vocab_size,
        seed=3,
        n=2,
        temperature=1.0,
    )
    params = {"num_blocks": 128, "max_num_seqs": 8, "max_num_batched_tokens": 64, "chunked_prefill": False}
    assert_identical(workload, min_covered_share=0.3, **params)


def test_a_recomputed_forked_group_admitted_next_to_a_run_sees_its_batch_planned():
    """A run's admission step plans its batch's decodes outside the scheduler's piece list
    (``admit_after_decodes``) but admission must still see them as planned. The one place
    that decides anything: a forked group preempted by recompute, back at the head, whose
    start the run cannot rule out (several sequences), with unchunked prefill. Counting
    the batch as no pieces lets its prompt run over the budget the batch leaves."""
    workload = best_of_n(
        9,
        {"kind": "uniform", "low": 8, "high": 32},
        {"kind": "uniform", "low": 10, "high": 60},
        {"kind": "poisson", "rate_per_s": 100.0},
        n=4,
        vocab_size=SPEC.vocab_size,
        seed=7,
    )
    params = {
        "num_blocks": 37,
        "block_size": 8,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 32,
        "chunked_prefill": False,
        "prefix_cache": "radix",
        "preemption": "recompute",
    }
    slow, _ = run(workload, False, **params)
    assert slow.steps["num_preemptions"].sum() > 0  # the scenario really preempts
    assert_identical(workload, min_covered_share=0.1, **params)


@pytest.mark.parametrize("prefix_cache", ["block_hash", "radix", "none"])
def test_mooncake_head_fixture(prefix_cache, monkeypatch):
    # Count the steps runs reserved together (quiet steps: the head could not start).
    reserved = [0]
    advance_many = PagedDecodeRun.advance_many

    def counting_advance_many(run, num_steps, *args, **kwargs):
        reserved[0] += num_steps
        return advance_many(run, num_steps, *args, **kwargs)

    monkeypatch.setattr(PagedDecodeRun, "advance_many", counting_advance_many)
    workload = mooncake_head(60, SPEC)
    assert_identical(
        workload,
        min_covered_share=0.3,
        num_blocks=160,
        max_num_seqs=12,
        max_num_batched_tokens=256,
        prefix_cache=prefix_cache,
    )
    # Radix commits move block references, so its runs go one step at a time.
    assert (reserved[0] > 0) == (prefix_cache != "radix")


def _prefix_cut_scenario(seed: int, crowded: bool = False) -> tuple[Workload, dict[str, object]]:
    """Two prompts sharing a prefix, prefilled side by side (so the prefix is computed
    twice and the first one to commit registers it), decoding next to long fillers; a
    later prompt extends the longer one. Once both finish, the later prompt's match runs
    through the shorter one's prefix blocks then the longer one's, and the shorter one's
    were freed first: a decode step that reuses one cuts the match short, and the
    prompt may then fit (``PagedKVManager.num_blocks_before_admission``). ``crowded``:
    more fillers, budgets that are no multiple of the block size and longer later
    prompts, so the budget left after the decodes decides where a run stops."""
    rng = random.Random(seed)
    bs = 4
    shared = [rng.randint(10, 40) for _ in range(bs * rng.randint(1, 3))]
    rest = [rng.randint(10, 40) for _ in range(bs * rng.randint(2, 8))]
    requests = [
        Request("short", 0.0, (*shared, 1), rng.randint(1, 4)),
        Request("long", 0.0, (*shared, *rest, 2), rng.randint(4, 12)),
    ]
    for filler in range(rng.randint(3, 7) if crowded else rng.randint(1, 4)):
        prompt = tuple(rng.randint(50, 90) for _ in range(rng.randint(2, 12)))
        requests.append(Request(f"filler{filler}", 0.0, prompt, rng.randint(30, 120)))
    arrival_s = rng.uniform(0.05, 0.6)
    extra = [rng.randint(100, 140) for _ in range(rng.randint(1, 60 if crowded else 12))]
    requests.append(Request("later", arrival_s, (*shared, *rest, *extra), rng.randint(1, 10)))
    requests.sort(key=lambda request: request.arrival_s)
    params: dict[str, object] = dict(
        block_size=bs,
        num_blocks=rng.randint(10, 40),
        max_num_seqs=8,
        max_num_batched_tokens=rng.choice(
            [13, 14, 18, 21, 22, 26, 30, 34, 38] if crowded else [16, 24, 32, 64, 128]
        ),
        prefix_cache="block_hash",
    )
    return Workload("prefix_cut", tuple(requests)), params


@pytest.mark.parametrize(("seed", "crowded"), [(13, False), (266, False), (400, False), (223, True)])
def test_runs_stop_before_a_reused_prefix_block_lets_the_head_start(seed, crowded, monkeypatch):
    # Seeds (found by search) in which a run's quiet steps end because the next block
    # taken would cut the waiting prompt's match enough for it to start; in the crowded
    # one, only where the budget left after the decodes says so.
    workload, params = _prefix_cut_scenario(seed, crowded)
    stopped = [0]
    blocks_before = PagedKVManager.num_blocks_before_admission
    guard_of = PagedKVManager.admission_guard

    def checked_guard(manager, token_ids, extra_key, seq_ids, num_tokens, max_new_tokens):
        # The scheduler's head: its whole prompt to compute (no beams here), and the
        # step's budget less one token per decoding sequence.
        assert num_tokens == len(token_ids)
        assert max_new_tokens == params["max_num_batched_tokens"] - len(seq_ids)
        return guard_of(manager, token_ids, extra_key, seq_ids, num_tokens, max_new_tokens)

    def counting(manager, guard, limit):
        safe = blocks_before(manager, guard, limit)
        stopped[0] += (
            guard is not None and len(guard.match_blocks) > 0 and safe < min(limit, manager.pool.num_free)
        )
        return safe

    monkeypatch.setattr(PagedKVManager, "num_blocks_before_admission", counting)
    monkeypatch.setattr(PagedKVManager, "admission_guard", checked_guard)
    assert_identical(workload, **params)
    assert stopped[0] > 0


def test_parallel_samples_swap_preemption_and_closed_loop():
    workload = best_of_n(
        6, 40, {"kind": "uniform", "low": 20, "high": 70}, n=3, vocab_size=SPEC.vocab_size, seed=4
    )
    closed = Workload(workload.name, workload.requests, max_concurrency=3)
    assert_identical(closed, min_covered_share=0.3, num_blocks=40, max_num_seqs=9, preemption="swap")


def test_beams_stay_identical():
    beams = random_requests(3, 30, 25, vocab_size=SPEC.vocab_size, seed=6, beam_width=2)
    assert_identical(beams, num_blocks=64)


def test_eos_ends_runs_when_not_ignored():
    # A 12-token vocabulary with EOS among the stand-ins' range [3, 12): EOS comes often.
    spec = dataclasses.replace(SPEC, vocab_size=12, eos_token_id=5)
    workload = random_requests(8, 20, 200, vocab_size=12, seed=7)
    workload = Workload(
        workload.name, tuple(dataclasses.replace(r, ignore_eos=False) for r in workload.requests)
    )
    slow, _ = run(workload, False, spec, num_blocks=128)
    lengths = [len(out[0]) for out in slow.outputs.values()]
    assert min(lengths) < 200  # EOS really ended some sequences early
    assert_identical(workload, spec=spec, num_blocks=128)


def _four_long_requests(check_eos: bool) -> tuple[ModelSpec, Workload]:
    """Four requests arriving together, 100 to 300 output tokens each; where EOS is
    checked, one stand-in in 200 is EOS (vocabulary 203). Pure."""
    spec = dataclasses.replace(SPEC, vocab_size=203, eos_token_id=10) if check_eos else SPEC
    workload = random_requests(
        4, 24, {"kind": "uniform", "low": 100, "high": 300}, vocab_size=spec.vocab_size, seed=3
    )
    requests = tuple(dataclasses.replace(r, ignore_eos=not check_eos) for r in workload.requests)
    return spec, Workload(workload.name, requests)


@pytest.mark.parametrize("check_eos", [False, True])
def test_reserved_steps_span_modeling_windows_in_one_call(check_eos, monkeypatch):
    # Four requests arriving together, with room for all: once they decode, nothing waits,
    # so a run takes its first step alone and reserves every later one in one
    # advance_many call, through the windows its steps are modeled in (8, 16, 32 ...
    # steps: no first window sized by tokens here), up to the first finish: a length
    # limit or, where EOS is checked (one stand-in in 200 is EOS), the first EOS, which
    # may lie in any window (here past the first two).
    monkeypatch.setattr(fast_forward, "FIRST_DECODE_WINDOW_TOKENS", 0)
    spec, workload = _four_long_requests(check_eos)
    calls_per_run: list[int] = []
    reserved: list[int] = []
    fast_run, advance_many = FastForward.run, PagedDecodeRun.advance_many

    def counting_run(fast, *args):  # type: ignore[no-untyped-def]
        calls_per_run.append(0)
        return fast_run(fast, *args)

    def counting_advance_many(run, num_steps, *args):  # type: ignore[no-untyped-def]
        calls_per_run[-1] += 1
        reserved.append(num_steps)
        return advance_many(run, num_steps, *args)

    monkeypatch.setattr(FastForward, "run", counting_run)
    monkeypatch.setattr(PagedDecodeRun, "advance_many", counting_advance_many)
    assert_identical(workload, min_covered_share=0.9, spec=spec, num_blocks=256)
    assert max(calls_per_run) == 1
    assert max(reserved) > 8 + 16  # a reservation reached past the second window
    if check_eos:
        slow, _ = run(workload, False, spec, num_blocks=256)
        limits = {request.request_id: request.max_new_tokens for request in workload.requests}
        # EOS ended one early, in a step past the first two windows (8 + 16) of its run.
        assert any(8 + 16 < len(out[0]) < limits[request_id] for request_id, out in slow.outputs.items())


@pytest.mark.parametrize("check_eos", [False, True])
def test_runs_taking_steps_one_at_a_time_span_modeling_windows(check_eos, monkeypatch):
    # The same four requests with no step known quiet (0 is always a safe answer): every
    # step after a run's first goes alone, and the run models its next window of steps
    # when it reaches the end of the last, up to the first finish.
    monkeypatch.setattr(fast_forward, "FIRST_DECODE_WINDOW_TOKENS", 0)
    monkeypatch.setattr(Scheduler, "quiet_decode_steps", lambda scheduler, pairs, run, max_steps: 0)
    spec, workload = _four_long_requests(check_eos)
    steps_per_run: list[int] = []
    fast_run = FastForward.run

    def counting_run(fast, *args):  # type: ignore[no-untyped-def]
        output = fast_run(fast, *args)
        if output is not None and output.covered_steps is not None:
            steps_per_run.append(len(output.covered_steps.durations_s))
        return output

    monkeypatch.setattr(FastForward, "run", counting_run)
    assert_identical(workload, min_covered_share=0.9, spec=spec, num_blocks=256)
    assert max(steps_per_run) > 8 + 16  # a run went on past its second window


def test_runs_after_sample_0_finished():
    """A best-of-2 request whose sample 0 stops at EOS after one token: the runs that
    follow hold only sample 1, so the covered tokens the runner counts give sample 0 no
    token time at all."""
    spec = dataclasses.replace(SPEC, vocab_size=12, eos_token_id=4)
    workload = best_of_n(1, 20, 60, n=2, vocab_size=12, seed=0)
    workload = Workload(
        workload.name, tuple(dataclasses.replace(r, ignore_eos=False) for r in workload.requests)
    )
    slow, _ = run(workload, False, spec, num_blocks=64)
    assert [len(sample) for sample in next(iter(slow.outputs.values()))] == [1, 9]  # the scenario
    assert len(slow.requests["token_times_s"][0]) == 1
    assert_identical(workload, min_covered_share=0.3, spec=spec, num_blocks=64)


# max_len slab regions of 256 positions: 16 blocks of 16 tokens, a few to an arena.
SHORT_SPEC = dataclasses.replace(SPEC, max_position_embeddings=256)
# The engines the property compares: paged (half the examples, each prefix cache), and slab with each
# reservation and placement.
ENGINE_VARIANTS = [
    *(
        ("paged", {"prefix_cache": prefix_cache})
        for prefix_cache in ("block_hash", "radix", "none", "block_hash")
    ),
    *(
        ("slab", {"reserve": reserve, "placement": placement})
        for reserve in ("request", "max_len")
        for placement in ("first_fit", "best_fit")
    ),
]


@settings(max_examples=120, deadline=None)
@given(
    num_requests=st.integers(1, 8),
    prompt_high=st.integers(2, 120),
    output_high=st.integers(1, 80),
    rate_per_s=st.sampled_from([5.0, 50.0, 1000.0]),
    num_blocks=st.integers(12, 80),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.sampled_from([16, 48, 512]),
    n=st.sampled_from([1, 1, 2]),
    variant=st.sampled_from(ENGINE_VARIANTS),
    tiny_vocab=st.booleans(),
    seed=st.integers(0, 1000),
    chunked_prefill=st.booleans(),
    victim_policy=st.sampled_from(["newest", "priority"]),
    preemption=st.sampled_from(["recompute", "swap"]),
    register_blocks=st.sampled_from(REGISTER_BLOCKS),
)
def test_property_fast_forward_equals_stepping(
    num_requests,
    prompt_high,
    output_high,
    rate_per_s,
    num_blocks,
    max_num_seqs,
    max_num_batched_tokens,
    n,
    variant,
    tiny_vocab,
    seed,
    chunked_prefill,
    victim_policy,
    preemption,
    register_blocks,
):
    # A tiny vocabulary (one regular id) fills blocks with the same ids: keys repeat across
    # requests and samples, so prefix hits, evictions and radix block swaps come often.
    spec = dataclasses.replace(SHORT_SPEC, vocab_size=4, eos_token_id=2) if tiny_vocab else SHORT_SPEC
    workload = random_requests(
        num_requests,
        {"kind": "uniform", "low": 1, "high": prompt_high},
        {"kind": "uniform", "low": 1, "high": output_high},
        {"kind": "poisson", "rate_per_s": rate_per_s},
        vocab_size=spec.vocab_size,
        seed=seed,
        n=n,
        temperature=1.0 if n > 1 else 0.0,
    )
    if victim_policy == "priority":
        workload = with_mixed_priorities(workload)
    engine, engine_params = variant
    # The scheduler's policies: the slab engine takes chunking and the victim policy only
    # (it never swaps, and registers nothing).
    policies: dict[str, object] = {"chunked_prefill": chunked_prefill, "victim_policy": victim_policy}
    if engine == "paged":
        policies.update(preemption=preemption, register_blocks=register_blocks)
    assert_identical(
        workload,
        spec=spec,
        engine_cls=CountingEngine if engine == "paged" else CountingSlabEngine,
        # A slab arena of at least one max_len region (16 blocks): smaller rejects everything.
        num_blocks=num_blocks if engine == "paged" else max(num_blocks, 16),
        max_num_seqs=max(max_num_seqs, n),
        max_num_batched_tokens=max_num_batched_tokens,
        **engine_params,
        **policies,
    )


@pytest.mark.parametrize("seed", range(3))
def test_tiny_vocabulary_drops_and_registrations_interleave_as_stepping(seed):
    # One regular id (vocab 4) and 4-token blocks: every block holds the same tokens,
    # so decode blocks repeat the keys of cached-free blocks. A step's reused blocks must
    # lose their registrations before that step's commits register (and after the
    # previous step's), as step by step; otherwise a commit finds a key free that was
    # taken, or the reverse, and caching differs from then on.
    spec = dataclasses.replace(SPEC, vocab_size=4)
    workload = random_requests(
        14,
        {"kind": "uniform", "low": 6, "high": 30},
        {"kind": "uniform", "low": 20, "high": 80},
        {"kind": "poisson", "rate_per_s": 20.0},
        vocab_size=4,
        seed=seed,
    )
    assert_identical(
        workload, spec=spec, block_size=4, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=64
    )


@pytest.mark.parametrize(("prefix_cache", "peak_kv_slots"), [("radix", 12), ("block_hash", 16)])
def test_sample_peaks_are_taken_before_commits_that_share_blocks(prefix_cache, peak_kv_slots):
    # Two samples of one repeated token (vocab 4, stand-ins all 3): their decode blocks
    # fill with the same ids. A radix commit swaps the second sample's full block for the
    # first's, so the group holds fewer slots after the commit than during the step: the
    # peak (three full blocks, 12 slots) is the one before it, as stepping records it. A
    # block-hash commit moves no reference: the samples keep four blocks (16 slots).
    spec = dataclasses.replace(SPEC, vocab_size=4, eos_token_id=2)
    request = Request("r0", 0.0, (3, 3, 3), 6, n=2, temperature=1.0)
    workload = Workload("two_samples", (request,))
    params = dict(
        block_size=4, num_blocks=4, max_num_seqs=2, max_num_batched_tokens=2, prefix_cache=prefix_cache
    )
    slow, _ = run(workload, False, spec, **params)
    assert slow.outputs == {"r0": ((3,) * 6, (3,) * 6)}
    assert slow.requests["peak_kv_slots"].tolist() == [peak_kv_slots]
    assert_identical(workload, spec=spec, **params)


def test_vectorised_stand_in_tokens_equal_the_scalar_draw():
    from kvbench.engines.sim.stand_in import stand_in_token, stand_in_tokens

    bases = [0, 1, (1 << 63) - 1, 123456789012345]
    samples = [0, 3, 1, 7]
    firsts = [0, 5, 1000, (1 << 40)]
    got = stand_in_tokens(bases, samples, firsts, 6, 128256)
    want = [
        [stand_in_token(b, s, p + k, 128256) for k in range(6)] for b, s, p in zip(bases, samples, firsts)
    ]
    assert got.tolist() == want


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, (1 << 63) - 1), st.integers(0, 64), st.integers(0, 1 << 62)), max_size=6
    ),
    num_steps=st.integers(0, 9),
    vocab_size=st.sampled_from([4, 5, 32000, 128256, 1 << 31]),
)
def test_compiled_stand_in_tokens_equal_the_scalar_draw(rows, num_steps, vocab_size):
    from kvbench.engines.sim.stand_in import stand_in_token, stand_in_tokens

    got = stand_in_tokens(
        [b for b, _, _ in rows], [s for _, s, _ in rows], [p for _, _, p in rows], num_steps, vocab_size
    )
    assert got.shape == (len(rows), num_steps)
    assert got.tolist() == [
        [stand_in_token(b, s, p + k, vocab_size) for k in range(num_steps)] for b, s, p in rows
    ]


class RecordingEngine(CountingEngine):
    """Also keeps what each multi-step output carried besides its decode run."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.covered_with = {"finished": 0, "first_scheduled": 0, "tokens": 0}

    def step(self):  # type: ignore[override]
        output = super().step()
        if output.covered_steps is not None:
            for kind in self.covered_with:
                self.covered_with[kind] += bool(getattr(output, kind))
        return output


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_runs_cover_finishing_and_admitting_steps(ignore_eos):
    # Staggered lengths and arrivals: nearly every step finishes or admits a request. The
    # step producing a sequence's last token ends a run inside it, and a run's first step
    # may admit the waiting head (its prefill chunk and first token ride along).
    spec = SPEC if ignore_eos else dataclasses.replace(SPEC, vocab_size=40, eos_token_id=7)
    workload = random_requests(
        40,
        {"kind": "uniform", "low": 5, "high": 120},
        {"kind": "uniform", "low": 1, "high": 60},
        {"kind": "poisson", "rate_per_s": 40.0},
        vocab_size=spec.vocab_size,
        seed=11,
    )
    workload = Workload(
        workload.name, tuple(dataclasses.replace(r, ignore_eos=ignore_eos) for r in workload.requests)
    )
    params = {"num_blocks": 96, "max_num_seqs": 12, "max_num_batched_tokens": 96}
    covered = assert_identical(workload, min_covered_share=0.3, spec=spec, **params)
    ctx = EngineContext(spec, SLOW, None, "cpu", "fp32", 0, "sim")
    engine = RecordingEngine(ctx, executor=CostModelExecutor.from_context(ctx, block_size=16), **params)
    raw = replay(engine, workload, SimClock())
    assert 1 - engine.num_calls / raw.num_steps == covered
    assert engine.covered_with["finished"] > 10, engine.covered_with
    assert engine.covered_with["first_scheduled"] > 10, engine.covered_with
    assert engine.covered_with["tokens"] > 10, engine.covered_with  # admitted groups' first tokens


def chunked_prompts(**extra: object) -> Workload:
    """16 requests of 20-300 prompt and 5-90 output tokens at 40/s: in steps of 64 tokens or
    fewer, most prompts prefill in chunks next to decoding requests (``extra``: more
    ``random_requests`` arguments)."""
    return random_requests(
        16,
        {"kind": "uniform", "low": 20, "high": 300},
        {"kind": "uniform", "low": 5, "high": 90},
        {"kind": "poisson", "rate_per_s": 40.0},
        vocab_size=SPEC.vocab_size,
        seed=3,
        **extra,
    )


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("prefix_cache", ["block_hash", "radix", "none"])
def test_prompts_prefilled_in_chunks_behind_a_decode_batch_as_stepping(prefix_cache, preemption, monkeypatch):
    # Prompts of up to 300 tokens in chunks of at most 64 tokens a step, in a pool of 40
    # blocks: many steps decode a batch with the newest prompt's next chunk behind it
    # (DecodeBatch.tail), and some of those chunks find no room, so that prompt preempts
    # itself and the step is planned whole for a normal step.
    workload = chunked_prompts()
    outcomes = {"planned": 0, "kept for a normal step": 0}
    plan_tail_after_decodes = Scheduler.plan_tail_after_decodes

    def counting(scheduler, pairs, run, tail):  # type: ignore[no-untyped-def]
        plan = plan_tail_after_decodes(scheduler, pairs, run, tail)
        outcomes["planned" if plan is not None else "kept for a normal step"] += 1
        return plan

    monkeypatch.setattr(Scheduler, "plan_tail_after_decodes", counting)
    params = {"num_blocks": 40, "max_num_seqs": 6, "max_num_batched_tokens": 64}
    assert_identical(workload, 0.15, prefix_cache=prefix_cache, preemption=preemption, **params)
    assert outcomes["planned"] > 5 and outcomes["kept for a normal step"] > 0, outcomes


@pytest.mark.parametrize(
    ("workload", "params"),
    [
        # Priorities: a prefilling group may sit before others in ``running`` (no tail then).
        (
            with_mixed_priorities(chunked_prompts()),
            {"max_num_batched_tokens": 64, "victim_policy": "priority"},
        ),
        (priority_arrivals(), {"num_blocks": 48, "max_num_batched_tokens": 16, "victim_policy": "priority"}),
        # Blocks registered when scheduled: the tail's chunk registers in its step.
        (
            three_turn_chats(4, 120, (5, 60), 40.0, 0.05),
            {"num_blocks": 64, "max_num_batched_tokens": 48, "register_blocks": "on_schedule"},
        ),
        # More sequences than tokens a step: the batch fills the budget, the tail waits.
        (
            chunked_prompts(n=2, temperature=1.0),
            {"num_blocks": 50, "max_num_seqs": 9, "max_num_batched_tokens": 4},
        ),
    ],
    ids=["priorities", "priority_arrivals", "registered_on_schedule", "batch_fills_the_budget"],
)
def test_prefilling_tails_under_other_policies_as_stepping(workload, params):
    assert_identical(workload, **{"num_blocks": 40, "max_num_seqs": 6, **params})


def test_tails_behind_the_default_number_of_sequences_as_stepping(monkeypatch):
    # The production rule (MIN_SEQS_BEFORE_TAIL): 120 requests at once, at most 100 running,
    # in steps of 128 tokens, so a prompt prefills in chunks behind batches of 64 sequences
    # and more (and none behind fewer).
    monkeypatch.setattr(FastForward, "min_seqs_before_tail", fast_forward.MIN_SEQS_BEFORE_TAIL)
    workload = random_requests(
        120,
        {"kind": "uniform", "low": 100, "high": 200},
        {"kind": "uniform", "low": 150, "high": 250},
        vocab_size=SPEC.vocab_size,
        seed=8,
    )
    tails = []
    decode_batch = Scheduler.decode_batch

    def recording(scheduler, min_seqs_before_tail=1):  # type: ignore[no-untyped-def]
        batch = decode_batch(scheduler, min_seqs_before_tail)
        if batch is not None and batch.tail is not None:
            tails.append(len(batch.pairs))
        return batch

    monkeypatch.setattr(Scheduler, "decode_batch", recording)
    assert_identical(workload, 0.1, num_blocks=1024, max_num_seqs=100, max_num_batched_tokens=128)
    assert tails and min(tails) >= fast_forward.MIN_SEQS_BEFORE_TAIL, tails


# --------------------------------------------------------------------------- the slab engine
@pytest.mark.parametrize(
    "reserve, placement, num_blocks",
    [("request", "first_fit", 48), ("request", "best_fit", 48), ("max_len", "first_fit", 72)],
)
def test_slab_queueing_for_a_fragmented_arena(reserve, placement, num_blocks, monkeypatch):
    # Singles, parallel samples and beams queue for holes between regions: external
    # fragmentation, which decode runs must record per step (it lives in usage_counts).
    requests = []
    for i, extra in enumerate([{}, {"n": 2, "temperature": 1.0}, {"beam_width": 2}] * 6):
        base = random_requests(
            1, {"kind": "uniform", "low": 4, "high": 150}, {"kind": "uniform", "low": 5, "high": 60},
            vocab_size=SPEC.vocab_size, seed=40 + i, **extra,
        ).requests[0]  # fmt: skip
        requests.append(dataclasses.replace(base, request_id=f"r{i}", arrival_s=0.004 * i))
    workload = Workload("slab-mix", tuple(requests))
    params = {"reserve": reserve, "placement": placement, "num_blocks": num_blocks, "max_num_seqs": 8}
    slow, _ = run(workload, False, SHORT_SPEC, CountingSlabEngine, **params)
    assert slow.steps["kv_external_frag_bytes"].max() > 0  # requests really wait for holes
    assert (slow.requests["rejected_reason"] == "").all()  # every request fits the arena
    # The runs' recorded fragmentation (usage_columns serves only RunLog.finish).
    covered_frag: list[int] = []
    usage_columns = SlabKVManager.usage_columns

    def recording_usage_columns(kv, counts):
        columns = usage_columns(kv, counts)
        covered_frag.extend(columns["kv.external_frag_bytes"])
        return columns

    monkeypatch.setattr(SlabKVManager, "usage_columns", recording_usage_columns)
    # Beams are never fast-forwarded, samples only once forked: a modest share is covered.
    assert_identical(workload, 0.1, SHORT_SPEC, CountingSlabEngine, **params)
    assert max(covered_frag) > 0  # some runs really recorded fragmentation


def test_slab_eos_ends_runs():
    spec = dataclasses.replace(SPEC, vocab_size=12, eos_token_id=5)
    workload = random_requests(8, 20, 200, vocab_size=12, seed=7)
    workload = Workload(
        workload.name, tuple(dataclasses.replace(r, ignore_eos=False) for r in workload.requests)
    )
    params = {"reserve": "request", "num_blocks": 128}
    slow, _ = run(workload, False, spec, CountingSlabEngine, **params)
    assert min(len(out[0]) for out in slow.outputs.values()) < 200  # EOS really ended some early
    assert_identical(workload, 0.3, spec, CountingSlabEngine, **params)


def _decode_batch_by_the_rule(scheduler) -> tuple[list, object] | None:  # type: ignore[no-untyped-def]
    """``decode_batch``'s answer, pairs and tail, with ``is_decode_ready`` asked of every
    running group (``decode_batch`` asks it only of the groups marked changed): nothing
    swapped, every group ready but perhaps the last, which then ``may_follow_decodes``
    (the tail) behind at least one ready group, the batch within the token budget.
    (Pending rejections and a prepared step never occur below: every request fits, and an
    engine that steps one iteration per call prepares none.)"""
    running = scheduler.running
    if scheduler.swapped or not running:
        return None
    tail = None if is_decode_ready(running[-1]) else running[-1]
    batched = running[:-1] if tail is not None else running
    if not batched or not all(map(is_decode_ready, batched)):
        return None
    if tail is not None and not may_follow_decodes(tail):
        return None
    pairs = [(group, seq) for group in batched for seq in group.seqs]
    return (pairs, tail) if len(pairs) <= scheduler.config.max_num_batched_tokens else None


class BatchCheckingEngine(PagedEngine):
    """Steps one iteration per call; before each, asks ``decode_batch`` and compares it
    with the rule read from every running group."""

    num_batches = 0
    num_tails = 0

    def step(self):  # type: ignore[no-untyped-def]
        expected = _decode_batch_by_the_rule(self.scheduler)
        if expected is not None and expected[1] is not None:
            # A tail behind fewer sequences than asked for: no batch, no mark cleared.
            assert self.scheduler.decode_batch(len(expected[0]) + 1) is None
        batch = self.scheduler.decode_batch()
        assert (batch is None) == (expected is None)
        if batch is not None:
            pairs, tail = expected
            assert batch.pairs == pairs
            assert batch.seqs == [seq for _, seq in pairs]
            assert batch.seq_ids == [seq.seq_id for _, seq in pairs]
            assert batch.tail is tail
            self.num_batches += 1
            self.num_tails += tail is not None
        self.scheduler.check()  # every running group not marked changed is decode-ready
        return super().step()


@pytest.mark.parametrize(
    ("workload", "params", "with_tails"),
    [
        (
            chunked_prompts(),
            {"num_blocks": 40, "max_num_seqs": 6, "max_num_batched_tokens": 64},  # chunks, preemption
            True,
        ),
        (
            best_of_n(
                6, 30, {"kind": "uniform", "low": 10, "high": 60}, n=3, vocab_size=SPEC.vocab_size, seed=4
            ),
            {"num_blocks": 40, "max_num_seqs": 9, "preemption": "swap"},
            False,
        ),
        (
            random_requests(4, 30, 25, vocab_size=SPEC.vocab_size, seed=6, beam_width=2),
            {"num_blocks": 64},
            False,
        ),
        (priority_arrivals(), {"num_blocks": 48, "max_num_seqs": 8, "victim_policy": "priority"}, False),
    ],
    ids=["chunks_and_preemption", "samples_and_swaps", "beams", "priorities"],
)
def test_decode_batch_checks_only_changed_groups_and_answers_as_the_rule(workload, params, with_tails):
    ctx = EngineContext(SPEC, SLOW, None, "cpu", "fp32", 0, "sim")
    engine = BatchCheckingEngine(
        ctx, executor=CostModelExecutor.from_context(ctx, block_size=16), fast_forward=False, **params
    )
    raw = replay(engine, workload, SimClock())
    assert len(raw.requests) == len(workload.requests)
    if not any(request.beam_width > 1 for request in workload.requests):
        assert engine.num_batches > 0  # decode batches were really formed
    if with_tails:
        assert engine.num_tails > 0  # some behind which a prompt was prefilled in chunks


def test_check_catches_running_sequences_kept_out_of_step():
    """``check`` compares the sequences and ids kept next to ``running`` (what
    ``decode_batch`` hands out) with the groups: a pair out of order, a stale id or a
    list of the wrong length each raise."""
    ctx = EngineContext(SPEC, SLOW, None, "cpu", "fp32", 0, "sim")
    engine = PagedEngine(ctx, executor=CostModelExecutor.from_context(ctx, block_size=16), num_blocks=64)
    for request in random_requests(3, 40, 20, vocab_size=SPEC.vocab_size, seed=8).requests:
        engine.add_request(request)
    for _ in range(100):
        if len(engine.scheduler.running) == 3:
            break
        engine.step()
    scheduler = engine.scheduler
    assert len(scheduler.running) == 3
    scheduler.check()
    seqs, ids = scheduler._running_seqs, scheduler._running_seq_ids
    for corrupt, message in [
        (lambda: (seqs.reverse(), ids.reverse()), "is not its one sequence"),
        (lambda: ids.__setitem__(0, ids[0] + 1000), "kept id"),
        (lambda: seqs.pop(), "kept next to them"),
    ]:
        saved_seqs, saved_ids = list(seqs), list(ids)
        corrupt()
        with pytest.raises(AssertionError, match=message):
            scheduler.check()
        seqs[:], ids[:] = saved_seqs, saved_ids
        scheduler.check()


def test_verify_carry_catches_a_carried_batch_that_is_off(monkeypatch):
    """The differential check can fail: carried lengths that miss the run's steps."""
    monkeypatch.setattr(fast_forward.BatchColumns, "advanced", lambda columns, num_steps: columns)
    with pytest.raises(AssertionError, match="carried batch columns differ"):
        test_chat_with_shared_prefixes_and_poisson_arrivals()


@pytest.mark.parametrize(
    ("carried", "asked", "expected"),
    [
        ([], [3, 1], [-1, -1]),  # nothing carried
        ([7, 3, 5], [5, 7, 3], [2, 0, 1]),  # the same sequences, reordered
        ([7, 3, 5], [1, 9, 4, 6], [-1, -1, -1, -1]),  # below the first, past the last, between
        ([7, 3, 5], [3, 8, 7], [1, -1, 0]),
    ],
)
def test_carry_rows_find_each_carried_sequence_and_only_those(carried, asked, expected):
    """``_Carry.rows``: the row each id had in the carried batch, -1 for the others."""
    from kvbench.engines.sim.fast_forward import _Carry

    carry = _Carry.of(np.array(carried, dtype=np.int64), None, None)  # type: ignore[arg-type]
    rows = carry.rows(asked, np.array(asked, dtype=np.int64), ())
    assert rows.dtype == np.int64
    assert rows.tolist() == expected


@pytest.mark.parametrize("num_changed", [0, 1, 3, 8, 9, 15])
def test_carry_rows_drop_the_sequences_of_changed_groups(num_changed):
    """A changed group's sequences get -1 even when carried, on both of ``_Carry.rows``'
    paths (a scan per id up to ``_FEW_CHANGED``, one pass through a set above); changed
    groups that left the batch change nothing."""
    from kvbench.engines.sched.sequence import SequenceGroup
    from kvbench.engines.sim.fast_forward import _FEW_CHANGED, _Carry

    assert 3 <= _FEW_CHANGED < 9  # the parametrisation straddles it
    carried = list(range(100, 140))
    carry = _Carry.of(np.array(carried, dtype=np.int64), None, None)  # type: ignore[arg-type]
    asked = carried[::-1] + [7, 8]  # every carried sequence, reordered, and two new ones
    # Changed groups: every third carried sequence, then one that left the batch.
    changed_ids = carried[::3][: max(num_changed - 1, 0)] + [999] * min(num_changed, 1)
    changed = [
        SequenceGroup(Request(f"r{seq_id}", 0.0, [1, 2, 3], 4), 0, seq_id, 2) for seq_id in changed_ids
    ]
    rows = carry.rows(asked, np.array(asked, dtype=np.int64), changed)
    expected = [
        -1 if seq_id in changed_ids or seq_id not in carried else carried.index(seq_id) for seq_id in asked
    ]
    assert rows.tolist() == expected
