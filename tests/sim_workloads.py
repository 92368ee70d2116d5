"""Workloads the simulation tests share (no conftest magic)."""

from __future__ import annotations

from pathlib import Path

from kvbench.specs import ModelSpec
from kvbench.types import Workload
from kvbench.workloads.traces import load_trace

MOONCAKE_HEAD = Path(__file__).parent / "fixtures" / "traces" / "mooncake_conversation_head200.jsonl"


def mooncake_head(max_requests: int, spec: ModelSpec | None = None) -> Workload:
    """The first ``max_requests`` conversations of the Mooncake fixture, scaled to the tiny
    test model: prompts 1/32 as long (at most 1,024 tokens), outputs a quarter (at most 120),
    arrivals 20x faster, so that conversations share prefixes under memory pressure."""
    return load_trace(
        MOONCAKE_HEAD,
        vocab_size=(spec or ModelSpec()).vocab_size,
        length_scale=1 / 32,
        output_scale=0.25,
        max_prompt_tokens=1024,
        max_output_tokens=120,
        max_requests=max_requests,
        time_scale=0.05,
    )
