"""Recorded traces: parsing, bad input, replay controls, Mooncake prefix sharing, round trips."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from run_fixtures import run_kvbench

from kvbench.types import ComputedTokenIds, is_computed_token_ids
from kvbench.workloads.distributions import EmpiricalLength
from kvbench.workloads.errors import TraceError, WorkloadConfigError
from kvbench.workloads.replay import RandomPrompt, ReplayOptions, replay, scaled_block_lengths
from kvbench.workloads.tokens import STREAM_TOKENS, derive_rng, keyed_token_ids, random_token_ids
from kvbench.workloads.trace_formats import CHARS_PER_TOKEN
from kvbench.workloads.trace_io import SHIPPED_TRACES, detect_format, resolve_trace_path
from kvbench.workloads.traces import load_trace, parse_trace

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
MOONCAKE_CONV = FIXTURES / "mooncake_conversation_head200.jsonl"
MOONCAKE_SYN = FIXTURES / "mooncake_synthetic_head100.jsonl"
AZURE_CODE = FIXTURES / "azure_llm_2023_code_head500.csv"
AZURE_CONV = FIXTURES / "azure_llm_2023_conv_head500.csv"
BURSTGPT = FIXTURES / "burstgpt_small.csv"
BURSTGPT_V12 = FIXTURES / "burstgpt_v12_small.csv"
SHAREGPT = FIXTURES / "sharegpt_small.json"
BIG_VOCAB = 1 << 30


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) for c in text]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def mooncake_row(ts: int = 0, inp: int = 10, out: int = 5, ids: list[int] | None = None, **extra) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids or [1], **extra}
    )


def raises_exactly(path: Path, line: int, field: str, problem: str):
    """pytest.raises for a TraceError with exactly ``FILE:LINE: field 'NAME': problem``."""
    return pytest.raises(
        TraceError, match="^" + re.escape(f"{path}:{line}: field '{field}': {problem}") + "$"
    )


# --------------------------------------------------------------------------- parsing fixtures


def test_mooncake_fixture_parses() -> None:
    trace = parse_trace(MOONCAKE_CONV)
    assert trace.format == "mooncake" and len(trace.records) == 200
    first = trace.records[0]
    assert (first.line, first.timestamp_s, first.input_length, first.output_length) == (1, 0.0, 6758, 500)
    assert first.hash_ids == tuple(range(14))
    assert trace.records[-1].timestamp_s == 72.0
    assert trace.counters == {"num_skipped_invalid": 0}


def test_azure_timestamps_keep_seven_digits() -> None:
    trace = parse_trace(AZURE_CODE)
    assert trace.format == "azure" and len(trace.records) == 500 and trace.time_origin == "2023-11-16"
    first, second = trace.records[:2]
    # 2023-11-16 18:17:03.9799600 and 18:17:04.0319600
    assert first.timestamp_s == pytest.approx(18 * 3600 + 17 * 60 + 3.97996, abs=1e-9)
    assert second.timestamp_s - first.timestamp_s == pytest.approx(0.052, abs=1e-9)
    assert (first.line, first.input_length, first.output_length) == (2, 4808, 10)


def test_azure_2024_timezone_suffix_and_day_rollover(tmp_path) -> None:
    path = write(
        tmp_path,
        "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 23:59:59.9999999+00:00,10,2\n2024-05-11 00:00:00.0000001+00:00,20,3\n",
    )
    first, second = parse_trace(path).records
    assert second.timestamp_s - first.timestamp_s == pytest.approx(2e-7, abs=1e-9)


def test_burstgpt_fixture_counts_failed_requests() -> None:
    trace = parse_trace(BURSTGPT)
    assert trace.format == "burstgpt"
    assert [(r.line, r.timestamp_s, r.input_length, r.output_length) for r in trace.records] == [
        (2, 5.0, 472, 18),
        (4, 118.0, 417, 276),
        (5, 122.0, 1360, 215),
        (6, 190.0, 30, 57),
    ]
    assert trace.records[1].tags == {"model": "GPT-4", "log_type": "Conversation log"}
    assert trace.counters == {"num_skipped_invalid": 0, "num_failed_requests_skipped": 1}
    v12 = parse_trace(BURSTGPT_V12)
    assert [r.tags["session"] for r in v12.records] == ["s1", "s1"]


def test_sharegpt_with_tokenizer_builds_growing_histories() -> None:
    tok = CharTokenizer()
    trace = parse_trace(SHAREGPT, vocab_size=BIG_VOCAB, tokenizer=tok, max_turns=4)
    turns_a = ["What is a KV cache?", "It stores the keys and values of past tokens.", "Why page it?",
               "Paging avoids fragmentation."]  # fmt: skip
    a0, a1, c0 = trace.records
    assert a0.prompt_token_ids == tuple(tok.encode(turns_a[0]))
    assert a0.output_length == len(turns_a[1])
    assert a1.prompt_token_ids == tuple(tok.encode(turns_a[0] + turns_a[1] + turns_a[2]))
    assert a1.output_length == len(turns_a[3])
    assert c0.prompt_token_ids == a0.prompt_token_ids  # same first question, same ids
    assert (a0.tags["conversation"], a1.tags["turn"], c0.line) == ("conv-a", "1", 17)
    assert trace.counters["num_conversations_too_short"] == 1
    assert len(parse_trace(SHAREGPT, vocab_size=BIG_VOCAB, tokenizer=tok).records) == 2  # max_turns=1


def test_sharegpt_without_tokenizer_approximates_four_chars_per_token() -> None:
    trace = parse_trace(SHAREGPT, vocab_size=4096, seed=1, max_turns=4)
    a0, a1, c0 = trace.records
    question = "What is a KV cache?"
    assert a0.input_length == math.ceil(len(question) / CHARS_PER_TOKEN) == 5
    assert a0.prompt_token_ids == c0.prompt_token_ids  # identical text, identical ids
    assert a1.prompt_token_ids[: a0.input_length] == a0.prompt_token_ids
    assert all(3 <= t < 4096 for t in a1.prompt_token_ids)
    other_seed = parse_trace(SHAREGPT, vocab_size=4096, seed=2, max_turns=4)
    assert other_seed.records[0].prompt_token_ids != a0.prompt_token_ids


def test_gzip_is_read_transparently(tmp_path) -> None:
    plain = parse_trace(MOONCAKE_SYN)
    named = tmp_path / "trace.jsonl.gz"
    with open(MOONCAKE_SYN, "rb") as src, gzip.open(named, "wb") as dst:
        shutil.copyfileobj(src, dst)
    unnamed = tmp_path / "trace_gz_without_suffix.jsonl"
    shutil.copy(named, unnamed)
    assert parse_trace(named).records == plain.records
    assert parse_trace(unnamed).records == plain.records


def test_shipped_names_resolve_and_detect() -> None:
    for name, (file, fmt) in SHIPPED_TRACES.items():
        path = resolve_trace_path(name)
        assert path.name == file and path.is_file()
        assert detect_format(name) == fmt
    assert detect_format(str(AZURE_CONV)) == "azure" and detect_format(str(BURSTGPT)) == "burstgpt"
    with pytest.raises(FileNotFoundError, match="no such trace file, and not a shipped trace name"):
        resolve_trace_path("mooncake_conversatoin")


# --------------------------------------------------------------------------- bad input


def test_mooncake_bad_json(tmp_path) -> None:
    path = write(tmp_path, "t.jsonl", mooncake_row() + "\n" + '{"timestamp": 1, "input_length": 10\n')
    with raises_exactly(path, 2, "<json>", "invalid JSON: Expecting ',' delimiter (column 36)"):
        parse_trace(path)


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', "output_length", "missing"),
        (mooncake_row(priority=1), "priority",
         "unexpected field (expected exactly timestamp, input_length, output_length, hash_ids)"),
        (mooncake_row(inp="10"), "input_length", "expected an int, got str '10'"),
        (mooncake_row(inp=10.5), "input_length", "expected an int, got float 10.5"),
        (mooncake_row(out=True), "output_length", "expected an int, got bool True"),
        (mooncake_row(out=-5), "output_length", "must be >= 1, got -5"),
        (mooncake_row(inp=0, ids=[]), "input_length", "must be >= 1, got 0"),
        (mooncake_row(ts=-1), "timestamp", "must be a finite number >= 0, got -1"),
        (mooncake_row(ts="0"), "timestamp", "expected a number, got str '0'"),
        (mooncake_row(inp=600, ids=[1]), "hash_ids", "1 ids, but input_length 600 needs ceil(600/512) = 2 blocks"),
        (mooncake_row(inp=10, ids=[1, 2]), "hash_ids", "2 ids, but input_length 10 needs ceil(10/512) = 1 blocks"),
        (mooncake_row(ids=["a"]), "hash_ids", "expected an int, got str 'a'"),
        ('[1, 2]', "<json>", "expected a JSON object, got list"),
    ],
)  # fmt: skip
def test_mooncake_bad_fields(tmp_path, row: str, field: str, problem: str) -> None:
    path = write(tmp_path, "t.jsonl", mooncake_row() + "\n" + row + "\n")
    with raises_exactly(path, 2, field, problem):
        parse_trace(path)


def test_timestamps_going_backwards(tmp_path) -> None:
    path = write(
        tmp_path, "t.jsonl", "\n".join([mooncake_row(ts=1000), mooncake_row(ts=2500), mooncake_row(ts=2000)])
    )
    with raises_exactly(path, 3, "timestamp", "goes backwards (2 s < 2.5 s at line 2)"):
        parse_trace(path)
    trace = parse_trace(path, skip_invalid=True)
    assert [r.line for r in trace.records] == [1, 2]
    assert trace.counters["num_skipped_invalid"] == 1


def test_skip_invalid_skips_and_counts(tmp_path) -> None:
    lines = [mooncake_row(ts=0), "{oops", mooncake_row(ts=5, out=0), "", mooncake_row(ts=9)]
    path = write(tmp_path, "t.jsonl", "\n".join(lines) + "\n")
    trace = parse_trace(path, skip_invalid=True)
    assert [r.line for r in trace.records] == [1, 5]
    assert trace.counters["num_skipped_invalid"] == 2
    workload = load_trace(path, vocab_size=100, skip_invalid=True)
    assert workload.counters["num_skipped_invalid"] == 2 and len(workload.requests) == 2


def test_empty_traces_are_errors(tmp_path) -> None:
    empty = write(tmp_path, "empty.jsonl", "\n\n")
    with raises_exactly(empty, 0, "<records>", "empty trace: no valid requests (0 invalid rows skipped)"):
        parse_trace(empty)
    all_bad = write(tmp_path, "bad.jsonl", "{\n[\n")
    with raises_exactly(all_bad, 0, "<records>", "empty trace: no valid requests (2 invalid rows skipped)"):
        parse_trace(all_bad, skip_invalid=True)
    header_only = write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with raises_exactly(
        header_only, 0, "<records>", "empty trace: no valid requests (0 invalid rows skipped)"
    ):
        parse_trace(header_only)
    nothing = write(tmp_path, "n.csv", "")
    with raises_exactly(nothing, 1, "<header>", "unknown CSV header '' (Azure: TIMESTAMP,ContextTokens,"
                        "GeneratedTokens; BurstGPT: Timestamp,Model,Request tokens,Response tokens,Total tokens,"
                        "Log Type)"):  # fmt: skip
        parse_trace(nothing)
    with raises_exactly(nothing, 0, "<records>", "empty trace: no header and no rows"):
        parse_trace(nothing, format="azure")
    empty_list = write(tmp_path, "s.json", "[]")
    with raises_exactly(
        empty_list, 0, "<records>", "empty trace: no valid requests (0 invalid rows skipped)"
    ):
        parse_trace(empty_list)


AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ_OK = "2023-11-16 18:00:00.0000000,10,2\n"


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ("2023-11-16T18:00:01,10,2", "TIMESTAMP", "expected 'YYYY-MM-DD HH:MM:SS.fffffff', got '2023-11-16T18:00:01'"),
        ("2023-13-16 18:00:01.0,10,2", "TIMESTAMP",
         "bad date '2023-13-16': month must be in 1..12"),
        ("2023-11-16 18:00:01.0,10", "GeneratedTokens", "missing (row has 2 of 3 columns)"),
        ("2023-11-16 18:00:01.0,10,2,9", "<column 4>", "unexpected extra value '9' (the header has 3 columns)"),
        ("2023-11-16 18:00:01.0,12.5,2", "ContextTokens", "expected an int, got '12.5'"),
        ("2023-11-16 18:00:01.0,0,2", "ContextTokens", "must be >= 1, got 0"),
        ("2023-11-16 18:00:01.0,10,-3", "GeneratedTokens", "must be >= 1, got -3"),
        ("2023-11-16 17:59:59.5,10,2", "TIMESTAMP", "goes backwards (64799.5 s < 64800 s at line 2)"),
    ],
)  # fmt: skip
def test_azure_bad_rows(tmp_path, row: str, field: str, problem: str) -> None:
    path = write(tmp_path, "t.csv", AZ_HEAD + AZ_OK + row + "\n")
    with raises_exactly(path, 3, field, problem):
        parse_trace(path)
    assert parse_trace(path, skip_invalid=True).counters["num_skipped_invalid"] == 1


def test_azure_bad_header(tmp_path) -> None:
    path = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens,Extra\n" + AZ_OK)
    with raises_exactly(path, 1, "<header>",
                        "expected columns TIMESTAMP,ContextTokens,GeneratedTokens, got "
                        "'TIMESTAMP,ContextTokens,GeneratedTokens,Extra'"):  # fmt: skip
        parse_trace(path, format="azure")


def test_burstgpt_bad_rows(tmp_path) -> None:
    head = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    path = write(
        tmp_path, "b.csv", head + "1,ChatGPT,10,5,15,Conversation log\nsoon,ChatGPT,10,5,15,API log\n"
    )
    with raises_exactly(path, 3, "Timestamp", "expected a number, got 'soon'"):
        parse_trace(path)
    path = write(tmp_path, "b2.csv", head + "1,,10,5,15,Conversation log\n")
    with raises_exactly(path, 2, "Model", "empty"):
        parse_trace(path)


@pytest.mark.parametrize(
    ("entry", "field", "problem"),
    [
        ('{"id": "x"}', "conversations", "missing"),
        ('{"id": "x", "conversations": [], "model": "gpt-4"}', "model",
         "unexpected field (expected exactly id, conversations)"),
        ('{"id": "x", "conversations": {"from": "human"}}', "conversations", "expected a list, got dict"),
        ('{"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": 3}]}',
         "conversations[1].value", "expected a string, got 3"),
        ('{"id": "x", "conversations": [{"from": "human"}]}', "value", "missing"),
        ('"just text"', "<json>", "expected a conversation object, got str"),
    ],
)  # fmt: skip
def test_sharegpt_bad_entries(tmp_path, entry: str, field: str, problem: str) -> None:
    good = '{"id": "ok", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}'
    path = write(tmp_path, "s.json", "[\n" + good + ",\n\n" + entry + "\n]\n")
    with raises_exactly(path, 4, field, problem):
        parse_trace(path, vocab_size=100)
    assert parse_trace(path, vocab_size=100, skip_invalid=True).counters["num_skipped_invalid"] == 1


def test_sharegpt_bad_json_always_raises(tmp_path) -> None:
    path = write(tmp_path, "s.json", '[\n{"id": "a",\n "conversations": [}\n]')
    with raises_exactly(path, 3, "<json>", "invalid JSON: Expecting value (column 20)"):
        parse_trace(path, vocab_size=100, skip_invalid=True)
    not_list = write(tmp_path, "o.json", '{"id": 1}')
    with raises_exactly(not_list, 1, "<json>", "expected a JSON list of conversations"):
        parse_trace(not_list, vocab_size=100)


# --------------------------------------------------------------------------- replay


def lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@pytest.mark.parametrize("length_scale", [1 / 16, 1 / 100])
def test_mooncake_token_sharing_matches_hash_id_prefixes(length_scale: float) -> None:
    trace = parse_trace(MOONCAKE_CONV)
    workload = replay(trace, ReplayOptions(length_scale=length_scale), vocab_size=BIG_VOCAB, seed=3)
    by_line = {int(r.tags["line"]): r for r in workload.requests}
    records = trace.records
    num_shared_pairs = 0
    for i, a in enumerate(records):
        lens_a = scaled_block_lengths(a, length_scale)
        for b in records[i + 1 :]:
            if a.hash_ids[0] != b.hash_ids[0]:
                assert by_line[a.line].prompt_token_ids[0] != by_line[b.line].prompt_token_ids[0]
                continue
            lens_b = scaled_block_lengths(b, length_scale)
            expected = 0
            for ha, hb, la, lb in zip(a.hash_ids, b.hash_ids, lens_a, lens_b):
                if ha != hb:
                    break
                expected += min(la, lb)
                if la != lb:
                    break
            assert lcp(by_line[a.line].prompt_token_ids, by_line[b.line].prompt_token_ids) == expected
            num_shared_pairs += 1
    assert num_shared_pairs > 1000  # the fixture's conversations share id 0 and longer histories


def test_mooncake_length_scale_keeps_block_structure() -> None:
    trace = parse_trace(MOONCAKE_SYN)
    workload = replay(trace, ReplayOptions(length_scale=1 / 64), vocab_size=4096, seed=0)
    for record, request in zip(trace.records, sorted(workload.requests, key=lambda r: int(r.tags["line"]))):
        n = len(record.hash_ids)
        remainder = record.input_length - 512 * (n - 1)
        assert request.num_prompt_tokens == 8 * (n - 1) + min(8, max(1, round(remainder / 64)))
    # 512 * scale rounds, and is never below one token per block
    record = trace.records[0]
    assert set(scaled_block_lengths(record, 0.0001)[:-1]) == {1}
    assert set(scaled_block_lengths(record, 0.1)[:-1]) == {51}


def test_replay_window_sampling_caps_and_counters() -> None:
    trace = parse_trace(MOONCAKE_CONV)
    times = np.array([r.timestamp_s for r in trace.records])
    in_window = int(np.count_nonzero((times >= 10) & (times < 50)))
    options = ReplayOptions(start_s=10, end_s=50, sample_fraction=0.5, max_requests=30, length_scale=1 / 32,
                            output_scale=0.5, max_prompt_tokens=300, max_output_tokens=100, time_scale=2.0,
                            time_offset_s=1.0)  # fmt: skip
    workload = replay(trace, options, vocab_size=4096, seed=11)
    c = workload.counters
    assert c["num_records"] == 200 and c["num_outside_window"] == 200 - in_window
    assert in_window - c["num_sampled_out"] - c["num_over_max_requests"] == c["num_requests"] == 30
    assert 0.3 * in_window < c["num_sampled_out"] < 0.7 * in_window
    by_line = {r.line: r for r in trace.records}
    prompt_cut = output_cut = num_prompt = num_output = 0
    for req in workload.requests:
        rec = by_line[int(req.tags["line"])]
        assert req.arrival_s == pytest.approx(1.0 + (rec.timestamp_s - 10) * 2.0)
        full = int(scaled_block_lengths(rec, 1 / 32).sum())
        assert req.num_prompt_tokens == min(full, 300)
        prompt_cut += max(0, full - 300)
        num_prompt += full > 300
        out = max(1, round(rec.output_length * 0.5))
        assert req.max_new_tokens == min(out, 100)
        output_cut += max(0, out - 100)
        num_output += out > 100
    assert (c["num_prompts_truncated"], c["num_prompt_tokens_truncated"]) == (num_prompt, prompt_cut)
    assert (c["num_outputs_truncated"], c["num_output_tokens_truncated"]) == (num_output, output_cut)
    assert num_prompt > 0 and num_output > 0
    assert_same_workload(replay(trace, options, vocab_size=4096, seed=11), workload)


def assert_same_workload(a, b) -> None:
    """Workload equality where prompts may be numpy arrays (Mooncake), which ``==`` on
    the dataclasses cannot compare."""
    assert dataclasses.replace(a, requests=()) == dataclasses.replace(b, requests=())
    assert len(a.requests) == len(b.requests)
    for ra, rb in zip(a.requests, b.requests):
        assert np.array_equal(ra.prompt_token_ids, rb.prompt_token_ids), ra.request_id
        assert dataclasses.replace(ra, prompt_token_ids=()) == dataclasses.replace(rb, prompt_token_ids=())


def test_mooncake_prompts_are_computed_per_hash_block_as_read_only_int32_arrays() -> None:
    trace = parse_trace(MOONCAKE_CONV)
    workload = replay(
        trace, ReplayOptions(length_scale=1 / 16, max_requests=40), vocab_size=BIG_VOCAB, seed=3
    )
    by_line = {int(r.tags["line"]): r for r in workload.requests}
    for record in trace.records[:40]:
        request = by_line[record.line]
        assert isinstance(request.prompt_token_ids, ComputedTokenIds)  # ids computed when read
        prompt = request.with_prompt_in_memory().prompt_token_ids
        assert isinstance(prompt, np.ndarray) and prompt.dtype == np.int32 and not prompt.flags.writeable
        # The same ids as keying every token of the prompt at once (block id, offset in block).
        lengths = scaled_block_lengths(record, 1 / 16)
        keys = np.repeat(np.asarray(record.hash_ids, dtype=np.int64), lengths)
        offsets = np.concatenate([np.arange(n) for n in lengths])
        assert np.array_equal(prompt, keyed_token_ids(3, keys, offsets, BIG_VOCAB))
        assert by_line[record.line].num_prompt_tokens == len(prompt) == lengths.sum()


def test_the_computed_prompt_check_is_the_protocol_check_by_class() -> None:
    """``is_computed_token_ids`` (the engine asks it once per request) answers as
    ``isinstance(prompt, ComputedTokenIds)`` for every kind of prompt a workload
    produces and for classes that hold some of the protocol's methods but not all, asked
    first or again; it decides by class, so an instance that sets a missing member as its
    own attribute is no ComputedTokenIds."""
    mooncake = replay(
        parse_trace(MOONCAKE_CONV), ReplayOptions(length_scale=1 / 16, max_requests=2), vocab_size=BIG_VOCAB
    )
    azure = replay(parse_trace(AZURE_CONV), ReplayOptions(length_scale=0.1, max_requests=2), vocab_size=4096)

    class LengthOnly:  # __len__ and __getitem__, no ids() or __array__
        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> int:
            return 7

    class AllMembers(LengthOnly):
        def __array__(self, dtype: object = None, copy: bool | None = None) -> np.ndarray:
            return np.full(3, 7)

        def ids(self) -> np.ndarray:
            return np.full(3, 7)

    prompts = [
        mooncake.requests[0].prompt_token_ids,
        azure.requests[0].prompt_token_ids,
        mooncake.requests[0].with_prompt_in_memory().prompt_token_ids,
        [1, 2, 3],
        (1, 2, 3),
        np.arange(3),
        "abc",
        LengthOnly(),
        AllMembers(),
    ]
    expected = [True, True, False, False, False, False, False, False, True]
    for _ in range(2):  # the first answer per class and the cached one
        assert [is_computed_token_ids(p) for p in prompts] == expected
        assert [isinstance(p, ComputedTokenIds) for p in prompts] == expected
    patched = LengthOnly()
    patched.ids = patched.__array__ = lambda *args: np.full(3, 7)  # type: ignore[attr-defined]
    assert isinstance(patched, ComputedTokenIds) and not is_computed_token_ids(patched)


def test_length_only_prompts_are_drawn_when_read_as_read_only_int32_arrays() -> None:
    """Azure / BurstGPT prompts hold no ids (a trace of millions of requests would hold
    them as Python ints otherwise): each is its record's own random stream, drawn when
    read, the same ids every read and the ids the eager definition gives."""
    trace = parse_trace(AZURE_CONV)
    workload = replay(trace, ReplayOptions(length_scale=0.1, max_requests=30), vocab_size=4096, seed=5)
    by_line = {int(r.tags["line"]): r for r in workload.requests}
    for record in trace.records[:30]:
        request = by_line[record.line]
        assert isinstance(request.prompt_token_ids, RandomPrompt)
        assert isinstance(request.prompt_token_ids, ComputedTokenIds)
        prompt = request.with_prompt_in_memory().prompt_token_ids
        assert isinstance(prompt, np.ndarray) and prompt.dtype == np.int32 and not prompt.flags.writeable
        eager = random_token_ids(derive_rng(5, STREAM_TOKENS, record.line), len(prompt), 4096)
        assert prompt.tolist() == eager.tolist() == request.prompt_token_ids.ids().tolist()
        assert len(prompt) == request.num_prompt_tokens == max(1, round(record.input_length * 0.1))
        assert request == request.with_prompt_in_memory()  # == compares ids across forms
    with pytest.raises(WorkloadConfigError, match="2\\*\\*32"):
        RandomPrompt(5, 2**32, 4, 4096)


def test_random_ids_of_a_record_do_not_depend_on_the_window() -> None:
    full = load_trace(AZURE_CONV, vocab_size=4096, seed=5, length_scale=0.1)
    windowed = load_trace(AZURE_CONV, vocab_size=4096, seed=5, length_scale=0.1, start_s=5.0)
    by_line = {r.tags["line"]: r.prompt_token_ids.ids().tolist() for r in full.requests}
    assert all(by_line[r.tags["line"]] == r.prompt_token_ids.ids().tolist() for r in windowed.requests)
    assert windowed.requests[0].arrival_s >= 0 and len(windowed.requests) < len(full.requests)


def test_load_trace_shipped_config_fits_a_tiny_model() -> None:
    workload = load_trace("mooncake_conversation", vocab_size=4096, seed=0, length_scale=1 / 32, output_scale=1 / 8,
                          max_prompt_tokens=1536, max_output_tokens=64, max_requests=64)  # fmt: skip
    assert workload.name == "mooncake_conversation" and len(workload.requests) == 64
    assert workload.counters["num_over_max_requests"] == 12031 - 64
    assert max(r.num_prompt_tokens + r.max_new_tokens for r in workload.requests) <= 1600


def test_sharegpt_replay_uses_the_arrival_process() -> None:
    workload = load_trace(
        SHAREGPT, vocab_size=4096, max_turns=2, arrival={"kind": "poisson", "rate_per_s": 2}
    )
    assert len(workload.requests) == 3 and workload.requests[0].arrival_s == 0.0
    assert workload.requests[-1].arrival_s > 0


def test_replay_option_and_empty_result_errors() -> None:
    with pytest.raises(WorkloadConfigError, match=r"^sample_fraction: must be in \(0, 1\], got 0$"):
        ReplayOptions(sample_fraction=0)
    with pytest.raises(WorkloadConfigError, match="^end_s: must be > start_s=5, got 5$"):
        ReplayOptions(start_s=5, end_s=5)
    with pytest.raises(WorkloadConfigError, match="^max_requests: must be an int >= 1 or null, got 0$"):
        ReplayOptions(max_requests=0)
    with pytest.raises(WorkloadConfigError, match="no request left after the window"):
        load_trace(MOONCAKE_SYN, vocab_size=100, start_s=1e6)


# --------------------------------------------------------------------------- bytes (issue 17)

BURST_HEAD = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
SG_TURNS = '"conversations": [{"from": "h", "value": "hi"}, {"from": "g", "value": "yo"}]'
# Per format: a file whose line 3 holds the byte 0xE9 (Latin-1 "é") after "café" in
# valid UTF-8, and how many requests remain when that line is skipped.
BAD_BYTE_FILES = {
    "mooncake": (
        "t.jsonl",
        (mooncake_row(0) + "\n" + mooncake_row(1) + "\n").encode()
        + b'{"timestamp": 2, "caf\xc3\xa9\xe9": 1}\n'
        + (mooncake_row(3) + "\n").encode(),
        23,  # '{"timestamp": 2, "café' is 22 characters (é is one), so the byte is the 23rd
        3,
    ),
    "azure": (
        "t.csv",
        (AZ_HEAD + AZ_OK).encode()
        + b"2023-11-16 18:00:01.0,1\xe9,2\n"
        + AZ_OK.replace("00.0", "02.0").encode(),
        24,
        2,
    ),
    "burstgpt": (
        "t.csv",
        (BURST_HEAD + "1,ChatGPT,10,5,15,API log\n").encode()
        + b"2,Caf\xc3\xa9\xe9,10,5,15,API log\n"
        + b"3,ChatGPT,10,5,15,API log\n",
        7,
        2,
    ),
    "sharegpt": (
        "s.json",
        ('[\n{"id": "a", ' + SG_TURNS + "},\n").encode()
        + b'{"id": "caf\xc3\xa9\xe9", '
        + (SG_TURNS + "}\n]\n").encode(),
        13,
        1,
    ),
}


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("fmt", sorted(BAD_BYTE_FILES))
def test_bytes_that_are_not_utf8_name_line_and_column(tmp_path, fmt: str, suffix: str) -> None:
    name, data, column, num_left = BAD_BYTE_FILES[fmt]
    path = tmp_path / (name + suffix)
    path.write_bytes(gzip.compress(data) if suffix else data)
    message = f"{path}:3: not UTF-8 (byte 0xe9 at column {column})"
    with pytest.raises(TraceError, match="^" + re.escape(message) + "$"):
        parse_trace(path, vocab_size=100)
    trace = parse_trace(path, vocab_size=100, skip_invalid=True)
    assert trace.counters["num_skipped_invalid"] == 1
    assert len(trace.records) == num_left and 3 not in {r.line for r in trace.records}
    workload = load_trace(path, vocab_size=100, skip_invalid=True)
    assert workload.counters["num_skipped_invalid"] == 1


def test_a_bad_byte_where_no_line_can_be_skipped_always_raises(tmp_path) -> None:
    header = tmp_path / "h.csv"
    header.write_bytes(b"TIMESTAMP,Context\xffTokens,GeneratedTokens\n" + AZ_OK.encode())
    with pytest.raises(TraceError, match=re.escape(f"{header}:1: not UTF-8 (byte 0xff at column 18)")):
        parse_trace(header, skip_invalid=True)  # detect_format reads the header
    with pytest.raises(TraceError, match=re.escape(f"{header}:1: not UTF-8 (byte 0xff at column 18)")):
        parse_trace(header, format="azure", skip_invalid=True)
    # Between ShareGPT conversations the list cannot be resynchronised.
    between = tmp_path / "s.json"
    between.write_bytes(('[{"id": "a", ' + SG_TURNS + "}\n").encode() + b" \x80, {}]")
    with pytest.raises(
        TraceError, match="^" + re.escape(f"{between}:2: not UTF-8 (byte 0x80 at column 2)") + "$"
    ):
        parse_trace(between, vocab_size=100, skip_invalid=True)


def test_a_skipped_bad_row_in_a_csv_spans_its_quoted_lines(tmp_path) -> None:
    # A quoted newline makes one row of lines 3-4; the bad byte is on line 4.
    path = tmp_path / "b.csv"
    path.write_bytes(
        (BURST_HEAD + "1,ChatGPT,10,5,15,API log\n").encode()
        + b'2,"Chat\nG\xe9PT",10,5,15,API log\n3,ChatGPT,10,5,15,API log\n'
    )
    with pytest.raises(TraceError, match=re.escape(f"{path}:4: not UTF-8 (byte 0xe9 at column 2)")):
        parse_trace(path)
    trace = parse_trace(path, skip_invalid=True)
    assert [r.line for r in trace.records] == [2, 5]


def _gzip_variants(data: bytes) -> dict[str, bytes]:
    packed = gzip.compress(data, mtime=0)
    flipped = bytearray(packed)
    flipped[len(packed) // 2] ^= 0xFF
    return {
        "cut in half": packed[: len(packed) // 2],
        "header only": packed[:10],
        "garbage after the magic": b"\x1f\x8b" + b"garbage" * 10,
        "a flipped byte": bytes(flipped),
        "garbage after the member": packed + b"junk",
    }


@pytest.mark.parametrize("damage", list(_gzip_variants(b"")))
@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("m.jsonl.gz", MOONCAKE_CONV),
        ("a.csv.gz", AZURE_CODE),
        ("b.csv.gz", BURSTGPT),
        ("s.json.gz", SHAREGPT),
    ],
)
def test_corrupt_gzip_is_one_line_naming_the_file(tmp_path, name: str, source: Path, damage: str) -> None:
    path = tmp_path / name
    path.write_bytes(_gzip_variants(source.read_bytes())[damage])
    for skip_invalid in (False, True):
        with pytest.raises(TraceError) as info:
            parse_trace(path, vocab_size=100, skip_invalid=skip_invalid)
        message = str(info.value)
        assert message.isprintable(), message
        # A flipped byte may also surface first as a bad byte on some line.
        assert message.startswith(f"{path}: corrupt or truncated gzip data (") or re.match(
            re.escape(str(path)) + r":\d+: ", message
        ), message
        if damage != "a flipped byte":
            assert message.startswith(f"{path}: corrupt or truncated gzip data ("), message


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ('{"timestamp": 1' + "0" * 400 + ', "input_length": 10, "output_length": 5, "hash_ids": [1]}',
         "timestamp", "must be a finite number >= 0, got an int of 1329 bits"),
        ('{"timestamp": 1e400, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
         "timestamp", "must be a finite number >= 0, got inf"),
        ('{"timestamp": NaN, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
         "timestamp", "must be a finite number >= 0, got nan"),
        ('{"timestamp": 1e14, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
         "timestamp", "must be <= 1e+10 s, got 100000000000 s"),
        (mooncake_row(inp=2**24 + 1, ids=list(range(32769))), "input_length", "must be <= 16777216, got 16777217"),
        (mooncake_row(ids=[2**63]), "hash_ids", "must be <= 9223372036854775807, got 9223372036854775808"),
        (mooncake_row(out=10**30), "output_length", "must be <= 16777216, got an int of 100 bits"),
        ('{"timestamp": ' + "1" * 5000 + "}", "<json>",
         "invalid JSON: Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits"),
        ("[" * 5000 + "]" * 5000, "<json>", "invalid JSON: nested too deeply"),
        (mooncake_row(**{"a\nb": 1}), "a\\nb",
         "unexpected field (expected exactly timestamp, input_length, output_length, hash_ids)"),
        (mooncake_row(**{"k" * 100: 1}), "k" * 60 + "... (100 chars)",
         "unexpected field (expected exactly timestamp, input_length, output_length, hash_ids)"),
    ],
    ids=["int-timestamp-1329-bits", "1e400", "NaN", "timestamp-past-bound", "tokens-past-bound",
         "hash-id-past-int64", "huge-int", "5000-digits", "deep-nesting", "newline-in-key", "long-key"],
)  # fmt: skip
def test_mooncake_hostile_values_are_one_line_errors(tmp_path, row: str, field: str, problem: str) -> None:
    path = write(tmp_path, "t.jsonl", mooncake_row() + "\n" + row + "\n")
    with raises_exactly(path, 2, field, problem):
        parse_trace(path)
    assert parse_trace(path, skip_invalid=True).counters["num_skipped_invalid"] == 1


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ("2023-11-16 18:00:01.0," + "1" * 5000 + ",2", "ContextTokens",
         "must be in [1, 16777216], got '" + "1" * 59 + "... (5002 chars)"),
        ("2023-11-16 18:00:01.0,999999999999999999,2", "ContextTokens",
         "must be in [1, 16777216], got '999999999999999999'"),
        ("2023-11-16 18:00:01.0,16777217,2", "ContextTokens", "must be <= 16777216, got 16777217"),
        ("2023-11-16 18:00:01.0,\u0661\u0662,2", "ContextTokens", "expected an int, got '\u0661\u0662'"),
        ("2023-11-16 18:00:01.0,1_0,2", "ContextTokens", "expected an int, got '1_0'"),
        ("\u0662023-11-16 18:00:01.0,10,2", "TIMESTAMP",
         "expected 'YYYY-MM-DD HH:MM:SS.fffffff', got '\u0662023-11-16 18:00:01.0'"),
    ],
    ids=["5000-digits", "18-digits", "tokens-past-bound", "arabic-digits", "underscore", "arabic-date"],
)  # fmt: skip
def test_azure_hostile_values_are_one_line_errors(tmp_path, row: str, field: str, problem: str) -> None:
    path = write(tmp_path, "t.csv", AZ_HEAD + AZ_OK + row + "\n")
    with raises_exactly(path, 3, field, problem):
        parse_trace(path)
    assert parse_trace(path, skip_invalid=True).counters["num_skipped_invalid"] == 1


def test_burstgpt_number_text_is_ascii_and_a_huge_field_is_a_skippable_row(tmp_path) -> None:
    path = write(tmp_path, "b.csv", BURST_HEAD + "1_5,ChatGPT,10,5,15,API log\n")
    with raises_exactly(path, 2, "Timestamp", "expected a number, got '1_5'"):
        parse_trace(path)
    huge = write(
        tmp_path, "h.csv", BURST_HEAD + '1,"' + "x" * 140_000 + '",10,5,15,API log\n2,M,1,1,2,API log\n'
    )
    with pytest.raises(
        TraceError, match="^" + re.escape(f"{huge}:2: bad CSV row: field larger than field limit")
    ):
        parse_trace(huge)
    assert [r.line for r in parse_trace(huge, skip_invalid=True).records] == [3]


def test_sharegpt_lone_surrogates_and_odd_ids_are_errors(tmp_path) -> None:
    path = write(tmp_path, "s.json", '[{"id": "a", "conversations": [{"from": "h", "value": "ok\\ud800"}, '
                 '{"from": "g", "value": "yo"}]}]')  # fmt: skip
    with raises_exactly(
        path, 1, "conversations[0].value", "not valid Unicode (lone surrogate U+D800 at character 3)"
    ):
        parse_trace(path, vocab_size=100)
    path = write(tmp_path, "i.json", "[{" + '"id": [1], ' + SG_TURNS + "}]")
    with raises_exactly(path, 1, "id", "expected a string or an int, got list"):
        parse_trace(path, vocab_size=100)
    deep = write(tmp_path, "d.json", "[" * 5000)
    with raises_exactly(deep, 1, "<json>", "invalid JSON: nested too deeply"):
        parse_trace(deep, vocab_size=100)


def test_paths_are_reported_absolute(tmp_path, monkeypatch) -> None:
    # A relative FILE in ``FILE: problem`` would read like a config key in the run's
    # "workload.FILE: problem" error; an absolute one cannot.
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "t.jsonl", mooncake_row() + "\n")
    assert parse_trace("t.jsonl").path == str(tmp_path / "t.jsonl")
    (tmp_path / "t.jsonl.gz").write_bytes(b"\x1f\x8bgarbage")
    with pytest.raises(
        TraceError, match="^" + re.escape(f"{tmp_path / 't.jsonl.gz'}: corrupt or truncated gzip")
    ):
        parse_trace("t.jsonl.gz")
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        parse_trace(tmp_path)  # a directory is not a trace file


def test_a_capped_prompt_is_drawn_only_up_to_the_cap(tmp_path) -> None:
    # A 16.7M-token record costs nothing when capped, and capping keeps the ids' prefix.
    path = write(
        tmp_path, "a.csv", AZ_HEAD + f"2023-11-16 18:00:00.0,{2**24},2\n2023-11-16 18:00:01.0,500,2\n"
    )
    capped = load_trace(path, vocab_size=1000, max_prompt_tokens=40)
    assert [r.num_prompt_tokens for r in capped.requests] == [40, 40]
    assert capped.counters["num_prompt_tokens_truncated"] == 2**24 - 40 + 500 - 40
    full = load_trace(path, vocab_size=1000, start_s=0.5)  # the 500-token record alone
    assert (
        capped.requests[1].prompt_token_ids.ids().tolist() == full.requests[0].prompt_token_ids[:40].tolist()
    )


def test_kvbench_run_on_a_truncated_gzip_names_the_file_on_one_screen(tmp_path) -> None:
    packed = gzip.compress(MOONCAKE_CONV.read_bytes())
    (tmp_path / "bad.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    out = run_kvbench(
        "run", "engine=paged", "workload=mooncake_conversation", "workload.path=bad.jsonl.gz",
        "workload.max_requests=2", "run.warmup=false", "run.mode=sim", cwd=tmp_path,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert (
        f"workload: {tmp_path / 'bad.jsonl.gz'}: corrupt or truncated gzip data "
        "(Compressed file ended before the end-of-stream marker was reached)" in text
    ), text
    assert "Traceback" not in text and "Exception" not in text and len(text.strip().splitlines()) <= 25, text


def test_length_files_share_the_byte_and_bound_checks(tmp_path) -> None:
    path = tmp_path / "lengths.txt"
    path.write_bytes(b"12\n# caf\xe9\n7\n")
    with pytest.raises(
        TraceError, match="^" + re.escape(f"{path}:2: not UTF-8 (byte 0xe9 at column 6)") + "$"
    ):
        EmpiricalLength.from_file(path)
    path.write_text("12\n99999999999999999999\n")
    with raises_exactly(path, 2, "length", "must be <= 16777216, got 99999999999999999999"):
        EmpiricalLength.from_file(path)
    packed = tmp_path / "lengths.txt.gz"
    packed.write_bytes(gzip.compress(b"12\n" * 1000)[:30])
    with pytest.raises(TraceError, match="^" + re.escape(f"{packed}: corrupt or truncated gzip data (")):
        EmpiricalLength.from_file(packed)
