"""Scheduler cost per running sequence per step, step by step, without a model.

Run: pytest tests/benchmarks/bench_scheduler.py --benchmark-enable -o python_files='bench_*.py' -s

Goal (issue 16): <= 2 microseconds of CPU per running sequence per step. Never asserted.

What is timed: ``decode_steps(R)`` decode steps of ``schedule()`` + ``complete_step()`` +
``append_token()`` per sequence + ``kv.usage()`` (the engine reads it every step) over R
running single-sample requests, with the real KV manager (append, commit, usage) and no
executor: the step-by-step path of the real-mode engine and of simulation with
``fast_forward=False`` (simulation's decode runs skip ``schedule()``; bench_sim.py times
the whole engine). ``chunk_contents`` is the scheduler's setting: ``real`` copies each
chunk's token ids and block table for a model; ``sim`` (what the cost-model executor asks
for) does not.

Honest by construction: every round starts from a freshly built scheduler past its
prefill (untimed), so every round times the same steps at the same context lengths; the
divisor is the number of decode chunks the scheduler actually emitted (each step is
checked to decode one token for every one of the R sequences), not R x steps assumed;
the time is CPU time (``time.process_time``), and the prefix caches are interleaved in
rounds (tests/benchmarks/rounds.py), so ``block_hash_over_none`` compares same-round times.
After every round (and the warm-up) the scheduler and its KV manager run their integrity
checks (``Scheduler.check``, ``PagedKVManager.check``: O(blocks) each) through
``run_rounds``'s ``verify``, off the clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from rounds import run_rounds

from kvbench.engines.config import PREFIX_INDEXES
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.sched.scheduler import Scheduler, SchedulerConfig
from kvbench.types import Request

GOAL_US_PER_SEQ_STEP = 2.0
# Sequence-steps a round times, in at least MIN_DECODE_STEPS steps: 16 sequences x 64
# steps was a round of about 2 ms, whose median over 9 rounds moved by a quarter between
# runs of the suite while the machine-speed probe held; 8,192 take about 15 ms.
SEQ_STEPS_PER_ROUND = 8192
MIN_DECODE_STEPS = 64
PROMPT_LEN = 200
BLOCK_SIZE = 16
PREFIX_CACHES = ("none", "block_hash", "radix")


def decode_steps(num_seqs: int) -> int:
    """Decode steps a round of ``num_seqs`` running sequences times. Pure."""
    return max(MIN_DECODE_STEPS, SEQ_STEPS_PER_ROUND // num_seqs)


def max_tokens(num_seqs: int) -> int:
    """Each request's output limit: room for every round's steps (and the warm-up's)
    without finishing a request or running out of blocks. Pure."""
    return 4 * decode_steps(num_seqs)


@dataclass(frozen=True)
class DecodeOutcome:
    """What one round's work did: the decode chunks it counted and the scheduler it ran."""

    num_seq_steps: int
    scheduler: Scheduler


def _verify(name: str, outcome: DecodeOutcome) -> None:
    """``run_rounds``'s verify: the round left scheduler and KV manager consistent."""
    outcome.scheduler.kv.check()
    outcome.scheduler.check()


def _one_step(scheduler: Scheduler) -> int:
    """One step; returns how many decode chunks it scheduled."""
    output = scheduler.schedule()
    for group, seq in scheduler.complete_step():
        scheduler.append_token(group, seq, 7)
    scheduler.kv.usage()  # the engine reads usage every step
    return sum(1 for chunk in output.chunks if chunk.is_decode)


def _decoding_scheduler(num_seqs: int, prefix_cache: str, chunk_contents: bool) -> Scheduler:
    """A scheduler with ``num_seqs`` single-sample requests past their prefill."""
    blocks_per_seq = -(-(PROMPT_LEN + max_tokens(num_seqs)) // BLOCK_SIZE)
    kv = PagedKVManager(num_seqs * blocks_per_seq + 16, BLOCK_SIZE, 2048, PREFIX_INDEXES[prefix_cache]())
    config = SchedulerConfig(
        max_num_seqs=num_seqs, max_num_batched_tokens=max(num_seqs, PROMPT_LEN) * 2, max_model_len=1 << 20
    )
    scheduler = Scheduler(kv, config, eos_token_id=2, chunk_contents=chunk_contents)
    rng = random.Random(0)
    for i in range(num_seqs):
        prompt = tuple(rng.randrange(3, 4096) for _ in range(PROMPT_LEN))
        scheduler.add(Request(f"r{i}", 0.0, prompt, max_tokens(num_seqs)))
    while (
        any(group.seqs[0].num_computed_tokens < PROMPT_LEN for group in scheduler.running)
        or scheduler.waiting
    ):
        _one_step(scheduler)
    return scheduler


def _decode_steps(
    num_seqs: int, prefix_cache: str, chunk_contents: bool
) -> Callable[[], Callable[[], DecodeOutcome]]:
    def prepare() -> Callable[[], DecodeOutcome]:
        scheduler = _decoding_scheduler(num_seqs, prefix_cache, chunk_contents)

        def work() -> DecodeOutcome:
            num_seq_steps = 0
            for _ in range(decode_steps(num_seqs)):
                decoded = _one_step(scheduler)
                assert decoded == num_seqs, f"a step decoded {decoded} of {num_seqs} sequences"
                num_seq_steps += decoded
            return DecodeOutcome(num_seq_steps, scheduler)

        return work

    return prepare


@pytest.mark.parametrize("mode", ["real", "sim"])
@pytest.mark.parametrize("num_seqs", [16, 64, 256])
def test_scheduler_cpu_per_running_sequence_step(benchmark, num_seqs, mode):
    variants = {pc: _decode_steps(num_seqs, pc, chunk_contents=mode == "real") for pc in PREFIX_CACHES}
    result = benchmark.pedantic(lambda: run_rounds(variants, verify=_verify), rounds=1, iterations=1)
    benchmark.extra_info.update(result.info())
    benchmark.extra_info.update(num_seqs=num_seqs, mode=mode, decode_steps=decode_steps(num_seqs))
    lines = []
    for pc in PREFIX_CACHES:
        num_seq_steps = result.outcomes[pc].num_seq_steps
        assert num_seq_steps == num_seqs * decode_steps(num_seqs)
        us = result.spread(pc, 1e6 / num_seq_steps)
        benchmark.extra_info.update(us.as_info(f"{pc}_us_per_seq_step"))
        lines.append(f"  {pc:10} {us.text('.2f')} us")
    for pc in ("block_hash", "radix"):
        benchmark.extra_info.update(result.ratio(pc, "none").as_info(f"{pc}_over_none"))
    print(
        f"\n[scheduler R={num_seqs}, chunk contents {mode}] CPU per running sequence per step "
        f"(min / median / max; goal <= {GOAL_US_PER_SEQ_STEP} us):\n"
        + "\n".join(lines)
        + f"\n  block_hash / none {result.ratio('block_hash', 'none').text('.2f')}\n  {result.context_line()}"
    )
