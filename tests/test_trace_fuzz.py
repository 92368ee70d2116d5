"""Fuzzing every trace parser: random bytes and mutations of valid files.

Every input, plain or gzip, with or without ``skip_invalid``, must end in a parsed trace
that inspects and replays into a Workload, or in one TraceError whose message is one
printable line starting ``FILE:LINE: `` or ``FILE: ``; never another exception.

Example counts are bounded and the search derandomized, so CI runs the same inputs in a
few seconds. To hunt for new failures, ask for more examples, drawn at random:
``KVBENCH_FUZZ_EXAMPLES=20000 KVBENCH_FUZZ_RANDOM=1 python -m pytest tests/test_trace_fuzz.py``.
Each failure found so far is kept below as an ``@example``.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbench.workloads.errors import TraceError
from kvbench.workloads.inspect import inspect_trace
from kvbench.workloads.replay import ReplayOptions, replay
from kvbench.workloads.traces import parse_trace

FUZZ_EXAMPLES = int(os.environ.get("KVBENCH_FUZZ_EXAMPLES", "500"))
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("KVBENCH_FUZZ_RANDOM"),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
VOCAB_SIZE = 1000
# Replay caps, so that a parsed trace with a huge (but allowed) length stays cheap.
REPLAY = ReplayOptions(max_requests=64, max_prompt_tokens=256, max_output_tokens=64)

SUFFIX = {"mooncake": ".jsonl", "azure": ".csv", "burstgpt": ".csv", "sharegpt": ".json"}
MOONCAKE_ROWS: list[dict[str, Any]] = [
    {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 1500, "input_length": 10, "output_length": 3, "hash_ids": [1]},
    {"timestamp": 2000, "input_length": 1100, "output_length": 7, "hash_ids": [1, 2, 3]},
]
CSV_ROWS: dict[str, list[list[str]]] = {
    "azure": [
        ["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
        ["2023-11-16 18:00:01.0000000", "10", "2"],
        ["2023-11-16 18:00:02.5000000", "300", "20"],
        ["2023-11-17 00:00:00.1234567+00:00", "7", "1"],
    ],
    "burstgpt": [
        ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"],
        ["1", "ChatGPT", "10", "5", "15", "Conversation log"],
        ["2.5", "GPT-4", "200", "0", "200", "API log"],
        ["4", "ChatGPT", "30", "9", "39", "Conversation log"],
    ],
}
SHAREGPT_DOC: list[dict[str, Any]] = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "What is a KV cache?"},
            {"from": "gpt", "value": "Keys and values of past tokens."},
        ],
    },
    {"id": "b", "conversations": [{"from": "human", "value": "hi"}]},
    {
        "id": 7,
        "conversations": [{"from": "human", "value": "Why page?"}, {"from": "gpt", "value": "Less waste."}],
    },
]

# JSON values of every wrong kind: other types, huge and negative numbers, NaN and
# infinities (Python's json accepts them), an int past int()'s 4300 digits, nesting past
# the recursion limit, escaped lone surrogates and control characters.
WEIRD_JSON = [
    "NaN", "Infinity", "-Infinity", "-1", "0", "-0", "1.5", "1e400", "-1e400", "1e308",
    "9223372036854775808", "18446744073709551616", "1" + "0" * 30, "1" + "0" * 400, "1" * 5000,
    "true", "false", "null", '"10"', '""', '"x"', "[]", "{}", "[1, [2]]", '{"a": 1}',
    "[" * 3000 + "]" * 3000, '"\\ud800"', '"a\\udce9b"', '"line\\nbreak"', '"\\u0000"', "[-1]", "[1e400]",
]  # fmt: skip
# CSV cells of every wrong kind, including a field over the csv module's size limit.
WEIRD_CELLS = [
    "", " ", "-1", "0", "nan", "inf", "-inf", "1e400", "1.5", "1_000", "\u0661\u0662", "x", "1" * 5000,
    "9" * 25, '"a\nb"', "2023-02-30 00:00:00.0", "2023-11-16 25:00:00.0", "0000-01-01 00:00:00.0",
    "9999-12-31 23:59:59.9999999", "2023-11-16 18:00:01.0\n", "\x00", "x" * 140_000,
]  # fmt: skip


@dataclass(frozen=True)
class Raw:
    """JSON text inserted verbatim (json.dumps cannot write an int of 5000 digits)."""

    text: str


def dump(value: Any) -> str:
    """``value`` as JSON text, with Raw nodes written as they are."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dump(v) for v in value) + "]"
    return json.dumps(value)


def node_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths (keys and indices) to every node of a JSON value, the root included."""
    paths = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            paths += node_paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            paths += node_paths(child, (*prefix, index))
    return paths


def mutate_json(draw: st.DrawFn, value: Any) -> Any:
    """``value`` with one node replaced, deleted, or given an extra key (in place)."""
    path = draw(st.sampled_from(node_paths(value)))
    kind = draw(st.sampled_from(["replace", "delete", "add_key"]))
    if not path:
        return Raw(draw(st.sampled_from(WEIRD_JSON)))
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    if kind == "delete":
        del parent[path[-1]]
    elif kind == "add_key" and isinstance(parent, dict):
        name = draw(st.sampled_from(["extra", "a\nb", "x" * 500, "\udce9"]))
        parent[name] = Raw(draw(st.sampled_from(WEIRD_JSON)))
    else:
        parent[path[-1]] = Raw(draw(st.sampled_from(WEIRD_JSON)))
    return value


def to_bytes(text: str) -> bytes:
    # A lone surrogate in ``text`` stands for itself: written as its (invalid) UTF-8 form.
    return text.encode("utf-8", "surrogatepass")


def base_data(fmt: str) -> Any:
    """A fresh copy of the valid content of ``fmt``: rows, a document or a table."""
    if fmt == "mooncake":
        return json.loads(json.dumps(MOONCAKE_ROWS))
    if fmt == "sharegpt":
        return json.loads(json.dumps(SHAREGPT_DOC))
    return [list(row) for row in CSV_ROWS[fmt]]


def render(fmt: str, data: Any) -> list[bytes]:
    """``data`` (from base_data, maybe mutated) as the lines of a ``fmt`` file."""
    if fmt == "mooncake":
        return [to_bytes(dump(row) + "\n") for row in data]
    if fmt == "sharegpt":
        # One conversation per line, as ShareGPT dumps are usually laid out.
        text = re.sub(r"(?<=\}), (?=\{\"id\")", ",\n", dump(data))
        return [to_bytes(line) for line in text.splitlines(keepends=True)]
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(data)
    return [to_bytes(line) for line in buffer.getvalue().splitlines(keepends=True)]


@st.composite
def valid_lines(draw: st.DrawFn, fmt: str) -> list[bytes]:
    """A valid file of ``fmt`` as lines (with their newlines), one field mutated (wrong
    type, huge, negative, NaN, missing, extra) or none."""
    data = base_data(fmt)
    if draw(st.integers(0, 3)) == 0:
        return render(fmt, data)
    if fmt == "mooncake":
        index = draw(st.integers(0, len(data) - 1))
        data[index] = mutate_json(draw, data[index])
    elif fmt == "sharegpt":
        data = mutate_json(draw, data)
    else:
        row = data[draw(st.integers(0, len(data) - 1))]
        column = draw(st.integers(0, len(row) - 1))
        kind = draw(st.sampled_from(["replace", "delete", "add"]))
        if kind == "delete":
            del row[column]
        elif kind == "add":
            row.insert(column, draw(st.sampled_from(WEIRD_CELLS)))
        else:
            row[column] = draw(st.sampled_from(WEIRD_CELLS))
    return render(fmt, data)


@st.composite
def byte_mutations(draw: st.DrawFn, lines: list[bytes]) -> bytes:
    """``lines`` joined, after a few byte-level edits: flips, truncations, inserted and
    deleted bytes, empty, swapped and duplicated lines."""
    lines = list(lines)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "empty", "swap", "dup", "crlf"]))
        index = draw(st.integers(0, len(lines) - 1))
        line = lines[index]
        at = draw(st.integers(0, len(line)))
        if kind == "flip" and line:
            at = min(at, len(line) - 1)
            line = line[:at] + bytes([draw(st.integers(0, 255))]) + line[at + 1 :]
        elif kind == "truncate":
            line = line[:at]
        elif kind == "insert":
            line = line[:at] + draw(st.binary(min_size=1, max_size=4)) + line[at:]
        elif kind == "delete":
            line = line[:at] + line[at + draw(st.integers(1, 8)) :]
        elif kind == "empty":
            lines.insert(index, draw(st.sampled_from([b"\n", b"\r\n", b"   \n", b"\r", b"\t\n"])))
        elif kind == "swap":
            other = draw(st.integers(0, len(lines) - 1))
            lines[index], lines[other] = lines[other], lines[index]
            continue
        elif kind == "dup":
            lines.insert(index, line)
        elif kind == "crlf":
            line = line.replace(b"\n", b"\r\n")
        lines[index] = line
    return b"".join(lines)


@st.composite
def compressed(draw: st.DrawFn, data: bytes) -> tuple[str, bytes]:
    """``("", data)`` or ``(".gz", gzip of data)``, the gzip maybe cut short or corrupted."""
    if not draw(st.booleans()):
        return "", data
    packed = gzip.compress(data, mtime=0)
    kind = draw(st.sampled_from(["whole", "whole", "whole", "cut", "flip", "tail"]))
    if kind == "cut":
        packed = packed[: draw(st.integers(0, len(packed) - 1))]
    elif kind == "flip":
        at = draw(st.integers(2, len(packed) - 1))  # keep the magic: a gzip file, but corrupt
        packed = packed[:at] + bytes([packed[at] ^ draw(st.integers(1, 255))]) + packed[at + 1 :]
    elif kind == "tail":
        packed += draw(st.binary(min_size=1, max_size=8))
    return ".gz", packed


@st.composite
def mutated_files(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """``(format, file suffix, content)`` for a valid file of a random format, mutated."""
    fmt = draw(st.sampled_from(sorted(SUFFIX)))
    data = draw(byte_mutations(draw(valid_lines(fmt))))
    gz, content = draw(compressed(data))
    return fmt, SUFFIX[fmt] + gz, content


@st.composite
def random_files(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """``(format, file suffix, content)``: random bytes, maybe after a valid header."""
    fmt = draw(st.sampled_from(sorted(SUFFIX)))
    head = draw(
        st.sampled_from([b"", b"[", b"{", *(to_bytes(",".join(CSV_ROWS[f][0]) + "\n") for f in CSV_ROWS)])
    )
    data = head + draw(st.binary(max_size=200))
    gz, content = draw(compressed(data))
    if gz == "" and draw(st.booleans()):
        content = b"\x1f\x8b" + content  # gzip magic, then garbage
        gz = ".gz"
    return fmt, SUFFIX[fmt] + gz, content


def check_outcome(directory: Path, case: tuple[str, str, bytes], skip_invalid: bool, sniff: bool) -> None:
    """Parse ``case``; a trace must inspect and replay, an error must be one clean line."""
    fmt, suffix, content = case
    path = directory / f"trace{suffix}"
    path.write_bytes(content)
    try:
        trace = parse_trace(
            path, format=None if sniff else fmt, skip_invalid=skip_invalid, vocab_size=VOCAB_SIZE
        )
    except TraceError as exc:
        message = str(exc)
        assert message.isprintable(), message  # no newline, no control character
        assert re.match(re.escape(str(path)) + r"(:\d+)?: \S", message), message
        return
    assert trace.records
    summary = inspect_trace(trace, block_size=16)
    assert summary["num_requests"] == len(trace.records)
    workload = replay(trace, REPLAY, vocab_size=VOCAB_SIZE)
    assert 1 <= len(workload.requests) <= len(trace.records)
    for request in workload.requests:
        assert 1 <= request.num_prompt_tokens <= REPLAY.max_prompt_tokens
        assert 1 <= request.max_new_tokens <= REPLAY.max_output_tokens


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# Inputs that crashed the parsers before they were fixed, each with the crash it caused.
@example(
    case=("mooncake", ".jsonl", b'{"timestamp": 0, "input_length": 10, "x\xe9": 1}\n'),
    skip_invalid=True,
    sniff=False,
)  # UnicodeDecodeError, even with skip_invalid
@example(
    case=("mooncake", ".jsonl.gz", gzip.compress(b'{"timestamp": 0}\n' * 50)[:40]),
    skip_invalid=False,
    sniff=False,
)  # EOFError from gzip
@example(case=("azure", ".csv.gz", b"\x1f\x8bgarbage"), skip_invalid=False, sniff=True)  # BadGzipFile
@example(
    case=("mooncake", ".jsonl", b'{"timestamp": ' + b"1" * 5000 + b"}\n"), skip_invalid=False, sniff=False
)  # ValueError: int over 4300 digits, from json
@example(
    case=(
        "mooncake",
        ".jsonl",
        b'{"timestamp": 1' + b"0" * 400 + b', "input_length": 10, "output_length": 5, "hash_ids": [1]}\n',
    ),
    skip_invalid=False,
    sniff=False,
)  # OverflowError
@example(
    case=("mooncake", ".jsonl", b"[" * 3000 + b"]" * 3000 + b"\n"), skip_invalid=False, sniff=False
)  # RecursionError
@example(
    case=(
        "mooncake",
        ".jsonl",
        b'{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [9223372036854775808]}\n',
    ),
    skip_invalid=False,
    sniff=False,
)  # OverflowError in replay
@example(
    case=(
        "mooncake",
        ".jsonl",
        b'{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1], "a\\nb": 1}\n',
    ),
    skip_invalid=False,
    sniff=False,
)  # two-line message
@example(
    case=(
        "azure",
        ".csv",
        b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:01.0," + b"1" * 5000 + b",2\n",
    ),
    skip_invalid=False,
    sniff=False,
)  # ValueError from int()
@example(
    case=(
        "azure",
        ".csv",
        b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:01.0,999999999999999999,2\n",
    ),
    skip_invalid=False,
    sniff=False,
)  # MemoryError in replay
@example(
    case=(
        "burstgpt",
        ".csv",
        b"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        b'1,"' + b"x" * 140_000 + b'",10,5,15,API log\n',
    ),
    skip_invalid=True,
    sniff=False,
)  # csv.Error
@example(
    case=(
        "sharegpt",
        ".json",
        b'[{"id": "a", "conversations": [{"from": "h", "value": "\\ud800"}, {"from": "g", "value": "yo"}]}]',
    ),
    skip_invalid=False,
    sniff=False,
)  # UnicodeEncodeError
@example(
    case=("sharegpt", ".json", b'[{"id": "a", "conversations": []}\xe9]'), skip_invalid=True, sniff=False
)  # UnicodeDecodeError
@example(case=("sharegpt", ".json", b"[" + b"[" * 3000), skip_invalid=False, sniff=False)  # RecursionError
@given(case=mutated_files(), skip_invalid=st.booleans(), sniff=st.booleans())
@FUZZ_SETTINGS
def test_mutated_traces_parse_or_fail_in_one_line(
    fuzz_dir: Path, case: tuple[str, str, bytes], skip_invalid: bool, sniff: bool
) -> None:
    check_outcome(fuzz_dir, case, skip_invalid, sniff)


@given(case=random_files(), skip_invalid=st.booleans(), sniff=st.booleans())
@FUZZ_SETTINGS
def test_random_bytes_parse_or_fail_in_one_line(
    fuzz_dir: Path, case: tuple[str, str, bytes], skip_invalid: bool, sniff: bool
) -> None:
    check_outcome(fuzz_dir, case, skip_invalid, sniff)


@pytest.mark.parametrize(
    ("fmt", "num_records"),
    # BurstGPT's second row is a failed request (0 response tokens) and ShareGPT's second
    # conversation has one turn: both are skipped and counted, not errors.
    [("mooncake", 3), ("azure", 3), ("burstgpt", 2), ("sharegpt", 2)],
)
def test_unmutated_inputs_parse(fuzz_dir: Path, fmt: str, num_records: int) -> None:
    """The fuzzers' starting point is valid, so a mutation is what any error is about."""
    path = fuzz_dir / f"valid{SUFFIX[fmt]}"
    path.write_bytes(b"".join(render(fmt, base_data(fmt))))
    trace = parse_trace(path, vocab_size=VOCAB_SIZE)
    assert len(trace.records) == num_records and trace.counters["num_skipped_invalid"] == 0
