"""Parsing and validating recorded traces into plain records (no token ids, except ShareGPT).

One parser per format; each checks every field of every row and either raises a
TraceError (``FILE:LINE: field 'NAME': problem``) or, with ``skip_invalid``, skips the
row and counts it in ``num_skipped_invalid``. A line with a byte that is not UTF-8 is a
bad row like any other (``FILE:LINE: not UTF-8 (byte 0xNN at column C)``). Token counts
are ints in ``[1, MAX_TRACE_TOKENS]`` and times finite, ``<= MAX_TRACE_SECONDS``. What
cannot be skipped raises whatever ``skip_invalid`` says: a bad header, JSON that cannot
be resynchronised (ShareGPT), a corrupt gzip stream (``FILE: problem``), an empty result.

Formats (schemas in data/README.md):

- Mooncake JSONL: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``,
  ``len(hash_ids) == ceil(input_length / 512)``.
- Azure LLM inference CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens``; TIMESTAMP has 7
  fractional digits (100 ns ticks), optionally a ``+00:00`` suffix (the 2024 traces).
- BurstGPT CSV: ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
  (+ ``Session ID``, ``Elapsed time`` in v1.2); Timestamp in seconds. A row with 0
  response tokens is a failed request in BurstGPT's log: skipped, counted in
  ``num_failed_requests_skipped``.
- ShareGPT JSON: a list of ``{"id", "conversations": [{"from", "value"}, ...]}``; see
  ``parse_sharegpt`` for how turns become requests and how text becomes token ids.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvbench.hashing import stable_key
from kvbench.workloads.errors import TraceError
from kvbench.workloads.tokens import Tokenizer, keyed_token_ids
from kvbench.workloads.trace_io import (
    AZURE_HEADER,
    BURSTGPT_HEADER,
    bad_byte_error,
    bad_byte_index,
    check_utf8,
    open_text,
)

MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
BURSTGPT_OPTIONAL = ("Session ID", "Elapsed time")
SHAREGPT_FIELDS = ("id", "conversations")
SHAREGPT_TURN_FIELDS = ("from", "value")
# Without a tokenizer, a ShareGPT text of c characters counts as ceil(c / 4) tokens: the
# usual rule of thumb for English BPE vocabularies (about 4 characters per token).
CHARS_PER_TOKEN = 4
# Bounds on recorded values. A token count above MAX_TRACE_TOKENS (16.8M) exceeds every
# released model's context window (10M) and the shipped traces' largest prompt (191K) by
# far: it is a corrupt value, and replaying it uncapped would allocate gigabytes. Mooncake
# hash ids become int64 keys. A time above MAX_TRACE_SECONDS (317 years) is corrupt too,
# and keeps scaled arrival times finite.
MAX_TRACE_TOKENS = 2**24
MAX_HASH_ID = 2**63 - 1
MAX_TRACE_SECONDS = 1e10
# A shown value (a bad field, a header) is cut to this many characters of its repr.
_MAX_SHOWN_CHARS = 60

# ASCII digits only: int() and float() also accept other scripts' digits and underscores.
_AZURE_TIME = re.compile(r"(\d{4}-\d{2}-\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,7}))?(\+00:00)?", re.ASCII)
_INT_TEXT = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True)
class TraceRecord:
    """One valid request of a trace, before scaling and token materialisation.

    ``timestamp_s`` is on the trace's own clock: Mooncake ms / 1000, Azure seconds since
    midnight of ``ParsedTrace.time_origin``, BurstGPT as written, ShareGPT 0 (no times).
    ``prompt_token_ids`` is set only by formats that carry text (ShareGPT).
    """

    line: int
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedTrace:
    """A validated trace: records in file order plus counts of what was skipped."""

    path: str
    format: str
    records: tuple[TraceRecord, ...]
    counters: Mapping[str, int]
    has_timestamps: bool = True
    time_origin: str = ""  # Azure: the date (YYYY-MM-DD) that timestamp_s counts from


class _Collector:
    """Gathers records, enforcing non-decreasing timestamps and the skip/raise policy."""

    def __init__(self, path: str | Path, skip_invalid: bool, time_field: str) -> None:
        self.path = str(path)
        self.skip_invalid = skip_invalid
        self.time_field = time_field
        self.records: list[TraceRecord] = []
        self.counters: dict[str, int] = {"num_skipped_invalid": 0}
        self._last_time_s = -math.inf
        self._last_line = 0

    def add(self, parse: Callable[[], list[TraceRecord]]) -> None:
        """Run one row's ``parse``; keep its records, or raise/count its TraceError."""
        try:
            records = parse()
            last_s, last_line = self._last_time_s, self._last_line
            for record in records:
                if record.timestamp_s > MAX_TRACE_SECONDS:
                    raise TraceError(
                        self.path,
                        record.line,
                        self.time_field,
                        f"must be <= {MAX_TRACE_SECONDS:.0e} s, got {_fmt_time(record.timestamp_s)} s",
                    )
                if record.timestamp_s < last_s:
                    raise TraceError(
                        self.path,
                        record.line,
                        self.time_field,
                        f"goes backwards ({_fmt_time(record.timestamp_s)} s < {_fmt_time(last_s)} s "
                        f"at line {last_line})",
                    )
                last_s, last_line = record.timestamp_s, record.line
        except TraceError:
            if not self.skip_invalid:
                raise
            self.counters["num_skipped_invalid"] += 1
            return
        self._last_time_s, self._last_line = last_s, last_line
        self.records.extend(records)

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def finish(self, fmt: str, **extra: Any) -> ParsedTrace:
        if not self.records:
            skipped = self.counters["num_skipped_invalid"]
            raise TraceError(
                self.path, 0, "<records>", f"empty trace: no valid requests ({skipped} invalid rows skipped)"
            )
        return ParsedTrace(self.path, fmt, tuple(self.records), dict(self.counters), **extra)


def _fmt_time(value: float) -> str:
    return f"{value:.7f}".rstrip("0").rstrip(".")


# --------------------------------------------------------------------------- field checks


def _shown(value: Any) -> str:
    """``repr(value)`` for a message, cut to _MAX_SHOWN_CHARS; a huge int by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    if len(text) > _MAX_SHOWN_CHARS:
        return f"{text[:_MAX_SHOWN_CHARS]}... ({len(text)} chars)"
    return text


def _cut(text: str) -> str:
    """``text`` (a field name from the file) cut to _MAX_SHOWN_CHARS characters."""
    return text if len(text) <= _MAX_SHOWN_CHARS else f"{text[:_MAX_SHOWN_CHARS]}... ({len(text)} chars)"


def _int_field(
    path: str, line: int, name: str, value: Any, minimum: int, maximum: int = MAX_TRACE_TOKENS
) -> int:
    """An int from JSON or CSV text in ``[minimum, maximum]``; bools and floats are wrong types."""
    if isinstance(value, str):
        text = value.strip()
        if not _INT_TEXT.fullmatch(text):
            raise TraceError(path, line, name, f"expected an int, got {_shown(value)}")
        # int() refuses more than 4300 digits; so many digits are out of range anyway.
        if len(text.lstrip("+-").lstrip("0")) > len(str(max(abs(minimum), maximum))):
            raise TraceError(path, line, name, f"must be in [{minimum}, {maximum}], got {_shown(text)}")
        value = int(text)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, name, f"expected an int, got {type(value).__name__} {_shown(value)}")
    if value < minimum:
        raise TraceError(path, line, name, f"must be >= {minimum}, got {_shown(value)}")
    if value > maximum:
        raise TraceError(path, line, name, f"must be <= {maximum}, got {_shown(value)}")
    return value


def _json_int(
    path: str, line: int, name: str, value: Any, minimum: int, maximum: int = MAX_TRACE_TOKENS
) -> int:
    """An int from a JSON value: a string is a wrong type here, unlike in CSV text."""
    if isinstance(value, str):
        raise TraceError(path, line, name, f"expected an int, got str {_shown(value)}")
    return _int_field(path, line, name, value, minimum, maximum)


def _json_number(path: str, line: int, name: str, value: Any) -> float:
    if isinstance(value, str):
        raise TraceError(path, line, name, f"expected a number, got str {_shown(value)}")
    return _float_field(path, line, name, value)


def _float_field(path: str, line: int, name: str, value: Any) -> float:
    """A finite number >= 0 from JSON or CSV text (ASCII digits, no underscores)."""
    if isinstance(value, str):
        text = value.strip()
        try:
            if not text.isascii() or "_" in text:
                raise ValueError(text)
            number = float(text)
        except ValueError:
            raise TraceError(path, line, name, f"expected a number, got {_shown(value)}") from None
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(path, line, name, f"expected a number, got {type(value).__name__} {_shown(value)}")
    else:
        try:
            number = float(value)
        except OverflowError:  # an int beyond float range
            number = math.inf if value > 0 else -math.inf
    if not math.isfinite(number) or number < 0:
        raise TraceError(path, line, name, f"must be a finite number >= 0, got {_shown(value)}")
    return number


def _check_keys(path: str, line: int, obj: Mapping[str, Any], expected: tuple[str, ...]) -> None:
    for name in expected:
        if name not in obj:
            raise TraceError(path, line, name, "missing")
    for name in obj:
        if name not in expected:
            raise TraceError(
                path, line, _cut(name), f"unexpected field (expected exactly {', '.join(expected)})"
            )


@dataclass(frozen=True)
class _CsvRow:
    """One data row of a CSV trace: its cells, or why it cannot be read (``error``).
    ``line`` is the file line where the row ends (where its bad byte is, for a byte that
    is not UTF-8)."""

    line: int
    cells: tuple[str, ...]
    error: TraceError | None = None


def _csv_rows(path: str, handle: TextIO) -> Iterator[_CsvRow]:
    """The non-blank data rows of a CSV whose header line (line 1) was already read.

    A row with a byte that is not UTF-8, or that the csv module rejects (a field over its
    size limit), comes with its error, raised by ``_row_dict`` so that ``skip_invalid``
    can skip it like any other bad row; reading resumes at the next line.
    """
    row_lines: list[str] = []  # the physical lines of the row being read

    def lines() -> Iterator[str]:
        for text in handle:
            row_lines.append(text)
            yield text

    reader = csv.reader(lines())
    first_line = 2  # the line the next row starts on
    while True:
        try:
            cells = tuple(next(reader))
            error = None
        except StopIteration:
            return
        except csv.Error as exc:
            cells, error = (), TraceError(path, first_line + len(row_lines) - 1, None, f"bad CSV row: {exc}")
        for offset, text in enumerate(row_lines):
            index = bad_byte_index(text)
            if index >= 0:
                error = bad_byte_error(path, first_line + offset, index + 1, text[index])
                break
        end_line = first_line + len(row_lines) - 1
        first_line += len(row_lines)
        row_lines.clear()
        if error is not None:
            yield _CsvRow(error.line, cells, error)
        elif cells and any(cell.strip() for cell in cells):
            yield _CsvRow(end_line, cells)


def _row_dict(path: str, row: _CsvRow, header: tuple[str, ...]) -> dict[str, str]:
    """``{column: text}``; a row that could not be read raises its error, and a missing
    or extra value raises TraceError naming the column."""
    if row.error is not None:
        raise row.error
    line, cells = row.line, row.cells
    if len(cells) < len(header):
        raise TraceError(
            path, line, header[len(cells)], f"missing (row has {len(cells)} of {len(header)} columns)"
        )
    if len(cells) > len(header):
        raise TraceError(
            path,
            line,
            f"<column {len(header) + 1}>",
            f"unexpected extra value {_shown(cells[len(header)])} (the header has {len(header)} columns)",
        )
    return dict(zip(header, cells))


def _read_header(
    path: str, handle: TextIO, allowed: Callable[[tuple[str, ...]], bool], expected: str
) -> tuple[str, ...]:
    first = handle.readline()
    check_utf8(path, 1, first)
    if not first.strip():
        raise TraceError(path, 0, "<records>", "empty trace: no header and no rows")
    try:
        cells = next(csv.reader([first]))
    except csv.Error as exc:
        raise TraceError(path, 1, "<header>", f"bad CSV row: {exc}") from None
    header = tuple(col.strip() for col in cells)
    if header and header[0].startswith("\ufeff"):
        header = (header[0][1:], *header[1:])
    if not allowed(header):
        raise TraceError(path, 1, "<header>", f"expected columns {expected}, got {_shown(','.join(header))}")
    return header


def _json_problem(exc: ValueError | RecursionError) -> str:
    """What json rejected: a syntax error (JSONDecodeError), an int of over 4300 digits
    (ValueError) or nesting deeper than the interpreter's recursion limit."""
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON: {exc.msg} (column {exc.colno})"
    if isinstance(exc, RecursionError):
        return "invalid JSON: nested too deeply"
    return f"invalid JSON: {str(exc).split(';')[0]}"


# --------------------------------------------------------------------------- Mooncake


def parse_mooncake(path: str | Path, skip_invalid: bool = False) -> ParsedTrace:
    """Read a Mooncake JSONL trace; blank lines are ignored. See the module docstring."""
    spath = str(path)
    out = _Collector(spath, skip_invalid, "timestamp")
    with open_text(path) as handle:
        for line_no, text in enumerate(handle, start=1):
            if text.strip():
                out.add(lambda text=text, line_no=line_no: [_mooncake_record(spath, line_no, text)])
    return out.finish("mooncake")


def _mooncake_record(path: str, line: int, text: str) -> TraceRecord:
    check_utf8(path, line, text)
    try:
        obj = json.loads(text.rstrip("\r\n"))
    except (ValueError, RecursionError) as exc:
        raise TraceError(path, line, "<json>", _json_problem(exc)) from None
    if not isinstance(obj, dict):
        raise TraceError(path, line, "<json>", f"expected a JSON object, got {type(obj).__name__}")
    _check_keys(path, line, obj, MOONCAKE_FIELDS)
    timestamp_ms = _json_number(path, line, "timestamp", obj["timestamp"])
    input_length = _json_int(path, line, "input_length", obj["input_length"], 1)
    output_length = _json_int(path, line, "output_length", obj["output_length"], 1)
    raw_ids = obj["hash_ids"]
    if not isinstance(raw_ids, list):
        raise TraceError(path, line, "hash_ids", f"expected a list of ints, got {type(raw_ids).__name__}")
    hash_ids = tuple(_json_int(path, line, "hash_ids", value, 0, MAX_HASH_ID) for value in raw_ids)
    num_blocks = -(-input_length // MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != num_blocks:
        raise TraceError(
            path,
            line,
            "hash_ids",
            f"{len(hash_ids)} ids, but input_length {input_length} needs "
            f"ceil({input_length}/{MOONCAKE_BLOCK_TOKENS}) = {num_blocks} blocks",
        )
    return TraceRecord(line, timestamp_ms / 1000.0, input_length, output_length, hash_ids=hash_ids)


# --------------------------------------------------------------------------- Azure


def parse_azure(path: str | Path, skip_invalid: bool = False) -> ParsedTrace:
    """Read an Azure LLM inference CSV. Timestamps keep all 7 fractional digits: they are
    counted from midnight of the first valid row's date (``time_origin``)."""
    spath = str(path)
    out = _Collector(spath, skip_invalid, "TIMESTAMP")
    origin: list[dt.date] = []  # set by the first valid row
    with open_text(path) as handle:
        header = _read_header(spath, handle, lambda h: h == AZURE_HEADER, ",".join(AZURE_HEADER))
        for row in _csv_rows(spath, handle):
            out.add(lambda row=row: [_azure_record(spath, row.line, _row_dict(spath, row, header), origin)])
    return out.finish("azure", time_origin=origin[0].isoformat() if origin else "")


def _azure_record(path: str, line: int, row: dict[str, str], origin: list[dt.date]) -> TraceRecord:
    text = row["TIMESTAMP"].strip()
    match = _AZURE_TIME.fullmatch(text)
    if match is None:
        raise TraceError(
            path, line, "TIMESTAMP", f"expected 'YYYY-MM-DD HH:MM:SS.fffffff', got {_shown(text)}"
        )
    day_text, hours, minutes, seconds, fraction, _ = match.groups()
    try:
        day = dt.date.fromisoformat(day_text)
    except ValueError as exc:
        raise TraceError(path, line, "TIMESTAMP", f"bad date {day_text!r}: {exc}") from None
    if int(hours) > 23 or int(minutes) > 59 or int(seconds) > 59:
        raise TraceError(path, line, "TIMESTAMP", f"bad time of day in {text!r}")
    context = _int_field(path, line, "ContextTokens", row["ContextTokens"], 1)
    generated = _int_field(path, line, "GeneratedTokens", row["GeneratedTokens"], 1)
    if not origin:
        origin.append(day)
    ticks = int((fraction or "").ljust(7, "0"))  # 100 ns ticks
    day_s = (day.toordinal() - origin[0].toordinal()) * 86400
    timestamp_s = day_s + int(hours) * 3600 + int(minutes) * 60 + int(seconds) + ticks / 1e7
    return TraceRecord(line, timestamp_s, context, generated)


# --------------------------------------------------------------------------- BurstGPT


def parse_burstgpt(path: str | Path, skip_invalid: bool = False) -> ParsedTrace:
    """Read a BurstGPT CSV (v1.0 columns, optionally v1.2's Session ID and Elapsed time)."""
    spath = str(path)
    out = _Collector(spath, skip_invalid, "Timestamp")
    out.counters["num_failed_requests_skipped"] = 0

    def allowed(header: tuple[str, ...]) -> bool:
        return header[:6] == BURSTGPT_HEADER and all(col in BURSTGPT_OPTIONAL for col in header[6:])

    expected = ",".join(BURSTGPT_HEADER) + f"[,{','.join(BURSTGPT_OPTIONAL)}]"
    with open_text(path) as handle:
        header = _read_header(spath, handle, allowed, expected)
        for row in _csv_rows(spath, handle):
            out.add(lambda row=row: _burstgpt_records(spath, row.line, _row_dict(spath, row, header), out))
    return out.finish("burstgpt")


def _burstgpt_records(path: str, line: int, row: dict[str, str], out: _Collector) -> list[TraceRecord]:
    timestamp_s = _float_field(path, line, "Timestamp", row["Timestamp"])
    request_tokens = _int_field(path, line, "Request tokens", row["Request tokens"], 1)
    response_tokens = _int_field(path, line, "Response tokens", row["Response tokens"], 0)
    _int_field(path, line, "Total tokens", row["Total tokens"], 0)
    model = row["Model"].strip()
    if not model:
        raise TraceError(path, line, "Model", "empty")
    tags = {"model": model, "log_type": row["Log Type"].strip()}
    if "Session ID" in row:
        tags["session"] = row["Session ID"].strip()
    if "Elapsed time" in row:
        _float_field(path, line, "Elapsed time", row["Elapsed time"])
    if response_tokens == 0:
        out.count("num_failed_requests_skipped")
        return []
    return [TraceRecord(line, timestamp_s, request_tokens, response_tokens, tags=tags)]


# --------------------------------------------------------------------------- ShareGPT


def parse_sharegpt(
    path: str | Path,
    *,
    vocab_size: int,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    max_turns: int = 1,
    skip_invalid: bool = False,
) -> ParsedTrace:
    """Read a ShareGPT JSON list; each conversation gives up to ``max_turns`` requests.

    Turns pair up by position, whatever their ``from`` role (as vLLM's benchmark does):
    request k's prompt is turns 0..2k concatenated (the history grows, so later turns
    share their conversation's prefix) and its output length is turn 2k+1's length.
    Token ids come from ``tokenizer.encode(text)`` per turn; without one, a text of c
    characters becomes ceil(c / 4) ids keyed by the text (so equal texts give equal ids).
    Conversations with fewer than 2 turns and requests with an empty prompt or output are
    skipped and counted. Malformed JSON cannot be resynchronised, so it always raises.
    """
    spath = str(path)
    out = _Collector(spath, skip_invalid, "<order>")
    out.counters.update({"num_conversations_too_short": 0, "num_empty_turns_skipped": 0})
    turn_ids: dict[str, tuple[int, ...]] = {}  # text -> ids, shared across the file

    def encode(text: str) -> tuple[int, ...]:
        if text not in turn_ids:
            if tokenizer is not None:
                turn_ids[text] = tuple(int(i) for i in tokenizer.encode(text))
            else:
                num = -(-len(text) // CHARS_PER_TOKEN)
                key = stable_key(text)
                turn_ids[text] = tuple(
                    keyed_token_ids(seed, np.full(num, key), np.arange(num), vocab_size).tolist()
                )
        return turn_ids[text]

    def entry_records(line: int, entry: Any) -> list[TraceRecord]:
        if not isinstance(entry, dict):
            raise TraceError(
                spath, line, "<json>", f"expected a conversation object, got {type(entry).__name__}"
            )
        _check_keys(spath, line, entry, SHAREGPT_FIELDS)
        conversation_id = entry["id"]
        if isinstance(conversation_id, bool) or not isinstance(conversation_id, str | int):
            raise TraceError(
                spath, line, "id", f"expected a string or an int, got {type(conversation_id).__name__}"
            )
        if isinstance(conversation_id, str):
            _check_unicode(spath, line, "id", conversation_id)
        turns = entry["conversations"]
        if not isinstance(turns, list):
            raise TraceError(spath, line, "conversations", f"expected a list, got {type(turns).__name__}")
        texts = []
        for index, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise TraceError(spath, line, f"conversations[{index}]", "expected an object")
            _check_keys(spath, line, turn, SHAREGPT_TURN_FIELDS)
            for name in SHAREGPT_TURN_FIELDS:
                if not isinstance(turn[name], str):
                    raise TraceError(
                        spath,
                        line,
                        f"conversations[{index}].{name}",
                        f"expected a string, got {_shown(turn[name])}",
                    )
                _check_unicode(spath, line, f"conversations[{index}].{name}", turn[name])
            texts.append(turn["value"])
        if len(texts) < 2:
            out.count("num_conversations_too_short")
            return []
        records = []
        prompt: tuple[int, ...] = ()
        for k in range(min(max_turns, len(texts) // 2)):
            prompt = prompt + encode(texts[2 * k])
            output_len = len(encode(texts[2 * k + 1]))
            if prompt and output_len:
                tags = {"conversation": str(conversation_id), "turn": str(k)}
                records.append(
                    TraceRecord(line, 0.0, len(prompt), output_len, prompt_token_ids=prompt, tags=tags)
                )
            else:
                out.count("num_empty_turns_skipped")
            prompt = prompt + encode(texts[2 * k + 1])
        return records

    for line, entry, bad_byte in _json_list_entries(spath):
        if bad_byte is not None:
            out.add(lambda bad_byte=bad_byte: _raise(bad_byte))
        else:
            out.add(lambda line=line, entry=entry: entry_records(line, entry))
    return out.finish("sharegpt", has_timestamps=False)


def _raise(error: TraceError) -> list[TraceRecord]:
    raise error


# A JSON string may escape a lone UTF-16 surrogate ("\ud800"): valid JSON, but no text.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(path: str, line: int, name: str, text: str) -> None:
    """Raise TraceError if ``text`` (a parsed JSON string) holds a lone surrogate, which no
    tokenizer or UTF-8 writer accepts."""
    match = _SURROGATE.search(text)
    if match is not None:
        raise TraceError(
            path,
            line,
            name,
            f"not valid Unicode (lone surrogate U+{ord(match.group()):04X} at character {match.start() + 1})",
        )


def _json_list_entries(path: str) -> Iterator[tuple[int, Any, TraceError | None]]:
    """Yield ``(line, entry, bad_byte)`` for each element of a top-level JSON list, with
    the line where the element starts (json.load alone cannot tell).

    ``bad_byte`` is the error for the element's first byte that is not UTF-8, at its own
    line and column (the element is then invalid, and skippable). A bad byte outside the
    elements, or JSON that does not parse, raises: the list cannot be resynchronised.
    """
    with open_text(path) as handle:
        text = handle.read()
    decoder = json.JSONDecoder()
    pos, line = 0, 1

    def skip_ws(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    def advance(line: int, start: int, end: int) -> int:
        return line + text.count("\n", start, end)

    def bad_byte(start: int, start_line: int, end: int) -> TraceError | None:
        """The error for the first undecodable byte in ``text[start:end]``, or None;
        ``start`` is on line ``start_line``."""
        index = bad_byte_index(text, start, end)
        if index < 0:
            return None
        column = index - text.rfind("\n", 0, index)  # 1-based: rfind gives -1 on line 1
        return bad_byte_error(path, advance(start_line, start, index), column, text[index])

    def syntax_error(start: int, start_line: int, at: int, error: TraceError) -> TraceError:
        """``error`` (a JSON syntax error at ``at``), or the undecodable byte that caused it."""
        return bad_byte(start, start_line, at + 1) or error

    start = skip_ws(0)
    line = advance(line, 0, start)
    if start >= len(text):
        raise TraceError(path, 0, "<records>", "empty trace: the file is empty")
    if text[start] != "[":
        raise syntax_error(
            0, 1, start, TraceError(path, line, "<json>", "expected a JSON list of conversations")
        )
    pos = skip_ws(start + 1)
    line = advance(line, start, pos)
    if pos < len(text) and text[pos] == "]":
        return
    while True:
        try:
            entry, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            error = TraceError(path, exc.lineno, "<json>", _json_problem(exc))
            raise syntax_error(pos, line, exc.pos, error) from None
        except (ValueError, RecursionError) as exc:
            raise TraceError(path, line, "<json>", _json_problem(exc)) from None
        yield line, entry, bad_byte(pos, line, end)
        after = skip_ws(end)
        line = advance(line, pos, after)
        if after < len(text) and text[after] == "]":
            return
        if after >= len(text) or text[after] != ",":
            error = TraceError(path, line, "<json>", "expected ',' or ']' after a conversation")
            raise syntax_error(after, line, after, error)
        pos = skip_ws(after + 1)
        line = advance(line, after, pos)


PARSERS: dict[str, Callable[..., ParsedTrace]] = {
    "mooncake": parse_mooncake,
    "azure": parse_azure,
    "burstgpt": parse_burstgpt,
}
