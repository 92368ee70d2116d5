"""Quality loss of a lossy KV cache, measured against the full cache of the same model.

A lossy cache (H2O, StreamingLLM, offload with partial recall) changes what the model
attends to, so it changes the logits. This harness runs one model twice over the same
tokens, once with the candidate backend and once with the full cache, and compares:

* teacher-forced text: top-1 agreement and mean KL(full || candidate) of the
  next-token distributions, and perplexity with the candidate (eviction applied token
  by token) next to the full-cache perplexity;
* greedy continuation of a prompt: the first generated position where the two differ;
* passkey retrieval (RULER / landmark style): a pass key hidden at several depths of
  filler text, scored by whether the greedy answer contains its digits;
* memory: the KV tokens and bytes the candidate actually holds at each step.

Protocol (StreamingLLM's): the candidate gets a prompt as one prefill step, then ONE
TOKEN PER STEP, and may evict between steps. It is driven only through the
``SequenceBackend`` protocol below, so any engine's KV policy plugs in by wrapping one
sequence. The full-cache reference feeds the text in chunks (mathematically the same
as token by token, and much faster).

The harness never imports an engine; callers pass a factory ``(model, max_len) ->
SequenceBackend``, for example ``FullCacheBackend`` itself or
``functools.partial(SomeEvictingBackend, budget_tokens=256)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from kvbench.model import DenseKVCache, LlamaModel
from kvbench.quality_config import QualityConfig

DEFAULT_QUALITY = QualityConfig()  # frozen: safe as a shared default


# --------------------------------------------------------------------------- protocol
@runtime_checkable
class SequenceBackend(Protocol):
    """The KV store of ONE sequence, as the quality harness drives it.

    Call order for a sequence of ``n`` tokens with a ``p``-token prompt:
    ``begin(p)``; ``before_step(0, p)``; one model forward (``attend`` once per layer);
    ``kv_tokens_resident()`` / ``kv_bytes_resident()``; ``after_step(p)``; then for
    each later token ``before_step(pos, 1)``, forward, the two reads,
    ``after_step(pos + 1)``. A backend is used for one sequence only.
    """

    def begin(self, num_prompt_tokens: int) -> None:
        """Start the sequence; the first step will carry ``num_prompt_tokens`` tokens.

        Budgets defined as a share of the prompt (H2O's 10 % + 10 %) are sized here.
        """
        ...

    def before_step(self, start_position: int, num_tokens: int) -> None:
        """The next forward carries positions [start_position, start_position + num_tokens)."""
        ...

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """``kvbench.model.AttentionBackend.attend`` for this step's tokens (stores k, v).

        q: [T, num_q_heads, head_dim]; k, v: [T, num_kv_heads, head_dim], RoPE applied
        at the token's true position. Returns [T, num_q_heads, head_dim]. Causal within
        the step; attends over whatever the backend still holds.
        """
        ...

    def after_step(self, num_tokens_seen: int) -> None:
        """The step is done; ``num_tokens_seen`` tokens exist so far. Evict here if at all."""
        ...

    def kv_tokens_resident(self) -> int:
        """Token positions held on the device right now (per layer; max over layers/heads)."""
        ...

    def kv_bytes_resident(self) -> int:
        """Device bytes of K and V held right now, over all layers."""
        ...


BackendFactory = Callable[[LlamaModel, int], SequenceBackend]  # (model, max_len) -> fresh backend


def _model_device_dtype(model: LlamaModel) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters())
    return param.device, param.dtype


class FullCacheBackend:
    """The reference: every token's K/V kept, in a one-slot ``DenseKVCache`` of ``max_len``.

    Allocates 2 x layers x max_len x kv_heads x head_dim elements of the model's dtype
    up front; raises ValueError (from DenseKVCache) on a step past ``max_len``.
    """

    def __init__(self, model: LlamaModel, max_len: int) -> None:
        device, dtype = _model_device_dtype(model)
        spec = model.spec
        self._cache = DenseKVCache(spec, num_slots=1, max_len=max_len, device=str(device), dtype=dtype)
        self._bytes_per_token = (
            2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * self._cache.k.element_size()
        )
        self._num_written = 0

    def begin(self, num_prompt_tokens: int) -> None:
        self._num_written = 0  # stale rows beyond the written prefix are never read

    def before_step(self, start_position: int, num_tokens: int) -> None:
        self._cache.prepare([(0, start_position, num_tokens)])
        self._num_written = start_position + num_tokens

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self._cache.attend(layer, q, k, v)

    def after_step(self, num_tokens_seen: int) -> None:
        pass  # a full cache never evicts

    def kv_tokens_resident(self) -> int:
        return self._num_written

    def kv_bytes_resident(self) -> int:
        return self._num_written * self._bytes_per_token


@runtime_checkable
class QualityBackendEngine(Protocol):
    """An engine whose KV policy the quality harness can run directly:
    ``sequence_backend_factory()`` returns ``(model, max_len) -> SequenceBackend`` with the
    engine's policy (engines without one are scored on ``FullCacheBackend``). Pure."""

    def sequence_backend_factory(self) -> Callable[[Any, int], SequenceBackend]: ...


class TextCodec(Protocol):
    """What the passkey test needs from a tokenizer (``kvbench.tokenizer.Tokenizer`` fits)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# --------------------------------------------------------------------------- config and report
@dataclass(frozen=True)
class QualityReport:
    """Candidate vs full cache on the same model and tokens. KL is in nats.

    ``first_divergence`` equals ``num_continuation_tokens`` when the greedy outputs
    never differ. Passkey accuracies are NaN when no passkey trial ran. KV figures are
    over the teacher-forced steps, read after each step's attention and before its
    eviction (the most the step needed); ``kv_tokens_mean_full`` is what a full cache
    holds at the same steps.
    """

    backend: str
    num_text_tokens: int
    num_scored_tokens: int
    top1_agreement: float
    kl_mean: float
    kl_max: float
    ppl: float
    ppl_full: float
    num_continuation_tokens: int
    first_divergence: int
    passkey_depths: tuple[float, ...]
    passkey_depth_accuracy: tuple[float, ...]
    passkey_accuracy: float
    passkey_accuracy_full: float
    num_passkey_trials: int
    kv_tokens_mean: float
    kv_tokens_peak: int
    kv_bytes_mean: float
    kv_bytes_peak: int
    kv_tokens_mean_full: float

    def to_dict(self) -> dict[str, Any]:
        """Flat ``quality_*`` columns for a results row; per-depth passkey accuracy as
        ``quality_passkey_accuracy_depth050`` (depth in percent)."""
        row: dict[str, Any] = {}
        for item in fields(self):
            if item.name in ("passkey_depths", "passkey_depth_accuracy"):
                continue
            row[f"quality_{item.name}"] = getattr(self, item.name)
        for depth, accuracy in zip(self.passkey_depths, self.passkey_depth_accuracy):
            row[f"quality_passkey_accuracy_depth{round(depth * 100):03d}"] = accuracy
        return row


# --------------------------------------------------------------------------- stepping
def _forward_logits(
    model: LlamaModel, backend: SequenceBackend, token_ids: Sequence[int], start: int, last_only: bool
) -> Tensor:
    """One step of ``len(token_ids)`` tokens at positions from ``start``; fp32 logits
    [T or 1, vocab]. Calls ``before_step`` but leaves ``after_step`` to the caller."""
    device, _ = _model_device_dtype(model)
    num_tokens = len(token_ids)
    backend.before_step(start, num_tokens)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(start, start + num_tokens, dtype=torch.long, device=device)
    hidden = model(ids, positions, backend)  # [T, hidden]
    return model.compute_logits(hidden[-1:] if last_only else hidden)


def _candidate_stream(
    model: LlamaModel, backend: SequenceBackend, token_ids: Sequence[int], num_prompt_tokens: int
) -> Iterator[tuple[Tensor, int, int]]:
    """Yields (logits [vocab], kv tokens, kv bytes) for positions num_prompt_tokens-1 .. n-2."""
    backend.begin(num_prompt_tokens)
    logits = _forward_logits(model, backend, token_ids[:num_prompt_tokens], 0, last_only=True)
    kv = (backend.kv_tokens_resident(), backend.kv_bytes_resident())
    backend.after_step(num_prompt_tokens)
    yield logits[0], *kv
    for position in range(num_prompt_tokens, len(token_ids) - 1):
        logits = _forward_logits(model, backend, token_ids[position : position + 1], position, last_only=True)
        kv = (backend.kv_tokens_resident(), backend.kv_bytes_resident())
        backend.after_step(position + 1)
        yield logits[0], *kv


def greedy_continuation(
    model: LlamaModel, backend: SequenceBackend, prompt_ids: Sequence[int], num_new_tokens: int
) -> list[int]:
    """Greedy tokens after ``prompt_ids`` (prefill, then one token per step; EOS ignored).

    Drives ``backend`` through the SequenceBackend protocol; its capacity must cover
    ``len(prompt_ids) + num_new_tokens - 1`` positions.
    """
    if not prompt_ids:
        raise ValueError("greedy_continuation: prompt_ids is empty")
    if num_new_tokens <= 0:
        return []
    num_prompt = len(prompt_ids)
    backend.begin(num_prompt)
    logits = _forward_logits(model, backend, prompt_ids, 0, last_only=True)
    backend.after_step(num_prompt)
    output = [int(logits[0].argmax())]
    for position in range(num_prompt, num_prompt + num_new_tokens - 1):
        logits = _forward_logits(model, backend, output[-1:], position, last_only=True)
        backend.after_step(position + 1)
        output.append(int(logits[0].argmax()))
    return output[:num_new_tokens]


# --------------------------------------------------------------------------- passkey
PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = " The pass key is {passkey}. Remember it."
PASSKEY_QUESTION = " What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyPrompt:
    token_ids: tuple[int, ...]
    passkey: str
    needle_token_index: int  # first token of the needle sentence
    num_filler_units: int  # filler sentences in total


def build_passkey_prompt(
    tokenizer: TextCodec, passkey: str, depth: float, num_context_tokens: int
) -> PasskeyPrompt:
    """Intro, filler, the needle at ``depth`` (0 = first, 1 = last) of the filler, more
    filler, and the question; about ``num_context_tokens`` tokens in all (never fewer
    than one filler unit on each side of the needle's slot).

    The pieces are encoded separately and concatenated, so the needle sits exactly at
    a filler-sentence boundary whatever the tokenizer does at word edges.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth {depth} is outside [0, 1]")
    intro = tokenizer.encode(PASSKEY_INTRO)
    filler = tokenizer.encode(PASSKEY_FILLER)
    needle = tokenizer.encode(PASSKEY_NEEDLE.format(passkey=passkey))
    question = tokenizer.encode(PASSKEY_QUESTION)
    budget = num_context_tokens - len(intro) - len(needle) - len(question)
    num_units = max(1, budget // len(filler))
    num_before = round(depth * num_units)
    ids = intro + filler * num_before
    needle_index = len(ids)
    ids += needle + filler * (num_units - num_before) + question
    return PasskeyPrompt(tuple(ids), passkey, needle_index, num_units)


def passkey_found(output_text: str, passkey: str) -> bool:
    """RULER-style string match: the answer counts when it contains the digits."""
    return passkey in output_text


# --------------------------------------------------------------------------- harness
@torch.inference_mode()
def evaluate_quality(
    model: LlamaModel,
    backend_factory: BackendFactory,
    token_ids: Sequence[int],
    tokenizer: TextCodec | None = None,
    config: QualityConfig = DEFAULT_QUALITY,
    name: str = "",
) -> QualityReport:
    """Compare the backends ``backend_factory`` makes against ``FullCacheBackend``.

    ``token_ids`` is the teacher-forced text (prepend BOS yourself if wanted); the
    continuation prompt is its first ``num_continuation_prompt_tokens`` tokens. The
    passkey runs need ``tokenizer``; pass ``passkey_depths=()`` to skip them. Builds a
    fresh backend per sequence; mutates nothing else. Raises ValueError naming the
    field when the config, text length or model context cannot work.
    """
    config.validate()
    text = list(token_ids)[: config.num_text_tokens] if config.num_text_tokens else list(token_ids)
    if len(text) <= config.num_prompt_tokens:
        raise ValueError(
            f"quality: the text has {len(text)} tokens; it needs more than "
            f"quality.num_prompt_tokens={config.num_prompt_tokens}"
        )
    if config.passkey_depths and tokenizer is None:
        raise ValueError(
            "quality.passkey_depths: the passkey test needs a tokenizer (or set passkey_depths=())"
        )
    max_positions = model.spec.max_position_embeddings
    if len(text) > max_positions:
        raise ValueError(f"quality.num_text_tokens: {len(text)} exceeds the model context {max_positions}")

    teacher = _teacher_forced(model, backend_factory, text, config)
    backend_type = teacher.pop("backend_type")

    prompt = text[: config.num_continuation_prompt_tokens]
    num_new = config.num_continuation_tokens
    divergence = num_new
    if num_new > 0:
        seq_len = len(prompt) + num_new
        full = greedy_continuation(model, FullCacheBackend(model, seq_len), prompt, num_new)
        candidate = greedy_continuation(model, backend_factory(model, seq_len), prompt, num_new)
        divergence = next((i for i, (a, b) in enumerate(zip(full, candidate)) if a != b), num_new)

    depth_accuracy, accuracy, accuracy_full, num_trials = _passkey(model, backend_factory, tokenizer, config)
    return QualityReport(
        backend=name or backend_type,
        num_text_tokens=len(text),
        num_continuation_tokens=num_new,
        first_divergence=divergence,
        passkey_depths=tuple(config.passkey_depths),
        passkey_depth_accuracy=depth_accuracy,
        passkey_accuracy=accuracy,
        passkey_accuracy_full=accuracy_full,
        num_passkey_trials=num_trials,
        **teacher,
    )


def _teacher_forced(
    model: LlamaModel, backend_factory: BackendFactory, text: list[int], config: QualityConfig
) -> dict[str, Any]:
    num_prompt = config.num_prompt_tokens
    first_scored = num_prompt - 1  # the prediction made from the last prompt token
    candidate_backend = backend_factory(model, len(text))
    stream = _candidate_stream(model, candidate_backend, text, num_prompt)
    reference = FullCacheBackend(model, len(text))
    reference.begin(min(config.reference_chunk_tokens, len(text) - 1))
    targets_all = torch.tensor(text, dtype=torch.long)

    num_scored = num_agree = 0
    nll_sum = nll_full_sum = kl_sum = 0.0
    kl_max = 0.0
    kv_tokens: list[int] = []
    kv_bytes: list[int] = []
    chunk = config.reference_chunk_tokens
    # The reference predicts positions [0, n-1) chunk by chunk; the candidate yields the
    # same positions one by one from first_scored on.
    for start in range(0, len(text) - 1, chunk):
        end = min(start + chunk, len(text) - 1)
        ref_logits = _forward_logits(model, reference, text[start:end], start, last_only=False)
        reference.after_step(end)
        lo = max(start, first_scored)
        if lo >= end:
            continue
        rows = []
        for _ in range(lo, end):
            logits, tokens, nbytes = next(stream)
            rows.append(logits)
            kv_tokens.append(tokens)
            kv_bytes.append(nbytes)
        cand = torch.stack(rows).float()  # [m, vocab]
        ref = ref_logits[lo - start :].float()  # [m, vocab]
        targets = targets_all[lo + 1 : end + 1].to(cand.device)
        logp_ref = torch.log_softmax(ref, dim=-1)
        logp_cand = torch.log_softmax(cand, dim=-1)
        kl = (logp_ref.exp() * (logp_ref - logp_cand)).sum(-1).clamp_min(0.0)  # [m]
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        num_agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        nll_sum -= float(logp_cand.gather(1, targets[:, None]).sum())
        nll_full_sum -= float(logp_ref.gather(1, targets[:, None]).sum())
        num_scored += end - lo
    return {
        "backend_type": type(candidate_backend).__name__,
        "num_scored_tokens": num_scored,
        "top1_agreement": num_agree / num_scored,
        "kl_mean": kl_sum / num_scored,
        "kl_max": kl_max,
        "ppl": math.exp(nll_sum / num_scored),
        "ppl_full": math.exp(nll_full_sum / num_scored),
        "kv_tokens_mean": sum(kv_tokens) / len(kv_tokens),
        "kv_tokens_peak": max(kv_tokens),
        "kv_bytes_mean": sum(kv_bytes) / len(kv_bytes),
        "kv_bytes_peak": max(kv_bytes),
        # A full cache holds position + 1 tokens while predicting from that position.
        "kv_tokens_mean_full": sum(p + 1 for p in range(first_scored, len(text) - 1)) / num_scored,
    }


def _passkey(
    model: LlamaModel, backend_factory: BackendFactory, tokenizer: TextCodec | None, config: QualityConfig
) -> tuple[tuple[float, ...], float, float, int]:
    if not config.passkey_depths or tokenizer is None:
        return (), math.nan, math.nan, 0
    rng = random.Random(config.seed)  # local generator: no global random state touched
    per_depth: list[float] = []
    hits = hits_full = trials = 0
    for depth in config.passkey_depths:
        depth_hits = 0
        for _ in range(config.passkey_trials_per_depth):
            passkey = str(rng.randint(10000, 99999))
            prompt = build_passkey_prompt(tokenizer, passkey, depth, config.passkey_context_tokens)
            seq_len = len(prompt.token_ids) + config.passkey_new_tokens
            if seq_len > model.spec.max_position_embeddings:
                raise ValueError(
                    f"quality.passkey_context_tokens: {seq_len} tokens exceed the model context "
                    f"{model.spec.max_position_embeddings}"
                )
            full = greedy_continuation(
                model, FullCacheBackend(model, seq_len), prompt.token_ids, config.passkey_new_tokens
            )
            candidate = greedy_continuation(
                model, backend_factory(model, seq_len), prompt.token_ids, config.passkey_new_tokens
            )
            hit = passkey_found(tokenizer.decode(candidate), passkey)
            depth_hits += hit
            hits_full += passkey_found(tokenizer.decode(full), passkey)
            trials += 1
        hits += depth_hits
        per_depth.append(depth_hits / config.passkey_trials_per_depth)
    return tuple(per_depth), hits / trials, hits_full / trials, trials


def load_quality_text() -> str:
    """The shipped public-domain English text (``kvbench/data/quality_text.txt``, ~4k tokens)."""
    return resources.files("kvbench").joinpath("data", "quality_text.txt").read_text(encoding="utf-8")
