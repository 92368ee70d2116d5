"""The paged engine on the real tiny model: token-exact against a dense reference.

The reference runs each request alone through LlamaModel + DenseKVCache (prefill the
prompt, then one token per step), sampling with the same SampleKeys, so any difference
comes from paging, batching, chunking, prefix sharing, copy-on-write or preemption.
Beam search is compared with a brute-force reference that recomputes every beam from
scratch each step and ranks all (beam, token) continuations in plain Python.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from engine_driver import drive_engine

from kvbench.engines.exec.sampler import SampleKey, Sampler
from kvbench.engines.paged import PagedEngine
from kvbench.model import DenseKVCache, LlamaModel
from kvbench.sizing import weight_bytes
from kvbench.specs import HardwareSpec, ModelSpec, SpecError
from kvbench.types import EngineContext, Request

SPEC = ModelSpec()  # tiny-gqa: 4 layers, 8 q heads, 2 kv heads, head dim 32, vocab 4096


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    torch.set_num_threads(1)
    return LlamaModel.random(SPEC, seed=0)


def make_engine(model: LlamaModel, **params) -> PagedEngine:
    ctx = EngineContext(
        spec=SPEC, hardware=HardwareSpec(), model=model, device="cpu", kv_dtype="fp32", seed=0
    )
    return PagedEngine(ctx, **{"decode_backend": "torch", **params})


def run(engine: PagedEngine, requests: list[Request], max_steps: int = 2000):
    return drive_engine(engine, requests, max_steps)


# --------------------------------------------------------------------------- references
def logits_of(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """fp32 logits of the last position after running ``tokens`` from scratch."""
    cache = DenseKVCache(SPEC, 1, len(tokens), "cpu", torch.float32)
    cache.prepare([(0, 0, len(tokens))])
    hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), cache)
    return model.compute_logits(hidden[-1:])[0]


def dense_generate(
    model: LlamaModel, request: Request, sample_index: int = 0, seed: int = 0
) -> tuple[int, ...]:
    """One sample of ``request`` alone: prefill, then one decode token per step (dense cache)."""
    sampler = Sampler(seed)
    prompt = list(request.prompt_token_ids)
    max_len = len(prompt) + request.max_new_tokens
    cache = DenseKVCache(SPEC, 1, max_len, "cpu", torch.float32)
    cache.prepare([(0, 0, len(prompt))])
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
    output: list[int] = []
    while True:
        logits = model.compute_logits(hidden[-1:])
        key = SampleKey(request.request_id, sample_index, len(output), request.temperature)
        token = sampler.sample(logits, [key])[0]
        output.append(token)
        if len(output) == request.max_new_tokens:
            return tuple(output)
        position = len(prompt) + len(output) - 1
        cache.prepare([(0, position, 1)])
        hidden = model(torch.tensor([token]), torch.tensor([position]), cache)


def brute_beam_search(model: LlamaModel, request: Request) -> list[tuple[int, ...]]:
    """Beam search by recomputation: rank every (beam, token) by float64 cumulative log-prob."""
    width = request.beam_width
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    for _ in range(request.max_new_tokens):
        candidates = []
        for b, (output, score) in enumerate(beams):
            logprobs = torch.log_softmax(
                logits_of(model, list(request.prompt_token_ids) + output), -1
            ).tolist()
            candidates.extend((score + lp, b, token) for token, lp in enumerate(logprobs))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        beams = [(beams[b][0] + [token], score) for score, b, token in candidates[:width]]
    return [tuple(output) for output, _ in beams]


def random_prompt(rng: random.Random, length: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, SPEC.vocab_size) for _ in range(length))


def mixed_requests(seed: int = 1) -> list[Request]:
    """Different lengths, a shared 40-token system prefix on some, and one n=3 sampled request."""
    rng = random.Random(seed)
    system = random_prompt(rng, 40)
    requests = []
    for i, (length, max_new, shared) in enumerate(
        [(5, 7, False), (33, 5, True), (17, 9, False), (50, 4, True), (1, 6, False), (21, 8, True)]
    ):
        prompt = (system if shared else ()) + random_prompt(rng, length)
        requests.append(Request(f"r{i}", 0.0, prompt, max_new))
    requests.append(Request("sampled", 0.0, system + random_prompt(rng, 9), 6, n=3, temperature=0.8))
    return requests


def expected_outputs(model: LlamaModel, requests: list[Request]) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {r.request_id: tuple(dense_generate(model, r, i) for i in range(r.n)) for r in requests}


@pytest.fixture(scope="module")
def mixed(model):
    requests = mixed_requests()
    return requests, expected_outputs(model, requests)


# --------------------------------------------------------------------------- token-exact
@pytest.mark.parametrize("prefix_cache", ["block_hash", "radix", "none"])
def test_mixed_batch_matches_dense(model, mixed, prefix_cache):
    requests, expected = mixed
    engine = make_engine(model, num_blocks=128, prefix_cache=prefix_cache)
    # One request with the shared system prompt runs a step first, so the others can hit it.
    engine.add_request(requests[1])
    first = engine.step()
    finished, rejected, outputs = run(engine, requests[:1] + requests[2:])
    outputs.insert(0, first)
    assert not rejected
    assert {rid: f.output_token_ids for rid, f in finished.items()} == expected
    hits = sum(o.stats.num_prefix_hit_tokens for o in outputs)
    if prefix_cache == "none":
        assert hits == 0
    else:
        assert hits > 0  # the shared system prompt was reused


@pytest.mark.parametrize("chunked", [True, False])
def test_small_token_budget_matches_dense(model, mixed, chunked):
    requests, expected = mixed
    budget = 7 if chunked else 96  # the longest prompt is 90 tokens
    engine = make_engine(model, num_blocks=128, max_num_batched_tokens=budget, chunked_prefill=chunked)
    finished, _, outputs = run(engine, requests)
    assert {rid: f.output_token_ids for rid, f in finished.items()} == expected
    assert max(o.stats.num_scheduled_tokens for o in outputs) <= budget


@pytest.mark.parametrize(
    ("preemption", "prefix_cache"), [("recompute", "block_hash"), ("recompute", "none"), ("swap", "none")]
)
def test_preemption_under_a_small_pool_matches_dense(model, mixed, preemption, prefix_cache):
    requests, expected = mixed
    engine = make_engine(
        model,
        block_size=4,
        num_blocks=40,
        preemption=preemption,
        prefix_cache=prefix_cache,
        max_num_batched_tokens=64,
    )
    finished, rejected, outputs = run(engine, requests)
    assert not rejected
    assert {rid: f.output_token_ids for rid, f in finished.items()} == expected
    assert sum(o.stats.num_preemptions for o in outputs) > 0
    if preemption == "swap":
        assert sum(o.stats.bytes_to_host for o in outputs) > 0
    if prefix_cache == "none" and preemption == "recompute":
        assert sum(o.stats.num_recomputed_tokens for o in outputs) > 0


def test_radix_partial_block_match_matches_dense(model):
    # Prompts sharing 21 tokens (not a multiple of block_size 8): radix matches mid-block.
    rng = random.Random(3)
    shared = random_prompt(rng, 21)
    first = Request("first", 0.0, shared + random_prompt(rng, 4), 5)
    second = Request("second", 0.0, shared + random_prompt(rng, 6), 5)
    engine = make_engine(model, block_size=8, num_blocks=64, prefix_cache="radix")
    run(engine, [first])
    finished, _, _ = run(engine, [second])
    assert finished["second"].num_cached_prompt_tokens == 21
    assert finished["second"].output_token_ids == (dense_generate(model, second),)


# --------------------------------------------------------------------------- sharing
def test_parallel_sampling_shares_prompt_blocks_and_copies_on_write(model):
    rng = random.Random(5)
    request = Request("n4", 0.0, random_prompt(rng, 20), 5, n=4, temperature=1.0)
    engine = make_engine(model, block_size=16, num_blocks=32, prefix_cache="none")
    finished, _, outputs = run(engine, [request])
    record = finished["n4"]
    assert record.output_token_ids == tuple(dense_generate(model, request, i) for i in range(4))
    assert len(set(record.output_token_ids)) > 1  # the samples really differ
    # Each sample ends holding 20 + 5 - 1 = 24 slots: the full prompt block (16) shared,
    # the partial block copied by 3 of the 4 samples on their first write.
    assert record.peak_kv_slots_unshared == 4 * 24
    assert record.peak_kv_slots == 16 + 4 * 8
    assert engine.kv.num_cow_copies == 3
    bpt = engine.bytes_per_token
    # After the first decode step: 16 shared + 4 x 5 slots hold tokens, counted once.
    assert outputs[1].stats.kv.token_bytes == (16 + 4 * 5) * bpt
    assert outputs[1].stats.kv.num_blocks_in_use == 5


def test_beam_search_matches_brute_force_reference(model):
    rng = random.Random(11)
    request = Request("beam", 0.0, random_prompt(rng, 10), 5, beam_width=3)
    expected = brute_beam_search(model, request)
    engine = make_engine(model, block_size=4, num_blocks=64, prefix_cache="none")
    finished, _, _ = run(engine, [request])
    record = finished["beam"]
    assert list(record.output_token_ids) == expected
    # Beams share the prompt and their common history: fewer distinct slots than copies.
    assert record.peak_kv_slots < record.peak_kv_slots_unshared
    assert record.peak_kv_slots_unshared == 3 * (10 + 5 - 1)
    usage = engine.kv.usage()
    assert usage.num_blocks_in_use == 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_beam_search_survives_preemption(model, preemption):
    rng = random.Random(11)
    beam = Request("beam", 0.0, random_prompt(rng, 10), 10, beam_width=3)
    others = [Request(f"o{i}", 0.0, random_prompt(rng, 12), 16) for i in range(3)]
    # 17 blocks of 4: the three others peak at 7 blocks each, so the beams (newest) are
    # preempted several times while they run beside them.
    engine = make_engine(
        model,
        block_size=4,
        num_blocks=17,
        prefix_cache="none",
        max_num_batched_tokens=64,
        preemption=preemption,
    )
    finished, rejected, outputs = run(engine, [*others, beam])
    assert not rejected
    assert finished["beam"].num_preemptions > 0
    if preemption == "recompute":
        assert finished["beam"].num_recomputed_tokens > 0
    else:
        assert sum(o.stats.bytes_to_host for o in outputs) > 0
    assert list(finished["beam"].output_token_ids) == brute_beam_search(model, beam)
    for other in others:
        assert finished[other.request_id].output_token_ids == (dense_generate(model, other),)


# --------------------------------------------------------------------------- contract
def test_step_reports_first_scheduled_and_usage(model):
    engine = make_engine(model, num_blocks=64)
    rng = random.Random(2)
    requests = [Request(f"r{i}", 0.0, random_prompt(rng, 10), 3) for i in range(2)]
    _, _, outputs = run(engine, requests)
    assert outputs[0].first_scheduled == ("r0", "r1")
    assert all(not o.first_scheduled for o in outputs[1:])
    assert outputs[0].stats.num_prefill_tokens == 20 and outputs[1].stats.num_decode_tokens == 2
    assert outputs[0].stats.kv.token_bytes == 20 * engine.bytes_per_token
    assert outputs[0].stats.kv.capacity_bytes == engine.describe()["kv_pool_bytes"]


def test_describe_and_pool_sizing(model):
    engine = make_engine(model, kv_memory_bytes=1 << 20, block_size=16)
    facts = engine.describe()
    assert facts["kv_bytes_per_token"] == 2048  # 2 x 4 layers x 2 heads x 32 x 4 bytes
    assert facts["num_blocks"] == (1 << 20) // (16 * 2048) == 32
    assert facts["kv_pool_bytes"] == 1 << 20
    assert facts["prefix_cache"] == "block_hash"
    swap = make_engine(model, num_blocks=8, preemption="swap")
    assert swap.describe()["num_host_blocks"] == 8


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"block_size": 12}, "engine.block_size: must be a power of two, got 12"),
        ({"prefix_cache": "lru"}, "engine.prefix_cache: must be one of"),
        ({"preemption": "drop"}, "engine.preemption: must be one of"),
        ({"decode_backend": "cuda"}, "engine.decode_backend: must be one of"),
        ({"num_blocks": 0}, "engine.num_blocks: must be > 0"),
        ({"kv_memory_bytes": 100}, "engine.kv_memory_bytes: 100 bytes hold no block"),
        ({"max_num_batched_tokens": 0}, "engine.max_num_batched_tokens: must be > 0"),
        ({"num_host_blocks": -1}, "engine.num_host_blocks: must be >= 0"),
    ],
)
def test_invalid_parameters_name_the_field(model, params, message):
    with pytest.raises(ValueError) as info:
        make_engine(model, **params)
    assert str(info.value).startswith(message)


def test_sim_mode_builds_the_cost_model_executor_and_sizes_the_pool(capsys):
    from kvbench.engines.sim.executor import CostModelExecutor

    hw = HardwareSpec(memory_bytes=1024**3)
    ctx = EngineContext(spec=SPEC, hardware=hw, model=None, mode="sim")
    explicit = PagedEngine(ctx, num_blocks=40)
    assert isinstance(explicit.executor, CostModelExecutor) and explicit.num_blocks == 40
    assert "40 blocks x 16 tokens" in capsys.readouterr().out
    # kv_memory_bytes=None: (1 GiB x 0.5 - fp32 weights - 1 GiB reserve) is negative...
    with pytest.raises(SpecError, match="does not fit"):
        PagedEngine(ctx, kv_memory_bytes=None, gpu_memory_utilization=0.5)
    # ...and with 4 GiB there is room: the pool is derived like a real engine's.
    big = dataclasses.replace(ctx, hardware=dataclasses.replace(hw, memory_bytes=4 * 1024**3))
    derived = PagedEngine(big, kv_memory_bytes=None, gpu_memory_utilization=0.5)
    per_block = derived.bytes_per_block
    assert derived.num_blocks == (2 * 1024**3 - weight_bytes(SPEC, "fp32") - 1024**3) // per_block
    assert f"{derived.num_blocks:,} blocks x 16 tokens" in capsys.readouterr().out


def test_real_mode_needs_a_model_and_a_pool_size(model):
    ctx = EngineContext(spec=SPEC, hardware=HardwareSpec(), model=None, mode="real")
    with pytest.raises(ValueError, match="ctx.model is None"):
        PagedEngine(ctx)
    with pytest.raises(ValueError, match="engine.kv_memory_bytes: null sizes the pool"):
        PagedEngine(dataclasses.replace(ctx, model=model), kv_memory_bytes=None)
    with pytest.raises(ValueError, match="engine.gpu_memory_utilization"):
        PagedEngine(dataclasses.replace(ctx, model=model), gpu_memory_utilization=1.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode_backend", ["torch", "triton"])
def test_cuda_matches_cpu(decode_backend):
    model_cpu = LlamaModel.random(SPEC, seed=0)
    model_gpu = LlamaModel.random(SPEC, seed=0, device="cuda")
    requests = mixed_requests()
    ctx = EngineContext(spec=SPEC, hardware=HardwareSpec(), model=model_gpu, device="cuda")
    engine = PagedEngine(ctx, block_size=4, num_blocks=40, decode_backend=decode_backend)
    finished, rejected, outputs = run(engine, requests)
    assert not rejected and sum(o.stats.num_preemptions for o in outputs) > 0
    assert {rid: f.output_token_ids for rid, f in finished.items()} == expected_outputs(model_cpu, requests)


@pytest.mark.parametrize(
    ("config", "prefix_cache", "preemption"),
    [
        ("paged", "block_hash", "recompute"),
        ("paged_radix", "radix", "recompute"),
        ("paged_noprefix", "none", "recompute"),
        ("paged_swap", "block_hash", "swap"),
    ],
)
def test_hydra_configs_build_the_engine(model, config, prefix_cache, preemption):
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    with initialize_config_module("kvbench.conf", version_base=None):
        cfg = compose(f"engine/{config}")
    factory = instantiate(cfg.engine)
    ctx = EngineContext(spec=SPEC, hardware=HardwareSpec(), model=model)
    engine = factory(ctx)
    facts = engine.describe()
    assert engine.name == config
    assert (facts["prefix_cache"], facts["preemption"]) == (prefix_cache, preemption)
    assert facts["num_blocks"] == 33554432 // (16 * 2048)
    assert facts["num_host_blocks"] == (facts["num_blocks"] if preemption == "swap" else 0)


def test_step_stats_show_the_memory_of_the_step_as_executed(model):
    """A one-token request finishes in its only step; that step must still show its KV
    and its sequence (read before retirement frees them), or peaks would read low."""
    engine = make_engine(model, block_size=16, num_blocks=8)
    engine.add_request(Request("only", 0.0, tuple(range(3, 23)), 1))
    output = engine.step()
    assert [f.request_id for f in output.finished] == ["only"]
    assert output.stats.num_running == 1
    assert output.stats.kv.num_blocks_in_use == 2
    assert output.stats.kv.token_bytes == 20 * engine.bytes_per_token
    assert engine.kv.usage().allocated_bytes == 0  # freed once the step is over
