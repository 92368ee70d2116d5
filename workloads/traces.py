"""Public entry points for recorded traces: ``load_trace`` (a Workload) and
``parse_trace`` (validated records, for inspection without materialising tokens).

Hydra configs target ``kvbench.workloads.traces.load_trace`` with ``path`` set to a
file or a shipped short name (``mooncake_conversation``, ``mooncake_synthetic``,
``azure_code``, ``azure_conv``; sources and licences in ``data/README.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvbench.types import Workload
from kvbench.workloads.distributions import arrival_process
from kvbench.workloads.errors import WorkloadConfigError
from kvbench.workloads.replay import ReplayOptions, replay
from kvbench.workloads.tokens import Tokenizer, check_seed, check_vocab_size
from kvbench.workloads.trace_formats import PARSERS, ParsedTrace, parse_sharegpt
from kvbench.workloads.trace_io import SHIPPED_TRACES, TRACE_FORMATS, detect_format, resolve_trace_path


def parse_trace(
    path: str | Path,
    *,
    format: str | None = None,
    skip_invalid: bool = False,
    vocab_size: int = 32000,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    max_turns: int = 1,
) -> ParsedTrace:
    """Read and validate a trace file or shipped name (``.gz`` read transparently).

    ``format`` (mooncake, azure, burstgpt, sharegpt) defaults to sniffing the name and
    header. ``vocab_size``, ``seed``, ``tokenizer`` and ``max_turns`` matter only for
    ShareGPT, whose records carry token ids. Raises TraceError for a bad row (unless
    ``skip_invalid``) or an empty trace, FileNotFoundError for a missing file.
    """
    resolved = resolve_trace_path(path)
    fmt = format or detect_format(path if str(path) in SHIPPED_TRACES else resolved)
    if fmt not in TRACE_FORMATS:
        raise WorkloadConfigError(f"format: expected one of {TRACE_FORMATS}, got {fmt!r}")
    if fmt == "sharegpt":
        check_vocab_size(vocab_size)
        check_seed(seed)
        if max_turns < 1:
            raise WorkloadConfigError(f"max_turns: must be >= 1, got {max_turns}")
        return parse_sharegpt(
            resolved,
            vocab_size=vocab_size,
            seed=seed,
            tokenizer=tokenizer,
            max_turns=max_turns,
            skip_invalid=skip_invalid,
        )
    return PARSERS[fmt](resolved, skip_invalid=skip_invalid)


def load_trace(
    path: str | Path,
    *,
    vocab_size: int,
    seed: int = 0,
    format: str | None = None,
    name: str | None = None,
    skip_invalid: bool = False,
    tokenizer: Tokenizer | None = None,
    max_turns: int = 1,
    arrival: Mapping[str, Any] | str | None = None,
    time_scale: float = 1.0,
    time_offset_s: float = 0.0,
    start_s: float = 0.0,
    end_s: float | None = None,
    sample_fraction: float = 1.0,
    max_requests: int | None = None,
    length_scale: float = 1.0,
    output_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> Workload:
    """Replay a recorded trace as a Workload (see ``ReplayOptions`` for the controls).

    ``name`` defaults to the shipped name or the file's format; ``arrival`` (a mapping
    with ``kind``, as for synthetic workloads) times traces that have none (ShareGPT).
    Everything skipped, sampled out, capped or truncated is in ``Workload.counters``.
    Raises TraceError for bad rows (``FILE:LINE: field 'NAME': problem``) unless
    ``skip_invalid``, and WorkloadConfigError for impossible options.
    """
    options = ReplayOptions(
        time_scale=time_scale,
        time_offset_s=time_offset_s,
        start_s=start_s,
        end_s=end_s,
        sample_fraction=sample_fraction,
        max_requests=max_requests,
        length_scale=length_scale,
        output_scale=output_scale,
        max_prompt_tokens=max_prompt_tokens,
        max_output_tokens=max_output_tokens,
    )
    trace = parse_trace(
        path,
        format=format,
        skip_invalid=skip_invalid,
        vocab_size=vocab_size,
        seed=seed,
        tokenizer=tokenizer,
        max_turns=max_turns,
    )
    return replay(
        trace,
        options,
        vocab_size=vocab_size,
        seed=seed,
        name=name or (str(path) if str(path) in SHIPPED_TRACES else trace.format),
        arrival=arrival_process(arrival),
    )
