"""KV pool sizing the way serving engines do it, for simulation mode.

vLLM sizes its block pool after loading the weights and profiling one forward pass::

    usable_bytes   = floor(memory_bytes * gpu_memory_utilization)
    kv_budget      = usable_bytes - weight_bytes - activation_reserve_bytes
    num_blocks     = kv_budget // (block_size * kv_bytes_per_token)

The arithmetic is ``kvbench.sizing.fit`` (the same numbers ``kvbench size`` prints), so a
simulated engine and the memory calculator can never disagree. The plan is printed in one
line when a simulated engine starts (``KVPoolPlan.summary``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.sizing import DEFAULT_ACTIVATION_RESERVE_BYTES, GIB, fit
from kvbench.specs import HardwareSpec, ModelSpec, SpecError


@dataclass(frozen=True)
class KVPoolPlan:
    """The KV pool of one model on one device; every byte figure is exact."""

    model_name: str
    hardware_name: str
    kv_dtype: str
    weight_dtype: str
    block_size: int
    gpu_memory_utilization: float
    memory_bytes: int
    usable_memory_bytes: int
    weight_bytes: int
    activation_reserve_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    num_blocks: int

    @property
    def pool_bytes(self) -> int:
        """Bytes the block pool occupies (whole blocks; <= kv_budget_bytes)."""
        return self.num_blocks * self.kv_bytes_per_block

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size

    def summary(self) -> str:
        """One line for the start of a simulated run, e.g.

        ``KV pool llama-3-70b on h200-141gb: 141.00 GiB x 0.9 - weights 65.71 GiB (fp8)
        - activations 1.00 GiB = 60.20 GiB -> 12,327 blocks x 16 tokens (197,232 tokens,
        320 KiB/token bf16)``
        """
        return (
            f"KV pool {self.model_name} on {self.hardware_name}: "
            f"{self.memory_bytes / GIB:,.2f} GiB x {self.gpu_memory_utilization} "
            f"- weights {self.weight_bytes / GIB:,.2f} GiB ({self.weight_dtype}) "
            f"- activations {self.activation_reserve_bytes / GIB:,.2f} GiB "
            f"= {self.kv_budget_bytes / GIB:,.2f} GiB -> {self.num_blocks:,} blocks x {self.block_size} tokens "
            f"({self.num_token_slots:,} tokens, {self.kv_bytes_per_token / 1024:,.0f} KiB/token {self.kv_dtype})"
        )


def plan_kv_pool(
    spec: ModelSpec,
    hardware: HardwareSpec,
    *,
    kv_dtype: str,
    weight_dtype: str,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> KVPoolPlan:
    """Size the KV pool of ``spec`` on ``hardware`` (formulas in the module docstring).

    Pure function. Raises SpecError naming the field for an invalid argument (see
    ``kvbench.sizing.fit``) and when the weights plus the activation reserve leave no
    room for a single block, with the figures that do not fit.
    """
    report = fit(
        spec,
        hardware,
        seq_len=1,  # fit() also plans sequences; one token is always a valid length
        batch=1,
        kv_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        activation_reserve_bytes=activation_reserve_bytes,
    )
    if report.num_gpu_blocks == 0:
        raise SpecError(
            f"hardware.memory_bytes: {spec.name} does not fit on {hardware.name}: "
            f"{report.usable_memory_bytes / GIB:,.2f} GiB usable (x {gpu_memory_utilization}) "
            f"- weights {report.weight_bytes / GIB:,.2f} GiB ({weight_dtype}) "
            f"- activations {activation_reserve_bytes / GIB:,.2f} GiB leaves no room for one "
            f"{report.kv_bytes_per_block:,}-byte KV block; use smaller weights (run.dtype=fp8) or more memory"
        )
    return KVPoolPlan(
        model_name=spec.name,
        hardware_name=hardware.name,
        kv_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        memory_bytes=report.memory_bytes,
        usable_memory_bytes=report.usable_memory_bytes,
        weight_bytes=report.weight_bytes,
        activation_reserve_bytes=activation_reserve_bytes,
        kv_budget_bytes=report.kv_budget_bytes,
        kv_bytes_per_token=report.kv_bytes_per_token,
        kv_bytes_per_block=report.kv_bytes_per_block,
        num_blocks=report.num_gpu_blocks,
    )
