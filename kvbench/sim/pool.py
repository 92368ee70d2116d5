"""KV pool sizing the way serving engines do it, for simulation mode.

vLLM sizes its block pool after loading the weights and profiling one forward pass::

    usable_bytes   = floor(memory_bytes * gpu_memory_utilization)
    kv_budget      = usable_bytes - weight_bytes - activation_reserve_bytes
    num_blocks     = kv_budget // (block_size * kv_bytes_per_token)

The arithmetic is ``kvbench.sizing.fit`` and the plan is its ``SizingReport`` (the same
numbers ``kvbench size`` prints), so a simulated engine and the memory calculator can
never disagree. ``pool_summary`` is the line a simulated engine prints when it starts.
"""

from __future__ import annotations

from kvbench.sizing import DEFAULT_ACTIVATION_RESERVE_BYTES, DEFAULT_BLOCK_SIZE, GIB, SizingReport, fit
from kvbench.specs import HardwareSpec, ModelSpec, SpecError


def plan_kv_pool(
    spec: ModelSpec,
    hardware: HardwareSpec,
    *,
    kv_dtype: str,
    weight_dtype: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> SizingReport:
    """Size the KV pool of ``spec`` on ``hardware`` (formulas in the module docstring):
    ``num_gpu_blocks`` blocks of ``kv_bytes_per_block`` bytes.

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
    return report


def pool_summary(plan: SizingReport) -> str:
    """One line for the start of a simulated run, e.g.

    ``KV pool llama-3-70b on h200-141gb: 141.00 GiB x 0.9 - weights 65.71 GiB (fp8)
    - activations 1.00 GiB = 60.20 GiB -> 12,327 blocks x 16 tokens (197,232 tokens,
    320 KiB/token bf16)``
    """
    return (
        f"KV pool {plan.model_name} on {plan.hardware_name}: "
        f"{plan.memory_bytes / GIB:,.2f} GiB x {plan.gpu_memory_utilization} "
        f"- weights {plan.weight_bytes / GIB:,.2f} GiB ({plan.weight_dtype}) "
        f"- activations {plan.activation_reserve_bytes / GIB:,.2f} GiB "
        f"= {plan.kv_budget_bytes / GIB:,.2f} GiB -> {plan.num_gpu_blocks:,} blocks x {plan.block_size} tokens "
        f"({plan.max_tokens_paged:,} tokens, {plan.kv_bytes_per_token / 1024:,.0f} KiB/token {plan.kv_dtype})"
    )
