"""The executor interface: what the paged engine needs from any executor, free of tensors.

::

    class Executor(Protocol):
        reads_chunk_contents: bool
        def execute(self, output: SchedulerOutput) -> ExecutionResult: ...
        def describe(self) -> dict[str, Any]: ...

``execute`` first applies ``output.kv_ops`` in order (copy-on-write copies, swaps to and
from the host pool), then computes every ``ScheduledChunk`` and returns fp32 logits
``[num_sampling_chunks, vocab]``, one row per chunk with ``sample=True`` in chunk order.
A cost-model executor (simulation mode, ``engines/sim/executor.py``) implements the same
call and returns ``ExecutionResult(logits=None, modeled_duration_s=...)``: the scheduler
and the KV manager never see the difference.

This module imports no torch (tensors appear in annotations only), so simulation mode
assembles engines without it; the torch executors live in ``executor.py`` and
``bounded.py`` and are imported only where real mode builds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from kvbench.engines.sched.scheduler import SchedulerOutput


@dataclass(frozen=True)
class ExecutionResult:
    """What one executed step produced.

    ``logits``: fp32 [num_sampling_chunks, vocab] in chunk order, or None from a cost
    model; ``modeled_duration_s``: the cost model's step time, None for real execution.
    """

    logits: Tensor | None
    modeled_duration_s: float | None = None


class Executor(Protocol):
    # False when the executor reads neither chunk token ids nor block tables (simulation
    # prices steps from their shapes), so the scheduler need not copy them
    # (``Scheduler(chunk_contents=...)``).
    reads_chunk_contents: bool

    def execute(self, output: SchedulerOutput) -> ExecutionResult:
        """Apply ``output.kv_ops`` in order, run ``output.chunks``; see the module docstring."""
        ...

    def describe(self) -> dict[str, Any]:
        """Static facts for run.json (executor kind, tensor shapes or cost-model inputs). Pure."""
        ...
