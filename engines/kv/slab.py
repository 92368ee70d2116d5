r"""The slab KV manager: the pre-PagedAttention baseline users migrate from.

Each sequence reserves, when it is admitted, one contiguous region of a flat arena of
blocks, sized for the longest it may ever grow: the model's maximum length
(``reserve=max_len``: FasterTransformer, Orca "Max") or its prompt + max_new_tokens
(``reserve=request``: Orca "Oracle" when max_new_tokens is the true output length).
Regions are placed first-fit (lowest address) or best-fit (smallest run that fits), so
holes between regions are real: a request waits until one contiguous run fits it.

Arena of 12 blocks, two live regions, a request needing 4 blocks waiting::

    block   0  1  2  3  4  5  6  7  8  9 10 11
           [  A (4 blocks) ][free ][ B (3)  ][free ]     free runs (4, 2), (9, 3)
                             \__ 2 __/         \_ 3 _/   both < 4: 5 blocks of external
                                                         fragmentation until A or B ends

The block table of a sequence is the leading part of its region (``start .. start +
ceil(num_tokens / block_size) - 1``), so slot = block * block_size + offset is just
``start * block_size + position``: the paged executor and attention kernels work on it
unchanged. There is no prefix cache (this is the pre-vLLM baseline) and no sharing:
each parallel sample or beam reserves its own region, and ``fork`` copies the parent's
written blocks into the child's region (``KVOps.copies``).

Waste, per live sequence with a region of R blocks (``KVUsage`` fields, in slots; bytes
are slots * bytes_per_token)::

    token_bytes            num_tokens (slots allocated so far, as the paged manager counts)
    reserved_unused_bytes  will_use - num_tokens: slots for tokens it will still produce,
                           will_use = max(num_tokens, prompt + max_new_tokens - 1)
                           (the last sampled token is never fed back, so never stored)
    internal_frag_bytes    R * block_size - will_use: reserved but never used (max_len
                           over-reservation, block rounding, the unstored last token)
    external_frag_bytes    free blocks in runs shorter than the smallest region any
                           waiting request needs: free memory no waiting request can use
                           (0 when nothing waits: free memory is then simply free)

Regions a request reserved for samples or beams not yet forked are counted like a
sequence with no tokens (reserved_unused = will_use, the rest internal).

The manager learns which request a sequence serves, and what waits, through the
KV-manager contract (``engines/kv/protocol.py``): the scheduler reports every group that
enters or leaves its waiting queue (``waiting_entered`` / ``waiting_left``), and only a
waiting group's sequences are ever allocated. It is tensor-free, so simulation mode runs
it as is.

Cost per engine step does not grow with the trace: ``usage`` reads running totals kept
by every allocate/append/fork/free, the smallest waiting region is the minimum of a
multiset updated as groups enter and leave the waiting queue, and external fragmentation is a Fenwick-tree query over free-run lengths. (Scanning
the waiting queue every step made long simulated traces quadratic: the queue grows with
the trace.) ``check`` recounts all of it from scratch.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbench.engines.kv.paged import SeqTable, check_sizes, usage_columns_of
from kvbench.engines.kv.protocol import (
    COMMITS_REGISTER_NOTHING,
    NO_OPS,
    AdmissionGuard,
    DecodeRun,
    KVCapacityError,
    KVOps,
    StepCommit,
)
from kvbench.engines.kv.token_ids import prefix_of
from kvbench.engines.sched.sequence import num_samples
from kvbench.types import KVUsage, Request

if TYPE_CHECKING:
    from kvbench.engines.sched.sequence import SequenceGroup

_NO_BLOCKS = np.zeros(0, dtype=np.int64)  # an admission guard's matched blocks: none cached
_NO_BLOCKS.flags.writeable = False


# --------------------------------------------------------------------------- policies
class MaxLenReservation:
    """Every sequence reserves the model's maximum length (static slab)."""

    name = "max_len"

    def __init__(self, max_model_len: int) -> None:
        if max_model_len <= 0:
            raise ValueError(f"MaxLenReservation.max_model_len: must be > 0, got {max_model_len}")
        self.max_model_len = max_model_len

    def num_tokens(self, request: Request) -> int:
        """Token slots one sequence of ``request`` reserves (never less than it can use)."""
        return max(self.max_model_len, request.num_prompt_tokens + request.max_new_tokens)


class RequestReservation:
    """Every sequence reserves its request's prompt + max_new_tokens (per-request slab)."""

    name = "request"

    def num_tokens(self, request: Request) -> int:
        """Token slots one sequence of ``request`` reserves."""
        return request.num_prompt_tokens + request.max_new_tokens


RESERVE_MODES = ("max_len", "request")


def make_reservation(reserve: str, max_model_len: int) -> MaxLenReservation | RequestReservation:
    """The reservation policy named ``reserve``; ValueError naming ``engine.reserve`` otherwise."""
    if reserve == "max_len":
        return MaxLenReservation(max_model_len)
    if reserve == "request":
        return RequestReservation()
    raise ValueError(f"engine.reserve: must be one of {RESERVE_MODES}, got {reserve!r}")


class FirstFit:
    """The lowest-addressed free run that is long enough. O(number of free runs)."""

    name = "first_fit"

    @staticmethod
    def choose(runs: FreeRuns, num_blocks: int) -> int | None:
        """Index (in address order) of the run to carve ``num_blocks`` from, or None."""
        return runs.lowest_fitting(num_blocks)


class BestFit:
    """The shortest free run that is long enough (ties: lowest address). O(log runs).

    Keeps long runs whole for long requests, at the price of leaving slivers."""

    name = "best_fit"

    @staticmethod
    def choose(runs: FreeRuns, num_blocks: int) -> int | None:
        return runs.shortest_fitting(num_blocks)


PLACEMENTS = {"first_fit": FirstFit, "best_fit": BestFit}


# --------------------------------------------------------------------------- free runs
class _LengthSums:
    """Fenwick tree over run lengths 1..max_length: blocks in runs of length <= n in O(log)."""

    __slots__ = ("_tree",)

    def __init__(self, max_length: int) -> None:
        self._tree = [0] * (max_length + 1)

    def add(self, length: int, num_blocks: int) -> None:
        tree = self._tree
        index = length
        while index < len(tree):
            tree[index] += num_blocks
            index += index & -index

    def up_to(self, length: int) -> int:
        """Blocks counted for every length <= ``length`` (clamped to the tree). Pure."""
        tree = self._tree
        index = min(length, len(tree) - 1)
        total = 0
        while index > 0:
            total += tree[index]
            index -= index & -index
        return total


class FreeRuns:
    """Free block runs of the arena, always coalesced, indexed by address and by length.

    ``starts[i]`` / ``lengths[i]`` describe run i in address order; adjacent runs never
    touch (a release merges with its neighbours). A size index (sorted ``(length,
    start)`` pairs) answers best fit and "do k regions fit" without a scan, and a Fenwick
    tree over lengths gives the free blocks in runs shorter than n (external
    fragmentation) in O(log num_blocks). ``take``/``release`` are O(log runs) plus list
    insertions (memmove). There are at most (reserved regions + 1) runs, so the
    address-order scans (first fit, ``num_fits``) are bounded by the live batch.
    """

    def __init__(self, num_blocks: int) -> None:
        self.starts: list[int] = []
        self.lengths: list[int] = []
        self.num_free_blocks = 0
        self._by_size: list[tuple[int, int]] = []  # (length, start), sorted
        self._length_sums = _LengthSums(num_blocks)
        if num_blocks:
            self._insert(0, 0, num_blocks)

    def num_fits(self, num_blocks: int) -> int:
        """How many regions of ``num_blocks`` could be carved now (each from a run's start)."""
        return sum(length // num_blocks for length in self.lengths)

    def fits(self, num_blocks: int, count: int) -> bool:
        """Whether ``num_fits(num_blocks) >= count``, from the longest runs down. Pure."""
        found = 0
        for length, _ in reversed(self._by_size):
            if found >= count or length < num_blocks:
                break
            found += length // num_blocks
        return found >= count

    def lowest_fitting(self, num_blocks: int) -> int | None:
        """Index of the lowest-addressed run of at least ``num_blocks``, or None. Pure."""
        if not self._by_size or self._by_size[-1][0] < num_blocks:
            return None
        return next(index for index, length in enumerate(self.lengths) if length >= num_blocks)

    def shortest_fitting(self, num_blocks: int) -> int | None:
        """Index of the shortest run of at least ``num_blocks`` (ties: lowest address), or None. Pure."""
        position = bisect.bisect_left(self._by_size, (num_blocks, -1))
        if position == len(self._by_size):
            return None
        return bisect.bisect_left(self.starts, self._by_size[position][1])

    def num_blocks_shorter_than(self, num_blocks: int) -> int:
        """Free blocks in runs shorter than ``num_blocks``. O(log num_blocks), pure."""
        return self._length_sums.up_to(num_blocks - 1)

    def take(self, index: int, num_blocks: int) -> int:
        """Carve ``num_blocks`` from the start of run ``index``; returns the region start."""
        start, length = self.starts[index], self.lengths[index]
        self._remove(index)
        if length > num_blocks:
            self._insert(index, start + num_blocks, length - num_blocks)
        return start

    def release(self, start: int, num_blocks: int) -> None:
        """Return ``[start, start + num_blocks)`` (must be reserved), merging with neighbours."""
        index = bisect.bisect_left(self.starts, start)
        length = num_blocks
        if index < len(self.starts) and start + num_blocks == self.starts[index]:
            length += self.lengths[index]
            self._remove(index)
        if index > 0 and self.starts[index - 1] + self.lengths[index - 1] == start:
            index -= 1
            start = self.starts[index]
            length += self.lengths[index]
            self._remove(index)
        self._insert(index, start, length)

    def check(self) -> None:
        """Raise AssertionError when the indexes disagree with the runs. O(runs log)."""
        assert self._by_size == sorted(zip(self.lengths, self.starts)), "size index differs from the runs"
        assert self.num_free_blocks == sum(self.lengths), (
            f"free blocks {self.num_free_blocks}, recount {sum(self.lengths)}"
        )
        for length in {1, *self.lengths, *(n + 1 for n in self.lengths)}:
            recount = sum(n for n in self.lengths if n < length)
            assert self.num_blocks_shorter_than(length) == recount, (
                f"blocks in runs shorter than {length}: {self.num_blocks_shorter_than(length)}, recount {recount}"
            )

    def _insert(self, index: int, start: int, length: int) -> None:
        self.starts.insert(index, start)
        self.lengths.insert(index, length)
        bisect.insort(self._by_size, (length, start))
        self._length_sums.add(length, length)
        self.num_free_blocks += length

    def _remove(self, index: int) -> None:
        start = self.starts.pop(index)
        length = self.lengths.pop(index)
        del self._by_size[bisect.bisect_left(self._by_size, (length, start))]
        self._length_sums.add(length, -length)
        self.num_free_blocks -= length


class _MinCounter:
    """A multiset of ints with its minimum: add/remove O(log n) amortised (lazy heap)."""

    __slots__ = ("counts", "_heap")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self._heap: list[int] = []  # every counted value, plus values whose count fell to 0

    def add(self, value: int) -> None:
        count = self.counts.get(value, 0)
        if not count:
            heapq.heappush(self._heap, value)
        self.counts[value] = count + 1

    def remove(self, value: int) -> None:
        count = self.counts[value] - 1
        if count:
            self.counts[value] = count
        else:
            del self.counts[value]

    def min(self) -> int | None:
        heap = self._heap
        while heap and heap[0] not in self.counts:
            heapq.heappop(heap)
        return heap[0] if heap else None


# --------------------------------------------------------------------------- records
class _Group:
    """Regions of one request: its live sequences' plus spares for samples/beams to come."""

    __slots__ = ("request_id", "region_num_blocks", "will_use", "spares", "num_live", "num_forks_left")

    def __init__(
        self, request_id: str, region_num_blocks: int, will_use: int, num_forks_left: int | None
    ) -> None:
        self.request_id = request_id
        self.region_num_blocks = region_num_blocks
        self.will_use = will_use  # slots one sequence writes by its end: prompt + max_new - 1
        self.spares: list[int] = []  # starts of reserved regions no sequence holds yet
        self.num_live = 0
        # Forks still to come: a spare region left when none can come goes back to the
        # arena at once. None: beams, which fork and drop sequences until the group ends.
        self.num_forks_left = num_forks_left


class _SlabSeq:
    __slots__ = ("group", "start", "num_tokens")

    def __init__(self, group: _Group, start: int, num_tokens: int) -> None:
        self.group = group
        self.start = start  # first block of the sequence's region
        self.num_tokens = num_tokens  # token slots allocated


# --------------------------------------------------------------------------- manager
class SlabKVManager(SeqTable):
    """Contiguous per-sequence regions over a flat arena; the ``PagedKVManager`` interface.

    Paired calls ``can_allocate``/``allocate`` and ``can_append``/``append``: a check call
    returns False when no contiguous run fits (or the region is full); the act call then
    raises ``KVCapacityError``. A new request's first ``allocate`` reserves one region
    per sample or beam (``num_samples`` regions); its later sequences (forks, beams
    re-admitted together) take those. ``fork`` copies the parent's written blocks; the
    copies are returned with the next ``KVOps`` any act call returns, which the
    scheduler applies before the next forward pass (the only thing that writes KV).
    Swap is not supported (no host tier): ``can_swap_out`` is False, so the scheduler
    recomputes instead. Misuse (unknown or duplicate seq id, an unbound manager) raises
    ``KeyError``/``ValueError``/``RuntimeError`` naming the seq id.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_token: int,
        reservation: MaxLenReservation | RequestReservation,
        placement: FirstFit | BestFit | None = None,
    ) -> None:
        check_sizes("SlabKVManager", num_blocks, block_size, bytes_per_token)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.commit_interval = COMMITS_REGISTER_NOTHING  # no prefix cache: decode commits are skipped
        self.bytes_per_token = bytes_per_token
        self.reservation = reservation
        self.placement = placement or FirstFit()
        self.free_runs = FreeRuns(num_blocks)
        # Groups in the scheduler's waiting queue (by id), as reported through the contract;
        # the only groups whose sequences ``allocate`` may start.
        self._waiting: dict[int, tuple[SequenceGroup, tuple[int, ...]]] = {}  # with its seq ids
        self._waiting_seqs: dict[int, SequenceGroup] = {}  # seq id -> its waiting group
        self._waiting_regions = _MinCounter()  # region blocks of every waiting group
        self._seqs: dict[int, _SlabSeq] = {}
        self._groups: dict[str, _Group] = {}
        self._num_reserved_blocks = 0
        # Running totals behind usage(): slots allocated over live sequences, and slots
        # they and the spare regions will hold by their end (module doc, will_use).
        self._num_token_slots = 0
        self._num_will_use_slots = 0
        # Fork copies not yet handed out, per child: (src_block, dst_block).
        self._pending_copies: dict[int, tuple[tuple[int, int], ...]] = {}
        # Counters the engine reads. A slab has no prefix cache: it never looks a prefix
        # up (so the prefix hit rate is "not measured", not 0 %) and never evicts.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_evicted_blocks = 0
        self.num_fork_copies = 0  # cumulative blocks copied for forks

    def waiting_entered(self, group: SequenceGroup) -> None:
        """The scheduler queued ``group`` (new, or back after a recompute preemption).
        Mutates the waiting summary; ValueError when it is already waiting."""
        if id(group) in self._waiting:
            raise ValueError(f"waiting_entered: request {group.request_id} is already waiting")
        seq_ids = tuple(seq.seq_id for seq in group.seqs)
        self._waiting[id(group)] = (group, seq_ids)
        for seq_id in seq_ids:
            self._waiting_seqs[seq_id] = group
        self._waiting_regions.add(self.region_num_blocks(group.request))

    def waiting_left(self, group: SequenceGroup) -> None:
        """``group`` left the waiting queue (admitted or rejected). Mutates the waiting
        summary; KeyError when it was not waiting."""
        entry = self._waiting.pop(id(group), None)
        if entry is None:
            raise KeyError(f"waiting_left: request {group.request_id} is not waiting")
        for seq_id in entry[1]:
            del self._waiting_seqs[seq_id]
        self._waiting_regions.remove(self.region_num_blocks(group.request))

    # ------------------------------------------------------------------ sizes
    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def region_num_blocks(self, request: Request) -> int:
        """Blocks of one region (one sequence) of ``request``."""
        return -(-self.reservation.num_tokens(request) // self.block_size)

    def num_blocks_needed(self, request: Request) -> int:
        """Blocks ``request`` reserves when admitted: one region per sample or beam."""
        return num_samples(request) * self.region_num_blocks(request)

    def reject_reason(self, request: Request) -> str | None:
        """Why the arena can never hold ``request`` (its regions exceed it), else None.
        The scheduler's static check calls it (the KV-manager contract). Pure."""
        if self.num_blocks_needed(request) <= self.num_blocks:
            return None
        num_regions = num_samples(request)
        return (
            f"slab reservation of {num_regions} x {self.region_num_blocks(request)} blocks "
            f"({self.reservation.name}) exceeds the arena of {self.num_blocks} blocks"
        )

    # ------------------------------------------------------------------ queries
    def is_swapped(self, seq_id: int) -> bool:
        self._seq(seq_id)
        return False

    def num_tokens(self, seq_id: int) -> int:
        """Token slots (positions) allocated for the sequence."""
        return self._seq(seq_id).num_tokens

    def block_table(self, seq_id: int) -> list[int]:
        """The blocks covering the sequence's slots: a contiguous run from its region start."""
        seq = self._seq(seq_id)
        return list(range(seq.start, seq.start + -(-seq.num_tokens // self.block_size)))

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Physical slot ``region_start * block_size + position`` for positions ``[start, end)``."""
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(
                f"slot_mapping: seq {seq_id} range [{start}, {end}) outside its {seq.num_tokens} slots"
            )
        base = seq.start * self.block_size
        return list(range(base + start, base + end))

    def num_cached_tokens(self, token_ids: Sequence[int], extra_key: str | None) -> int:
        """Always 0: the slab baseline has no prefix cache. Pure."""
        return 0

    def region_of(self, seq_id: int) -> tuple[int, int]:
        """(first block, number of blocks) of the sequence's reserved region."""
        seq = self._seq(seq_id)
        return seq.start, seq.group.region_num_blocks

    # ------------------------------------------------------------------ allocate / append
    def can_allocate(
        self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int, extra_key: str | None
    ) -> bool:
        """Whether ``allocate`` would succeed now: a reserved spare region, or room to place
        every region the request reserves. Mutates nothing."""
        self._check_new(seq_id, num_new_tokens, "can_allocate")
        group = self._group_of(seq_id)
        record = self._groups.get(group.request_id)
        if record is not None and record.spares:
            return num_new_tokens <= record.region_num_blocks * self.block_size
        region = self.region_num_blocks(group.request)
        if num_new_tokens > region * self.block_size:
            return False
        return self.free_runs.fits(region, self._num_regions_to_reserve(group, record))

    def allocate(
        self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int, extra_key: str | None
    ) -> tuple[int, KVOps]:
        """Start ``seq_id`` with ``num_new_tokens`` slots in a region of its own.

        The request's first sequence reserves all its regions (placement policy, one at a
        time); later ones take a spare. Returns (0 cached tokens, pending fork copies).
        Mutates the free runs and the group records. Raises KVCapacityError when
        ``can_allocate`` is False.
        """
        if not self.can_allocate(seq_id, token_ids, num_new_tokens, extra_key):
            raise KVCapacityError(f"allocate: seq {seq_id} does not fit in any free run of the slab arena")
        group = self._group_of(seq_id)
        record = self._groups.get(group.request_id)
        if record is None or not record.spares:
            num_regions = self._num_regions_to_reserve(group, record)
            if record is None:
                request = group.request
                record = _Group(
                    group.request_id,
                    self.region_num_blocks(request),
                    request.num_prompt_tokens + request.max_new_tokens - 1,
                    self._num_forks_to_come(group, num_regions),
                )
                self._groups[group.request_id] = record
            for _ in range(num_regions):
                self._add_spare(record, self._place(record.region_num_blocks))
        seq = _SlabSeq(record, self._take_spare(record), num_new_tokens)
        record.num_live += 1
        self._seqs[seq_id] = seq
        self._count_slots(seq, 1)
        return 0, self._flush()

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        """Whether the sequence's region has room for ``num_new_tokens`` more slots."""
        seq = self._seq(seq_id)
        return seq.num_tokens + num_new_tokens <= seq.group.region_num_blocks * self.block_size

    def append(self, seq_id: int, num_new_tokens: int) -> KVOps:
        """Grow ``seq_id`` by ``num_new_tokens`` slots inside its region (never moves it).

        Returns pending fork copies. Mutates the slot count. Raises KVCapacityError when
        ``can_append`` is False, ValueError for a negative count."""
        if num_new_tokens < 0:
            raise ValueError(f"append: seq {seq_id} num_new_tokens must be >= 0, got {num_new_tokens}")
        if not self.can_append(seq_id, num_new_tokens):
            seq = self._seqs[seq_id]
            raise KVCapacityError(
                f"append: seq {seq_id} would hold {seq.num_tokens + num_new_tokens} slots, "
                f"its region has {seq.group.region_num_blocks * self.block_size}"
            )
        seq = self._seqs[seq_id]
        num_tokens = seq.num_tokens + num_new_tokens
        will_use = seq.group.will_use  # _count_slots inlined: one call per decoded token
        self._num_token_slots += num_new_tokens
        self._num_will_use_slots += max(num_tokens, will_use) - max(seq.num_tokens, will_use)
        seq.num_tokens = num_tokens
        return self._flush()

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Nothing to register (no prefix cache); ValueError when more tokens than slots."""
        seq = self._seq(seq_id)
        if len(token_ids) > seq.num_tokens:
            raise ValueError(
                f"commit: seq {seq_id} commits {len(token_ids)} tokens but has {seq.num_tokens} slots"
            )

    def commit_many(self, entries: Sequence[StepCommit]) -> None:
        """``commit`` each entry's prefix: nothing to register, so each only checks its count."""
        for seq_id, token_ids, num_tokens in entries:
            self.commit(seq_id, prefix_of(token_ids, num_tokens))

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Give ``child_seq_id`` a spare region of the parent's request and queue copies of
        the parent's written blocks into it (handed out by the next act call).

        The parent's blocks stay intact until then even if it is freed first (an EOS
        sample): only a forward pass rewrites them, and every forward follows an act
        call. Mutates the group's spares and the pending copies. Raises KVCapacityError
        when the request has no spare region (more samples than it reserved)."""
        parent = self._seq(parent_seq_id)
        if child_seq_id in self._seqs:
            raise ValueError(f"fork: seq {child_seq_id} already exists")
        group = parent.group
        if not group.spares:
            raise KVCapacityError(
                f"fork: request {group.request_id} has no reserved region left for seq {child_seq_id}"
            )
        start = self._take_spare(group)
        if group.num_forks_left is not None:
            group.num_forks_left -= 1
        group.num_live += 1
        child = self._seqs[child_seq_id] = _SlabSeq(group, start, parent.num_tokens)
        self._count_slots(child, 1)
        num_written = -(-parent.num_tokens // self.block_size)
        self._pending_copies[child_seq_id] = tuple((parent.start + i, start + i) for i in range(num_written))

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id``. Its region goes back to the arena, or stays reserved as a spare
        while the request may still fork (beams, samples not forked yet); the request's
        spares go back when its last sequence goes. Mutates the free runs and records."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        self._count_slots(seq, -1)
        self._pending_copies.pop(seq_id, None)
        group = seq.group
        group.num_live -= 1
        if group.num_forks_left == 0:
            self._release(seq.start, group.region_num_blocks)
        else:
            self._add_spare(group, seq.start)
        if group.num_live == 0:
            while group.spares:
                self._release(self._take_spare(group), group.region_num_blocks)
            del self._groups[group.request_id]

    # ------------------------------------------------------------------ swap (none)
    def can_swap_out(self, seq_id: int) -> bool:
        """Always False: the slab has no host tier (the scheduler then recomputes)."""
        self._seq(seq_id)
        return False

    def swap_out(self, seq_id: int) -> KVOps:
        raise KVCapacityError(f"swap_out: seq {seq_id}: the slab manager has no host tier")

    def can_swap_in(self, seq_id: int) -> bool:
        raise ValueError(f"can_swap_in: seq {seq_id} is not swapped out (the slab never swaps)")

    def swap_in(self, seq_id: int) -> KVOps:
        raise ValueError(f"swap_in: seq {seq_id} is not swapped out (the slab never swaps)")

    # ------------------------------------------------------------------ decode runs (simulation)
    def can_decode_together(self, seq_ids: Sequence[int]) -> bool:
        """Whether ``decode_run(seq_ids)`` may start: no fork copy is pending (an
        ``append`` would hand it out). KeyError for an unknown sequence. Pure."""
        return self.try_decode_run(seq_ids) is not None

    def try_decode_run(
        self, seq_ids: Sequence[int], previous: DecodeRun | None = None, rows: np.ndarray | None = None
    ) -> SlabDecodeRun | None:
        """``decode_run(seq_ids)``, or None when ``can_decode_together`` is False. Reads
        every sequence: ``previous`` and ``rows`` (``DecodeRunKV.try_decode_run``) are not
        used (a slab run's state is the regions' room, read in one pass). Mutates nothing."""
        seqs = [self._seq(seq_id) for seq_id in seq_ids]
        if self._pending_copies:
            return None
        return SlabDecodeRun(self, seqs)

    def decode_run(self, seq_ids: Sequence[int]) -> SlabDecodeRun:
        """Start growing ``seq_ids`` by one slot per step inside their regions (see
        ``SlabDecodeRun``). Mutates nothing yet. ValueError when ``can_decode_together``
        is False."""
        run = self.try_decode_run(seq_ids)
        if run is None:
            raise ValueError(f"decode_run: seqs {list(seq_ids)} cannot decode together (fork copies pending)")
        return run

    def admission_guard(
        self,
        token_ids: Sequence[int],
        extra_key: str | None,
        seq_ids: Sequence[int],
        num_tokens: int,
        max_new_tokens: int,
    ) -> AdmissionGuard:
        """See ``DecodeRunKV.admission_guard``: no matched block (nothing is ever cached),
        and no step of a decode run takes a region, so the prompt's answer stays. Pure."""
        return AdmissionGuard(_NO_BLOCKS, num_tokens, max_new_tokens)

    # ------------------------------------------------------------------ usage / check
    def usage(self) -> KVUsage:
        """Memory now, split into token state and the three kinds of waste (module doc).

        O(log num_blocks): running totals and the waiting-region multiset. Mutates nothing."""
        return self.usage_of(*self.usage_counts())

    def usage_counts(self) -> tuple[int, ...]:
        """(reserved blocks, token slots, will-use slots, unusable free blocks) now: what
        ``usage`` derives its variable figures from (module doc). O(log num_blocks), pure."""
        return (
            self._num_reserved_blocks,
            self._num_token_slots,
            self._num_will_use_slots,
            self.num_unusable_free_blocks(),
        )

    def usage_of(self, *counts: int) -> KVUsage:
        """KVUsage for these ``usage_counts``. Pure."""
        return KVUsage(
            capacity_bytes=self.num_blocks * self.bytes_per_block,
            num_blocks_total=self.num_blocks,
            **self._count_fields(*counts),
        )

    def usage_columns(self, counts: Sequence[tuple[int, ...]]) -> dict[str, list[int]]:
        """The KVUsage fields that ``usage_counts`` determine, one value per entry of
        ``counts`` (several steps at once), keyed ``kv.<field>``. Pure."""
        return usage_columns_of(self._count_fields, counts)

    def _count_fields(self, reserved: Any, token_slots: Any, will_use: Any, unusable: Any) -> dict[str, Any]:
        """KVUsage's count-dependent fields: ints, or int64 arrays (one per step). Pure."""
        bpt = self.bytes_per_token
        allocated = reserved * self.bytes_per_block
        token_bytes = token_slots * bpt
        reserved_unused = (will_use - token_slots) * bpt
        return {
            "allocated_bytes": allocated,
            "token_bytes": token_bytes,
            "reserved_unused_bytes": reserved_unused,
            "internal_frag_bytes": allocated - token_bytes - reserved_unused,
            "external_frag_bytes": unusable * self.bytes_per_block,
            "num_blocks_in_use": reserved,
            "num_blocks_free": self.num_blocks - reserved,
        }

    def smallest_waiting_region(self) -> int | None:
        """Blocks of the smallest region any waiting request needs; None when none waits.
        O(1) amortised. Pure."""
        return self._waiting_regions.min()

    def num_unusable_free_blocks(self) -> int:
        """Free blocks in runs too short for every waiting request (external fragmentation)."""
        need = self.smallest_waiting_region()
        if need is None:
            return 0
        return self.free_runs.num_blocks_shorter_than(need)

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant. O(blocks)."""
        n = self.num_blocks
        owner: list[str | None] = [None] * n

        def claim(start: int, length: int, who: str) -> None:
            assert length > 0 and start >= 0 and start + length <= n, (
                f"{who}: [{start}, {start + length}) outside arena"
            )
            for b in range(start, start + length):
                assert owner[b] is None, f"block {b}: held by {owner[b]} and {who}"
                owner[b] = who

        runs = self.free_runs
        for i, (start, length) in enumerate(zip(runs.starts, runs.lengths)):
            if i:
                prev_end = runs.starts[i - 1] + runs.lengths[i - 1]
                assert prev_end < start, f"free runs {i - 1} and {i} overlap or touch (not coalesced)"
            claim(start, length, f"free run {i}")
        num_live: dict[str, int] = {}
        for seq_id, seq in self._seqs.items():
            group = seq.group
            assert self._groups.get(group.request_id) is group, f"seq {seq_id}: request record missing"
            slots = group.region_num_blocks * self.block_size
            assert 0 <= seq.num_tokens <= slots, (
                f"seq {seq_id}: {seq.num_tokens} slots in a region of {slots}"
            )
            claim(seq.start, group.region_num_blocks, f"seq {seq_id}")
            num_live[group.request_id] = num_live.get(group.request_id, 0) + 1
        reserved = 0
        for request_id, group in self._groups.items():
            assert group.num_live == num_live.get(request_id, 0) > 0, (
                f"request {request_id}: num_live={group.num_live}, live seqs {num_live.get(request_id, 0)}"
            )
            for start in group.spares:
                claim(start, group.region_num_blocks, f"spare of {request_id}")
            reserved += (group.num_live + len(group.spares)) * group.region_num_blocks
        assert reserved == self._num_reserved_blocks, (
            f"reserved blocks {self._num_reserved_blocks}, recount {reserved}"
        )
        assert reserved + runs.num_free_blocks == n, (
            f"reserved {reserved} + free {runs.num_free_blocks} != {n}"
        )
        assert all(b is not None for b in owner), "a block is neither free nor reserved"
        runs.check()
        token_slots = sum(seq.num_tokens for seq in self._seqs.values())
        will_use_slots = sum(max(seq.num_tokens, seq.group.will_use) for seq in self._seqs.values())
        will_use_slots += sum(len(group.spares) * group.will_use for group in self._groups.values())
        assert (self._num_token_slots, self._num_will_use_slots) == (token_slots, will_use_slots), (
            f"(token, will-use) slots ({self._num_token_slots}, {self._num_will_use_slots}), "
            f"recount ({token_slots}, {will_use_slots})"
        )
        regions: dict[int, int] = {}
        for group, _ in self._waiting.values():
            region = self.region_num_blocks(group.request)
            regions[region] = regions.get(region, 0) + 1
        assert self._waiting_regions.counts == regions, (
            f"waiting regions {self._waiting_regions.counts}, recount {regions}"
        )
        assert self._waiting_regions.min() == min(regions, default=None)
        waiting_seqs = {seq_id for _, seq_ids in self._waiting.values() for seq_id in seq_ids}
        assert waiting_seqs == set(self._waiting_seqs), "waiting sequences out of date"
        destinations = set()
        for child, copies in self._pending_copies.items():
            assert child in self._seqs, f"pending copies for dead seq {child}"
            start, length = self._seqs[child].start, self._seqs[child].group.region_num_blocks
            for _, dst in copies:
                assert start <= dst < start + length, f"seq {child}: copy into block {dst} outside its region"
                destinations.add(dst)
        for copies in self._pending_copies.values():
            for src, _ in copies:
                assert src not in destinations, f"block {src} is both a pending copy source and destination"

    # ------------------------------------------------------------------ internals
    def _num_regions_to_reserve(self, group: SequenceGroup, record: _Group | None) -> int:
        if record is not None:
            return 1  # more sequences than the request reserved for: one more region
        if group.is_beam or not group.has_forked:
            return group.num_samples
        return len(group.seqs)  # samples re-admitted after a recompute preemption

    @staticmethod
    def _num_forks_to_come(group: SequenceGroup, num_regions: int) -> int | None:
        if group.is_beam:
            return None  # beams fork and drop sequences until the request ends
        return 0 if group.has_forked else num_regions - 1

    def _place(self, num_blocks: int) -> int:
        index = self.placement.choose(self.free_runs, num_blocks)
        assert index is not None, "placement found no run although can_allocate said one fits"
        self._num_reserved_blocks += num_blocks
        return self.free_runs.take(index, num_blocks)

    def _release(self, start: int, num_blocks: int) -> None:
        self.free_runs.release(start, num_blocks)
        self._num_reserved_blocks -= num_blocks

    def _count_slots(self, seq: _SlabSeq, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) ``seq``'s slots in the usage totals."""
        self._num_token_slots += sign * seq.num_tokens
        self._num_will_use_slots += sign * max(seq.num_tokens, seq.group.will_use)

    def _add_spare(self, group: _Group, start: int) -> None:
        group.spares.append(start)
        self._num_will_use_slots += group.will_use

    def _take_spare(self, group: _Group) -> int:
        """The group's first spare region (its start), no longer counted as a spare."""
        self._num_will_use_slots -= group.will_use
        return group.spares.pop(0)

    def _flush(self) -> KVOps:
        """Hand out queued fork copies (one KVOps: sources and destinations are disjoint)."""
        if not self._pending_copies:
            return NO_OPS
        copies = tuple(pair for pairs in self._pending_copies.values() for pair in pairs)
        self._pending_copies.clear()
        self.num_fork_copies += len(copies)
        return KVOps(copies=copies)

    def _group_of(self, seq_id: int) -> SequenceGroup:
        """The waiting group of a sequence being allocated; KeyError naming it otherwise."""
        try:
            return self._waiting_seqs[seq_id]
        except KeyError:
            raise KeyError(
                f"SlabKVManager: seq {seq_id} is not in a waiting group (the scheduler reports "
                "waiting groups through waiting_entered before allocating them)"
            ) from None


class SlabDecodeRun:
    """Sequences that each grow by one slot per step inside their reserved regions: a
    simulated decode run's KV side over the slab (``SlabKVManager.decode_run``).

    A slab step takes no block (regions are reserved at admission), so a step fits while
    every region has a free slot, and the steps change only the slot totals: token slots
    grow by one per sequence, will-use slots by one per sequence already past its
    ``will_use``. ``advance`` leaves exactly the state of ``append(seq, 1)`` for each
    sequence in order; using these sequences any other way (append, free, fork) while the
    run is in use voids it.
    """

    __slots__ = ("_kv", "_seqs", "_num_steps_left", "_past_will_use")

    def __init__(self, kv: SlabKVManager, seqs: list[_SlabSeq]) -> None:
        self._kv = kv
        self._seqs = seqs
        bs = kv.block_size
        # Steps until the first region is full (the run cannot take that one).
        self._num_steps_left = min(
            [seq.group.region_num_blocks * bs - seq.num_tokens for seq in seqs], default=0
        )
        # Slots each sequence holds beyond the slots it will use (negative: not yet there).
        self._past_will_use = np.array([seq.num_tokens - seq.group.will_use for seq in seqs], dtype=np.int64)

    def can_advance(self) -> bool:
        """Whether every region has room for one more slot. Pure."""
        return self._num_steps_left > 0

    def snapshot(self) -> tuple[Any, ...]:
        """The run's state as plain values (the manager's sequence records by identity,
        steps until a region is full, slots past each will-use). Pure."""
        return tuple(map(id, self._seqs)), self._num_steps_left, tuple(self._past_will_use.tolist())

    def advance(self) -> None:
        """Reserve the next slot of every sequence. Mutates the slot counts and totals.
        Raises KVCapacityError, changing nothing, when ``can_advance`` is False."""
        if not self.can_advance():
            raise KVCapacityError("decode run: a region is full (check can_advance)")
        for seq in self._seqs:
            seq.num_tokens += 1
        # A sequence at or past its will-use counts its new slot there too (see append).
        self._took(1, int(np.count_nonzero(self._past_will_use >= 0)))

    def num_quiet_steps(self, guard: AdmissionGuard | None, max_steps: int) -> int:
        """How many of the next steps (at most ``max_steps``) ``advance_many`` may take at
        once: until the first region is full. ``guard`` plays no part (a slab step takes
        no region: a prompt that cannot start now cannot in the run). Pure."""
        return max(0, min(max_steps, self._num_steps_left))

    def advance_many(
        self, num_steps: int, commits: Sequence[Sequence[StepCommit]] = ()
    ) -> list[tuple[int, ...]]:
        """``advance`` ``num_steps`` times, checking step ``t``'s commits (``commits[t]``)
        once its slots are reserved (slab commits register nothing). Returns, per step,
        the manager's ``usage_counts`` after it and 0 evictions. Mutates the slot counts and
        totals; raises KVCapacityError when a region would overflow and ValueError from a
        commit of more tokens than slots, both changing nothing."""
        if num_steps > self._num_steps_left:
            raise KVCapacityError(
                f"decode run: {num_steps} steps, the fullest region has room for {self._num_steps_left}"
            )
        kv = self._kv
        num_seqs = len(self._seqs)
        reserved, token_slots, will_use, unusable = kv.usage_counts()
        past = self._past_will_use
        if past.size and int(past.max()) + num_steps > 0:
            # Some sequence passes its will_use in these steps: its slots beyond it count.
            after = past[:, None] + np.arange(1, num_steps + 1, dtype=np.int64)  # [seq, step]
            extra = (np.maximum(after, 0) - np.maximum(past, 0)[:, None]).sum(axis=0).tolist()
        else:
            extra = [0] * num_steps
        counts = [
            (reserved, token_slots + (t + 1) * num_seqs, will_use + extra[t], unusable, 0)
            for t in range(num_steps)
        ]
        seqs = self._seqs
        if any(commits):
            # Step by step: each commit is checked against its step's slot counts.
            num_taken = 0
            try:
                for t in range(num_steps):
                    for seq in seqs:
                        seq.num_tokens += 1
                    num_taken += 1
                    if t < len(commits) and commits[t]:
                        kv.commit_many(commits[t])
            except BaseException:
                for seq in seqs:
                    seq.num_tokens -= num_taken
                raise
        else:
            for seq in seqs:
                seq.num_tokens += num_steps
        self._took(num_steps, extra[-1] if num_steps else 0)
        return counts

    def _took(self, num_steps: int, num_will_use_slots: int) -> None:
        """Settle the manager's totals and the run's state once the sequences' slot counts
        grew by ``num_steps`` (``num_will_use_slots`` of the new slots past will-use)."""
        kv = self._kv
        kv._num_token_slots += num_steps * len(self._seqs)
        kv._num_will_use_slots += num_will_use_slots
        self._past_will_use = self._past_will_use + num_steps
        self._num_steps_left -= num_steps
