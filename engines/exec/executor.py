"""The torch executor: turns a ``SchedulerOutput`` into logits and owns the KV tensors.

It implements the executor interface of ``protocol.py`` (``Executor``, ``ExecutionResult``).
Only real mode imports this module (it imports torch, the model and the attention kernels).

``TorchExecutor`` keeps the whole device pool in one tensor::

    kv:   [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = K, V)
    host: [num_layers, 2, num_host_blocks, block_size, num_kv_heads, head_dim]  (swap tier)

and runs ``LlamaModel`` through ``PagedAttentionBackend``: each layer writes the step's
K/V into the slots of the block tables, then single-token chunks attend through one
batched paged decode call (torch gather or Triton on CUDA) and longer chunks through
``paged_prefill_attention``, one sequence at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kvbench.engines.exec.attention import (
    DecodeWorkspace,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from kvbench.engines.exec.protocol import ExecutionResult
from kvbench.engines.exec.triton_attention import select_decode_backend
from kvbench.model import LlamaModel, torch_dtype

if TYPE_CHECKING:
    from kvbench.engines.kv.protocol import KVOps
    from kvbench.engines.sched.scheduler import ScheduledChunk, SchedulerOutput


class PagedAttentionBackend:
    """``kvbench.model.AttentionBackend`` over the paged pool, prepared once per step.

    Token layout of a step (set by ``prepare``)::

        [ decode tokens (one per sequence) | prefill chunk 0 | prefill chunk 1 | ... ]
          batched paged decode               one paged prefill call per chunk
    """

    def __init__(self, kv: Tensor, scale: float, decode_fn: Any, workspace: DecodeWorkspace | None) -> None:
        self.kv = kv  # kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.scale = scale
        self.decode_fn = decode_fn
        self.workspace = workspace
        self.slot_mapping = torch.empty(0, dtype=torch.int64)
        self.num_decode = 0
        self.block_tables = torch.empty(0, 0, dtype=torch.int32)
        self.context_lens = torch.empty(0, dtype=torch.int32)
        self.prefills: list[tuple[int, int, int, Tensor]] = []  # (offset, num_tokens, start_pos, table)

    def prepare(
        self,
        slot_mapping: Tensor,
        num_decode: int,
        block_tables: Tensor,
        context_lens: Tensor,
        prefills: list[tuple[int, int, int, Tensor]],
    ) -> None:
        """Set the step's layout. slot_mapping: int64 [T]; block_tables: int32 [num_decode, max_blocks];
        context_lens: int32 [num_decode]; prefills: (token offset, num tokens, start position, int32 table)."""
        self.slot_mapping = slot_mapping
        self.num_decode = num_decode
        self.block_tables = block_tables
        self.context_lens = context_lens
        self.prefills = prefills

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write this layer's K/V for the step's tokens, then attend. Mutates ``kv[layer]``."""
        k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]  # [num_blocks, block_size, Hkv, D]
        write_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype), self.slot_mapping)
        q_cache = q.to(k_cache.dtype)  # attention runs in the cache dtype (kv_dtype may differ)
        out = torch.empty_like(q_cache)  # out: [T, Hq, D]
        nd = self.num_decode
        if nd:
            out[:nd] = self.decode_fn(
                q_cache[:nd],
                k_cache,
                v_cache,
                self.block_tables,
                self.context_lens,
                self.scale,
                workspace=self.workspace,
            )
        for offset, num_tokens, start_pos, table in self.prefills:
            out[offset : offset + num_tokens] = paged_prefill_attention(
                q_cache[offset : offset + num_tokens], k_cache, v_cache, table, start_pos, self.scale
            )
        return out.to(q.dtype)


class TorchExecutor:
    """Real execution on ``device``: the KV pool tensors plus the model forward (see module doc)."""

    reads_chunk_contents = True

    def __init__(
        self,
        model: LlamaModel,
        *,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        device: str,
        kv_dtype: str,
        decode_backend: str = "auto",
    ) -> None:
        spec = model.spec
        try:
            dtype = torch_dtype(kv_dtype)
        except ValueError:
            raise ValueError(
                f"kv_dtype: {kv_dtype!r} cannot be stored by the paged executor (use fp32, bf16 or fp16)"
            ) from None
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        host_shape = (spec.num_layers, 2, num_host_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        pin = self.device.type == "cuda"
        self.host = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.decode_fn = select_decode_backend(device, decode_backend)
        # The torch gather path reuses its buffers across steps; Triton needs none.
        workspace = DecodeWorkspace() if self.decode_fn is paged_decode_attention else None
        self.backend = PagedAttentionBackend(self.kv, model.scale, self.decode_fn, workspace)

    def describe(self) -> dict[str, Any]:
        return {
            # select_decode_backend returns one of two module functions: its name is the backend.
            "decode_backend": self.decode_fn.__name__,
            "kv_pool_shape": list(self.kv.shape),
            "host_pool_shape": list(self.host.shape),
        }

    # ------------------------------------------------------------------ KV ops
    def apply_ops(self, ops: tuple[KVOps, ...]) -> None:
        """Do the block copies and swaps, in order. Mutates ``kv`` and ``host``."""
        for op in ops:
            if op.swap_out:
                device_ids = self._index([d for d, _ in op.swap_out], self.device)
                host_ids = self._index([h for _, h in op.swap_out], torch.device("cpu"))
                self.host[:, :, host_ids] = self.kv[:, :, device_ids].to("cpu")
            if op.swap_in:
                host_ids = self._index([h for h, _ in op.swap_in], torch.device("cpu"))
                device_ids = self._index([d for _, d in op.swap_in], self.device)
                # Gather into page-locked memory on CUDA: fancy indexing of the pinned pool
                # would make an unpinned copy and silently turn non_blocking into a sync.
                shape = (*self.host.shape[:2], len(op.swap_in), *self.host.shape[3:])
                staged = torch.empty(shape, dtype=self.host.dtype, pin_memory=self.kv.is_cuda)
                torch.index_select(self.host, 2, host_ids, out=staged)
                self.kv[:, :, device_ids] = staged.to(self.device, non_blocking=True)
            if op.copies:
                # Copy-on-write: sources are shared blocks, destinations fresh ones (disjoint sets).
                src = self._index([s for s, _ in op.copies], self.device)
                dst = self._index([d for _, d in op.copies], self.device)
                self.kv[:, :, dst] = self.kv[:, :, src]

    @staticmethod
    def _index(ids: list[int], device: torch.device) -> Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=device)

    # ------------------------------------------------------------------ forward
    def execute(self, output: SchedulerOutput) -> ExecutionResult:
        """Apply the step's KV ops, run the model over its chunks, return sampling logits.

        Mutates the KV pool (ops, then each layer's K/V writes). Returns fp32 logits
        [num_sampling_chunks, vocab] in chunk order (an empty tensor when none samples).
        """
        self.apply_ops(output.kv_ops)
        chunks = output.chunks
        if not chunks:
            return ExecutionResult(logits=torch.empty(0, self.model.spec.vocab_size, device=self.device))
        bs = self.block_size
        decode = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        prefill = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}  # chunk index -> row of its last token in the flat batch
        for i in decode:
            chunk = chunks[i]
            pos = chunk.start_pos
            last_row[i] = len(input_ids)
            input_ids.append(chunk.token_ids[0])
            positions.append(pos)
            slots.append(chunk.block_table[pos // bs] * bs + pos % bs)
        prefills: list[tuple[int, int, int, Tensor]] = []
        for i in prefill:
            chunk = chunks[i]
            offset = len(input_ids)
            end = chunk.start_pos + chunk.num_tokens
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, end))
            table = chunk.block_table
            slots.extend(table[pos // bs] * bs + pos % bs for pos in range(chunk.start_pos, end))
            table_t = torch.tensor(table, dtype=torch.int32, device=self.device)
            prefills.append((offset, chunk.num_tokens, chunk.start_pos, table_t))
            last_row[i] = offset + chunk.num_tokens - 1
        block_tables, context_lens = self._decode_tables([chunks[i] for i in decode])
        device = self.device
        self.backend.prepare(
            torch.tensor(slots, dtype=torch.int64, device=device),
            len(decode),
            block_tables,
            context_lens,
            prefills,
        )
        hidden = self.model(  # hidden: [T, hidden_size]
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.backend,
        )
        rows = [last_row[i] for i, chunk in enumerate(chunks) if chunk.sample]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=device)])
        return ExecutionResult(logits=logits)

    def _decode_tables(self, chunks: list[ScheduledChunk]) -> tuple[Tensor, Tensor]:
        """Block tables int32 [B, max_blocks] (0-padded) and context lengths int32 [B]."""
        if not chunks:
            empty = torch.empty(0, 0, dtype=torch.int32, device=self.device)
            return empty, torch.empty(0, dtype=torch.int32, device=self.device)
        bs = self.block_size
        max_blocks = max(-(-(c.start_pos + 1) // bs) for c in chunks)
        rows = []
        for chunk in chunks:
            table = list(chunk.block_table[:max_blocks])
            rows.append(table + [0] * (max_blocks - len(table)))
        block_tables = torch.tensor(rows, dtype=torch.int32, device=self.device)
        context_lens = torch.tensor([c.start_pos + 1 for c in chunks], dtype=torch.int32, device=self.device)
        return block_tables, context_lens
