"""Reading Hugging Face config.json files into ModelSpec, and its error messages."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.hf_config import HFConfigError, model_spec_from_hf_config
from kvbench.sizing import kv_bytes_per_token, num_params
from kvbench.specs import ModelSpec, SpecError

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf_configs"
CONF = Path(__file__).resolve().parents[1] / "conf"


def preset(name: str) -> ModelSpec:
    merged = OmegaConf.merge(OmegaConf.structured(ModelSpec), OmegaConf.load(CONF / "model" / f"{name}.yaml"))
    return OmegaConf.to_object(merged)


def comparable(spec: ModelSpec) -> dict:
    # Presets carry what config.json cannot know: published counts, weight loaders.
    data = dataclasses.asdict(spec)
    for key in ("num_params", "weights"):
        data.pop(key)
    return data


@pytest.mark.parametrize(
    "name", ["llama-3-8b", "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "smollm2-135m", "deepseek-v2"]
)
def test_config_json_matches_the_preset(name: str) -> None:
    spec = model_spec_from_hf_config(FIXTURES / f"{name}.json")
    assert comparable(spec) == comparable(preset(name))


def test_llama2_7b_defaults_and_dtype() -> None:
    spec = model_spec_from_hf_config(FIXTURES / "llama-2-7b.json")
    # The published checkpoint is float16 (the preset uses bf16 like the others).
    assert spec.dtype == "fp16"
    assert spec.rope_theta == 10000.0  # absent from the file: transformers' default
    assert spec.head_dim == 128  # absent: hidden 4096 / 32 heads
    assert num_params(spec) == 6_738_415_616
    assert comparable(dataclasses.replace(spec, dtype="bf16")) == comparable(preset("llama-2-7b"))


def test_deepseek_mla_fields() -> None:
    spec = model_spec_from_hf_config(FIXTURES / "deepseek-v2.json")
    assert spec.attention_kind == "mla"
    assert (spec.kv_lora_rank, spec.qk_rope_head_dim, spec.head_dim) == (512, 64, 192)
    assert (spec.num_experts, spec.num_experts_per_token, spec.intermediate_size) == (160, 6, 1536)
    assert kv_bytes_per_token(spec, "bf16") == 69_120
    assert spec.num_params is None
    with pytest.raises(SpecError, match="num_params"):
        num_params(spec)
    given = model_spec_from_hf_config(FIXTURES / "deepseek-v2.json", num_params=236_000_000_000)
    assert num_params(given) == 236_000_000_000


def test_names_directory_and_defaults(tmp_path: Path) -> None:
    model_dir = tmp_path / "My-Model"
    model_dir.mkdir()
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 100,
        "max_position_embeddings": 512,
        "eos_token_id": [7, 8],
        "head_dim": None,
        "num_key_value_heads": None,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    spec = model_spec_from_hf_config(model_dir)
    assert spec.name == "My-Model"
    assert (spec.num_kv_heads, spec.head_dim) == (4, 16)  # null -> defaults
    assert spec.dtype == "fp32"  # no torch_dtype: transformers loads float32
    assert spec.eos_token_id == 7
    assert spec.rms_norm_eps == 1e-6 and not spec.tie_word_embeddings
    assert model_spec_from_hf_config(model_dir / "config.json", name="x").name == "x"

    config["dtype"] = "float16"  # transformers >= 4.56 spelling
    (model_dir / "config.json").write_text(json.dumps(config))
    assert model_spec_from_hf_config(model_dir).dtype == "fp16"


def _write(tmp_path: Path, data: dict, indent: int | None = 2) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data, indent=indent))
    return path


def _base() -> dict:
    return json.loads((FIXTURES / "llama-3-8b.json").read_text())


@pytest.mark.parametrize(
    "key",
    [
        "num_hidden_layers",
        "num_attention_heads",
        "hidden_size",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
    ],
)
def test_missing_required_key_names_file_and_key(tmp_path: Path, key: str) -> None:
    data = _base()
    del data[key]
    path = _write(tmp_path, data)
    with pytest.raises(HFConfigError) as info:
        model_spec_from_hf_config(path)
    message = str(info.value)
    assert str(path) in message and f"missing required key {key!r}" in message


def test_wrong_type_names_key_and_line(tmp_path: Path) -> None:
    data = _base()
    data["num_key_value_heads"] = "8"
    path = _write(tmp_path, data)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "num_key_value_heads" in text)
    with pytest.raises(
        HFConfigError, match=rf"config\.json:{line}: key 'num_key_value_heads': expected an integer"
    ):
        model_spec_from_hf_config(path)

    data = _base()
    data["tie_word_embeddings"] = 1
    with pytest.raises(HFConfigError, match="key 'tie_word_embeddings': expected true or false"):
        model_spec_from_hf_config(_write(tmp_path, data))

    data = _base()
    data["torch_dtype"] = "float8_e4m3fn"
    with pytest.raises(HFConfigError, match="key 'torch_dtype': unsupported dtype 'float8_e4m3fn'"):
        model_spec_from_hf_config(_write(tmp_path, data))


def test_invalid_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{\n  "hidden_size": 64,\n  "vocab_size": ,\n}\n')
    with pytest.raises(HFConfigError, match=r"config\.json:3:\d+: invalid JSON"):
        model_spec_from_hf_config(path)
    path.write_text("[1, 2]")
    with pytest.raises(HFConfigError, match="expected a JSON object"):
        model_spec_from_hf_config(path)


def test_missing_file_and_impossible_shape(tmp_path: Path) -> None:
    with pytest.raises(HFConfigError, match="cannot read config.json"):
        model_spec_from_hf_config(tmp_path / "absent.json")
    data = _base()
    data["num_key_value_heads"] = 5  # does not divide 32 query heads
    path = _write(tmp_path, data)
    with pytest.raises(HFConfigError, match=r"config\.json: model\.num_kv_heads: 5 does not divide"):
        model_spec_from_hf_config(path)
    data = _base()
    data["hidden_size"] = 4095  # no head_dim and not divisible by 32 heads
    with pytest.raises(HFConfigError, match="key 'hidden_size'.*add head_dim"):
        model_spec_from_hf_config(_write(tmp_path, data))
