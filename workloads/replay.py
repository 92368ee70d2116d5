"""Turning parsed trace records into a Workload: window, sample, cap, scale, token ids.

Order of operations (each step counts what it removes or cuts, in ``Workload.counters``):

1. times relative to the first record (or drawn from ``arrival`` for traces without times),
2. time window ``[start_s, end_s)``           -> ``num_outside_window``
3. Bernoulli sampling with ``sample_fraction`` -> ``num_sampled_out``
4. the first ``max_requests``                  -> ``num_over_max_requests``
5. length scaling, then caps on prompt/output  -> ``num_prompts_truncated`` (+ tokens), ...

Token ids: a Mooncake block is content-addressed by its hash id, so requests that share
hash-id prefixes share token prefixes exactly; traces with only lengths get random ids
keyed by the record's line (a record keeps its ids whatever the window or sample).

Hash-id (Mooncake) prompts are read-only int32 numpy arrays (``Request`` allows them):
the full conversation trace holds 145M prompt tokens, ~5 GB as tuples of Python ints
and 0.6 GB as arrays, and each hash block's ids are computed once and concatenated.
Other traces keep tuples.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvbench.types import Request, Workload
from kvbench.workloads.build import closed_loop_limit
from kvbench.workloads.distributions import ArrivalProcess, arrival_process
from kvbench.workloads.errors import WorkloadConfigError
from kvbench.workloads.tokens import (
    STREAM_ARRIVALS,
    STREAM_SAMPLE,
    STREAM_TOKENS,
    check_seed,
    check_vocab_size,
    derive_rng,
    keyed_block_bases,
    keyed_ids_from_bases,
    random_token_ids,
)
from kvbench.workloads.trace_formats import MOONCAKE_BLOCK_TOKENS, ParsedTrace, TraceRecord

_TRUNCATION_COUNTERS = (
    "num_prompts_truncated",
    "num_prompt_tokens_truncated",
    "num_outputs_truncated",
    "num_output_tokens_truncated",
)


@dataclass(frozen=True)
class ReplayOptions:
    """How to replay a trace. Times are seconds; ``start_s``/``end_s`` are on the trace's
    clock counted from its first record; lengths are tokens.

    ``time_scale`` multiplies every gap (0.5 replays twice as fast); ``length_scale``
    multiplies prompt lengths (for Mooncake the block size becomes
    ``max(1, round(512 * length_scale))`` so the hash-block structure survives) and
    ``output_scale`` output lengths; scaled lengths are at least 1.
    """

    time_scale: float = 1.0
    time_offset_s: float = 0.0
    start_s: float = 0.0
    end_s: float | None = None
    sample_fraction: float = 1.0
    max_requests: int | None = None
    length_scale: float = 1.0
    output_scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("time_scale", "length_scale", "output_scale"):
            if not getattr(self, name) > 0:
                raise WorkloadConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.start_s < 0:
            raise WorkloadConfigError(f"start_s: must be >= 0, got {self.start_s}")
        if self.end_s is not None and self.end_s <= self.start_s:
            raise WorkloadConfigError(f"end_s: must be > start_s={self.start_s}, got {self.end_s}")
        if not 0 < self.sample_fraction <= 1:
            raise WorkloadConfigError(f"sample_fraction: must be in (0, 1], got {self.sample_fraction}")
        for name in ("max_requests", "max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise WorkloadConfigError(f"{name}: must be an int >= 1 or null, got {value!r}")


def replay(
    trace: ParsedTrace,
    options: ReplayOptions,
    *,
    vocab_size: int,
    seed: int = 0,
    name: str | None = None,
    arrival: ArrivalProcess | None = None,
) -> Workload:
    """The Workload for ``trace`` under ``options``; pure (same inputs, same requests).

    ``arrival`` gives times to traces without timestamps (ShareGPT; default offline) and
    is ignored otherwise. Raises WorkloadConfigError when nothing is left to replay.
    """
    check_vocab_size(vocab_size)
    check_seed(seed)
    name = name or trace.format
    records = trace.records
    counters: dict[str, int] = {**trace.counters, "num_records": len(records)}

    process = arrival_process(arrival)
    if trace.has_timestamps:
        rel_s = np.array([r.timestamp_s for r in records]) - records[0].timestamp_s
    else:
        rel_s = process.times(derive_rng(seed, STREAM_ARRIVALS), len(records))

    keep = rel_s >= options.start_s
    if options.end_s is not None:
        keep &= rel_s < options.end_s
    counters["num_outside_window"] = int(np.count_nonzero(~keep))
    if options.sample_fraction < 1:
        # Drawn for every record so that a record's fate does not depend on the window.
        sampled = derive_rng(seed, STREAM_SAMPLE).random(len(records)) < options.sample_fraction
        counters["num_sampled_out"] = int(np.count_nonzero(keep & ~sampled))
        keep &= sampled
    else:
        counters["num_sampled_out"] = 0
    indices = np.flatnonzero(keep)
    counters["num_over_max_requests"] = 0
    if options.max_requests is not None and len(indices) > options.max_requests:
        counters["num_over_max_requests"] = len(indices) - options.max_requests
        indices = indices[: options.max_requests]
    if len(indices) == 0:
        raise WorkloadConfigError(
            f"{trace.path}: no request left after the window, sampling and caps (counters: {counters})"
        )

    for key in _TRUNCATION_COUNTERS:
        counters[key] = 0
    extra_tags = {"kind": "trace", "format": trace.format, **process.request_tags()}
    blocks = _HashBlockIds(seed, vocab_size)
    blocks.prefetch(
        block
        for record in (records[i] for i in indices)
        if record.hash_ids is not None
        for block in zip(record.hash_ids, scaled_block_lengths(record, options.length_scale).tolist())
    )
    requests = []
    for index in indices:
        record = records[index]
        prompt, prompt_len = _prompt_ids(record, options, vocab_size, seed, blocks)
        if prompt_len > len(prompt):
            counters["num_prompts_truncated"] += 1
            counters["num_prompt_tokens_truncated"] += prompt_len - len(prompt)
        output_len = max(1, round(record.output_length * options.output_scale))
        if options.max_output_tokens is not None and output_len > options.max_output_tokens:
            counters["num_outputs_truncated"] += 1
            counters["num_output_tokens_truncated"] += output_len - options.max_output_tokens
            output_len = options.max_output_tokens
        arrival_s = options.time_offset_s + (float(rel_s[index]) - options.start_s) * options.time_scale
        requests.append(
            Request(
                request_id=f"{name}-{index:06d}",
                arrival_s=arrival_s,
                prompt_token_ids=prompt if record.hash_ids is not None else tuple(prompt.tolist()),
                max_new_tokens=output_len,
                tags={**extra_tags, "line": str(record.line), **record.tags},
            )
        )
    counters["num_requests"] = len(requests)
    requests.sort(key=lambda r: r.arrival_s)  # stable: file order among equal times
    return Workload(
        name=name,
        requests=tuple(requests),
        source=f"{trace.format}:{trace.path}",
        counters=counters,
        max_concurrency=closed_loop_limit(requests),
    )


def scaled_block_lengths(record: TraceRecord, length_scale: float) -> np.ndarray:
    """Tokens per Mooncake hash block after scaling: ``round(512 * scale)`` (>= 1) for full
    blocks, the scaled remainder (>= 1, <= a block) for the last one."""
    assert record.hash_ids is not None
    block_len = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    num_blocks = len(record.hash_ids)
    last_len = record.input_length - MOONCAKE_BLOCK_TOKENS * (num_blocks - 1)
    lengths = np.full(num_blocks, block_len, dtype=np.int64)  # [num_blocks]
    lengths[-1] = min(block_len, max(1, round(last_len * length_scale)))
    return lengths


class _HashBlockIds:
    """Token ids of Mooncake hash blocks, computed once per (hash id, length) for one
    replay: conversation turns repeat their history's blocks, so most are cache hits."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self._seed = seed
        self._vocab_size = vocab_size
        self._ids: dict[tuple[int, int], np.ndarray] = {}

    def prefetch(self, blocks: Iterable[tuple[int, int]]) -> None:
        """Compute the ids of these (hash id, length) blocks not cached yet, _PREFETCH_BLOCKS
        per vectorised call: per-prompt calls cost ~0.6 s more of numpy overhead on the
        Mooncake conversation trace, and bigger batches fall out of cache. Mutates the
        cache."""
        cache = self._ids
        missing = list(dict.fromkeys(block for block in blocks if block not in cache))
        for start in range(0, len(missing), _PREFETCH_BLOCKS):
            self._compute(missing[start : start + _PREFETCH_BLOCKS])

    def prompt(self, hash_ids: list[int], lengths: np.ndarray) -> np.ndarray:
        """The prompt of these blocks: a new read-only int32 array. Mutates the cache."""
        blocks = list(zip(hash_ids, lengths.tolist()))
        cache = self._ids
        missing = list(dict.fromkeys(block for block in blocks if block not in cache))
        if missing:
            self._compute(missing)
        prompt = np.concatenate([cache[block] for block in blocks])  # [num_tokens] int32
        prompt.flags.writeable = False
        return prompt

    def _compute(self, missing: list[tuple[int, int]]) -> None:
        """Cache the ids of these distinct uncached blocks, in one vectorised call."""
        new_lengths = np.array([length for _, length in missing], dtype=np.int64)  # [m]
        ends = np.cumsum(new_lengths)  # [m]
        # Each block's key mixed once, then repeated over its tokens.
        bases = np.repeat(keyed_block_bases(self._seed, [h for h, _ in missing]), new_lengths)  # [total]
        offsets = np.arange(int(ends[-1])) - np.repeat(ends - new_lengths, new_lengths)  # [total]
        # ids: [total] int32 (vocabularies are far below 2**31)
        ids = keyed_ids_from_bases(bases, offsets, self._vocab_size).astype(np.int32)
        self._ids.update(zip(missing, np.split(ids, ends[:-1])))


_PREFETCH_BLOCKS = 256  # 128K tokens of 512-token Mooncake blocks per call (cache-sized arrays)


def _prompt_ids(
    record: TraceRecord, options: ReplayOptions, vocab_size: int, seed: int, blocks: _HashBlockIds
) -> tuple[np.ndarray, int]:
    """The record's prompt token ids after length scaling, cut to ``max_prompt_tokens``,
    and the prompt's length before the cut: a read-only int32 array for hash-id records
    (from ``blocks``), int64 otherwise. Random ids are drawn only up to the cap (the
    first n draws of a stream do not depend on how many follow), so a huge recorded
    length costs nothing when capped."""
    cap = options.max_prompt_tokens
    if record.hash_ids is not None:
        prompt = blocks.prompt(record.hash_ids, scaled_block_lengths(record, options.length_scale))
        return prompt[:cap], len(prompt)
    length = max(1, round(record.input_length * options.length_scale))
    kept = length if cap is None else min(length, cap)
    if record.prompt_token_ids is not None:
        # Scaling text-derived prompts keeps their prefix, so shared prefixes stay shared.
        length = min(length, len(record.prompt_token_ids))
        kept = min(kept, length)
        return np.asarray(record.prompt_token_ids[:kept], dtype=np.int64), length
    return random_token_ids(derive_rng(seed, STREAM_TOKENS, record.line), kept, vocab_size), length
