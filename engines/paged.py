"""The paged engine (PagedAttention, vLLM style): scheduler + block KV manager + executor + sampler.

One ``step()``::

    scheduler.schedule()          reserve KV slots, preempt / swap / admit  (tensor-free)
    executor.execute(output)      apply KV ops, run the model over the chunks -> logits
    scheduler.complete_step()     mark chunks computed, register full blocks in the prefix index
    sample / rank beams           Sampler (batch-independent keys) or beam ranking
    scheduler.append_token / fork_samples / advance_beams

Sampling uses ``SampleKey(request_id, sample_index, output position, temperature)``, the
same keys as the dense reference, so outputs do not depend on batching, chunking,
preemption or sharing. Parallel samples are forked from the prompt sequence after its
last prompt token (sharing every prompt block); beams are ranked jointly every step
(the best ``beam_width`` of all (beam, token) continuations by cumulative log-probability).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import Any

import numpy as np
import torch

from kvbench.engines.executor import ExecutionResult, Executor, TorchExecutor
from kvbench.engines.kv_manager import PagedKVManager
from kvbench.engines.prefix_cache import BlockHashPrefixIndex, NullPrefixIndex
from kvbench.engines.radix_cache import RadixPrefixIndex
from kvbench.engines.sampler import SampleKey, Sampler, log_softmax, stable_seed
from kvbench.engines.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvbench.engines.sequence import Sequence, SequenceGroup
from kvbench.engines.sim_executor import CostModelExecutor, pool_and_executor
from kvbench.hashing import GOLDEN64, MASK64, mix64
from kvbench.sim.cost_model import StepShape
from kvbench.sizing import kv_bytes_per_block, kv_bytes_per_token
from kvbench.types import CoveredSteps, EngineContext, KVUsage, Request, StepOutput, StepStats, TokenEvent

PREFIX_INDEXES = {
    "block_hash": BlockHashPrefixIndex,
    "radix": RadixPrefixIndex,
    "none": NullPrefixIndex,
}
DECODE_BACKENDS = ("auto", "torch", "triton")
# Most steps one decode run covers (one StepOutput): runs end at the first finish,
# arrival, admission or preemption anyway; the cap bounds one output's size.
MAX_DECODE_RUN_STEPS = 1024
# Steps modeled in a run's first window (then 2x, 4x, ...): runs often end within a few.
FIRST_DECODE_WINDOW = 8
_SAMPLE64 = 0xD1B54A32D192ED03


def stand_in_token(base: int, sample_index: int, position: int, vocab_size: int) -> int:
    """Simulation's stand-in for a sampled token: a SplitMix64 mix of the request's
    ``base`` key, the sample and the output position, drawn from ``[3, vocab_size)``.

    Integer arithmetic only (~0.3 us; a blake2b seed per token cost ~3 us, a fifth of a
    simulated decode step per sequence). Pure.
    """
    x = (base + (sample_index + 1) * _SAMPLE64 + (position + 1) * GOLDEN64) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return 3 + x % (vocab_size - 3)


def stand_in_tokens(
    bases: SequenceOf[int],
    sample_indexes: SequenceOf[int],
    first_positions: SequenceOf[int],
    num_steps: int,
    vocab_size: int,
) -> np.ndarray:
    """``stand_in_token`` for many sequences and consecutive positions at once: entry
    ``[i, k]`` equals ``stand_in_token(bases[i], sample_indexes[i], first_positions[i] + k,
    vocab_size)`` (uint64 arithmetic wraps mod 2**64 like the masked Python version).
    Returns int64 [len(bases), num_steps]. Pure."""
    u64 = np.uint64
    x = (
        np.asarray(bases, dtype=u64)[:, None]
        + (np.asarray(sample_indexes, dtype=u64)[:, None] + u64(1)) * u64(_SAMPLE64)
        + (np.asarray(first_positions, dtype=u64)[:, None] + np.arange(1, num_steps + 1, dtype=u64))
        * u64(GOLDEN64)
    )
    return (u64(3) + mix64(x) % u64(vocab_size - 3)).astype(np.int64)


def rank_beam_candidates(
    logprobs: torch.Tensor, cum_logprobs: list[float], beam_width: int, eos_token_id: int | None
) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
    """Best continuations of a beam step.

    logprobs: fp32 [num_beams, vocab]; cum_logprobs: each beam's score so far. Scores add
    in float64. Candidates are ranked by score, ties by (beam, token). Returns ``chosen``:
    the first ``beam_width`` non-EOS candidates (beam, token, score), best first, and
    ``finished``: EOS candidates ranked within the top ``beam_width`` (only when
    ``eos_token_id`` is not None, i.e. EOS is not ignored). Mutates nothing.
    """
    num_beams, vocab = logprobs.shape
    scores = (
        logprobs.double() + torch.tensor(cum_logprobs, dtype=torch.float64, device=logprobs.device)[:, None]
    )
    k = min(2 * beam_width, num_beams * vocab)
    values, flat = torch.topk(scores.flatten(), k)
    ranked = sorted(zip(values.tolist(), flat.tolist()), key=lambda c: (-c[0], c[1]))
    chosen: list[tuple[int, int, float]] = []
    finished: list[tuple[int, int, float]] = []
    for rank, (score, index) in enumerate(ranked):
        beam, token = divmod(index, vocab)
        if eos_token_id is not None and token == eos_token_id:
            if rank < beam_width:
                finished.append((beam, token, score))
            continue
        chosen.append((beam, token, score))
        if len(chosen) == beam_width:
            break
    return chosen, finished


class _RunLog:
    """A decode run's covered steps as they go: durations, KV counts, evictions, tokens."""

    __slots__ = (
        "engine",
        "request_ids",
        "samples",
        "context",
        "queues",
        "durations_s",
        "counts",
        "evicted",
        "token_rows",
    )

    def __init__(self, engine: PagedEngine, request_ids: list[str], samples: list[int], context: int) -> None:
        self.engine = engine
        self.request_ids = request_ids  # per sequence of the run, in batch order
        self.samples = samples
        self.context = context  # KV tokens the batch reads in the run's first step
        # Waiting and swapped groups, unchanged by the run's steps (a step that admits a
        # group is left to the next normal step, which pops it from the queue).
        scheduler = engine.scheduler
        self.queues = (len(scheduler.waiting), len(scheduler.swapped))
        self.durations_s: list[float] = []
        self.counts: list[tuple[int, int, int]] = []  # the KV manager's usage_counts after each step
        self.evicted: list[int] = []  # cached blocks each step reused
        self.token_rows: list[list[int]] = [[] for _ in request_ids]  # [seq][step]

    def add(
        self, step_tokens: list[int], duration_s: float, counts: tuple[int, int, int], evicted: int
    ) -> None:
        """Record one step: a token per sequence, its time, KV counts and evictions."""
        self.durations_s.append(duration_s)
        self.counts.append(counts)
        self.evicted.append(evicted)
        for row, token in zip(self.token_rows, step_tokens):
            row.append(token)

    def add_many(
        self, token_rows: list[list[int]], durations_s: list[float], reserved: list[tuple[int, int, int, int]]
    ) -> None:
        """Record steps taken together: ``token_rows[seq][step]`` and ``DecodeRun.advance_many``'s
        per-step counts."""
        self.durations_s.extend(durations_s)
        for in_use, token_slots, free, evicted in reserved:
            self.counts.append((in_use, token_slots, free))
            self.evicted.append(evicted)
        for row, new in zip(self.token_rows, token_rows):
            row.extend(new)

    def finish(self) -> CoveredSteps | None:
        """End the run: its steps as ``StepOutput.covered_steps`` (None when none was
        taken; the template is the last step's stats). Mutates the executor's step
        counters (adds the run's steps); call once."""
        num_steps = len(self.durations_s)
        if not num_steps:
            return None
        engine = self.engine
        kv = engine.kv
        num_seqs = len(self.request_ids)
        last = num_steps - 1
        # Each step decodes one more token per sequence than the last.
        contexts = range(self.context, self.context + num_steps * num_seqs, num_seqs)
        template = engine._stats(
            (0, 0, 0),  # prefix queries and hits: none in a run; evictions: the last step's
            (0, 0, self.evicted[last]),
            num_prefill_tokens=0,
            num_decode_tokens=num_seqs,
            shape=StepShape(num_decode_seqs=num_seqs, num_decode_context_tokens=contexts[last]),
            usage=kv._usage(*self.counts[last]),
            num_running=num_seqs,
            queues=self.queues,
        )
        columns: dict[str, SequenceOf[Any]] = dict(kv.usage_columns(self.counts))
        columns["num_evicted_blocks"] = self.evicted
        columns["num_decode_context_tokens"] = contexts
        executor = engine.executor
        assert isinstance(executor, CostModelExecutor)
        executor.num_steps += num_steps
        for duration_s in self.durations_s:  # one at a time: the same float sums as single steps
            executor.total_modeled_s += duration_s
        return CoveredSteps(
            durations_s=tuple(self.durations_s),
            template=template,
            columns=columns,
            request_ids=tuple(self.request_ids),
            sample_indexes=tuple(self.samples),
            token_ids=tuple(map(tuple, self.token_rows)),
        )


class PagedEngine:
    """Paged KV engine; see the module docstring. Parameters mirror ``conf/engine/paged.yaml``.

    Variants plug in a KV manager with ``PagedKVManager``'s interface: ``kv_manager`` (built
    by the caller for this pool) or ``kv_manager_factory(num_blocks, block_size,
    bytes_per_token)``, called once the engine has sized the pool. A manager may define
    ``reject_reason(request) -> str | None`` to reject requests it can never hold.

    ``fast_forward`` (simulation mode only) lets one ``step`` cover a run of plain decode
    steps once the runner has called ``set_next_arrival_s``; results are identical to
    stepping one iteration per call (``fast_forward=False``), only faster.

    Raises ValueError naming ``engine.<parameter>`` for an invalid parameter.
    """

    def __init__(
        self,
        ctx: EngineContext,
        *,
        name: str = "paged",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = 32 * 1024 * 1024,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        chunked_prefill: bool = True,
        prefix_cache: str = "block_hash",
        preemption: str = "recompute",
        victim_policy: str = "newest",
        num_host_blocks: int = 0,
        decode_backend: str = "auto",
        fast_forward: bool = True,
        executor: Executor | None = None,
        kv_manager: PagedKVManager | None = None,
        kv_manager_factory: Callable[[int, int, int], Any] | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"engine.block_size: must be a power of two, got {block_size}")
        if prefix_cache not in PREFIX_INDEXES:
            raise ValueError(
                f"engine.prefix_cache: must be one of {tuple(PREFIX_INDEXES)}, got {prefix_cache!r}"
            )
        if decode_backend not in DECODE_BACKENDS:
            raise ValueError(
                f"engine.decode_backend: must be one of {DECODE_BACKENDS}, got {decode_backend!r}"
            )
        if num_host_blocks < 0:
            raise ValueError(f"engine.num_host_blocks: must be >= 0, got {num_host_blocks}")
        if kv_manager is not None and kv_manager_factory is not None:
            raise ValueError("engine.kv_manager: give kv_manager or kv_manager_factory, not both")
        self.name = name
        self.ctx = ctx
        spec = ctx.spec
        self.bytes_per_token = kv_bytes_per_token(spec, ctx.kv_dtype)
        self.bytes_per_block = kv_bytes_per_block(spec, ctx.kv_dtype, block_size)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"engine.gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}"
            )
        num_blocks, executor = pool_and_executor(
            ctx,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_memory_bytes=kv_memory_bytes,
            executor=executor,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        if preemption == "swap" and num_host_blocks == 0:
            num_host_blocks = num_blocks
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill=bool(chunked_prefill),
            preemption=preemption,
            victim_policy=victim_policy,
            max_model_len=spec.max_position_embeddings,
        )
        config.validate()
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.prefix_cache = prefix_cache
        self.gpu_memory_utilization = gpu_memory_utilization
        # Variants (slab, H2O, offload) pass their own manager with the same interface;
        # its pool must match num_blocks / block_size so the executor's tensors fit it.
        # A factory gets the pool this engine sized (num_blocks, block_size,
        # bytes_per_token), so variants do not repeat the sizing rule.
        if kv_manager is None and kv_manager_factory is not None:
            kv_manager = kv_manager_factory(num_blocks, block_size, self.bytes_per_token)
        self.kv = kv_manager or PagedKVManager(
            num_blocks, block_size, self.bytes_per_token, PREFIX_INDEXES[prefix_cache](), num_host_blocks
        )
        if executor is None:
            if ctx.model is None:
                raise ValueError(
                    "engine.paged: ctx.model is None (simulation mode) and no executor was given; "
                    "pass a cost-model executor"
                )
            executor = TorchExecutor(
                ctx.model,
                num_blocks=num_blocks,
                block_size=block_size,
                num_host_blocks=num_host_blocks,
                device=ctx.device,
                kv_dtype=ctx.kv_dtype,
                decode_backend=decode_backend,
            )
        self.executor = executor
        self.scheduler = Scheduler(
            self.kv, config, spec.eos_token_id, chunk_contents=getattr(executor, "reads_chunk_contents", True)
        )
        self.sampler = Sampler(ctx.seed)
        self.config = config
        self._is_cuda = torch.device(ctx.device).type == "cuda"
        # Fast-forward (simulation only): the cost-model executor prices a decode run in
        # one call, and only the plain paged manager's accounting is known to be what
        # DecodeRun/append_decodes assume (variants override append/usage).
        self._decode_runs = (
            bool(fast_forward) and isinstance(executor, CostModelExecutor) and type(self.kv) is PagedKVManager
        )
        self._run_window: tuple[float, float] | None = None
        self._stand_in_bases: dict[str, int] = {}  # request id -> stand-in token key
        self._prepared_counters: tuple[int, int, int] | None = None

    # ------------------------------------------------------------------ protocol
    def add_request(self, request: Request) -> None:
        """Queue ``request`` (mutates the scheduler's waiting queue); unfit ones are rejected by step()."""
        self.scheduler.add(request)

    def unsupported_reason(self, request: Request) -> str | None:
        """None: the paged engine serves parallel sampling and beam search (shared blocks)."""
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def set_next_arrival_s(self, now_s: float, next_arrival_s: float) -> None:
        """The runner's hook (kvbench.types.Engine): simulated time now and of the next
        submission (``math.inf``: none due). Lets the next ``step`` cover a decode run of
        steps that all start before ``next_arrival_s``. Mutates only the stored window,
        which that ``step`` consumes. Raises ValueError when the arrival is not after now.
        """
        if not next_arrival_s > now_s:
            raise ValueError(f"set_next_arrival_s: next arrival {next_arrival_s} must be after now {now_s}")
        self._run_window = (now_s, next_arrival_s)

    def describe(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "kv_bytes_per_token": self.bytes_per_token,
            "kv_pool_bytes": self.num_blocks * self.bytes_per_block,
            "kv_bytes_per_block": self.bytes_per_block,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "num_host_blocks": self.num_host_blocks,
            "prefix_cache": self.prefix_cache,
            "preemption": cfg.preemption,
            "victim_policy": cfg.victim_policy,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "chunked_prefill": cfg.chunked_prefill,
            **self.executor.describe(),
        }

    def step(self) -> StepOutput:
        """Run one iteration (see module doc), or, in simulation mode after
        ``set_next_arrival_s``, a decode run of several (``_decode_run``). Mutates queues,
        KV state and outputs.

        On CUDA it synchronises before returning so the runner's clock reads finished work.
        """
        window, self._run_window = self._run_window, None
        if window is not None and self._decode_runs:
            run = self._decode_run(*window)
            if run is not None:
                return run
        kv = self.kv
        # A step a decode run already began (its slots reserved) counts from before that.
        counters0 = self._prepared_counters or (
            kv.num_prefix_query_tokens,
            kv.num_prefix_hit_tokens,
            kv.num_evicted_blocks,
        )
        self._prepared_counters = None
        output = self.scheduler.schedule()
        result = self.executor.execute(output)
        targets = self.scheduler.complete_step()
        # Memory and concurrency of the step as executed: read before sampling retires
        # finished sequences (and frees their blocks), or a request's last step would
        # never show its KV and peaks would read low.
        usage = self.kv.usage()
        num_running = sum(len(group.seqs) for group in self.scheduler.running)
        events = self._advance(targets, result)
        finished = self.scheduler.pop_finished()
        if self._is_cuda:
            torch.cuda.synchronize()
        for done in finished:
            self._stand_in_bases.pop(done.request_id, None)
        bytes_to_host, bytes_from_host = self._swap_bytes(output)
        stats = self._stats(
            counters0,
            num_prefill_tokens=output.num_prefill_tokens,
            num_decode_tokens=output.num_decode_tokens,
            shape=output.shape,
            num_preemptions=output.num_preemptions,
            num_recomputed_tokens=output.num_recomputed_tokens,
            bytes_to_host=bytes_to_host,
            bytes_from_host=bytes_from_host,
            usage=usage,
            num_running=num_running,
        )
        return StepOutput(
            tokens=tuple(events),
            first_scheduled=output.first_scheduled,
            finished=tuple(finished),
            rejected=output.rejected,
            stats=stats,
            modeled_duration_s=result.modeled_duration_s,
        )

    def _stats(
        self,
        counters0: tuple[int, int, int],
        counters1: tuple[int, int, int] | None = None,
        *,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        shape: StepShape,
        num_preemptions: int = 0,
        num_recomputed_tokens: int = 0,
        bytes_to_host: int = 0,
        bytes_from_host: int = 0,
        usage: KVUsage | None = None,
        num_running: int | None = None,
        queues: tuple[int, int] | None = None,
    ) -> StepStats:
        """The step's StepStats; ``counters0`` are the KV manager's (prefix queries, hits,
        evictions) before it and ``counters1`` after it (default: now); ``usage``,
        ``num_running`` and ``queues`` (waiting, swapped groups) as executed (default:
        now). Pure."""
        kv = self.kv
        scheduler = self.scheduler
        queries0, hits0, evicted0 = counters0
        if counters1 is None:
            counters1 = (kv.num_prefix_query_tokens, kv.num_prefix_hit_tokens, kv.num_evicted_blocks)
        queries1, hits1, evicted1 = counters1
        if num_running is None:
            num_running = sum(len(group.seqs) for group in scheduler.running)
        num_waiting, num_swapped = (
            queues if queues is not None else (len(scheduler.waiting), len(scheduler.swapped))
        )
        return StepStats(
            num_running=num_running,
            num_waiting=num_waiting,
            num_scheduled_tokens=num_prefill_tokens + num_decode_tokens,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            kv=usage if usage is not None else kv.usage(),
            num_swapped=num_swapped,
            num_preemptions=num_preemptions,
            num_recomputed_tokens=num_recomputed_tokens,
            num_prefix_query_tokens=queries1 - queries0,
            num_prefix_hit_tokens=hits1 - hits0,
            num_evicted_blocks=evicted1 - evicted0,
            bytes_to_host=bytes_to_host,
            bytes_from_host=bytes_from_host,
            modeled_transfer_s=(bytes_to_host + bytes_from_host) / (self.ctx.hardware.pcie_gbps * 1e9),
            num_prefill_seqs=shape.num_prefill_seqs,
            num_prefill_attention_pairs=shape.num_prefill_attention_pairs,
            num_prefill_context_tokens=shape.num_prefill_context_tokens,
            num_decode_context_tokens=shape.num_decode_context_tokens,
        )

    # ------------------------------------------------------------------ decode runs
    def _decode_run(self, now_s: float, next_arrival_s: float) -> StepOutput | None:
        """Fast-forward: take consecutive plain decode steps in one call (simulation only).

        A run continues while the batch stays the same: every running sequence decodes
        one token, none finishes, no block is copied or swapped, the pool has the blocks
        the step needs (no preemption), the head of the waiting queue still cannot start,
        and the step starts before ``next_arrival_s``. Each step updates the scheduler, KV
        manager and prefix index exactly as a single ``step`` would (tests compare both),
        without planning chunks or modeling each step separately: step times come from
        cost-model calls over windows of steps, stand-in tokens and the first EOS from
        vectorised draws, and the KV side from a ``DecodeRun``. Steps in which the waiting
        head provably cannot start (``Scheduler.quiet_decode_steps``) are reserved and
        completed together; the others one at a time, checking the head. Returns None when
        not even the first step qualifies (the caller steps normally); a step that turns
        out to admit a waiting group is left planned in the scheduler for that normal step.
        """
        scheduler = self.scheduler
        pairs = scheduler.decode_batch()
        if pairs is None:
            return None
        bases = self._stand_in_bases
        seed = self.ctx.seed
        # Steps before the first finish: the step producing a sequence's last token ends it.
        max_steps = MAX_DECODE_RUN_STEPS
        seq_bases, samples, positions, check_eos = [], [], [], []
        for group, seq in pairs:
            request = group.request
            max_steps = min(max_steps, request.max_new_tokens - seq.num_output_tokens - 1)
            base = bases.get(request.request_id)
            if base is None:
                base = bases[request.request_id] = stable_seed(seed, request.request_id)
            seq_bases.append(base)
            samples.append(seq.sample_index)
            positions.append(seq.num_output_tokens)
            check_eos.append(not request.ignore_eos)
        if max_steps <= 0:
            return None
        executor = self.executor
        assert isinstance(executor, CostModelExecutor)
        context = sum(len(seq.token_ids) for _, seq in pairs)
        num_seqs = len(pairs)
        vocab, eos = self.ctx.spec.vocab_size, self.ctx.spec.eos_token_id
        eos_rows = np.asarray(check_eos) if any(check_eos) else None
        kv = self.kv
        run = kv.decode_run([seq.seq_id for _, seq in pairs])
        log = _RunLog(self, [group.request_id for group, _ in pairs], samples, context)
        start_s = now_s  # summed one step at a time, as the clock does
        offset = 0
        quiet = 0  # steps ahead known not to admit anything (reserved together)
        window = FIRST_DECODE_WINDOW
        ended = False
        while not ended and offset < max_steps:
            # Step times and tokens for a window of steps at a time, doubling: most runs
            # end within a few steps (an admission, a preemption), and modeling all
            # MAX_DECODE_RUN_STEPS up front wasted most of the work.
            size = min(window, max_steps - offset)
            window *= 2
            durations = executor.cost_model.decode_run_s(num_seqs, context + offset * num_seqs, size).tolist()
            tokens = stand_in_tokens(seq_bases, samples, [p + offset for p in positions], size, vocab)
            limit = size
            if eos_rows is not None:
                # The step in which some sequence samples EOS finishes it: a normal step.
                eos_hits = (tokens[eos_rows] == eos).any(axis=0)
                if eos_hits.any():
                    limit = int(eos_hits.argmax())
                    ended = True
            index = 0
            while index < limit:
                if start_s >= next_arrival_s:
                    ended = True  # the arrival is submitted before this step
                    break
                if quiet:
                    # Steps the head surely cannot join (see Scheduler.quiet_decode_steps):
                    # reserve them together, up to the arrival.
                    num = 1
                    end_s = start_s + durations[index]
                    cap = min(quiet, limit - index)
                    while num < cap and end_s < next_arrival_s:
                        end_s += durations[index + num]
                        num += 1
                    token_rows = tokens[:, index : index + num].tolist()  # [seq][step]
                    step_commits = scheduler.complete_decodes_many(pairs, token_rows)
                    reserved = run.advance_many(
                        num,
                        after_step=lambda step, commits=step_commits: scheduler.commit_decodes(commits[step]),
                    )
                    log.add_many(token_rows, durations[index : index + num], reserved)
                    quiet -= num
                    index += num
                    offset += num
                    start_s = end_s
                    continue
                if run.num_new_blocks() > kv.num_allocatable_blocks:
                    ended = True  # a preemption: a normal step
                    break
                counters0 = (kv.num_prefix_query_tokens, kv.num_prefix_hit_tokens, kv.num_evicted_blocks)
                if not scheduler.append_decodes(pairs, run):
                    # A waiting group starts in this step: the scheduler keeps its plan for
                    # the next normal step, whose stats count from here.
                    self._prepared_counters = counters0
                    ended = True
                    break
                quiet = scheduler.quiet_decode_steps(pairs, run, max_steps - offset - 1)
                step_tokens, duration_s = tokens[:, index].tolist(), durations[index]  # one per sequence
                scheduler.complete_decodes(pairs, step_tokens)
                log.add(step_tokens, duration_s, kv.usage_counts(), kv.num_evicted_blocks - counters0[2])
                index += 1
                offset += 1
                start_s += duration_s
        scheduler.finish_decodes(pairs)
        covered = log.finish()
        if covered is None:
            return None
        return StepOutput(
            tokens=(),
            first_scheduled=(),
            finished=(),
            rejected=(),
            stats=covered.template,
            modeled_duration_s=math.fsum(covered.durations_s),
            covered_steps=covered,
        )

    # ------------------------------------------------------------------ token selection
    def _swap_bytes(self, output: SchedulerOutput) -> tuple[int, int]:
        num_out = sum(len(op.swap_out) for op in output.kv_ops)
        num_in = sum(len(op.swap_in) for op in output.kv_ops)
        return num_out * self.bytes_per_block, num_in * self.bytes_per_block

    def _advance(
        self, targets: list[tuple[SequenceGroup, Sequence]], result: ExecutionResult
    ) -> list[TokenEvent]:
        """Pick next tokens for every sampling target and apply them (forks, beams, finishes)."""
        if not targets:
            return []
        if result.logits is None:
            return self._advance_without_logits(targets)
        logits = result.logits  # logits: [len(targets), vocab] fp32
        rows: list[int] = []
        keys: list[SampleKey] = []
        beams: dict[int, tuple[SequenceGroup, list[int]]] = {}
        for row, (group, seq) in enumerate(targets):
            request = group.request
            if group.is_beam:
                beams.setdefault(id(group), (group, []))[1].append(row)
            elif not group.has_forked and group.num_samples > 1:
                # The prompt's last logits give every sample its first token.
                for index in range(group.num_samples):
                    keys.append(SampleKey(request.request_id, index, 0, request.temperature))
                    rows.append(row)
            else:
                keys.append(
                    SampleKey(
                        request.request_id, seq.sample_index, seq.num_output_tokens, request.temperature
                    )
                )
                rows.append(row)
        events: list[TokenEvent] = []
        if keys:
            index_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            tokens = self.sampler.sample(logits.index_select(0, index_t), keys)
            cursor = 0
            for group, seq in targets:
                if group.is_beam:
                    continue
                if not group.has_forked and group.num_samples > 1:
                    firsts = tokens[cursor : cursor + group.num_samples]
                    cursor += group.num_samples
                    self.scheduler.fork_samples(group, firsts)
                    events.extend(TokenEvent(group.request_id, i, t) for i, t in enumerate(firsts))
                else:
                    token = tokens[cursor]
                    cursor += 1
                    events.append(TokenEvent(group.request_id, seq.sample_index, token))
                    self.scheduler.append_token(group, seq, token)
        for group, group_rows in beams.values():
            events.extend(self._advance_beams(group, [targets[r][1] for r in group_rows], logits, group_rows))
        return events

    def _advance_beams(
        self, group: SequenceGroup, seqs: list[Sequence], logits: torch.Tensor, rows: list[int]
    ) -> list[TokenEvent]:
        request = group.request
        index_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logprobs = log_softmax(logits.index_select(0, index_t))  # [num_beams, vocab]
        eos = None if request.ignore_eos else self.ctx.spec.eos_token_id
        chosen, finished = rank_beam_candidates(
            logprobs, [s.cum_logprob for s in seqs], request.beam_width, eos
        )
        live = self.scheduler.advance_beams(
            group,
            [(seqs[beam], token, score) for beam, token, score in chosen],
            [(score, (*seqs[beam].output_token_ids, token)) for beam, token, score in finished],
        )
        del live
        return [TokenEvent(request.request_id, rank, token) for rank, (_, token, _) in enumerate(chosen)]

    def _advance_without_logits(self, targets: list[tuple[SequenceGroup, Sequence]]) -> list[TokenEvent]:
        """Cost-model execution: no logits, so each target gets a seeded stand-in token.

        Tokens are drawn from [3, vocab) by (seed, request, sample, position)
        (``stand_in_token``), so outputs of different requests do not collide in the
        prefix cache. Beams continue one
        stand-in token each (no ranking without logits).
        """
        vocab = self.ctx.spec.vocab_size
        seed = self.ctx.seed
        bases = self._stand_in_bases

        def stand_in(group: SequenceGroup, sample_index: int, position: int) -> int:
            base = bases.get(group.request_id)
            if base is None:
                base = bases[group.request_id] = stable_seed(seed, group.request_id)
            return stand_in_token(base, sample_index, position, vocab)

        events: list[TokenEvent] = []
        done_beams: set[int] = set()
        for group, seq in targets:
            if group.is_beam:
                if id(group) in done_beams:
                    continue
                done_beams.add(id(group))
                beams = list(group.seqs) if group.has_forked else [seq] * group.num_samples
                chosen = [
                    (beam, stand_in(group, i, beam.num_output_tokens), 0.0) for i, beam in enumerate(beams)
                ]
                self.scheduler.advance_beams(group, chosen, [])
                events.extend(TokenEvent(group.request_id, i, t) for i, (_, t, _) in enumerate(chosen))
            elif not group.has_forked and group.num_samples > 1:
                firsts = [stand_in(group, i, 0) for i in range(group.num_samples)]
                self.scheduler.fork_samples(group, firsts)
                events.extend(TokenEvent(group.request_id, i, t) for i, t in enumerate(firsts))
            else:
                token = stand_in(group, seq.sample_index, seq.num_output_tokens)
                events.append(TokenEvent(group.request_id, seq.sample_index, token))
                self.scheduler.append_token(group, seq, token)
        return events
