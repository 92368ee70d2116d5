"""The slab KV manager and engine: placement, fragmentation, waste accounting, exactness.

Manager-level scenarios pin block placement and the byte counts of every kind of waste
for hand-built arrival orders; engine-level tests run the slab under the paged engine's
scheduler: against the dense reference on the real tiny model (token-exact), under a
slot-tracking shadow executor on random workloads (property test), and in simulation
mode at paper scale (Llama-3-70B on an H100's KV pool).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pandas as pd
import pytest
import torch
from engine_driver import drive_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from run_fixtures import sweep_experiment

from kvbench.engines.dense import DenseEngine
from kvbench.engines.exec.executor import ExecutionResult
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.prefix_cache import NullPrefixIndex
from kvbench.engines.kv.protocol import KVCapacityError, KVOps
from kvbench.engines.kv.slab import (
    BestFit,
    FirstFit,
    FreeRuns,
    MaxLenReservation,
    RequestReservation,
    SlabKVManager,
)
from kvbench.engines.paged import PagedEngine
from kvbench.engines.sched.scheduler import SchedulerOutput
from kvbench.engines.sched.sequence import SequenceGroup
from kvbench.engines.slab import SlabEngine
from kvbench.metrics import summarize_run
from kvbench.model import LlamaModel
from kvbench.runner import SimClock, replay
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import EngineContext, Request, Workload
from kvbench.workloads.synthetic import random_requests

SPEC = ModelSpec()  # tiny-gqa fp32: 2 * 4 layers * 2 kv heads * 32 dims * 4 B = 2,048 B per token
BPT = 2048


def req(rid: str, prompt_len: int, max_new: int, **kw) -> Request:
    return Request(rid, 0.0, tuple(range(3, 3 + prompt_len)), max_new, **kw)


# --------------------------------------------------------------------------- manager scenarios
class Directory:
    """The scheduler's side of the KV-manager contract, for driving the manager without a
    scheduler: ``new`` queues a group (``waiting_entered``), ``admit`` reports that it left
    the waiting queue (``waiting_left``), as the scheduler does around ``allocate``."""

    def __init__(self, kv: SlabKVManager) -> None:
        self.kv = kv
        self.groups: dict[int, SequenceGroup] = {}
        self._next_seq_id = 0

    def new(self, request: Request) -> int:
        """A new waiting group for ``request``; returns its first sequence id."""
        seq_id = self._next_seq_id
        self._next_seq_id += 100
        group = self.groups[seq_id] = SequenceGroup(request, seq_id, seq_id, eos_token_id=2)
        self.kv.waiting_entered(group)
        return seq_id

    def admit(self, seq_id: int) -> None:
        self.kv.waiting_left(self.groups[seq_id])


def manager(
    num_blocks: int, block_size: int, reservation=None, placement=None
) -> tuple[SlabKVManager, Directory]:
    kv = SlabKVManager(num_blocks, block_size, BPT, reservation or RequestReservation(), placement)
    return kv, Directory(kv)


def start(kv: SlabKVManager, directory: Directory, request: Request) -> int:
    seq_id = directory.new(request)
    assert kv.can_allocate(seq_id, request.prompt_token_ids, request.num_prompt_tokens, None)
    assert kv.allocate(seq_id, request.prompt_token_ids, request.num_prompt_tokens, None) == (0, KVOps())
    directory.admit(seq_id)
    kv.check()
    return seq_id


def test_free_runs_merge_with_both_neighbours():
    runs = FreeRuns(12)
    assert [runs.take(0, n) for n in (3, 2, 4)] == [0, 3, 5]
    assert (runs.starts, runs.lengths) == ([9], [3])
    runs.release(0, 3)  # no neighbour
    runs.release(5, 4)  # merges with the tail run
    assert (runs.starts, runs.lengths) == ([0, 5], [3, 7])
    runs.release(3, 2)  # bridges both
    assert (runs.starts, runs.lengths) == ([0], [12])
    assert runs.num_fits(5) == 2


@pytest.mark.parametrize("placement, expected_start", [(FirstFit(), 0), (BestFit(), 10)])
def test_first_fit_takes_the_lowest_hole_best_fit_the_tightest(placement, expected_start):
    # block_size 4, reservation = prompt + max_new: A 3 blocks, B 2, C 4, D 1, tail 2 free.
    kv, directory = manager(12, 4, placement=placement)
    a = start(kv, directory, req("A", 11, 1))
    b = start(kv, directory, req("B", 7, 1))
    c = start(kv, directory, req("C", 15, 1))
    d = start(kv, directory, req("D", 3, 1))
    assert [kv.region_of(s) for s in (a, b, c, d)] == [(0, 3), (3, 2), (5, 4), (9, 1)]
    assert kv.block_table(b) == [3, 4] and kv.slot_mapping(b, 5, 7) == [17, 18]
    kv.free(a)  # free runs: (0, 3 blocks) and (10, 2 blocks)
    e = start(kv, directory, req("E", 6, 2))  # 8 tokens: 2 blocks
    assert kv.region_of(e) == (expected_start, 2)
    assert kv.block_table(e) == [expected_start, expected_start + 1]
    # A step's chunks read their tables in one call (SeqTable.block_tables): the same.
    assert kv.block_tables([e, d, b, c]) == [kv.block_table(s) for s in (e, d, b, c)]
    with pytest.raises(KeyError, match=f"unknown seq {a}"):
        kv.block_tables([e, a])


def test_external_fragmentation_appears_in_a_hand_built_arrival_order():
    kv, directory = manager(12, 4)
    a = start(kv, directory, req("A", 12, 4))  # 4 blocks [0, 4)
    b = start(kv, directory, req("B", 7, 1))  # 2 blocks [4, 6)
    c = start(kv, directory, req("C", 11, 1))  # 3 blocks [6, 9)
    d = start(kv, directory, req("D", 11, 1))  # 3 blocks [9, 12)
    assert kv.usage().num_blocks_free == 0
    kv.free(b)
    kv.free(d)  # 5 blocks free, in runs of 2 and 3
    waiting = req("E", 14, 2)  # 16 tokens: a 4-block region
    e = directory.new(waiting)
    assert not kv.can_allocate(e, waiting.prompt_token_ids, 14, None)
    with pytest.raises(KVCapacityError):
        kv.allocate(e, waiting.prompt_token_ids, 14, None)
    usage = kv.usage()
    assert usage.num_blocks_free == 5
    assert usage.external_frag_bytes == 5 * 4 * BPT  # neither run fits the waiting request
    # A paged pool of the same 12 blocks with 7 in use would admit it (4 blocks anywhere).
    paged = PagedKVManager(12, 4, BPT, NullPrefixIndex())
    for seq_id, length in enumerate((16, 12)):
        paged.allocate(seq_id, list(range(length)), length, None)
    assert paged.can_allocate(9, waiting.prompt_token_ids, 14, None)
    # C ends: the holes merge into one 8-block run, which fits E at its start.
    kv.free(c)
    assert kv.usage().external_frag_bytes == 0
    kv.allocate(e, waiting.prompt_token_ids, 14, None)
    directory.admit(e)
    assert kv.region_of(e) == (4, 4)
    assert kv.usage().external_frag_bytes == 0  # nothing waits: free memory is just free
    kv.free(a)
    kv.free(e)
    kv.check()
    assert kv.usage().allocated_bytes == 0 and (kv.free_runs.starts, kv.free_runs.lengths) == ([0], [12])


def test_waste_accounting_is_exact_to_the_byte():
    # max_len 40 tokens, block_size 8: every region is 5 blocks (40 slots).
    kv, directory = manager(20, 8, reservation=MaxLenReservation(40))
    seq = start(kv, directory, req("A", 10, 6))  # will write 10 + 6 - 1 = 15 slots
    kv.append(seq, 1)
    usage = kv.usage()
    assert usage.allocated_bytes == 40 * BPT == 5 * 8 * BPT
    assert usage.token_bytes == 11 * BPT
    assert usage.reserved_unused_bytes == 4 * BPT  # 15 - 11
    assert usage.internal_frag_bytes == 25 * BPT  # 40 - 15: the max_len over-reservation
    assert usage.external_frag_bytes == 0
    # Per-request reservation of the same request: 16 tokens = 2 blocks, 1 slot never used.
    kv, directory = manager(20, 8)
    seq = start(kv, directory, req("A", 10, 6))
    usage = kv.usage()
    assert (usage.allocated_bytes, usage.token_bytes) == (16 * BPT, 10 * BPT)
    assert (usage.reserved_unused_bytes, usage.internal_frag_bytes) == (5 * BPT, 1 * BPT)
    assert (usage.num_blocks_in_use, usage.num_blocks_free, usage.capacity_bytes) == (2, 18, 20 * 8 * BPT)


def test_parallel_samples_reserve_a_region_each_and_copy_the_prompt():
    kv, directory = manager(9, 4)
    request = req("S", 6, 3, n=3, temperature=1.0)  # 9 tokens: 3 blocks per sample
    parent = start(kv, directory, request)
    assert kv.region_of(parent) == (0, 3)
    # Three regions reserved at admission; the two spares will hold 6 + 3 - 1 = 8 slots each.
    usage = kv.usage()
    assert usage.allocated_bytes == 9 * 4 * BPT and usage.token_bytes == 6 * BPT
    assert usage.reserved_unused_bytes == (2 + 8 + 8) * BPT
    assert usage.internal_frag_bytes == 3 * (12 - 8) * BPT
    group = directory.groups[parent]
    for child in (parent + 1, parent + 2):
        kv.fork(parent, child)
        directory.groups[child] = group
    assert [kv.region_of(s)[0] for s in (parent + 1, parent + 2)] == [3, 6]
    assert kv.num_tokens(parent + 2) == 6 and kv.block_table(parent + 2) == [6, 7]
    kv.check()
    # The prompt's 2 written blocks are copied into each sample's region by the next act call.
    ops = kv.append(parent, 1)
    assert ops.copies == ((0, 3), (1, 4), (0, 6), (1, 7))
    assert kv.append(parent + 1, 1).is_empty
    with pytest.raises(KVCapacityError, match="no reserved region left"):
        kv.fork(parent, parent + 3)
    # Samples go back to the arena as they finish (no more forks can come).
    kv.free(parent + 1)
    assert kv.usage().num_blocks_in_use == 6
    kv.free(parent)
    kv.free(parent + 2)
    kv.check()
    assert kv.usage().num_blocks_in_use == 0


def test_misuse_is_a_clear_error():
    kv = SlabKVManager(8, 4, BPT, RequestReservation())
    with pytest.raises(KeyError, match="seq 0 is not in a waiting group"):
        kv.can_allocate(0, [3, 4], 2, None)
    kv, directory = manager(8, 4)
    seq = start(kv, directory, req("A", 4, 4))
    with pytest.raises(ValueError, match="already exists"):
        kv.allocate(seq, [3], 1, None)
    with pytest.raises(KVCapacityError, match="region has 8"):
        kv.append(seq, 5)
    with pytest.raises(KeyError, match="unknown seq 7"):
        kv.num_tokens(7)
    assert not kv.can_swap_out(seq)
    with pytest.raises(ValueError, match="request A is already waiting"):
        kv.waiting_entered(directory.groups[directory.new(req("A", 4, 4))])
    with pytest.raises(KeyError, match="request A is not waiting"):
        kv.waiting_left(directory.groups[seq])


# --------------------------------------------------------------------------- shadow executor
class ShadowExecutor:
    """Tensor-free executor: remembers which token each KV slot holds and checks that every
    position a chunk attends to holds that sequence's token (after the step's copies)."""

    reads_chunk_contents = True

    def __init__(self, block_size: int, vocab_size: int, random_logits: bool) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(0) if random_logits else None
        self.slots: dict[int, int] = {}
        self.engine: PagedEngine | None = None

    def describe(self) -> dict:
        return {"executor": "shadow"}

    def execute(self, output: SchedulerOutput) -> ExecutionResult:
        for op in output.kv_ops:
            assert not op.swap_in and not op.swap_out
            moved = {
                dst * self.block_size + i: self.slots.get(src * self.block_size + i)
                for src, dst in op.copies
                for i in range(self.block_size)
            }
            self.slots.update({slot: token for slot, token in moved.items() if token is not None})
        bs = self.block_size
        for chunk in output.chunks:
            seq = self.engine.scheduler.sequence_of(chunk.seq_id)
            for pos in range(chunk.start_pos):
                slot = chunk.block_table[pos // bs] * bs + pos % bs
                assert self.slots.get(slot) == seq.token_ids[pos], f"seq {chunk.seq_id} position {pos}"
        for chunk in output.chunks:
            for offset, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + offset
                self.slots[chunk.block_table[pos // bs] * bs + pos % bs] = token
        if self.generator is None:
            return ExecutionResult(logits=None, modeled_duration_s=0.0)
        return ExecutionResult(
            torch.randn(output.num_sampling_chunks, self.vocab_size, generator=self.generator)
        )


def shadow_engine(spec: ModelSpec, random_logits: bool = False, **params) -> SlabEngine:
    shadow = ShadowExecutor(params.get("block_size", 16), spec.vocab_size, random_logits)
    ctx = EngineContext(spec=spec, hardware=HardwareSpec(), model=None, mode="sim")
    engine = SlabEngine(ctx, executor=shadow, **params)
    shadow.engine = engine
    return engine


def drive(engine, requests: list[Request], max_steps: int = 5000):  # noqa: ANN001
    return drive_engine(engine, requests, max_steps)


def test_engine_waits_for_a_contiguous_region_and_reports_waste_per_step():
    # The manager scenario above, through the scheduler: B and D finish after their
    # prefill, leaving holes of 2 and 3 blocks that E (4 blocks) cannot use.
    requests = [req("A", 6, 10), req("B", 7, 1), req("C", 2, 10), req("D", 11, 1), req("E", 6, 10)]
    engine = shadow_engine(SPEC, block_size=4, num_blocks=12, reserve="request")
    finished, rejected, outputs = drive(engine, requests)
    assert not rejected and sorted(finished) == ["A", "B", "C", "D", "E"]
    assert outputs[0].first_scheduled == ("A", "B", "C", "D")
    second = outputs[1].stats
    assert (second.num_running, second.num_waiting, second.kv.num_blocks_free) == (2, 1, 5)
    # A: 7 slots of 16, will write 15; C: 3 slots of 12, will write 11.
    assert second.kv.allocated_bytes == 7 * 4 * BPT
    assert second.kv.token_bytes == (7 + 3) * BPT
    assert second.kv.reserved_unused_bytes == (8 + 8) * BPT
    assert second.kv.internal_frag_bytes == (1 + 1) * BPT
    assert second.kv.external_frag_bytes == 5 * 4 * BPT
    # C writes its last token in step 9 and frees its region, next to both holes; the
    # merged 8-block run fits E, which starts in step 10. Step stats show memory as the
    # step executed (before C's region is freed), so the holes persist through step 9.
    start_step = next(i for i, o in enumerate(outputs) if "E" in o.first_scheduled)
    assert start_step == 10
    assert [o.stats.kv.external_frag_bytes // (4 * BPT) for o in outputs[1:start_step]] == [5] * 9
    assert outputs[start_step].stats.kv.external_frag_bytes == 0
    assert engine.describe()["slab_reserve"] == "request"


def test_requests_larger_than_the_arena_are_rejected_at_once():
    engine = shadow_engine(SPEC, block_size=16, num_blocks=200)  # max_len 2048: 128 blocks a sequence
    finished, rejected, _ = drive(engine, [req("two", 8, 4, n=2, temperature=1.0), req("one", 8, 4)])
    assert sorted(finished) == ["one"]
    assert "2 x 128 blocks (max_len) exceeds the arena of 200 blocks" in rejected["two"].reason


@pytest.mark.parametrize(
    "params, message",
    [({"reserve": "pow2"}, "engine.reserve"), ({"placement": "worst_fit"}, "engine.placement"),
     ({"block_size": 12}, "engine.block_size"), ({"kv_memory_bytes": 100}, "engine.kv_memory_bytes")],
)  # fmt: skip
def test_invalid_parameters_name_the_field(params, message):
    with pytest.raises(ValueError, match=message):
        shadow_engine(SPEC, **params)


request_st = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 12),  # max_new_tokens
    st.sampled_from(["single", "n", "beam"]),
    st.integers(2, 3),  # n or beam width
    st.booleans(),  # ignore_eos
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request_st, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(4, 64),
    max_num_batched_tokens=st.integers(3, 48),  # >= the widest beam (else rejected for budget)
    max_num_seqs=st.integers(3, 8),
    reserve=st.sampled_from(["max_len", "request"]),
    placement=st.sampled_from(["first_fit", "best_fit"]),
    random_logits=st.booleans(),
)
def test_random_workloads_keep_every_slot_right(
    requests, block_size, num_blocks, max_num_batched_tokens, max_num_seqs, reserve, placement, random_logits
):
    spec = ModelSpec(vocab_size=64, max_position_embeddings=64)  # a small vocabulary makes EOS common
    engine = shadow_engine(
        spec, random_logits, block_size=block_size, num_blocks=num_blocks, reserve=reserve,
        placement=placement, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
    )  # fmt: skip
    built = []
    for i, (prompt_len, max_new, kind, width, ignore_eos) in enumerate(requests):
        extra = (
            {"n": width, "temperature": 1.0}
            if kind == "n"
            else {"beam_width": width}
            if kind == "beam"
            else {}
        )
        built.append(
            Request(f"r{i}", 0.0, tuple(range(3, 3 + prompt_len)), max_new, ignore_eos=ignore_eos, **extra)
        )
    finished, rejected, outputs = drive(engine, built)
    assert set(finished) | set(rejected) == {r.request_id for r in built}
    for request in built:  # only a request whose regions exceed the arena is turned away
        assert (request.request_id in rejected) == (engine.slab.num_blocks_needed(request) > num_blocks)
    assert all(o.stats.num_preemptions == 0 for o in outputs)  # a reservation never runs out
    assert engine.kv.usage().allocated_bytes == 0


# --------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def model() -> LlamaModel:
    torch.set_num_threads(1)
    return LlamaModel.random(SPEC, seed=0)


def mixed_requests() -> list[Request]:
    gen = torch.Generator().manual_seed(1)

    def prompt(length: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, SPEC.vocab_size, (length,), generator=gen).tolist())

    shapes = [(5, 7), (73, 5), (17, 9), (90, 4), (1, 6), (61, 8), (30, 12)]
    requests = [Request(f"r{i}", 0.0, prompt(n), m) for i, (n, m) in enumerate(shapes)]
    requests.append(Request("sampled", 0.0, prompt(49), 6, n=3, temperature=0.8))
    return requests


@pytest.fixture(scope="module")
def dense_outputs(model):
    ctx = EngineContext(
        spec=SPEC, hardware=HardwareSpec(), model=model, device="cpu", kv_dtype="fp32", seed=0
    )
    finished, rejected, _ = drive(DenseEngine(ctx, max_num_seqs=16), mixed_requests())
    assert not rejected
    return {rid: f.output_token_ids for rid, f in finished.items()}


@pytest.mark.parametrize(
    "params",
    [
        {"reserve": "max_len", "num_blocks": 600},  # 4 regions of 128 blocks at a time
        {"reserve": "request", "num_blocks": 24, "placement": "best_fit", "max_num_batched_tokens": 32},
        {"reserve": "request", "num_blocks": 24, "block_size": 8, "chunked_prefill": False},
    ],
)
def test_mixed_batch_matches_the_dense_reference(model, dense_outputs, params):
    ctx = EngineContext(
        spec=SPEC, hardware=HardwareSpec(), model=model, device="cpu", kv_dtype="fp32", seed=0
    )
    engine = SlabEngine(ctx, decode_backend="torch", **params)
    finished, rejected, outputs = drive(engine, mixed_requests())
    assert not rejected
    assert {rid: f.output_token_ids for rid, f in finished.items()} == dense_outputs
    assert max(o.stats.num_waiting for o in outputs) > 0  # the arena made some requests wait
    assert engine.slab.num_fork_copies > 0  # the sampled request's prompt was copied twice


def test_beam_search_matches_the_paged_engine(model):
    # The paged engine's beams are checked against a brute-force reference in its own tests.
    request = Request("beam", 0.0, tuple(range(5, 30)), 6, beam_width=3)
    ctx = EngineContext(
        spec=SPEC, hardware=HardwareSpec(), model=model, device="cpu", kv_dtype="fp32", seed=0
    )
    slab, _, _ = drive(
        SlabEngine(ctx, decode_backend="torch", reserve="request", num_blocks=24, block_size=4), [request]
    )
    paged, _, _ = drive(PagedEngine(ctx, decode_backend="torch", num_blocks=64), [request])
    assert slab["beam"].output_token_ids == paged["beam"].output_token_ids


# --------------------------------------------------------------------------- simulation mode
def test_sim_mode_llama3_70b_batch_of_32_on_an_h100_pool():
    """32 requests of ~800 tokens (8K limit) on Llama-3-70B's H100 KV pool (1,083 blocks):
    the static slab admits 2 sequences at a time and most of what it holds is never used."""
    spec = ModelSpec(
        name="llama-3-70b", num_layers=80, num_q_heads=64, num_kv_heads=8, head_dim=128,
        hidden_size=8192, intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192, dtype="fp8",
    )  # fmt: skip
    h100 = HardwareSpec(
        name="h100-80gb", memory_bytes=80 * 1024**3, hbm_bandwidth_gbps=3350.0, bf16_tflops=989.0
    )
    ctx = EngineContext(spec, h100, None, "cpu", "bf16", 0, "sim")
    workload = random_requests(
        32, {"kind": "uniform", "low": 300, "high": 900}, {"kind": "uniform", "low": 100, "high": 300},
        vocab_size=spec.vocab_size, seed=0,
    )  # fmt: skip
    workload = Workload(
        workload.name, tuple(dataclasses.replace(r, arrival_s=0.0) for r in workload.requests)
    )
    summaries = {}
    for name, engine in (("paged", PagedEngine), ("slab", SlabEngine)):
        built = engine(ctx, kv_memory_bytes=None, max_num_seqs=256, max_num_batched_tokens=8192)
        assert built.num_blocks == 1083
        raw = replay(built, workload, SimClock())
        summaries[name] = summarize_run(raw.requests, raw.steps, {}).metrics
        assert summaries[name]["num_completed"] == 32
    paged, slab = summaries["paged"], summaries["slab"]
    assert slab["peak_num_running"] == 2 < paged["peak_num_running"]  # 1,083 // 512-block regions
    assert slab["kv_token_fraction_mean"] < 0.15 < 0.9 < paged["kv_token_fraction_mean"]
    assert slab["kv_internal_frag_bytes_at_peak"] > 0.8 * slab["kv_peak_allocated_bytes"]
    assert slab["output_tokens_per_s"] < paged["output_tokens_per_s"]


def test_seed_claims_slab_experiment_sweeps_the_engines_in_simulation(tmp_path: Path):
    """The experiment sweeps conf/engine/<name> with its pool sized from the hardware."""
    sweep = sweep_experiment(
        "seed_claims_slab",
        "hydra.sweeper.params.hardware=h100-80gb",
        "hydra.sweeper.params.workload=chat",
        cwd=tmp_path,
    )
    runs = pd.read_parquet(sweep / "runs.parquet").set_index("engine")
    assert sorted(runs.index) == ["paged", "slab", "slab_request"]
    assert (runs["status"] == "ok").all() and (runs["executor"] == "cost_model").all()
    fraction = runs["kv_token_fraction_mean"]
    assert fraction["slab"] < fraction["slab_request"] < fraction["paged"]
    assert runs.loc["slab", "peak_num_running"] == 2  # 1,083 blocks hold two 8K regions


# --------------------------------------------------------------------------- scale (issue 17)
@settings(max_examples=80, deadline=None)
@given(
    num_blocks=st.integers(1, 40),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 1000), st.integers(1, 12)), max_size=40),
)
def test_free_run_indexes_agree_with_a_scan(num_blocks, ops):
    """Best fit, first fit, "k regions fit" and blocks in short runs, from the size index
    and the Fenwick tree, equal a scan of the address-ordered runs after any sequence of
    takes and releases."""
    runs = FreeRuns(num_blocks)
    reserved: list[tuple[int, int]] = []
    for is_take, pick, size in ops:
        if is_take and runs.starts:
            index = pick % len(runs.starts)
            size = min(size, runs.lengths[index])
            reserved.append((runs.take(index, size), size))
        elif reserved:
            runs.release(*reserved.pop(pick % len(reserved)))
        runs.check()
        pairs = list(zip(runs.starts, runs.lengths))
        for n in range(1, num_blocks + 2):
            fitting = [(length, i) for i, (_, length) in enumerate(pairs) if length >= n]
            assert runs.lowest_fitting(n) == (fitting[0][1] if fitting else None)
            assert runs.shortest_fitting(n) == (min(fitting)[1] if fitting else None)
            assert runs.num_blocks_shorter_than(n) == sum(length for _, length in pairs if length < n)
            for count in range(4):
                assert runs.fits(n, count) == (runs.num_fits(n) >= count)
    assert runs.num_free_blocks + sum(size for _, size in reserved) == num_blocks


def test_waiting_groups_reported_through_the_contract_set_the_smallest_region():
    """The scheduler reports each group entering and leaving its waiting queue; the
    manager's waiting-region multiset follows (check() recounts it)."""
    kv, directory = manager(64, 4)
    groups = [directory.groups[directory.new(req(f"w{i}", 4 * i + 1, 3))] for i in range(8)]
    assert kv.smallest_waiting_region() == 1  # w0: 1 + 3 tokens in one block
    kv.check()
    for group in groups[:2]:
        kv.waiting_left(group)
    assert kv.smallest_waiting_region() == 3  # w2: 9 + 3 tokens
    kv.waiting_entered(groups[1])  # back after a recompute preemption
    assert kv.smallest_waiting_region() == 2  # w1: 5 + 3 tokens
    kv.check()
    for group in groups[1:]:
        kv.waiting_left(group)
    assert kv.smallest_waiting_region() is None
    kv.check()


class CountingReservation(RequestReservation):
    """The per-request reservation, counting how often a request's size is computed."""

    def __init__(self) -> None:
        self.num_calls = 0

    def num_tokens(self, request: Request) -> int:
        self.num_calls += 1
        return super().num_tokens(request)


def test_usage_does_not_scan_the_waiting_queue():
    """usage() costs the same with 3,000 waiting requests as with none: it never touches
    a waiting group (the scan made long simulated traces quadratic)."""
    reservation = CountingReservation()
    kv, directory = manager(4096, 16, reservation=reservation)
    running = [start(kv, directory, req(f"r{i}", 40 + i, 8)) for i in range(5)]
    kv.free(running[1])
    kv.free(running[3])  # holes of 4 blocks, far smaller than any waiting region
    for i in range(3000):
        directory.new(req(f"w{i}", 5000 - i, 10))
    calls = reservation.num_calls
    usages = [kv.usage() for _ in range(1000)]
    assert reservation.num_calls == calls
    need = kv.smallest_waiting_region()
    assert need == -(-(2001 + 10) // 16)
    holes = [length for length in kv.free_runs.lengths if length < need]
    assert usages[-1].external_frag_bytes == sum(holes) * 16 * BPT > 0


def test_sim_figures_match_the_scanning_implementation():
    """Samples, beams and single requests queueing for a fragmented arena in simulation:
    figures recorded with the implementation that recounted usage and scanned the
    waiting queue every step (before issue 17); any change in placement, admission or
    waste accounting moves them."""
    figures = {}
    for reserve, placement, num_blocks, block_size in PINNED_SIM_CONFIGS:
        engine = SlabEngine(
            QUEUEING_CTX, reserve=reserve, placement=placement, num_blocks=num_blocks,
            block_size=block_size, max_num_seqs=8,
        )  # fmt: skip
        figures[(reserve, placement)] = sim_figures(replay(engine, queueing_mix(), SimClock()).steps)
    assert figures == PINNED_SIM_FIGURES


QUEUEING_CTX = EngineContext(
    ModelSpec(vocab_size=64, max_position_embeddings=256), HardwareSpec(), None, "cpu", "fp32", 0, "sim"
)
# (reserve, placement, num_blocks, block_size) -> (steps, peak waiting, and the sums over
# steps of allocated, external fragmentation, reserved-unused, internal fragmentation and
# token bytes)
PINNED_SIM_CONFIGS = [
    ("request", "first_fit", 24, 16),
    ("request", "best_fit", 24, 16),
    ("max_len", "best_fit", 46, 8),
]
PINNED_SIM_FIGURES = {
    ("request", "first_fit"): (383, 48, 207585280, 1048576, 36548608, 27076608, 143960064),
    ("request", "best_fit"): (387, 48, 207585280, 950272, 36548608, 27076608, 143960064),
    ("max_len", "best_fit"): (432, 23, 225443840, 92667904, 8413184, 180578304, 36452352),
}


def sim_figures(steps: pd.DataFrame) -> tuple[int, ...]:
    return (
        len(steps),
        int(steps["num_waiting"].max()),
        *(
            int(steps[f"kv_{name}_bytes"].sum())
            for name in ("allocated", "external_frag", "reserved_unused", "internal_frag", "token")
        ),
    )


def queueing_mix() -> Workload:
    """60 requests within 50 ms (a quarter parallel samples, a quarter beams), prompts of
    1-60 tokens, 1-30 new tokens, seeded."""
    rng = random.Random(2)
    requests = []
    for i in range(60):
        kind = rng.choice(["single", "single", "n", "beam"])
        extra = (
            {"n": rng.randint(2, 3), "temperature": 1.0}
            if kind == "n"
            else {"beam_width": rng.randint(2, 3)}
            if kind == "beam"
            else {}
        )
        prompt = tuple(rng.randrange(3, 64) for _ in range(rng.randint(1, 60)))
        requests.append(Request(f"r{i}", rng.uniform(0, 0.05), prompt, rng.randint(1, 30), **extra))
    return Workload("mix", tuple(requests))


# --------------------------------------------------------------------------- decode runs
def _run_state(kv: SlabKVManager, seq_ids: list[int]) -> tuple:
    return [kv.num_tokens(s) for s in seq_ids], kv.usage_counts(), kv.usage()


def _decode_pair(reservation) -> tuple[SlabKVManager, SlabKVManager, list[int]]:
    """Two identical managers with three live sequences: one well short of its will-use,
    one at it, one past it (max_len regions leave room beyond prompt + max_new), a
    waiting request too big for the holes (external fragmentation)."""
    pair = []
    for _ in range(2):
        kv, directory = manager(64, 4, reservation=reservation)
        seqs = [start(kv, directory, req(f"r{i}", prompt, 3)) for i, prompt in enumerate((5, 9, 2))]
        kv.append(seqs[1], 2)  # 11 slots: prompt + max_new - 1, its will-use
        if isinstance(reservation, MaxLenReservation):
            kv.append(seqs[2], 6)  # 8 slots, past its will-use of 4
        directory.new(req("w", 240, 10))  # 63 blocks: more than the free 57
        pair.append((kv, seqs))
    (kv, seqs), (stepped, _) = pair
    return kv, stepped, seqs


@pytest.mark.parametrize("reservation", [RequestReservation(), MaxLenReservation(24)])
def test_decode_run_advance_equals_appending_one_slot_per_sequence(reservation):
    kv, stepped, seqs = _decode_pair(reservation)
    run = kv.try_decode_run(seqs)
    assert run is not None and kv.can_decode_together(seqs)
    num_steps = 0
    while run.can_advance():
        run.advance()
        for seq_id in seqs:
            assert stepped.can_append(seq_id, 1)
            stepped.append(seq_id, 1)
        kv.check()
        assert _run_state(kv, seqs) == _run_state(stepped, seqs)
        assert kv.usage_of(*kv.usage_counts()) == stepped.usage()
        num_steps += 1
    # The fullest region decides: the request region of 3 blocks of 4 slots holding 11
    # (its last step passes its will-use); max_len regions of 24 slots, the one at 11 first.
    assert num_steps == (1 if isinstance(reservation, RequestReservation) else 13)
    assert not all(stepped.can_append(seq_id, 1) for seq_id in seqs)
    before = _run_state(kv, seqs)
    with pytest.raises(KVCapacityError):
        run.advance()
    assert _run_state(kv, seqs) == before
    assert run.num_quiet_steps(None, 10) == 0


@pytest.mark.parametrize("reservation", [RequestReservation(), MaxLenReservation(24)])
def test_decode_run_advance_many_reports_each_steps_usage(reservation):
    kv, stepped, seqs = _decode_pair(reservation)
    run = kv.decode_run(seqs)
    num_steps = run.num_quiet_steps(None, 100)
    # A slab step takes no region: a waiting prompt's guard plays no part.
    guard = kv.admission_guard([1] * 40, None, seqs, 40, 8)
    assert guard.match_blocks.size == 0 and num_steps == run.num_quiet_steps(guard, 100)
    reported = run.advance_many(num_steps)
    expected = []
    for _ in range(num_steps):
        for seq_id in seqs:
            stepped.append(seq_id, 1)
        expected.append((*stepped.usage_counts(), 0))
    assert reported == expected
    assert _run_state(kv, seqs) == _run_state(stepped, seqs)
    kv.check()
    columns = kv.usage_columns([counts[:-1] for counts in reported])
    assert columns["kv.reserved_unused_bytes"][-1] == stepped.usage().reserved_unused_bytes
    assert columns["kv.external_frag_bytes"][-1] == stepped.usage().external_frag_bytes > 0
    with pytest.raises(KVCapacityError):
        run.advance_many(1)


def test_decode_run_checks_commits_per_step_and_refuses_whole():
    kv, _, seqs = _decode_pair(MaxLenReservation(24))
    run = kv.decode_run(seqs)
    tokens = list(range(3, 40))
    # Step 0 writes slot 6 of seq 0 (5 prompt slots + 1): 6 tokens commit, 7 do not.
    run.advance_many(2, [[(seqs[0], tokens, 6)], [(seqs[0], tokens, 7)]])
    before = _run_state(kv, seqs)
    with pytest.raises(ValueError, match="commits 10 tokens but has 8 slots"):
        run.advance_many(1, [[(seqs[0], tokens, 10)]])
    assert _run_state(kv, seqs) == before
    # 9 tokens after the first of two steps: 9 slots only once both are taken.
    with pytest.raises(ValueError, match="commits 9 tokens but has 8 slots"):
        run.advance_many(2, [[(seqs[0], tokens, 9)], []])
    assert _run_state(kv, seqs) == before
    kv.check()


def test_no_decode_run_while_fork_copies_are_pending():
    kv, directory = manager(64, 4)
    parent = directory.new(req("n", 6, 4, n=2, temperature=1.0))
    kv.allocate(parent, tuple(range(3, 9)), 6, None)
    directory.admit(parent)
    kv.fork(parent, parent + 1)
    assert kv.try_decode_run([parent, parent + 1]) is None
    with pytest.raises(ValueError, match="fork copies pending"):
        kv.decode_run([parent, parent + 1])
    assert kv.append(parent, 1).copies  # the copies go out with the next act call
    assert kv.try_decode_run([parent, parent + 1]) is not None
