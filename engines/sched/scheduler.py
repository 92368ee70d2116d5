"""Continuous-batching scheduler of the paged engine (tensor-free).

Each ``schedule()`` call plans one engine iteration under two budgets, a token budget
(``max_num_batched_tokens``) and a sequence budget (``max_num_seqs``), and reserves KV
slots for it through the KV manager. The order follows vLLM v1 (running first) with
vLLM v0's swap tier:

1. Running groups, most important first: each gets its next prefill chunk or one
   decode token per sequence. When the pool cannot grow a group, the least important
   running group (the end of ``running``) is preempted; if that is the group itself,
   it preempts itself and the pass ends.
2. Swapped groups come back (swap-in) when nothing was preempted this step; they run
   from the next step on.
3. Waiting groups are admitted first-come-first-served (or by priority) when nothing
   was preempted and nothing is swapped, as long as their first chunk fits.

Preemption by *recompute* frees the group's blocks (hashed blocks stay in the prefix
cache, so it may hit its own prefix when it returns) and puts it back in the waiting
queue; by *swap* it moves the blocks to the host pool (falling back to recompute when
the host pool is full). ``victim_policy`` orders both queues: ``newest`` (arrival order,
the newest is preempted first) or ``priority`` (``Request.priority``, lower is more
important, then arrival).

Beam search runs its beams in lockstep: a beam group only decodes when every beam has
exactly one token left to compute, so that the engine can rank all candidates at once.
After a recompute preemption each beam re-prefills up to (not including) its last
token, and the beams then decode together.

The scheduler never touches tensors: the KV work it implies is returned as ``KVOps``
(copies and swaps, in issue order) and the computation as ``ScheduledChunk`` entries,
so the same code drives a real executor or a cost model.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvbench.engines.kv.protocol import NO_OPS, StepCommit
from kvbench.engines.kv.token_ids import TokenPrefix, TokenSpan, prefix_of
from kvbench.engines.sched.sequence import GroupStatus, Sequence, SequenceGroup, num_samples
from kvbench.records import frozen_record
from kvbench.sim.cost_model import StepShape
from kvbench.types import FinishedRequest, RejectedRequest, Request

if TYPE_CHECKING:
    from kvbench.engines.kv.protocol import DecodeRun, KVManager, KVOps

PREEMPTION_MODES = ("recompute", "swap")
# When a prefill chunk's KV becomes visible to prefix matches: once the step that writes it
# completes (``complete_step``), or as soon as the chunk is scheduled, as vLLM does
# (``KVCacheManager.allocate_slots`` -> ``cache_blocks``): a group admitted later in the same
# pass then hits blocks still being computed. Exact in real mode too: the executor writes
# every chunk's K/V of a layer before any attention of that layer reads the cache.
REGISTER_BLOCKS = ("on_completion", "on_schedule")


# --------------------------------------------------------------------------- policies
class NewestVictimPolicy:
    """Serve in arrival order; preempt the most recently arrived group first (vLLM's default)."""

    name = "newest"

    @staticmethod
    def key(group: SequenceGroup) -> tuple[int, ...]:
        return (group.arrival_index,)


class PriorityVictimPolicy:
    """Serve by ``Request.priority`` (lower first), then arrival; preempt the least important."""

    name = "priority"

    @staticmethod
    def key(group: SequenceGroup) -> tuple[int, ...]:
        return (group.request.priority, group.arrival_index)


VICTIM_POLICIES: dict[str, Callable[[], Any]] = {
    "newest": NewestVictimPolicy,
    "priority": PriorityVictimPolicy,
}

_SEQS_OF = operator.attrgetter("seqs")  # a group's sequences, read in C


# --------------------------------------------------------------------------- records
@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler, checked on construction (ValueError naming the offending
    ``engine.*`` parameter). The defaults are the engines' (``engines/config.DEFAULTS``)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    chunked_prefill: bool = True
    preemption: str = "recompute"
    victim_policy: str = "newest"
    max_model_len: int = 2048
    register_blocks: str = "on_completion"  # one of REGISTER_BLOCKS

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"engine.max_num_seqs: must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"engine.max_num_batched_tokens: must be > 0, got {self.max_num_batched_tokens}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"engine.preemption: must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.victim_policy not in VICTIM_POLICIES:
            raise ValueError(
                f"engine.victim_policy: must be one of {tuple(VICTIM_POLICIES)}, got {self.victim_policy!r}"
            )
        if self.max_model_len <= 0:
            raise ValueError(f"engine.max_model_len: must be > 0, got {self.max_model_len}")
        if self.register_blocks not in REGISTER_BLOCKS:
            raise ValueError(
                f"engine.register_blocks: must be one of {REGISTER_BLOCKS}, got {self.register_blocks!r}"
            )


class ScheduledChunk(NamedTuple):
    """Tokens of one sequence to compute this step.

    ``token_ids`` sit at positions ``[start_pos, start_pos + len(token_ids))``; their K/V
    go to the slots given by ``block_table`` (physical block ids in logical order, valid
    after this step's ``kv_ops``; a copy owned by the chunk). With
    ``Scheduler(chunk_contents=False)`` (an executor that reads neither) the ids are a
    read-only view and the table is empty. ``sample`` asks for logits of the last token.
    A NamedTuple (immutable, like a frozen dataclass, and cheaper to build): one is built
    per running sequence per step.
    """

    seq_id: int
    token_ids: SequenceOf[int]  # the chunk's own copy
    start_pos: int
    block_table: SequenceOf[int]
    sample: bool
    is_decode: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


# Builds a ScheduledChunk as ``_new_tuple(ScheduledChunk, fields)``: the tuple its
# constructor builds, minus the named tuple's Python-level ``__new__``.
_new_tuple = tuple.__new__


@frozen_record
class SchedulerOutput:
    """One iteration's plan: what to compute and the KV work to do first.

    ``kv_ops`` must be applied in order (a block swapped out may be reused by a later
    allocation of the same step), before the forward pass.
    """

    chunks: tuple[ScheduledChunk, ...]
    kv_ops: tuple[KVOps, ...]
    num_preemptions: int
    num_recomputed_tokens: int
    first_scheduled: tuple[str, ...]
    rejected: tuple[RejectedRequest, ...]
    # The step's composition for the cost model (host bytes left 0: the executor knows the
    # block bytes), built with the chunks: the sim executor prices it, the engine records
    # it in the step stats, and the token counts below read it.
    shape: StepShape

    @property
    def num_prefill_tokens(self) -> int:
        return self.shape.num_prefill_tokens

    @property
    def num_decode_tokens(self) -> int:
        return self.shape.num_decode_seqs

    @property
    def num_scheduled_tokens(self) -> int:
        return self.shape.num_tokens

    @property
    def num_sampling_chunks(self) -> int:
        return sum(1 for chunk in self.chunks if chunk.sample)


def is_decode_chunk(seq: Sequence, start: int, num_tokens: int) -> bool:
    """Whether a chunk of ``num_tokens`` from ``start`` is a decode token: the sequence's
    newest token, an output (not the prompt's last). Pure."""
    return num_tokens == 1 and start == len(seq.token_ids) - 1 and start >= seq.num_prompt_tokens


# A chunk being planned: (group, sequence, start position, number of tokens). A plain
# tuple: one is built per running sequence per step, and nothing changes it once planned.
_Piece = tuple[SequenceGroup, Sequence, int, int]


def is_decode_ready(group: SequenceGroup) -> bool:
    """Whether a running group may join a decode batch: not a beam group (beams are
    ranked jointly), forked if it runs several samples, and every sequence in decode
    state: only its newest token lacks KV, that token is an output (not the prompt's
    last), and computing it is no recomputation. Pure."""
    if group.is_beam or (group.num_samples > 1 and not group.has_forked):
        return False
    for seq in group.seqs:
        computed = seq.num_computed_tokens
        if (
            len(seq.token_ids) - computed != 1
            or computed < seq.num_prompt_tokens
            or computed < seq.num_lost_tokens
        ):
            return False
    return True


def may_follow_decodes(group: SequenceGroup) -> bool:
    """Whether a running group that is not decode-ready may still share a decode batch's
    step as the last running group (``DecodeBatch.tail``): one sequence, no beam, nothing
    detached. ``_schedule_running`` then plans it as in any step, after the batch, and
    making room for it can preempt only itself (victims come from the end of ``running``),
    never a group of the batch. Pure."""
    return len(group.seqs) == 1 and not group.is_beam and not group.num_detached


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """``Scheduler.decode_batch``'s answer: the step's (group, sequence) pairs in chunk
    order, and the groups changed other than by the decode-run methods since the
    previous batch was returned (joined ``running``, computed a chunk, took a token,
    forked; some may have left ``running`` since). A pair whose group is not in
    ``changed`` and that was in the previous batch has changed only through that
    batch's decode-run calls: a caller may carry what it knew about it (``changed`` also
    lists the previous batch's tail, whose marks a batch keeps). ``seqs``: the
    pairs' sequences, in order; ``seq_ids``: their ids. The lists are the batch's own
    (the scheduler's queues change under a run that admits or retires)."""

    pairs: list[tuple[SequenceGroup, Sequence]]
    seqs: list[Sequence]
    seq_ids: list[int]
    changed: tuple[SequenceGroup, ...]
    # The last running group when it is not decode-ready but may follow the batch in its
    # step (``may_follow_decodes``: a prompt prefilled in chunks, mostly), planned after the
    # batch by ``plan_tail_after_decodes``; None when the batch holds every running group.
    tail: SequenceGroup | None


# --------------------------------------------------------------------------- scheduler
class Scheduler:
    """Queues of sequence groups plus the step planner; owns the KV manager's sequence ids.

    Call order per engine step: ``schedule()`` -> (executor runs the chunks) ->
    ``complete_step()`` -> token updates (``append_token`` / ``fork_samples`` /
    ``advance_beams``) -> ``pop_finished()``. Misuse (a token for a sequence that is not
    running) raises ``KeyError`` naming the sequence.
    """

    def __init__(
        self, kv: KVManager, config: SchedulerConfig, eos_token_id: int, *, chunk_contents: bool = True
    ) -> None:
        self.kv = kv
        self.config = config
        self.eos_token_id = eos_token_id
        # Whether chunks carry their own copies of token ids and block tables. An executor
        # that only prices steps (simulation) reads neither: chunks then hold a view of
        # the ids and no table, so prompts are never copied for them.
        self.chunk_contents = chunk_contents
        self.policy = VICTIM_POLICIES[config.victim_policy]()
        self._register_on_schedule = config.register_blocks == "on_schedule"
        # Whether schedule() plans running groups with the decode fast path
        # (``_plan_running``) or group by group (``_plan_running_plain``): the same plans;
        # False only for the differential test.
        self.fast_decodes = True
        self.block_size = kv.block_size
        self.waiting: list[SequenceGroup] = []  # sorted by policy key
        self.running: list[SequenceGroup] = []  # sorted by policy key; victims from the end
        # Parallel to ``running`` (entry i for running[i]): the group's first sequence when
        # it joined, and that sequence's id. A group of one sample (num_samples 1: no beam,
        # no parallel samples) runs that one sequence for as long as it is running, and
        # ``decode_batch`` reads them only when every group is such a group: its batch
        # without a Python pass over the groups (two passes cost about 450 instructions a
        # sequence, at every decode run). Changed with ``running`` only, by ``_insert`` and
        # ``_remove_running`` (``check``).
        self._running_seqs: list[Sequence] = []
        self._running_seq_ids: list[int] = []
        self.swapped: list[SequenceGroup] = []  # sorted by policy key
        self._seqs: dict[int, tuple[SequenceGroup, Sequence]] = {}
        self._next_seq_id = 0
        self._next_arrival = 0
        # Sequence budget taken (max_num_seqs): num_samples summed over running groups, which
        # counts a group's samples before it forks and after some finish (num_running_seqs
        # counts the live sequences).
        self._seq_budget_used = 0
        self._pending_rejections: list[RejectedRequest] = []
        self._finished: list[FinishedRequest] = []
        # Per-step planning state.
        self._pieces: list[_Piece] = []
        # Decode pieces planned outside ``_pieces``: a decode run's batch, whose caller
        # completes it (``admit_after_decodes``, ``plan_tail_after_decodes``). They count as
        # planned (admission reads whether anything is: ``_has_pieces``) but make no chunks.
        self._num_outside_pieces = 0
        self._ops: list[KVOps] = []
        self._budget = 0
        self._num_preemptions = 0
        self._last_pieces: list[_Piece] = []
        # A step planned by append_decodes that was not a plain decode step; schedule() returns it.
        self._prepared: SchedulerOutput | None = None
        # Groups changed other than by the decode-run methods since ``decode_batch`` last
        # returned a batch (by id): joining ``running``, computing chunks, taking tokens,
        # forking. Invariant (``check``): every running group not in it is decode-ready
        # (``is_decode_ready``), since the decode-run methods keep a group ready. So
        # ``decode_batch`` checks only these, and reports them as the batch's changes.
        self._unchecked: dict[int, SequenceGroup] = {}

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        """Queue ``request`` as a new waiting group, or record why it can never run.

        Mutates the waiting queue (or the pending rejections reported by the next
        ``schedule``); never raises for an unfit request.
        """
        reason = self._static_reject_reason(request)
        if reason is not None:
            self._pending_rejections.append(RejectedRequest(request.request_id, reason))
            return
        group = SequenceGroup(request, self._next_arrival, self._new_seq_id(), self.eos_token_id)
        self._next_arrival += 1
        self._seqs[group.seqs[0].seq_id] = (group, group.seqs[0])
        self._enqueue_waiting(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._pending_rejections)

    def num_blocks_needed(self, request: Request) -> int:
        """Blocks the request holds at its peak if its samples share only the prompt's full blocks.

        Every sample holds at most prompt + max_new_tokens - 1 slots (the last sampled
        token is never fed back); the prompt's full blocks are shared after a fork.
        """
        bs = self.block_size
        max_len = request.num_prompt_tokens + request.max_new_tokens - 1
        shared = request.num_prompt_tokens // bs
        per_sample = -(-max_len // bs) - shared
        return shared + num_samples(request) * per_sample

    def _static_reject_reason(self, request: Request) -> str | None:
        cfg = self.config
        num_seqs = num_samples(request)
        if request.num_prompt_tokens == 0:
            return "empty prompt"
        if request.max_new_tokens <= 0:
            return f"max_new_tokens must be > 0, got {request.max_new_tokens}"
        if request.n < 1 or request.beam_width < 1:
            return f"n and beam_width must be >= 1, got n={request.n}, beam_width={request.beam_width}"
        if request.n > 1 and request.beam_width > 1:
            return "n > 1 together with beam_width > 1 is not supported"
        total = request.num_prompt_tokens + request.max_new_tokens
        if total > cfg.max_model_len:
            return (
                f"prompt {request.num_prompt_tokens} + max_new_tokens {request.max_new_tokens} = {total} "
                f"exceeds the model's max positions {cfg.max_model_len}"
            )
        if num_seqs > cfg.max_num_seqs:
            return f"needs {num_seqs} sequences, more than engine.max_num_seqs={cfg.max_num_seqs}"
        if request.beam_width > cfg.max_num_batched_tokens:
            return (
                f"beam_width {request.beam_width} beams decode in lockstep, more tokens than "
                f"engine.max_num_batched_tokens={cfg.max_num_batched_tokens} per step"
            )
        if not cfg.chunked_prefill and request.num_prompt_tokens > cfg.max_num_batched_tokens:
            return (
                f"prompt {request.num_prompt_tokens} tokens exceeds engine.max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens} with chunked_prefill off"
            )
        # A manager with its own capacity rule (the slab reserves whole regions) names why
        # it can never hold the request (the KV-manager contract); None lets it through.
        reason = self.kv.reject_reason(request)
        if reason is not None:
            return reason
        needed = self.num_blocks_needed(request)
        if needed > self.kv.num_blocks:
            return f"needs {needed} KV blocks of {self.block_size} tokens, the whole pool has {self.kv.num_blocks}"
        return None

    # ------------------------------------------------------------------ planning
    def schedule(self) -> SchedulerOutput:
        """Plan one iteration: reserve KV slots, preempt, swap and admit (see module doc).

        Mutates the queues, the KV manager (append/allocate/free/swap) and group counters.
        When a decode run (``append_decodes``) ended on a step it could not take as a plain
        decode step, that step's plan was already made; it is returned (once) instead.
        """
        if self._prepared is not None:
            output, self._prepared = self._prepared, None
            return output
        self._begin_plan()
        if self.fast_decodes:
            self._plan_running()
        else:
            self._plan_running_plain()
        return self._finish_plan()

    def _plan_running_plain(self) -> None:
        """Give every running group its tokens, most important first (``_schedule_running``)."""
        index = 0
        while index < len(self.running):
            if self._schedule_running(self.running[index]):
                index += 1

    def _plan_running(self) -> None:
        """``_plan_running_plain`` with the common case batched: the running groups from
        the next one on that are one attached sequence in decode state (its only
        uncomputed token is its newest, an output token) get that token each, their slots
        reserved by one ``append_decodes`` call (a KV-manager call per sequence was a
        third of a decode step's scheduling); every other group goes through
        ``_schedule_running``.

        Why it is the same plan: the batch takes at most one group per token of budget
        left (none once a prefill that may run past the budget, unchunked, made it
        negative), and with one sequence and a positive budget a beam group holds nothing
        back and fits its lockstep rule, so ``_schedule_running`` gives the sequence 1
        token, a decode piece (``_register_scheduled`` registers nothing for it).
        ``append_decodes`` stops before the first sequence whose ``append`` raises
        KVCapacityError, which is ``can_append`` being False (the KV-manager contract),
        when ``_schedule_running`` makes room: that group does so here too
        (``_append_piece``), and batching resumes after it. Room is made by preempting
        from the end of ``running``, never a group planned before.
        tests/test_sched_fast_decodes.py runs both on the same workloads."""
        running = self.running
        pieces = self._pieces  # _drop_pieces edits it in place
        append_decodes = self.kv.append_decodes
        index = 0
        while index < len(running):
            # The pieces of the decode groups from ``index`` on, within the budget (a
            # negative one would slice from the end).
            batch: list[_Piece] = []
            for group in running[index : index + max(self._budget, 0)]:
                seqs = group.seqs
                if len(seqs) != 1 or group.num_detached:
                    break
                seq = seqs[0]
                start = seq.num_computed_tokens
                if len(seq.token_ids) - start != 1 or start < seq.num_prompt_tokens:
                    break
                batch.append((group, seq, start, 1))
            if not batch:
                if self._schedule_running(running[index]):
                    index += 1
                continue
            num_done, ops = append_decodes([seq.seq_id for _, seq, _, _ in batch])
            self._ops += ops
            pieces += batch if num_done == len(batch) else batch[:num_done]
            self._budget -= num_done
            index += num_done
            if num_done < len(batch):
                piece = batch[num_done]
                group, seq, _, _ = piece
                if self._append_piece(group, seq.seq_id, 1):
                    pieces.append(piece)
                    self._budget -= 1
                    index += 1
                # else it preempted itself: the next group is at ``index`` now

    def _begin_plan(self) -> None:
        self._pieces = []
        self._num_outside_pieces = 0
        self._ops = []
        self._budget = self.config.max_num_batched_tokens
        self._num_preemptions = 0

    def _finish_plan(self) -> SchedulerOutput:
        """The rest of ``schedule`` once running groups have their tokens: swap-in, admission.

        Pieces planned outside ``_pieces`` (a decode run's batch, see ``admit_after_decodes``
        and ``plan_tail_after_decodes``) are left out of the output and of
        ``complete_step``: their caller completes them."""
        first_scheduled: list[str] = []
        rejected, self._pending_rejections = self._pending_rejections, []
        if self._num_preemptions == 0:
            self._swap_in_groups()
        if self._num_preemptions == 0 and not self.swapped:
            self._admit_waiting(first_scheduled)
        # (The cheap tests first: most steps have running groups and nothing swapped.)
        if self.swapped and not self.running and not self._has_pieces():
            self._unblock_swapped(first_scheduled)

        if not self.running and not self._has_pieces():
            rejected.extend(self._reject_stuck_head())

        chunks, num_recomputed, shape = self._finalize_pieces()
        return SchedulerOutput(
            chunks=chunks,
            kv_ops=tuple(self._ops),
            num_preemptions=self._num_preemptions,
            num_recomputed_tokens=num_recomputed,
            first_scheduled=tuple(first_scheduled),
            rejected=tuple(rejected),
            shape=shape,
        )

    # ------------------------------------------------------------------ decode runs (simulation)
    # A decode run takes consecutive plain decode steps without planning chunks: the
    # engine asks for the batch (``decode_batch``) and the KV manager's ``DecodeRun`` for
    # it; per step it checks the slots fit (``DecodeRun.can_advance``), reserves them
    # (``append_decodes``) and, after choosing tokens, completes it (``complete_decodes``);
    # ``finish_decodes`` ends the run. Each step leaves exactly the state ``schedule`` +
    # ``complete_step`` + ``append_token`` would have. Steps that cannot admit the head
    # (``quiet_decode_steps``) go together: ``complete_decodes_many``, then
    # ``DecodeRun.advance_many`` committing each step after its blocks are taken.

    def decode_batch(self, min_seqs_before_tail: int = 1) -> DecodeBatch | None:
        """The (group, sequence) pairs of the next step, in chunk order, when that step can
        only decode one token for every sequence of the batch: every running one, or every
        one but the last group's (the ``tail``, below); else None. Mutates only the change
        marks: a batch returned clears them (its ``changed`` lists them) but the tail's.

        None when rejections are pending, a group is swapped, a beam group runs (beams
        are ranked jointly), a prompt is not fully computed, a sample group has not
        forked yet, or the batch exceeds the token budget. One exception: the last
        running group alone may be not decode-ready when it ``may_follow_decodes`` (a
        prompt prefilled in chunks, mostly) and the others hold at least
        ``min_seqs_before_tail`` sequences (the caller's rule for when that pays): the
        batch then holds the others and names it as its ``tail``, which only the batch's
        first step may take, planning the tail after the batch
        (``plan_tail_after_decodes``). The KV side (no copy-on-write ahead) is the caller's
        to check: the manager's ``try_decode_run`` answers it while building the run.
        Whether a waiting group would be admitted is checked per step by
        ``append_decodes``. Only groups changed since the last batch are checked
        (``_unchecked``): the others are ready by the invariant.
        """
        if self._pending_rejections or self.swapped or not self.running or self._prepared is not None:
            return None
        unchecked = self._unchecked
        running_status = GroupStatus.RUNNING
        running = self.running
        tail = None
        for group in unchecked.values():
            if group.status is running_status and not is_decode_ready(group):
                # A tail needs at least min_seqs_before_tail (and one) sequences before it,
                # besides its own one: asked here, so that the first group not ready ends
                # the check where batches are small, as before tails existed.
                if (
                    tail is not None
                    or group is not running[-1]
                    or not may_follow_decodes(group)
                    or self.num_running_seqs() - 1 < max(min_seqs_before_tail, 1)
                ):
                    return None
                tail = group
        num_batched = len(running) - (tail is not None)
        if self._single_samples():
            # Each group's one live sequence (num_running_seqs), kept next to running:
            # copies in C, the pairs zipped in C (up to the tail's).
            if tail is None:
                seqs = self._running_seqs.copy()
                seq_ids = self._running_seq_ids.copy()
            else:
                seqs = self._running_seqs[:num_batched]
                seq_ids = self._running_seq_ids[:num_batched]
            pairs = list(zip(running, seqs))
        else:
            pairs = [(group, seq) for group in running[:num_batched] for seq in group.seqs]
            seqs = [seq for _, seq in pairs]
            seq_ids = [seq.seq_id for seq in seqs]
        if len(pairs) > self.config.max_num_batched_tokens:
            return None
        changed = tuple(unchecked.values())
        unchecked.clear()
        if tail is not None:
            unchecked[id(tail)] = tail  # still not decode-ready: checked again next time
        return DecodeBatch(pairs, seqs, seq_ids, changed, tail)

    def append_decodes(self, pairs: list[tuple[SequenceGroup, Sequence]], run: DecodeRun) -> bool:
        """Reserve one decode slot per sequence of ``pairs`` (the running loop of ``schedule``)
        through ``run`` (the KV manager's run over the same sequences, in order).

        Call only when ``run.can_advance()``.
        Returns True when the step is a plain decode step (no waiting group could start in
        it); otherwise plans the rest of the step as ``schedule`` would, keeps that plan for
        the next ``schedule`` call and returns False. Mutates the KV manager (appends) and,
        on False, whatever admission does.
        """
        plan = self._plan_after_decodes(pairs, run, outside=False)
        if plan is None:
            return True
        self._prepared = plan
        return False

    def admit_after_decodes(
        self, pairs: list[tuple[SequenceGroup, Sequence]], run: DecodeRun
    ) -> SchedulerOutput | None:
        """``append_decodes`` for a step whose decode tokens the caller completes itself
        (``complete_decodes``, ``finish_decodes``): None for a plain decode step; otherwise
        the plan of the step's other work (swap-in and admission, as ``schedule`` plans
        them after these decodes), whose chunks, counts and ``complete_step`` targets
        leave out the batch. Complete it with ``complete_decodes`` then ``complete_step``,
        the order in which ``complete_step`` commits a whole step.
        Mutates what ``append_decodes`` does."""
        return self._plan_after_decodes(pairs, run, outside=True)

    def _plan_after_decodes(
        self, pairs: list[tuple[SequenceGroup, Sequence]], run: DecodeRun, outside: bool
    ) -> SchedulerOutput | None:
        """Reserve the batch's decode slots through ``run``; None when no waiting group could
        start in the step, else the step's plan (``_finish_plan``), whose pieces include
        the batch's unless ``outside`` (its caller completes them)."""
        run.advance()
        budget = self.config.max_num_batched_tokens - len(pairs)
        if not self._head_may_start(budget):
            return None
        self._begin_plan()
        self._budget = budget
        # The batch's pieces stay planned: admission reads whether any piece is planned.
        if outside:
            self._num_outside_pieces = len(pairs)  # no tuple per sequence: most runs' step
        else:
            self._pieces = [(group, seq, seq.num_computed_tokens, 1) for group, seq in pairs]
        return self._finish_plan()

    def plan_tail_after_decodes(
        self, pairs: list[tuple[SequenceGroup, Sequence]], run: DecodeRun, tail: SequenceGroup
    ) -> SchedulerOutput | None:
        """``admit_after_decodes`` for a batch with a ``tail`` (``DecodeBatch.tail``):
        reserve the batch's decode slots through ``run``, then plan the tail after the
        batch's pieces as ``_plan_running`` plans it, then swap-in and admission. Returns
        the step's plan less the batch's pieces (the caller completes them, as after
        ``admit_after_decodes``), empty when the batch fills the token budget. None when
        making room for the tail preempted it (itself: the last running group is the
        first victim): the whole step's plan, the batch's pieces included, is then kept
        for the next ``schedule`` call, as when ``append_decodes`` returns False.
        Mutates what ``append_decodes`` does."""
        run.advance()
        self._begin_plan()
        self._budget = self.config.max_num_batched_tokens - len(pairs)
        self._pieces = [(group, seq, seq.num_computed_tokens, 1) for group, seq in pairs]
        if not self._schedule_running(tail):
            self._prepared = self._finish_plan()
            return None
        del self._pieces[: len(pairs)]  # the batch's go to the caller
        self._num_outside_pieces = len(pairs)
        return self._finish_plan()

    def complete_decodes(
        self, seqs: list[Sequence], token_ids: SequenceOf[int], commit_phases: np.ndarray, step: int
    ) -> None:
        """Finish a plain decode step of a run: what ``complete_step`` and ``append_token``
        do for these decode chunks; ``token_ids[i]`` is the token sampled for ``seqs[i]``.
        ``commit_phases`` (``decode_commit_phases`` of the run's first step) and ``step``
        (steps of the run completed before this one) say which sequences reach a
        commit: the others' commits would register nothing. A sequence this token
        finishes retires in ``finish_decodes`` (the run's last step), as do peaks, except
        a committing sample group's: its peak is taken before the commit, as ``schedule``
        takes it before ``complete_step``, because a commit may shrink what the group
        holds (a radix index swaps a sample's full block for its cached twin).
        Mutates the sequences, the prefix index (commit) and those groups' peaks."""
        kv = self.kv
        committing = (commit_phases == step % kv.commit_interval).nonzero()[0].tolist()
        # Only a group of several samples can shrink.
        if committing and not self._single_samples():
            seq_groups = self._seqs
            shared = {
                id(group): group
                for group, _ in [seq_groups[seqs[index].seq_id] for index in committing]
                if len(group.seqs) > 1
            }
            for group in shared.values():
                self._update_peaks(group)
        if committing:
            # Every token but the new one (appended below) has its KV: computed + 1 of them.
            entries = []
            for index in committing:
                seq = seqs[index]
                entries.append((seq.seq_id, seq.token_ids, seq.num_computed_tokens + 1))
            kv.commit_many(entries)
        for seq, token in zip(seqs, token_ids):
            # Decode state: one token lacked KV; it has it now and the new one lacks it.
            seq.num_computed_tokens += 1
            seq.token_ids.append(token)

    def decode_commit_phases(self, lengths: np.ndarray) -> np.ndarray:
        """For sequences of ``lengths`` tokens (int64) in decode state: the step of a run,
        modulo ``kv.commit_interval``, in which each one's commit can register something
        (its computed length then reaches a multiple of the interval). Pure."""
        return -lengths % self.kv.commit_interval

    def quiet_decode_steps(
        self, pairs: list[tuple[SequenceGroup, Sequence]], run: DecodeRun, max_steps: int
    ) -> int:
        """Call right after ``append_decodes`` returned True: how many of the next steps (at
        most ``max_steps``) surely stay plain decode steps as far as admission goes, and can
        be reserved together (``DecodeRun.advance_many``). The head's admission check
        (``_head_may_start``) only reads its prefix match and the room the manager has for
        it, which in a run only shrinks (paged: allocatable blocks) or stays (slab: free
        runs); a match only shrinks too unless a registration could extend it (then the
        manager gives no guard). ``run`` counts the steps after each of which the head
        still cannot start (``DecodeRun.num_quiet_steps`` with the manager's
        ``admission_guard``). Pure apart from the prefix index's match memo."""
        budget = self.config.max_num_batched_tokens - len(pairs)
        guard = None  # no waiting group could start in the run, whatever blocks it takes
        if self.waiting and budget > 0:
            group = self.waiting[0]
            if self._fits_seq_budget(group):
                if len(group.seqs) != 1:
                    return 0
                seq = group.seqs[0]
                guard = self.kv.admission_guard(
                    seq.token_ids,
                    group.request.cache_salt,
                    [running.seq_id for _, running in pairs],
                    self._prefill_target(seq, group.is_beam and group.has_forked),
                    budget,
                )
                if guard is None:
                    return 0
        return run.num_quiet_steps(guard, max_steps)

    def complete_decodes_many(
        self, seqs: list[Sequence], token_rows: list[list[int]]
    ) -> list[list[StepCommit]]:
        """``complete_decodes`` for consecutive steps taken together: ``token_rows[i]`` holds
        the tokens sampled for ``seqs[i]`` (in decode state, as ``decode_batch`` returns
        them), one per step, every row as long. Appends them and sets the computed counts
        now; returns, per step, the commits it makes (``commit_many`` entries: sequence id,
        its token ids, how many had their KV written then; in sequence order), for
        ``DecodeRun.advance_many`` to make right after that step's slots are reserved, so
        that the prefix index sees each step's drops before its registrations, as step by
        step. Mutates the sequences."""
        interval = self.kv.commit_interval
        num_steps = len(token_rows[0]) if token_rows else 0
        steps: list[list[StepCommit]] = [[] for _ in range(num_steps)]
        # (A range per sequence: finding the committing ones with numpy costs more below
        # about 60 sequences, a few numpy calls' fixed cost.)
        for seq, row in zip(seqs, token_rows):
            tokens = seq.token_ids
            # Decode state: the sequence holds its computed tokens and one more.
            first = seq.num_computed_tokens + 1
            tokens.extend(row)
            for at in range(-first % interval, num_steps, interval):
                steps[at].append((seq.seq_id, tokens, first + at))
            seq.num_computed_tokens = first + num_steps - 1
        return steps

    def finish_decodes(
        self, pairs: list[tuple[SequenceGroup, Sequence]], candidates: SequenceOf[int]
    ) -> None:
        """End a decode run: the peak KV slots of its groups of several sequences, which
        only grew during it (no slot is freed in a run), so one update at the end equals
        one per step (a lone sequence's peak follows its computed tokens:
        ``SequenceGroup.settle_peaks``). Then retire, in pair order, every sequence among
        ``pairs[i]`` for ``i`` in ``candidates`` (ascending) that is done, as
        ``append_token`` does after a normal step (``pop_finished`` reports their
        requests): the caller names those that may have produced their last token in the
        run's last step (a superset is fine). Mutates those groups' peak counters and, on
        retirement, the queues and the KV manager (frees)."""
        if not self._single_samples():
            shared = {id(group): group for group, _ in pairs if len(group.seqs) > 1}
            for group in shared.values():
                self._update_peaks(group)
        for index in candidates:
            group, seq = pairs[index]
            if group.is_finished_token(seq):
                self._finish_seq(group, seq)

    def _head_may_start(self, budget: int) -> bool:
        """Whether ``_admit_waiting`` with ``budget`` tokens left could admit the head (or
        do anything at all) after this step's decode slots were reserved. Pure apart from
        the prefix index's match memo; answers True
        whenever unsure (a multi-sequence head), which only ends a run early."""
        if not self.waiting or budget <= 0:
            return False
        group = self.waiting[0]
        if not self._fits_seq_budget(group):
            return False
        if len(group.seqs) != 1:
            return True
        seq = group.seqs[0]
        salt = group.request.cache_salt
        # The decode pieces of this step are already planned (has_pieces).
        num_tokens = self._first_chunk(seq, group.is_beam and group.has_forked, salt, budget, True)
        return num_tokens is not None and self.kv.can_allocate(seq.seq_id, seq.token_ids, num_tokens, salt)

    # The admission rule, shared by _admit_waiting and the decode-run checks above.
    def _fits_seq_budget(self, group: SequenceGroup) -> bool:
        """Whether ``group``'s samples fit the sequence budget next to the running ones. Pure."""
        return self._seq_budget_used + group.num_samples <= self.config.max_num_seqs

    def _first_chunk(
        self, seq: Sequence, hold_last: bool, salt: str | None, budget: int, has_pieces: bool
    ) -> int | None:
        """Tokens ``seq`` computes in its first step if admitted now with ``budget`` tokens
        left: its uncached tokens (all but the last for a forked beam), chunked to the
        budget; 0 for a beam whose history is cached but for its last token (it still
        attaches its blocks). None when its prefill cannot start in this step: unchunked,
        over the budget, and other pieces (``has_pieces``) are planned. Pure apart from
        the prefix index's match memo."""
        remaining = self._prefill_target(seq, hold_last) - self.kv.num_cached_tokens(seq.token_ids, salt)
        if remaining < 0:
            remaining = 0
        if self.config.chunked_prefill:
            return min(remaining, budget)
        if remaining > budget and has_pieces:
            return None
        return remaining

    @staticmethod
    def _prefill_target(seq: Sequence, hold_last: bool) -> int:
        """Tokens ``seq`` has computed once its prefill is done: all (all but the last for
        a beam holding it back, ``_hold_last``). Pure."""
        return len(seq.token_ids) - (1 if hold_last else 0)

    def _num_tokens_to_run(self, group: SequenceGroup, seq: Sequence, hold_last: bool) -> int:
        """Tokens of ``seq`` to compute now under the remaining budget (0: nothing now)."""
        return self._chunk_len(self._prefill_target(seq, hold_last) - seq.num_computed_tokens)

    def _chunk_len(self, remaining: int) -> int:
        """Tokens of a ``remaining``-token prefill to compute now under the budget (0: none now)."""
        if remaining <= 0:
            return 0
        if self.config.chunked_prefill:
            return min(remaining, self._budget)
        # Without chunking a prefill runs whole; one larger than the budget (a recompute
        # of prompt + outputs) may run alone in an otherwise empty step.
        if remaining <= self._budget or not self._has_pieces():
            return remaining
        return 0

    def _hold_last(self, group: SequenceGroup) -> bool:
        """Beams compute their last token only together (lockstep ranking)."""
        return group.has_forked and group.is_beam and any(s.num_uncomputed_tokens > 1 for s in group.seqs)

    def _schedule_running(self, group: SequenceGroup) -> bool:
        """Give a running group its tokens, preempting from the end. False if it preempted itself."""
        if self._budget <= 0:
            return True
        if group.num_detached:
            return self._schedule_attaching(group)
        hold_last = False
        if group.has_forked and group.is_beam:
            hold_last = self._hold_last(group)
            if not hold_last and len(group.seqs) > self._budget:
                return True  # lockstep decode needs one token per beam in the same step
        pieces = self._pieces
        for seq in group.seqs:
            if not hold_last and len(seq.token_ids) - seq.num_computed_tokens == 1:
                num_tokens = 1  # a decode token (the budget is > 0): the common case, inlined
            else:
                num_tokens = self._num_tokens_to_run(group, seq, hold_last)
                if num_tokens == 0:
                    continue
            if not self._append_piece(group, seq.seq_id, num_tokens):
                return False
            pieces.append((group, seq, seq.num_computed_tokens, num_tokens))
            self._budget -= num_tokens
            if self._budget <= 0:
                break
        if self._register_on_schedule:
            self._register_scheduled(group)
        return True

    def _append_piece(self, group: SequenceGroup, seq_id: int, num_tokens: int) -> bool:
        """Reserve ``num_tokens`` more slots for ``seq_id`` of running ``group``, making
        room (``_make_room``) when the KV manager has none; the KV ops go to the plan.
        False when the group preempted itself (nothing reserved). Asks ``can_append``
        first, as the plain path always has (``_plan_running`` batches ``append_decodes``
        instead and comes here where it stops). Mutates the KV manager, the plan's ops
        and, making room, the queues."""
        kv = self.kv
        if not kv.can_append(seq_id, num_tokens) and not self._make_room(group, seq_id, num_tokens):
            return False
        ops = kv.append(seq_id, num_tokens)
        if ops is not NO_OPS:
            self._ops.append(ops)
        return True

    def _make_room(self, group: SequenceGroup, seq_id: int, num_tokens: int) -> bool:
        """Preempt less important running groups until ``seq_id`` can grow by ``num_tokens``.

        When ``group`` is the last running group, the device blocks that swapped groups
        still hold (blocks shared with their siblings or pinned by the prefix index stay
        resident) are the only memory left to take: those groups are recomputed instead,
        least important first. Only then does ``group`` preempt itself (returns False).
        """
        kv = self.kv
        while not kv.can_append(seq_id, num_tokens):
            victim = self.running[-1]
            if victim is group:
                if len(self.running) == 1 and self.swapped:
                    self._recompute(self.swapped.pop())
                    continue
                self._preempt_self(group)
                return False
            self._remove_running(len(self.running) - 1)
            self._preempt(victim)
        return True

    # A forked group (parallel samples, beams) preempted by recompute comes back with only
    # its leader (seqs[0]) attached: the leader recomputes up to the share point (the
    # shortest common prefix with a detached sibling, before anyone's last token) and
    # stops; the next step the siblings fork its blocks (KV fork: no new block) and go on
    # from there. Every sibling shares at least the prompt with the leader, so the group
    # never holds more than ``num_blocks_needed``; recomputing each sample alone would
    # hold the prompt once per sample and may never fit again.

    def _share_point(self, group: SequenceGroup) -> int:
        """Tokens the leader computes before its detached siblings attach. Pure."""
        kv = self.kv
        tokens = group.seqs[0].token_ids
        point = len(tokens) - 1
        for seq in group.seqs[1:]:
            if kv.has_seq(seq.seq_id):
                continue
            other = seq.token_ids
            end = min(point, len(other) - 1)
            # Samples and beams all start with the prompt; compare from there.
            index = seq.num_prompt_tokens
            while index < end and tokens[index] == other[index]:
                index += 1
            point = min(point, index)
        return point

    def _attach(self, group: SequenceGroup, point: int) -> None:
        """Fork the leader's blocks (exactly its ``point`` computed tokens) to every detached sibling."""
        kv = self.kv
        self._unchecked[id(group)] = group
        leader = group.seqs[0]
        assert kv.num_tokens(leader.seq_id) == leader.num_computed_tokens == point, (
            f"{group.request_id}: the leader holds {kv.num_tokens(leader.seq_id)} slots, "
            f"{leader.num_computed_tokens} computed, at share point {point}"
        )
        for seq in group.seqs[1:]:
            if not kv.has_seq(seq.seq_id):
                kv.fork(leader.seq_id, seq.seq_id)
                seq.num_computed_tokens = leader.num_computed_tokens
        group.num_detached = 0

    def _schedule_attaching(self, group: SequenceGroup) -> bool:
        """``_schedule_running`` for a group with detached siblings: the leader computes up to
        the share point; once it is there, the siblings attach and the group runs as usual."""
        leader = group.seqs[0]
        point = self._share_point(group)
        if leader.num_computed_tokens == point:
            self._attach(group, point)
            return self._schedule_running(group)
        num_tokens = self._chunk_len(point - leader.num_computed_tokens)
        if num_tokens == 0:
            return True
        if not self._append_piece(group, leader.seq_id, num_tokens):
            return False
        self._add_piece(group, leader, leader.num_computed_tokens, num_tokens)
        if self._register_on_schedule:
            self._register_scheduled(group)
        return True

    def _register_scheduled(self, group: SequenceGroup) -> None:
        """``register_blocks=on_schedule``: register with the prefix index the KV that this
        step's prefill pieces of ``group`` write (the pieces at the end of the plan), so a
        group admitted later in this pass hits it. Called once the group's pieces are all
        planned: a group that preempts itself drops its pieces, and their KV must never be
        registered. Pieces planned earlier in a pass are never dropped later in it (victims
        come from the end of ``running``, not yet planned). Decode tokens are registered on
        completion as with ``on_completion``, so the simulation fast path, which takes
        decode steps without planning them, stays identical to stepping one by one.
        ``complete_step`` commits again (a no-op for what is registered). Mutates the
        prefix index (and, for de-duplicated blocks, the group's block tables)."""
        pieces = self._pieces
        first = len(pieces)
        while first > 0 and pieces[first - 1][0] is group:
            first -= 1
        kv = self.kv
        for _, seq, start, num_tokens in pieces[first:]:
            if is_decode_chunk(seq, start, num_tokens):
                continue
            end = start + num_tokens
            tokens = seq.token_ids
            kv.commit(seq.seq_id, prefix_of(tokens, end))

    def _has_pieces(self) -> bool:
        """Whether any piece is planned in this step (its batch's included). Pure."""
        return bool(self._pieces) or self._num_outside_pieces > 0

    def _add_piece(self, group: SequenceGroup, seq: Sequence, start: int, num_tokens: int) -> None:
        self._pieces.append((group, seq, start, num_tokens))
        self._budget -= num_tokens

    def _drop_pieces(self, group: SequenceGroup) -> None:
        pieces = self._pieces
        self._budget += sum(piece[3] for piece in pieces if piece[0] is group)
        # In place: the running loop (_plan_running) holds the list.
        pieces[:] = [piece for piece in pieces if piece[0] is not group]

    def _preempt_self(self, group: SequenceGroup) -> None:
        """The group cannot grow even after every less important group was preempted."""
        # Slots appended this step for some of its sequences were never computed; swap
        # would carry them along, so a partly grown group is recomputed instead.
        partly_grown = any(piece[0] is group for piece in self._pieces)
        self._drop_pieces(group)
        self._remove_running(self.running.index(group))
        if not self.running:
            # Alone in the pool and still no room: it would loop forever. Reject it.
            self._release(group)
            self._pending_rejections.append(
                RejectedRequest(
                    group.request_id,
                    f"does not fit in the KV pool ({self.kv.num_blocks} blocks) even when running alone",
                )
            )
            self._seq_budget_used -= group.num_samples
            return
        self._preempt(group, allow_swap=not partly_grown)

    def _preempt(self, group: SequenceGroup, allow_swap: bool = True) -> None:
        """Evict a running group (already removed from ``running``): swap or recompute."""
        group.num_preemptions += 1
        self._num_preemptions += 1
        self._seq_budget_used -= group.num_samples
        if allow_swap and self.config.preemption == "swap" and self._swap_out(group):
            group.status = GroupStatus.SWAPPED
            self._insert(self.swapped, group)
            return
        self._recompute(group)

    def _recompute(self, group: SequenceGroup) -> None:
        """Drop every KV block of a preempted group (device and host) and queue it to be
        computed again. Mutates the KV manager, the group and the waiting queue."""
        kv = self.kv
        group.settle_peaks()  # before its computed count drops
        for seq in group.seqs:
            seq.num_lost_tokens = max(seq.num_lost_tokens, seq.num_computed_tokens)
            seq.num_computed_tokens = 0
            if kv.has_seq(seq.seq_id):  # detached siblings hold nothing
                kv.free(seq.seq_id)
        group.num_detached = 0
        group.status = GroupStatus.WAITING
        self._enqueue_waiting(group)

    def _unblock_swapped(self, first_scheduled: list[str]) -> None:
        """Nothing runs and the head swapped group cannot come back: the other swapped
        groups' resident blocks are in its way. Recompute them (least important first),
        then the head itself, until a group swaps in or admission can start one."""
        while self.swapped and not self.running:
            self._recompute(self.swapped.pop(-1 if len(self.swapped) > 1 else 0))
            self._swap_in_groups()
        if not self.swapped:
            self._admit_waiting(first_scheduled)

    def _swap_out(self, group: SequenceGroup) -> bool:
        """Move every sequence's blocks to the host; on a full host pool undo and return False."""
        moved: list[Sequence] = []
        for seq in group.seqs:
            if not self.kv.has_seq(seq.seq_id):
                continue  # a detached sibling holds nothing
            if not self.kv.can_swap_out(seq.seq_id):
                break
            self._ops.append(self.kv.swap_out(seq.seq_id))
            moved.append(seq)
        else:
            return True
        # Bring the moved ones back (their device blocks were just freed, so they fit):
        # the caller then recomputes the whole group.
        for seq in moved:
            self._ops.append(self.kv.swap_in(seq.seq_id))
        return False

    def _swap_in_groups(self) -> None:
        """Bring swapped groups back in policy order while blocks and sequence slots allow."""
        while self.swapped:
            group = self.swapped[0]
            if not self._fits_seq_budget(group):
                return
            moved: list[Sequence] = []
            for seq in group.seqs:
                if not self.kv.has_seq(seq.seq_id):
                    continue  # a detached sibling holds nothing
                if not self.kv.can_swap_in(seq.seq_id):
                    break
                self._ops.append(self.kv.swap_in(seq.seq_id))
                moved.append(seq)
            else:
                self.swapped.pop(0)
                group.status = GroupStatus.RUNNING
                self._seq_budget_used += group.num_samples
                self._insert(self.running, group)
                continue
            for seq in moved:  # not enough room for the whole group: put them back
                self._ops.append(self.kv.swap_out(seq.seq_id))
            return

    def _admit_waiting(self, first_scheduled: list[str]) -> None:
        """Admit waiting groups in order while their first chunk fits (head-of-line blocking)."""
        kv = self.kv
        while self.waiting and self._budget > 0:
            group = self.waiting[0]
            if not self._fits_seq_budget(group):
                return
            if group.has_forked and len(group.seqs) > 1:
                if not self._admit_forked(group):
                    return
                if self._register_on_schedule:
                    self._register_scheduled(group)
                self._dequeue_waiting()
                group.status = GroupStatus.RUNNING
                self._seq_budget_used += group.num_samples
                self._insert(self.running, group)
                continue
            hold_last = group.is_beam and group.has_forked
            salt = group.request.cache_salt
            admitted: list[Sequence] = []
            for seq in group.seqs:
                num_tokens = self._first_chunk(seq, hold_last, salt, self._budget, self._has_pieces())
                if num_tokens is None or not kv.can_allocate(seq.seq_id, seq.token_ids, num_tokens, salt):
                    break
                num_cached, ops = kv.allocate(seq.seq_id, seq.token_ids, num_tokens, salt)
                self._ops.append(ops)
                seq.num_computed_tokens = num_cached
                admitted.append(seq)
                if num_tokens > 0:
                    self._add_piece(group, seq, num_cached, num_tokens)
            else:
                if self._register_on_schedule:
                    self._register_scheduled(group)
                self._dequeue_waiting()
                group.status = GroupStatus.RUNNING
                self._seq_budget_used += group.num_samples
                self._insert(self.running, group)
                if not group.was_scheduled:
                    group.was_scheduled = True
                    group.num_cached_prompt_tokens = group.seqs[0].num_computed_tokens
                    first_scheduled.append(group.request_id)
                continue
            # The group does not fit now: undo its partial admission and stop (FCFS).
            self._drop_pieces(group)
            for seq in admitted:
                seq.num_computed_tokens = 0
                kv.free(seq.seq_id)
            return

    def _admit_forked(self, group: SequenceGroup) -> bool:
        """Admit a forked group after a recompute preemption: its leader with a prefix-cache
        hit of at most the share point and its first chunk towards it; its siblings attach
        at once when the hit reaches the share point, else in a later step. False (and
        nothing held) when that does not fit now."""
        kv = self.kv
        leader = group.seqs[0]
        point = self._share_point(group)  # every sibling is detached: none holds KV
        salt = group.request.cache_salt
        # A hit past the share point would give the leader slots its siblings cannot fork.
        shared = TokenPrefix(leader.token_ids, point + 1)
        remaining = point - kv.num_cached_tokens(shared, salt)
        if not self.config.chunked_prefill and remaining > self._budget and self._has_pieces():
            return False
        num_tokens = min(remaining, self._budget) if self.config.chunked_prefill else remaining
        if not kv.can_allocate(leader.seq_id, shared, num_tokens, salt):
            return False
        num_cached, ops = kv.allocate(leader.seq_id, shared, num_tokens, salt)
        self._ops.append(ops)
        leader.num_computed_tokens = num_cached
        group.num_detached = len(group.seqs) - 1
        if num_tokens > 0:
            self._add_piece(group, leader, num_cached, num_tokens)
            return True
        self._attach(group, point)
        hold_last = group.is_beam
        for seq in group.seqs:
            num_tokens = self._num_tokens_to_run(group, seq, hold_last)
            if num_tokens == 0:
                continue
            if not kv.can_append(seq.seq_id, num_tokens):
                # Undo: the group holds nothing and waits (head-of-line, as any group).
                self._drop_pieces(group)
                for undone in group.seqs:
                    undone.num_computed_tokens = 0
                    kv.free(undone.seq_id)
                group.num_detached = 0
                return False
            ops = kv.append(seq.seq_id, num_tokens)
            if ops is not NO_OPS:
                self._ops.append(ops)
            self._add_piece(group, seq, seq.num_computed_tokens, num_tokens)
        return True

    def _reject_stuck_head(self) -> list[RejectedRequest]:
        """Nothing runs and nothing was scheduled: the head can never start, so reject it."""
        queue = self.swapped or self.waiting
        if not queue:
            return []
        if queue is self.waiting:
            group = self._dequeue_waiting()
        else:
            group = queue.pop(0)
        self._release(group)
        where = "swapped" if queue is self.swapped else "waiting"
        return [
            RejectedRequest(
                group.request_id,
                f"cannot be scheduled on an idle engine ({where}; KV pool {self.kv.num_blocks} blocks, "
                f"{self.kv.usage().num_blocks_free} free)",
            )
        ]

    def _release(self, group: SequenceGroup) -> None:
        """Drop every KV reference of ``group`` (device or host) and forget its sequences."""
        for seq in group.seqs:
            if self.kv.has_seq(seq.seq_id):
                self.kv.free(seq.seq_id)
            self._seqs.pop(seq.seq_id, None)
        self._unchecked.pop(id(group), None)
        group.status = GroupStatus.FINISHED

    def _finalize_pieces(self) -> tuple[tuple[ScheduledChunk, ...], int, StepShape]:
        """Chunks, recomputed token count, the step's shape (which counts its prefill and
        decode tokens) and peaks of the pieces planned in ``_pieces``; they become
        ``complete_step``'s pieces."""
        kv = self.kv
        chunk_contents = self.chunk_contents
        chunks: list[ScheduledChunk] = []
        num_recomputed = 0
        prefill_chunks: list[tuple[int, int]] = []  # (start, tokens) per prefill chunk
        decode_lens: list[int] = []  # per decode chunk: its context, the token decoded included
        touched: dict[int, SequenceGroup] = {}
        pieces = self._pieces
        tables: Iterator[list[int]]  # real mode: every chunk's table, read in one call
        if chunk_contents:  # (nothing below changes the KV manager)
            tables = iter(kv.block_tables([seq.seq_id for _, seq, _, _ in pieces]))
        for group, seq, start, num_tokens in pieces:
            tokens = seq.token_ids
            # The common chunk first, in few steps: a decode token (is_decode_chunk written
            # out: a call per running sequence per step; tests/test_scheduler.py checks every
            # chunk against it) that recomputes nothing. The general branch would build the
            # same chunk (for one token, ``sample`` is ``start == len(tokens) - 1``).
            token_ids: SequenceOf[int]
            if (
                num_tokens == 1
                and start == len(tokens) - 1
                and start >= seq.num_prompt_tokens
                and start >= seq.num_lost_tokens
            ):
                decode_lens.append(start + 1)
                token_ids, sample, is_decode = [tokens[start]], True, True
            else:
                end = start + num_tokens
                sample = end == len(tokens)
                is_decode = num_tokens == 1 and sample and start >= seq.num_prompt_tokens
                # (Never a decode in practice: here that needs start < num_lost_tokens, but a
                # preemption records at most the computed tokens, fewer than the sequence's.
                # The general rule stays so that this branch builds any chunk right.)
                if is_decode:
                    decode_lens.append(start + 1)
                else:
                    prefill_chunks.append((start, num_tokens))
                if start < seq.num_lost_tokens:
                    lost = min(end, seq.num_lost_tokens) - start
                    num_recomputed += lost
                    group.num_recomputed_tokens += lost
                if num_tokens == 1:
                    token_ids = [tokens[start]]
                elif chunk_contents:
                    # A list slice is the chunk's own copy already (tuple() of it copied a
                    # prefill chunk's 8K ids twice).
                    token_ids = tokens[start:end]
                else:
                    token_ids = TokenSpan(tokens, start, end)
            table = next(tables) if chunk_contents else ()
            # One chunk per running sequence per step: built without ScheduledChunk.__new__.
            chunks.append(
                _new_tuple(ScheduledChunk, (seq.seq_id, token_ids, start, table, sample, is_decode))
            )
            if len(group.seqs) != 1:
                # A lone sequence's peak follows its computed tokens (SequenceGroup.settle_peaks).
                touched[id(group)] = group
        for group in touched.values():
            self._update_peaks(group)
        self._last_pieces = pieces
        return tuple(chunks), num_recomputed, StepShape.build(prefill_chunks, decode_lens)

    # ------------------------------------------------------------------ after the forward
    def complete_step(self) -> list[tuple[SequenceGroup, Sequence]]:
        """Mark the last schedule's chunks computed and register full blocks for reuse.

        Returns the (group, sequence) of every chunk with ``sample=True``, in chunk order:
        row i of the executor's logits belongs to entry i. Mutates the sequences'
        computed counts and the KV manager's prefix index (``commit``).
        """
        targets = []
        commits: list[StepCommit] = []  # together, in chunk order
        interval = self.kv.commit_interval
        unchecked = self._unchecked
        for group, seq, start, num_tokens in self._last_pieces:
            unchecked[id(group)] = group
            seq.num_computed_tokens = computed = start + num_tokens
            tokens = seq.token_ids
            # A one-token piece commits only where it can register something (as
            # complete_decodes); a longer chunk may complete a block anywhere.
            if num_tokens > 1 or computed % interval == 0:
                # A prefilling sequence commits its computed prefix: a count, not an O(prompt) copy.
                commits.append((seq.seq_id, tokens, computed))
            if computed == len(tokens):
                targets.append((group, seq))
        if commits:
            self.kv.commit_many(commits)
        self._last_pieces = []
        return targets

    def append_token(self, group: SequenceGroup, seq: Sequence, token_id: int) -> None:
        """Append a sampled token to ``seq``; retire the sequence (and group) when done.

        Mutates the sequence, may free its KV and queue a FinishedRequest.
        """
        self._unchecked[id(group)] = group
        seq.token_ids.append(token_id)
        if group.is_finished_token(seq):
            self._finish_seq(group, seq)

    def fork_samples(self, group: SequenceGroup, token_ids: list[int]) -> list[Sequence]:
        """Parallel sampling: split the prompt sequence into ``len(token_ids)`` samples.

        Sample i gets token_ids[i]; samples 1.. share every block of sample 0 (KV fork).
        Returns the samples in order. Mutates the group, the KV manager and peak counters.
        """
        self._unchecked[id(group)] = group
        group.settle_peaks()  # the lone sequence's peak, before the group forks
        parent = group.seqs[0]
        samples = [parent]
        for index in range(1, len(token_ids)):
            child = parent.fork(self._new_seq_id(), index)
            self.kv.fork(parent.seq_id, child.seq_id)
            self._seqs[child.seq_id] = (group, child)
            samples.append(child)
        group.seqs = list(samples)
        group.has_forked = True
        self._update_peaks(group)
        for sample, token in zip(samples, token_ids):
            self.append_token(group, sample, token)
        return samples

    def advance_beams(
        self,
        group: SequenceGroup,
        chosen: list[tuple[Sequence, int, float]],
        finished: list[tuple[float, tuple[int, ...]]],
    ) -> list[Sequence]:
        """Replace the beams by ``chosen`` (parent beam, token, new cumulative logprob), best first.

        A parent chosen k times is kept once and forked k-1 times (sharing its blocks,
        the partial last block copied on the next write); parents never chosen are freed.
        ``finished`` hypotheses (score, output tokens) end here (EOS). Beams stop at
        max_new_tokens, or early once ``beam_width`` finished hypotheses beat every live
        beam (scores only fall). Returns the live beams. Mutates the group and the KV manager.
        """
        kv = self.kv
        self._unchecked[id(group)] = group
        group.settle_peaks()  # a lone beam's peak, before the beams change
        chosen_parents = {id(parent) for parent, _, _ in chosen}
        for beam in group.seqs:
            if id(beam) not in chosen_parents:
                kv.free(beam.seq_id)
                self._seqs.pop(beam.seq_id, None)
        # Forks first (copying the parent's tokens before its own new token is appended).
        used: set[int] = set()
        targets: list[Sequence] = []
        for rank, (parent, _, _) in enumerate(chosen):
            if id(parent) in used:
                child = parent.fork(self._new_seq_id(), rank)
                kv.fork(parent.seq_id, child.seq_id)
                self._seqs[child.seq_id] = (group, child)
                targets.append(child)
            else:
                used.add(id(parent))
                targets.append(parent)
        for rank, (beam, (_, token, score)) in enumerate(zip(targets, chosen)):
            beam.sample_index = rank
            beam.token_ids.append(token)
            beam.cum_logprob = score
        group.seqs = targets
        group.has_forked = True
        group.finished_beams.extend(finished)
        self._update_peaks(group)
        width = group.request.beam_width
        best_live = max((b.cum_logprob for b in targets), default=float("-inf"))
        done_scores = sorted((s for s, _ in group.finished_beams), reverse=True)
        at_length = any(b.num_output_tokens >= group.request.max_new_tokens for b in targets)
        early = len(done_scores) >= width and done_scores[width - 1] >= best_live
        if at_length or early or not targets:
            for beam in targets:
                if at_length:
                    group.finished_beams.append((beam.cum_logprob, beam.output_token_ids))
                kv.free(beam.seq_id)
                self._seqs.pop(beam.seq_id, None)
            group.seqs = []
            self._retire(group)
        return group.seqs

    def num_running_seqs(self) -> int:
        """Sequences of the running groups now (a step's ``num_running``). Pure."""
        if self._single_samples():
            return len(self.running)  # each group's one live sequence (a done group retires)
        return sum(map(len, map(_SEQS_OF, self.running)))

    def _single_samples(self) -> bool:
        """Whether every running group runs one sample (no beam, no parallel samples): the
        sequence budget, num_samples summed over the groups (each at least 1), then equals
        the group count. O(1), for the per-step paths. Pure."""
        return self._seq_budget_used == len(self.running)

    def pop_finished(self) -> list[FinishedRequest]:
        """Requests completed since the last call (clears the list)."""
        finished, self._finished = self._finished, []
        return finished

    # ------------------------------------------------------------------ internals
    def _finish_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        group.settle_peaks()  # a lone sequence's peak, before it leaves the group
        self.kv.free(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        group.finished_outputs[seq.sample_index] = seq.output_token_ids
        group.seqs.remove(seq)
        if group.is_done:
            self._retire(group)

    def _retire(self, group: SequenceGroup) -> None:
        self._unchecked.pop(id(group), None)
        if group.status is GroupStatus.RUNNING:
            self._remove_running(self.running.index(group))
            self._seq_budget_used -= group.num_samples
        group.status = GroupStatus.FINISHED
        self._finished.append(group.to_finished())

    def _update_peaks(self, group: SequenceGroup) -> None:
        """Track the most KV slots the group held at once, with and without sharing (a
        lone sequence: ``SequenceGroup.settle_peaks``)."""
        kv = self.kv
        if len(group.seqs) == 1:
            group.settle_peaks()
            return
        bs = self.block_size
        used_per_block: dict[int, int] = {}
        unshared = 0
        for seq in group.seqs:
            if group.num_detached and not kv.has_seq(seq.seq_id):
                continue
            num_tokens = kv.num_tokens(seq.seq_id)
            unshared += num_tokens
            for logical, block in enumerate(kv.block_table(seq.seq_id)):
                used = min(bs, num_tokens - logical * bs)
                if used > used_per_block.get(block, 0):
                    used_per_block[block] = used
        distinct = sum(used_per_block.values())
        group.peak_kv_slots = max(group.peak_kv_slots, distinct)
        group.peak_kv_slots_unshared = max(group.peak_kv_slots_unshared, unshared)

    def _insert(self, queue: list[SequenceGroup], group: SequenceGroup) -> None:
        """Put ``group`` into ``queue`` (sorted by the policy's key) after every group whose
        key is not greater: ``bisect.insort``. A group no earlier than the last (arrivals
        and admissions, most often) is appended without the search's key calls."""
        key = self.policy.key
        own = key(group)
        if not queue or key(queue[-1]) <= own:
            at = len(queue)  # where insort puts it: after the last key <= its own
        else:
            at = bisect.bisect_right(queue, own, key=key)
        queue.insert(at, group)
        if queue is self.running:
            self._unchecked[id(group)] = group
            seq = group.seqs[0]
            self._running_seqs.insert(at, seq)
            self._running_seq_ids.insert(at, seq.seq_id)

    def _remove_running(self, at: int) -> None:
        """Take ``running[at]`` out of ``running`` and its entries out of the lists kept
        next to it. Mutates the three."""
        del self.running[at], self._running_seqs[at], self._running_seq_ids[at]

    # Every change of the waiting queue goes through these two, which report it to the KV
    # manager (the contract's waiting_entered / waiting_left: the slab sizes its external
    # fragmentation by what waits).
    def _enqueue_waiting(self, group: SequenceGroup) -> None:
        self._insert(self.waiting, group)
        self.kv.waiting_entered(group)

    def _dequeue_waiting(self) -> SequenceGroup:
        group = self.waiting.pop(0)
        self.kv.waiting_left(group)
        return group

    def _new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    def check(self) -> None:
        """Raise AssertionError when scheduler and KV manager disagree (call between steps).

        Every attached sequence of a running or swapped group holds exactly its computed
        tokens' slots; a detached one (see ``_attach``) holds nothing, has computed nothing
        and is not the leader; waiting groups hold none; the sequence budget matches the
        running groups, and ``num_running_seqs`` their live sequences; each queue is in the
        victim policy's order; the sequences and ids kept next to ``running`` are, for each
        group of one sample, its one sequence and that sequence's id.
        """
        kv = self.kv
        key = self.policy.key
        for name, queue in (("waiting", self.waiting), ("running", self.running), ("swapped", self.swapped)):
            keys = [key(group) for group in queue]  # once each: key is a Python call
            for at in range(1, len(queue)):
                assert keys[at - 1] <= keys[at], (
                    f"{name} queue out of {self.policy.name} order: "
                    f"{queue[at - 1].request_id} before {queue[at].request_id}"
                )
        for queue, status in ((self.running, GroupStatus.RUNNING), (self.swapped, GroupStatus.SWAPPED)):
            for group in queue:
                assert group.status is status, (
                    f"{group.request_id}: status {group.status} in {status.value} queue"
                )
                detached = [seq for seq in group.seqs if not kv.has_seq(seq.seq_id)]
                assert len(detached) == group.num_detached, (
                    f"{group.request_id}: {len(detached)} sequences without KV, num_detached "
                    f"{group.num_detached}"
                )
                assert not detached or group.seqs[0] not in detached, (
                    f"{group.request_id}: the leader is detached"
                )
                for seq in group.seqs:
                    if seq in detached:
                        assert seq.num_computed_tokens == 0, f"{group.request_id} seq {seq.seq_id}: detached"
                        continue
                    assert kv.num_tokens(seq.seq_id) == seq.num_computed_tokens, (
                        f"{group.request_id} seq {seq.seq_id}: {kv.num_tokens(seq.seq_id)} KV slots but "
                        f"{seq.num_computed_tokens} computed tokens"
                    )
        for group in self.waiting:
            assert group.status is GroupStatus.WAITING, f"{group.request_id}: {group.status} in waiting queue"
            assert group.num_detached == 0, f"{group.request_id}: waiting with num_detached set"
            for seq in group.seqs:
                assert not kv.has_seq(seq.seq_id), (
                    f"{group.request_id} seq {seq.seq_id}: waiting but holds KV"
                )
        for group in self.running:
            assert id(group) in self._unchecked or is_decode_ready(group), (
                f"{group.request_id}: not decode-ready but not marked changed (_unchecked)"
            )
        assert len(self._running_seqs) == len(self._running_seq_ids) == len(self.running), (
            f"{len(self.running)} running groups but {len(self._running_seqs)} sequences and "
            f"{len(self._running_seq_ids)} ids kept next to them"
        )
        for group, seq, seq_id in zip(self.running, self._running_seqs, self._running_seq_ids):
            assert seq.seq_id == seq_id, f"{group.request_id}: kept id {seq_id} for seq {seq.seq_id}"
            if group.num_samples == 1:
                assert len(group.seqs) == 1 and group.seqs[0] is seq, (
                    f"{group.request_id}: kept seq {seq.seq_id} is not its one sequence"
                )
        num_seqs = sum(group.num_samples for group in self.running)
        assert num_seqs == self._seq_budget_used, f"sequence budget {self._seq_budget_used} != {num_seqs}"
        num_live = sum(len(group.seqs) for group in self.running)
        assert self.num_running_seqs() == num_live, (
            f"num_running_seqs {self.num_running_seqs()} != {num_live} live running sequences"
        )

    def group_of(self, seq_id: int) -> SequenceGroup:
        """The group owning a live sequence; KeyError naming the id otherwise."""
        return self._live(seq_id)[0]

    def sequence_of(self, seq_id: int) -> Sequence:
        """A live sequence by id (an executor checking what it stores); KeyError otherwise."""
        return self._live(seq_id)[1]

    def _live(self, seq_id: int) -> tuple[SequenceGroup, Sequence]:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} is not live in the scheduler") from None
