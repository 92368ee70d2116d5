"""Token selection from logits that does not depend on how requests were batched.

Random sampling draws its noise from a generator seeded by (seed, request id, sample
index, position), so the dense reference and every paged variant pick the same token
for the same logits whatever else shared the step. Greedy is a plain argmax. Beams are
ranked jointly every step (``rank_beam_candidates``).

``LogitsTokens`` is the paged engine's token update of a step that produced logits (real
mode); a logit-less step (simulation) takes ``engines/sim/stand_in.StandInTokens`` instead,
so simulation never imports this module (it imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvbench.hashing import stable_seed
from kvbench.types import TokenEvent

if TYPE_CHECKING:
    from kvbench.engines.sched.scheduler import Scheduler
    from kvbench.engines.sched.sequence import Sequence, SequenceGroup


@dataclass(frozen=True)
class SampleKey:
    """Identifies one draw: which request, which sample of it, which output position."""

    request_id: str
    sample_index: int
    position: int
    temperature: float


class Sampler:
    """Picks next tokens from fp32 logits. Stateless apart from the base seed."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def sample(self, logits: Tensor, keys: list[SampleKey]) -> list[int]:
        """logits: [N, vocab] fp32, one row per key -> N token ids. Mutates nothing."""
        tokens = torch.argmax(logits, dim=-1).tolist()
        for row, key in enumerate(keys):
            if key.temperature > 0.0:
                generator = torch.Generator().manual_seed(
                    stable_seed(self.seed, key.request_id, key.sample_index, key.position)
                )
                uniform = torch.rand(logits.shape[1], generator=generator).clamp_(1e-20, 1.0)
                # Gumbel-max: argmax(logits / T + Gumbel noise) samples softmax(logits / T).
                gumbel = -torch.log(-torch.log(uniform))
                tokens[row] = int(torch.argmax(logits[row].cpu() / key.temperature + gumbel))
        return tokens


def log_softmax(logits: Tensor) -> Tensor:
    """[N, vocab] fp32 logits -> log-probabilities (for beam search scores)."""
    return torch.log_softmax(logits.float(), dim=-1)


def rank_beam_candidates(
    logprobs: Tensor, cum_logprobs: list[float], beam_width: int, eos_token_id: int | None
) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
    """Best continuations of a beam step.

    logprobs: fp32 [num_beams, vocab]; cum_logprobs: each beam's score so far. Scores add
    in float64. Candidates are ranked by score, ties by (beam, token). Returns ``chosen``:
    the first ``beam_width`` non-EOS candidates (beam, token, score), best first, and
    ``finished``: EOS candidates ranked within the top ``beam_width`` (only when
    ``eos_token_id`` is not None, i.e. EOS is not ignored). Mutates nothing.
    """
    num_beams, vocab = logprobs.shape
    scores = (
        logprobs.double() + torch.tensor(cum_logprobs, dtype=torch.float64, device=logprobs.device)[:, None]
    )
    k = min(2 * beam_width, num_beams * vocab)
    values, flat = torch.topk(scores.flatten(), k)
    ranked = sorted(zip(values.tolist(), flat.tolist()), key=lambda c: (-c[0], c[1]))
    chosen: list[tuple[int, int, float]] = []
    finished: list[tuple[int, int, float]] = []
    for rank, (score, index) in enumerate(ranked):
        beam, token = divmod(index, vocab)
        if eos_token_id is not None and token == eos_token_id:
            if rank < beam_width:
                finished.append((beam, token, score))
            continue
        chosen.append((beam, token, score))
        if len(chosen) == beam_width:
            break
    return chosen, finished


class LogitsTokens:
    """The token updates of a step that produced logits: sample every target with
    ``SampleKey(request_id, sample_index, output position, temperature)`` (the dense
    reference's keys), fork parallel samples after the prompt's last token, rank beams
    jointly. Stateless apart from the sampler's seed and the model's EOS id."""

    def __init__(self, seed: int, eos_token_id: int | None) -> None:
        self.sampler = Sampler(seed)
        self.eos_token_id = eos_token_id

    def advance(
        self, scheduler: Scheduler, targets: list[tuple[SequenceGroup, Sequence]], logits: Tensor
    ) -> list[TokenEvent]:
        """Pick the next token of every target from its row of ``logits`` ([len(targets),
        vocab] fp32) and apply it through the scheduler (forks, beams, finishes). Mutates
        the scheduler's sequences."""
        rows: list[int] = []
        keys: list[SampleKey] = []
        beams: dict[int, tuple[SequenceGroup, list[int]]] = {}
        for row, (group, seq) in enumerate(targets):
            request = group.request
            if group.is_beam:
                beams.setdefault(id(group), (group, []))[1].append(row)
            elif not group.has_forked and group.num_samples > 1:
                # The prompt's last logits give every sample its first token.
                for index in range(group.num_samples):
                    keys.append(SampleKey(request.request_id, index, 0, request.temperature))
                    rows.append(row)
            else:
                keys.append(
                    SampleKey(
                        request.request_id, seq.sample_index, seq.num_output_tokens, request.temperature
                    )
                )
                rows.append(row)
        events: list[TokenEvent] = []
        if keys:
            index_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            tokens = self.sampler.sample(logits.index_select(0, index_t), keys)
            cursor = 0
            for group, seq in targets:
                if group.is_beam:
                    continue
                if not group.has_forked and group.num_samples > 1:
                    firsts = tokens[cursor : cursor + group.num_samples]
                    cursor += group.num_samples
                    scheduler.fork_samples(group, firsts)
                    events.extend(TokenEvent(group.request_id, i, t) for i, t in enumerate(firsts))
                else:
                    token = tokens[cursor]
                    cursor += 1
                    events.append(TokenEvent(group.request_id, seq.sample_index, token))
                    scheduler.append_token(group, seq, token)
        for group, group_rows in beams.values():
            seqs = [targets[r][1] for r in group_rows]
            events.extend(self._advance_beams(scheduler, group, seqs, logits, group_rows))
        return events

    def _advance_beams(
        self,
        scheduler: Scheduler,
        group: SequenceGroup,
        seqs: list[Sequence],
        logits: Tensor,
        rows: list[int],
    ) -> list[TokenEvent]:
        request = group.request
        index_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logprobs = log_softmax(logits.index_select(0, index_t))  # [num_beams, vocab]
        eos = None if request.ignore_eos else self.eos_token_id
        chosen, finished = rank_beam_candidates(
            logprobs, [s.cum_logprob for s in seqs], request.beam_width, eos
        )
        scheduler.advance_beams(
            group,
            [(seqs[beam], token, score) for beam, token, score in chosen],
            [(score, (*seqs[beam].output_token_ids, token)) for beam, token, score in finished],
        )
        return [TokenEvent(request.request_id, rank, token) for rank, (_, token, _) in enumerate(chosen)]
