"""Stable 64-bit mixing: the one hash family behind seeded ids and content keys.

Workloads derive token ids from (seed, key, offset), simulation draws stand-in tokens,
and metrics key prompt blocks; all need hashes that are the same in every process (unlike
``hash`` on ``str``) and fast on numpy arrays. SplitMix64's finaliser is the mixer
(uint64 arithmetic wraps mod 2**64, which is intended); blake2b keys text.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
from numba import njit

MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd: SplitMix64's increment


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (a new array; wrapping intended). Pure."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def stable_key(text: str) -> int:
    """A 63-bit key of ``text`` that is the same in every process. Pure."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from the parts' text (their ``repr``), the same in every process
    (unlike ``hash``): the sampler's per-draw generators and simulation's stand-in keys. Pure."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# ---------------------------------------------------------------------------- block keys
# The prefix cache's block keys (``BlockHashPrefixIndex``) and the prefix-reuse bound
# (``metrics.prefix_reused_tokens``) share this one definition. A full block of
# ``block_size`` token ids at position ``j`` of its sequence (0: the first block) has
#
#   content  c_j  = sum_k t_jk * BLOCK_MULTIPLIERS[k]                   (wrapping)
#   term     u_j  = mix64(c_j + j * LANE_STEPS[lane] + LANE_SEEDS[lane])  per lane
#   key      K_i  = chain_start(salt, lane) + sum_{j <= i} u_j           (mod 2**64)
#
# so block i's key depends on every token before its end (a chained key, as vLLM's
# parent-hash chain) while a whole prompt's keys come from a few numpy calls (a cumulative
# sum, not a sequential loop of hashes). Two lanes: lane 0 is the hash table's key, lane 1 is
# compared on a hit. For ids that are not crafted against it, a false hit has probability
# ~2**-64 per pair of blocks. It is not collision resistant: both lanes share c_j, a
# linear sum of the ids, and lattice reduction finds two blocks with equal c_j (so equal
# keys) in seconds; a cache shared by mutually distrusting tenants should salt prompts
# (``cache_salt``) or use a cryptographic key, as vLLM's sha256 option does. The same in
# every process. ``chained_block_keys_into`` (compiled) gives the same values bit for bit
# for one sequence that grows a few blocks at a time (the engines' key chains).

LANE_SEEDS = (0x2545F4914F6CDD1D, 0x5851F42D4C957F2D)
LANE_STEPS = (GOLDEN64, 0xD1B54A32D192ED03)  # odd: distinct positions stay distinct
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB


@functools.cache
def block_multipliers(block_size: int) -> np.ndarray:
    """Per-slot odd multipliers of a block's content sum. Read-only uint64 [block_size];
    memoised (a pure function of the size, asked for once per prompt)."""
    multipliers = mix64(np.arange(1, block_size + 1, dtype=np.uint64)) | np.uint64(1)
    multipliers.flags.writeable = False
    return multipliers


def block_contents(tokens: np.ndarray) -> np.ndarray:
    """c_j of each row of ``tokens`` (int [blocks, block_size]). uint64 [blocks]. Pure."""
    # einsum casts the ids chunk by chunk through its buffer (no uint64 copy of a 100K-
    # token prompt); negative ids wrap as astype would.
    return np.einsum("ij,j->i", tokens, block_multipliers(tokens.shape[1]), dtype=np.uint64, casting="unsafe")


def block_terms(
    contents: np.ndarray, positions: np.ndarray, lane: int, scratch: np.ndarray | None = None
) -> np.ndarray:
    """u_j of each block for ``lane`` (contents, positions: [blocks]; ``scratch``: any
    uint64 [blocks] to overwrite). A new uint64 array [blocks]. Pure."""
    terms = positions.astype(np.uint64)  # a copy, written in place below
    terms *= np.uint64(LANE_STEPS[lane])
    terms += np.uint64(LANE_SEEDS[lane])
    terms += contents
    _mix64_in_place(terms, np.empty_like(terms) if scratch is None else scratch)
    return terms


_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))
_MULTIPLIERS = (np.uint64(_MIX_1), np.uint64(_MIX_2))


def _mix64_in_place(x: np.ndarray, scratch: np.ndarray) -> None:
    """``mix64`` written into ``x`` (uint64 array), using ``scratch`` (same shape): no new
    arrays, which for a whole prompt's blocks cost more than the arithmetic. (Array
    integer arithmetic wraps without warnings, so no errstate: it cost ~1 us a call.)"""
    np.right_shift(x, _SHIFTS[0], out=scratch)
    x ^= scratch
    x *= _MULTIPLIERS[0]
    np.right_shift(x, _SHIFTS[1], out=scratch)
    x ^= scratch
    x *= _MULTIPLIERS[1]
    np.right_shift(x, _SHIFTS[2], out=scratch)
    x ^= scratch


def chain_start(salt: str | None, lane: int) -> int:
    """The key sum before a sequence's first block: 0 unsalted, else a mix of the salt's
    stable key (so salted and unsalted chains meet only by a 64-bit chance). Pure."""
    if salt is None:
        return 0
    return mix64_int((stable_key(salt) + LANE_SEEDS[lane]) & MASK64)


def mix64_int(x: int) -> int:
    """``mix64`` of one value in [0, 2**64) as a Python int (the same bits). Pure."""
    x = ((x ^ (x >> 30)) * _MIX_1) & MASK64
    x = ((x ^ (x >> 27)) * _MIX_2) & MASK64
    return x ^ (x >> 31)


@njit(cache=True, nogil=True)
def mix64_u64(x: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """``mix64`` of one uint64, compiled (for loops that mix per block or per token)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_MIX_1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_MIX_2)
    return x ^ (x >> np.uint64(31))


_LANE_STEPS_U64 = np.array(LANE_STEPS, dtype=np.uint64)
_LANE_SEEDS_U64 = np.array(LANE_SEEDS, dtype=np.uint64)


@njit(cache=True, nogil=True)
def chained_block_keys_into(tokens, multipliers, first_position, starts, out_a, out_b):  # pragma: no cover
    """Both lanes' chained keys of consecutive whole blocks of one sequence, compiled:
    ``tokens`` int [blocks * block_size] are blocks ``first_position ..``;
    ``multipliers`` is ``block_multipliers(block_size)``; ``starts`` uint64 [2] each
    lane's key sum before them (the previous block's key, or ``chain_start``). Writes
    ``out_a`` / ``out_b`` uint64 [blocks]: the values ``prompt_block_keys`` gives, bit for
    bit (tests/test_prefix_cache.py compares them). The one compiled body of the
    definition above, written out in the loop (numba does not inline a helper taking
    arrays, and calling one per block cost 3x the block's work). Mutates only the outputs."""
    bs = multipliers.shape[0]
    a = starts[0]
    b = starts[1]
    for j in range(out_a.shape[0]):
        c = np.uint64(0)  # the block's content sum
        for k in range(bs):
            c += np.uint64(tokens[j * bs + k]) * multipliers[k]
        p = np.uint64(first_position + j)
        a += mix64_u64(c + p * _LANE_STEPS_U64[0] + _LANE_SEEDS_U64[0])
        b += mix64_u64(c + p * _LANE_STEPS_U64[1] + _LANE_SEEDS_U64[1])
        out_a[j] = a
        out_b[j] = b


def prompt_block_keys(
    parts: list[np.ndarray], firsts: list[int], salts: list[str | None], block_size: int
) -> np.ndarray:
    """Lane 0 of the chained keys of the full blocks of several prompts at once, in order:
    the values the engine's ``BlockKeyChain.hashes`` holds for each prompt (the
    prefix-reuse bound and ``kvbench trace inspect`` key blocks with it). ``parts``: each
    prompt's full-block tokens; ``firsts``: where each prompt's blocks start among them;
    ``salts``: each prompt's cache salt. A running sum over all blocks, less the sum before
    each prompt, plus the prompt's chain start. uint64 [blocks]. Pure."""
    contents = block_contents(np.concatenate(parts).reshape(-1, block_size))  # [blocks]
    starts = np.asarray(firsts, dtype=np.int64)
    lengths = np.diff(np.append(starts, len(contents)))
    positions = np.arange(len(contents), dtype=np.int64) - np.repeat(starts, lengths)  # in its prompt
    with np.errstate(over="ignore"):
        sums = np.cumsum(block_terms(contents, positions, 0), dtype=np.uint64)
        before = np.where(starts > 0, sums[np.maximum(starts - 1, 0)], np.uint64(0))
        chain = np.array([chain_start(salt, 0) for salt in salts], dtype=np.uint64)
        return sums - np.repeat(before, lengths) + np.repeat(chain, lengths)


# ---------------------------------------------------------------------------- seen keys
class SeenKeys:
    """A growing set of uint64 block keys that answers, prompt after prompt, how many of a
    prompt's leading keys an earlier prompt already added (``leading_seen_then_add``).

    Open addressing with linear probing over a power-of-two table, compiled; keys are
    chained mix64 sums, so their low bits index the table directly. The table grows
    (doubling, rehashed) before a batch could take it past 3/4 full. Memory: 9 bytes per
    slot, 12 to 24 per distinct key; the full Mooncake conversation trace's 9.0M prompt
    blocks of 16 tokens (5.7M distinct) fill 8M slots, 75 MB.
    """

    def __init__(self, num_slots: int = 1 << 16) -> None:
        if num_slots < 1 or num_slots & (num_slots - 1):
            raise ValueError(f"SeenKeys: num_slots must be a power of two, got {num_slots}")
        self._table = np.zeros(num_slots, dtype=np.uint64)  # [slots] key, where occupied
        self._occupied = np.zeros(num_slots, dtype=np.uint8)  # [slots] 1: holds a key
        self.num_keys = 0

    def leading_seen_then_add(self, keys: np.ndarray, firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """For each prompt ``p`` in order, whose keys are ``keys[firsts[p] : firsts[p] +
        counts[p]]`` (uint64; int64 ``firsts``, ``counts``): how many of its leading keys
        the set held before it (int64 [prompts]); then its keys join the set. Mutates
        the set."""
        need = self.num_keys + len(keys)  # at most every key is new
        size = len(self._table)
        while 4 * need > 3 * size:
            size *= 2
        if size != len(self._table):
            table = np.zeros(size, dtype=np.uint64)
            occupied = np.zeros(size, dtype=np.uint8)
            _rehash_keys(self._table, self._occupied, table, occupied)
            self._table, self._occupied = table, occupied
        out = np.empty(len(firsts), dtype=np.int64)
        self.num_keys += _leading_seen_then_add(self._table, self._occupied, keys, firsts, counts, out)
        return out


@njit(cache=True, nogil=True)
def _slot_of(table, occupied, key):  # pragma: no cover - compiled
    """The slot holding ``key``, else the free slot where it would go (the table has one)."""
    mask = np.uint64(table.shape[0] - 1)
    i = key & mask
    while occupied[i] and table[i] != key:
        i = (i + np.uint64(1)) & mask
    return i


@njit(cache=True, nogil=True)
def _add_key(table, occupied, key):  # pragma: no cover - compiled
    """Add ``key`` (a table with a free slot); returns 1 when it was not there, else 0."""
    i = _slot_of(table, occupied, key)
    if occupied[i]:
        return 0
    table[i] = key
    occupied[i] = 1
    return 1


@njit(cache=True, nogil=True)
def _has_key(table, occupied, key):  # pragma: no cover - compiled
    return occupied[_slot_of(table, occupied, key)] != 0


@njit(cache=True, nogil=True)
def _rehash_keys(table, occupied, new_table, new_occupied):  # pragma: no cover - compiled
    for i in range(table.shape[0]):
        if occupied[i]:
            _add_key(new_table, new_occupied, table[i])


@njit(cache=True, nogil=True)
def _leading_seen_then_add(table, occupied, keys, firsts, counts, out):  # pragma: no cover - compiled
    """``SeenKeys.leading_seen_then_add``'s loop; returns how many keys were new."""
    added = 0
    for p in range(firsts.shape[0]):
        start = firsts[p]
        n = counts[p]
        k = 0
        while k < n and _has_key(table, occupied, keys[start + k]):
            k += 1
        out[p] = k
        for j in range(k, n):  # the leading ones are there already
            added += _add_key(table, occupied, keys[start + j])
    return added
