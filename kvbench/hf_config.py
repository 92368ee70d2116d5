"""Build a ModelSpec from a Hugging Face ``config.json`` on disk (no network, no transformers).

Understood keys (Llama, Mistral, Qwen2, Mixtral, SmolLM2, DeepSeek-V2):

    required   num_hidden_layers, num_attention_heads, hidden_size, intermediate_size,
               vocab_size, max_position_embeddings
    optional   num_key_value_heads (default: num_attention_heads), head_dim (default:
               hidden_size / num_attention_heads), torch_dtype or dtype (default fp32,
               as transformers loads), rope_theta (10000), rms_norm_eps (1e-6),
               tie_word_embeddings (false), bos/eos_token_id (first entry of a list)
    MoE        num_local_experts (Mixtral) or n_routed_experts (DeepSeek), with
               num_experts_per_tok; DeepSeek experts are moe_intermediate_size wide
    MLA        kv_lora_rank, qk_rope_head_dim; head_dim = qk_nope_head_dim + qk_rope_head_dim

An MLA config yields ``num_params=None`` (the Llama formula does not cover MLA): pass
``num_params=`` when the published count is needed for weight sizing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kvbench.specs import ModelSpec, SpecError

# Hugging Face torch_dtype strings -> kvbench dtype names.
_HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class HFConfigError(SpecError):
    """A config.json that cannot be read as a ModelSpec; the message names file, key, line."""


class _ConfigReader:
    """Typed access to one parsed config.json that reports errors with file and line."""

    def __init__(self, path: Path, text: str, data: dict[str, Any]) -> None:
        self.path = path
        self._text = text
        self._data = data

    def _where(self, key: str) -> str:
        # json does not keep positions; the first `"key":` in the text is the line a
        # reader needs (nested duplicates of top-level keys do not occur in HF configs).
        match = re.search(r'"' + re.escape(key) + r'"\s*:', self._text)
        if match is None:
            return str(self.path)
        line = self._text.count("\n", 0, match.start()) + 1
        return f"{self.path}:{line}"

    def error(self, key: str, message: str) -> HFConfigError:
        return HFConfigError(f"{self._where(key)}: key {key!r}: {message}")

    def has(self, key: str) -> bool:
        return self._data.get(key) is not None

    def raw(self, key: str) -> Any:
        return self._data.get(key)

    def get_int(self, key: str, default: int | None = None) -> int:
        value = self._data.get(key)
        if value is None:
            if default is None:
                raise HFConfigError(f"{self.path}: missing required key {key!r}")
            return default
        if isinstance(value, list) and value and key.endswith("_token_id"):
            value = value[0]  # Llama-3.1 style eos lists: the first id is the primary one
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        return value

    def get_float(self, key: str, default: float) -> float:
        value = self._data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"expected a number, got {value!r}")
        return float(value)

    def get_bool(self, key: str, default: bool) -> bool:
        value = self._data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value


def _read(path: Path) -> _ConfigReader:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise HFConfigError(f"{path}: cannot read config.json: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HFConfigError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return _ConfigReader(path, text, data)


def _dtype(cfg: _ConfigReader) -> str:
    # transformers >= 4.56 writes "dtype"; older configs write "torch_dtype".
    key = "dtype" if cfg.has("dtype") else "torch_dtype"
    value = cfg.raw(key)
    if value is None:
        return "fp32"
    if value not in _HF_DTYPES:
        raise cfg.error(key, f"unsupported dtype {value!r} (supported: {', '.join(_HF_DTYPES)})")
    return _HF_DTYPES[value]


def _default_name(path: Path) -> str:
    # ".../Meta-Llama-3-8B/config.json" -> "Meta-Llama-3-8B"; a bare "x.json" -> "x".
    return path.parent.name if path.name == "config.json" and path.parent.name else path.stem


def model_spec_from_hf_config(
    path: str | Path, name: str | None = None, num_params: int | None = None
) -> ModelSpec:
    """Read ``path`` (a config.json file, or a directory containing one) into a ModelSpec.

    ``name`` defaults to the directory name (or the file stem); ``num_params`` is copied
    into the spec unchanged. Reads the file only; mutates nothing.

    Raises HFConfigError (a SpecError) naming the file and, where one is involved, the
    key and its line: unreadable file, invalid JSON (line and column), missing required
    key, wrong value type, unsupported dtype, or a shape ModelSpec.validate() rejects.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    cfg = _read(path)

    num_q_heads = cfg.get_int("num_attention_heads")
    hidden_size = cfg.get_int("hidden_size")
    is_mla = cfg.get_int("kv_lora_rank", 0) > 0
    if is_mla:
        head_dim = cfg.get_int("qk_nope_head_dim") + cfg.get_int("qk_rope_head_dim")
    elif cfg.has("head_dim"):
        head_dim = cfg.get_int("head_dim")
    else:
        if hidden_size % num_q_heads != 0:
            raise cfg.error(
                "hidden_size",
                f"{hidden_size} is not divisible by num_attention_heads={num_q_heads}; "
                "add head_dim to the config",
            )
        head_dim = hidden_size // num_q_heads

    # Mixtral names its expert count num_local_experts; DeepSeek n_routed_experts, whose
    # experts are moe_intermediate_size wide (intermediate_size is its dense layer).
    if cfg.has("n_routed_experts"):
        num_experts = cfg.get_int("n_routed_experts")
        intermediate_size = cfg.get_int("moe_intermediate_size")
    else:
        num_experts = cfg.get_int("num_local_experts", 1)
        intermediate_size = cfg.get_int("intermediate_size")
    num_experts_per_token = cfg.get_int("num_experts_per_tok", 1) if num_experts > 1 else 1

    defaults = ModelSpec()
    spec = ModelSpec(
        name=name or _default_name(path),
        num_layers=cfg.get_int("num_hidden_layers"),
        num_q_heads=num_q_heads,
        num_kv_heads=cfg.get_int("num_key_value_heads", num_q_heads),
        head_dim=head_dim,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        vocab_size=cfg.get_int("vocab_size"),
        max_position_embeddings=cfg.get_int("max_position_embeddings"),
        dtype=_dtype(cfg),
        rope_theta=cfg.get_float("rope_theta", 10000.0),
        rms_norm_eps=cfg.get_float("rms_norm_eps", 1e-6),
        tie_word_embeddings=cfg.get_bool("tie_word_embeddings", False),
        num_experts=num_experts,
        num_experts_per_token=num_experts_per_token,
        kv_lora_rank=cfg.get_int("kv_lora_rank", 0),
        qk_rope_head_dim=cfg.get_int("qk_rope_head_dim", 0) if is_mla else 0,
        num_params=num_params,
        bos_token_id=cfg.get_int("bos_token_id", defaults.bos_token_id),
        eos_token_id=cfg.get_int("eos_token_id", defaults.eos_token_id),
    )
    try:
        spec.validate()
    except SpecError as exc:
        raise HFConfigError(f"{path}: {exc}") from None
    return spec
