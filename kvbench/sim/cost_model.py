"""Roofline cost model: the modeled duration of one engine step in simulation mode.

A step is described by its composition (``StepShape``): which prefill chunks and
decode sequences it runs and how many bytes it moves to or from the host. Its time is::

    memory_s   = (weights read + KV read + KV written) bytes
                 / (hbm_bandwidth_gbps * 1e9 * memory_efficiency)
    compute_s  = (2 * active_params * tokens + attention FLOPs)
                 / (bf16_tflops * 1e12 * mfu)
    overhead_s = step_overhead_s + per_token_overhead_s * tokens + per_seq_overhead_s * seqs
    transfer_s = host bytes / (pcie_gbps * 1e9)
    duration_s = max(memory_s, compute_s) + overhead_s + transfer_s

``max`` is the roofline: a step is bound by whichever of HBM traffic or arithmetic
takes longer, because a well-pipelined kernel overlaps the other. Overheads (launch,
scheduler, Python) and host copies are added because they do not overlap with the
forward pass in the engines modeled here (swap copies run before the forward).

Every coefficient comes from ``HardwareSpec`` (``conf/hardware/*.yaml``); ``kvbench
calibrate`` fits them (kvbench.sim.calibrate). Approximations, stated once:

- every parameter is counted in the FLOPs of every token (the lm_head of prefill tokens
  that do not sample is counted too: ~1.5 % of a 70B model);
- MoE: per token, the non-expert parameters plus ``k / E`` of the expert parameters do
  FLOPs; per step, the expected share of experts touched by ``T`` tokens under uniform
  routing, ``1 - (1 - k/E)**T``, has its weights read;
- attention FLOPs per (query, key) pair and layer: ``4 * num_q_heads * head_dim``
  (QK^T and PV), for MLA ``num_q_heads * (2 * (kv_lora_rank + qk_rope_head_dim) +
  2 * kv_lora_rank)`` (absorbed projections); each sequence reads its whole context,
  shared prefix blocks included (no cascade attention).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numba import njit

from kvbench.records import frozen_record
from kvbench.sizing import kv_bytes_per_token, num_params, weight_bytes
from kvbench.specs import HardwareSpec, ModelSpec, SpecError


@frozen_record
class StepShape:
    """The aggregate composition of one engine step: everything the cost model reads.

    Counts are for this step only. ``num_prefill_attention_pairs`` counts causal
    (query, key) pairs of the prefill chunks: a chunk of ``n`` tokens starting at
    position ``s`` attends ``n * s + n * (n + 1) / 2`` pairs. ``num_decode_context_tokens``
    is the sum of the decoding sequences' context lengths including the token decoded
    (the keys each one attends, which is also the KV it reads).
    """

    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    num_prefill_attention_pairs: int = 0
    num_prefill_context_tokens: int = 0  # KV tokens the chunks read: cached prefix + chunk
    num_decode_seqs: int = 0
    num_decode_context_tokens: int = 0
    host_bytes: int = 0  # bytes copied between device and host this step, both directions

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (prefill chunk tokens plus one per decode sequence)."""
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch (a chunked prompt counts once)."""
        return self.num_prefill_seqs + self.num_decode_seqs

    @staticmethod
    def build(
        prefill_chunks: Iterable[tuple[int, int]] = (),
        decode_context_lens: Iterable[int] = (),
        host_bytes: int = 0,
    ) -> StepShape:
        """Shape of a step from its parts. Pure; raises ValueError on negative lengths.

        ``prefill_chunks``: ``(start_position, num_tokens)`` per prefilling sequence
        (start = tokens already cached or computed before this chunk).
        ``decode_context_lens``: per decoding sequence, its length including the token
        decoded this step.
        """
        num_tokens = num_seqs = pairs = context = 0
        for start, n in prefill_chunks:
            if start < 0 or n <= 0:
                raise ValueError(
                    f"prefill chunk (start={start}, num_tokens={n}): need start >= 0, num_tokens > 0"
                )
            num_tokens += n
            num_seqs += 1
            pairs += n * start + n * (n + 1) // 2
            context += start + n
        lens = list(decode_context_lens)
        if any(length <= 0 for length in lens):
            raise ValueError(f"decode context lengths must be > 0, got {min(lens)}")
        if host_bytes < 0:
            raise ValueError(f"host_bytes: must be >= 0, got {host_bytes}")
        return StepShape(num_tokens, num_seqs, pairs, context, len(lens), sum(lens), host_bytes)


@frozen_record
class StepCost:
    """The modeled duration of one step and its parts, in seconds."""

    memory_s: float
    compute_s: float
    overhead_s: float
    transfer_s: float

    @property
    def duration_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.overhead_s + self.transfer_s

    @property
    def bound(self) -> str:
        """ "memory" or "compute": the roofline term that set the forward time."""
        return "memory" if self.memory_s >= self.compute_s else "compute"


@dataclass(frozen=True)
class StepFeatures:
    """Raw quantities of a step before the hardware coefficients are applied.

    ``duration_s = max(memory_bytes * s_per_byte, flops * s_per_flop) + step_overhead_s
    + per_token_overhead_s * num_tokens + per_seq_overhead_s * num_seqs + transfer_s``;
    calibration fits those coefficients against measured durations.
    """

    memory_bytes: float
    flops: float
    num_tokens: int
    num_seqs: int
    host_bytes: int


class CostModel:
    """Roofline step-time model of one model on one hardware profile (see module docstring).

    Immutable after construction; every method is a pure function of its arguments.
    Raises SpecError from construction when the specs are invalid.
    """

    def __init__(
        self, spec: ModelSpec, hardware: HardwareSpec, *, kv_bytes_per_token: int, weight_bytes: int
    ) -> None:
        spec.validate()
        hardware.validate()
        if kv_bytes_per_token <= 0 or weight_bytes <= 0:
            raise SpecError(
                f"cost model: kv_bytes_per_token ({kv_bytes_per_token}) and weight_bytes ({weight_bytes}) must be > 0"
            )
        self.spec = spec
        self.hardware = hardware
        self.kv_bytes_per_token = kv_bytes_per_token
        self.weight_bytes = weight_bytes
        total_params = num_params(spec)
        # Expert weights by the Llama-MoE formula, clipped to the published total.
        expert_params = 0
        if spec.num_experts > 1:
            expert_params = min(
                total_params,
                spec.num_layers * 3 * spec.hidden_size * spec.intermediate_size * spec.num_experts,
            )
        self._expert_share = expert_params / total_params
        self._expert_route_share = spec.num_experts_per_token / spec.num_experts
        active_params = total_params - expert_params * (1.0 - self._expert_route_share)
        self.flops_per_token = 2.0 * active_params
        if spec.kv_lora_rank > 0:
            per_head = 2 * (spec.kv_lora_rank + spec.qk_rope_head_dim) + 2 * spec.kv_lora_rank
        else:
            per_head = 4 * spec.head_dim
        # FLOPs of one (query, key) pair summed over layers and query heads.
        self.flops_per_attention_pair = float(spec.num_layers * spec.num_q_heads * per_head)
        self.s_per_byte = 1.0 / (hardware.hbm_bandwidth_gbps * 1e9 * hardware.memory_efficiency)
        self.s_per_flop = 1.0 / (hardware.bf16_tflops * 1e12 * hardware.mfu)
        self.s_per_host_byte = 1.0 / (hardware.pcie_gbps * 1e9)

    @classmethod
    def for_dtypes(
        cls, spec: ModelSpec, hardware: HardwareSpec, kv_dtype: str, weight_dtype: str
    ) -> CostModel:
        """A cost model whose byte sizes come from kvbench.sizing for these dtypes."""
        return cls(
            spec,
            hardware,
            kv_bytes_per_token=kv_bytes_per_token(spec, kv_dtype),
            weight_bytes=weight_bytes(spec, weight_dtype),
        )

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weight bytes one forward over ``num_tokens`` tokens reads (MoE: experts touched)."""
        if num_tokens <= 0:
            return 0.0
        if self._expert_share == 0.0:
            return float(self.weight_bytes)
        touched = 1.0 - (1.0 - self._expert_route_share) ** num_tokens
        return self.weight_bytes * (1.0 - self._expert_share + self._expert_share * touched)

    def features(self, shape: StepShape) -> StepFeatures:
        """Bytes, FLOPs and counts of ``shape`` (hardware-independent)."""
        tokens = shape.num_tokens
        kv_tokens = shape.num_decode_context_tokens + shape.num_prefill_context_tokens + tokens
        memory_bytes = self.weight_bytes_read(tokens) + kv_tokens * self.kv_bytes_per_token
        pairs = shape.num_prefill_attention_pairs + shape.num_decode_context_tokens
        flops = self.flops_per_token * tokens + self.flops_per_attention_pair * pairs
        return StepFeatures(memory_bytes, flops, tokens, shape.num_seqs, shape.host_bytes)

    def cost(self, shape: StepShape) -> StepCost:
        """The step's modeled time split into its terms. An empty step costs only the
        fixed step overhead (plus transfers)."""
        f = self.features(shape)
        hw = self.hardware
        transfer_s = f.host_bytes * self.s_per_host_byte
        if f.num_tokens == 0:
            return StepCost(0.0, 0.0, hw.step_overhead_s, transfer_s)
        overhead_s = (
            hw.step_overhead_s + hw.per_token_overhead_s * f.num_tokens + hw.per_seq_overhead_s * f.num_seqs
        )
        return StepCost(f.memory_bytes * self.s_per_byte, f.flops * self.s_per_flop, overhead_s, transfer_s)

    def duration_s(self, shape: StepShape) -> float:
        """Modeled seconds of one step: ``cost(shape).duration_s``."""
        return self.cost(shape).duration_s

    def transfer_s(self, host_bytes: int) -> float:
        """Seconds to move ``host_bytes`` over PCIe (one direction's bandwidth)."""
        return host_bytes * self.s_per_host_byte

    def decode_run_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> np.ndarray:
        """Durations of ``num_steps`` consecutive decode-only steps of a fixed batch.

        Step ``j`` (0-based) decodes one token for each of ``num_seqs`` sequences whose
        context lengths sum to ``context_tokens + j * num_seqs`` (each grows by one per
        step). Equal, element for element, to ``duration_s`` of the same shapes built
        one by one; this is what fast-forwarding identical decode steps uses. Returns a
        float64 array of length ``num_steps``. Raises ValueError for a non-positive
        batch or step count.
        """
        if num_seqs <= 0 or num_steps <= 0:
            raise ValueError(f"decode run: num_seqs ({num_seqs}) and num_steps ({num_steps}) must be > 0")
        hw = self.hardware
        overhead_s = (
            hw.step_overhead_s + hw.per_token_overhead_s * num_seqs + hw.per_seq_overhead_s * num_seqs
        )
        # The per-step terms in one compiled loop: a run asks for windows of a few steps,
        # where a dozen numpy calls cost ~15 us. The model's ints go in as float64, as
        # mixed int/float arithmetic converts them.
        return _decode_run_s(
            num_steps,
            float(context_tokens),
            float(num_seqs),
            float(self.weight_bytes_read(num_seqs)),
            float(self.kv_bytes_per_token),
            self.s_per_byte,
            float(self.flops_per_token * num_seqs),
            float(self.flops_per_attention_pair),
            self.s_per_flop,
            float(overhead_s),
        )


@njit(cache=True, nogil=True)
def _decode_run_s(
    num_steps,
    context_tokens,
    num_seqs,
    weight_bytes,
    kv_bytes_per_token,
    s_per_byte,
    flops,
    flops_per_pair,
    s_per_flop,
    overhead_s,
):  # pragma: no cover - compiled
    """``CostModel.decode_run_s``' durations (float64 [num_steps]), each computed as
    ``max(memory_s, compute_s) + overhead_s`` from float64 scalars, step ``j``'s context
    being ``context_tokens + num_seqs * j``. No fastmath (no reordering, no fused
    multiply-add): each element is, to the bit, what the array expression
    ``np.maximum(memory_s, compute_s) + overhead_s`` over all steps gives
    (``test_decode_run_is_its_numpy_expression_to_the_bit``)."""
    out = np.empty(num_steps, dtype=np.float64)
    for j in range(num_steps):
        ctx = context_tokens + num_seqs * float(j)
        memory_s = (weight_bytes + (ctx + num_seqs) * kv_bytes_per_token) * s_per_byte
        compute_s = (flops + flops_per_pair * ctx) * s_per_flop
        out[j] = (memory_s if memory_s >= compute_s else compute_s) + overhead_s
    return out
