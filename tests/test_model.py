"""The tiny Llama decoder: cache consistency, grouped GQA path, and Hugging Face parity."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvbench.model import DenseKVCache, LlamaModel, grouped_attention
from kvbench.specs import ModelSpec

TINY = ModelSpec(
    name="t",
    num_layers=2,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=16,
    hidden_size=128,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=256,
)


def _logits_full(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    cache = DenseKVCache(model.spec, 1, 256, "cpu", torch.float32)
    cache.prepare([(0, 0, len(ids))])
    return model.compute_logits(model(ids, torch.arange(len(ids)), cache))


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_incremental_decoding_matches_full_forward(kv_heads: int) -> None:
    spec = dataclasses.replace(TINY, num_kv_heads=kv_heads)
    model = LlamaModel.random(spec, seed=1)
    ids = torch.randint(3, spec.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    full = _logits_full(model, ids)
    cache = DenseKVCache(spec, 1, 256, "cpu", torch.float32)
    cache.prepare([(0, 0, 25)])
    steps = [model.compute_logits(model(ids[:25], torch.arange(25), cache))[-1:]]
    for pos in range(25, 40):
        cache.prepare([(0, pos, 1)])
        steps.append(model.compute_logits(model(ids[pos : pos + 1], torch.tensor([pos]), cache)))
    torch.testing.assert_close(torch.cat(steps), full[24:], rtol=1e-4, atol=1e-4)


def test_mixed_batch_equals_separate_sequences() -> None:
    model = LlamaModel.random(TINY, seed=2)
    a = torch.randint(3, 512, (11,), generator=torch.Generator().manual_seed(1))
    b = torch.randint(3, 512, (7,), generator=torch.Generator().manual_seed(2))
    cache = DenseKVCache(TINY, 2, 64, "cpu", torch.float32)
    cache.prepare([(0, 0, 11), (1, 0, 7)])
    hidden = model(torch.cat([a, b]), torch.cat([torch.arange(11), torch.arange(7)]), cache)
    logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits[:11], _logits_full(model, a), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[11:], _logits_full(model, b), rtol=1e-4, atol=1e-4)


def test_grouped_attention_matches_repeated_heads_and_never_repeats_kv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 8, 16, generator=gen)
    k = torch.randn(9, 2, 16, generator=gen)
    v = torch.randn(9, 2, 16, generator=gen)
    # Reference: materialised repeat (Hugging Face's repeat_kv) + causal SDPA.
    kr, vr = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    mask = torch.arange(9)[None, :] <= torch.arange(4, 9)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kr.transpose(0, 1), vr.transpose(0, 1), attn_mask=mask, scale=0.25
    ).transpose(0, 1)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("grouped path must not repeat K/V heads")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", forbidden)
    monkeypatch.setattr(torch, "repeat_interleave", forbidden)
    out = grouped_attention(q, k, v, q_start=4, scale=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_random_weights_are_seeded() -> None:
    a = LlamaModel.random(TINY, seed=5)
    b = LlamaModel.random(TINY, seed=5)
    c = LlamaModel.random(TINY, seed=6)
    assert torch.equal(a.layers[0].self_attn.q_proj.weight, b.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(a.layers[0].self_attn.q_proj.weight, c.layers[0].self_attn.q_proj.weight)


def test_moe_and_mla_are_rejected_for_real_execution() -> None:
    with pytest.raises(ValueError, match="mode=sim"):
        LlamaModel(dataclasses.replace(TINY, num_experts=8, num_experts_per_token=2))


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_huggingface_llama(tied: bool, tmp_path) -> None:  # noqa: ANN001
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    spec = dataclasses.replace(TINY, tie_word_embeddings=tied, rope_theta=50000.0)
    ours = LlamaModel.random(spec, seed=7)
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_q_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=tied,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    state = {f"model.{k}": v.clone() for k, v in ours.state_dict().items() if k != "lm_head.weight"}
    if not tied:
        state["lm_head.weight"] = ours.lm_head.weight.detach().clone()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not [m for m in missing if m != "lm_head.weight"] and not unexpected
    ids = torch.randint(3, spec.vocab_size, (33,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(_logits_full(ours, ids), expected, rtol=1e-4, atol=1e-4)
    # The safetensors loader reads the same checkpoint back by Hugging Face names.
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    loaded = LlamaModel.from_safetensors(spec, tmp_path)
    torch.testing.assert_close(_logits_full(loaded, ids), expected, rtol=1e-4, atol=1e-4)
