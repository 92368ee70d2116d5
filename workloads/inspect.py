"""``kvbench trace inspect``: what a workload or trace looks like before running it.

Reports request count, duration, arrival rate, prompt/output length percentiles and the
prefix-reuse upper bound: the share of prompt tokens whose ``block_size``-token block,
chained by prefix, already appeared in an earlier request (what an unbounded prefix
cache could at best skip). The definition is the run metric ``prefix_reuse_upper_bound``
(``kvbench.metrics.prefix_reused_tokens``): full blocks only, and never the block holding
a prompt's last token unless a later token follows it in the prompt (an engine always
computes the last prompt token), so a run's ``prefix_hit_rate_first_admission`` reaches it
exactly when nothing is evicted and requests do not overlap. For Mooncake traces it also
reports the share of hash ids seen before, at the trace's own 512-token granularity.

Traces are inspected from their records, without materialising token ids, so the full
Mooncake files (145M prompt tokens) inspect in seconds; the reuse computed from hash ids
equals the one measured on the replayed tokens.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.metrics import prefix_reused_tokens
from kvbench.sizing import DEFAULT_BLOCK_SIZE
from kvbench.types import Workload
from kvbench.workloads.errors import TraceError, WorkloadConfigError
from kvbench.workloads.trace_formats import MOONCAKE_BLOCK_TOKENS, ParsedTrace, TraceRecord
from kvbench.workloads.trace_io import SHIPPED_TRACES, TRACE_FORMATS

PERCENTILES = (50, 90, 99)


# --------------------------------------------------------------------------- statistics


def inspect_workload(workload: Workload, block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, Any]:
    """Summary of ``workload`` (see the module docstring); pure."""
    _check_block_size(block_size)
    requests = workload.requests  # sorted by arrival (Workload's contract)
    reused = int(
        prefix_reused_tokens(
            (r.prompt_token_ids for r in requests), block_size, (r.cache_salt for r in requests)
        ).sum()
    )
    return _summary(
        name=workload.name,
        source=workload.source,
        arrivals_s=np.array([r.arrival_s for r in requests]),
        prompt_lens=np.array([r.num_prompt_tokens for r in requests]),
        output_lens=np.array([r.max_new_tokens for r in requests]),
        num_reused_tokens=reused,
        block_size=block_size,
        counters=workload.counters,
    )


def inspect_trace(trace: ParsedTrace, block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, Any]:
    """Summary of a parsed trace as recorded (no scaling or caps); pure.

    Reuse comes from hash ids (Mooncake), from token ids (ShareGPT), and is 0 for
    traces with lengths only (their replayed prompts are independent random ids).
    """
    _check_block_size(block_size)
    records = trace.records
    extra: dict[str, Any] = {}
    if records[0].hash_ids is not None:
        reused = _reused_tokens_by_hash_ids(records, block_size)
        extra["hash_block_size"] = MOONCAKE_BLOCK_TOKENS
        extra["hash_block_reuse"] = _hash_id_reuse(records)
    elif records[0].prompt_token_ids is not None:
        reused = int(prefix_reused_tokens((r.prompt_token_ids or () for r in records), block_size).sum())
    else:
        reused = 0
    times = np.array([r.timestamp_s for r in records])
    return _summary(
        name=Path(trace.path).name,
        source=f"{trace.format}:{trace.path}",
        arrivals_s=times - times[0] if trace.has_timestamps else np.zeros(len(records)),
        prompt_lens=np.array([r.input_length for r in records]),
        output_lens=np.array([r.output_length for r in records]),
        num_reused_tokens=reused,
        block_size=block_size,
        counters=trace.counters,
        **extra,
    )


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise WorkloadConfigError(f"block_size: must be an int >= 1, got {block_size!r}")


def _summary(
    *,
    name: str,
    source: str,
    arrivals_s: np.ndarray,
    prompt_lens: np.ndarray,
    output_lens: np.ndarray,
    num_reused_tokens: int,
    block_size: int,
    counters: Mapping[str, int],
    **extra: Any,
) -> dict[str, Any]:
    duration_s = float(arrivals_s.max() - arrivals_s.min())
    total_prompt = int(prompt_lens.sum())
    return {
        "name": name,
        "source": source,
        "num_requests": len(prompt_lens),
        "duration_s": duration_s,
        # Mean rate of the arrival process: (n - 1) gaps over the span; None if offline.
        "arrival_rate_per_s": (len(prompt_lens) - 1) / duration_s if duration_s > 0 else None,
        "prompt_tokens": _length_stats(prompt_lens),
        "output_tokens": _length_stats(output_lens),
        "block_size": block_size,
        "prefix_reuse_upper_bound": num_reused_tokens / total_prompt if total_prompt else 0.0,
        **extra,
        "counters": dict(counters),
    }


def _length_stats(lengths: np.ndarray) -> dict[str, float | int]:
    stats: dict[str, float | int] = {"mean": float(lengths.mean())}
    for q in PERCENTILES:
        stats[f"p{q}"] = float(np.percentile(lengths, q))
    stats["max"] = int(lengths.max())
    stats["total"] = int(lengths.sum())
    return stats


def _reused_tokens_by_hash_ids(records: Sequence[TraceRecord], block_size: int) -> int:
    """The block reuse that replaying the trace would show, computed from hash ids.

    Replayed tokens depend only on (hash id, offset in block), so the longest token
    prefix a request shares with any earlier one is found by walking a trie of hash-id
    paths that remembers the longest stretch of each block seen so far; the full
    ``block_size`` blocks inside that prefix, and inside the first ``input_length - 1``
    tokens, are the reused ones (``prefix_reused_tokens``'s definition, from hash ids
    instead of tokens). O(total hash ids).
    """
    children: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node
    longest: list[int] = [0]  # node -> most tokens of its block seen so far
    reused = 0
    for record in records:
        assert record.hash_ids is not None
        last_len = record.input_length - MOONCAKE_BLOCK_TOKENS * (len(record.hash_ids) - 1)
        block_lens = [MOONCAKE_BLOCK_TOKENS] * (len(record.hash_ids) - 1) + [last_len]
        matched, node = 0, 0
        for hash_id, block_len in zip(record.hash_ids, block_lens):
            child = children.get((node, hash_id))
            if child is None:
                break
            common = min(block_len, longest[child])
            matched += common
            if common < MOONCAKE_BLOCK_TOKENS:
                break
            node = child
        # The last prompt token is always computed, so its block is never a hit.
        reused += min(matched, record.input_length - 1) // block_size * block_size
        node = 0
        for hash_id, block_len in zip(record.hash_ids, block_lens):
            child = children.get((node, hash_id))
            if child is None:
                child = children[(node, hash_id)] = len(longest)
                longest.append(0)
            longest[child] = max(longest[child], block_len)
            node = child
    return reused


def _hash_id_reuse(records: Sequence[TraceRecord]) -> float:
    """Share of hash ids (512-token blocks) that already appeared earlier in the trace."""
    seen: set[int] = set()
    total = repeated = 0
    for record in records:
        for hash_id in record.hash_ids or ():
            total += 1
            if hash_id in seen:
                repeated += 1
            else:
                seen.add(hash_id)
    return repeated / total if total else 0.0


# --------------------------------------------------------------------------- rendering


def format_inspect(summary: Mapping[str, Any]) -> str:
    """``summary`` (from inspect_workload / inspect_trace) as a plain-text rich table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=summary["name"], title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rate = summary["arrival_rate_per_s"]
    table.add_row("source", summary["source"])
    table.add_row("requests", f"{summary['num_requests']:,}")
    table.add_row("duration (s)", f"{summary['duration_s']:,.3f}")
    table.add_row("arrival rate (req/s)", "offline (all at t=0)" if rate is None else f"{rate:,.3f}")
    table.add_row(
        f"prefix reuse bound ({summary['block_size']}-token blocks)",
        f"{summary['prefix_reuse_upper_bound']:.3f}",
    )
    if "hash_block_reuse" in summary:
        table.add_row(
            f"hash ids seen before ({summary['hash_block_size']}-token blocks)",
            f"{summary['hash_block_reuse']:.3f}",
        )
    for name, value in summary["counters"].items():
        table.add_row(name, f"{value:,}")
    lengths = Table(title="lengths (tokens)", title_justify="left")
    lengths.add_column("stat")
    lengths.add_column("prompt", justify="right")
    lengths.add_column("output", justify="right")
    for stat in ("mean", *(f"p{q}" for q in PERCENTILES), "max", "total"):
        prompt, output = summary["prompt_tokens"][stat], summary["output_tokens"][stat]
        fmt = ",.1f" if stat == "mean" else ",.0f"
        lengths.add_row(stat, f"{prompt:{fmt}}", f"{output:{fmt}}")
    buffer = io.StringIO()
    console = Console(file=buffer, width=120, color_system=None, force_terminal=False)
    console.print(table)
    console.print(lengths)
    return buffer.getvalue()


# --------------------------------------------------------------------------- command line


def main(argv: list[str]) -> int:
    """``kvbench trace inspect FILE [--format F] [--json] [--skip-invalid] [--block-size N]
    [--vocab-size N] [--seed N]``; FILE is a trace file, a shipped trace name, a workload
    config (.yaml) or a shipped config name (``chat``). Prints the table (or JSON) and
    returns 0; prints the one-line error and returns 2 on bad input."""
    parser = argparse.ArgumentParser(prog="kvbench trace inspect", description=__doc__.splitlines()[0])
    parser.add_argument("file", help="trace file, shipped trace name, workload .yaml or conf/workload name")
    parser.add_argument(
        "--format", choices=TRACE_FORMATS, help="trace format (default: from name and header)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--skip-invalid", action="store_true", help="skip and count malformed rows")
    parser.add_argument("--block-size", type=int, default=16, help="prefix-cache block size in tokens")
    parser.add_argument("--vocab-size", type=int, default=32000, help="vocabulary for generated token ids")
    parser.add_argument("--seed", type=int, default=0, help="seed for workload configs and ShareGPT ids")
    args = parser.parse_args(argv)
    try:
        summary = _inspect_target(args)
    except (TraceError, WorkloadConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else format_inspect(summary), end="\n")
    return 0


def _inspect_target(args: argparse.Namespace) -> dict[str, Any]:
    from kvbench.workloads.traces import parse_trace

    config = _workload_config_path(args.file)
    if config is not None:
        return inspect_workload(_instantiate(config, args.vocab_size, args.seed), args.block_size)
    trace = parse_trace(
        args.file,
        format=args.format,
        skip_invalid=args.skip_invalid,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )
    return inspect_trace(trace, args.block_size)


def _workload_config_path(target: str) -> Path | None:
    """The YAML behind ``target`` if it names a workload config, else None (a trace)."""
    if target.endswith((".yaml", ".yml")):
        if not Path(target).is_file():
            raise FileNotFoundError(f"{target}: no such workload config")
        return Path(target)
    if target in SHIPPED_TRACES or Path(target).exists():
        return None
    shipped = resources.files("kvbench.conf") / "workload" / f"{target}.yaml"
    return Path(str(shipped)) if shipped.is_file() else None


def _instantiate(config: Path, vocab_size: int, seed: int) -> Workload:
    """Build the workload of a ``conf/workload`` YAML under a minimal root config that
    supplies its ``${model.vocab_size}`` and ``${seed}`` interpolations."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    root = OmegaConf.create(
        {"model": {"vocab_size": vocab_size}, "seed": seed, "workload": OmegaConf.load(config)}
    )
    try:
        workload = instantiate(root.workload)
    except InstantiationException as exc:
        # Hydra wraps the generator's own error; show that one-line message instead.
        if isinstance(exc.__cause__, (TraceError, WorkloadConfigError, FileNotFoundError)):
            raise exc.__cause__ from None
        raise WorkloadConfigError(f"{config}: {exc}") from None
    if not isinstance(workload, Workload):
        raise WorkloadConfigError(f"{config}: _target_ returned {type(workload).__name__}, not a Workload")
    return workload
