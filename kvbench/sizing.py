"""KV-cache and weight memory arithmetic, and "does it fit on this GPU" reports.

Everything is exact integer arithmetic on bytes. Element widths come from
``kvbench.specs.dtype_bits``; a size is converted from bits to bytes only when it is a
whole number of bytes, otherwise ``SpecError`` is raised (int4 packs two elements per
byte, so an odd element count has no exact byte size). Quantisation metadata (int4 /
fp8 scales and zero points) is not counted: these are payload bytes.

Formulas (L = num_layers, H_kv = num_kv_heads, D = head_dim, b = bits per element)::

    elements/token (MHA, GQA, MQA) = 2 * L * H_kv * D          # one K and one V row
    elements/token (MLA)           = L * (kv_lora_rank + qk_rope_head_dim)
    bytes for n tokens             = n * elements/token * b / 8
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvbench.specs import HardwareSpec, ModelSpec, SpecError, dtype_bits

GIB = 1024**3

# Activation reserve when the caller has no profiled peak: 1 GiB. Real engines measure
# it with a dummy forward pass (vLLM's profile run); pass the measured value to fit().
DEFAULT_ACTIVATION_RESERVE_BYTES = 1 * GIB
# Tokens per KV block when none is given: vLLM's default, shared by the engines
# (engines/config.EngineConfig), the calculator and trace inspection.
DEFAULT_BLOCK_SIZE = 16


def bytes_for_elements(num_elements: int, dtype: str, what: str = "size") -> int:
    """Exact bytes taken by ``num_elements`` values of ``dtype``.

    Pure function. Raises SpecError (naming ``what`` and the dtype) when the bits do
    not make whole bytes, e.g. an odd number of int4 values, or when the count is
    negative.
    """
    if num_elements < 0:
        raise SpecError(f"{what}: element count must be >= 0, got {num_elements}")
    total_bits = num_elements * dtype_bits(dtype)
    if total_bits % 8 != 0:
        raise SpecError(
            f"{what}: {num_elements} elements of {dtype} are {total_bits} bits, not a whole number of bytes"
        )
    return total_bits // 8


def kv_elements_per_token(spec: ModelSpec) -> int:
    """Cached values one token adds across all layers (see the module docstring).

    MLA (``spec.kv_lora_rank > 0``): one latent plus one decoupled RoPE key per layer,
    with no K/V factor 2 and no heads. Otherwise one K and one V vector per KV head.
    """
    if spec.kv_lora_rank > 0:
        return spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim)
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim


def kv_bytes_for_tokens(spec: ModelSpec, kv_dtype: str, num_tokens: int) -> int:
    """Exact KV bytes for ``num_tokens`` token slots; raises SpecError if fractional."""
    if num_tokens < 0:
        raise SpecError(f"num_tokens: must be >= 0, got {num_tokens}")
    return bytes_for_elements(num_tokens * kv_elements_per_token(spec), kv_dtype, what="kv bytes")


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str) -> int:
    """KV bytes one token occupies: ``elements/token * bits / 8``.

    Raises SpecError when one token is not a whole number of bytes (int4 with an odd
    element count per token) or the dtype is unknown.
    """
    return kv_bytes_for_tokens(spec, kv_dtype, 1)


def kv_bytes_per_block(spec: ModelSpec, kv_dtype: str, block_size: int) -> int:
    """Bytes of one paged block holding ``block_size`` tokens: block_size * bytes/token.

    For MHA/GQA/MQA this is ``2 * L * block_size * H_kv * D * bytes``, the quantity
    engines divide their KV budget by. Raises SpecError if ``block_size <= 0``.
    """
    if block_size <= 0:
        raise SpecError(f"block_size: must be > 0, got {block_size}")
    return kv_bytes_for_tokens(spec, kv_dtype, block_size)


def kv_bytes_per_sequence(spec: ModelSpec, kv_dtype: str, seq_len: int) -> int:
    """Bytes of exactly ``seq_len`` cached tokens (no block rounding, no reservation)."""
    if seq_len <= 0:
        raise SpecError(f"seq_len: must be > 0, got {seq_len}")
    return kv_bytes_for_tokens(spec, kv_dtype, seq_len)


def kv_bytes_per_batch(spec: ModelSpec, kv_dtype: str, seq_len: int, batch: int) -> int:
    """Bytes of ``batch`` sequences of ``seq_len`` tokens each: batch * per-sequence."""
    if batch <= 0:
        raise SpecError(f"batch: must be > 0, got {batch}")
    return batch * kv_bytes_per_sequence(spec, kv_dtype, seq_len)


def num_blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks a paged engine allocates for ``num_tokens``: ceil(num_tokens / block_size)."""
    if block_size <= 0:
        raise SpecError(f"block_size: must be > 0, got {block_size}")
    return -(-num_tokens // block_size)


def num_params(spec: ModelSpec) -> int:
    """Parameter count: ``spec.num_params`` when set, else the Llama formula.

    Llama formula (H = hidden, I = intermediate, V = vocab, E = num_experts)::

        embeddings       V * H
        per layer        q: H * H_q*D   k, v: 2 * H * H_kv*D   o: H_q*D * H
                         SwiGLU MLP (gate, up, down): 3 * H * I, times E
                         router H * E when E > 1
                         two RMSNorm weights 2 * H
        final RMSNorm    H
        lm_head          V * H unless tie_word_embeddings

    No biases (Qwen2's q/k/v biases need ``num_params``). Raises SpecError for MLA
    specs without ``num_params``: the formula does not describe MLA projections.
    """
    if spec.num_params is not None:
        return spec.num_params
    if spec.kv_lora_rank > 0:
        raise SpecError(
            f"model.num_params: required for MLA model {spec.name!r}; "
            "the Llama formula does not cover low-rank attention projections"
        )
    h = spec.hidden_size
    q_width = spec.num_q_heads * spec.head_dim
    kv_width = spec.num_kv_heads * spec.head_dim
    attention = h * q_width + 2 * h * kv_width + q_width * h
    mlp = 3 * h * spec.intermediate_size * spec.num_experts
    router = h * spec.num_experts if spec.num_experts > 1 else 0
    per_layer = attention + mlp + router + 2 * h
    embeddings = spec.vocab_size * h
    lm_head = 0 if spec.tie_word_embeddings else spec.vocab_size * h
    return embeddings + spec.num_layers * per_layer + h + lm_head


def weight_bytes(spec: ModelSpec, weight_dtype: str) -> int:
    """Bytes of all parameters stored in ``weight_dtype``: num_params * bits / 8.

    Every parameter is counted at ``weight_dtype`` (real int4 checkpoints keep norms
    and scales wider, so treat the int4 figure as a lower bound). Raises SpecError
    when the total is not whole bytes or the count is unavailable (see num_params).
    """
    return bytes_for_elements(num_params(spec), weight_dtype, what="weight bytes")


@dataclass(frozen=True)
class SizingReport:
    """Memory plan of one model on one device; every byte figure is exact.

    Formulas (``usable = floor(memory_bytes * gpu_memory_utilization)`` with the
    utilisation read as its decimal value, so 0.9 means exactly 9/10)::

        kv_budget_bytes     = max(0, usable - weight_bytes - activation_reserve_bytes)
        num_gpu_blocks      = kv_budget_bytes // kv_bytes_per_block
        max_tokens          = kv_budget_bytes // kv_bytes_per_token   (no block rounding)
        max_tokens_paged    = num_gpu_blocks * block_size
        blocks_per_sequence = ceil(seq_len / block_size)
        max_sequences_paged = num_gpu_blocks // blocks_per_sequence
        max_sequences_slab_seq_len  = kv_budget_bytes // kv_bytes_per_sequence(seq_len)
        max_sequences_slab_max_len  = kv_budget_bytes // kv_bytes_per_sequence(max_position_embeddings)
        batch_fits_paged    = batch <= max_sequences_paged
        batch_fits_slab     = batch <= max_sequences_slab_max_len
    """

    model_name: str
    hardware_name: str
    kv_dtype: str
    weight_dtype: str
    seq_len: int
    batch: int
    block_size: int
    gpu_memory_utilization: float
    memory_bytes: int
    usable_memory_bytes: int
    weight_bytes: int
    activation_reserve_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    kv_bytes_per_sequence: int
    kv_bytes_per_batch: int
    kv_budget_bytes: int
    weights_fit: bool
    num_gpu_blocks: int
    max_tokens: int
    max_tokens_paged: int
    blocks_per_sequence: int
    max_sequences_paged: int
    max_sequences_slab_seq_len: int
    max_sequences_slab_max_len: int
    batch_fits_paged: bool
    batch_fits_slab: bool


def fit(
    spec: ModelSpec,
    hardware: HardwareSpec,
    seq_len: int,
    batch: int,
    kv_dtype: str,
    weight_dtype: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> SizingReport:
    """Plan ``batch`` sequences of ``seq_len`` tokens of ``spec`` on ``hardware``.

    The KV pool is sized the way vLLM sizes it: device memory times utilisation, minus
    weights, minus the activation peak, divided into whole blocks (formulas on
    SizingReport). Pure function. When the weights alone do not fit, the report says so
    (``weights_fit=False``, budget and capacities 0) rather than raising.

    Raises SpecError naming the argument for seq_len/batch/block_size <= 0, seq_len
    beyond ``spec.max_position_embeddings``, utilisation outside (0, 1], a negative
    reserve, an unknown dtype or a fractional byte size.
    """
    spec.validate()
    hardware.validate()
    if seq_len <= 0:
        raise SpecError(f"seq_len: must be > 0, got {seq_len}")
    if seq_len > spec.max_position_embeddings:
        raise SpecError(
            f"seq_len: {seq_len} exceeds model.max_position_embeddings="
            f"{spec.max_position_embeddings} of {spec.name!r}"
        )
    if batch <= 0:
        raise SpecError(f"batch: must be > 0, got {batch}")
    if block_size <= 0:
        raise SpecError(f"block_size: must be > 0, got {block_size}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise SpecError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
    if activation_reserve_bytes < 0:
        raise SpecError(f"activation_reserve_bytes: must be >= 0, got {activation_reserve_bytes}")

    # Fraction(str(x)) reads 0.9 as 9/10, so the usable bytes do not depend on binary
    # floating-point rounding and can be checked by hand.
    usable = math.floor(hardware.memory_bytes * Fraction(str(gpu_memory_utilization)))
    weights = weight_bytes(spec, weight_dtype)
    per_token = kv_bytes_per_token(spec, kv_dtype)
    per_block = kv_bytes_per_block(spec, kv_dtype, block_size)
    per_sequence = kv_bytes_per_sequence(spec, kv_dtype, seq_len)
    per_max_len_sequence = kv_bytes_per_sequence(spec, kv_dtype, spec.max_position_embeddings)
    budget = max(0, usable - weights - activation_reserve_bytes)
    num_gpu_blocks = budget // per_block
    blocks_per_sequence = num_blocks_for_tokens(seq_len, block_size)
    max_sequences_paged = num_gpu_blocks // blocks_per_sequence
    max_sequences_slab_max_len = budget // per_max_len_sequence
    return SizingReport(
        model_name=spec.name,
        hardware_name=hardware.name,
        kv_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        seq_len=seq_len,
        batch=batch,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        memory_bytes=hardware.memory_bytes,
        usable_memory_bytes=usable,
        weight_bytes=weights,
        activation_reserve_bytes=activation_reserve_bytes,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block,
        kv_bytes_per_sequence=per_sequence,
        kv_bytes_per_batch=batch * per_sequence,
        kv_budget_bytes=budget,
        weights_fit=weights + activation_reserve_bytes <= usable,
        num_gpu_blocks=num_gpu_blocks,
        max_tokens=budget // per_token,
        max_tokens_paged=num_gpu_blocks * block_size,
        blocks_per_sequence=blocks_per_sequence,
        max_sequences_paged=max_sequences_paged,
        max_sequences_slab_seq_len=budget // per_sequence,
        max_sequences_slab_max_len=max_sequences_slab_max_len,
        batch_fits_paged=batch <= max_sequences_paged,
        batch_fits_slab=batch <= max_sequences_slab_max_len,
    )


def report_to_dict(report: SizingReport) -> dict[str, Any]:
    """The report as a JSON-serialisable dict (field name -> int / float / str / bool)."""
    return dataclasses.asdict(report)


def _format_bytes(num_bytes: int) -> str:
    """``1,073,741,824 B (1.00 GiB)``: exact bytes, then the largest binary unit >= 1."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= size:
            return f"{num_bytes:,} B ({num_bytes / size:,.2f} {unit})"
    return f"{num_bytes:,} B"


def format_table(report: SizingReport) -> str:
    """Render the report as a plain-text rich table (no colour codes), one row per figure."""
    # Imported here so that importing the arithmetic above stays dependency-free.
    from rich.console import Console
    from rich.table import Table

    r = report
    title = (
        f"{r.model_name} on {r.hardware_name}: batch {r.batch:,} x {r.seq_len:,} tokens, "
        f"KV {r.kv_dtype}, weights {r.weight_dtype}, block {r.block_size}"
    )
    table = Table(show_lines=False)
    table.add_column("quantity", style=None)
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("device memory", _format_bytes(r.memory_bytes)),
        (f"usable at utilization {r.gpu_memory_utilization}", _format_bytes(r.usable_memory_bytes)),
        ("weights", _format_bytes(r.weight_bytes)),
        ("activation reserve", _format_bytes(r.activation_reserve_bytes)),
        ("KV budget", _format_bytes(r.kv_budget_bytes)),
        ("KV bytes / token", _format_bytes(r.kv_bytes_per_token)),
        (f"KV bytes / block ({r.block_size} tokens)", _format_bytes(r.kv_bytes_per_block)),
        (f"KV bytes / sequence ({r.seq_len:,} tokens)", _format_bytes(r.kv_bytes_per_sequence)),
        (f"KV bytes / batch ({r.batch:,} sequences)", _format_bytes(r.kv_bytes_per_batch)),
        ("num_gpu_blocks", f"{r.num_gpu_blocks:,}"),
        ("max tokens (budget / bytes per token)", f"{r.max_tokens:,}"),
        ("max tokens in whole blocks", f"{r.max_tokens_paged:,}"),
        ("blocks per sequence", f"{r.blocks_per_sequence:,}"),
        ("max sequences, paged", f"{r.max_sequences_paged:,}"),
        ("max sequences, slab reserving seq_len", f"{r.max_sequences_slab_seq_len:,}"),
        ("max sequences, slab reserving max positions", f"{r.max_sequences_slab_max_len:,}"),
        ("weights fit", "yes" if r.weights_fit else "NO"),
        ("batch fits, paged", "yes" if r.batch_fits_paged else "NO"),
        ("batch fits, slab (max positions)", "yes" if r.batch_fits_slab else "NO"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    buffer = io.StringIO()
    console = Console(file=buffer, width=110, color_system=None, force_terminal=False)
    console.print(title, highlight=False)
    console.print(table)
    return buffer.getvalue()
