"""Finding and opening trace files: shipped short names, transparent gzip, format sniffing."""

from __future__ import annotations

import gzip
import io
from importlib import resources
from pathlib import Path
from typing import TextIO

from kvbench.workloads.errors import TraceError

# Short name -> (file in workloads/data/, format). Sources and licences: data/README.md.
SHIPPED_TRACES: dict[str, tuple[str, str]] = {
    "mooncake_conversation": ("mooncake_fast25_conversation_trace.jsonl.gz", "mooncake"),
    "mooncake_synthetic": ("mooncake_fast25_synthetic_trace.jsonl.gz", "mooncake"),
    "azure_code": ("azure_llm_2023_code.csv.gz", "azure"),
    "azure_conv": ("azure_llm_2023_conv.csv.gz", "azure"),
}

TRACE_FORMATS = ("mooncake", "azure", "burstgpt", "sharegpt")

_GZIP_MAGIC = b"\x1f\x8b"
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_HEADER = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


def resolve_trace_path(path_or_name: str | Path) -> Path:
    """The file for a shipped short name or a path; FileNotFoundError naming both options."""
    name = str(path_or_name)
    if name in SHIPPED_TRACES:
        data = resources.files("kvbench.workloads") / "data" / SHIPPED_TRACES[name][0]
        return Path(str(data))
    path = Path(name)
    if not path.is_file():
        shipped = ", ".join(sorted(SHIPPED_TRACES))
        raise FileNotFoundError(f"{name}: no such trace file, and not a shipped trace name ({shipped})")
    return path


def open_text(path: str | Path) -> TextIO:
    """Open ``path`` for reading text (UTF-8), gunzipping when the file starts with the
    gzip magic bytes, whatever its name. The caller closes the handle."""
    with open(path, "rb") as probe:
        compressed = probe.read(2) == _GZIP_MAGIC
    if compressed:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def detect_format(path: str | Path) -> str:
    """The trace format of ``path``: shipped name, else by suffix (``.jsonl`` Mooncake,
    ``.json`` ShareGPT), and for ``.csv`` by header (Azure or BurstGPT). Raises
    TraceError at line 1 when it cannot tell."""
    name = str(path)
    if name in SHIPPED_TRACES:
        return SHIPPED_TRACES[name][1]
    stem = name[: -len(".gz")] if name.endswith(".gz") else name
    if stem.endswith(".jsonl"):
        return "mooncake"
    if stem.endswith(".json"):
        return "sharegpt"
    if stem.endswith(".csv"):
        with open_text(path) as handle:
            header = tuple(col.strip() for col in handle.readline().strip().split(","))
        if header[:3] == AZURE_HEADER:
            return "azure"
        if header[:6] == BURSTGPT_HEADER:
            return "burstgpt"
        raise TraceError(
            path,
            1,
            "<header>",
            f"unknown CSV header {','.join(header)!r} (Azure: {','.join(AZURE_HEADER)}; "
            f"BurstGPT: {','.join(BURSTGPT_HEADER)})",
        )
    raise TraceError(
        path, 0, "<format>", f"cannot tell the format from the name; pass one of {TRACE_FORMATS}"
    )
