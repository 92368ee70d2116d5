"""Static descriptions of models and hardware: what the KV formulas and cost models read.

Both are frozen dataclasses so that they double as Hydra structured-config schemas
(``conf/model/*.yaml`` and ``conf/hardware/*.yaml`` are validated against them).
"""

from __future__ import annotations

from dataclasses import dataclass

# Storage width of each supported element type, in bits (int4 packs two per byte).
DTYPE_BITS: dict[str, int] = {
    "fp32": 32,
    "float32": 32,
    "bf16": 16,
    "bfloat16": 16,
    "fp16": 16,
    "float16": 16,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
}


class SpecError(ValueError):
    """An impossible model or hardware description; the message names the field."""


def dtype_bits(dtype: str) -> int:
    """Bits per element of ``dtype``; raises SpecError naming the dtype when unknown."""
    try:
        return DTYPE_BITS[dtype]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BITS))
        raise SpecError(f"dtype: unknown dtype {dtype!r} (known: {known})") from None


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (Llama family, MoE and MLA variants).

    MHA, GQA and MQA differ only in ``num_kv_heads``. MLA (DeepSeek-V2) caches one
    compressed latent of ``kv_lora_rank`` plus a decoupled RoPE key of
    ``qk_rope_head_dim`` per layer and token; it is selected by ``kv_lora_rank > 0``.
    """

    name: str = "tiny-gqa"
    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    hidden_size: int = 256
    intermediate_size: int = 688
    vocab_size: int = 4096
    max_position_embeddings: int = 2048
    dtype: str = "fp32"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Mixture of experts: every expert is a SwiGLU MLP of intermediate_size.
    num_experts: int = 1
    num_experts_per_token: int = 1
    # MLA (DeepSeek-V2): latent width and decoupled rope key width; 0 means not MLA.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # Published parameter count, for architectures the Llama formula does not cover
    # (MLA projections, shared experts). None: computed from the shape above.
    num_params: int | None = None
    bos_token_id: int = 1
    eos_token_id: int = 2
    # Where real weights come from: "random" (seeded) or a local path / loader name.
    weights: str = "random"

    @property
    def attention_kind(self) -> str:
        if self.kv_lora_rank > 0:
            return "mla"
        if self.num_kv_heads == 1:
            return "mqa"
        if self.num_kv_heads == self.num_q_heads:
            return "mha"
        return "gqa"

    def validate(self) -> None:
        """Raise SpecError naming the first impossible field."""
        positive = (
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "num_experts",
            "num_experts_per_token",
        )
        for field_name in positive:
            if getattr(self, field_name) <= 0:
                raise SpecError(f"model.{field_name}: must be > 0, got {getattr(self, field_name)}")
        if self.num_q_heads % self.num_kv_heads != 0:
            raise SpecError(
                f"model.num_kv_heads: {self.num_kv_heads} does not divide "
                f"model.num_q_heads={self.num_q_heads}"
            )
        if self.num_experts_per_token > self.num_experts:
            raise SpecError("model.num_experts_per_token: larger than model.num_experts")
        if self.kv_lora_rank < 0 or self.qk_rope_head_dim < 0:
            raise SpecError("model.kv_lora_rank / model.qk_rope_head_dim: must be >= 0")
        if self.num_params is not None and self.num_params <= 0:
            raise SpecError(f"model.num_params: must be > 0, got {self.num_params}")
        dtype_bits(self.dtype)


@dataclass(frozen=True)
class HardwareSpec:
    """An accelerator's published limits plus the cost-model coefficients fitted to it.

    Units are in the names: bytes, GB/s (1e9 bytes per second), TFLOP/s (1e12).
    """

    name: str = "cpu"
    memory_bytes: int = 16 * 1024**3
    hbm_bandwidth_gbps: float = 20.0
    bf16_tflops: float = 0.5
    pcie_gbps: float = 10.0
    # Cost-model coefficients (simulation mode); `kvbench calibrate` fits them.
    memory_efficiency: float = 0.7
    mfu: float = 0.5
    step_overhead_s: float = 0.0
    per_token_overhead_s: float = 0.0
    per_seq_overhead_s: float = 0.0

    def validate(self) -> None:
        for field_name in ("memory_bytes", "hbm_bandwidth_gbps", "bf16_tflops", "pcie_gbps"):
            if getattr(self, field_name) <= 0:
                raise SpecError(f"hardware.{field_name}: must be > 0, got {getattr(self, field_name)}")
        for field_name in ("memory_efficiency", "mfu"):
            value = getattr(self, field_name)
            if not 0.0 < value <= 1.0:
                raise SpecError(f"hardware.{field_name}: must be in (0, 1], got {value}")
        for field_name in ("step_overhead_s", "per_token_overhead_s", "per_seq_overhead_s"):
            if getattr(self, field_name) < 0:
                raise SpecError(f"hardware.{field_name}: must be >= 0")
