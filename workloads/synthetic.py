"""Synthetic workloads without structured sharing: random prompts (optionally best-of-n
or beam search) and vLLM's prefix-repetition pattern.

Every generator takes ``tokenizer`` like the text-based ones do, so a runner can pass
it uniformly; random prompts have no text, so they ignore it.

Lengths are LengthDist specs (an int is a fixed length; ``{kind: uniform, low, high}``,
``normal``, ``lognormal``, ``empirical``), arrivals an ArrivalProcess spec (``offline``,
``poisson``, ``gamma``, ``ramp``, ``closed_loop``). Request i's prompt ids come from
their own stream keyed by i, so they do not depend on the other requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvbench.types import Request, Workload
from kvbench.workloads.build import check_common, draw_lengths, sorted_workload
from kvbench.workloads.distributions import arrival_process
from kvbench.workloads.errors import WorkloadConfigError
from kvbench.workloads.tokens import (
    STREAM_ARRIVALS,
    STREAM_CHOICES,
    STREAM_HEADER,
    STREAM_OUTPUT_LEN,
    STREAM_PROMPT_LEN,
    STREAM_TOKENS,
    Tokenizer,
    derive_rng,
    random_token_ids,
)

LengthSpec = Mapping[str, Any] | int
ArrivalSpec = Mapping[str, Any] | str | None


def random_requests(
    num_requests: int = 32,
    prompt_len: LengthSpec = 128,
    output_len: LengthSpec = 32,
    arrival: ArrivalSpec = None,
    *,
    vocab_size: int,
    seed: int = 0,
    name: str = "random",
    tokenizer: Tokenizer | None = None,
    n: int = 1,
    beam_width: int = 1,
    temperature: float = 0.0,
) -> Workload:
    """``num_requests`` independent random prompts; no two share a prefix (beyond chance).

    ``n`` (parallel samples per request) and ``beam_width`` are copied onto every
    request. Counters: ``num_prompt_len_clipped``, ``num_output_len_clipped``. Raises
    WorkloadConfigError naming the bad parameter.
    """
    check_common(vocab_size, seed, num_requests=num_requests, n=n, beam_width=beam_width)
    if n > 1 and beam_width > 1:
        raise WorkloadConfigError("n/beam_width: a request is either best-of-n or beam search, not both")
    counters: dict[str, int] = {}
    prompt_lens = draw_lengths(prompt_len, "prompt_len", seed, STREAM_PROMPT_LEN, num_requests, counters)
    output_lens = draw_lengths(output_len, "output_len", seed, STREAM_OUTPUT_LEN, num_requests, counters)
    process = arrival_process(arrival)
    arrivals = process.times(derive_rng(seed, STREAM_ARRIVALS), num_requests)
    tags = {"kind": name, **process.request_tags()}
    requests = [
        Request(
            request_id=f"{name}-{i:06d}",
            arrival_s=float(arrivals[i]),
            prompt_token_ids=_frozen_ids(
                random_token_ids(derive_rng(seed, STREAM_TOKENS, i), int(prompt_lens[i]), vocab_size)
            ),
            max_new_tokens=int(output_lens[i]),
            n=n,
            beam_width=beam_width,
            temperature=temperature,
            tags=tags,
        )
        for i in range(num_requests)
    ]
    return sorted_workload(name, requests, counters)


def _frozen_ids(ids: np.ndarray) -> np.ndarray:
    """``ids`` as a read-only int32 array, a prompt form ``Request`` takes: 4 bytes a token
    where a tuple holds an int object (~36 bytes), so a workload of a million random
    prompts fits in memory (vocabularies are far below 2**31)."""
    frozen = ids.astype(np.int32)
    frozen.flags.writeable = False
    return frozen


def best_of_n(
    num_requests: int = 16,
    prompt_len: LengthSpec = 128,
    output_len: LengthSpec = 32,
    arrival: ArrivalSpec = None,
    *,
    n: int = 4,
    temperature: float = 1.0,
    vocab_size: int,
    seed: int = 0,
    name: str = "best_of_n",
    tokenizer: Tokenizer | None = None,
) -> Workload:
    """Random prompts, each asking for ``n`` parallel samples (which share the prompt's
    KV); ``temperature > 0`` so that the samples differ."""
    if n < 2:
        raise WorkloadConfigError(f"n: best-of-n needs n >= 2, got {n}")
    return random_requests(
        num_requests, prompt_len, output_len, arrival, vocab_size=vocab_size, seed=seed, name=name, n=n,
        temperature=temperature,
    )  # fmt: skip


def beam_search(
    num_requests: int = 16,
    prompt_len: LengthSpec = 128,
    output_len: LengthSpec = 32,
    arrival: ArrivalSpec = None,
    *,
    beam_width: int = 4,
    vocab_size: int,
    seed: int = 0,
    name: str = "beam_search",
    tokenizer: Tokenizer | None = None,
) -> Workload:
    """Random prompts decoded with beam search of ``beam_width`` beams."""
    if beam_width < 2:
        raise WorkloadConfigError(f"beam_width: beam search needs beam_width >= 2, got {beam_width}")
    return random_requests(
        num_requests, prompt_len, output_len, arrival, vocab_size=vocab_size, seed=seed, name=name,
        beam_width=beam_width,
    )  # fmt: skip


def prefix_repetition(
    num_requests: int = 32,
    num_prefixes: int = 4,
    prefix_len: LengthSpec = 128,
    suffix_len: LengthSpec = 32,
    output_len: LengthSpec = 32,
    arrival: ArrivalSpec = None,
    *,
    vocab_size: int,
    seed: int = 0,
    name: str = "prefix_repetition",
    tokenizer: Tokenizer | None = None,
) -> Workload:
    """vLLM's prefix-repetition pattern: ``num_prefixes`` random prefixes, each reused by
    about ``num_requests / num_prefixes`` prompts with their own random suffix, in a
    seeded shuffled order. ``tags['prefix']`` names each prompt's prefix."""
    check_common(vocab_size, seed, num_requests=num_requests, num_prefixes=num_prefixes)
    counters: dict[str, int] = {}
    prefix_lens = draw_lengths(prefix_len, "prefix_len", seed, STREAM_HEADER, num_prefixes, counters)
    prefixes = [
        random_token_ids(derive_rng(seed, STREAM_HEADER, p), int(prefix_lens[p]), vocab_size).tolist()
        for p in range(num_prefixes)
    ]
    suffix_lens = draw_lengths(suffix_len, "suffix_len", seed, STREAM_PROMPT_LEN, num_requests, counters)
    output_lens = draw_lengths(output_len, "output_len", seed, STREAM_OUTPUT_LEN, num_requests, counters)
    # Round-robin assignment, then shuffle: every prefix gets floor or ceil of its share.
    owner = derive_rng(seed, STREAM_CHOICES).permutation(num_requests) % num_prefixes
    process = arrival_process(arrival)
    arrivals = process.times(derive_rng(seed, STREAM_ARRIVALS), num_requests)
    requests = []
    for i in range(num_requests):
        suffix = random_token_ids(
            derive_rng(seed, STREAM_TOKENS, i), int(suffix_lens[i]), vocab_size
        ).tolist()
        requests.append(
            Request(
                request_id=f"{name}-{i:06d}",
                arrival_s=float(arrivals[i]),
                prompt_token_ids=tuple(prefixes[owner[i]] + suffix),
                max_new_tokens=int(output_lens[i]),
                tags={"kind": name, "prefix": str(owner[i]), **process.request_tags()},
            )
        )
    return sorted_workload(name, requests, counters)
