"""Simulation mode for engines built on the shared scheduler: a cost-model executor.

``CostModelExecutor`` implements the executor interface of ``engines/executor.py``
(``execute(SchedulerOutput) -> ExecutionResult``) without tensors: it reads the step's
chunks and KV ops, asks the roofline cost model (kvbench.sim.cost_model) how long the
step takes, and returns ``ExecutionResult(logits=None, modeled_duration_s=...)``. The
scheduler, the KV manager and the prefix index run unchanged, so block counts per step
are exactly those of a real engine with the same pool; without logits the paged engine
feeds each sequence a seeded stand-in token (``PagedEngine._advance_without_logits``),
so prefix caches see the same reuse a real run would for the prompts.

The pool of a simulated engine is sized the way real engines size theirs on
``ctx.hardware`` (kvbench.sim.pool), unless a block count is given::

    sim_setup(ctx, block_size=16, num_blocks=None)  ->  (num_blocks, executor)

Engines on the shared scheduler (paged, H2O / StreamingLLM, offload) resolve their pool
and executor through ``pool_and_executor``, which calls ``sim_setup`` in simulation mode.

``simulated_engine`` wraps any engine factory that accepts ``num_blocks=`` and
``executor=`` keywords (the paged engine) for use as a Hydra target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvbench.engines.executor import ExecutionResult
from kvbench.sim.cost_model import CostModel, StepShape
from kvbench.sim.pool import plan_kv_pool
from kvbench.sizing import DEFAULT_ACTIVATION_RESERVE_BYTES, GIB, kv_bytes_per_block
from kvbench.types import Engine, EngineContext

if TYPE_CHECKING:
    from kvbench.engines.scheduler import SchedulerOutput


class CostModelExecutor:
    """Executor of simulation mode (see module docstring). Keeps running totals only.

    ``execute`` mutates ``num_steps`` and ``total_modeled_s`` and nothing else; it never
    raises for a well-formed ``SchedulerOutput``.
    """

    # Prices steps from their shapes: chunk token ids and block tables go unread
    # (``Scheduler(chunk_contents=False)``).
    reads_chunk_contents = False

    def __init__(self, cost_model: CostModel, *, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"engine.block_size: must be > 0, got {block_size}")
        self.cost_model = cost_model
        self.block_size = block_size
        self.bytes_per_block = block_size * cost_model.kv_bytes_per_token
        self.num_steps = 0
        self.total_modeled_s = 0.0

    @classmethod
    def from_context(cls, ctx: EngineContext, *, block_size: int) -> CostModelExecutor:
        """Cost model of ``ctx.spec`` on ``ctx.hardware``: KV in ``ctx.kv_dtype``, weights in
        ``ctx.spec.dtype`` (an FP8 checkpoint is ``model.dtype=fp8``)."""
        return cls(
            CostModel.for_dtypes(ctx.spec, ctx.hardware, ctx.kv_dtype, ctx.spec.dtype), block_size=block_size
        )

    def shape(self, output: SchedulerOutput) -> StepShape:
        """The step's composition: decode chunks by context length, prefill chunks by
        (start, length), swapped blocks as host bytes. Pure."""
        shape = output.shape
        num_swapped = sum(len(op.swap_out) + len(op.swap_in) for op in output.kv_ops)
        if num_swapped:
            shape = dataclasses.replace(shape, host_bytes=num_swapped * self.bytes_per_block)
        return shape

    def execute(self, output: SchedulerOutput) -> ExecutionResult:
        """No tensors: the modeled duration of ``output`` and no logits."""
        duration_s = self.cost_model.duration_s(self.shape(output))
        self.num_steps += 1
        self.total_modeled_s += duration_s
        return ExecutionResult(logits=None, modeled_duration_s=duration_s)

    def decode_run_s(self, output: SchedulerOutput, num_steps: int) -> list[float]:
        """Durations of ``output`` and the ``num_steps - 1`` decode steps that repeat it.

        The fast-forward hook: when the scheduler knows the batch stays the same (no
        arrival, finish or new block) for ``num_steps`` steps, each sequence grows by
        one token per step and the engine can take every step's time from one call.
        Mutates the running totals as if ``execute`` had been called ``num_steps``
        times. Raises ValueError unless ``output`` is decode-only with no KV ops.
        """
        if not output.chunks or not all(chunk.is_decode for chunk in output.chunks):
            raise ValueError("decode run: the step must be decode-only")
        if any(op.copies or op.swap_in or op.swap_out for op in output.kv_ops):
            raise ValueError("decode run: the step has KV copies or swaps, which are not repeated")
        context = sum(chunk.start_pos + 1 for chunk in output.chunks)
        durations = self.cost_model.decode_run_s(len(output.chunks), context, num_steps).tolist()
        self.num_steps += num_steps
        self.total_modeled_s += sum(durations)
        return durations

    def describe(self) -> dict[str, Any]:
        hw = self.cost_model.hardware
        return {
            "executor": "cost_model",
            "sim_hardware": hw.name,
            "sim_weight_bytes": self.cost_model.weight_bytes,
            "sim_memory_efficiency": hw.memory_efficiency,
            "sim_mfu": hw.mfu,
        }


def sim_setup(
    ctx: EngineContext,
    *,
    block_size: int,
    num_blocks: int | None,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
    log: Callable[[str], None] | None = print,
) -> tuple[int, CostModelExecutor]:
    """Block count and executor of a simulated engine.

    ``num_blocks=None`` sizes the pool from ``ctx.hardware`` like a real engine
    (kvbench.sim.pool.plan_kv_pool); either way the pool's one-line summary goes to ``log``.
    Raises SpecError (weights do not fit, bad dtype) or ValueError naming the parameter.
    """
    if num_blocks is None:
        plan = plan_kv_pool(
            ctx.spec,
            ctx.hardware,
            kv_dtype=ctx.kv_dtype,
            weight_dtype=ctx.spec.dtype,
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            activation_reserve_bytes=activation_reserve_bytes,
        )
        num_blocks = plan.num_blocks
        if log is not None:
            log(plan.summary())
    elif num_blocks <= 0:
        raise ValueError(f"engine.num_blocks: must be > 0 (or null), got {num_blocks}")
    else:
        per_block = kv_bytes_per_block(ctx.spec, ctx.kv_dtype, block_size)  # validates block_size, dtype
        if log is not None:
            log(
                f"KV pool {ctx.spec.name} on {ctx.hardware.name}: {num_blocks:,} blocks x {block_size} tokens "
                f"({num_blocks * block_size:,} tokens, {num_blocks * per_block / GIB:,.2f} GiB, "
                f"{per_block // block_size / 1024:,.0f} KiB/token {ctx.kv_dtype}) set by engine.num_blocks "
                "or engine.kv_memory_bytes"
            )
    kv_bytes_per_block(ctx.spec, ctx.kv_dtype, block_size)  # validates block_size and dtype
    return num_blocks, CostModelExecutor.from_context(ctx, block_size=block_size)


def pool_and_executor(
    ctx: EngineContext,
    *,
    block_size: int,
    num_blocks: int | None,
    kv_memory_bytes: int | None,
    executor: Any,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> tuple[int, Any]:
    """An engine's block count and executor from its parameters, in either mode.

    ``num_blocks`` wins; else ``kv_memory_bytes // bytes_per_block``; in simulation
    mode with no executor given, the cost-model executor and (sizes still unset) the
    pool a real engine would get on ``ctx.hardware`` (``sim_setup``). The executor
    comes back unchanged otherwise (None: the engine builds its own). Raises ValueError
    naming ``engine.<parameter>`` for a size that is not positive, holds no block, or is
    unset outside simulation.
    """
    if num_blocks is None and kv_memory_bytes is not None:
        if kv_memory_bytes <= 0:
            raise ValueError(f"engine.kv_memory_bytes: must be > 0 (or null), got {kv_memory_bytes}")
        per_block = kv_bytes_per_block(ctx.spec, ctx.kv_dtype, block_size)
        num_blocks = kv_memory_bytes // per_block
        if num_blocks == 0:
            raise ValueError(
                f"engine.kv_memory_bytes: {kv_memory_bytes} bytes hold no block of {per_block} bytes "
                f"(block_size {block_size})"
            )
    elif num_blocks is not None and num_blocks <= 0:
        raise ValueError(f"engine.num_blocks: must be > 0 (or null), got {num_blocks}")
    if executor is None and ctx.mode == "sim":
        num_blocks, executor = sim_setup(
            ctx,
            block_size=block_size,
            num_blocks=num_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            activation_reserve_bytes=activation_reserve_bytes,
        )
    if num_blocks is None:
        raise ValueError(
            "engine.kv_memory_bytes: null sizes the pool from the hardware profile, which only "
            f"simulation mode does (run.mode=sim; this run is {ctx.mode!r}); set kv_memory_bytes "
            "or num_blocks"
        )
    return num_blocks, executor


def simulated_engine(
    ctx: EngineContext,
    *,
    engine: Callable[..., Engine],
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
    name: str | None = None,
    **params: Any,
) -> Engine:
    """Build ``engine(ctx, block_size=, num_blocks=, executor=, **params)`` for simulation mode.

    ``engine`` is a partial of an engine class built on the shared scheduler (Hydra:
    ``engine: {_target_: kvbench.engines.paged.PagedEngine, _partial_: true}``); every
    other parameter of that engine passes through ``params``. The pool is ``num_blocks``
    if given, else ``kv_memory_bytes // bytes_per_block`` if given, else sized from
    ``ctx.hardware`` (``sim_setup``). Raises ValueError when ``ctx.mode`` is not "sim"
    (a real run must not be modeled) or a size is not positive.
    """
    if ctx.mode != "sim":
        raise ValueError(f"engine: the simulated engine needs run.mode=sim, got {ctx.mode!r}")
    num_blocks, executor = pool_and_executor(  # sim mode, no executor: always the cost model
        ctx,
        block_size=block_size,
        num_blocks=num_blocks,
        kv_memory_bytes=kv_memory_bytes,
        executor=None,
        gpu_memory_utilization=gpu_memory_utilization,
        activation_reserve_bytes=activation_reserve_bytes,
    )
    built = engine(ctx, block_size=block_size, num_blocks=num_blocks, executor=executor, **params)
    if name is not None:
        built.name = name
    return built
