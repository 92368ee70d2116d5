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

Hash-id (Mooncake) prompts are ``HashBlockPrompt``s, ids computed when read (``Request``
allows such ``ComputedTokenIds``; the runner hands engines read-only int32 arrays): the
full conversation trace holds 145M prompt tokens, ~5 GB as tuples of Python ints and
0.6 GB as int32, against ~6 MB of block keys and lengths. Other traces keep tuples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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
    check_stream_words,
    check_vocab_size,
    derive_rng,
    keyed_block_bases,
    keyed_block_ids_into,
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
    hashed = _hash_id_prompts(
        [records[i] for i in indices if records[i].hash_ids is not None], options, vocab_size, seed
    )
    requests = []
    for index in indices:
        record = records[index]
        if record.hash_ids is not None:
            prompt, prompt_len = next(hashed)
        else:
            prompt, prompt_len = _prompt_ids(record, options, vocab_size, seed)
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
                prompt_token_ids=prompt,
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


class _IdsWhenRead(ABC):
    """``ComputedTokenIds``' reads for a prompt that holds ``num_tokens`` and makes its
    ids on every read."""

    num_tokens: int

    @abstractmethod
    def _make_ids(self) -> np.ndarray:
        """The ids as a new int32 array [num_tokens]. Pure."""

    def __len__(self) -> int:
        return self.num_tokens

    def ids(self) -> np.ndarray:
        """The ids: a new read-only int32 array [num_tokens] (vocabularies are far below 2**31)."""
        ids = self._make_ids()
        ids.flags.writeable = False
        return ids

    def __getitem__(self, index: int | slice) -> Any:
        return self.ids()[index]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        ids = self.ids()
        return ids if dtype is None else ids.astype(dtype)


@dataclass(frozen=True, eq=False)
class HashBlockPrompt(_IdsWhenRead):
    """A Mooncake prompt as ``ComputedTokenIds``: the ids of its hash blocks (block ``b``:
    ``lengths[b]`` ids keyed by the seed and its hash id, offsets from 0;
    ``keyed_token_ids``), computed when read. Two prompts sharing a hash-id prefix
    share those ids exactly, as the keyed definition does not depend on the rest.

    ``bases``: ``keyed_block_bases(seed, hash ids)`` uint64 [num_blocks]; ``lengths``:
    int64 [num_blocks] after length scaling and the prompt cap. Both read-only. Holds a
    few bytes per 512-token block instead of the ids.
    """

    bases: np.ndarray
    lengths: np.ndarray
    vocab_size: int
    num_tokens: int

    def _make_ids(self) -> np.ndarray:
        ids = np.empty(self.num_tokens, dtype=np.int32)
        keyed_block_ids_into(self.bases, self.lengths, self.vocab_size, ids)
        return ids

    def __repr__(self) -> str:
        return f"HashBlockPrompt({self.num_tokens} ids in {len(self.lengths)} blocks)"


def _hash_id_prompts(
    records: list[TraceRecord], options: ReplayOptions, vocab_size: int, seed: int
) -> Iterator[tuple[HashBlockPrompt, int]]:
    """Per hash-id record, in order: its prompt after length scaling, cut to
    ``max_prompt_tokens``, and the prompt's length before the cut. Every block's base is
    mixed in one vectorised call; the prompts hold views of the two arrays."""
    cap = options.max_prompt_tokens
    keys: list[int] = []
    lengths: list[np.ndarray] = []
    full_lens: list[int] = []
    for record in records:
        assert record.hash_ids is not None
        block_lens = scaled_block_lengths(record, options.length_scale)  # [num_blocks]
        full_len = int(block_lens.sum())
        if cap is not None and full_len > cap:
            ends = np.cumsum(block_lens)
            num_kept = int(np.searchsorted(ends, cap)) + 1  # blocks that start before the cap
            block_lens = block_lens[:num_kept].copy()
            block_lens[-1] -= int(ends[num_kept - 1]) - cap
        keys.extend(record.hash_ids[: len(block_lens)])
        lengths.append(block_lens)
        full_lens.append(full_len)
    if not records:
        return iter(())
    all_lengths = np.concatenate(lengths)  # [total blocks]
    all_bases = keyed_block_bases(seed, keys)  # [total blocks]
    all_lengths.flags.writeable = all_bases.flags.writeable = False
    ends = np.cumsum([len(block_lens) for block_lens in lengths]).tolist()
    return (
        (
            HashBlockPrompt(
                all_bases[end - len(n) : end], all_lengths[end - len(n) : end], vocab_size, int(n.sum())
            ),
            full_len,
        )
        for n, end, full_len in zip(lengths, ends, full_lens)
    )


@dataclass(frozen=True, eq=False)
class RandomPrompt(_IdsWhenRead):
    """A length-only trace record's prompt (Azure, BurstGPT) as ``ComputedTokenIds``:
    ``num_tokens`` ids drawn from the record's own stream (``random_token_ids`` of
    ``derive_rng(seed, STREAM_TOKENS, line)``), computed when read. Holds four ints
    instead of the ids, so a trace of millions of requests holds no prompt; the first n
    draws of a stream do not depend on how many follow, so a capped prompt is the
    uncapped one cut. Raises WorkloadConfigError for a seed or line outside [0, 2**32).
    """

    seed: int
    line: int
    num_tokens: int
    vocab_size: int

    def __post_init__(self) -> None:
        check_stream_words((self.seed, STREAM_TOKENS, 1, self.line))  # derive_rng's words, now

    def _make_ids(self) -> np.ndarray:
        rng = derive_rng(self.seed, STREAM_TOKENS, self.line)
        return random_token_ids(rng, self.num_tokens, self.vocab_size).astype(np.int32)

    def __repr__(self) -> str:
        return f"RandomPrompt({self.num_tokens} ids of line {self.line})"


def _prompt_ids(
    record: TraceRecord, options: ReplayOptions, vocab_size: int, seed: int
) -> tuple[tuple[int, ...] | RandomPrompt, int]:
    """The prompt of a record without hash ids after length scaling, cut to
    ``max_prompt_tokens``, and the prompt's length before the cut: the text-derived ids as
    a tuple, else a ``RandomPrompt`` (whose ids are drawn when read, and only up to the
    cap, so a huge recorded length costs nothing when capped)."""
    cap = options.max_prompt_tokens
    length = max(1, round(record.input_length * options.length_scale))
    kept = length if cap is None else min(length, cap)
    if record.prompt_token_ids is not None:
        # Scaling text-derived prompts keeps their prefix, so shared prefixes stay shared.
        length = min(length, len(record.prompt_token_ids))
        kept = min(kept, length)
        return record.prompt_token_ids[:kept], length
    return RandomPrompt(seed, record.line, kept, vocab_size), length
