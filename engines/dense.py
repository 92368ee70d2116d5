"""The dense reference engine: one contiguous max-length KV cache per sequence slot.

This is the gpt-fast layout and the numerical reference of every other engine: each
running sequence owns a slot of ``max_seq_len`` positions, requests are admitted
first come first served while slots are free, and every step runs the newly admitted
prompts (whole) together with one decode token for every running sequence.
Parallel samples (n > 1) each take their own slot (no sharing: this is the
baseline sharing is measured against). Beam search is not implemented here and
such requests are rejected with a reason.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvbench.engines.exec.sampler import SampleKey, Sampler
from kvbench.model import DenseKVCache, torch_dtype
from kvbench.sim.cost_model import StepShape
from kvbench.sizing import kv_bytes_per_token
from kvbench.types import (
    EngineContext,
    FinishedRequest,
    KVUsage,
    RejectedRequest,
    Request,
    StepOutput,
    StepStats,
    TokenEvent,
)


@dataclass
class _Sample:
    slot: int
    tokens: list[int]  # prompt + generated so far
    num_cached: int = 0  # positions whose KV is in the slot
    output: list[int] = field(default_factory=list)


@dataclass
class _Running:
    request: Request
    samples: list[_Sample]


class DenseEngine:
    """Reference engine; see the module docstring. Real mode only (needs ctx.model)."""

    def __init__(
        self,
        ctx: EngineContext,
        *,
        name: str = "dense",
        max_num_seqs: int = 8,
        max_seq_len: int | None = None,
    ) -> None:
        if ctx.model is None:
            raise ValueError("engine=dense needs the real model (run.mode=real)")
        if max_num_seqs <= 0:
            raise ValueError(f"engine.max_num_seqs: must be > 0, got {max_num_seqs}")
        self.name = name
        self.ctx = ctx
        self.model = ctx.model
        self.max_num_seqs = max_num_seqs
        self.max_seq_len = max_seq_len or ctx.spec.max_position_embeddings
        if not 0 < self.max_seq_len <= ctx.spec.max_position_embeddings:
            raise ValueError(
                f"engine.max_seq_len: must be in (0, {ctx.spec.max_position_embeddings}], got {self.max_seq_len}"
            )
        self.bytes_per_token = kv_bytes_per_token(ctx.spec, ctx.kv_dtype)
        self.cache = DenseKVCache(
            ctx.spec, max_num_seqs, self.max_seq_len, ctx.device, torch_dtype(ctx.kv_dtype)
        )
        self.sampler = Sampler(ctx.seed)
        self.waiting: deque[Request] = deque()
        self.running: list[_Running] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))

    # ------------------------------------------------------------------ protocol
    def add_request(self, request: Request) -> None:
        """Queue ``request`` (mutates the waiting queue). Unfit requests are rejected by step()."""
        self.waiting.append(request)

    def unsupported_reason(self, request: Request) -> str | None:
        if request.beam_width > 1:
            return "beam search is not supported by the dense reference engine"
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def describe(self) -> dict[str, Any]:
        return {
            "kv_bytes_per_token": self.bytes_per_token,
            "kv_pool_bytes": self.max_num_seqs * self.max_seq_len * self.bytes_per_token,
            "block_size": None,
            "max_num_seqs": self.max_num_seqs,
            "max_seq_len": self.max_seq_len,
        }

    def step(self) -> StepOutput:
        """Admit, run one forward over new prompts + running decodes, retire finished requests.

        Mutates the queues, the slots' KV and the samples' outputs.
        """
        rejected = self._reject_unfit()
        admitted = self._admit()
        # One batch entry per forward row group: (running, sample, slot layout).
        entries: list[tuple[_Running, _Sample]] = []
        for running in self.running:
            if running in admitted:
                entries.append((running, running.samples[0]))  # siblings copy its prompt KV
            else:
                entries.extend((running, s) for s in running.samples if not self._sample_done(running, s))
        layout = [(s.slot, s.num_cached, len(s.tokens) - s.num_cached) for _, s in entries]
        num_prefill = sum(n for (r, _), (_, _, n) in zip(entries, layout) if r in admitted)
        num_decode = sum(n for _, _, n in layout) - num_prefill
        num_running = sum(len(r.samples) for r in self.running)
        tokens: list[TokenEvent] = []
        if entries:
            logits = self._forward(entries, layout)
            self._copy_prompt_to_siblings(admitted)
            keys: list[SampleKey] = []
            rows: list[int] = []
            for row, (running, sample) in enumerate(entries):
                targets = running.samples if running in admitted else [sample]
                for target in targets:
                    index = running.samples.index(target)
                    request = running.request
                    keys.append(SampleKey(request.request_id, index, len(target.output), request.temperature))
                    rows.append(row)
            chosen = self.sampler.sample(logits[torch.tensor(rows, device=logits.device)], keys)
            by_id = {r.request.request_id: r for r in self.running}
            for key, token in zip(keys, chosen):
                sample = by_id[key.request_id].samples[key.sample_index]
                sample.output.append(token)
                sample.tokens.append(token)
                tokens.append(TokenEvent(key.request_id, key.sample_index, token))
        shape = StepShape.build(
            [(start, n) for (r, _), (_, start, n) in zip(entries, layout) if r in admitted],
            [start + n for (r, _), (_, start, n) in zip(entries, layout) if r not in admitted],
        )
        stats = StepStats(
            num_running=num_running,
            num_waiting=len(self.waiting),
            num_scheduled_tokens=num_prefill + num_decode,
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            kv=self.usage(),
            num_prefill_seqs=shape.num_prefill_seqs,
            num_prefill_attention_pairs=shape.num_prefill_attention_pairs,
            num_prefill_context_tokens=shape.num_prefill_context_tokens,
            num_decode_context_tokens=shape.num_decode_context_tokens,
        )
        return StepOutput(
            tokens=tuple(tokens),
            first_scheduled=tuple(r.request.request_id for r in admitted),
            finished=tuple(self._retire()),
            rejected=tuple(rejected),
            stats=stats,
        )

    def _forward(
        self, entries: list[tuple[_Running, _Sample]], layout: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """Run the model over every entry's uncached tokens; returns fp32 logits [entries, vocab]."""
        input_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for (_, sample), (_, start, num) in zip(entries, layout):
            input_ids.extend(sample.tokens[start:])
            positions.extend(range(start, start + num))
            last_rows.append(len(input_ids) - 1)
        device = self.ctx.device
        self.cache.prepare(layout)
        hidden = self.model(
            torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), self.cache
        )
        for (_, sample), (_, start, num) in zip(entries, layout):
            sample.num_cached = start + num
        return self.model.compute_logits(hidden[torch.tensor(last_rows, device=device)])

    def _sample_done(self, running: _Running, sample: _Sample) -> bool:
        request = running.request
        if len(sample.output) >= request.max_new_tokens:
            return True
        return (
            not request.ignore_eos and bool(sample.output) and sample.output[-1] == self.ctx.spec.eos_token_id
        )

    # ------------------------------------------------------------------ internals
    def usage(self) -> KVUsage:
        """Slot accounting: each live sample holds max_seq_len positions."""
        bpt = self.bytes_per_token
        num_slots_used = self.max_num_seqs - len(self.free_slots)
        token = reserved = 0
        for running in self.running:
            final = running.request.num_prompt_tokens + running.request.max_new_tokens
            for sample in running.samples:
                token += sample.num_cached
                reserved += final - sample.num_cached
        allocated = num_slots_used * self.max_seq_len
        return KVUsage(
            capacity_bytes=self.max_num_seqs * self.max_seq_len * bpt,
            allocated_bytes=allocated * bpt,
            token_bytes=token * bpt,
            reserved_unused_bytes=reserved * bpt,
            internal_frag_bytes=(allocated - token - reserved) * bpt,
        )

    def _reject_unfit(self) -> list[RejectedRequest]:
        rejected, kept = [], deque()
        for request in self.waiting:
            reason = self.unsupported_reason(request) or self._unfit_reason(request)
            if reason is None:
                kept.append(request)
            else:
                rejected.append(RejectedRequest(request.request_id, reason))
        self.waiting = kept
        return rejected

    def _unfit_reason(self, request: Request) -> str | None:
        """Why ``request`` cannot run in this engine's slots (their length and count). Pure."""
        if request.num_prompt_tokens + request.max_new_tokens > self.max_seq_len:
            return (
                f"prompt {request.num_prompt_tokens} + max_new_tokens {request.max_new_tokens} "
                f"exceeds max_seq_len {self.max_seq_len}"
            )
        if request.n > self.max_num_seqs:
            return f"n={request.n} exceeds max_num_seqs {self.max_num_seqs}"
        if request.num_prompt_tokens == 0 or request.max_new_tokens <= 0:
            return "empty prompt or max_new_tokens <= 0"
        return None

    def _admit(self) -> list[_Running]:
        admitted = []
        while self.waiting and len(self.free_slots) >= self.waiting[0].n:
            request = self.waiting.popleft()
            prompt = np.asarray(request.prompt_token_ids).tolist()  # tuples, arrays, computed ids
            samples = [_Sample(slot=self.free_slots.pop(), tokens=list(prompt)) for _ in range(request.n)]
            running = _Running(request, samples)
            self.running.append(running)
            admitted.append(running)
        return admitted

    def _copy_prompt_to_siblings(self, admitted: list[_Running]) -> None:
        for running in admitted:
            first = running.samples[0]
            for sibling in running.samples[1:]:
                self.cache.k[:, sibling.slot, : first.num_cached] = self.cache.k[
                    :, first.slot, : first.num_cached
                ]
                self.cache.v[:, sibling.slot, : first.num_cached] = self.cache.v[
                    :, first.slot, : first.num_cached
                ]
                sibling.num_cached = first.num_cached

    def _retire(self) -> list[FinishedRequest]:
        """Free the slots of requests whose every sample is done (mutates running/free_slots)."""
        finished, still = [], []
        for running in self.running:
            if not all(self._sample_done(running, s) for s in running.samples):
                still.append(running)
                continue
            self.free_slots.extend(s.slot for s in running.samples)
            # No sharing here: each sample holds its own copy of the prompt.
            slots = sum(len(s.tokens) - 1 for s in running.samples)
            finished.append(
                FinishedRequest(
                    request_id=running.request.request_id,
                    output_token_ids=tuple(tuple(s.output) for s in running.samples),
                    peak_kv_slots=slots,
                    peak_kv_slots_unshared=slots,
                )
            )
        self.running = still
        return finished
