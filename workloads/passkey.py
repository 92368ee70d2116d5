"""Long-context passkey retrieval prompts (Mohtashami & Jaggi 2023's needle test).

Layout of every prompt, exactly ``context_len`` tokens::

    [intro][filler ........ | needle: "the pass key is K" | ........ filler][question]
                            ^ depth * len(filler)

The filler is the same repeated text for every request, so prompts share a prefix up
to their needle (as real passkey suites do). With a ``tokenizer`` every part is real
text and ``expected_output_token_ids`` is ``encode(" K")``; without one the parts are
fixed seeded pseudo-words, and the key's digits map to ten reserved ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvbench.types import Request, Workload
from kvbench.workloads.build import check_common, sorted_workload
from kvbench.workloads.distributions import arrival_process
from kvbench.workloads.errors import WorkloadConfigError
from kvbench.workloads.tokens import (
    FIRST_REGULAR_TOKEN_ID,
    STREAM_ARRIVALS,
    STREAM_HEADER,
    STREAM_PASSKEY,
    Tokenizer,
    derive_rng,
    random_token_ids,
    tile_to_length,
)

INTRO_TEXT = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)
FILLER_TEXT = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE_TEXT = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION_TEXT = " What is the pass key? The pass key is"

# Sizes of the tokenizer-free pseudo-words (ids drawn once per seed).
_NUM_INTRO_IDS = 24
_NUM_FILLER_IDS = 64
_NUM_MARKER_IDS = 6  # "the pass key is"
_NUM_QUESTION_IDS = 8


class _TextParts:
    """The fixed pieces of a passkey prompt as real text through a tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.intro = list(tokenizer.encode(INTRO_TEXT))
        self.filler_unit = list(tokenizer.encode(FILLER_TEXT))
        self.question = list(tokenizer.encode(QUESTION_TEXT))

    def needle(self, key: str) -> list[int]:
        return list(self.tokenizer.encode(NEEDLE_TEXT.format(key=key)))

    def answer(self, key: str) -> list[int]:
        return list(self.tokenizer.encode(f" {key}"))


class _PseudoParts:
    """The same pieces as seeded pseudo-words, for models without a tokenizer; the key's
    digits map to ten distinct ids and the needle is ``marker + digits``."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        if vocab_size < FIRST_REGULAR_TOKEN_ID + 10:
            raise WorkloadConfigError(f"vocab_size: passkey prompts need >= 13 ids, got {vocab_size}")
        rng = derive_rng(seed, STREAM_HEADER)
        num_regular = vocab_size - FIRST_REGULAR_TOKEN_ID
        self.digit_ids = (rng.choice(num_regular, 10, replace=False) + FIRST_REGULAR_TOKEN_ID).tolist()
        self.intro = random_token_ids(rng, _NUM_INTRO_IDS, vocab_size).tolist()
        self.filler_unit = random_token_ids(rng, _NUM_FILLER_IDS, vocab_size).tolist()
        self.marker = random_token_ids(rng, _NUM_MARKER_IDS, vocab_size).tolist()
        self.question = random_token_ids(rng, _NUM_QUESTION_IDS, vocab_size).tolist() + self.marker

    def needle(self, key: str) -> list[int]:
        return self.marker + self.answer(key)

    def answer(self, key: str) -> list[int]:
        return [self.digit_ids[int(d)] for d in key]


def long_context(
    num_requests: int = 8,
    context_len: int = 1024,
    depths: Sequence[float] | None = None,
    passkey_digits: int = 5,
    arrival: Mapping[str, Any] | str | None = None,
    *,
    vocab_size: int,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    max_new_tokens: int | None = None,
    name: str = "long_context",
) -> Workload:
    """Passkey prompts of exactly ``context_len`` tokens with the needle at a depth.

    ``depths`` (fractions in [0, 1]) are used in turn; None draws each uniformly.
    ``max_new_tokens`` defaults to the answer's length. Tags: ``depth``, ``passkey``.
    Raises WorkloadConfigError when ``context_len`` cannot hold intro, needle and question.
    """
    check_common(
        vocab_size, seed, num_requests=num_requests, context_len=context_len, passkey_digits=passkey_digits
    )
    depth_list = None if depths is None else [float(d) for d in depths]
    if depth_list is not None and (not depth_list or any(not 0.0 <= d <= 1.0 for d in depth_list)):
        raise WorkloadConfigError(f"depths: must be a non-empty list of fractions in [0, 1], got {depths!r}")
    parts = _TextParts(tokenizer) if tokenizer is not None else _PseudoParts(vocab_size, seed)
    process = arrival_process(arrival)
    arrivals = process.times(derive_rng(seed, STREAM_ARRIVALS), num_requests)
    requests = []
    for i in range(num_requests):
        rng = derive_rng(seed, STREAM_PASSKEY, i)
        key = str(int(rng.integers(10 ** (passkey_digits - 1), 10**passkey_digits)))
        depth = depth_list[i % len(depth_list)] if depth_list is not None else float(rng.random())
        needle = parts.needle(key)
        num_filler = context_len - len(parts.intro) - len(needle) - len(parts.question)
        if num_filler < 0:
            fixed = context_len - num_filler
            raise WorkloadConfigError(
                f"context_len: {context_len} cannot hold the intro, needle and question ({fixed} tokens)"
            )
        filler = tile_to_length(parts.filler_unit, num_filler).tolist()
        split = round(depth * num_filler)
        prompt = parts.intro + filler[:split] + needle + filler[split:] + parts.question
        expected = parts.answer(key)
        requests.append(
            Request(
                request_id=f"{name}-{i:06d}",
                arrival_s=float(arrivals[i]),
                prompt_token_ids=tuple(int(t) for t in prompt),
                max_new_tokens=max_new_tokens or len(expected),
                expected_output_token_ids=tuple(int(t) for t in expected),
                tags={"kind": "passkey", "depth": f"{depth:.3f}", "passkey": key, **process.request_tags()},
            )
        )
    return sorted_workload(name, requests, {})
