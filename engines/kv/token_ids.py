"""Token ids of a sequence and the block keys they carry.

A sequence's tokens live in a ``KeyedTokenIds`` (a ``list``) or an ``ArrayTokenIds`` (a
trace prompt's numpy array plus the tokens appended since); both carry the
``BlockKeyChain`` of their full blocks, computed with ``kvbench.hashing``'s chained
block keys (the one definition of a block key, shared with the metrics' prefix-reuse
bound and ``kvbench trace inspect``). ``TokenSpan`` / ``TokenPrefix`` are read-only
views of a token list.

Invariant: sequences only grow (``append`` / ``extend``), so full blocks never change
and a chain's keys are only ever appended.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvbench.hashing import block_multipliers, chain_start, chained_block_keys_into
from kvbench.types import ComputedTokenIds

# A full block's key: two 64-bit lanes of a chained sum (``kvbench.hashing``'s block keys,
# shared with the prefix-reuse bound). Lane 0 keys the hash table; lane 1 is compared on a
# hit. The block's token ids are not kept in the key (vLLM likewise trusts a hash).

# What a new chain starts with, shared by every chain: a chain replaces its (empty) key
# arrays before it writes a key (``_reserve``) and its memo's array is only ever replaced,
# so nothing writes these; ``_STARTS`` is written just before each keying call, which only
# reads it. (Four arrays per chain cost more than keying a short prompt.) Not flagged
# read only: compiled calls take these, and a read-only array is another type to compile.
_NO_KEYS = np.empty(0, dtype=np.uint64)
NO_BLOCK_IDS = np.empty(0, dtype=np.int64)  # no blocks (a match memo's, an index's): never written
_STARTS = np.empty(2, dtype=np.uint64)  # each lane's sum before the blocks being keyed


class BlockKeyChain:
    """The chained keys of a token sequence's full blocks, kept between uses.

    vLLM keeps block hashes on the request so that matching and registering do not rehash
    a prompt; this is that cache. It is valid for one append-only token sequence, one
    block size and one extra key (the cache salt): full blocks never change as the
    sequence grows, so keys are only ever appended. Block ``i``'s key is ``hashes[i]``
    (lane 0) and ``checks[i]`` (lane 1) of ``kvbench.hashing``'s chained block keys, which
    depend on every token up to the block's end. ``extend`` keys new blocks in one
    compiled loop (``kvbench.hashing.chained_block_keys_into``; from the prompt's own array in an
    ``ArrayTokenIds``): O(new blocks x block_size). A chain may lag behind its sequence:
    the index keys a decoding sequence's new blocks in its own compiled pass and keeps
    only the last key (``BlockHashPrefixIndex``), so a later ``extend`` (a recompute's
    match, a fork's commit) keys those blocks again from the tokens, to the same keys.

    It also memoises the last match of the chain against one index (the ``match_*``
    slots): a waiting sequence is matched every step it stays blocked, and re-walking a
    1,000-block prefix in Python each time dominated long-prompt traces. The index
    revalidates the memo itself (``BlockHashPrefixIndex.match``).
    """

    __slots__ = (
        "block_size",
        "extra_key",
        "num_blocks",
        "_hashes",
        "_checks",
        "last_key",
        "match_owner",
        "match_array",
        "match_num_taken",
        "match_ref_version",
        "match_num_drops",
        "match_version",
        "match_num_full",
    )

    def __init__(self, block_size: int, extra_key: str | None) -> None:
        self.block_size = block_size
        self.extra_key = extra_key
        self.num_blocks = 0  # full blocks keyed so far
        # uint64 [capacity >= num_blocks], grown by doubling: lane 0 (the hash map's key)
        # and lane 1 (compared on a hit) of each full block's key.
        self._hashes = _NO_KEYS
        self._checks = _NO_KEYS
        # Both lanes of the last keyed block's key (Python ints), or the chain's start before
        # any block: what the next block's key is chained from.
        self.last_key: tuple[int, int] = _start_key(extra_key)
        self.match_owner: object | None = None  # the index the memo belongs to
        # The last match's blocks, in order, int64 [matched] (read only: answers share it).
        self.match_array = NO_BLOCK_IDS
        self.match_num_taken = 0  # unreferenced blocks among them then
        self.match_ref_version = -1  # the pool's ref_version then
        self.match_num_drops = 0  # the index's cumulative dropped registrations then
        # The memo is the answer as it stands while the index's version (bumped by every
        # registration and drop), the pool's ref_version and the full-block count asked
        # for are unchanged: admission asks up to three times per step for the same head.
        # (The chain keeps no PrefixMatch: its handle is the chain, and the cycle would
        # outlive the sequence until a garbage collection. The index keeps its last one.)
        self.match_version = -1
        self.match_num_full = -1

    @property
    def hashes(self) -> np.ndarray:
        """Lane 0 of each full block's key, uint64 [num_blocks] (a view: read only)."""
        return self._hashes[: self.num_blocks]

    @property
    def checks(self) -> np.ndarray:
        """Lane 1 of each full block's key, uint64 [num_blocks] (a view: read only)."""
        return self._checks[: self.num_blocks]

    def extend(self, token_ids: Sequence[int], num_blocks: int) -> None:
        """Compute keys up to block ``num_blocks - 1`` (no-op when already there). Mutates the
        chain; raises ValueError when ``token_ids`` has fewer full blocks."""
        first = self.num_blocks
        if num_blocks <= first:
            return
        bs = self.block_size
        if num_blocks * bs > len(token_ids):
            raise ValueError(f"BlockKeyChain: {num_blocks} blocks asked of {len(token_ids)} tokens")
        self._reserve(num_blocks)
        ids = _id_array(token_ids, first * bs, num_blocks * bs)
        _STARTS[0], _STARTS[1] = self.last_key
        chained_block_keys_into(
            ids,
            block_multipliers(bs),
            first,
            _STARTS,
            self._hashes[first:num_blocks],
            self._checks[first:num_blocks],
        )
        self.num_blocks = num_blocks
        self.last_key = (int(self._hashes[num_blocks - 1]), int(self._checks[num_blocks - 1]))

    def key_before(self, num_blocks: int) -> tuple[int, int]:
        """The key (both lanes, Python ints) block ``num_blocks`` chains from: block
        ``num_blocks - 1``'s, or the chain's start for block 0. Pure; IndexError when
        ``num_blocks`` exceeds the blocks keyed so far."""
        if num_blocks > self.num_blocks:
            raise IndexError(f"BlockKeyChain.key_before: block {num_blocks} of {self.num_blocks} keyed")
        if num_blocks == self.num_blocks:
            return self.last_key
        if num_blocks == 0:
            return _start_key(self.extra_key)
        return (int(self._hashes[num_blocks - 1]), int(self._checks[num_blocks - 1]))

    def _reserve(self, num_blocks: int) -> None:
        """Room for ``num_blocks`` keys (capacity doubling: amortised O(1) per key)."""
        if num_blocks > len(self._hashes):
            n = self.num_blocks
            capacity = max(num_blocks, 2 * len(self._hashes), 8)
            hashes = np.empty(capacity, dtype=np.uint64)
            checks = np.empty(capacity, dtype=np.uint64)
            if n:  # (a chain's first keys, once per prompt, copy nothing)
                hashes[:n] = self.hashes
                checks[:n] = self.checks
            self._hashes, self._checks = hashes, checks

    def copy(self) -> BlockKeyChain:
        """An independent chain with the same keys (a fork shares every full block)."""
        chain = BlockKeyChain(self.block_size, self.extra_key)
        chain._hashes = self.hashes.copy()
        chain._checks = self.checks.copy()
        chain.num_blocks = self.num_blocks
        chain.last_key = self.last_key
        return chain


def _start_key(extra_key: str | None) -> tuple[int, int]:
    """Both lanes of a chain's start (what block 0's key chains from) for ``extra_key``. Pure."""
    return (chain_start(extra_key, 0), chain_start(extra_key, 1))


def _id_array(token_ids: Sequence[int], start: int, stop: int) -> np.ndarray:
    """Ids ``[start, stop)`` of ``token_ids`` as a numpy array: a slice of an
    ``ArrayTokenIds``' prompt array (directly or through a view) when the range lies in
    it, else a copy (``id_list``: for a decode block, of its appended tail only)."""
    tokens, first, last = _unwrapped(token_ids, start, stop)
    if type(tokens) is ArrayTokenIds and last <= tokens.num_prompt_ids:  # exact: see _unwrapped
        return tokens.array[first:last]
    return np.array(id_list(token_ids, start, stop), dtype=np.int64)


def id_list(token_ids: Sequence[int], start: int, stop: int) -> list[int]:
    """Ids ``[start, stop)`` of ``token_ids`` (``0 <= start <= stop <= len``) as a list,
    equal to ``token_ids[start:stop]``: a decode block's ids are one slice of an
    ``ArrayTokenIds``' appended tail or of a list, also through a view (registering
    decode blocks slices once per block; the views' own slicing re-checks the range
    twice, this does not). Of ids that are no view, a ``stop`` past them gives fewer, as
    slicing does (a commit entry's batch reads that as a count past its ids).
    ``_StepRegistrations.add_steps`` inlines the branches for a sequence's own ids (a
    block in an ``ArrayTokenIds``' tail, a ``KeyedTokenIds`` list's slice): change both
    alike."""
    tokens = token_ids
    if type(tokens) is not ArrayTokenIds:  # a sequence's own ids (every commit entry's) skip the call
        tokens, start, stop = _unwrapped(token_ids, start, stop)
    if type(tokens) is ArrayTokenIds:  # exact: see _unwrapped
        num_array = tokens.num_prompt_ids
        if start >= num_array:
            return tokens.tail[start - num_array : stop - num_array]
        if stop > num_array:
            # The block across the prompt's end: a decode run's first registration of a
            # sequence whose prompt ends mid-block (the slice's own range checks skipped).
            return tokens.array[start:num_array].tolist() + tokens.tail[: stop - num_array]
    return tokens[start:stop]


def _unwrapped(token_ids: Sequence[int], start: int, stop: int) -> tuple[Sequence[int], int, int]:
    """The ids a ``TokenSpan`` views and the range ``[start, stop)`` of the span in them;
    any other ids as they are. Pure.

    The usual types are told apart by exact type tests: an ``isinstance`` test that is
    not an exact match calls these ABC-derived classes' Python-level
    ``__instancecheck__`` (about 1,500 instructions; decode registrations unwrap once
    per block). Callers' own exact tests for ``ArrayTokenIds`` only choose a faster
    slice: a subclass takes the plain one, to the same ids."""
    cls = type(token_ids)
    if cls is TokenPrefix or cls is TokenSpan:
        pass
    elif cls is ArrayTokenIds or cls is KeyedTokenIds or cls is list or not isinstance(token_ids, TokenSpan):
        return token_ids, start, stop
    return token_ids._tokens, start + token_ids._start, stop + token_ids._start


class KeyCarrier:
    """Token ids that carry their ``BlockKeyChain`` (``KeyedTokenIds``, ``ArrayTokenIds``).

    The scheduler's sequences hold their tokens in one, so ``BlockHashPrefixIndex.match``
    (called for a waiting sequence every step it stays blocked) and ``commit`` reuse the
    keys instead of rehashing the prompt. Contract: only ``append``/``extend`` mutate the
    ids (which is how sequences grow); the chain covers full blocks only, so it stays
    valid. ``copy`` (fork) copies the chain, since both copies share every full block.
    """

    __slots__ = ()
    key_chain: BlockKeyChain | None

    def chain(self, block_size: int, extra_key: str | None) -> BlockKeyChain:
        """The chain for this block size and extra key (a new one if those changed). Mutates
        ``key_chain``."""
        chain = self.key_chain
        if chain is None or chain.block_size != block_size or chain.extra_key != extra_key:
            chain = self.key_chain = BlockKeyChain(block_size, extra_key)
        return chain


class KeyedTokenIds(KeyCarrier, list):  # type: ignore[type-arg]  # a list[int]
    """A sequence's token ids as a plain ``list`` carrying its ``BlockKeyChain``."""

    __slots__ = ("key_chain",)

    def __init__(self, token_ids: Iterable[int] = ()) -> None:
        # Python ints throughout, as the list stands for one: readers (outputs, results,
        # comparisons) get ints, never numpy scalars. An array converts in one C call.
        super().__init__(token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids)
        if not set(map(type, self)) <= {int}:  # one C pass (bool and numpy ints convert)
            self[:] = [int(t) for t in self]
        self.key_chain: BlockKeyChain | None = None

    def copy(self) -> KeyedTokenIds:  # type: ignore[override]
        other = KeyedTokenIds(self)
        if self.key_chain is not None:
            other.key_chain = self.key_chain.copy()
        return other

    # copy.copy / copy.deepcopy: ``copy``, with a chain of its own. (The default would share
    # the chain, its keys and its match memo, between two lists that may then diverge.)
    def __copy__(self) -> KeyedTokenIds:
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> KeyedTokenIds:
        return self.copy()


class ArrayTokenIds(KeyCarrier, Sequence[int]):
    """A sequence's token ids as its prompt's numpy array (shared, never written) plus a
    list of the ids appended since; carries its ``BlockKeyChain``.

    Trace prompts arrive as numpy arrays and stay so: in simulation only the prompt's
    block keys (computed from the array in a few numpy calls) and its length are ever
    read, and Python int lists of long prompts take far more memory. Reads behave like the equivalent list: ``len``,
    iteration, indexing (Python ints), slicing (a new list), ``==`` with lists and views
    of equal ids, ``copy`` (also ``copy.copy``/``deepcopy``); list arithmetic (``+``,
    ``*``) and ordering are not offered. ``append``/``extend`` are the tail list's own
    (C) methods. ``tail`` (the appended ids) and ``num_prompt_ids`` (the prompt's length)
    are read directly by the decode-registration loop; neither is rebound after
    construction (``tail`` only grows).

    The prompt may also be ``ComputedTokenIds`` (a trace prompt computed when read): its
    ids are then computed on the first read of ``array`` and held from then on, so a
    request waiting in the queue holds no ids until it is matched or scheduled (the full
    Mooncake replay queues thousands of requests of 12K tokens each).
    """

    __slots__ = ("_array", "tail", "num_prompt_ids", "append", "extend", "key_chain")

    def __init__(self, array: np.ndarray | ComputedTokenIds, tail: Iterable[int] = ()) -> None:
        if isinstance(array, np.ndarray) and (array.ndim != 1 or array.dtype.kind not in "iu"):
            raise ValueError(f"ArrayTokenIds: a 1-D integer array is needed, got {array.dtype} {array.shape}")
        self._array = array
        self.num_prompt_ids = len(array)
        self.tail: list[int] = list(tail)
        self.append = self.tail.append
        self.extend = self.tail.extend
        self.key_chain: BlockKeyChain | None = None

    @property
    def array(self) -> np.ndarray:
        """The prompt's ids: a read-only 1-D integer array (computed now on the first read
        of a ``ComputedTokenIds`` prompt, then held)."""
        array = self._array
        if not isinstance(array, np.ndarray):
            array = self._array = array.ids()
        return array

    def __len__(self) -> int:
        return self.num_prompt_ids + len(self.tail)

    def __getitem__(self, index):  # type: ignore[override]  # int -> int, slice -> list
        num_array = self.num_prompt_ids
        if isinstance(index, slice):
            start, stop, step = index.indices(num_array + len(self.tail))
            if step != 1:
                return list(self)[index]
            if stop <= start:
                return []
            if stop <= num_array:
                return self.array[start:stop].tolist()
            if start >= num_array:
                return self.tail[start - num_array : stop - num_array]
            return self.array[start:].tolist() + self.tail[: stop - num_array]
        size = num_array + len(self.tail)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(f"ArrayTokenIds index {index} out of range({size})")
        return int(self.array[index]) if index < num_array else self.tail[index - num_array]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.array.tolist(), self.tail)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, TokenSpan, ArrayTokenIds)):
            return len(other) == len(self) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable like them

    def copy(self) -> ArrayTokenIds:
        other = ArrayTokenIds(self._array, self.tail)
        if self.key_chain is not None:
            other.key_chain = self.key_chain.copy()
        return other

    # copy.copy / copy.deepcopy: a new tail (its own append/extend), as for a list; the
    # read-only prompt array is shared.
    def __copy__(self) -> ArrayTokenIds:
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> ArrayTokenIds:
        return self.copy()

    def __repr__(self) -> str:
        return f"ArrayTokenIds(len={len(self)}, prompt={self.num_prompt_ids})"


class TokenSpan(Sequence[int]):
    """Ids ``[start, stop)`` of a token list, without copying them (read-only view).

    The list must not change there (sequences only append). Indexing and slicing stay
    within the span; a slice is a new list.
    """

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: Sequence[int], start: int, stop: int) -> None:
        if not 0 <= start <= stop <= len(tokens):
            raise ValueError(f"{type(self).__name__}: ids [{start}, {stop}) asked of {len(tokens)}")
        self._tokens = tokens
        self._start = start
        self._stop = stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):  # type: ignore[override]  # int -> int, slice -> list
        size = self._stop - self._start
        if isinstance(index, slice):
            start, stop, step = index.indices(size)
            if step == 1:
                return self._tokens[self._start + start : self._start + max(start, stop)]
            return [self._tokens[self._start + i] for i in range(start, stop, step)]
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(f"{type(self).__name__} index {index} out of range({size})")
        return self._tokens[self._start + index]

    def __eq__(self, other: object) -> bool:
        # Compares like the list slice it stands for (chunks hold one or the other).
        if isinstance(other, (list, TokenSpan, ArrayTokenIds)):
            return len(other) == len(self) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable like them


class TokenPrefix(TokenSpan):
    """The first ``num_tokens`` ids of a token list (a ``TokenSpan`` from 0).

    A plain ``commit`` of a prefilling sequence's computed prefix reads one
    (``prefix_of``), as do prefix matches of part of a sequence; slicing a 100K-token
    prompt for that copied O(prompt) per step, O(prompt^2 / chunk) per request.
    """

    __slots__ = ()

    def __init__(self, tokens: Sequence[int], num_tokens: int) -> None:
        super().__init__(tokens, 0, num_tokens)


def prefix_of(token_ids: Sequence[int], num_tokens: int) -> Sequence[int]:
    """The first ``num_tokens`` ids of ``token_ids``: the ids themselves when that is all
    of them, else a ``TokenPrefix`` view (ValueError when ``num_tokens`` is outside
    ``[0, len]``). Pure. What a ``commit_many`` entry (sequence id, ids, count) stands for
    where a manager or index commits one entry as a plain ``commit``."""
    return token_ids if num_tokens == len(token_ids) else TokenPrefix(token_ids, num_tokens)
