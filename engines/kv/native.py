"""Compiled per-block loops of the block pool, the block-hash index and the paged KV
manager's decode runs (numba).

Why numba: simulating a trace does the same few operations on millions of blocks
(allocate, free, register, look up), each a handful of integer reads and writes that
cost ~50x more as Python bytecode than as machine code. numba compiles these plain
loops over numpy arrays from a PyPI wheel (no compiler on the user's machine) and caches
the machine code next to this file (``cache=True``), so only the first run on a machine
pays the compilation (a few seconds). A C extension would need a compiler in every
install; vectorising with numpy does not fit the free list's pointer chasing.

Callers hold the state; these functions only read and write the arrays they are given.

Pool state ``st`` int32 [5, num_blocks + 1]: rows ``REF``, ``SOFT``, ``CACHED`` (0/1),
``NEXT``, ``PREV`` (the free list's links; column ``num_blocks`` is the sentinel).
Pool counters ``counts`` int64 [4]: ``NUM_FREE``, ``NUM_CACHED_FREE``,
``NUM_RECLAIMABLE``, ``REF_VERSION`` (see ``BlockPool``).

Hash table: ``keys`` uint64 [cap] and ``vals`` int32 [cap] (-1: empty slot), linear
probing, ``cap`` a power of two. An entry ``h -> b`` is *live* while the pool flags ``b``
cached and ``block_hash[b] == h``; entries die without being touched (the pool clears
the flag when it reuses the block) and ``register`` rebuilds the table from the live
blocks once more than half its slots are used.

Functions that can meet a bad block id return its position (>= 0) instead of raising,
having applied the operations before it; -1 means all went through. The Python wrappers
raise the error naming the block.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvbench.hashing import chained_block_keys_into

REF, SOFT, CACHED, NEXT, PREV = 0, 1, 2, 3, 4
NUM_FREE, NUM_CACHED_FREE, NUM_RECLAIMABLE, REF_VERSION = 0, 1, 2, 3
EMPTY = -1


# ---------------------------------------------------------------------- block pool
@njit(cache=True, nogil=True)
def allocate_into(st, counts, out, reused):  # pragma: no cover - compiled
    """Pop ``out.shape[0]`` blocks from the free list's head (the caller checked there are
    enough) into ``out`` (int64): ref count 1, cached flag cleared. The cached ones among
    them go, in order, to the head of ``reused`` (int64, as long as ``out``); returns how
    many. The caller allocates both arrays: an array numba allocates costs more to hand
    back to Python (~1.5 us) than a small allocation's whole pass. Raises ValueError,
    changing nothing, when ``reused`` is shorter than ``out``."""
    if reused.shape[0] < out.shape[0]:
        raise ValueError("allocate_into: reused is shorter than out")
    return _pop(st, counts, out.shape[0], out, 0, reused, 0)


@njit(cache=True, nogil=True)
def _pop(st, counts, num_blocks, out, at, reused, reused_at):  # pragma: no cover - compiled
    """``allocate_into``'s body: the blocks go to ``out[at:]``, the cached ones among them
    to ``reused[reused_at:]``; returns how many were cached."""
    sentinel = st.shape[1] - 1
    k = 0
    b = st[NEXT, sentinel]
    for i in range(num_blocks):
        out[at + i] = b
        st[REF, b] = 1
        if st[CACHED, b]:
            st[CACHED, b] = 0
            reused[reused_at + k] = b
            k += 1
        b = st[NEXT, b]
    st[NEXT, sentinel] = b
    st[PREV, b] = sentinel
    counts[NUM_FREE] -= num_blocks
    counts[NUM_CACHED_FREE] -= k
    return k


def step_buffers(num_blocks: int, num_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The output arrays of ``allocate_steps_into`` (and ``allocate_steps_registering``)
    for ``num_blocks`` blocks over ``num_steps`` steps, unfilled: blocks and reused int64
    [num_blocks], reused per step int64 [num_steps]. Pure."""
    return (
        np.empty(num_blocks, dtype=np.int64),
        np.empty(num_blocks, dtype=np.int64),
        np.empty(num_steps, dtype=np.int64),
    )


@njit(cache=True, nogil=True)
def _check_step_buffers(needs, out, reused, reused_per_step):  # pragma: no cover - compiled
    """Raise ValueError unless ``out`` and ``reused`` hold ``sum(needs)`` blocks and
    ``reused_per_step`` one count per step: the loops write them unchecked."""
    total = 0
    for t in range(needs.shape[0]):
        total += needs[t]
    if out.shape[0] != total or reused.shape[0] < total or reused_per_step.shape[0] != needs.shape[0]:
        raise ValueError("step buffers: out, reused or reused_per_step do not fit needs")


@njit(cache=True, nogil=True)
def allocate_steps_into(st, counts, needs, out, reused, reused_per_step):  # pragma: no cover - compiled
    """``allocate_into`` ``needs[t]`` blocks for each step ``t`` in turn (the caller checked
    that ``sum(needs)`` blocks are free): the blocks into ``out`` (int64 [sum(needs)]), in
    order; the cached ones among them, in order, to the head of ``reused`` (int64, as long
    as ``out``); how many of each step's were cached to ``reused_per_step`` (int64
    [steps]). Returns how many were cached in all. Raises ValueError, changing nothing,
    when an output is shorter than that (``_check_step_buffers``)."""
    _check_step_buffers(needs, out, reused, reused_per_step)
    at = 0
    k = 0
    for t in range(needs.shape[0]):
        n = _pop(st, counts, needs[t], out, at, reused, k)
        reused_per_step[t] = n
        at += needs[t]
        k += n
    return k


@njit(cache=True, nogil=True)
def allocate_one(st, counts):  # pragma: no cover - compiled
    """``allocate_into`` of one block without arrays (the caller checked a block is
    free): returns (the block, whether it was cached)."""
    sentinel = st.shape[1] - 1
    b = st[NEXT, sentinel]
    after = st[NEXT, b]
    st[NEXT, sentinel] = after
    st[PREV, after] = sentinel
    counts[NUM_FREE] -= 1
    st[REF, b] = 1
    was_cached = st[CACHED, b] != 0
    if was_cached:
        st[CACHED, b] = 0
        counts[NUM_CACHED_FREE] -= 1
    return b, was_cached


@njit(cache=True, nogil=True)
def incref_one(st, counts, b):  # pragma: no cover - compiled
    """``incref_many`` of one block: returns False for an id outside the pool."""
    ids = np.empty(1, dtype=np.int64)
    ids[0] = b
    return incref_many(st, counts, ids) == -1


@njit(cache=True, nogil=True)
def decref_one(st, counts, b):  # pragma: no cover - compiled
    """``free_many`` of one block: 1 when it became free, 0 when still held, -1 for an id
    outside the pool or a block without a hard reference (nothing changed)."""
    ids = np.empty(1, dtype=np.int64)
    ids[0] = b
    num_freed, bad = free_many(st, counts, ids)
    return -1 if bad >= 0 else num_freed


# Per-block bodies are written out in their loops, not called: numba does not inline a
# helper that writes to arrays it is passed, and such a call costs several times the
# handful of reads and writes it does. (Read-only ``_slot`` is inlined.)
@njit(cache=True, nogil=True)
def incref_many(st, counts, block_ids):  # pragma: no cover - compiled
    """One hard reference more on each block, in order; a free block leaves the free list.
    Returns the position of the first bad id, or -1 (the blocks before it took theirs;
    the ref version moves only when one did)."""
    n = st.shape[1] - 1
    for i in range(block_ids.shape[0]):
        b = block_ids[i]
        if b < 0 or b >= n:
            if i:
                counts[REF_VERSION] += 1
            return i
        r = st[REF, b]
        if r == 0:
            p = st[PREV, b]
            nx = st[NEXT, b]
            st[NEXT, p] = nx
            st[PREV, nx] = p
            counts[NUM_FREE] -= 1
            if st[CACHED, b]:
                counts[NUM_CACHED_FREE] -= 1
        elif r == st[SOFT, b]:
            counts[NUM_RECLAIMABLE] -= 1  # a hard reference pins a reclaimable block
        st[REF, b] = r + 1
    if block_ids.shape[0]:
        counts[REF_VERSION] += 1
    return -1


@njit(cache=True, nogil=True)
def free_many(st, counts, block_ids):  # pragma: no cover - compiled
    """Drop one hard reference from each block, in order; a block left with none joins the
    free list's tail. Returns (blocks freed, position of the first block without a hard
    reference or with a bad id, else -1; the blocks before it dropped theirs, and the ref
    version moves only when one did)."""
    n = st.shape[1] - 1
    tail = st[PREV, n]
    num_freed = 0
    bad = -1
    num_done = block_ids.shape[0]
    for i in range(block_ids.shape[0]):
        b = block_ids[i]
        if b < 0 or b >= n or st[REF, b] - 1 < st[SOFT, b]:
            bad = i
            num_done = i
            break
        r = st[REF, b] - 1
        st[REF, b] = r
        if r == 0:
            # Linked after the tail; the sentinel follows the last one (below).
            st[NEXT, tail] = b
            st[PREV, b] = tail
            tail = b
            num_freed += 1
            counts[NUM_FREE] += 1
            if st[CACHED, b]:
                counts[NUM_CACHED_FREE] += 1
        elif r == st[SOFT, b]:
            counts[NUM_RECLAIMABLE] += 1
    st[NEXT, tail] = n
    st[PREV, n] = tail
    if num_done:
        counts[REF_VERSION] += 1
    return num_freed, bad


@njit(cache=True, nogil=True)
def set_cached(st, counts, block_ids):  # pragma: no cover - compiled
    """Flag each block as holding reusable KV (a free one counts as cached-free). Returns
    the position of the first bad id, or -1."""
    n = st.shape[1] - 1
    for i in range(block_ids.shape[0]):
        b = block_ids[i]
        if b < 0 or b >= n:
            return i
        if not st[CACHED, b]:
            st[CACHED, b] = 1
            if st[REF, b] == 0:
                counts[NUM_CACHED_FREE] += 1
    return -1


@njit(cache=True, nogil=True)
def free_list_head(st, limit):  # pragma: no cover - compiled
    """The first ``limit`` blocks of the free list (fewer when it is shorter), head first."""
    sentinel = st.shape[1] - 1
    out = np.empty(limit, dtype=np.int64)
    k = 0
    b = st[NEXT, sentinel]
    while k < limit and b != sentinel:
        out[k] = b
        k += 1
        b = st[NEXT, b]
    return out[:k]


# ---------------------------------------------------------------------- hash index
@njit(cache=True, nogil=True)
def _slot(keys, vals, h):  # pragma: no cover - compiled
    """The slot holding key ``h``, or the empty slot where it would go."""
    mask = keys.shape[0] - 1
    i = np.int64(h & np.uint64(mask))
    while vals[i] != EMPTY and keys[i] != h:
        i = (i + 1) & mask
    return i


@njit(cache=True, nogil=True)
def lookup_run(keys, vals, st, block_hash, block_check, hashes, checks, start, stop):  # pragma: no cover
    """Blocks registered under keys ``start ..`` of a chain, up to the first that is not
    (or ``stop``), and how many of them have ref count 0: (int64 [k], count)."""
    out = np.empty(max(stop - start, 0), dtype=np.int64)
    k = 0
    for j in range(start, stop):
        h = hashes[j]
        b = vals[_slot(keys, vals, h)]
        if b == EMPTY or not st[CACHED, b] or block_hash[b] != h or block_check[b] != checks[j]:
            break
        out[k] = b
        k += 1
    return out[:k], _num_unreferenced(st, out, k)


@njit(cache=True, nogil=True)
def first_dropped(dropped_at, block_ids, stop, since):  # pragma: no cover - compiled
    """The first position ``i < stop`` of ``block_ids`` whose block's drop stamp
    (``dropped_at[b]``: the drop count just after its latest drop) exceeds ``since``,
    else ``stop``: how much of a match memo taken at drop count ``since`` still stands."""
    for i in range(stop):
        if dropped_at[block_ids[i]] > since:
            return i
    return stop


@njit(cache=True, nogil=True)
def revalidate_run(
    dropped_at, memo, valid, since, keys, vals, st, block_hash, block_check, hashes, checks, stop, taken
):  # pragma: no cover - compiled
    """A match memo brought up to date: its three steps in one call instead of three (a
    call costs microseconds, the steps nanoseconds per block). ``memo`` int64 [m]: the
    blocks (valid ids: nothing is bounds checked) a chain matched before; ``valid <= m``:
    how many of them may still stand. (A chain with no memo walks with ``lookup_run``
    from its first block: fewer arguments.)

    1. Cut: when ``since >= 0`` (registrations were dropped since the memo, which was
       taken at drop count ``since``), ``valid`` falls to ``first_dropped``'s position.
    2. Walk: the blocks registered under keys ``valid ..`` of the chain (``hashes``,
       ``checks``: keyed up to at least ``stop``), up to the first that is not or ``stop``
       (``lookup_run``).
    3. Count the unreferenced blocks of ``memo[:valid]`` followed by the walk's blocks:
       ``taken`` (>= 0, the memo's own count, still right when nothing was cut) plus the
       walk's; with ``taken < 0``, or after a cut, every block's.

    Returns (valid after the cut, the walk's blocks int64 [k], the count). Pure."""
    if since >= 0 and valid:
        valid = first_dropped(dropped_at, memo, valid, since)
    if valid < memo.shape[0]:
        taken = -1
    if taken < 0:
        taken = _num_unreferenced(st, memo, valid)
    run, num_run_unreferenced = lookup_run(
        keys, vals, st, block_hash, block_check, hashes, checks, valid, stop
    )
    return valid, run, taken + num_run_unreferenced


@njit(cache=True, nogil=True)
def _num_unreferenced(st, block_ids, stop):  # pragma: no cover - compiled
    """How many of ``block_ids[:stop]`` (valid ids) have ref count 0."""
    count = 0
    for i in range(stop):
        if st[REF, block_ids[i]] == 0:
            count += 1
    return count


@njit(cache=True, nogil=True)
def register_run(keys, vals, used, st, counts, block_hash, block_check, hashes, checks, block_ids, start):
    """Register block ``block_ids[i]`` under key ``start + i`` of a chain (lanes
    ``hashes``, ``checks``), in order, unless a live entry already holds the key: the
    first registration wins, within the call too, since each registered block is flagged
    cached at once. ``used`` int64 [1] counts the table's used slots; the table is
    rebuilt from the live blocks whenever they pass half its size. Returns how many
    blocks were registered."""  # pragma: no cover - compiled
    num_registered = 0
    for i in range(block_ids.shape[0]):
        b = block_ids[i]
        h = hashes[start + i]
        slot = _slot(keys, vals, h)
        old = vals[slot]
        if old == EMPTY:
            keys[slot] = h
            used[0] += 1
        elif st[CACHED, old] and block_hash[old] == h:
            continue  # a live entry keeps its block (a fresh block is never cached)
        vals[slot] = b
        block_hash[b] = h
        block_check[b] = checks[start + i]
        if not st[CACHED, b]:
            st[CACHED, b] = 1
            if st[REF, b] == 0:
                counts[NUM_CACHED_FREE] += 1
        num_registered += 1
        if 2 * used[0] > keys.shape[0]:
            rebuild(keys, vals, used, st, block_hash)
    return num_registered


@njit(cache=True, nogil=True)
def allocate_steps_registering(
    keys,
    vals,
    used,
    st,
    counts,
    block_hash,
    block_check,
    needs,
    out,
    reused,
    reused_per_step,
    multipliers,
    entries,
    num_entries,
    lanes,
):  # pragma: no cover - compiled
    """``allocate_steps_into`` (``needs``, ``out``, ``reused``, ``reused_per_step`` as
    there; ``st`` and ``counts`` the pool's, among ``register_run``'s first seven arrays,
    in its order, as ``register_entries`` takes them) with registrations after each
    step. ``entries`` int64
    [capacity, 4 + bs] (``bs = multipliers.shape[0]``; the caller keeps that width), of
    which the first ``num_entries`` rows are read (the caller reuses one array across
    calls): per entry its step, row, position and block, then the block's ``bs`` token
    ids (one array: each argument costs a type check per call and each conversion a
    numpy call, and the decode path calls this once per step or ``advance_many`` call).
    After step ``t``'s blocks are taken, entries ``e`` of step ``t`` (steps ascending) are
    keyed and registered in order (``register_entries``: one step that takes none).
    Entry ``e`` keys its block, block ``position`` of its sequence, from ``entries[e,
    4:]`` as ``kvbench.hashing.chained_block_keys_into`` keys it, chained from
    its ``row`` of ``lanes`` (uint64 [rows, 2]: each sequence's last key, one row per
    sequence, never shared; updated as its entries are keyed, so a sequence's entries
    chain in order and each row ends at its last entry's key; rows no entry names are
    left as they are); each step's entries are then registered by one ``register_run``
    call, in order. Returns (how many of the blocks taken were cached, how many blocks were
    registered). Raises ValueError, changing nothing, when an output does not fit
    ``needs`` (``_check_step_buffers``) or ``num_entries`` lies outside ``[0,
    entries.shape[0]]``."""
    _check_step_buffers(needs, out, reused, reused_per_step)
    if not 0 <= num_entries <= entries.shape[0]:
        raise ValueError("allocate_steps_registering: num_entries out of the entries' rows")
    entry_keys = np.empty((2, num_entries), dtype=np.uint64)  # lanes 0 and 1 of each entry's key
    blocks = np.ascontiguousarray(entries[:num_entries, 3])
    table = (keys, vals, used, st, counts, block_hash, block_check)
    at = 0
    k = 0
    e = 0
    registered = 0
    for t in range(needs.shape[0]):
        n = _pop(st, counts, needs[t], out, at, reused, k)
        reused_per_step[t] = n
        at += needs[t]
        k += n
        stop = e
        while stop < num_entries and entries[stop, 0] == t:
            stop += 1
        if stop > e:
            registered += _key_and_register(table, multipliers, entries, e, stop, lanes, entry_keys, blocks)
            e = stop
    return k, registered


@njit(cache=True, nogil=True)
def register_entries(
    keys, vals, used, st, counts, block_hash, block_check, multipliers, entries, num_entries, lanes
):  # pragma: no cover - compiled
    """``allocate_steps_registering`` for one step that takes no blocks (a commit's decode
    registrations): the first ``num_entries`` rows of ``entries`` keyed and registered in
    order, whatever their step column says. Four arguments and the step buffers fewer:
    a commit of one or two blocks paid as much for those as for its work. Returns how
    many blocks were registered. Raises ValueError, changing nothing, when
    ``num_entries`` lies outside ``[0, entries.shape[0]]``."""
    if not 0 <= num_entries <= entries.shape[0]:
        raise ValueError("register_entries: num_entries out of the entries' rows")
    entry_keys = np.empty((2, num_entries), dtype=np.uint64)
    blocks = np.ascontiguousarray(entries[:num_entries, 3])
    table = (keys, vals, used, st, counts, block_hash, block_check)
    return _key_and_register(table, multipliers, entries, 0, num_entries, lanes, entry_keys, blocks)


@njit(cache=True, nogil=True)
def _key_and_register(
    table, multipliers, entries, first, stop, lanes, entry_keys, blocks
):  # pragma: no cover - compiled
    """Key entries ``first`` to ``stop - 1`` (one step's) in order into ``entry_keys``
    (uint64 [2, entries]), each chained from its row of ``lanes``, which then holds its
    key, then register their ``blocks`` by one ``register_run``. Keying reads only the
    tokens and lanes, never the table: a step's entries are keyed first, then registered
    in order. ``table``: ``register_run``'s first seven arrays (keys, vals, used, st,
    counts, block_hash, block_check). Returns how many blocks were registered."""
    keys, vals, used, st, counts, block_hash, block_check = table
    for e in range(first, stop):
        row = entries[e, 1]
        chained_block_keys_into(
            entries[e, 4:],
            multipliers,
            entries[e, 2],
            lanes[row],
            entry_keys[0, e : e + 1],
            entry_keys[1, e : e + 1],
        )
        lanes[row, 0] = entry_keys[0, e]
        lanes[row, 1] = entry_keys[1, e]
    return register_run(
        keys,
        vals,
        used,
        st,
        counts,
        block_hash,
        block_check,
        entry_keys[0],
        entry_keys[1],
        blocks[first:stop],
        first,
    )


@njit(cache=True, nogil=True)
def rebuild(keys, vals, used, st, block_hash):  # pragma: no cover - compiled
    """Drop every dead entry: the table then holds exactly the live blocks' keys."""
    vals[:] = EMPTY
    used[0] = 0
    for b in range(st.shape[1] - 1):
        if st[CACHED, b]:
            i = _slot(keys, vals, block_hash[b])
            keys[i] = block_hash[b]
            vals[i] = b
            used[0] += 1


@njit(cache=True, nogil=True)
def lookup(keys, vals, h):  # pragma: no cover - compiled
    """The block of key ``h``'s entry (live or dead), or -1."""
    return vals[_slot(keys, vals, h)]


# ---------------------------------------------------------------------- KV manager
@njit(cache=True, nogil=True)
def add_seq_refs(seq_refs, claimed, block_ids):  # pragma: no cover - compiled
    """One block-table reference more on each block. Returns (blocks that gained their
    first one, the claimed slots of those blocks)."""
    num_new = 0
    slots = 0
    for i in range(block_ids.shape[0]):
        b = block_ids[i]
        r = seq_refs[b]
        if r == 0:
            num_new += 1
            slots += claimed[b]
        seq_refs[b] = r + 1
    return num_new, slots


@njit(cache=True, nogil=True)
def drop_seq_refs(seq_refs, claimed, block_ids):  # pragma: no cover - compiled
    """One block-table reference less on each block (the caller holds them). Returns
    (blocks left with none, the claimed slots of those blocks)."""
    num_released = 0
    slots = 0
    for i in range(block_ids.shape[0]):
        b = block_ids[i]
        r = seq_refs[b] - 1
        seq_refs[b] = r
        if r == 0:
            num_released += 1
            slots += claimed[b]
    return num_released, slots


@njit(cache=True, nogil=True)
def must_copy(st, claimed, b, offset, num_held):  # pragma: no cover - compiled
    """Whether writing slot ``offset`` of block ``b`` (a valid id) needs a copy: the slot is
    already claimed (a fork sibling wrote ahead, or a stale claim) and another holder reads
    the block: a reference beyond the writer's own ``num_held`` (0 or 1), or a prefix-index
    registration (read by future hits without a reference; a fork sibling left alone
    with a block its parent filled and registered must not overwrite its tokens)."""
    return claimed[b] > offset and (st[REF, b] > num_held or st[CACHED, b] != 0)


@njit(cache=True, nogil=True)
def decodes_in_place(st, claimed, num_slots, last_blocks, block_size):  # pragma: no cover - compiled
    """Whether sequences holding ``num_slots`` slots (int64 [seqs]) with last blocks
    ``last_blocks`` may each write their next slot without a copy: a partial last block
    is written in place unless another sequence's partial last block is the same block
    (the second writer would copy it), or the slot is already claimed (a fork sibling
    or a stale claim) while another reference or a registration holds the block
    (``must_copy``). A full last block is followed by a fresh one."""
    partial = np.empty(num_slots.shape[0], dtype=np.int64)
    k = 0
    for i in range(num_slots.shape[0]):
        offset = num_slots[i] % block_size
        if offset:
            b = last_blocks[i]
            if must_copy(st, claimed, b, offset, 1):
                return False
            partial[k] = b
            k += 1
    order = np.sort(partial[:k])
    return not np.any(order[1:] == order[:-1])


@njit(cache=True, nogil=True)
def claim_fresh(seq_refs, claimed, block_ids, block_size, last_slots):  # pragma: no cover - compiled
    """Fresh blocks joining one table: each gets its first block-table reference and a
    full block's claimed slots, the last one ``last_slots``."""
    for i in range(block_ids.shape[0]):
        b = block_ids[i]
        claimed[b] = block_size
        seq_refs[b] = 1
    claimed[block_ids[block_ids.shape[0] - 1]] = last_slots


# ---------------------------------------------------------------------- decode runs
@njit(cache=True, nogil=True)
def decode_step(
    st, counts, claimed, seq_refs, residues, lasts, num_steps, block_size, scratch
):  # pragma: no cover - compiled
    """One step of a decode run (``PagedDecodeRun.advance``) over its rows: row ``i`` holds
    ``residues[i] + num_steps`` slots modulo ``block_size`` (int64 [rows]) and last block
    ``lasts[i]`` (int64 [rows], distinct among partial ones). A row whose next slot lies in
    its last block claims it in place (``claimed``: a sole holder overwrites stale claims).
    The others ("crossing") go in row order to ``scratch[0, :k]`` (``scratch`` int64
    [3, rows], the caller's); when the free list holds ``k`` blocks, each takes the next one
    from its head (``_pop``: ref count 1, cached flag cleared) into ``scratch[1, :k]`` and
    ``lasts``, with one claimed slot and its first block-table reference (``seq_refs``),
    the cached ones among them going to ``scratch[2]`` in order; else none is taken.
    Returns (the in-place claims' change in claimed slots: negative where a stale claim
    past the slot is overwritten, ``k``, cached blocks reused or -1 when fewer than ``k``
    were free and nothing was taken)."""
    num_rows = residues.shape[0]
    added = 0
    k = 0
    for i in range(num_rows):
        offset = (residues[i] + num_steps) % block_size
        if offset:
            b = lasts[i]
            added += offset + 1 - claimed[b]
            claimed[b] = offset + 1
        else:
            scratch[0, k] = i
            k += 1
    if k == 0:
        return added, 0, 0
    if counts[NUM_FREE] < k:
        return added, k, -1
    fresh = scratch[1]
    num_reused = _pop(st, counts, k, fresh, 0, scratch[2], 0)
    for j in range(k):
        b = fresh[j]
        claimed[b] = 1
        seq_refs[b] = 1
        lasts[scratch[0, j]] = b
    return added, k, num_reused


@njit(cache=True, nogil=True)
def decode_takers(first_need, num_steps, block_size):  # pragma: no cover - compiled
    """The rows of a decode run that take a fresh block in each of ``num_steps`` steps,
    in step order, then row order (the order the pool hands blocks out, step by step):
    row ``i`` takes one in steps ``first_need[i]``, ``first_need[i] + block_size``, ...
    (int64 [rows], each in ``[0, block_size)``). A counting sort by step. int64 [blocks]."""
    num_rows = first_need.shape[0]
    starts = np.zeros(num_steps + 1, dtype=np.int64)  # starts[t]: step t's first entry
    for i in range(num_rows):
        for t in range(first_need[i], num_steps, block_size):
            starts[t + 1] += 1
    for t in range(num_steps):
        starts[t + 1] += starts[t]
    out = np.empty(starts[num_steps], dtype=np.int64)
    for i in range(num_rows):  # rows ascending: row order within each step
        for t in range(first_need[i], num_steps, block_size):
            out[starts[t]] = i
            starts[t] += 1
    return out


@njit(cache=True, nogil=True)
def settle_decode_claims(
    claimed, seq_refs, offsets, lasts, takers, fresh, num_steps, block_size
):  # pragma: no cover - compiled
    """The claims ``num_steps`` decode steps leave (``PagedDecodeRun.advance_many``), per
    row: ``offsets`` its slots modulo ``block_size`` before them, ``lasts`` its last block
    before them, which becomes its last block after them: row ``takers[k]`` took block
    ``fresh[k]``, ``k`` in order (int64 each). A partial last block (offset > 0) claims
    ``min(offset + num_steps, block_size)`` slots, each fresh block all of them and its
    first sequence reference, and a row that took a block and ends mid-block ``(offset +
    num_steps) % block_size`` of its new last. Partial last blocks are distinct (a run's
    precondition). Returns what the first step's overwrite changes the claimed-slot
    count by: the sum of ``offset - claimed`` over partial rows (zero or negative: stale
    claims past a row's slots go). Mutates ``claimed``, ``seq_refs`` and ``lasts``."""
    stale = 0
    for i in range(offsets.shape[0]):
        offset = offsets[i]
        if offset:
            b = lasts[i]
            stale += offset - claimed[b]
            claimed[b] = min(offset + num_steps, block_size)
    for k in range(fresh.shape[0]):
        claimed[fresh[k]] = block_size
        seq_refs[fresh[k]] = 1
        lasts[takers[k]] = fresh[k]
    for i in range(offsets.shape[0]):
        offset = offsets[i]
        end = (offset + num_steps) % block_size
        if end and (offset == 0 or offset + num_steps > block_size):  # it took a block
            claimed[lasts[i]] = end
    return stale


@njit(cache=True, nogil=True)
def blocks_before_fit(
    st, match_blocks, num_tokens, max_new_tokens, block_size, num_allocatable, limit, position
):  # pragma: no cover - compiled
    """How many blocks, taken one by one from the free list's head (at most ``limit``),
    leave a waiting prompt unable to start after each (``PagedKVManager.admission_guard``):
    the paged manager's fit rule (``_match_fits``) for a block-aligned match, written out
    for every cut of it (tests/test_kv_manager.py checks it against ``can_allocate``).

    The prompt matches ``match_blocks`` (int64 [m], in order) and must have
    ``num_tokens`` computed; it starts with ``min(num_tokens - cached, max_new_tokens)``
    new tokens, which need that many slots' blocks on top of the matched blocks it
    revives (those with ref count 0), out of ``num_allocatable`` less the blocks taken.
    Taking a matched block cuts the match before it. Returns the blocks before the
    first one after which the prompt fits (0 when it fits now), else how many the walk
    took (fewer than ``limit`` when the free list is shorter). ``position`` int32
    [num_blocks]: all -1 on entry, left so (scratch for the blocks' match positions)."""
    m = match_blocks.shape[0]
    unreferenced = np.zeros(m + 1, dtype=np.int64)  # [j]: among the first j matched blocks
    for j in range(m):
        b = match_blocks[j]
        position[b] = j
        unreferenced[j + 1] = unreferenced[j] + (1 if st[REF, b] == 0 else 0)
    sentinel = st.shape[1] - 1
    cut = m  # matched blocks left
    taken = 0
    b = st[NEXT, sentinel]
    while True:
        # The prompt's first step after `taken` blocks went: does it fit?
        new = min(max(num_tokens - cut * block_size, 0), max_new_tokens)
        need = (new + block_size - 1) // block_size
        if need + unreferenced[cut] <= num_allocatable - taken:
            safe = max(taken - 1, 0)  # the block just taken was one too many (none now)
            break
        if taken == limit or b == sentinel:
            safe = taken
            break
        j = position[b]
        if 0 <= j < cut:
            cut = j
        taken += 1
        b = st[NEXT, b]
    for j in range(m):
        position[match_blocks[j]] = -1
    return safe
