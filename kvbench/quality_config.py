"""What the lossy-cache quality harness runs (``quality.*`` keys): a torch-free record, so
the configuration layer (``kvbench.config``) and commands that never run a model
(``kvbench size``) can read and check it without importing torch (``kvbench.quality``
runs the harness itself).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QualityConfig:
    """What the harness runs. Token counts are in model tokens.

    ``num_prompt_tokens`` is the candidate's prefill of the teacher-forced text (1 feeds
    every token alone); scoring starts at the last prompt token's prediction, so the
    full-attention prefill does not dilute the metrics.
    """

    num_text_tokens: int | None = None  # None: the whole text
    num_prompt_tokens: int = 1
    reference_chunk_tokens: int = 256
    num_continuation_prompt_tokens: int = 64
    num_continuation_tokens: int = 64
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    passkey_context_tokens: int = 1024
    passkey_trials_per_depth: int = 1
    passkey_new_tokens: int = 8
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first impossible field."""
        at_least = {
            "num_prompt_tokens": 1,
            "reference_chunk_tokens": 1,
            "num_continuation_prompt_tokens": 1,
            "num_continuation_tokens": 0,
            "passkey_context_tokens": 1,
            "passkey_trials_per_depth": 1,
            "passkey_new_tokens": 1,
        }
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"quality.{name}: must be >= {low}, got {getattr(self, name)}")
        if self.num_text_tokens is not None and self.num_text_tokens <= self.num_prompt_tokens:
            raise ValueError(
                f"quality.num_text_tokens: {self.num_text_tokens} leaves nothing to score after "
                f"quality.num_prompt_tokens={self.num_prompt_tokens}"
            )
        for depth in self.passkey_depths:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"quality.passkey_depths: {depth} is outside [0, 1]")
