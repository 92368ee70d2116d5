"""Scheduler and KV plumbing of the paged engine, without tensors.

A shadow executor (tests/shadow_executor.py) stands in for the model: prefix sharing,
copy-on-write, swap and recompute bugs all show up as a wrong token in some KV slot.
"""

from __future__ import annotations

import pytest
from engine_driver import drive_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shadow_executor import SPEC, make_engine

from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.prefix_cache import NullPrefixIndex
from kvbench.engines.paged import PagedEngine
from kvbench.engines.sched.scheduler import Scheduler, SchedulerConfig, is_decode_chunk
from kvbench.sim.cost_model import StepShape
from kvbench.types import Request


def run(engine: PagedEngine, max_steps: int = 5000) -> tuple[dict, dict, list]:
    return drive_engine(engine, (), max_steps)


def req(rid: str, prompt, max_new: int, **kw) -> Request:
    return Request(rid, 0.0, tuple(prompt), max_new, **kw)


# --------------------------------------------------------------------------- property test
request_st = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.lists(st.integers(3, 50), min_size=0, max_size=30),  # own tail
    st.integers(1, 10),  # max_new_tokens
    st.sampled_from(["single", "n", "beam"]),
    st.integers(2, 3),  # n or beam width
    st.integers(0, 3),  # priority
    st.booleans(),  # ignore_eos
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request_st, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(4, 48),
    max_num_batched_tokens=st.integers(1, 48),
    max_num_seqs=st.integers(1, 8),
    chunked=st.booleans(),
    prefix_cache=st.sampled_from(["block_hash", "radix", "none"]),
    preemption=st.sampled_from(["recompute", "swap"]),
    victim_policy=st.sampled_from(["newest", "priority"]),
    num_host_blocks=st.integers(0, 24),
    random_logits=st.booleans(),
)
def test_random_workloads_finish_with_consistent_kv(
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
    random_logits,
):
    engine, _ = make_engine(
        random_logits,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        chunked_prefill=chunked,
        prefix_cache=prefix_cache,
        preemption=preemption,
        victim_policy=victim_policy,
        num_host_blocks=num_host_blocks,
    )
    prefixes = [[7] * 9, list(range(10, 30)), []]
    expected = {}
    for i, (prefix, tail, max_new, kind, width, priority, ignore_eos) in enumerate(requests):
        prompt = prefixes[prefix] + tail or [5]
        extra = {"n": width} if kind == "n" else {"beam_width": width} if kind == "beam" else {}
        expected[f"r{i}"] = (max_new, width if kind != "single" else 1, ignore_eos)
        engine.add_request(
            req(f"r{i}", prompt, max_new, priority=priority, temperature=1.0, ignore_eos=ignore_eos, **extra)
        )
    finished, rejected, _ = run(engine)
    assert set(finished) | set(rejected) == set(expected)
    for rid, record in finished.items():
        max_new, num_samples, ignore_eos = expected[rid]
        assert len(record.output_token_ids) == num_samples
        for tokens in record.output_token_ids:
            if ignore_eos:
                assert len(tokens) == max_new
            else:  # stops at the first EOS or at the length limit
                assert 1 <= len(tokens) <= max_new and SPEC.eos_token_id not in tokens[:-1]
                assert len(tokens) == max_new or tokens[-1] == SPEC.eos_token_id
        assert record.peak_kv_slots <= record.peak_kv_slots_unshared
    usage = engine.kv.usage()
    assert usage.num_blocks_in_use == 0 and usage.host_bytes == 0, usage


# --------------------------------------------------------------------------- scenarios
def test_fits_alone_never_rejected_even_with_tiny_pool():
    # Each request needs ceil((8 + 6 - 1) / 4) = 4 blocks; the pool holds 4: they run one at a time.
    engine, _ = make_engine(block_size=4, num_blocks=4, max_num_batched_tokens=16)
    for i in range(3):
        engine.add_request(req(f"r{i}", range(3 + 10 * i, 11 + 10 * i), 6))
    finished, rejected, outputs = run(engine)
    assert not rejected and set(finished) == {"r0", "r1", "r2"}
    assert sum(o.stats.num_preemptions for o in outputs) > 0


def test_rejection_reasons():
    engine, _ = make_engine(
        block_size=4, num_blocks=8, max_num_seqs=2, chunked_prefill=False, max_num_batched_tokens=64
    )
    engine.add_request(req("too_long", range(3, 2000), 100))
    engine.add_request(req("too_big", range(3, 40), 10))  # ceil(48 / 4) = 12 blocks > 8
    engine.add_request(req("too_many", range(3, 10), 4, n=3))
    engine.add_request(req("empty", (), 4))
    engine.add_request(req("no_chunk", range(3, 70), 1))  # 67 > 64 with chunking off
    engine.add_request(req("ok", range(3, 10), 4))
    finished, rejected, _ = run(engine)
    assert set(finished) == {"ok"}
    assert "exceeds the model's max positions 2048" in rejected["too_long"].reason
    assert rejected["too_big"].reason == "needs 12 KV blocks of 4 tokens, the whole pool has 8"
    assert "more than engine.max_num_seqs=2" in rejected["too_many"].reason
    assert rejected["empty"].reason == "empty prompt"
    assert "with chunked_prefill off" in rejected["no_chunk"].reason


def test_rejected_reported_even_when_nothing_else_runs():
    engine, _ = make_engine(block_size=4, num_blocks=2)
    engine.add_request(req("big", range(3, 40), 4))
    assert engine.has_unfinished()
    out = engine.step()
    assert [r.request_id for r in out.rejected] == ["big"]
    assert not engine.has_unfinished()


@pytest.mark.parametrize(("victim_policy", "expected_victim"), [("newest", "c"), ("priority", "b")])
def test_preemption_victim_order(victim_policy, expected_victim):
    # Three requests of 8 prompt tokens grow to 8 + 12 - 1 = 19 slots (5 blocks of 4) each;
    # the 12-block pool holds all three prompts (6 blocks) but not their growth.
    engine, _ = make_engine(
        block_size=4, num_blocks=12, max_num_batched_tokens=64, victim_policy=victim_policy
    )
    engine.add_request(req("a", range(3, 11), 12, priority=0))
    engine.add_request(req("b", range(20, 28), 12, priority=5))
    engine.add_request(req("c", range(40, 48), 12, priority=1))
    first_victims = None
    for _ in range(200):
        out = engine.step()
        engine.kv.check()
        engine.scheduler.check()
        if out.stats.num_preemptions and first_victims is None:
            first_victims = [g.request_id for g in engine.scheduler.waiting]
        if not engine.has_unfinished():
            break
    assert first_victims == [expected_victim]


def test_preempted_group_returns_to_front_of_waiting_queue():
    # "a" and "b" (5 blocks each at their peak) do not both fit in 9 blocks; "late" waits
    # behind them because max_num_seqs is 2.
    engine, _ = make_engine(
        block_size=4, num_blocks=9, max_num_batched_tokens=64, max_num_seqs=2, prefix_cache="none"
    )
    engine.add_request(req("a", range(3, 11), 12))
    engine.add_request(req("b", range(20, 28), 12))
    engine.add_request(req("late", range(40, 48), 12))
    for _ in range(100):
        out = engine.step()
        if out.stats.num_preemptions:
            break
    else:
        raise AssertionError("no preemption happened")
    # "b" (newest running) was preempted and sits ahead of "late", which arrived after it.
    assert [g.request_id for g in engine.scheduler.waiting] == ["b", "late"]
    # Without a prefix cache everything "b" had computed is computed again.
    lost = engine.scheduler.waiting[0].seqs[0].num_lost_tokens
    assert lost >= 8
    finished, _, outputs = run(engine)
    assert finished["b"].num_preemptions == 1
    assert finished["b"].num_recomputed_tokens == lost
    assert sum(o.stats.num_recomputed_tokens for o in outputs) == lost


def test_swap_preemption_moves_blocks_to_host_and_back():
    engine, _ = make_engine(block_size=4, num_blocks=12, max_num_batched_tokens=64, preemption="swap")
    for i, rid in enumerate("abc"):
        engine.add_request(req(rid, range(3 + 20 * i, 11 + 20 * i), 12))
    finished, _, outputs = run(engine)
    to_host = sum(o.stats.bytes_to_host for o in outputs)
    from_host = sum(o.stats.bytes_from_host for o in outputs)
    assert to_host > 0 and to_host == from_host
    assert to_host % engine.bytes_per_block == 0
    assert sum(o.stats.num_recomputed_tokens for o in outputs) == 0
    assert any(o.stats.num_swapped for o in outputs)
    assert sum(f.num_preemptions for f in finished.values()) == sum(o.stats.num_preemptions for o in outputs)


def test_chunked_prefill_respects_token_budget():
    engine, _ = make_engine(block_size=4, num_blocks=64, max_num_batched_tokens=8)
    engine.add_request(req("long", range(3, 40), 3))
    engine.add_request(req("short", range(50, 53), 3))
    _, _, outputs = run(engine)
    assert all(o.stats.num_scheduled_tokens <= 8 for o in outputs)
    # 37 prompt tokens in chunks of at most 8 (the short prompt shares the first steps' budget).
    assert sum(o.stats.num_prefill_tokens for o in outputs) == 37 + 3
    assert outputs[0].first_scheduled == ("long",)


def test_prefix_cache_hits_counted_in_tokens():
    engine, _ = make_engine(block_size=4, num_blocks=64)
    shared = list(range(3, 21))  # 18 tokens: 4 full blocks
    engine.add_request(req("first", shared + [30, 31], 2))
    run(engine)
    engine.add_request(req("second", shared + [40], 2))
    finished, _, outputs = run(engine)
    assert finished["second"].num_cached_prompt_tokens == 16
    assert outputs[0].stats.num_prefix_query_tokens == 19
    assert outputs[0].stats.num_prefix_hit_tokens == 16
    assert outputs[0].stats.num_prefill_tokens == 3


def test_scheduler_config_errors_name_the_parameter():
    kv = PagedKVManager(8, 4, 16, NullPrefixIndex())
    with pytest.raises(ValueError, match=r"^engine.max_num_seqs: must be > 0, got 0$"):
        Scheduler(kv, SchedulerConfig(max_num_seqs=0), eos_token_id=2)
    with pytest.raises(ValueError, match=r"^engine.preemption: must be one of"):
        Scheduler(kv, SchedulerConfig(preemption="drop"), eos_token_id=2)
    with pytest.raises(ValueError, match=r"^engine.victim_policy: must be one of"):
        Scheduler(kv, SchedulerConfig(victim_policy="oldest"), eos_token_id=2)


class _PickyKV(PagedKVManager):
    """A manager with its own capacity rule: it never holds prompts longer than 8 tokens."""

    def reject_reason(self, request: Request) -> str | None:
        return "picky: prompt over 8 tokens" if request.num_prompt_tokens > 8 else None


def test_kv_manager_factory_gets_the_sized_pool_and_its_reject_hook_is_used():
    built = []

    def factory(num_blocks: int, block_size: int, bytes_per_token: int) -> _PickyKV:
        built.append((num_blocks, block_size, bytes_per_token))
        return _PickyKV(num_blocks, block_size, bytes_per_token, NullPrefixIndex())

    engine, _ = make_engine(block_size=4, kv_memory_bytes=4 * 1024 * 1024, kv_manager_factory=factory)
    assert built == [(engine.num_blocks, 4, engine.bytes_per_token)]
    assert engine.num_blocks == 4 * 1024 * 1024 // engine.bytes_per_block
    assert isinstance(engine.kv, _PickyKV) and engine.scheduler.kv is engine.kv
    engine.add_request(req("long", range(3, 20), 2))
    engine.add_request(req("short", range(3, 8), 2))
    finished, rejected, _ = run(engine)
    assert set(finished) == {"short"}
    assert rejected["long"].reason == "picky: prompt over 8 tokens"


def _drive_prompts(prompts: list, chunk_contents: bool = True) -> tuple[list[tuple], list[list[str]]]:
    """Run prompts to completion on a bare scheduler (one sequence at a time, stand-in
    token 7); returns every step's chunks (ids, start, sample, block table) and the
    token-id types of waiting groups."""
    from kvbench.engines.kv.prefix_cache import BlockHashPrefixIndex

    kv = PagedKVManager(32, 4, 16, BlockHashPrefixIndex())
    sched = Scheduler(
        kv,
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=6),
        eos_token_id=2,
        chunk_contents=chunk_contents,
    )
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", 0.0, prompt, 3, ignore_eos=True))
    steps, waiting_types = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        steps.append(
            tuple(
                (c.seq_id, list(c.token_ids), c.start_pos, c.sample, tuple(c.block_table)) for c in out.chunks
            )
        )
        waiting_types.append([type(g.seqs[0].token_ids).__name__ for g in sched.waiting])
        for group, seq in sched.complete_step():
            sched.append_token(group, seq, 7)
        sched.pop_finished()
        kv.check()
    return steps, waiting_types


def test_numpy_prompts_stay_their_arrays_and_schedule_like_tuples():
    np = pytest.importorskip("numpy")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 20, 21], [30, 31, 32]]
    arrays = []
    for p in prompts:
        a = np.asarray(p, dtype=np.int32)
        a.setflags(write=False)
        arrays.append(a)
    steps_np, waiting_np = _drive_prompts(arrays)
    steps_tuple, _ = _drive_prompts([tuple(p) for p in prompts])
    assert steps_np == steps_tuple
    # Every sequence of a numpy prompt reads the request's own array (no list copy).
    assert all(types == ["ArrayTokenIds"] * len(types) for types in waiting_np)
    assert all(len(types) == 2 for types in waiting_np[:1])
    from kvbench.engines.sched.sequence import SequenceGroup

    group = SequenceGroup(Request("r", 0.0, arrays[0], 3), 0, 0, eos_token_id=2)
    assert group.seqs[0].token_ids.array is arrays[0]
    # A non-integer array (outside Request's contract) still becomes a list, as before.
    odd = SequenceGroup(Request("f", 0.0, np.asarray([3.0, 4.0]), 3), 0, 0, eos_token_id=2)
    assert odd.seqs[0].token_ids == [3.0, 4.0]


def test_chunks_without_contents_schedule_the_same_tokens_without_tables():
    # A pricing-only executor (simulation) reads neither ids nor tables: chunks then
    # carry a view of the same ids and an empty table; the plan is otherwise the same.
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 20, 21], [30, 31, 32]]
    with_contents, _ = _drive_prompts(prompts)
    without, _ = _drive_prompts(prompts, chunk_contents=False)
    assert [[chunk[:4] for chunk in step] for step in without] == [
        [chunk[:4] for chunk in step] for step in with_contents
    ]
    assert all(chunk[4] == () for step in without for chunk in step)
    assert any(len(chunk[4]) > 1 for step in with_contents for chunk in step)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    max_new=st.integers(1, 12),
    num_blocks=st.integers(14, 40),  # 56+ slots: every request fits alone (none rejected)
    budget=st.integers(1, 24),
    preemption=st.sampled_from(["recompute", "swap"]),
)
def test_every_chunk_is_a_decode_exactly_when_is_decode_chunk_says(
    prompt_lens, max_new, num_blocks, budget, preemption
):
    """``_finalize_pieces`` writes ``is_decode_chunk``'s rule out inline (a call per
    running sequence per step cost ~3 % of a step): every chunk's ``is_decode`` equals
    the rule asked of its sequence as planned, through prefill chunks, prompts' last
    tokens, decodes and recomputation after preemption. The step's token counts and
    ``shape``, built in the same loop, are its chunks'."""
    kv = PagedKVManager(num_blocks, 4, 16, NullPrefixIndex(), num_host_blocks=num_blocks)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, preemption=preemption)
    scheduler = Scheduler(kv, config, eos_token_id=2)
    for i, length in enumerate(prompt_lens):
        scheduler.add(req(f"r{i}", range(3, 3 + length), max_new))
    num_decodes = 0
    for _ in range(2000):
        if not (scheduler.running or scheduler.waiting or scheduler.swapped):
            break
        output = scheduler.schedule()
        seqs = {seq.seq_id: seq for group in scheduler.running for seq in group.seqs}
        for chunk in output.chunks:
            rule = is_decode_chunk(seqs[chunk.seq_id], chunk.start_pos, len(chunk.token_ids))
            assert chunk.is_decode == rule, chunk
            num_decodes += chunk.is_decode
        assert output.num_decode_tokens == sum(chunk.is_decode for chunk in output.chunks)
        # The shape _finalize_pieces builds with the chunks is the chunks' own.
        prefill = [(chunk.start_pos, len(chunk.token_ids)) for chunk in output.chunks if not chunk.is_decode]
        decode_lens = [chunk.start_pos + 1 for chunk in output.chunks if chunk.is_decode]
        assert output.shape == StepShape.build(prefill, decode_lens), output.chunks
        assert output.num_prefill_tokens == sum(num_tokens for _, num_tokens in prefill)
        for group, seq in scheduler.complete_step():
            scheduler.append_token(group, seq, 7)
        scheduler.pop_finished()
    assert not (scheduler.running or scheduler.waiting or scheduler.swapped)
    assert max_new == 1 or num_decodes > 0
