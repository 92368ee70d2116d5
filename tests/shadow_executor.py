"""A tensor-free executor for scheduler tests: a shadow of every KV slot's token.

A shadow executor stands in for the model: it keeps, for every physical slot, the token
id whose K/V would be stored there, applies the step's KV ops (copies, swaps) in order,
and checks before and after each step's writes that every position a chunk attends to
holds exactly that sequence's token. Prefix sharing, copy-on-write, swap and recompute
bugs all show up as a wrong token in some slot.
"""

from __future__ import annotations

import torch

from kvbench.engines.exec.executor import ExecutionResult
from kvbench.engines.paged import PagedEngine
from kvbench.engines.sched.scheduler import SchedulerOutput
from kvbench.specs import HardwareSpec, ModelSpec
from kvbench.types import EngineContext

# A small vocabulary makes EOS (id 2) common when random logits drive sampling.
SPEC = ModelSpec(vocab_size=64)


class ShadowExecutor:
    """Tensor-free executor: tracks which token each KV slot holds and verifies reads."""

    reads_chunk_contents = True

    def __init__(self, block_size: int, random_logits: bool = False) -> None:
        self.block_size = block_size
        # Random logits exercise the engine's sampling, forking and beam ranking paths;
        # without them the engine uses its seeded stand-in tokens (cost-model path).
        self.generator = torch.Generator().manual_seed(0) if random_logits else None
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}
        self.engine: PagedEngine | None = None
        self.num_copies = 0

    def describe(self) -> dict:
        return {"executor": "shadow"}

    def _block(self, block: int) -> list[int | None]:
        return self.device.setdefault(block, [None] * self.block_size)

    def _verify(self, output: SchedulerOutput) -> None:
        assert self.engine is not None
        bs = self.block_size
        for chunk in output.chunks:
            seq = self.engine.scheduler.sequence_of(chunk.seq_id)
            for pos in range(chunk.start_pos):
                block = chunk.block_table[pos // bs]
                stored = self._block(block)[pos % bs]
                assert stored == seq.token_ids[pos], (
                    f"seq {chunk.seq_id} position {pos}: slot {block}*{bs}+{pos % bs} holds {stored}, "
                    f"expected {seq.token_ids[pos]}"
                )

    def execute(self, output: SchedulerOutput) -> ExecutionResult:
        for op in output.kv_ops:
            for device_block, host_block in op.swap_out:
                self.host[host_block] = list(self._block(device_block))
            for host_block, device_block in op.swap_in:
                self.device[device_block] = list(self.host[host_block])
            for src, dst in op.copies:
                self.device[dst] = list(self._block(src))
                self.num_copies += 1
        self._verify(output)
        bs = self.block_size
        for chunk in output.chunks:
            for offset, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + offset
                self._block(chunk.block_table[pos // bs])[pos % bs] = token
        self._verify(output)  # no chunk clobbered a slot another chunk attends to
        if self.generator is None:
            return ExecutionResult(logits=None, modeled_duration_s=0.0)
        logits = torch.randn(output.num_sampling_chunks, SPEC.vocab_size, generator=self.generator)
        return ExecutionResult(logits=logits)


def make_engine(random_logits: bool = False, **params) -> tuple[PagedEngine, ShadowExecutor]:
    block_size = params.get("block_size", 16)
    shadow = ShadowExecutor(block_size, random_logits)
    ctx = EngineContext(spec=SPEC, hardware=HardwareSpec(), model=None, mode="sim")
    engine = PagedEngine(ctx, executor=shadow, **params)
    shadow.engine = engine
    return engine, shadow
