"""The KV-manager contract: what the scheduler and the engine use of a KV manager.

Three managers implement it: ``PagedKVManager`` (``kv/paged.py``: block tables, prefix
sharing, copy-on-write, swap), ``BoundedKVManager`` (``kv/bounded.py``: block counts that
stop growing at an eviction budget) and ``SlabKVManager`` (``kv/slab.py``: one contiguous
region per sequence). The scheduler (``engines/sched``) talks to a manager only through
``KVManager``; the simulation fast path (``engines/sim``) additionally needs
``DecodeRunKV`` and its ``DecodeRun``, which the paged and slab managers offer.

Paired calls: a check call (``can_allocate``, ``can_append``, ``can_swap_out``,
``can_swap_in``) is pure and returns False when memory is short; the act call then
raises ``KVCapacityError``. Misuse (an unknown or duplicate sequence id, acting on a
swapped sequence) raises ``KeyError`` or ``ValueError`` naming the sequence. Act calls
return the tensor work they imply as ``KVOps``, which the executor applies, in order,
before the step's forward pass; the managers never touch tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvbench.types import KVUsage, Request

if TYPE_CHECKING:
    import numpy as np

    from kvbench.engines.sched.sequence import SequenceGroup


@dataclass(frozen=True, slots=True)
class AdmissionGuard:
    """A waiting prompt that cannot start in the step just planned, for a decode run to
    keep so while it takes several steps at once (``DecodeRunKV.admission_guard``,
    ``DecodeRun.num_quiet_steps``): its matched blocks now (``match_blocks``, int64
    [matched], in order; read only), the tokens its prefill must have computed
    (``num_tokens``: its length, less a last token held back) and the most it computes
    in its first step (``max_new_tokens``: the step's budget left after the run's
    decodes). It would start with ``min(uncached, max_new_tokens)`` tokens; an unchunked
    prefill starts with all of them or not at all, which only makes it start less
    often than the guard assumes."""

    match_blocks: np.ndarray
    num_tokens: int
    max_new_tokens: int


@dataclass(frozen=True)
class KVOps:
    """Tensor work the executor must do BEFORE this step's forward pass (block ids)."""

    copies: tuple[tuple[int, int], ...] = ()  # (src_block, dst_block): copy-on-write of a shared block
    swap_out: tuple[tuple[int, int], ...] = ()  # (device_block, host_block)
    swap_in: tuple[tuple[int, int], ...] = ()  # (host_block, device_block)

    @property
    def is_empty(self) -> bool:
        return not (self.copies or self.swap_out or self.swap_in)


NO_OPS = KVOps()


# ``KVManager.commit_interval`` of a manager whose commits register nothing (no prefix
# cache): no written length reaches a multiple of it, so the scheduler skips every
# one-token commit (a commit there would only check its count). 2^62, not 2^63: the
# scheduler takes int64 lengths modulo it (``-lengths % interval`` must fit int64).
COMMITS_REGISTER_NOTHING = 1 << 62


# One commit of a step (``KVManager.commit_many``): the sequence id, its token ids and
# how many of them, from the first, have their KV written (``commit`` of that prefix).
# The ids may run past the count: they are the sequence's own list, whose newest tokens
# lack KV, so a batched commit builds no view of them and takes no Python-level len() of
# them (a plain ``commit`` of an entry reads ``token_ids.prefix_of``).
StepCommit = tuple[int, Sequence[int], int]


class KVCapacityError(RuntimeError):
    """An act call (allocate, append, swap) whose check call (can_*) was False."""


class KVManager(Protocol):
    """The KV manager the scheduler drives (see the module docstring for the conventions).

    Counters the engine reports per step (cumulative, never decreasing):
    ``num_prefix_query_tokens`` and ``num_prefix_hit_tokens`` (prompt tokens looked up in
    the prefix cache and found there; both stay 0 for a manager without one) and
    ``num_evicted_blocks`` (prefix-cache blocks evicted to make room).
    """

    block_size: int
    num_blocks: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    # A ``commit`` after a one-token (decode) step registers something only when the
    # written length is a multiple of this; the scheduler skips the others (1: never skip;
    # COMMITS_REGISTER_NOTHING: skip every one).
    commit_interval: int

    @property
    def num_evicted_blocks(self) -> int: ...

    # ------------------------------------------------------------------ requests and queues
    def reject_reason(self, request: Request) -> str | None:
        """Why this manager can never hold ``request`` (e.g. its regions exceed the whole
        arena), or None. Pure; the scheduler rejects the request with the reason."""
        ...

    def waiting_entered(self, group: SequenceGroup) -> None:
        """The scheduler queued ``group`` as waiting (new, or back after a recompute
        preemption). Only a waiting group's sequences are ever ``allocate``d. Mutates the
        manager's view of the queue only."""
        ...

    def waiting_left(self, group: SequenceGroup) -> None:
        """``group`` left the waiting queue (admitted or rejected). Mutates the manager's
        view of the queue only."""
        ...

    # ------------------------------------------------------------------ queries (pure)
    def has_seq(self, seq_id: int) -> bool:
        """Whether the sequence holds KV (resident or swapped)."""
        ...

    def num_tokens(self, seq_id: int) -> int:
        """Token slots the sequence holds. KeyError for an unknown sequence."""
        ...

    def num_cached_tokens(self, token_ids: Sequence[int], extra_key: str | None) -> int:
        """Leading tokens of ``token_ids`` that ``allocate`` would attach from the prefix
        cache now (0 without one). Pure apart from the prefix index's match memo."""
        ...

    def block_table(self, seq_id: int) -> list[int]:
        """Physical device block ids in logical order (a copy). ValueError if swapped out."""
        ...

    def block_tables(self, seq_ids: Sequence[int]) -> list[list[int]]:
        """``block_table`` of each of ``seq_ids``, in order, each a new copy: a step's chunks
        read theirs in one call. KeyError for an unknown sequence, ValueError for a
        swapped-out one (the first such; nothing is returned). Pure."""
        ...

    def usage(self) -> KVUsage:
        """Device and host memory now. Pure."""
        ...

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant (call between steps)."""
        ...

    # ------------------------------------------------------------------ check / act pairs
    def can_allocate(
        self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int, extra_key: str | None
    ) -> bool:
        """Whether ``allocate`` would succeed now. Pure."""
        ...

    def allocate(
        self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int, extra_key: str | None
    ) -> tuple[int, KVOps]:
        """Start ``seq_id``: attach the cached prefix of ``token_ids`` and reserve
        ``num_new_tokens`` more slots. Returns (cached tokens attached, ops). Mutates the
        pool and the prefix cache; KVCapacityError when ``can_allocate`` is False."""
        ...

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        """Whether ``append`` would succeed now. Pure."""
        ...

    def append(self, seq_id: int, num_new_tokens: int) -> KVOps:
        """Reserve ``num_new_tokens`` more slots for ``seq_id`` (may copy a shared partial
        block). Mutates the pool; KVCapacityError when ``can_append`` is False."""
        ...

    def append_decodes(self, seq_ids: Sequence[int]) -> tuple[int, list[KVOps]]:
        """``append(seq_id, 1)`` for each of ``seq_ids`` in order (a step's decode tokens),
        stopping before the first that raises KVCapacityError, which is left unchanged:
        the caller makes room (``can_append``) and appends it itself. Returns how many were
        appended and the KV ops ``append`` returned for them that are not ``NO_OPS``, in
        order. Misuse (an unknown or swapped-out sequence) raises as ``append`` does, the
        sequences before it appended. Mutates what ``append`` mutates."""
        ...

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Register ``token_ids`` (every token whose KV is now written) with the prefix
        cache. Mutates the prefix cache only; ValueError for more tokens than slots."""
        ...

    def commit_many(self, entries: Sequence[StepCommit]) -> None:
        """``commit(seq_id, token_ids[:num_tokens])`` for each ``(seq_id, token_ids,
        num_tokens)`` in order, with the same effect (one step's commits together, so a
        manager may register them in one pass). Mutates what ``commit`` does; raises as
        ``commit`` would for the first bad entry (the entries before it may be committed):
        ValueError also for a negative count, and for a count past the ids wherever the
        manager reads ids the entry lacks."""
        ...

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Create ``child_seq_id`` holding the parent's KV (shared blocks, or queued copies
        handed out by the next act call). Mutates the pool."""
        ...

    def free(self, seq_id: int) -> None:
        """Drop every reference of ``seq_id`` (device and host). Mutates the pool."""
        ...

    def can_swap_out(self, seq_id: int) -> bool:
        """Whether ``swap_out`` would succeed (False without a host tier). Pure."""
        ...

    def swap_out(self, seq_id: int) -> KVOps:
        """Move the sequence's exclusive blocks to the host pool. KVCapacityError when
        ``can_swap_out`` is False."""
        ...

    def can_swap_in(self, seq_id: int) -> bool:
        """Whether ``swap_in`` would succeed now. Pure."""
        ...

    def swap_in(self, seq_id: int) -> KVOps:
        """Bring a swapped sequence back to the device. KVCapacityError when
        ``can_swap_in`` is False."""
        ...


class DecodeRun(Protocol):
    """The KV side of a simulated decode run: sequences that each grow by one slot per
    step, and nothing else touching them (``DecodeRunKV.decode_run`` builds one; using
    the sequences any other way voids it). Each step leaves exactly the state of
    ``append(seq_id, 1)`` for every sequence in order. Counts are ``DecodeRunKV.usage_counts``
    tuples."""

    def can_advance(self) -> bool:
        """Whether the next ``advance`` fits: the manager has every slot it needs without
        preempting anything (``can_append(seq_id, 1)`` for each sequence in order). Pure."""
        ...

    def advance(self) -> None:
        """Reserve the next slot of every sequence. Mutates the manager. Raises
        KVCapacityError, changing nothing, when ``can_advance`` is False."""
        ...

    def num_quiet_steps(self, guard: AdmissionGuard | None, max_steps: int) -> int:
        """How many of the next steps (at most ``max_steps``) ``advance_many`` may take at
        once, each leaving the waiting prompt ``guard`` (None: none) unable to start.
        Pure."""
        ...

    def advance_many(
        self, num_steps: int, commits: Sequence[Sequence[StepCommit]] = ()
    ) -> list[tuple[int, ...]]:
        """``advance`` ``num_steps`` times (at most ``num_quiet_steps``), making step ``t``'s
        commits (``commit_many`` entries, ``commits[t]``) right after its slots are
        reserved. Returns per step the manager's ``usage_counts`` after it followed by the
        cached blocks it reused (``(*counts, num_evicted)``). Mutates the manager; raises
        KVCapacityError, changing nothing, when the steps do not fit, and ValueError or
        KeyError, changing nothing, for an entry ``commit_many`` would refuse by its
        sequence or its count (checked at least against the slots after all the steps)."""
        ...

    def snapshot(self) -> tuple[Any, ...]:
        """The run's state as plain values: two runs over the same manager with equal
        snapshots take the same steps (a differential test's check that a carried run
        equals a fresh one). Pure."""
        ...


class DecodeRunKV(KVManager, Protocol):
    """What the simulation fast path (``engines/sim/fast_forward.py``) needs on top of
    ``KVManager``: taking many plain decode steps without planning each one."""

    def can_decode_together(self, seq_ids: Sequence[int]) -> bool:
        """Whether ``decode_run(seq_ids)`` may start. Pure."""
        ...

    def decode_run(self, seq_ids: Sequence[int]) -> DecodeRun:
        """Start growing ``seq_ids`` by one slot per step. ValueError when
        ``can_decode_together`` is False."""
        ...

    def try_decode_run(
        self, seq_ids: Sequence[int], previous: DecodeRun | None = None, rows: np.ndarray | None = None
    ) -> DecodeRun | None:
        """``decode_run(seq_ids)``, or None when ``can_decode_together`` is False (one pass
        over the sequences instead of two). ``previous`` (a run of this manager) and
        ``rows`` (int64 [seq]) let the next run of a batch start from where the last one
        ended: ``rows[i] >= 0`` says sequence ``i`` is that run's row ``rows[i]`` and has
        changed since only by that run's steps and the manager's commits between them
        (what the scheduler's ``DecodeBatch`` vouches for); the manager may take what it
        knew of those rows from ``previous`` instead of reading it, or read everything.
        The answer is the same either way. Mutates nothing."""
        ...

    def admission_guard(
        self,
        token_ids: Sequence[int],
        extra_key: str | None,
        seq_ids: Sequence[int],
        num_tokens: int,
        max_new_tokens: int,
    ) -> AdmissionGuard | None:
        """Call when a waiting prompt of ``token_ids`` (with ``extra_key``) cannot start
        (``can_allocate`` said no) next to a decode run of ``seq_ids``: the guard a run
        keeps it by (``AdmissionGuard``'s fields; ``num_tokens`` and ``max_new_tokens``
        as given). None when the run's registrations could lengthen its match, or the
        manager cannot tell: callers then check the prompt every step. Pure apart from
        the prefix index's match memo."""
        ...

    def usage_counts(self) -> tuple[int, ...]:
        """Counts now (a fixed number of them, the manager's choice) that determine every
        figure of ``usage`` that may differ between the steps of a decode run: the paged
        manager's are blocks in use, claimed token slots and free uncached blocks; the
        slab's reserved blocks, token slots, will-use slots and unusable free blocks. Pure."""
        ...

    def usage_of(self, *counts: int) -> KVUsage:
        """``usage`` as it was when ``usage_counts`` returned ``counts``. Pure."""
        ...

    def usage_columns(self, counts: Sequence[tuple[int, ...]]) -> dict[str, list[int]]:
        """The ``KVUsage`` fields these ``usage_counts`` determine, one value per entry
        (several steps at once), keyed ``kv.<field>``. Pure."""
        ...
