"""Synthetic workloads whose prompts share prefixes the way real traffic does.

- ``chat``: one system prompt shared by all conversations; turn k's prompt is the
  whole history (system, user_0, assistant_0, ..., user_k), so it grows turn by turn.
- ``agentic``: a long tool-description scaffold shared by all sessions, a task, then a
  growing chain of (action, observation) steps: the same shape as chat.
- ``rag``: a system prompt, several passages drawn from a pool by a Zipf law (popular
  passages recur), then a question.

History stand-ins: the assistant/action tokens inside later prompts are synthetic ids of
the length that turn asked for, not what the model generated, so a prefix cache can hit
every earlier *prompt* but not the earlier outputs (which a real run would have cached
from decoding). Turns arrive open loop: turn k+1 comes an exponential gap (mean
``turn_interval_s``) after turn k, whether or not turn k has finished; ``tags`` carry
``conversation`` and ``turn`` for a runner that wants to gate on completion.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvbench.types import Request, Workload
from kvbench.workloads.build import check_common, draw_lengths, sorted_workload
from kvbench.workloads.distributions import arrival_process
from kvbench.workloads.errors import WorkloadConfigError
from kvbench.workloads.tokens import (
    STREAM_ARRIVALS,
    STREAM_CHOICES,
    STREAM_GAPS,
    STREAM_HEADER,
    STREAM_NEXT_LEN,
    STREAM_OUTPUT_LEN,
    STREAM_PASSAGES,
    STREAM_PROMPT_LEN,
    STREAM_TOKENS,
    STREAM_TURNS,
    Tokenizer,
    derive_rng,
    random_token_ids,
    text_or_random_ids,
)

LengthSpec = Mapping[str, Any] | int
ArrivalSpec = Mapping[str, Any] | str | None

SYSTEM_PROMPT_TEXT = (
    "You are a helpful, honest and concise assistant. Answer the user's questions accurately, "
    "say so when you are unsure, and keep answers short unless asked for detail. "
)
TOOL_SCAFFOLD_TEXT = (
    "You can call the following tools. search(query: str) -> list of results: searches the web. "
    "read_file(path: str) -> str: returns the contents of a file. run_python(code: str) -> str: runs "
    "code in a sandbox and returns stdout. Reply with one tool call per step as JSON, for example "
    '{"tool": "search", "arguments": {"query": "..."}}, and finish with {"answer": "..."}. '
)


def chat(
    num_conversations: int = 8,
    num_turns: LengthSpec = 4,
    system_prompt_len: int = 64,
    user_len: LengthSpec | None = None,
    output_len: LengthSpec | None = None,
    arrival: ArrivalSpec = None,
    turn_interval_s: float = 1.0,
    *,
    vocab_size: int,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    name: str = "chat",
) -> Workload:
    """Multi-turn conversations sharing one system prompt (real text with ``tokenizer``).

    ``num_turns`` may be a distribution (turns per conversation); ``arrival`` times the
    conversations' first turns. Default lengths: users and answers uniform 16-48 tokens.
    """
    header = text_or_random_ids(
        SYSTEM_PROMPT_TEXT, system_prompt_len, tokenizer, derive_rng(seed, STREAM_HEADER), vocab_size
    )
    user = user_len or _DEFAULT_TURN_LEN
    return _sessions(
        name, num_conversations, (num_turns, "num_turns"), header, (user, "user_len"), (user, "user_len"),
        (output_len or _DEFAULT_TURN_LEN, "output_len"), arrival, turn_interval_s, vocab_size, seed,
    )  # fmt: skip


def agentic(
    num_sessions: int = 4,
    num_steps: LengthSpec = 6,
    scaffold_len: int = 256,
    task_len: LengthSpec = 32,
    observation_len: LengthSpec | None = None,
    output_len: LengthSpec | None = None,
    arrival: ArrivalSpec = None,
    step_interval_s: float = 0.5,
    *,
    vocab_size: int,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    name: str = "agentic",
) -> Workload:
    """Agent sessions: a shared tool scaffold, a task, then one request per step whose
    prompt holds every earlier (action, observation). Default observations uniform
    16-64 tokens, actions (outputs) uniform 16-32."""
    header = text_or_random_ids(
        TOOL_SCAFFOLD_TEXT, scaffold_len, tokenizer, derive_rng(seed, STREAM_HEADER), vocab_size
    )
    return _sessions(
        name, num_sessions, (num_steps, "num_steps"), header, (task_len, "task_len"),
        (observation_len or {"kind": "uniform", "low": 16, "high": 64}, "observation_len"),
        (output_len or {"kind": "uniform", "low": 16, "high": 32}, "output_len"),
        arrival, step_interval_s, vocab_size, seed,
    )  # fmt: skip


_DEFAULT_TURN_LEN = {"kind": "uniform", "low": 16, "high": 48}


_Named = tuple[LengthSpec, str]  # a length spec and its parameter name (for errors, counters)


def _sessions(
    name: str,
    num_sessions: int,
    num_turns: _Named,
    header: np.ndarray,
    first_input_len: _Named,
    next_input_len: _Named,
    output_len: _Named,
    arrival: ArrivalSpec,
    turn_interval_s: float,
    vocab_size: int,
    seed: int,
) -> Workload:
    """Sessions that grow turn by turn: prompt_k = header + in_0 + out_0 + ... + in_k."""
    check_common(vocab_size, seed, num_sessions=num_sessions)
    if turn_interval_s < 0:
        raise WorkloadConfigError(f"turn_interval_s: must be >= 0, got {turn_interval_s}")
    counters: dict[str, int] = {}
    turns = draw_lengths(*num_turns, seed, STREAM_TURNS, num_sessions, counters)
    total_turns = int(turns.sum())
    first_lens = draw_lengths(*first_input_len, seed, STREAM_PROMPT_LEN, num_sessions, counters)
    later_lens = iter(
        draw_lengths(*next_input_len, seed, STREAM_NEXT_LEN, total_turns - num_sessions, counters)
    )
    out_lens = iter(draw_lengths(*output_len, seed, STREAM_OUTPUT_LEN, total_turns, counters))
    process = arrival_process(arrival)
    starts = process.times(derive_rng(seed, STREAM_ARRIVALS), num_sessions)
    header_ids = header.tolist()
    requests = []
    for s in range(num_sessions):
        gaps = derive_rng(seed, STREAM_GAPS, s).exponential(turn_interval_s, size=int(turns[s]))
        gaps[0] = 0.0
        arrivals = starts[s] + np.cumsum(gaps)
        history = list(header_ids)
        for k in range(int(turns[s])):
            input_len = int(first_lens[s]) if k == 0 else int(next(later_lens))
            history += random_token_ids(
                derive_rng(seed, STREAM_TOKENS, s, 2 * k), input_len, vocab_size
            ).tolist()
            reply_len = int(next(out_lens))
            requests.append(
                Request(
                    request_id=f"{name}-{s:04d}-{k:03d}",
                    arrival_s=float(arrivals[k]),
                    prompt_token_ids=tuple(history),
                    max_new_tokens=reply_len,
                    tags={"kind": name, "conversation": str(s), "turn": str(k), **process.request_tags()},
                )
            )
            # Stand-in for the reply, so the next turn's prompt carries a full history.
            history += random_token_ids(
                derive_rng(seed, STREAM_TOKENS, s, 2 * k + 1), reply_len, vocab_size
            ).tolist()
    return sorted_workload(name, requests, counters)


def rag(
    num_requests: int = 32,
    num_passages: int = 64,
    passage_len: LengthSpec | None = None,
    passages_per_prompt: int = 3,
    zipf_exponent: float = 1.1,
    system_prompt_len: int = 32,
    question_len: LengthSpec | None = None,
    output_len: LengthSpec | None = None,
    arrival: ArrivalSpec = None,
    *,
    vocab_size: int,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    name: str = "rag",
) -> Workload:
    """Retrieval-augmented prompts: system + passages + question.

    Passage p (rank p + 1) is picked with probability proportional to
    ``(p + 1) ** -zipf_exponent``; each prompt holds ``passages_per_prompt`` distinct
    passages in the order drawn (``tags['passages']``). Defaults: passages uniform
    48-96 tokens, questions uniform 8-32, outputs uniform 16-48.
    """
    check_common(
        vocab_size, seed, num_requests=num_requests, num_passages=num_passages,
        passages_per_prompt=passages_per_prompt,
    )  # fmt: skip
    if passages_per_prompt > num_passages:
        raise WorkloadConfigError(
            f"passages_per_prompt: {passages_per_prompt} exceeds num_passages={num_passages}"
        )
    if zipf_exponent < 0:
        raise WorkloadConfigError(f"zipf_exponent: must be >= 0, got {zipf_exponent}")
    counters: dict[str, int] = {}
    header = text_or_random_ids(
        SYSTEM_PROMPT_TEXT, system_prompt_len, tokenizer, derive_rng(seed, STREAM_HEADER), vocab_size
    ).tolist()
    passage_lens = draw_lengths(
        passage_len or {"kind": "uniform", "low": 48, "high": 96}, "passage_len", seed, STREAM_PASSAGES,
        num_passages, counters,
    )  # fmt: skip
    passages = [
        random_token_ids(derive_rng(seed, STREAM_PASSAGES, p), int(passage_lens[p]), vocab_size).tolist()
        for p in range(num_passages)
    ]
    weights = np.arange(1, num_passages + 1, dtype=np.float64) ** -zipf_exponent
    probs = weights / weights.sum()
    question_lens = draw_lengths(
        question_len or {"kind": "uniform", "low": 8, "high": 32}, "question_len", seed, STREAM_PROMPT_LEN,
        num_requests, counters,
    )  # fmt: skip
    output_lens = draw_lengths(
        output_len or _DEFAULT_TURN_LEN, "output_len", seed, STREAM_OUTPUT_LEN, num_requests, counters
    )
    process = arrival_process(arrival)
    arrivals = process.times(derive_rng(seed, STREAM_ARRIVALS), num_requests)
    requests = []
    for i in range(num_requests):
        picked = derive_rng(seed, STREAM_CHOICES, i).choice(
            num_passages, passages_per_prompt, replace=False, p=probs
        )
        prompt = list(header)
        for p in picked:
            prompt += passages[p]
        prompt += random_token_ids(
            derive_rng(seed, STREAM_TOKENS, i), int(question_lens[i]), vocab_size
        ).tolist()
        requests.append(
            Request(
                request_id=f"{name}-{i:06d}",
                arrival_s=float(arrivals[i]),
                prompt_token_ids=tuple(prompt),
                max_new_tokens=int(output_lens[i]),
                tags={"kind": name, "passages": ",".join(str(p) for p in picked), **process.request_tags()},
            )
        )
    return sorted_workload(name, requests, counters)
