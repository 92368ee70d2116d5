"""Stand-in tokens: what a sequence "samples" when the executor returns no logits (simulation).

Tokens are drawn from ``[3, vocab_size)`` by (seed, request, sample, position), so outputs
of different requests do not collide in the prefix cache and a run does not depend on
batching, chunking or preemption. Beams continue one stand-in token each (no ranking
without logits).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np
from numba import njit

from kvbench.engines.sched.scheduler import Scheduler
from kvbench.engines.sched.sequence import Sequence, SequenceGroup
from kvbench.hashing import GOLDEN64, MASK64, mix64_u64, stable_seed
from kvbench.types import TokenEvent

_SAMPLE64 = 0xD1B54A32D192ED03


def stand_in_token(base: int, sample_index: int, position: int, vocab_size: int) -> int:
    """Simulation's stand-in for a sampled token: a SplitMix64 mix of the request's
    ``base`` key, the sample and the output position, drawn from ``[3, vocab_size)``.
    Integer arithmetic only: it runs once per simulated token. Pure."""
    x = (base + (sample_index + 1) * _SAMPLE64 + (position + 1) * GOLDEN64) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return 3 + x % (vocab_size - 3)


def stand_in_tokens(
    bases: SequenceOf[int],
    sample_indexes: SequenceOf[int],
    first_positions: SequenceOf[int],
    num_steps: int,
    vocab_size: int,
) -> np.ndarray:
    """``stand_in_token`` for many sequences and consecutive positions at once: entry
    ``[i, k]`` equals ``stand_in_token(bases[i], sample_indexes[i], first_positions[i] + k,
    vocab_size)`` (uint64 arithmetic wraps mod 2**64 like the masked Python version).
    Returns int64 [len(bases), num_steps]. Pure."""
    out = np.empty((len(bases), num_steps), dtype=np.int64)
    _stand_in_tokens_into(
        np.asarray(bases, dtype=np.uint64),
        np.asarray(sample_indexes, dtype=np.uint64),
        np.asarray(first_positions, dtype=np.uint64),
        vocab_size,
        out,
    )
    return out


@njit(cache=True, nogil=True)
def _stand_in_tokens_into(bases, sample_indexes, first_positions, vocab_size, out):  # pragma: no cover
    """``stand_in_tokens``' loop, compiled: one pass writing ``out`` int64 [seqs, steps]
    (the numpy form built five [seqs, steps] uint64 temporaries per window)."""
    golden = np.uint64(GOLDEN64)
    num_regular = np.uint64(vocab_size - 3)
    for i in range(out.shape[0]):
        x = bases[i] + (sample_indexes[i] + np.uint64(1)) * np.uint64(_SAMPLE64) + first_positions[i] * golden
        for k in range(out.shape[1]):
            x += golden  # position first_positions[i] + k, counted from 1
            out[i, k] = np.int64(mix64_u64(x) % num_regular) + 3


class StandInTokens:
    """Per-request stand-in keys of one engine (``stable_seed(seed, request_id)``, kept
    while the request runs) and the token updates of a logit-less step."""

    __slots__ = ("seed", "vocab_size", "_bases")

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self._bases: dict[str, int] = {}  # request id -> stand-in key

    def base(self, request_id: str) -> int:
        """The request's key (computed on first use). Mutates the key memo."""
        base = self._bases.get(request_id)
        if base is None:
            base = self._bases[request_id] = stable_seed(self.seed, request_id)
        return base

    def bases(self, request_ids: SequenceOf[str]) -> list[int]:
        """``base`` of each request, in order (one pass; keys computed on first use).
        Mutates the key memo."""
        get = self._bases.get
        found = [get(request_id) for request_id in request_ids]
        if None in found:
            found = [self.base(request_id) for request_id in request_ids]
        return found

    def forget(self, request_id: str) -> None:
        """Drop a finished request's key (no-op when it has none)."""
        self._bases.pop(request_id, None)

    def advance(
        self, scheduler: Scheduler, targets: list[tuple[SequenceGroup, Sequence]]
    ) -> list[TokenEvent]:
        """Give every sampling target its stand-in token and apply it through the
        scheduler (forks, beams, finishes), as the engine does with sampled tokens.
        Mutates the scheduler's sequences."""
        if not targets:
            return []
        vocab = self.vocab_size

        def stand_in(group: SequenceGroup, sample_index: int, position: int) -> int:
            return stand_in_token(self.base(group.request_id), sample_index, position, vocab)

        # Each target's own next token, drawn for all in one compiled call: most targets are
        # a lone (or forked) sample taking it, and a scalar draw per target costs more from
        # about four targets on (2.4x at a dozen). A draw depends only on its own sample's
        # state, which no other target's update below changes; beams and forks draw theirs
        # as they go.
        request_ids = [group.request_id for group, _ in targets]
        draws = stand_in_tokens(
            self.bases(request_ids),
            [seq.sample_index for _, seq in targets],
            [seq.num_output_tokens for _, seq in targets],
            1,
            vocab,
        )[:, 0].tolist()
        events: list[TokenEvent] = []
        done_beams: set[int] = set()
        for (group, seq), request_id, token in zip(targets, request_ids, draws):
            if group.is_beam:
                if id(group) in done_beams:
                    continue
                done_beams.add(id(group))
                beams = list(group.seqs) if group.has_forked else [seq] * group.num_samples
                chosen = [
                    (beam, stand_in(group, i, beam.num_output_tokens), 0.0) for i, beam in enumerate(beams)
                ]
                scheduler.advance_beams(group, chosen, [])
                events.extend(TokenEvent(group.request_id, i, t) for i, (_, t, _) in enumerate(chosen))
            elif not group.has_forked and group.num_samples > 1:
                firsts = [stand_in(group, i, 0) for i in range(group.num_samples)]
                scheduler.fork_samples(group, firsts)
                events.extend(TokenEvent(group.request_id, i, t) for i, t in enumerate(firsts))
            else:
                events.append(TokenEvent(request_id, seq.sample_index, token))
                scheduler.append_token(group, seq, token)
        return events
