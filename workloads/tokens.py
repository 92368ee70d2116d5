"""Seeded token ids: random draws, content-keyed blocks, and text through a tokenizer.

Every random stream is derived from ``(seed, stream, *keys)`` with numpy's SeedSequence,
so two generators never share state, adding a request never shifts another request's
tokens, and the same config gives the same ids on any machine. Ids 0-2 are reserved
specials (pad, bos, eos), so drawn ids lie in ``[FIRST_REGULAR_TOKEN_ID, vocab_size)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from numba import njit

from kvbench.hashing import GOLDEN64, MASK64, mix64, mix64_u64
from kvbench.workloads.errors import WorkloadConfigError

FIRST_REGULAR_TOKEN_ID = 3

# Stream ids: one per purpose, so that e.g. prompt lengths and arrivals never share draws.
STREAM_PROMPT_LEN = 1
STREAM_OUTPUT_LEN = 2
STREAM_ARRIVALS = 3
STREAM_TOKENS = 4
STREAM_HEADER = 5
STREAM_PASSAGES = 6
STREAM_CHOICES = 7
STREAM_TURNS = 8
STREAM_SAMPLE = 9
STREAM_PASSKEY = 10
STREAM_NEXT_LEN = 11
STREAM_GAPS = 12


@runtime_checkable
class Tokenizer(Protocol):
    """Anything with ``encode(text) -> list[int]`` (a HF ``tokenizers.Tokenizer`` needs a
    thin wrapper returning ``.ids``)."""

    def encode(self, text: str) -> list[int]: ...


def check_vocab_size(vocab_size: int) -> None:
    """Raise WorkloadConfigError unless some regular id exists above the specials."""
    if not isinstance(vocab_size, int) or vocab_size <= FIRST_REGULAR_TOKEN_ID:
        raise WorkloadConfigError(
            f"vocab_size: must be an int > {FIRST_REGULAR_TOKEN_ID} (ids 0-2 are specials), got {vocab_size!r}"
        )


def check_seed(seed: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise WorkloadConfigError(f"seed: must be an int in [0, 2**32), got {seed!r}")


def derive_rng(seed: int, stream: int, *keys: int) -> np.random.Generator:
    """An independent PCG64 generator for ``(seed, stream, *keys)``, all ints in [0, 2**32).

    The key count is part of the entropy because SeedSequence pads short entropy with
    zeros: without it ``(s, stream)`` and ``(s, stream, 0)`` would be the same stream.
    """
    words = [seed, stream, len(keys), *keys]
    check_stream_words(words)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))


def check_stream_words(words: Sequence[int]) -> None:
    """Raise WorkloadConfigError unless every word of a derived stream lies in [0, 2**32). Pure."""
    if any(not 0 <= int(w) < 2**32 for w in words):
        raise WorkloadConfigError(f"seed: derived-stream words must lie in [0, 2**32), got {list(words)}")


def random_token_ids(rng: np.random.Generator, num_tokens: int, vocab_size: int) -> np.ndarray:
    """``num_tokens`` ids drawn uniformly from ``[3, vocab_size)``; advances ``rng``."""
    # ids: [num_tokens] int64
    return rng.integers(FIRST_REGULAR_TOKEN_ID, vocab_size, size=num_tokens, dtype=np.int64)


def keyed_token_ids(
    seed: int, keys: np.ndarray | Sequence[int], offsets: np.ndarray | Sequence[int], vocab_size: int
) -> np.ndarray:
    """Ids that depend only on ``(seed, key, offset)``: the content of a keyed block.

    ``keys[i]`` names a block (a Mooncake hash id, a text's stable key) and ``offsets[i]``
    the position inside it, so two requests holding the same key get identical ids
    there, whatever else they contain. A counter-based hash (SplitMix64) rather than one
    RNG per key keeps the 300k blocks of a Mooncake trace fast. Pure; no state.
    """
    return keyed_ids_from_bases(keyed_block_bases(seed, keys), offsets, vocab_size)


def keyed_block_bases(seed: int, keys: np.ndarray | Sequence[int]) -> np.ndarray:
    """Per key, the uint64 base its block's ids are drawn from (``keyed_token_ids``' first
    stage): callers with many ids per key mix each key once and repeat the bases. Pure."""
    keys_u = np.asarray(keys, dtype=np.int64).astype(np.uint64)  # [n]
    # The +1s keep (seed, key, offset) = (0, 0, 0) off the mixer's fixed point at zero.
    seed_mixed = mix64(np.array([((seed + 1) * GOLDEN64) & MASK64], dtype=np.uint64))
    with np.errstate(over="ignore"):
        return mix64(((keys_u + np.uint64(1)) * np.uint64(GOLDEN64)) ^ seed_mixed)


def keyed_ids_from_bases(
    bases: np.ndarray, offsets: np.ndarray | Sequence[int], vocab_size: int
) -> np.ndarray:
    """``keyed_token_ids``' second stage: the id at each ``(base, offset)`` pair, int64. Pure."""
    offsets_u = np.asarray(offsets, dtype=np.int64).astype(np.uint64)  # [n]
    with np.errstate(over="ignore"):
        mixed = mix64(bases + (offsets_u + np.uint64(1)) * np.uint64(GOLDEN64))
    num_regular = np.uint64(vocab_size - FIRST_REGULAR_TOKEN_ID)
    return (mixed % num_regular).astype(np.int64) + FIRST_REGULAR_TOKEN_ID


# Smallest divisor for which ``mod_by_float_quotient`` is exact (see its proof).
FLOAT_QUOTIENT_MIN_DIVISOR = 8192


@njit(cache=True, nogil=True)
def mod_by_float_quotient(y, n, inv_n):  # pragma: no cover - compiled
    """``y % n`` for a uint64 ``y`` and an int ``n >= FLOAT_QUOTIENT_MIN_DIVISOR``, with
    ``inv_n = 1.0 / n``: a float64 quotient and one correction instead of a 64-bit
    division (about half the cost of a keyed id). Exact: ``q = fl(fl(y) * inv_n)`` is
    ``y / n`` times ``(1 + e)`` with ``|e| <= 3 * 2**-53``, so it is off by less than
    ``2**64 / n * 3 * 2**-53 = 6144 / n < 1``; truncated it is ``y // n`` or one either
    side, ``r = y - q * n`` lies in ``[-n, 2n)`` (exact in wrapping uint64 read as int64)
    and one step brings it into ``[0, n)``. ``q < 2**52`` converts exactly. Pure."""
    q = np.uint64(np.float64(y) * inv_n)
    r = np.int64(y - q * np.uint64(n))
    if r < 0:
        r += n
    elif r >= n:
        r -= n
    return np.uint64(r)


@njit(cache=True, nogil=True)
def keyed_block_ids_into(bases, lengths, vocab_size, out):  # pragma: no cover - compiled
    """``keyed_ids_from_bases`` for whole blocks, compiled: block ``b``'s ids (offsets
    ``0 .. lengths[b] - 1`` from ``bases[b]``, uint64) written one block after another
    into ``out`` (any integer array of ``lengths.sum()`` ids). The same values bit for
    bit (tests/test_sim_memory.py compares them): the numpy definition builds a
    uint64 temporary per operation over every id, ~4x the arithmetic's cost for the
    100M+ ids of a Mooncake trace. Every real vocabulary is above
    ``FLOAT_QUOTIENT_MIN_DIVISOR``, where the reduction skips the division
    (``mod_by_float_quotient``). Mutates only ``out``."""
    step = np.uint64(GOLDEN64)
    num_regular = vocab_size - FIRST_REGULAR_TOKEN_ID
    divisor = np.uint64(num_regular)
    inv = 1.0 / np.float64(num_regular)
    by_float = num_regular >= FLOAT_QUOTIENT_MIN_DIVISOR
    first = np.uint64(FIRST_REGULAR_TOKEN_ID)
    pos = 0
    for b in range(bases.shape[0]):
        x = bases[b]  # + (offset + 1) * GOLDEN64, one step per offset (wrapping)
        n = lengths[b]
        for k in range(n):
            x += step
            y = mix64_u64(x)
            out[pos + k] = (mod_by_float_quotient(y, num_regular, inv) if by_float else y % divisor) + first
        pos += n


def tile_to_length(ids: Sequence[int], length: int) -> np.ndarray:
    """Repeat ``ids`` end to end and cut at ``length`` (a filler or header of exact size)."""
    if length == 0:
        return np.zeros(0, dtype=np.int64)
    if len(ids) == 0:
        raise WorkloadConfigError("tokenizer: encoded an empty id list for a non-empty text")
    reps = -(-length // len(ids))
    return np.tile(np.asarray(ids, dtype=np.int64), reps)[:length]


def text_or_random_ids(
    text: str, length: int, tokenizer: Tokenizer | None, rng: np.random.Generator, vocab_size: int
) -> np.ndarray:
    """``length`` ids: ``text`` encoded by ``tokenizer`` and tiled, or random ids without one.

    Used for shared headers (system prompts, tool scaffolds) so that real-tokenizer runs
    see real text while tokenizer-less runs stay valid for any vocabulary.
    """
    if tokenizer is None:
        return random_token_ids(rng, length, vocab_size)
    return tile_to_length(tokenizer.encode(text), length)
