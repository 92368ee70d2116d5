r"""Per-request decoding state of the paged engine: sequences and the group a request forms.

A request becomes one ``SequenceGroup``. It starts with a single ``Sequence`` (the
prompt); when the prompt's last token has been computed, parallel sampling (``n > 1``)
or beam search (``beam_width > 1``) forks it into several sequences that share the
prompt's KV blocks. Everything here is plain Python (no tensors, no KV accounting):
the scheduler owns the KV manager and mutates these objects.

Token bookkeeping of one sequence::

    token_ids:  [ p0 p1 ... p(P-1) | o0 o1 ... o(k-1) ]
                  <---- prompt ---->   <-- outputs -->
    num_computed_tokens: how many leading tokens have their K/V written in the pool.
    While decoding, num_computed_tokens == len(token_ids) - 1: the newest sampled token
    is fed to the model in the next step.
"""

from __future__ import annotations

import enum
from collections.abc import MutableSequence

import numpy as np

from kvbench.engines.kv.token_ids import ArrayTokenIds, KeyCarrier, KeyedTokenIds
from kvbench.types import FinishedRequest, Request, is_computed_token_ids


class GroupStatus(enum.Enum):
    WAITING = "waiting"  # no KV held: new, or preempted by recompute
    RUNNING = "running"  # every attached live sequence holds its KV blocks on the device
    SWAPPED = "swapped"  # every attached live sequence's own blocks are in the host pool
    FINISHED = "finished"


class Sequence:
    """One token stream (a sample or a beam). Mutable; owned by its group.

    ``token_ids`` is a ``KeyCarrier``: a ``KeyedTokenIds`` list, or an ``ArrayTokenIds``
    over the request's numpy prompt (large traces)."""

    __slots__ = (
        "seq_id",
        "sample_index",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_lost_tokens",
        "cum_logprob",
    )

    def __init__(
        self, seq_id: int, sample_index: int, token_ids: MutableSequence[int], num_prompt_tokens: int
    ) -> None:
        self.seq_id = seq_id
        self.sample_index = sample_index
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        # Tokens whose K/V was computed before a recompute preemption threw it away:
        # computing any of them again counts as recomputation.
        self.num_lost_tokens = 0
        self.cum_logprob = 0.0  # beam score: sum of chosen tokens' log-probabilities

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[self.num_prompt_tokens :])

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def fork(self, seq_id: int, sample_index: int) -> Sequence:
        """A copy with a new id: same tokens, same computed prefix (its KV is shared)."""
        tokens = self.token_ids
        # A KeyCarrier's copy keeps the full blocks' prefix-cache keys (shared by both).
        copied = tokens.copy() if isinstance(tokens, KeyCarrier) else list(tokens)
        child = Sequence(seq_id, sample_index, copied, self.num_prompt_tokens)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_lost_tokens = self.num_lost_tokens
        child.cum_logprob = self.cum_logprob
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, sample={self.sample_index}, len={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens})"
        )


def num_samples(request: Request) -> int:
    """Sequences ``request`` runs at most at once: its beam width for beam search, else
    ``n`` (parallel samples). Pure."""
    return request.beam_width if request.beam_width > 1 else request.n


class SequenceGroup:
    """All sequences of one request plus the per-request counters the engine reports.

    ``seqs`` holds the live sequences, in sample order (parallel sampling) or best-first
    (beam search). Finished samples leave ``seqs`` and their outputs are kept in
    ``finished_outputs`` (sample_index -> tokens) or, for beams, ``finished_beams``
    ((score, tokens) hypotheses).
    """

    __slots__ = (
        "request",
        "arrival_index",
        "seqs",
        "status",
        "has_forked",
        "finished_outputs",
        "finished_beams",
        "num_preemptions",
        "num_recomputed_tokens",
        "num_cached_prompt_tokens",
        "was_scheduled",
        "peak_kv_slots",
        "peak_kv_slots_unshared",
        "eos_token_id",
        "num_detached",
        "num_samples",
        "request_id",
        "is_beam",
        "max_new_tokens",
        "stops_at_eos",
    )

    def __init__(self, request: Request, arrival_index: int, first_seq_id: int, eos_token_id: int) -> None:
        self.request = request
        # Read once per sequence per step: plain attributes of the (immutable) request's.
        self.request_id = request.request_id
        self.is_beam = request.beam_width > 1
        self.max_new_tokens = request.max_new_tokens
        self.stops_at_eos = not request.ignore_eos
        self.num_samples = num_samples(request)  # sequences it runs at most at once
        self.eos_token_id = eos_token_id
        self.arrival_index = arrival_index
        # Append-only token ids that remember their prefix-cache block keys (computed once).
        # A numpy prompt (large traces) stays the request's array (ArrayTokenIds): nothing
        # reads its ids one by one in simulation, and Python int lists of waiting prompts
        # would hold several times the memory. A prompt computed when read stays so until
        # the group is matched or scheduled: a queue of thousands holds no ids.
        prompt = request.prompt_token_ids
        integer_array = isinstance(prompt, np.ndarray) and prompt.dtype.kind in "iu"
        if integer_array or is_computed_token_ids(prompt):
            tokens: ArrayTokenIds | KeyedTokenIds = ArrayTokenIds(prompt)
        else:
            tokens = KeyedTokenIds(prompt)
        self.seqs: list[Sequence] = [Sequence(first_seq_id, 0, tokens, len(prompt))]
        self.status = GroupStatus.WAITING
        self.has_forked = False
        self.finished_outputs: dict[int, tuple[int, ...]] = {}
        self.finished_beams: list[tuple[float, tuple[int, ...]]] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.was_scheduled = False
        # The most KV slots the group held at once, with and without sharing. While the
        # group has one sequence the figures are these fields or that sequence's computed
        # tokens, whichever is larger (``settle_peaks``): after each step a lone sequence
        # holds exactly its computed tokens' slots, and they only grow until a recompute
        # preemption or a fork, which settle the fields first. A group of several
        # sequences keeps the fields current (the scheduler's ``_update_peaks``).
        self.peak_kv_slots = 0
        self.peak_kv_slots_unshared = 0
        # Sequences of a running (or swapped) group that hold no KV yet: after a recompute
        # preemption of a forked group only seqs[0] (the leader) is admitted; the others
        # fork its blocks once it has recomputed their common prefix (the scheduler's
        # "attach"), so the samples share the prompt again instead of each recomputing it.
        self.num_detached = 0

    @property
    def is_done(self) -> bool:
        return not self.seqs

    def is_finished_token(self, seq: Sequence) -> bool:
        """Whether ``seq`` has produced its last token (length limit, or EOS unless ignored)."""
        tokens = seq.token_ids
        num_output_tokens = len(tokens) - seq.num_prompt_tokens  # Sequence.num_output_tokens, read once
        if num_output_tokens >= self.max_new_tokens:
            return True
        return self.stops_at_eos and num_output_tokens > 0 and tokens[-1] == self.eos_token_id

    def settle_peaks(self) -> None:
        """Fold a lone sequence's computed tokens into the peak fields (a no-op for a group
        of several). Call before its computed count drops or the group forks, and
        before reading the fields. Mutates the peak fields."""
        if len(self.seqs) == 1:
            slots = self.seqs[0].num_computed_tokens
            if slots > self.peak_kv_slots:
                self.peak_kv_slots = slots
            if slots > self.peak_kv_slots_unshared:
                self.peak_kv_slots_unshared = slots

    def to_finished(self) -> FinishedRequest:
        """The request's record once every sequence is done; beams best first."""
        self.settle_peaks()
        if self.is_beam:
            ranked = sorted(self.finished_beams, key=lambda beam: -beam[0])[: self.request.beam_width]
            outputs = tuple(tokens for _, tokens in ranked)
        else:
            outputs = tuple(self.finished_outputs[i] for i in sorted(self.finished_outputs))
        return FinishedRequest(
            request_id=self.request_id,
            output_token_ids=outputs,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            num_preemptions=self.num_preemptions,
            num_recomputed_tokens=self.num_recomputed_tokens,
            peak_kv_slots=self.peak_kv_slots,
            peak_kv_slots_unshared=self.peak_kv_slots_unshared,
        )

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, {self.status.value}, seqs={self.seqs})"
