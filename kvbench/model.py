"""A Llama-architecture decoder in plain torch (RMSNorm, RoPE, MHA/GQA/MQA, SwiGLU).

The model never owns KV memory. Every attention layer hands its new keys and values
to an ``AttentionBackend`` chosen by the engine, which stores them wherever that
engine keeps KV (a dense contiguous cache, a paged block pool, a bounded H2O buffer)
and returns the attention output. The model therefore runs on a flat batch of
``T`` tokens from any number of sequences (vLLM's varlen layout); only the backend
knows which token belongs to which sequence.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` (minus the
``model.`` prefix), so a Llama-format safetensors checkpoint loads by name.
RoPE uses the rotate-half convention of Hugging Face checkpoints.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from kvbench.specs import ModelSpec

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """Torch dtype for a compute dtype name; raises ValueError naming it when not computable."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} cannot be used for model compute (use fp32, bf16 or fp16)"
        ) from None


class AttentionBackend(Protocol):
    """Where an engine keeps K/V and how it attends over them.

    The engine prepares the backend with the step's batch layout before calling the
    model; the model then calls ``attend`` once per layer, in layer order.
    """

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store this step's keys/values for ``layer`` and attend.

        q: [T, num_q_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T
        tokens of this step, RoPE already applied to q and k. Mutates the backend's KV
        storage. Returns the attention output [T, num_q_heads, head_dim].
        """
        ...


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float) -> Tensor:
    """Causal attention of one sequence's queries over its keys, GQA without repeating K/V.

    q: [T, Hq, D] at positions [q_start, q_start + T); k, v: [S, Hkv, D] at positions
    [0, S) with S >= q_start + T. Query head h uses KV head h // (Hq // Hkv), the
    Hugging Face grouping. Returns [T, Hq, D] in q's dtype (softmax in fp32).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    # Fold the group into the query rows: [Hkv, G*T, D] @ [Hkv, D, S] is one bmm per
    # KV head, so each K/V head is read once and never materialised G times.
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * num_tokens, head_dim)
    scores = torch.bmm(qg.float(), k.permute(1, 2, 0).float()) * scale  # [Hkv, G*T, S]
    q_pos = torch.arange(q_start, q_start + num_tokens, device=q.device).repeat(group)  # [G*T]
    k_pos = torch.arange(num_keys, device=q.device)
    scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, v.permute(1, 0, 2).float())  # [Hkv, G*T, D]
    out = out.reshape(num_kv_heads, group, num_tokens, head_dim).permute(2, 0, 1, 3)
    return out.reshape(num_tokens, num_q_heads, head_dim).to(q.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 like the reference implementation, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables: [max_positions, head_dim] (rotate-half layout)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        emb = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: [T, H, D]; positions: [T] -> x rotated by each token's position."""
        cos = self.cos[positions][:, None, :]  # [T, 1, D]
        sin = self.sin[positions][:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_q_heads = spec.num_q_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_q_heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=False)
        self.o_proj = nn.Linear(spec.num_q_heads * spec.head_dim, spec.hidden_size, bias=False)

    def forward(
        self, x: Tensor, positions: Tensor, rope: RotaryEmbedding, layer: int, backend: AttentionBackend
    ) -> Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_q_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(q, positions), rope(k, positions)
        out = backend.attend(layer, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_q_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self, x: Tensor, positions: Tensor, rope: RotaryEmbedding, layer: int, backend: AttentionBackend
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, layer, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Decoder-only Llama. MoE and MLA specs are for sizing and simulation only."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.num_experts > 1 or spec.kv_lora_rank > 0:
            raise ValueError(
                f"model {spec.name!r}: MoE / MLA models are supported for sizing and simulation "
                "(mode=sim), not for real-mode execution"
            )
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta)
        self.scale = 1.0 / math.sqrt(spec.head_dim)

    @classmethod
    def random(cls, spec: ModelSpec, seed: int, device: str = "cpu", dtype: str = "fp32") -> LlamaModel:
        """Seeded random weights scaled so that greedy decoding has clear argmax margins."""
        generator = torch.Generator().manual_seed(seed)
        model = cls(spec)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
                elif param.dim() == 2:
                    # fan-in scaling keeps activations O(1) through the layers.
                    param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
        return model.to(device=device, dtype=torch_dtype(dtype)).eval()

    @classmethod
    def from_safetensors(
        cls, spec: ModelSpec, path: str | Path, device: str = "cpu", dtype: str = "fp32"
    ) -> LlamaModel:
        """Load Hugging Face Llama-format weights from a local directory or file.

        Reads ``model.safetensors``, or every shard named in
        ``model.safetensors.index.json``. Raises FileNotFoundError naming the path when
        nothing is there and KeyError naming missing/unexpected tensors.
        """
        from safetensors.torch import load_file

        root = Path(path)
        if root.is_file():
            files = [root]
        elif (root / "model.safetensors.index.json").exists():
            index = json.loads((root / "model.safetensors.index.json").read_text())
            files = sorted({root / name for name in index["weight_map"].values()})
        elif (root / "model.safetensors").exists():
            files = [root / "model.safetensors"]
        else:
            raise FileNotFoundError(f"{root}: no model.safetensors or model.safetensors.index.json")
        state: dict[str, Tensor] = {}
        for file in files:
            for name, tensor in load_file(str(file)).items():
                state[name.removeprefix("model.")] = tensor
        return cls.from_state_dict(spec, state, device=device, dtype=dtype)

    @classmethod
    def from_state_dict(
        cls, spec: ModelSpec, state: dict[str, Tensor], device: str = "cpu", dtype: str = "fp32"
    ) -> LlamaModel:
        """Build from a name -> tensor map in Hugging Face naming (without ``model.``)."""
        model = cls(spec)
        if spec.tie_word_embeddings:
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (spec.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise KeyError(f"weights for {spec.name!r}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if spec.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.to(device=device, dtype=torch_dtype(dtype)).eval()

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, backend: AttentionBackend) -> Tensor:
        """input_ids, positions: int64 [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        for layer_index, layer in enumerate(self.layers):
            x = layer(x, positions, self.rope, layer_index, backend)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [N, hidden] -> fp32 logits [N, vocab]."""
        return self.lm_head(hidden).float()


class DenseKVCache:
    """The gpt-fast layout: one contiguous [max_len] cache per sequence slot.

    k, v: [num_layers, num_slots, max_len, num_kv_heads, head_dim]. This is the
    numerical reference every other KV layout is compared against.
    """

    def __init__(
        self, spec: ModelSpec, num_slots: int, max_len: int, device: str, dtype: torch.dtype
    ) -> None:
        shape = (spec.num_layers, num_slots, max_len, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self._batch: list[tuple[int, int, int]] = []

    def prepare(self, batch: list[tuple[int, int, int]]) -> None:
        """Set the step's layout: (slot, start_position, num_tokens) per sequence, in token order."""
        for slot, start, num_tokens in batch:
            if start + num_tokens > self.max_len:
                raise ValueError(f"slot {slot}: position {start + num_tokens} exceeds max_len {self.max_len}")
        self._batch = batch

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        offset = 0
        for slot, start, num_tokens in self._batch:
            end = start + num_tokens
            self.k[layer, slot, start:end] = k[offset : offset + num_tokens]
            self.v[layer, slot, start:end] = v[offset : offset + num_tokens]
            out[offset : offset + num_tokens] = grouped_attention(
                q[offset : offset + num_tokens],
                self.k[layer, slot, :end],
                self.v[layer, slot, :end],
                start,
                self.scale,
            )
            offset += num_tokens
        return out
