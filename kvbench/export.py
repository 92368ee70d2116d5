"""kvbench's reference model written as a Hugging Face Llama directory, for servers to load.

``export_hf`` writes what ``LlamaForCausalLM.from_pretrained`` and vLLM read::

    config.json              LlamaForCausalLM: the ModelSpec's shape, norms, RoPE, ids, dtype
    generation_config.json   bos/eos ids
    model.safetensors        the reference weights in HF names (``model.`` prefix; no
                             ``lm_head.weight`` when embeddings are tied)
    tokenizer.json           models with a tokenizer (SmolLM2): the byte-level BPE that
    tokenizer_config.json    kvbench rebuilds from the GGUF, so ids match kvbench's exactly
    .kvbench-export          marker: kvbench wrote this directory (JSON manifest)

The weights are the reference model's for that configuration, bit for bit: seeded random
(``LlamaModel.random(spec, seed)``), SmolLM2's dequantized GGUF, or a local safetensors
path, in the requested dtype. A server loading the directory therefore computes with the
same numbers as kvbench's dense/paged engines.

Export is deterministic (same spec, seed and dtype: the same bytes), atomic (built in a
hidden sibling and renamed into place) and idempotent (an existing export with the same
key is left as is). kvbench replaces only a directory it wrote: one holding the marker
and nothing but the files above, or an empty one. Anything else is refused untouched.
``exported_model_dir`` keeps exports in the kvbench cache directory, keyed by a hash of
what determines the bytes (spec, weight source, seed, dtype, ``EXPORT_FORMAT_VERSION``).

``reference_greedy`` and ``compare_greedy`` check another implementation (transformers,
a live vLLM) against the reference: greedy ids must agree except where the reference's
top-2 logits are within a margin, where float rounding may legitimately pick the other.

transformers is not imported here: kvbench writes the format without depending on it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from kvbench.config import validate_export_config
from kvbench.model import DenseKVCache, LlamaModel, torch_dtype
from kvbench.results import ResultsWriteError, ensure_writable_dir, foreign_dir_problem, install_dir
from kvbench.smollm2 import MODEL_NAME as SMOLLM2
from kvbench.smollm2 import cache_dir
from kvbench.specs import ModelSpec
from kvbench.tokenizer import Tokenizer, find_packaged_gguf

# Bump when the files written below change, so that cached exports are not reused.
EXPORT_FORMAT_VERSION = 1
EXPORT_MARKER = ".kvbench-export"
# Every name kvbench writes into an export directory; one holding anything else is not replaced.
EXPORT_FILES: frozenset[str] = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        EXPORT_MARKER,
    }
)
# Top-2 logit margin below which two implementations may pick different greedy tokens
# from float rounding alone (the issue 13 parity criterion).
DEFAULT_MIN_MARGIN = 1e-3


class ExportError(ValueError):
    """A model that cannot be exported where asked; the message names the path or field."""


# --------------------------------------------------------------------------- reference model
def hf_dtype_name(dtype: str) -> str:
    """``fp32`` -> ``float32`` (Hugging Face's torch_dtype spelling); ValueError naming a bad dtype."""
    return str(torch_dtype(dtype)).removeprefix("torch.")


def reference_model(
    spec: ModelSpec, *, seed: int, dtype: str = "fp32", device: str = "cpu"
) -> tuple[LlamaModel, Tokenizer | None]:
    """The model kvbench's real-mode engines run for ``spec`` (and its tokenizer, if any).

    ``spec.weights``: "random" (seeded by ``seed``), "smollm2" (the packaged GGUF; the
    returned model's spec is the GGUF's), or a local safetensors file or directory.
    """
    if spec.weights == "random":
        return LlamaModel.random(spec, seed, device=device, dtype=dtype), None
    if spec.weights == SMOLLM2:
        from kvbench.smollm2 import load_smollm2

        return load_smollm2(device=device, dtype=dtype)
    return LlamaModel.from_safetensors(spec, spec.weights, device=device, dtype=dtype), None


def _weights_source(spec: ModelSpec, seed: int) -> dict[str, Any]:
    """What, besides the spec and dtype, determines the exported weights (for the cache key).

    Packaged and local files are identified by path, size and mtime: reinstalling or
    rewriting them gives a new key without hashing hundreds of MB on every lookup.
    """
    if spec.weights == "random":
        return {"kind": "random", "seed": seed}
    if spec.weights == SMOLLM2:
        paths = [find_packaged_gguf(SMOLLM2)]
    else:
        root = Path(spec.weights)
        if not root.exists():
            raise ExportError(f"model.weights: {root}: no such file or directory")
        paths = sorted(root.glob("*.safetensors*")) if root.is_dir() else [root]
    return {
        "kind": "files",
        "files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths],
    }


def export_key(spec: ModelSpec, seed: int, dtype: str) -> str:
    """A hex digest of everything that determines an export's bytes. Reads file metadata only."""
    payload = {
        "format": EXPORT_FORMAT_VERSION,
        "spec": dataclasses.asdict(spec),
        "source": _weights_source(spec, seed),
        "dtype": hf_dtype_name(dtype),
    }
    return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=16).hexdigest()


# --------------------------------------------------------------------------- file contents
def hf_llama_config(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """config.json of a ``LlamaForCausalLM`` with ``spec``'s shape; ``dtype`` is the weights'."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_q_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.num_layers,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_id,
        "torch_dtype": hf_dtype_name(dtype),
        # What kvbench.model implements; HF's defaults, written out so no reader guesses.
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "use_cache": True,
    }


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The model's weights in ``LlamaForCausalLM`` names; tied ``lm_head`` left out (it is
    the embedding). Contiguous CPU tensors sharing no storage, as safetensors requires."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            if model.spec.tie_word_embeddings:
                continue
            hf_name = name
        else:
            hf_name = f"model.{name}"
        state[hf_name] = tensor.detach().to("cpu").contiguous()
    return state


def _tokenizer_files(tokenizer: Tokenizer, spec: ModelSpec) -> dict[str, str]:
    """tokenizer.json (tokenizers' own serialisation of kvbench's tokenizer) and a
    tokenizer_config.json that makes transformers load it as is: no BOS/EOS added on
    encode (kvbench adds none), no space clean-up on decode."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.token_text(spec.bos_token_id),
        "eos_token": tokenizer.token_text(spec.eos_token_id),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
    }
    return {"tokenizer.json": tokenizer.to_json(), "tokenizer_config.json": _json_text(config)}


def _json_text(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------- export
def export_hf(spec: ModelSpec, out_dir: str | os.PathLike[str], *, seed: int, dtype: str = "fp32") -> Path:
    """Write the reference model for ``spec`` (``seed``, weights in ``dtype``) to ``out_dir``.

    Returns ``out_dir``. A no-op when ``out_dir`` already holds this export (same key);
    replaces an older kvbench export or an empty directory; refuses anything else with
    ExportError naming the path. Raises SpecError / ValueError naming a bad field or
    dtype, and MissingModelPackageError when SmolLM2's packages are missing.
    """
    spec.validate()
    hf_dtype_name(dtype)  # a bad dtype fails before any work
    out = Path(out_dir)
    key = export_key(spec, seed, dtype)
    if is_export_of(out, key):
        return out
    check_replaceable_export(out)
    try:
        ensure_writable_dir(out.parent)
    except ResultsWriteError as exc:
        raise ExportError(str(exc)) from None
    model, tokenizer = reference_model(spec, seed=seed, dtype=dtype)
    # The written config describes the model that was built: for SmolLM2 that is the
    # GGUF's spec (its rms_norm_eps is the GGUF's float32 value, not the preset's 1e-5).
    written = model.spec
    texts = {
        "config.json": _json_text(hf_llama_config(written, dtype)),
        "generation_config.json": _json_text(
            {"bos_token_id": written.bos_token_id, "eos_token_id": written.eos_token_id}
        ),
    }
    if tokenizer is not None:
        texts.update(_tokenizer_files(tokenizer, written))
    manifest = {
        "written_by": "kvbench export (kvbench.export.export_hf); kvbench replaces this directory "
        "only while it holds nothing but the files it wrote",
        "key": key,
        "format": EXPORT_FORMAT_VERSION,
        "spec": dataclasses.asdict(spec),
        "seed": seed,
        "dtype": hf_dtype_name(dtype),
        "files": sorted([*texts, "model.safetensors"]),
    }
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _write_files(tmp, model, texts, manifest)
        _install(tmp, out, key)
    except OSError as exc:
        raise ExportError(f"{out}: cannot write: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_files(tmp: Path, model: LlamaModel, texts: dict[str, str], manifest: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    for name, text in texts.items():
        (tmp / name).write_text(text)
    weights = tmp / "model.safetensors"
    # metadata "format": "pt" is what transformers checks before loading a safetensors file.
    save_file(hf_state_dict(model), str(weights), metadata={"format": "pt"})
    # safetensors creates its file owner-only; a server running as another user must read
    # it, so it gets the mode (umask) of the other files.
    os.chmod(weights, stat.S_IMODE((tmp / "config.json").stat().st_mode))
    with open(tmp / EXPORT_MARKER, "w") as handle:  # last: the completion marker
        handle.write(_json_text(manifest))
        handle.flush()
        os.fsync(handle.fileno())


def _install(tmp: Path, out: Path, key: str) -> None:
    """Move the finished ``tmp`` to ``out``: absent or empty, one rename; an older kvbench
    export, swapped in by ``kvbench.results.install_dir`` (never a mix of the two)."""
    try:
        os.replace(tmp, out)  # succeeds when out is absent or an empty directory
        return
    except OSError:
        if is_export_of(out, key):
            return  # a concurrent export of the same key got there first
        check_replaceable_export(out)
    install_dir(tmp, out)  # an atomic exchange where the OS has one; the old export ends at tmp


def read_manifest(out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker's manifest of a kvbench export, or None when there is none or it is unreadable."""
    try:
        manifest = json.loads((Path(out_dir) / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_export_of(out_dir: str | os.PathLike[str], key: str) -> bool:
    """True when ``out_dir`` is a complete kvbench export with ``key``. Reads only."""
    out = Path(out_dir)
    manifest = read_manifest(out)
    if manifest is None or out.is_symlink() or manifest.get("key") != key:
        return False
    files = manifest.get("files")
    return isinstance(files, list) and all((out / str(name)).is_file() for name in files)


def check_replaceable_export(out_dir: str | os.PathLike[str]) -> None:
    """Raise ExportError unless ``out_dir`` is absent, an empty directory, or a kvbench
    export (the marker, and only ``EXPORT_FILES`` as plain files). Reads only."""
    out = Path(out_dir)
    if not os.path.lexists(out):
        return
    refusal = f"{out}: exists and is not a model directory kvbench exported, so it is left untouched"
    try:
        problem = foreign_dir_problem(out, EXPORT_FILES)
        empty = not problem and not any(out.iterdir())
    except OSError as exc:
        raise ExportError(f"{out}: cannot read: {exc.strerror or exc}") from None
    if problem:
        raise ExportError(f"{refusal} ({problem}); choose another out= or move it away")
    if not empty and read_manifest(out) is None:
        raise ExportError(f"{refusal} (no {EXPORT_MARKER} marker); choose another out= or move it away")


def exported_model_dir(spec: ModelSpec, seed: int, dtype: str = "fp32") -> Path:
    """The export of ``spec`` under the kvbench cache directory, written on first use.

    ``<cache>/hf/<name>-<dtype>-<key>``: the key covers spec, weight source, seed, dtype
    and format version, so a changed model never reuses a stale export.
    """
    key = export_key(spec, seed, dtype)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", spec.name).lstrip(".") or "model"
    out = cache_dir() / "hf" / f"{name}-{hf_dtype_name(dtype)}-{key[:16]}"
    return export_hf(spec, out, seed=seed, dtype=dtype)


# --------------------------------------------------------------------------- greedy parity
@dataclass(frozen=True)
class GreedyTrace:
    """The reference's greedy continuation with, per step, the runner-up and the top-2 margin."""

    token_ids: tuple[int, ...]
    runner_up_ids: tuple[int, ...]
    margins: tuple[float, ...]  # top-1 minus top-2 logit, fp32


@torch.inference_mode()
def reference_greedy(model: LlamaModel, prompt_ids: Sequence[int], num_new_tokens: int) -> GreedyTrace:
    """Greedy decode ``num_new_tokens`` after ``prompt_ids`` with the dense reference cache
    (EOS ignored, as servers do with ``ignore_eos``). Raises ValueError on an empty prompt,
    a non-positive count or a length past the model's positions."""
    if not prompt_ids or num_new_tokens <= 0:
        raise ValueError(
            f"reference_greedy: needs a prompt and num_new_tokens > 0 "
            f"(got {len(prompt_ids)} prompt ids, {num_new_tokens})"
        )
    max_len = len(prompt_ids) + num_new_tokens
    if max_len > model.spec.max_position_embeddings:
        raise ValueError(
            f"reference_greedy: {max_len} positions exceed {model.spec.name}'s "
            f"max_position_embeddings={model.spec.max_position_embeddings}"
        )
    weight = model.embed_tokens.weight
    cache = DenseKVCache(
        model.spec, num_slots=1, max_len=max_len, device=str(weight.device), dtype=weight.dtype
    )
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=weight.device)
    start = 0
    tokens: list[int] = []
    runners: list[int] = []
    margins: list[float] = []
    for _ in range(num_new_tokens):
        cache.prepare([(0, start, len(ids))])
        positions = torch.arange(start, start + len(ids), device=weight.device)
        hidden = model(ids, positions, cache)
        top = model.compute_logits(hidden[-1:])[0].topk(2)
        tokens.append(int(top.indices[0]))
        runners.append(int(top.indices[1]))
        margins.append(float(top.values[0] - top.values[1]))
        start += len(ids)
        ids = top.indices[:1]
    return GreedyTrace(tuple(tokens), tuple(runners), tuple(margins))


@dataclass(frozen=True)
class GreedyComparison:
    """How a candidate's greedy ids compare with a ``GreedyTrace``.

    verdict: "identical"; "near_tie" (first difference at a step where the reference's
    top-2 margin is at most ``min_margin`` and the candidate took the reference's
    runner-up: rounding, not a bug); "mismatch" (anything else, lengths included).
    ``decisive``: every reference step's margin exceeds ``min_margin`` (such requests
    must be identical).
    """

    verdict: str
    first_difference: int | None  # step index; None when identical
    margin_at_difference: float | None
    min_margin_seen: float  # smallest reference margin over all steps (inf for none)
    decisive: bool

    @property
    def ok(self) -> bool:
        return self.verdict != "mismatch"


def compare_greedy(
    reference: GreedyTrace, candidate_ids: Sequence[int], min_margin: float = DEFAULT_MIN_MARGIN
) -> GreedyComparison:
    """Compare ``candidate_ids`` (another implementation's greedy output for the same prompt)
    with ``reference``. Steps after the first difference are not compared: their contexts
    differ. Pure."""
    smallest = min(reference.margins, default=float("inf"))
    decisive = smallest > min_margin
    candidate = [int(t) for t in candidate_ids]
    for step, (ref, cand) in enumerate(zip(reference.token_ids, candidate, strict=False)):
        if ref != cand:
            margin = reference.margins[step]
            tie = margin <= min_margin and cand == reference.runner_up_ids[step]
            verdict = "near_tie" if tie else "mismatch"
            return GreedyComparison(verdict, step, margin, smallest, decisive)
    if len(candidate) != len(reference.token_ids):
        step = min(len(candidate), len(reference.token_ids))
        return GreedyComparison("mismatch", step, None, smallest, decisive)
    return GreedyComparison("identical", None, None, smallest, decisive)


# --------------------------------------------------------------------------- command line
def export_from_config(cfg: Any) -> Path:
    """Run `kvbench export` for a Hydra-composed config; returns the exported directory.

    Re-merges ``cfg`` into ``ExportConfig`` so that ``+key=`` additions fail too. Raises
    ConfigError naming the key (unknown key, wrong type, impossible spec, bad dtype),
    ExportError naming the path, ValueError for a model kvbench cannot run (MoE, MLA).
    """
    merged = validate_export_config(cfg)
    spec = ModelSpec(**OmegaConf.to_container(merged.model))
    if merged.out is None:
        return exported_model_dir(spec, merged.seed, merged.dtype)
    return export_hf(spec, Path(merged.out).expanduser(), seed=merged.seed, dtype=merged.dtype)
