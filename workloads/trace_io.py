"""Finding and opening trace files: shipped short names, transparent gzip, format sniffing."""

from __future__ import annotations

import gzip
import io
import re
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from importlib import resources
from pathlib import Path
from typing import BinaryIO, TextIO

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
    """The file for a shipped short name or a path, absolute (so that every message names
    the file unambiguously, and a bare ``trace.jsonl.gz: problem`` cannot read as a config
    key); FileNotFoundError naming both options."""
    name = str(path_or_name)
    if name in SHIPPED_TRACES:
        data = resources.files("kvbench.workloads") / "data" / SHIPPED_TRACES[name][0]
        return Path(str(data))
    path = Path(name)
    if not path.is_file():
        shipped = ", ".join(sorted(SHIPPED_TRACES))
        raise FileNotFoundError(f"{name}: no such trace file, and not a shipped trace name ({shipped})")
    return path.absolute()


@contextmanager
def open_text(path: str | Path) -> Iterator[TextIO]:
    """Open ``path`` for reading text (UTF-8), gunzipping when the file starts with the
    gzip magic bytes, whatever its name; a context manager.

    Bytes that are not UTF-8 do not raise: they decode to lone surrogates (Python's
    ``surrogateescape``), which ``bad_byte_index`` finds, so the parser can name the line
    and column and skip that line alone under ``skip_invalid``. Lines end at ``\\n``,
    ``\\r\\n`` or ``\\r``, kept on the line (``newline=""``, as the csv module needs).
    A file that cannot be opened, or whose reading fails inside the ``with`` block (gzip
    data cut short or corrupt, an I/O error), raises a TraceError for the whole file:
    ``FILE: problem``.
    """
    with ExitStack() as stack:
        try:
            raw: BinaryIO = stack.enter_context(open(path, "rb"))
            compressed = raw.read(2) == _GZIP_MAGIC
            raw.seek(0)
        except OSError as exc:
            raise TraceError(path, 0, None, f"cannot read ({exc.strerror or exc})") from None
        if compressed:
            raw = stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb"))
        handle = stack.enter_context(
            io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline="")
        )
        try:
            yield handle
        # gzip signals bad data with EOFError (cut short), BadGzipFile (an OSError: bad
        # header, CRC or length) or zlib.error (a corrupt deflate stream).
        except (EOFError, zlib.error, OSError) as exc:
            if compressed:
                raise TraceError(path, 0, None, f"corrupt or truncated gzip data ({exc})") from None
            if isinstance(exc, OSError):
                raise TraceError(path, 0, None, f"cannot read ({exc.strerror or exc})") from None
            raise


# ``open_text`` decodes a byte that is not UTF-8 to U+DC80..U+DCFF (``surrogateescape``);
# valid UTF-8 never decodes to a lone surrogate, so each such character is one bad byte.
_BAD_BYTE = re.compile("[\udc80-\udcff]")


def bad_byte_index(text: str, start: int = 0, end: int | None = None) -> int:
    """Index of the first undecodable byte in ``text[start:end]`` (text from
    ``open_text``), or -1 if that stretch was valid UTF-8."""
    match = _BAD_BYTE.search(text, start, len(text) if end is None else end)
    return -1 if match is None else match.start()


def bad_byte_error(path: str | Path, line: int, column: int, char: str) -> TraceError:
    """``FILE:LINE: not UTF-8 (byte 0xNN at column C)`` for the undecodable byte ``char``
    (a ``surrogateescape`` character). ``column`` is 1-based and counts characters: every
    decoded character before the byte counts one, as every undecodable byte does."""
    return TraceError(path, line, None, f"not UTF-8 (byte 0x{ord(char) - 0xDC00:02x} at column {column})")


def check_utf8(path: str | Path, line: int, text: str) -> None:
    """Raise ``bad_byte_error`` for the first undecodable byte of ``text``, the text of
    line ``line`` (from its first character)."""
    index = bad_byte_index(text)
    if index >= 0:
        raise bad_byte_error(path, line, index + 1, text[index])


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
            first = handle.readline()
        check_utf8(path, 1, first)
        header = tuple(col.strip() for col in first.strip().split(","))
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
