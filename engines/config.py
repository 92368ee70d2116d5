"""One engine configuration, built and validated once, and the one rule that sizes the pool.

Every engine on the shared scheduler (paged, slab, H2O / StreamingLLM, offload) turns its
keyword arguments (the ``engine.*`` keys of ``conf/engine/*.yaml``) into one frozen
``EngineConfig``. Each parameter has its default here (``DEFAULTS``; the front doors'
signatures read them, so the value is written once) and one check, in
``EngineConfig.__post_init__`` or, for the scheduler's limits, ``SchedulerConfig``'s.

``size_pool`` is the one pool-sizing rule::

    num_blocks set                  -> num_blocks
    else kv_memory_bytes set        -> kv_memory_bytes // bytes_per_block
    else (simulation mode only)     -> memory x gpu_memory_utilization - weights
                                       - activation reserve, in whole blocks (kvbench.sim.pool)

In simulation mode (no executor given) it also returns the cost-model executor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kvbench.engines.kv.prefix_cache import BlockHashPrefixIndex, NullPrefixIndex, PrefixIndex
from kvbench.engines.kv.radix_cache import RadixPrefixIndex
from kvbench.engines.sched.scheduler import SchedulerConfig
from kvbench.engines.sim.executor import CostModelExecutor
from kvbench.sim.pool import plan_kv_pool, pool_summary
from kvbench.sizing import DEFAULT_ACTIVATION_RESERVE_BYTES, DEFAULT_BLOCK_SIZE, GIB, kv_bytes_per_block
from kvbench.types import EngineContext

if TYPE_CHECKING:
    from kvbench.engines.exec.protocol import Executor

DECODE_BACKENDS = ("auto", "torch", "triton")
# engine.prefix_cache: the prefix index each value builds (a fresh one per manager).
PREFIX_INDEXES: dict[str, Callable[[], PrefixIndex]] = {
    "block_hash": BlockHashPrefixIndex,
    "radix": RadixPrefixIndex,
    "none": NullPrefixIndex,
}


@dataclass(frozen=True)
class EngineConfig:
    """The parameters every scheduler-based engine shares (``conf/engine/paged.yaml``
    explains each). Construction validates every field and raises ValueError naming
    ``engine.<parameter>``; an ``EngineConfig`` that exists is valid."""

    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV block (a power of two)
    num_blocks: int | None = None  # None: kv_memory_bytes // bytes_per_block
    kv_memory_bytes: int | None = 32 * 1024 * 1024  # None in simulation: sized from the hardware
    gpu_memory_utilization: float = 0.9  # simulation's hardware sizing only
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    chunked_prefill: bool = SchedulerConfig.chunked_prefill
    prefix_cache: str = "block_hash"  # a key of PREFIX_INDEXES
    preemption: str = SchedulerConfig.preemption
    victim_policy: str = SchedulerConfig.victim_policy
    num_host_blocks: int = 0  # host swap pool; 0 with preemption=swap: as many as num_blocks
    decode_backend: str = "auto"  # one of DECODE_BACKENDS
    fast_forward: bool = True  # simulation: one step may cover a run of plain decode steps
    # When prefill KV becomes visible to prefix matches (engines/sched/scheduler.REGISTER_BLOCKS):
    # on_completion (kvbench's default) or on_schedule (vLLM's allocate_slots -> cache_blocks).
    register_blocks: str = SchedulerConfig.register_blocks

    def __post_init__(self) -> None:
        block_size = self.block_size
        if not isinstance(block_size, int) or block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"engine.block_size: must be a power of two, got {block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"engine.num_blocks: must be > 0 (or null), got {self.num_blocks}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ValueError(f"engine.kv_memory_bytes: must be > 0 (or null), got {self.kv_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"engine.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.prefix_cache not in PREFIX_INDEXES:
            raise ValueError(
                f"engine.prefix_cache: must be one of {tuple(PREFIX_INDEXES)}, got {self.prefix_cache!r}"
            )
        if self.num_host_blocks < 0:
            raise ValueError(f"engine.num_host_blocks: must be >= 0, got {self.num_host_blocks}")
        if self.decode_backend not in DECODE_BACKENDS:
            raise ValueError(
                f"engine.decode_backend: must be one of {DECODE_BACKENDS}, got {self.decode_backend!r}"
            )
        self.scheduler_config(SchedulerConfig.max_model_len)  # checks the scheduler's limits

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], **fixed: Any) -> EngineConfig:
        """The config of a front door's keyword arguments (its ``locals()`` on entry to
        ``__init__``, whose explicit typed signature is what ``kvbench.config`` checks
        YAML keys against): every field the door takes, plus ``fixed``, the fields the
        door decides itself (the slab's ``prefix_cache="none"``). Validates as the
        constructor does."""
        values = {field.name: arguments[field.name] for field in fields(cls) if field.name in arguments}
        return cls(**values, **fixed)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits for a model of ``max_model_len`` positions. Pure; raises
        ValueError naming the ``engine.*`` limit that is invalid."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked_prefill=bool(self.chunked_prefill),
            preemption=self.preemption,
            victim_policy=self.victim_policy,
            max_model_len=max_model_len,
            register_blocks=self.register_blocks,
        )

    def host_blocks_for(self, num_blocks: int) -> int:
        """Host swap pool of a device pool of ``num_blocks``: ``num_host_blocks``, or as
        many as the device pool when swapping with none set. Pure."""
        if self.preemption == "swap" and self.num_host_blocks == 0:
            return num_blocks
        return self.num_host_blocks


DEFAULTS = EngineConfig()


def size_pool(
    ctx: EngineContext,
    config: EngineConfig,
    executor: Executor | None,
    *,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
    log: Callable[[str], None] | None = print,
) -> tuple[int, Executor | None]:
    """The device pool's block count (module docstring) and the executor: ``executor``
    unchanged, or in simulation mode with none given the cost-model executor, after
    logging the pool in one line. Raises ValueError naming ``engine.kv_memory_bytes`` when
    it holds no block or is null outside simulation, SpecError when the weights leave no
    room on ``ctx.hardware``. Pure apart from ``log``."""
    per_block = kv_bytes_per_block(ctx.spec, ctx.kv_dtype, config.block_size)  # validates the dtype
    num_blocks = config.num_blocks
    if num_blocks is None and config.kv_memory_bytes is not None:
        num_blocks = config.kv_memory_bytes // per_block
        if num_blocks == 0:
            raise ValueError(
                f"engine.kv_memory_bytes: {config.kv_memory_bytes} bytes hold no block of {per_block} "
                f"bytes (block_size {config.block_size})"
            )
    if executor is not None or ctx.mode != "sim":
        if num_blocks is None:
            raise ValueError(
                "engine.kv_memory_bytes: null sizes the pool from the hardware profile, which only "
                f"simulation mode does (run.mode=sim; this run is {ctx.mode!r}); set kv_memory_bytes "
                "or num_blocks"
            )
        return num_blocks, executor
    if num_blocks is None:
        plan = plan_kv_pool(
            ctx.spec,
            ctx.hardware,
            kv_dtype=ctx.kv_dtype,
            weight_dtype=ctx.spec.dtype,
            block_size=config.block_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            activation_reserve_bytes=activation_reserve_bytes,
        )
        num_blocks = plan.num_gpu_blocks
        line = pool_summary(plan)
    else:
        line = (
            f"KV pool {ctx.spec.name} on {ctx.hardware.name}: {num_blocks:,} blocks x {config.block_size} "
            f"tokens ({num_blocks * config.block_size:,} tokens, {num_blocks * per_block / GIB:,.2f} GiB, "
            f"{per_block // config.block_size / 1024:,.0f} KiB/token {ctx.kv_dtype}) set by "
            "engine.num_blocks or engine.kv_memory_bytes"
        )
    if log is not None:
        log(line)
    return num_blocks, CostModelExecutor.from_context(ctx, block_size=config.block_size)
