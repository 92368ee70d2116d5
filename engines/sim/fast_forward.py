"""The simulation fast path: one engine ``step`` covering a run of plain decode steps.

This is the boundary between the engine and the fast path. ``PagedEngine`` builds a
``FastForward`` in simulation mode (cost-model executor, a manager offering decode runs:
the plain ``PagedKVManager`` or the slab's ``SlabKVManager``) and calls ``run`` when the
runner has told it when the next request arrives. Everything the run does goes through
declared calls:

- the scheduler's decode-run interface (``Scheduler.decode_batch``, ``append_decodes``,
  ``admit_after_decodes`` or ``plan_tail_after_decodes`` / ``complete_step`` (a run's
  first step that admits or plans the batch's prefilling tail),
  ``quiet_decode_steps``, ``complete_decodes`` / ``complete_decodes_many`` /
  ``finish_decodes``),
- the KV manager's ``DecodeRunKV`` contract and its ``DecodeRun``
  (``engines/kv/protocol.py``; ``PagedDecodeRun`` in ``kv/paged.py``, ``SlabDecodeRun``
  in ``kv/slab.py``),
- the cost model's ``decode_run_s`` and ``CostModelExecutor.record_steps``,
- the engine's ``step_stats`` (passed in as ``stats``).

Invariant: a run leaves the scheduler, KV manager, prefix index, executor totals and
recorded steps exactly as stepping one iteration per call would (``fast_forward=False``);
``tests/test_sim_fast_forward.py`` compares both at this boundary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import Any, ClassVar

import numpy as np

from kvbench.engines.kv.protocol import DecodeRun, DecodeRunKV
from kvbench.engines.sched.scheduler import DecodeBatch, Scheduler, SchedulerOutput
from kvbench.engines.sched.sequence import Sequence, SequenceGroup
from kvbench.engines.sim.executor import CostModelExecutor
from kvbench.engines.sim.stand_in import StandInTokens, stand_in_tokens
from kvbench.sim.cost_model import CostModel, StepShape
from kvbench.types import CoveredSteps, StepOutput, StepStats

# Most steps one decode run covers (one StepOutput): runs end at the first finish,
# arrival, admission or preemption anyway; the cap bounds one output's size.
MAX_DECODE_RUN_STEPS = 1024
# A run's first window of modeled steps (then 2x, 4x, ...: _ModeledSteps) holds at least
# this many steps and at least FIRST_DECODE_WINDOW_TOKENS tokens (steps x sequences), or
# every step the run may take where that is fewer. Runs often end within a few steps, so
# modeling all MAX_DECODE_RUN_STEPS up front would mostly be wasted; but a window costs
# about the same up to a thousand tokens (its calls' fixed cost), so a small batch's first
# window is longer.
FIRST_DECODE_WINDOW = 8
FIRST_DECODE_WINDOW_TOKENS = 1024

# Sequences a decode batch needs before its run's first step also takes the prefill chunk
# of a group behind it (``DecodeBatch.tail``); with fewer, that step is a normal one. Both
# give the same step; this is speed only. A run's setup and covered output cost about
# 100 us a step more than a normal step's, whose plan, chunks, commits and token events
# cost about 2 us more per batch sequence, so a tail pays behind large batches only.
# Interleaved replays, tails on against off (thread CPU time, min / median / max of the
# ratio): ShareGPT-like traffic in 512-token steps (batches up to about 220 sequences)
# 0.52 / 0.58 / 0.70 over 7 rounds; Mooncake (batches of 8-31) with every tail taken
# 1.07 / 1.13 / 1.30 over 5.
MIN_SEQS_BEFORE_TAIL = 64

# The engine's StepStats builder: (counters before, counters after, keyword figures).
StatsFn = Callable[..., StepStats]


def _finishing(
    to_limit: np.ndarray, step: int, eos_rows: np.ndarray | None, step_tokens: np.ndarray, eos: int
) -> list[int]:
    """Which sequences produce their last token in the run's step ``step`` (counting from
    1): their length limit (``to_limit``: steps to it) or EOS where checked (``eos_rows``;
    ``step_tokens``: that step's tokens). Ascending indexes. Pure."""
    done = to_limit <= step
    if eos_rows is not None:
        done |= eos_rows & (step_tokens == eos)
    return done.nonzero()[0].tolist()


@dataclasses.dataclass(frozen=True, slots=True)
class BatchColumns:
    """What a decode run reads of each sequence of its batch, in batch order ([seq] arrays)."""

    lengths: np.ndarray  # int64: tokens, the newest (which lacks KV) included
    num_prompt_tokens: np.ndarray  # int64
    max_new_tokens: np.ndarray  # int64: the group's output limit
    stops_at_eos: np.ndarray  # bool: whether EOS ends the sequence
    samples: np.ndarray  # int64: sample indexes
    bases: np.ndarray  # uint64: the requests' stand-in token keys (StandInTokens.bases)
    request_ids: np.ndarray  # object (str)

    @classmethod
    def read(cls, pairs: list[tuple[SequenceGroup, Sequence]], tokens: StandInTokens) -> BatchColumns:
        """Read from the objects: ``pairs`` in decode state (``Scheduler.decode_batch``),
        whose length is its computed count + 1 (an attribute read; len() of a numpy
        prompt's ArrayTokenIds is a Python call). Mutates the stand-in key memo."""
        request_ids = [group.request_id for group, _ in pairs]
        return cls(
            lengths=np.array([seq.num_computed_tokens for _, seq in pairs], dtype=np.int64) + 1,
            num_prompt_tokens=np.array([seq.num_prompt_tokens for _, seq in pairs], dtype=np.int64),
            max_new_tokens=np.array([group.max_new_tokens for group, _ in pairs], dtype=np.int64),
            stops_at_eos=np.array([group.stops_at_eos for group, _ in pairs], dtype=bool),
            samples=np.array([seq.sample_index for _, seq in pairs], dtype=np.int64),
            bases=np.array(tokens.bases(request_ids), dtype=np.uint64),
            request_ids=np.array(request_ids, dtype=object),
        )

    def take(self, rows: np.ndarray, fresh: BatchColumns | None, at: np.ndarray) -> BatchColumns:
        """Rows ``rows`` (int64 [seq]) of these columns, except the entries at ``at``
        (ascending), which come from ``fresh`` in order (None: ``at`` is empty). Pure."""
        if fresh is None:
            return BatchColumns(*[mine[rows] for mine in self.arrays()])
        columns = []
        for mine, theirs in zip(self.arrays(), fresh.arrays()):
            out = mine[rows]
            out[at] = theirs
            columns.append(out)
        return BatchColumns(*columns)

    def advanced(self, num_steps: int) -> BatchColumns:
        """These columns after ``num_steps`` decode steps (each adds a token). Pure."""
        # Built directly: dataclasses.replace reads the fields' metadata on every call,
        # once per decode run.
        lengths, *others = self.arrays()
        return BatchColumns(lengths + num_steps, *others)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The columns in field order. Pure."""
        return (
            self.lengths,
            self.num_prompt_tokens,
            self.max_new_tokens,
            self.stops_at_eos,
            self.samples,
            self.bases,
            self.request_ids,
        )

    def same_as(self, other: BatchColumns) -> bool:
        """Whether every column is equal, element by element. Pure."""
        return all(np.array_equal(mine, theirs) for mine, theirs in zip(self.arrays(), other.arrays()))


# Changed sequences a run clears from its carried rows one ``list.index`` scan each; past
# this many, one pass over the batch (the scans would grow with the square of the batch).
_FEW_CHANGED = 8


@dataclasses.dataclass(frozen=True, slots=True)
class _Carry:
    """What a run knew of its batch when it ended, for the next run over the same
    sequences (``DecodeBatch``): its sequence ids sorted (``sorted_ids``, int64 [seq]) and
    the row of each (``rows_by_id``, int64 [seq]), the columns (lengths as of the end)
    and the KV run. (Sorted arrays, not a dict by id: a run reads its rows with one
    ``searchsorted`` instead of a Python call per sequence, and building a dict of a
    batch cost about as much.)"""

    sorted_ids: np.ndarray
    rows_by_id: np.ndarray
    columns: BatchColumns
    run: DecodeRun

    @classmethod
    def of(cls, seq_ids: np.ndarray, columns: BatchColumns, run: DecodeRun) -> _Carry:
        """The carry of a batch of ``seq_ids`` (int64 [seq], distinct, in row order). Pure."""
        order = seq_ids.argsort()  # the method: np.argsort adds a Python-level dispatch per call
        return cls(seq_ids[order], order, columns, run)

    def rows(
        self, seq_ids: list[int], id_array: np.ndarray, changed: SequenceOf[SequenceGroup]
    ) -> np.ndarray:
        """The carried row of each of ``seq_ids`` (``id_array``: the same as int64 [n]), -1
        for a sequence the carried batch did not hold or of a group in ``changed`` (whose
        carried values may be stale). A new array. Pure."""
        known = self.sorted_ids
        if not len(known):
            return np.full(len(id_array), -1, dtype=np.int64)
        at = known.searchsorted(id_array)  # (the method, as argsort in ``of``)
        np.minimum(at, len(known) - 1, out=at)  # past the last: compared below, unequal
        rows = np.where(known[at] == id_array, self.rows_by_id[at], -1)
        if not changed:
            return rows
        changed_ids = [seq.seq_id for group in changed for seq in group.seqs]
        if len(changed_ids) <= _FEW_CHANGED:
            for seq_id in changed_ids:  # list.index: one C scan each, no numpy call
                if seq_id in seq_ids:  # else it left the batch
                    rows[seq_ids.index(seq_id)] = -1
        else:  # e.g. every group after a normal step: one pass, not one scan per id
            changed_set = set(changed_ids)
            for index, seq_id in enumerate(seq_ids):
                if seq_id in changed_set:
                    rows[index] = -1
        return rows


class RunLog:
    """A decode run's covered steps as they go: durations, KV counts, evictions, tokens."""

    __slots__ = (
        "request_ids",
        "samples",
        "context",
        "queues",
        "durations_s",
        "counts",
        "evicted",
        "token_blocks",
    )

    def __init__(
        self, request_ids: list[str], samples: list[int], context: int, queues: tuple[int, int]
    ) -> None:
        self.request_ids = request_ids  # per sequence of the run, in batch order
        self.samples = samples
        self.context = context  # KV tokens the batch reads in the run's first step
        # Waiting and swapped groups, unchanged by the run's covered steps (a later step
        # that would admit a group is left to the next normal step, which pops it from the
        # queue; a first step that admits is an _admission_step, not logged here).
        self.queues = queues
        self.durations_s: list[float] = []
        self.counts: list[tuple[int, ...]] = []  # the KV manager's usage_counts after each step
        self.evicted: list[int] = []  # cached blocks each step reused
        # The steps' tokens: int64 [seq] columns (one step) and [seq, step] blocks, in order.
        self.token_blocks: list[np.ndarray] = []

    def add(self, step_tokens: np.ndarray, duration_s: float, counts: tuple[int, ...], evicted: int) -> None:
        """Record one step: a token per sequence (int64 [seq]), its time, KV counts and evictions."""
        self.durations_s.append(duration_s)
        self.counts.append(counts)
        self.evicted.append(evicted)
        self.token_blocks.append(step_tokens[:, None])

    def add_many(
        self, token_block: np.ndarray, durations_s: list[float], reserved: list[tuple[int, ...]]
    ) -> None:
        """Record steps taken together: tokens int64 [seq, step] and ``DecodeRun.advance_many``'s
        per-step counts."""
        self.durations_s.extend(durations_s)
        self.counts.extend([entry[:-1] for entry in reserved])
        self.evicted.extend([entry[-1] for entry in reserved])
        self.token_blocks.append(token_block)

    def finish(self, kv: DecodeRunKV, stats: StatsFn) -> CoveredSteps | None:
        """The run's steps as ``StepOutput.covered_steps`` (None when none was taken; the
        template is the last step's stats). Pure."""
        num_steps = len(self.durations_s)
        if not num_steps:
            return None
        num_seqs = len(self.request_ids)
        last = num_steps - 1
        # Each step decodes one more token per sequence than the last.
        contexts = range(self.context, self.context + num_steps * num_seqs, num_seqs)
        template = stats(
            (0, 0, 0),  # prefix queries and hits: none in a run; evictions: the last step's
            (0, 0, self.evicted[last]),
            num_prefill_tokens=0,
            num_decode_tokens=num_seqs,
            shape=StepShape(num_decode_seqs=num_seqs, num_decode_context_tokens=contexts[last]),
            usage=kv.usage_of(*self.counts[last]),
            num_running=num_seqs,
            queues=self.queues,
        )
        # Columns only where steps differ: a single step is its template, as in
        # _admission_step (the recorder repeats template values for steps without one).
        columns: dict[str, SequenceOf[Any]] = {}
        if num_steps > 1:
            columns.update(kv.usage_columns(self.counts))
            columns["num_evicted_blocks"] = self.evicted
            columns["num_decode_context_tokens"] = contexts
        return CoveredSteps(
            durations_s=tuple(self.durations_s),
            template=template,
            columns=columns,
            request_ids=tuple(self.request_ids),
            sample_indexes=tuple(self.samples),
            token_ids=np.concatenate(self.token_blocks, axis=1),
        )


class _ModeledSteps:
    """A decode run's steps as modeled so far: run step ``t`` (counting from 0) takes
    ``durations[t]`` seconds (the cost model's) and produces ``tokens[:, t]`` (stand-in
    tokens, int64 [seq, step]) for ``t`` below ``len(durations)``.

    ``more`` models the next window of steps (the first: FIRST_DECODE_WINDOW steps or
    FIRST_DECODE_WINDOW_TOKENS tokens, whichever is more; then twice the last), up to
    ``limit`` steps: the run's cap, lowered to ``eos_step`` once a window holds the first
    step (counting from 1) in which a sequence checked for EOS samples it, which finishes
    it (the run's last). It extends ``durations`` in place (the run holds the list) and
    replaces ``tokens``. The run asks for more only when it takes a step not modeled yet,
    so a run of reserved steps (``DecodeRun.advance_many``) is not cut at a window's end."""

    __slots__ = (
        "durations",
        "tokens",
        "eos_step",
        "_limit",
        "_window",
        "_cost_model",
        "_context",
        "_bases",
        "_samples",
        "_positions",
        "_vocab_size",
        "_eos_rows",
        "_eos",
    )

    def __init__(
        self,
        limit: int,
        cost_model: CostModel,
        context: int,
        bases: np.ndarray,
        samples: np.ndarray,
        positions: np.ndarray,
        vocab_size: int,
        eos_rows: np.ndarray | None,
        eos: int,
    ) -> None:
        """``limit``: most steps; ``context``: the batch's context tokens in step 0 (its
        sequences' lengths, the token decoded included); per sequence ([seq] arrays): its
        stand-in key (uint64), sample index and outputs so far (int64), and whether EOS
        ends it (``eos_rows``, bool; None: for none)."""
        self.durations: list[float] = []
        self.tokens = np.empty((len(bases), 0), dtype=np.int64)
        self._limit = limit
        self.eos_step: int | None = None
        self._window = max(FIRST_DECODE_WINDOW, -(-FIRST_DECODE_WINDOW_TOKENS // len(bases)))
        self._cost_model = cost_model
        self._context = context
        self._bases = bases
        self._samples = samples
        self._positions = positions
        self._vocab_size = vocab_size
        self._eos_rows = eos_rows
        self._eos = eos

    def more(self) -> bool:
        """Model the next window; False, changing nothing, when every step up to the cap
        (``limit``, or ``eos_step`` once found) is modeled. Mutates itself."""
        first = len(self.durations)
        if first >= self._limit:
            return False
        size = min(self._window, self._limit - first)
        self._window *= 2
        num_seqs = len(self._bases)
        durations = self._cost_model.decode_run_s(num_seqs, self._context + first * num_seqs, size).tolist()
        tokens = stand_in_tokens(self._bases, self._samples, self._positions + first, size, self._vocab_size)
        if self._eos_rows is not None:
            eos_hits = (tokens[self._eos_rows] == self._eos).any(axis=0)
            if eos_hits.any():
                size = int(eos_hits.argmax()) + 1
                self._limit = self.eos_step = first + size
                del durations[size:]
                tokens = tokens[:, :size]
        self.durations += durations
        # (A run of reserved steps may span windows: one array, the steps' columns in order.)
        self.tokens = np.concatenate([self.tokens, tokens], axis=1) if first else tokens
        return True


class FastForward:
    """Decode runs of one engine (module docstring). Holds two things between runs:
    ``prepared_counters``, the KV counters before a step a run began but could not take
    as a plain decode step (the scheduler keeps that step's plan for the next normal
    ``step``, whose stats count from there); and what the last run knew of its batch
    (``_Carry``), which the next run takes instead of reading again for every sequence
    its ``DecodeBatch`` does not report changed."""

    # Differential check (tests): build every carried batch fresh as well and raise
    # AssertionError where the two differ.
    verify_carry: ClassVar[bool] = False
    # Scheduler.decode_batch's min_seqs_before_tail (tests lower it to cover tails in
    # small batches).
    min_seqs_before_tail: ClassVar[int] = MIN_SEQS_BEFORE_TAIL

    def __init__(
        self,
        scheduler: Scheduler,
        kv: DecodeRunKV,
        executor: CostModelExecutor,
        tokens: StandInTokens,
        eos_token_id: int,
        stats: StatsFn,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.executor = executor
        self.tokens = tokens
        self.eos_token_id = eos_token_id
        self.stats = stats
        self.prepared_counters: tuple[int, int, int] | None = None
        self._carry: _Carry | None = None

    def _columns_and_run(
        self, batch: DecodeBatch, id_array: np.ndarray, carry: _Carry | None
    ) -> tuple[BatchColumns, DecodeRun | None]:
        """The batch's columns and KV run (None: a copy-on-write ahead), carried from
        ``carry`` for the sequences it knew and the batch does not report changed, read
        for the others. ``id_array``: the batch's ``seq_ids`` as int64 [seq]. Mutates the
        stand-in key memo."""
        pairs, seq_ids, kv, tokens = batch.pairs, batch.seq_ids, self.kv, self.tokens
        if carry is None:
            return BatchColumns.read(pairs, tokens), kv.try_decode_run(seq_ids)
        rows = carry.rows(seq_ids, id_array, batch.changed)
        fresh_at = (rows < 0).nonzero()[0]
        fresh = (
            BatchColumns.read([pairs[index] for index in fresh_at.tolist()], tokens)
            if fresh_at.size
            else None
        )
        columns = carry.columns.take(rows, fresh, fresh_at)
        run = kv.try_decode_run(seq_ids, carry.run, rows)
        if self.verify_carry:
            assert columns.same_as(BatchColumns.read(pairs, tokens)), (
                "carried batch columns differ from a fresh read"
            )
            fresh_run = kv.try_decode_run(seq_ids)
            assert (run is None) == (fresh_run is None), (
                "a carried run and a fresh one disagree on copy-on-write"
            )
            assert run is None or fresh_run is None or run.snapshot() == fresh_run.snapshot(), (
                "the carried KV run differs from a fresh one"
            )
        return columns, run

    def run(self, now_s: float, next_arrival_s: float) -> StepOutput | None:
        """Take consecutive plain decode steps in one call.

        A run continues while the batch stays the same: every sequence of the batch
        decodes one token, no block is copied or swapped, the KV manager has the slots
        the step needs (``DecodeRun.can_advance``: no preemption), the head of the
        waiting queue still cannot start, and the step starts before ``next_arrival_s``.
        The first step in which a sequence produces its last token (its length limit or
        EOS) is the run's last: those sequences retire after it, in batch order, as
        ``StandInTokens.advance`` retires them. Each step updates the scheduler, KV
        manager and prefix index exactly as a single ``step`` would, without planning
        chunks or modeling each step separately: step times come from cost-model calls
        over windows of steps, stand-in tokens and the first EOS from vectorised draws,
        and the KV side from a ``DecodeRun``. Steps in which the waiting head provably
        cannot start (``Scheduler.quiet_decode_steps``) are reserved and completed
        together; the others one at a time, checking the head. The run's first step may
        also admit waiting groups, and a batch with a ``tail`` (``DecodeBatch.tail``: the
        last running group, prefilling behind the batch) takes only that first step, the
        tail's chunk planned after the batch (``Scheduler.plan_tail_after_decodes``);
        ``_admission_step`` completes such a step. Returns None when not even the first
        step qualifies (the caller steps normally); a later step that turns out to admit a
        waiting group, or a first step whose tail preempts itself, is left planned in the
        scheduler for that normal step.
        Mutates the scheduler, the KV manager, the executor's totals and the token keys.
        """
        scheduler = self.scheduler
        batch = scheduler.decode_batch(self.min_seqs_before_tail)
        carry, self._carry = self._carry, None  # a run that does not start voids it
        if batch is None:
            return None
        pairs, seqs = batch.pairs, batch.seqs
        id_array = np.fromiter(batch.seq_ids, np.int64, len(seqs))  # the carry's key
        columns, run = self._columns_and_run(batch, id_array, carry)
        if run is None:
            return None  # a copy-on-write ahead: a normal step
        kv = self.kv
        tokens_of = self.tokens
        # Steps up to the first finish by length: the step producing a sequence's last
        # token (step ``max_new_tokens - num_output_tokens``, counting from 1) ends the run.
        lengths = columns.lengths
        positions = lengths - columns.num_prompt_tokens  # outputs so far
        # Steps until each sequence's length limit (its last token in step ``to_limit``).
        to_limit = columns.max_new_tokens - positions
        # (Reductions by the ufuncs' own methods: ndarray.min/sum/any go through numpy's
        # Python-level wrappers, which cost more than the reduction of a batch.)
        finish_step = min(MAX_DECODE_RUN_STEPS + 1, int(np.minimum.reduce(to_limit)))
        request_ids = columns.request_ids.tolist()
        samples = columns.samples.tolist()
        tail = batch.tail
        # A batch with a tail (a group prefilling behind it) takes only its first step.
        max_steps = 1 if tail is not None else min(finish_step, MAX_DECODE_RUN_STEPS)
        executor = self.executor
        context = int(np.add.reduce(lengths))
        eos = self.eos_token_id
        check_eos = columns.stops_at_eos
        eos_rows = check_eos if np.logical_or.reduce(check_eos) else None
        commit_phases = scheduler.decode_commit_phases(lengths)
        log = RunLog(
            request_ids,
            samples,
            context,
            (len(scheduler.waiting), len(scheduler.swapped)),
        )
        modeled = _ModeledSteps(
            max_steps,
            executor.cost_model,
            context,
            columns.bases,
            columns.samples,
            positions,
            tokens_of.vocab_size,
            eos_rows,
            eos,
        )
        durations = modeled.durations  # grows in place as steps are modeled
        start_s = now_s  # summed one step at a time, as the clock does
        offset = 0  # steps taken
        quiet = 0  # steps ahead known not to admit anything (reserved together)
        # (The arrival is submitted before a step that would start at or after it.)
        while start_s < next_arrival_s and (offset < len(durations) or modeled.more()):
            if quiet:
                # Steps the head surely cannot join (see Scheduler.quiet_decode_steps):
                # reserve them together, up to the arrival, modeling more as needed.
                num = 1
                end_s = start_s + durations[offset]
                while (
                    num < quiet
                    and end_s < next_arrival_s
                    and (offset + num < len(durations) or modeled.more())
                ):
                    end_s += durations[offset + num]
                    num += 1
                token_block = modeled.tokens[:, offset : offset + num]  # [seq, step]
                step_commits = scheduler.complete_decodes_many(seqs, token_block.tolist())
                reserved = run.advance_many(num, step_commits)
                log.add_many(token_block, durations[offset : offset + num], reserved)
                quiet -= num
                offset += num
                start_s = end_s
                continue
            if not run.can_advance():
                break  # a preemption: a normal step
            counters0 = (kv.num_prefix_query_tokens, kv.num_prefix_hit_tokens, kv.num_evicted_blocks)
            if offset == 0:
                # The run's first step: one that admits a waiting group or plans the tail
                # is taken here.
                if tail is None:
                    plan = scheduler.admit_after_decodes(pairs, run)
                else:
                    plan = scheduler.plan_tail_after_decodes(pairs, run, tail)
                    if plan is None:
                        # The tail preempted itself: the scheduler keeps the step's plan for
                        # the next normal step, whose stats count from here.
                        self.prepared_counters = counters0
                        break
                if plan is not None:
                    # The batch decodes this one step; the tail and the admitted groups are
                    # changes.
                    self._carry = _Carry.of(id_array, columns.advanced(1), run)
                    first_tokens = modeled.tokens[:, 0]
                    return self._admission_step(
                        batch,
                        plan,
                        counters0,
                        first_tokens,
                        context,
                        request_ids,
                        samples,
                        commit_phases,
                        _finishing(to_limit, 1, eos_rows, first_tokens, eos),
                    )
            elif not scheduler.append_decodes(pairs, run):
                # A waiting group starts in this step: the scheduler keeps its plan for
                # the next normal step, whose stats count from here.
                self.prepared_counters = counters0
                break
            quiet = scheduler.quiet_decode_steps(pairs, run, max_steps - offset - 1)
            step_tokens, duration_s = modeled.tokens[:, offset], durations[offset]  # one per sequence
            scheduler.complete_decodes(seqs, step_tokens.tolist(), commit_phases, offset)
            log.add(step_tokens, duration_s, kv.usage_counts(), kv.num_evicted_blocks - counters0[2])
            offset += 1
            start_s += duration_s
        # The next run carries the batch on from here (a step reserved but left to a
        # normal step, append_decodes' False, changes every group of the batch).
        self._carry = _Carry.of(id_array, columns.advanced(offset), run)
        # Sequences finish only in the run's last step (``finish_step``: the first to reach a
        # length limit or sample EOS), once it is taken.
        if modeled.eos_step is not None:
            finish_step = modeled.eos_step  # <= max_steps <= the length limits' finish_step
        if offset == finish_step:
            candidates = _finishing(to_limit, offset, eos_rows, modeled.tokens[:, offset - 1], eos)
        else:
            candidates = []
        scheduler.finish_decodes(pairs, candidates)
        finished = scheduler.pop_finished()
        for done in finished:
            tokens_of.forget(done.request_id)
        covered = log.finish(kv, self.stats)
        if covered is None:
            return None
        executor.record_steps(covered.durations_s)
        return StepOutput(
            tokens=(),
            first_scheduled=(),
            finished=tuple(finished),
            rejected=(),
            stats=covered.template,
            modeled_duration_s=math.fsum(covered.durations_s),
            covered_steps=covered,
        )

    def _admission_step(
        self,
        batch: DecodeBatch,
        plan: SchedulerOutput,
        counters0: tuple[int, int, int],
        step_tokens: np.ndarray,
        context: int,
        request_ids: list[str],
        samples: list[int],
        commit_phases: np.ndarray,
        candidates: list[int],
    ) -> StepOutput:
        """Take a step in which the decode batch ``batch`` (slots reserved) runs next to
        ``plan``, the rest of the step as ``Scheduler.admit_after_decodes`` or
        ``plan_tail_after_decodes`` planned it (the batch's tail's chunk, admissions), in
        the order a normal step completes it: the batch's commits and tokens
        (``step_tokens``, one per pair), the plan's chunks, the KV usage as executed, then
        the batch's finished sequences, then the plan's sampled tokens. ``context``: the
        batch's decode context (its sequences' lengths, the token decoded included);
        ``request_ids`` and ``samples``: its sequences' requests and sample indexes;
        ``commit_phases``: the batch's ``Scheduler.decode_commit_phases``;
        ``candidates``: the pairs whose token may finish them (``finish_decodes``).
        Returns the step as one covered step (the batch's tokens) with the plan's token
        events. Mutates the scheduler, KV manager, executor totals and stand-in keys."""
        scheduler, kv = self.scheduler, self.kv
        pairs = batch.pairs
        # A plan after a decode batch only plans the tail and admits: nothing is swapped,
        # nothing preempted (a tail that preempts itself leaves its step to a normal one).
        assert not plan.num_preemptions and all(not op.swap_in and not op.swap_out for op in plan.kv_ops)
        num_seqs = len(pairs)
        shape = dataclasses.replace(
            plan.shape,
            num_decode_seqs=plan.shape.num_decode_seqs + num_seqs,
            num_decode_context_tokens=plan.shape.num_decode_context_tokens + context,
        )
        duration_s = self.executor.cost_model.duration_s(shape)
        tokens = step_tokens.tolist()
        scheduler.complete_decodes(batch.seqs, tokens, commit_phases, 0)
        targets = scheduler.complete_step()
        usage = kv.usage()
        num_running = scheduler.num_running_seqs()
        scheduler.finish_decodes(pairs, candidates)
        events = self.tokens.advance(scheduler, targets) if targets else []
        finished = scheduler.pop_finished()
        for done in finished:
            self.tokens.forget(done.request_id)
        stats = self.stats(
            counters0,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens + num_seqs,
            shape=shape,
            num_recomputed_tokens=plan.num_recomputed_tokens,
            usage=usage,
            num_running=num_running,
        )
        covered = CoveredSteps(
            durations_s=(duration_s,),
            template=stats,
            columns={},
            request_ids=tuple(request_ids),
            sample_indexes=tuple(samples),
            token_ids=step_tokens[:, None],
        )
        self.executor.record_steps(covered.durations_s)
        return StepOutput(
            tokens=tuple(events),
            first_scheduled=plan.first_scheduled,
            finished=tuple(finished),
            rejected=plan.rejected,
            stats=stats,
            modeled_duration_s=duration_s,
            covered_steps=covered,
        )
