"""The quality harness on a tiny random model: full cache vs itself, and a lossy window."""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.model import DenseKVCache, LlamaModel, grouped_attention
from kvbench.quality import (
    FullCacheBackend,
    QualityConfig,
    SequenceBackend,
    build_passkey_prompt,
    evaluate_quality,
    greedy_continuation,
    load_quality_text,
    passkey_found,
)
from kvbench.specs import ModelSpec

TINY = ModelSpec(
    name="tiny-quality",
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    hidden_size=64,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=512,
)
BYTES_PER_TOKEN = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 4  # fp32


class CharTokenizer:
    """Printable ASCII, one token per character (ids 1..95): enough for passkey prompts."""

    alphabet = string.printable[:95]

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(ch) + 1 for ch in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.alphabet[i - 1] if 1 <= i <= len(self.alphabet) else "?" for i in ids)


class RecentWindowBackend:
    """Deliberately lossy: after every step keep only the last ``window`` tokens' K/V."""

    def __init__(self, model: LlamaModel, max_len: int, window: int) -> None:
        self.window = window
        self.scale = model.scale
        self.k: list[torch.Tensor | None] = [None] * model.spec.num_layers  # each [S, kv_heads, head_dim]
        self.v: list[torch.Tensor | None] = [None] * model.spec.num_layers

    def begin(self, num_prompt_tokens: int) -> None:
        pass

    def before_step(self, start_position: int, num_tokens: int) -> None:
        pass

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        old_k, old_v = self.k[layer], self.v[layer]
        if old_k is not None and old_v is not None:
            k, v = torch.cat([old_k, k]), torch.cat([old_v, v])
        self.k[layer], self.v[layer] = k, v
        # Keys are the kept tokens in order, so the step's queries start after the old ones.
        return grouped_attention(q, k, v, k.shape[0] - q.shape[0], self.scale)

    def after_step(self, num_tokens_seen: int) -> None:
        self.k = [None if k is None else k[-self.window :] for k in self.k]
        self.v = [None if v is None else v[-self.window :] for v in self.v]

    def kv_tokens_resident(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[0]

    def kv_bytes_resident(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny matmuls: extra threads only spin on a shared 2-core machine (20x slower under load)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.random(TINY, seed=3)


def text_ids(num_tokens: int, seed: int = 0) -> list[int]:
    return torch.randint(
        1, TINY.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


CONFIG = QualityConfig(
    num_prompt_tokens=8,
    reference_chunk_tokens=32,
    num_continuation_prompt_tokens=16,
    num_continuation_tokens=24,
    passkey_depths=(0.0, 0.5, 1.0),
    passkey_context_tokens=160,
    passkey_new_tokens=6,
)


def test_backends_satisfy_the_protocol(model: LlamaModel) -> None:
    assert isinstance(FullCacheBackend(model, 8), SequenceBackend)
    assert isinstance(RecentWindowBackend(model, 8, 4), SequenceBackend)


def test_full_cache_against_itself_is_perfect(model: LlamaModel) -> None:
    ids = text_ids(100)
    report = evaluate_quality(model, FullCacheBackend, ids, CharTokenizer(), CONFIG)
    assert report.backend == "FullCacheBackend"
    assert report.num_scored_tokens == 100 - CONFIG.num_prompt_tokens
    assert report.top1_agreement == 1.0
    assert report.kl_mean < 1e-6 and report.kl_max < 1e-5
    assert report.ppl == pytest.approx(report.ppl_full, rel=1e-5)
    assert report.first_divergence == CONFIG.num_continuation_tokens
    assert report.num_passkey_trials == 3
    assert report.passkey_accuracy == report.passkey_accuracy_full
    # The full cache holds position + 1 tokens: 8..99 over the scored steps.
    assert report.kv_tokens_mean == pytest.approx(report.kv_tokens_mean_full)
    assert report.kv_tokens_mean_full == pytest.approx((8 + 99) / 2)
    assert report.kv_tokens_peak == 99
    assert report.kv_bytes_peak == 99 * BYTES_PER_TOKEN


def test_full_cache_perplexity_matches_one_forward(model: LlamaModel) -> None:
    """ppl_full scores exactly positions num_prompt-1 .. n-2 against the next token."""
    ids = text_ids(70, seed=5)
    cache = DenseKVCache(TINY, 1, 70, "cpu", torch.float32)
    cache.prepare([(0, 0, 70)])
    logits = model.compute_logits(model(torch.tensor(ids), torch.arange(70), cache))
    nll = torch.nn.functional.cross_entropy(logits[8 - 1 : -1], torch.tensor(ids[8:]))
    config = QualityConfig(num_prompt_tokens=8, reference_chunk_tokens=16, passkey_depths=())
    report = evaluate_quality(model, FullCacheBackend, ids, config=config)
    assert report.ppl_full == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert math.isnan(report.passkey_accuracy) and report.num_passkey_trials == 0


def test_window_cache_loses_quality_and_memory(model: LlamaModel) -> None:
    ids = text_ids(100)
    lossy = evaluate_quality(
        model, functools.partial(RecentWindowBackend, window=4), ids, CharTokenizer(), CONFIG
    )
    wider = evaluate_quality(
        model, functools.partial(RecentWindowBackend, window=32), ids, CharTokenizer(), CONFIG
    )
    assert lossy.backend == "RecentWindowBackend"
    assert lossy.top1_agreement < 0.9
    assert lossy.kl_mean > 0.01
    assert lossy.ppl != pytest.approx(lossy.ppl_full, rel=1e-3)
    assert lossy.first_divergence < CONFIG.num_continuation_tokens
    # Window 4 holds 4 old tokens plus the new one during each decode step.
    assert lossy.kv_tokens_peak == CONFIG.num_prompt_tokens  # the prefill step held the whole prompt
    assert lossy.kv_tokens_mean < 5.1
    assert lossy.kv_bytes_peak == lossy.kv_tokens_peak * BYTES_PER_TOKEN
    assert lossy.kv_tokens_mean_full > 50
    # More context kept -> closer to the full cache.
    assert wider.kl_mean < lossy.kl_mean
    assert wider.top1_agreement > lossy.top1_agreement
    assert wider.kv_tokens_peak == 33


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_tokens=st.integers(10, 60),
    num_prompt=st.integers(1, 9),
    chunk=st.integers(1, 40),
    seed=st.integers(0, 1000),
)
def test_window_wider_than_text_never_evicts(
    model: LlamaModel, num_tokens: int, num_prompt: int, chunk: int, seed: int
) -> None:
    """Any split of prompt / reference chunks: a window that never evicts equals the full cache."""
    config = QualityConfig(
        num_prompt_tokens=num_prompt,
        reference_chunk_tokens=chunk,
        num_continuation_prompt_tokens=5,
        num_continuation_tokens=6,
        passkey_depths=(),
    )
    ids = text_ids(num_tokens, seed=seed)
    report = evaluate_quality(model, functools.partial(RecentWindowBackend, window=1000), ids, config=config)
    assert report.num_scored_tokens == num_tokens - num_prompt
    assert report.top1_agreement == 1.0
    assert report.kl_max < 1e-5
    assert report.ppl == pytest.approx(report.ppl_full, rel=1e-4)
    assert report.first_divergence == 6
    assert report.kv_tokens_peak == num_tokens - 1


def test_greedy_continuation_is_the_argmax_of_its_own_sequence(model: LlamaModel) -> None:
    prompt = text_ids(12, seed=9)
    out = greedy_continuation(model, FullCacheBackend(model, 40), prompt, 20)
    assert len(out) == 20
    seq = prompt + out
    cache = DenseKVCache(TINY, 1, len(seq), "cpu", torch.float32)
    cache.prepare([(0, 0, len(seq))])
    logits = model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq)), cache))
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out
    assert greedy_continuation(model, FullCacheBackend(model, 40), prompt, 0) == []


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_prompt_places_the_needle_at_depth(depth: float) -> None:
    tok = CharTokenizer()
    prompt = build_passkey_prompt(tok, "40217", depth, 600)
    text = tok.decode(prompt.token_ids)
    needle = " The pass key is 40217. Remember it."
    assert text.count(needle) == 1
    assert text.endswith(" What is the pass key? The pass key is")
    assert tok.decode(prompt.token_ids[prompt.needle_token_index :]).startswith(needle)
    filler = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    before = text[: text.index(needle)].count(filler)
    assert before == round(depth * prompt.num_filler_units)
    assert text.count(filler) == prompt.num_filler_units
    assert abs(len(prompt.token_ids) - 600) <= len(filler)


def test_passkey_scoring_is_a_digit_match() -> None:
    assert passkey_found(" 40217. Remember", "40217")
    assert not passkey_found(" 4021 7", "40217")


def test_report_dict_is_flat_and_prefixed(model: LlamaModel) -> None:
    row = evaluate_quality(
        model, FullCacheBackend, text_ids(60), CharTokenizer(), CONFIG, name="full"
    ).to_dict()
    assert all(key.startswith("quality_") for key in row)
    for key in (
        "quality_backend",
        "quality_top1_agreement",
        "quality_kl_mean",
        "quality_ppl",
        "quality_ppl_full",
        "quality_first_divergence",
        "quality_passkey_accuracy",
        "quality_passkey_accuracy_depth000",
        "quality_passkey_accuracy_depth050",
        "quality_passkey_accuracy_depth100",
        "quality_kv_tokens_mean",
        "quality_kv_bytes_peak",
    ):
        assert key in row
    assert row["quality_backend"] == "full"
    assert all(isinstance(value, (int, float, str)) for value in row.values())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_prompt_tokens": 0}, "quality.num_prompt_tokens"),
        ({"passkey_depths": (1.5,)}, "quality.passkey_depths"),
        ({"num_text_tokens": 4, "num_prompt_tokens": 4}, "quality.num_text_tokens"),
    ],
)
def test_bad_config_names_the_field(model: LlamaModel, change: dict, field: str) -> None:
    config = QualityConfig(**{"passkey_depths": (), **change})
    with pytest.raises(ValueError, match=field):
        evaluate_quality(model, FullCacheBackend, text_ids(20), config=config)


def test_errors_for_short_text_missing_tokenizer_and_long_context(model: LlamaModel) -> None:
    with pytest.raises(ValueError, match="quality.num_prompt_tokens"):
        evaluate_quality(model, FullCacheBackend, text_ids(8), config=QualityConfig(num_prompt_tokens=8))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        evaluate_quality(model, FullCacheBackend, text_ids(20), config=QualityConfig())
    with pytest.raises(ValueError, match="model context"):
        evaluate_quality(model, FullCacheBackend, text_ids(600), config=QualityConfig(passkey_depths=()))


def test_shipped_text_is_long_plain_english() -> None:
    text = load_quality_text()
    assert 3000 <= len(text.split()) <= 4500
    assert text.isascii()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_cache_against_itself_on_cuda() -> None:
    model = LlamaModel.random(TINY, seed=3, device="cuda")
    config = QualityConfig(num_prompt_tokens=4, num_continuation_tokens=8, passkey_depths=())
    report = evaluate_quality(model, FullCacheBackend, text_ids(64), config=config)
    assert report.top1_agreement == 1.0 and report.kl_max < 1e-4
    assert report.first_divergence == 8
