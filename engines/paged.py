"""The paged engine (PagedAttention, vLLM style): scheduler + block KV manager + executor + sampler.

One ``step()``::

    scheduler.schedule()          reserve KV slots, preempt / swap / admit  (tensor-free)
    executor.execute(output)      apply KV ops, run the model over the chunks -> logits
    scheduler.complete_step()     mark chunks computed, register full blocks in the prefix index
                                  (prefill chunks at schedule() with register_blocks=on_schedule)
    sample / rank beams           Sampler (batch-independent keys) or beam ranking
    scheduler.append_token / fork_samples / advance_beams

Sampling uses ``SampleKey(request_id, sample_index, output position, temperature)``, the
same keys as the dense reference, so outputs do not depend on batching, chunking,
preemption or sharing. Parallel samples are forked from the prompt sequence after its
last prompt token (sharing every prompt block); beams are ranked jointly every step
(the best ``beam_width`` of all (beam, token) continuations by cumulative log-probability).

The engine is an assembly: ``EngineConfig`` and ``size_pool`` (engines/config.py), a KV
manager (engines/kv), the scheduler (engines/sched), an executor (engines/exec or the
cost model of engines/sim) and, in simulation, the fast path (engines/sim/fast_forward.py).
The slab and bounded engines assemble the same parts around their own managers
(``PagedEngine.assemble``).

Simulation imports no torch: the torch executor and the sampler (engines/exec) are
imported by the builders only real mode calls (``torch_executor``, ``PagedEngine._sampling``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvbench.engines.config import DEFAULTS, PREFIX_INDEXES, EngineConfig, size_pool
from kvbench.engines.exec.protocol import ExecutionResult, Executor
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.kv.protocol import DecodeRunKV, KVManager
from kvbench.engines.sched.scheduler import Scheduler, SchedulerOutput
from kvbench.engines.sched.sequence import Sequence, SequenceGroup
from kvbench.engines.sim.executor import CostModelExecutor
from kvbench.engines.sim.fast_forward import FastForward
from kvbench.engines.sim.stand_in import StandInTokens
from kvbench.sim.cost_model import StepShape
from kvbench.sizing import kv_bytes_per_block, kv_bytes_per_token
from kvbench.types import EngineContext, KVUsage, Request, StepOutput, StepStats, TokenEvent

if TYPE_CHECKING:
    from kvbench.engines.exec.executor import TorchExecutor
    from kvbench.engines.exec.sampler import LogitsTokens
    from kvbench.model import LlamaModel


def torch_executor(
    model: LlamaModel, ctx: EngineContext, config: EngineConfig, num_blocks: int, num_host_blocks: int
) -> TorchExecutor:
    """Real mode's executor for a pool of ``num_blocks`` (and ``num_host_blocks`` on the
    host): ``model`` over torch KV tensors on ``ctx.device``. Imports torch, the model and
    the attention kernels here, so simulation, which never calls this, never loads them."""
    from kvbench.engines.exec.executor import TorchExecutor

    return TorchExecutor(
        model,
        num_blocks=num_blocks,
        block_size=config.block_size,
        num_host_blocks=num_host_blocks,
        device=ctx.device,
        kv_dtype=ctx.kv_dtype,
        decode_backend=config.decode_backend,
    )


def synchronize_cuda() -> None:
    """Wait for the current CUDA device's queued work. Only a real run on CUDA calls it,
    and such a run has torch loaded already."""
    import torch

    torch.cuda.synchronize()


class PagedEngine:
    """Paged KV engine; see the module docstring. Parameters mirror ``conf/engine/paged.yaml``
    (defaults and checks: ``engines/config.EngineConfig``).

    A variant plugs in its own KV manager (the ``engines/kv/protocol.KVManager`` contract)
    with ``kv_manager_factory(num_blocks, block_size, bytes_per_token)``, called once the
    engine has sized the pool; or builds its parts itself and calls ``assemble``.

    ``fast_forward`` (simulation mode only) lets one ``step`` cover a run of plain decode
    steps once the runner has called ``set_next_arrival_s``; results are identical to
    stepping one iteration per call (``fast_forward=False``), only faster.

    ``register_blocks`` says when a prefill chunk's KV becomes visible to prefix matches:
    ``on_completion`` (after the step) or ``on_schedule`` (vLLM: a request admitted later
    in the same scheduling pass hits blocks still being computed; exact in real mode, as
    every chunk's K/V of a layer is written before that layer's attention).

    Raises ValueError naming ``engine.<parameter>`` for an invalid parameter.
    """

    def __init__(
        self,
        ctx: EngineContext,
        *,
        name: str = "paged",
        block_size: int = DEFAULTS.block_size,
        num_blocks: int | None = DEFAULTS.num_blocks,
        kv_memory_bytes: int | None = DEFAULTS.kv_memory_bytes,
        gpu_memory_utilization: float = DEFAULTS.gpu_memory_utilization,
        max_num_seqs: int = DEFAULTS.max_num_seqs,
        max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens,
        chunked_prefill: bool = DEFAULTS.chunked_prefill,
        prefix_cache: str = DEFAULTS.prefix_cache,
        preemption: str = DEFAULTS.preemption,
        victim_policy: str = DEFAULTS.victim_policy,
        num_host_blocks: int = DEFAULTS.num_host_blocks,
        decode_backend: str = DEFAULTS.decode_backend,
        fast_forward: bool = DEFAULTS.fast_forward,
        register_blocks: str = DEFAULTS.register_blocks,
        executor: Executor | None = None,
        kv_manager_factory: Callable[[int, int, int], KVManager] | None = None,
    ) -> None:
        config = EngineConfig.from_arguments(locals())
        num_blocks, executor = size_pool(ctx, config, executor)
        bytes_per_token = kv_bytes_per_token(ctx.spec, ctx.kv_dtype)
        if kv_manager_factory is not None:
            kv = kv_manager_factory(num_blocks, config.block_size, bytes_per_token)
        else:
            kv = PagedKVManager(
                num_blocks,
                config.block_size,
                bytes_per_token,
                PREFIX_INDEXES[config.prefix_cache](),
                config.host_blocks_for(num_blocks),
            )
        # Only the plain paged manager's own accounting is what PagedDecodeRun assumes.
        self._build(ctx, name, config, num_blocks, executor, kv, kv if type(kv) is PagedKVManager else None)

    @classmethod
    def assemble(
        cls,
        ctx: EngineContext,
        *,
        name: str,
        config: EngineConfig,
        num_blocks: int,
        executor: Executor | None,
        kv: KVManager,
    ) -> PagedEngine:
        """An engine over parts a variant built itself: ``kv`` manages the pool of
        ``num_blocks`` blocks that ``size_pool`` gave for ``config`` (the executor's
        tensors must fit it); ``executor`` None builds the torch executor."""
        engine = cls.__new__(cls)
        engine._build(ctx, name, config, num_blocks, executor, kv, None)
        return engine

    def _build(
        self,
        ctx: EngineContext,
        name: str,
        config: EngineConfig,
        num_blocks: int,
        executor: Executor | None,
        kv: KVManager,
        decode_runs: DecodeRunKV | None,
    ) -> None:
        """Wire the engine over ``kv``; ``decode_runs``: the same manager when simulation
        may fast-forward decode runs over it (``engines/sim/fast_forward.py``), else None."""
        spec = ctx.spec
        self.name = name
        self.ctx = ctx
        self.engine_config = config
        self.bytes_per_token = kv_bytes_per_token(spec, ctx.kv_dtype)
        self.bytes_per_block = kv_bytes_per_block(spec, ctx.kv_dtype, config.block_size)
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = config.host_blocks_for(num_blocks)
        self.prefix_cache = config.prefix_cache
        self.gpu_memory_utilization = config.gpu_memory_utilization
        self.kv = kv
        if executor is None:
            if ctx.model is None:
                raise ValueError(
                    f"engine.{name}: ctx.model is None (simulation mode) and no executor was given; "
                    "pass a cost-model executor"
                )
            executor = torch_executor(ctx.model, ctx, config, num_blocks, self.num_host_blocks)
        self.executor = executor
        self.config = config.scheduler_config(spec.max_position_embeddings)
        self.scheduler = Scheduler(
            kv, self.config, spec.eos_token_id, chunk_contents=executor.reads_chunk_contents
        )
        # run.device is "cpu", "cuda" or "cuda:N" (kvbench.config checks it in real mode).
        self._is_cuda = ctx.device.partition(":")[0] == "cuda"
        # Token selection from logits (real mode), built by the first step that has logits.
        self._logits_tokens: LogitsTokens | None = None
        self._stand_ins = StandInTokens(ctx.seed, spec.vocab_size)
        # Fast-forward (simulation only): the cost-model executor prices a decode run in
        # one call; ``decode_runs`` is ``kv`` when its class offers decode runs whose
        # accounting is its own (not a subclass overriding append or usage).
        self._fast: FastForward | None = None
        if config.fast_forward and isinstance(executor, CostModelExecutor) and decode_runs is not None:
            self._fast = FastForward(
                self.scheduler, decode_runs, executor, self._stand_ins, spec.eos_token_id, self.step_stats
            )
        self._run_window: tuple[float, float] | None = None

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
        ``set_next_arrival_s``, a decode run of several (engines/sim/fast_forward.py). Mutates queues,
        KV state and outputs.

        On CUDA it synchronises before returning so the runner's clock reads finished work.
        """
        window, self._run_window = self._run_window, None
        kv = self.kv
        fast = self._fast
        counters0 = None
        if fast is not None:
            if window is not None:
                run = fast.run(*window)
                if run is not None:
                    return run
            # A step a decode run already began (its slots reserved) counts from before that.
            counters0, fast.prepared_counters = fast.prepared_counters, None
        if counters0 is None:
            counters0 = (kv.num_prefix_query_tokens, kv.num_prefix_hit_tokens, kv.num_evicted_blocks)
        output = self.scheduler.schedule()
        result = self.executor.execute(output)
        targets = self.scheduler.complete_step()
        # Memory and concurrency of the step as executed: read before sampling retires
        # finished sequences (and frees their blocks), or a request's last step would
        # never show its KV and peaks would read low.
        usage = self.kv.usage()
        num_running = self.scheduler.num_running_seqs()
        events = self._advance(targets, result)
        finished = self.scheduler.pop_finished()
        if self._is_cuda:
            synchronize_cuda()
        for done in finished:
            self._stand_ins.forget(done.request_id)
        bytes_to_host, bytes_from_host = self._swap_bytes(output)
        stats = self.step_stats(
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

    def step_stats(
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
            num_running = scheduler.num_running_seqs()
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

    # ------------------------------------------------------------------ token selection
    def _swap_bytes(self, output: SchedulerOutput) -> tuple[int, int]:
        num_out = sum(len(op.swap_out) for op in output.kv_ops)
        num_in = sum(len(op.swap_in) for op in output.kv_ops)
        return num_out * self.bytes_per_block, num_in * self.bytes_per_block

    def _advance(
        self, targets: list[tuple[SequenceGroup, Sequence]], result: ExecutionResult
    ) -> list[TokenEvent]:
        """Pick next tokens for every sampling target and apply them (forks, beams,
        finishes): sampled from the step's logits, or seeded stand-ins when it has none."""
        if not targets:
            return []
        if result.logits is None:
            return self._stand_ins.advance(self.scheduler, targets)
        return self._sampling().advance(self.scheduler, targets, result.logits)

    def _sampling(self) -> LogitsTokens:
        """The engine's token selection from logits (built once; it imports torch, which a
        step that produced logits has loaded already)."""
        if self._logits_tokens is None:
            from kvbench.engines.exec.sampler import LogitsTokens

            self._logits_tokens = LogitsTokens(self.ctx.seed, self.ctx.spec.eos_token_id)
        return self._logits_tokens
