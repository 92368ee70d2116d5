"""Token selection that does not depend on how requests were batched.

Random sampling draws its noise from a generator seeded by (seed, request id, sample
index, position), so the dense reference and every paged variant pick the same token
for the same logits whatever else shared the step. Greedy is a plain argmax.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from the parts' text, the same in every process (unlike hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


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
