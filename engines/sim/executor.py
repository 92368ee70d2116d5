"""Simulation mode's executor: a cost model instead of tensors.

``CostModelExecutor`` implements the executor interface of ``engines/exec/protocol.py``
(``execute(SchedulerOutput) -> ExecutionResult``) without tensors: it reads the step's
chunks and KV ops, asks the roofline cost model (kvbench.sim.cost_model) how long the
step takes, and returns ``ExecutionResult(logits=None, modeled_duration_s=...)``. The
scheduler, the KV manager and the prefix index run unchanged, so block counts per step
are exactly those of a real engine with the same pool; without logits the paged engine
feeds each sequence a seeded stand-in token (``engines/sim/fast_forward.py``), so prefix
caches see the same reuse a real run would for the prompts.

A simulated engine's pool is sized by ``engines/config.size_pool``, which builds this
executor in simulation mode.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvbench.engines.exec.protocol import ExecutionResult
from kvbench.sim.cost_model import CostModel, StepShape
from kvbench.types import EngineContext

if TYPE_CHECKING:
    from kvbench.engines.sched.scheduler import SchedulerOutput


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

    def record_steps(self, durations_s: tuple[float, ...]) -> None:
        """Count steps priced elsewhere (a decode run's): mutates the running totals as
        ``execute`` would have, adding one duration at a time so the float sums match."""
        self.num_steps += len(durations_s)
        for duration_s in durations_s:
            self.total_modeled_s += duration_s

    def describe(self) -> dict[str, Any]:
        hw = self.cost_model.hardware
        return {
            "executor": "cost_model",
            "sim_hardware": hw.name,
            "sim_weight_bytes": self.cost_model.weight_bytes,
            "sim_memory_efficiency": hw.memory_efficiency,
            "sim_mfu": hw.mfu,
        }
