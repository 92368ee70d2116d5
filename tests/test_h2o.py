"""H2O and StreamingLLM: the eviction policy, one bounded sequence, and the batched engine.

Exact scenarios (hand-built scores, a budget above the sequence length matching the dense
reference token for token, memory flat at the budget) plus hypothesis properties of the
policy. The tiny random model (tiny-gqa: 4 layers, 8 q / 2 KV heads) keeps it fast.
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.engines.exec.bounded import BoundedSequenceBackend, ContiguousSlotStorage
from kvbench.engines.h2o import H2OEngine, StreamingEngine
from kvbench.engines.kv.eviction import DropEvicted, EvictionPolicy, TransferCounters
from kvbench.engines.kv.slots import SequenceSlots
from kvbench.model import DenseKVCache, LlamaModel
from kvbench.quality import QualityConfig, evaluate_quality
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import EngineContext, Request

SPEC = ModelSpec()  # tiny-gqa
BYTES_PER_TOKEN = 2 * SPEC.num_layers * SPEC.num_kv_heads * SPEC.head_dim * 4  # fp32


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    torch.set_num_threads(1)
    return LlamaModel.random(SPEC, seed=0)


def make_ctx(model: LlamaModel | None, mode: str = "real") -> EngineContext:
    return EngineContext(
        spec=SPEC, hardware=HardwareSpec(), model=model, device="cpu", kv_dtype="fp32", mode=mode
    )


def dense_greedy(model: LlamaModel, prompt: tuple[int, ...], num_new: int) -> tuple[int, ...]:
    """Greedy tokens with the full dense cache: prefill, then one token per step."""
    cache = DenseKVCache(SPEC, 1, len(prompt) + num_new, "cpu", torch.float32)
    cache.prepare([(0, 0, len(prompt))])
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
    output: list[int] = []
    while True:
        token = int(model.compute_logits(hidden[-1:])[0].argmax())
        output.append(token)
        if len(output) == num_new:
            return tuple(output)
        position = len(prompt) + len(output) - 1
        cache.prepare([(0, position, 1)])
        hidden = model(torch.tensor([token]), torch.tensor([position]), cache)


def random_requests(seed: int, num: int, prompt_len: tuple[int, int], new: tuple[int, int]) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            f"r{i}",
            0.0,
            tuple(rng.randrange(3, SPEC.vocab_size) for _ in range(rng.randint(*prompt_len))),
            rng.randint(*new),
        )
        for i in range(num)
    ]


def run_engine(engine, requests: list[Request], max_steps: int = 3000):
    """Drive to completion, checking the KV manager after every step; returns (outputs, steps)."""
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, tuple[int, ...]] = {}
    rejected: dict[str, str] = {}
    steps = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs, rejected, steps
        out = engine.step()
        engine.kv.check()
        steps.append(out)
        outputs.update((f.request_id, f.output_token_ids[0]) for f in out.finished)
        rejected.update((r.request_id, r.reason) for r in out.rejected)
    raise AssertionError("engine did not finish")


# --------------------------------------------------------------------------- policy
def test_split_gives_heavy_share_of_non_sink_budget():
    assert EvictionPolicy(budget_tokens=20, num_sink_tokens=4, heavy_share=0.5).split(20).num_heavy == 8
    streaming = EvictionPolicy(budget_tokens=20, num_sink_tokens=4, heavy_share=0.0).split(20)
    assert (streaming.num_sink, streaming.num_heavy, streaming.num_recent) == (4, 0, 16)
    # The window always keeps the newest token, even with a heavy share close to 1.
    assert EvictionPolicy(budget_tokens=5, heavy_share=0.99).split(5).num_recent == 1


def test_ratio_budget_is_a_share_of_the_context_with_a_floor():
    policy = EvictionPolicy(budget_ratio=0.1, num_sink_tokens=4)
    assert policy.budget_for(1000) == 100
    assert policy.budget_for(10) == 5  # raised to sinks + 1
    assert EvictionPolicy(budget_tokens=64, budget_ratio=0.1).budget_for(1000) == 64  # tokens win


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"budget_tokens": None, "budget_ratio": None}, "engine.budget_tokens"),
        ({"budget_ratio": 1.5}, "engine.budget_ratio"),
        ({"heavy_share": 1.0}, "engine.heavy_share"),
        ({"score_aggregation": "sum"}, "engine.score_aggregation"),
        ({"budget_tokens": 4, "num_sink_tokens": 4}, "engine.budget_tokens"),
        ({"num_sink_tokens": -1}, "engine.num_sink_tokens"),
    ],
)
def test_bad_policy_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EvictionPolicy(**kwargs).validate()


def test_victim_is_lowest_score_outside_sinks_and_window():
    # Ten tokens, hand-built scores; 2 sinks, window from position 7 on.
    positions = torch.tensor([[3, 0, 8, 1, 5, 9, 2, 6, 4, 7]])  # slot -> position (shuffled slots)
    by_position = {0: 0.0, 1: 0.1, 2: 5.0, 3: 0.7, 4: 0.3, 5: 2.0, 6: 0.9, 7: 0.0, 8: 0.0, 9: 0.0}
    scores = torch.tensor([[[by_position[int(p)] for p in positions[0]]]])  # [Hkv=1, G=1, N]
    policy = EvictionPolicy(budget_tokens=8, num_sink_tokens=2)
    victims = policy.victims(positions, scores, 2, first_recent_position=7)
    # Sinks 0, 1 have the lowest scores and window 7..9 zero scores, but both are protected.
    assert [int(positions[0, s]) for s in victims[0]] == [4, 3]


def test_ties_evict_the_oldest_and_streaming_evicts_the_token_leaving_the_window():
    positions = torch.arange(12)[None, :]
    scores = torch.zeros(1, 1, 12)
    policy = EvictionPolicy(budget_tokens=11, num_sink_tokens=4, heavy_share=0.0)
    assert int(policy.victims(positions, scores, 1, first_recent_position=5)[0, 0]) == 4


def test_gqa_aggregation_mean_and_max_pick_different_victims():
    positions = torch.arange(4)[None, :]
    # Two query heads share the KV head: slot 1 matters to head 0 only, slot 2 a little to both.
    scores = torch.tensor([[[0.1, 1.5, 1.0, 0.0], [0.1, 0.0, 1.0, 0.0]]])  # [Hkv=1, G=2, N=4]
    mean = EvictionPolicy(budget_tokens=3, score_aggregation="mean")
    top = EvictionPolicy(budget_tokens=3, score_aggregation="max")
    # Window from position 3: mean scores (0.1, 0.75, 1.0), max scores (0.1, 1.5, 1.0).
    assert mean.victims(positions, scores, 2, first_recent_position=3)[0].tolist() == [0, 1]
    assert top.victims(positions, scores, 2, first_recent_position=3)[0].tolist() == [0, 2]


def test_too_few_candidates_is_a_clear_error():
    positions = torch.arange(5)[None, :]
    with pytest.raises(ValueError, match="candidates"):
        EvictionPolicy(budget_tokens=4, num_sink_tokens=2).victims(positions, torch.zeros(1, 1, 5), 3, 4)


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(6, 40),
    num_sinks=st.integers(0, 3),
    window=st.integers(1, 5),
    num_victims=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    aggregation=st.sampled_from(["mean", "max"]),
)
def test_partition_properties(num_tokens, num_sinks, window, num_victims, seed, aggregation):
    num_victims = min(num_victims, num_tokens - num_sinks - window)
    if num_victims < 1:
        return
    gen = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.randperm(num_tokens, generator=gen) for _ in range(2)])  # [Hkv=2, N]
    scores = torch.rand(2, 3, num_tokens, generator=gen)  # G = 3
    policy = EvictionPolicy(
        budget_tokens=num_tokens, num_sink_tokens=num_sinks, score_aggregation=aggregation
    )
    first_recent = num_tokens - window
    victims, kept = policy.partition(positions, scores, num_victims, first_recent)
    aggregated = policy.aggregate(scores)
    for head in range(2):
        out, keep = set(victims[head].tolist()), set(kept[head].tolist())
        assert out.isdisjoint(keep) and len(out | keep) == num_tokens
        for slot in out:
            assert num_sinks <= int(positions[head, slot]) < first_recent
        candidates = [
            s
            for s in range(num_tokens)
            if num_sinks <= int(positions[head, s]) < first_recent and s not in out
        ]
        worst_kept = min((float(aggregated[head, s]) for s in candidates), default=math.inf)
        assert max(float(aggregated[head, s]) for s in out) <= worst_kept


# --------------------------------------------------------------------------- one sequence
def feed(backend: BoundedSequenceBackend, model: LlamaModel, tokens: list[int], num_prompt: int) -> None:
    """The quality harness's protocol: a prefill of num_prompt tokens, then one per step."""
    backend.begin(num_prompt)
    steps = [(0, tokens[:num_prompt])] + [(p, [tokens[p]]) for p in range(num_prompt, len(tokens))]
    for start, chunk in steps:
        backend.before_step(start, len(chunk))
        model(torch.tensor(chunk), torch.arange(start, start + len(chunk)), backend)
        backend.after_step(start + len(chunk))


def resident_positions(backend: BoundedSequenceBackend) -> list[list[set[int]]]:
    slots = backend._require()
    return [[set(row[: slots.num_filled].tolist()) for row in layer] for layer in slots.positions]


def test_streaming_keeps_exactly_sinks_and_window(model):
    tokens = random_requests(3, 1, (60, 60), (1, 1))[0].prompt_token_ids
    policy = EvictionPolicy(budget_tokens=16, num_sink_tokens=4, heavy_share=0.0)
    backend = BoundedSequenceBackend(model, 60, policy=policy, tier=DropEvicted())
    feed(backend, model, list(tokens), num_prompt=1)
    want = set(range(4)) | set(range(60 - 12, 60))
    assert all(heads == want for layer in resident_positions(backend) for heads in layer)
    assert not policy.needs_scores
    assert backend._require().scores.abs().sum() == 0  # no scores accumulated


def test_streaming_is_h2o_with_zero_heavy_share(model):
    tokens = list(random_requests(4, 1, (50, 50), (1, 1))[0].prompt_token_ids)
    streaming = StreamingEngine(make_ctx(model), budget_tokens=12, num_sink_tokens=4)
    h2o = H2OEngine(make_ctx(model), budget_tokens=12, num_sink_tokens=4, heavy_share=0.0)
    assert streaming.policy == h2o.policy
    a = streaming.sequence_backend_factory()(model, 50)
    b = h2o.sequence_backend_factory()(model, 50)
    feed(a, model, tokens, 1)
    feed(b, model, tokens, 1)
    assert resident_positions(a) == resident_positions(b)


def test_h2o_keeps_sinks_window_and_heavy_hitters_per_head(model):
    tokens = list(random_requests(5, 1, (64, 64), (1, 1))[0].prompt_token_ids)
    policy = EvictionPolicy(budget_tokens=20, num_sink_tokens=2, heavy_share=0.5)  # 2 + 9 heavy + 9 recent
    backend = BoundedSequenceBackend(model, 64, policy=policy, tier=DropEvicted())
    feed(backend, model, tokens, num_prompt=1)
    protected = set(range(2)) | set(range(64 - 9, 64))
    kept = resident_positions(backend)
    for layer in kept:
        for heads in layer:
            assert len(heads) == 20 and protected <= heads
    # Heads choose heavy hitters independently: at least two (layer, head) sets differ.
    assert len({frozenset(h) for layer in kept for h in layer}) > 1


def test_long_prefill_is_attended_in_full_then_pruned_and_compacted(model):
    tokens = list(random_requests(6, 1, (40, 40), (1, 1))[0].prompt_token_ids)
    policy = EvictionPolicy(budget_tokens=16, num_sink_tokens=2)
    store = DropEvicted().new_store(policy, (4, 8, 2, 32), torch.float32, TransferCounters())
    slots = SequenceSlots(
        policy, 16, SPEC.num_layers, SPEC.num_q_heads, SPEC.num_kv_heads, torch.device("cpu"), store
    )
    storage = ContiguousSlotStorage(
        SPEC.num_layers, 40, SPEC.num_kv_heads, SPEC.head_dim, torch.float32, "cpu"
    )

    class Backend:
        def attend(self, layer, q, k, v):
            return slots.store_and_attend(layer, q, k, v, storage, model.scale)

    slots.begin_step(0, 40, 40)
    hidden = model(torch.tensor(tokens), torch.arange(40), Backend())
    dense = DenseKVCache(SPEC, 1, 40, "cpu", torch.float32)
    dense.prepare([(0, 0, 40)])
    reference = model(torch.tensor(tokens), torch.arange(40), dense)
    torch.testing.assert_close(hidden, reference)  # the prompt saw every token
    assert slots.end_step(storage, prune=True) == 24 and slots.num_filled == 16
    for layer in range(SPEC.num_layers):
        for head in range(SPEC.num_kv_heads):
            kept = slots.positions[layer, head, :16]
            assert torch.all(kept[1:] > kept[:-1])  # compacted in position order
            assert bool((slots.positions[layer, head, 16:] == -1).all())
            torch.testing.assert_close(storage.kv[layer, 0, :16, head], dense.k[layer, 0, kept, head])
            torch.testing.assert_close(storage.kv[layer, 1, :16, head], dense.v[layer, 0, kept, head])


def test_quality_harness_full_budget_is_lossless_and_small_budget_is_bounded(model):
    rng = random.Random(0)
    text = [rng.randrange(3, SPEC.vocab_size) for _ in range(120)]
    config = QualityConfig(passkey_depths=(), num_continuation_prompt_tokens=16, num_continuation_tokens=16)
    full = H2OEngine(make_ctx(model), budget_ratio=1.0).sequence_backend_factory()
    report = evaluate_quality(model, full, text, config=config)
    assert report.top1_agreement == 1.0 and report.kl_mean < 1e-6 and report.first_divergence == 16
    small = functools.partial(
        BoundedSequenceBackend, policy=EvictionPolicy(budget_tokens=24, num_sink_tokens=4), tier=DropEvicted()
    )
    lossy = evaluate_quality(model, small, text, config=config)
    assert lossy.kv_tokens_peak == 24 and lossy.kl_mean > 0.0


# --------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("factory", [H2OEngine, StreamingEngine])
def test_budget_above_sequence_length_matches_dense(model, factory):
    requests = random_requests(1, 6, (3, 70), (2, 20))
    engine = factory(
        make_ctx(model), budget_tokens=96, block_size=8, num_blocks=256, max_num_batched_tokens=48
    )
    outputs, _, steps = run_engine(engine, requests)
    assert outputs == {
        r.request_id: dense_greedy(model, r.prompt_token_ids, r.max_new_tokens) for r in requests
    }
    assert sum(s.stats.num_evicted_tokens for s in steps) == 0


def test_memory_stays_at_the_budget(model):
    request = random_requests(2, 1, (40, 40), (60, 60))[0]
    engine = H2OEngine(
        make_ctx(model),
        budget_tokens=24,
        num_sink_tokens=2,
        block_size=8,
        num_blocks=64,
        max_num_batched_tokens=16,
    )
    _, _, steps = run_engine(engine, [request])
    allocated = [s.stats.kv.allocated_bytes for s in steps]
    block_bytes = 8 * BYTES_PER_TOKEN
    # The 40-token prompt in chunks of 16 is kept in full while it prefills (2, then 4 blocks);
    # the step that completes it prunes to 24 slots = 3 blocks, and decode stays there.
    assert allocated[:2] == [2 * block_bytes, 4 * block_bytes]
    # Step stats read memory as the step executed, so the last step still holds it.
    assert allocated[2:] == [3 * block_bytes] * (len(steps) - 2)
    assert engine.kv.usage().allocated_bytes == 0  # finished and freed after the run
    # Positions fed: 40 + 59 (the last sampled token is never fed back); 24 stay.
    assert sum(s.stats.num_evicted_tokens for s in steps) == 40 + 59 - 24
    assert all(s.stats.bytes_to_host == 0 and s.stats.kv.host_bytes == 0 for s in steps)


def test_swap_preemption_keeps_each_sequences_eviction_state(model):
    # Short prompts grow to the 24-slot budget (3 blocks each) while decoding, then evict:
    # four of them do not fit in 9 blocks, so sequences are swapped out and back.
    requests = random_requests(7, 4, (4, 4), (40, 40))
    big = H2OEngine(make_ctx(model), budget_tokens=24, block_size=8, num_blocks=64)
    expected, _, _ = run_engine(big, requests)
    small = H2OEngine(make_ctx(model), budget_tokens=24, block_size=8, num_blocks=9, preemption="swap")
    outputs, _, steps = run_engine(small, requests)
    assert sum(s.stats.num_preemptions for s in steps) > 0
    assert outputs == expected  # eviction depends only on the sequence's own queries


def test_recompute_preemption_restarts_the_sequence_state(model):
    # Budget above every sequence: lossless, so preempted-and-recomputed outputs must match dense.
    requests = random_requests(8, 4, (4, 4), (40, 40))
    engine = H2OEngine(make_ctx(model), budget_tokens=64, block_size=8, num_blocks=12)
    outputs, _, steps = run_engine(engine, requests)
    assert sum(s.stats.num_preemptions for s in steps) > 0
    assert outputs == {
        r.request_id: dense_greedy(model, r.prompt_token_ids, r.max_new_tokens) for r in requests
    }
    assert engine.executor.states == {}  # every finished sequence's slot state was dropped


def test_parallel_sampling_is_rejected_with_a_reason(model):
    engine = H2OEngine(make_ctx(model), budget_tokens=16)
    request = Request("n3", 0.0, (5, 6, 7), 4, n=3, temperature=0.8)
    outputs, rejected, _ = run_engine(engine, [request, Request("ok", 0.0, (5, 6, 7), 4)])
    assert "n=3" in rejected["n3"] and set(outputs) == {"ok"}


def test_sequence_backend_factory_uses_the_engine_policy(model):
    engine = H2OEngine(make_ctx(model), budget_ratio=0.25, num_sink_tokens=3, score_aggregation="max")
    backend = engine.sequence_backend_factory()(model, 200)
    assert backend.policy == engine.policy and backend.budget == 50


def test_simulation_mode_bounds_memory_and_sizes_the_pool_from_the_hardware(capsys):
    # ``engine=h2o run.mode=sim`` on the command line: the engine takes the cost-model
    # executor itself, and kv_memory_bytes=null sizes the pool as the paged engine does.
    direct = H2OEngine(make_ctx(None, mode="sim"), block_size=8, num_blocks=64, budget_tokens=16)
    _, _, steps = run_engine(direct, [Request("a", 0.0, tuple(range(3, 43)), 30)])
    assert max(s.stats.kv.allocated_bytes for s in steps[1:]) == 2 * 8 * BYTES_PER_TOKEN
    assert all(s.modeled_duration_s is not None and s.modeled_duration_s > 0 for s in steps)
    sized = H2OEngine(make_ctx(None, mode="sim"), block_size=8, kv_memory_bytes=None, budget_tokens=16)
    assert sized.kv.num_blocks > 64 and "blocks x 8 tokens" in capsys.readouterr().out
    with pytest.raises(ValueError, match="engine.kv_memory_bytes: null sizes the pool"):
        H2OEngine(make_ctx(None), block_size=8, kv_memory_bytes=None)
