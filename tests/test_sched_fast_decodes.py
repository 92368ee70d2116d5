"""The scheduler's decode fast path (``Scheduler._plan_running``) against the plain path
(``_plan_running_plain``, ``Scheduler.fast_decodes = False``).

Two engines over the same requests, one per path, step in lockstep, with a shadow
executor (tests/shadow_executor.py: every slot's token is checked, so a wrong block table
or copy shows up) or the cost model (chunk contents unread, as in simulation), on the
paged or the slab KV manager (whose appends return fork copies); every step's plan (chunks with their ids, positions and block tables,
KV ops, token counts, preemptions, first-scheduled and rejected requests), the KV usage
after it, and the finished records must be identical. Random workloads cover preemption
by recompute and swap (the fast path's ``_make_room`` branch), self-preemption, beams
and parallel samples (the plain path's groups), every prefix index, both register-blocks
settings and chunked prefill on and off.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shadow_executor import SPEC, ShadowExecutor

from kvbench.engines.exec.executor import ExecutionResult
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.prefix_cache import NullPrefixIndex
from kvbench.engines.paged import PagedEngine
from kvbench.engines.sched.scheduler import SchedulerOutput
from kvbench.engines.sim.executor import CostModelExecutor
from kvbench.engines.slab import SlabEngine
from kvbench.sim.cost_model import CostModel
from kvbench.specs import HardwareSpec
from kvbench.types import EngineContext, Request


def _plan_of(output: SchedulerOutput) -> tuple:
    """A step's plan as plain values (chunk ids as a list, tables as a tuple)."""
    chunks = tuple(
        (c.seq_id, list(c.token_ids), c.start_pos, tuple(c.block_table), c.sample, c.is_decode)
        for c in output.chunks
    )
    return (
        chunks,
        output.kv_ops,
        output.num_prefill_tokens,
        output.num_decode_tokens,
        output.num_preemptions,
        output.num_recomputed_tokens,
        output.first_scheduled,
        output.rejected,
    )


class RecordingShadow(ShadowExecutor):
    """The shadow executor (chunk contents read), keeping every step's plan."""

    def __init__(self, block_size: int, random_logits: bool) -> None:
        super().__init__(block_size, random_logits)
        self.plans: list[tuple] = []

    def execute(self, output: SchedulerOutput) -> ExecutionResult:
        self.plans.append(_plan_of(output))
        return super().execute(output)


class RecordingCostModel(CostModelExecutor):
    """Simulation's executor (chunk contents unread), keeping every step's plan."""

    def __init__(self, cost_model: CostModel, *, block_size: int) -> None:
        super().__init__(cost_model, block_size=block_size)
        self.plans: list[tuple] = []

    def execute(self, output: SchedulerOutput) -> ExecutionResult:
        self.plans.append(_plan_of(output))
        return super().execute(output)


CTX = EngineContext(SPEC, HardwareSpec(), None, "cpu", "fp32", 0, "sim")


def _engine(
    fast: bool, executor: str, random_logits: bool, **params
) -> tuple[PagedEngine, RecordingShadow | RecordingCostModel]:
    """A paged engine over the shadow executor (``executor="shadow"``) or the cost model
    (``"cost_model"``, stepping one iteration per call), or the slab engine over the cost
    model (``"slab"``), on the fast or the plain path."""
    block_size = params.get("block_size", 16)
    recorder: RecordingShadow | RecordingCostModel
    if executor == "shadow":
        recorder = RecordingShadow(block_size, random_logits)
    else:
        recorder = RecordingCostModel.from_context(CTX, block_size=block_size)
    engine: PagedEngine
    if executor == "slab":
        engine = SlabEngine(CTX, executor=recorder, **params)
    else:
        if executor == "cost_model":
            params["fast_forward"] = False
        engine = PagedEngine(CTX, executor=recorder, **params)
    if isinstance(recorder, RecordingShadow):
        recorder.engine = engine
    engine.scheduler.fast_decodes = fast
    return engine, recorder


def _run_both(
    requests: list[Request],
    executor: str,
    random_logits: bool,
    arrival_steps: list[int] | None = None,
    **params,
) -> list[tuple]:
    """Step a fast-path and a plain-path engine in lockstep; assert every step equal.
    ``arrival_steps[i]``: how many steps run before ``requests[i]`` is added (default: all
    at the start). Returns the plans."""
    fast, fast_recorder = _engine(True, executor, random_logits, **params)
    plain, plain_recorder = _engine(False, executor, random_logits, **params)
    pending = sorted(zip(arrival_steps or [0] * len(requests), range(len(requests)), requests), reverse=True)
    for step in range(5000):
        while pending and pending[-1][0] <= step:
            request = pending.pop()[2]
            fast.add_request(request)
            plain.add_request(request)
        if not plain.has_unfinished():
            assert not fast.has_unfinished()
            if not pending:
                return fast_recorder.plans
            continue  # idle until the next arrival
        fast_out, plain_out = fast.step(), plain.step()
        fast.kv.check()
        fast.scheduler.check()
        assert fast_recorder.plans[-1] == plain_recorder.plans[-1], f"step {step}"
        assert fast.kv.usage() == plain.kv.usage(), f"step {step}"
        assert fast_out.finished == plain_out.finished, f"step {step}"
        assert fast_out.rejected == plain_out.rejected, f"step {step}"
    raise AssertionError("the engines did not finish in 5000 steps")


request_st = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.lists(st.integers(3, 50), min_size=0, max_size=30),  # own tail
    st.integers(1, 12),  # max_new_tokens
    st.sampled_from(["single", "single", "n", "beam"]),
    st.integers(2, 3),  # n or beam width
    st.integers(0, 3),  # priority
    st.booleans(),  # ignore_eos
    st.integers(0, 30),  # steps before it arrives
)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request_st, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(4, 40),
    max_num_batched_tokens=st.integers(1, 40),
    max_num_seqs=st.integers(1, 8),
    chunked=st.booleans(),
    prefix_cache=st.sampled_from(["block_hash", "radix", "none"]),
    preemption=st.sampled_from(["recompute", "swap"]),
    victim_policy=st.sampled_from(["newest", "priority"]),
    num_host_blocks=st.integers(0, 24),
    register_blocks=st.sampled_from(["on_completion", "on_schedule"]),
    executor=st.sampled_from(["shadow", "cost_model", "slab"]),
    random_logits=st.booleans(),
)
def test_fast_and_plain_paths_plan_the_same_steps(
    requests,
    block_size,
    num_blocks,
    max_num_batched_tokens,
    max_num_seqs,
    chunked,
    prefix_cache,
    preemption,
    victim_policy,
    num_host_blocks,
    register_blocks,
    executor,
    random_logits,
):
    prefixes = [[7] * 9, list(range(10, 30)), []]
    built = []
    for i, (prefix, tail, max_new, kind, width, priority, ignore_eos, _) in enumerate(requests):
        extra = {"n": width} if kind == "n" else {"beam_width": width} if kind == "beam" else {}
        prompt = tuple(prefixes[prefix] + tail or [5])
        built.append(
            Request(
                f"r{i}",
                0.0,
                prompt,
                max_new,
                priority=priority,
                temperature=1.0,
                ignore_eos=ignore_eos,
                **extra,
            )
        )
    params = dict(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        chunked_prefill=chunked,
        victim_policy=victim_policy,
    )
    if executor == "slab":
        # The slab shares nothing and recomputes; a request reservation lets several run.
        params["reserve"] = "request"
    else:
        params.update(
            prefix_cache=prefix_cache,
            preemption=preemption,
            num_host_blocks=num_host_blocks,
            register_blocks=register_blocks,
        )
        # The shadow checks every position a chunk attends to before the step's writes: a
        # hit on blocks computed in the same step (on_schedule) is for the cost model only.
        if register_blocks == "on_schedule":
            executor = "cost_model"
    _run_both(built, executor, random_logits, [request[-1] for request in requests], **params)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_decode_steps_that_preempt_plan_the_same(preemption: str) -> None:
    # Six single-sample requests decode in a pool too small for all of them: decode
    # tokens (the fast path) run out of blocks and preempt the newest groups, which
    # return later; the two paths must take the same victims at the same steps.
    requests = [Request(f"r{i}", 0.0, tuple(range(3 + i, 13 + i)), 20, ignore_eos=True) for i in range(6)]
    plans = _run_both(
        requests,
        "shadow",
        False,
        block_size=4,
        num_blocks=24,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        prefix_cache="none",
        preemption=preemption,
        num_host_blocks=24,
    )
    preempting = [plan for plan in plans if plan[4] > 0]
    assert preempting, "the scenario no longer preempts"
    # Some preemption happened in a step of decode chunks only (the fast path's branch).
    assert any(all(chunk[5] for chunk in plan[0]) for plan in preempting)


def test_decodes_behind_a_prefill_past_the_budget_plan_the_same() -> None:
    # Unchunked prefill may run past the budget (7 here): the forked groups' recomputes
    # after swap-outs leave it negative with decode groups still behind them in
    # ``running``, which then get no token, on either path. (Found by a random lockstep
    # run with requests arriving between steps; the fast path once sliced the running
    # groups by the negative budget, from the end, and gave them a token.)
    requests = [
        (Request("r0", 0.0, (50,), 20, priority=2, temperature=1.0), 13),
        (Request("r1", 0.0, (46, 36, 14, 11, 31, 49), 2, priority=1, temperature=1.0, ignore_eos=True), 4),
        (Request("r2", 0.0, (11,), 18, n=2, temperature=1.0, ignore_eos=True), 23),
        (Request("r3", 0.0, (20, 21, 22, 14, 33), 11, n=3, temperature=1.0, ignore_eos=True), 30),
        (Request("r4", 0.0, (37, 6, 29), 17, temperature=1.0), 5),
        (Request("r5", 0.0, (17,), 16, n=3, temperature=1.0, ignore_eos=True), 24),
        (Request("r6", 0.0, (18, 39, 17, 8), 14, n=3, priority=2, temperature=1.0, ignore_eos=True), 7),
        (
            Request(
                "r7", 0.0, (8, 8, 24, 4, 10), 20, beam_width=3, priority=1, temperature=1.0, ignore_eos=True
            ),
            15,
        ),
        (Request("r8", 0.0, (16, 11, 32, 50, 17), 10, temperature=1.0, ignore_eos=True), 16),
        (Request("r9", 0.0, (8, 31, 24), 9, temperature=1.0, ignore_eos=True), 26),
    ]
    plans = _run_both(
        [request for request, _ in requests],
        "shadow",
        True,
        [step for _, step in requests],
        block_size=4,
        num_blocks=13,
        max_num_batched_tokens=7,
        max_num_seqs=6,
        chunked_prefill=False,
        victim_policy="newest",
        prefix_cache="none",
        preemption="swap",
        num_host_blocks=5,
    )
    assert any(plan[2] + plan[3] > 7 for plan in plans), "no step ran past the budget"


def test_a_decode_left_out_of_a_full_budget_plans_the_same() -> None:
    # Budget 4: step 1 runs a's 2-token prompt, b's (n=3) and c's 1-token prompts. In
    # step 2 b's three samples and a's decode take the whole budget: c, decoding alone in
    # its group (the fast path's case), gets no token until a finishes.
    requests = [
        Request("a", 0.0, (5, 6), 3, ignore_eos=True),
        Request("b", 0.0, (7,), 6, n=3, temperature=1.0, ignore_eos=True),
        Request("c", 0.0, (8,), 6, ignore_eos=True),
    ]
    plans = _run_both(
        requests, "shadow", False, block_size=4, num_blocks=32, max_num_batched_tokens=4, max_num_seqs=8
    )
    assert plans[0][6] == ("a", "b", "c")
    seq_c = plans[0][0][2][0]
    assert all(chunk[0] != seq_c for chunk in plans[1][0])  # c left out of step 2
    assert any(chunk[0] == seq_c and chunk[5] for plan in plans[2:] for chunk in plan[0])


def test_a_prompts_last_token_registers_on_schedule_the_same() -> None:
    # register_blocks=on_schedule, block size 4, budget 7: a computes 7 of its 8 prompt
    # tokens, then its last one alone (the fast path's case, not a decode): that
    # registers a's second block at once, so b (a's prompt + 4), admitted in the same
    # pass, hits all 8 tokens.
    prompt = tuple(range(10, 18))
    requests = [Request("a", 0.0, prompt, 2, ignore_eos=True), Request("b", 0.0, prompt + (3, 4, 5, 6), 2)]
    plans = _run_both(
        requests,
        "cost_model",
        False,
        block_size=4,
        num_blocks=32,
        max_num_batched_tokens=7,
        max_num_seqs=2,
        prefix_cache="block_hash",
        register_blocks="on_schedule",
    )
    assert plans[0][6] == ("a",) and plans[1][6] == ("b",)
    (_, a_ids, a_start, _, _, a_decode), (_, b_ids, b_start, _, _, _) = plans[1][0]
    assert (len(a_ids), a_start, a_decode) == (1, 7, False)
    assert (b_start, len(b_ids)) == (8, 4)  # b's cached prefix is a's whole prompt


class CountingKV(PagedKVManager):
    """A paged manager recording how many sequences each ``append_decodes`` call names and
    counting ``can_append`` calls."""

    def __init__(self, num_blocks: int, block_size: int, bytes_per_token: int) -> None:
        super().__init__(num_blocks, block_size, bytes_per_token, NullPrefixIndex())
        self.batches: list[int] = []
        self.num_can_append = 0

    def append_decodes(self, seq_ids):
        self.batches.append(len(seq_ids))
        return super().append_decodes(seq_ids)

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        self.num_can_append += 1
        return super().can_append(seq_id, num_new_tokens)


@pytest.mark.parametrize(
    ("fast", "expected_batches", "expected_asks"), [(True, [4], 0), (False, [1, 1, 1, 1], 4)]
)
def test_the_fast_path_is_the_one_that_runs(
    fast: bool, expected_batches: list[int], expected_asks: int
) -> None:
    # A plain decode step of four sequences: the fast path reserves their slots in one
    # append_decodes call without asking first (it stops where a sequence has no room,
    # per the KV contract); the plain path asks can_append, then appends each one (the
    # paged manager's append of one slot is a batch of one).
    engine, shadow = _engine(
        fast, "shadow", False, block_size=4, num_blocks=32, kv_manager_factory=CountingKV
    )
    for i in range(4):
        engine.add_request(Request(f"r{i}", 0.0, (5, 6, 7), 8, ignore_eos=True))
    engine.step()  # the prefills
    engine.step()  # the first decode step
    kv = engine.kv
    assert isinstance(kv, CountingKV)
    kv.batches.clear()
    kv.num_can_append = 0
    engine.step()
    assert all(chunk[5] for chunk in shadow.plans[-1][0]) and len(shadow.plans[-1][0]) == 4
    assert kv.batches == expected_batches
    assert kv.num_can_append == expected_asks
