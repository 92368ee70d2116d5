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

from kvbench.workloads.errors import TraceError, WorkloadConfigError
from kvbench.workloads.replay import ReplayOptions, replay, scaled_block_lengths
from kvbench.workloads.tokens import keyed_token_ids
from kvbench.workloads.trace_formats import CHARS_PER_TOKEN
from kvbench.workloads.trace_io import SHIPPED_TRACES, detect_format, resolve_trace_path
from kvbench.workloads.trace_writers import write_azure, write_burstgpt, write_mooncake
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


def test_mooncake_prompts_are_read_only_int32_arrays_built_per_hash_block() -> None:
    trace = parse_trace(MOONCAKE_CONV)
    workload = replay(
        trace, ReplayOptions(length_scale=1 / 16, max_requests=40), vocab_size=BIG_VOCAB, seed=3
    )
    by_line = {int(r.tags["line"]): r for r in workload.requests}
    for record in trace.records[:40]:
        prompt = by_line[record.line].prompt_token_ids
        assert isinstance(prompt, np.ndarray) and prompt.dtype == np.int32 and not prompt.flags.writeable
        # The same ids as keying every token of the prompt at once (block id, offset in block).
        lengths = scaled_block_lengths(record, 1 / 16)
        keys = np.repeat(np.asarray(record.hash_ids, dtype=np.int64), lengths)
        offsets = np.concatenate([np.arange(n) for n in lengths])
        assert np.array_equal(prompt, keyed_token_ids(3, keys, offsets, BIG_VOCAB))
        assert by_line[record.line].num_prompt_tokens == len(prompt) == lengths.sum()


def test_random_ids_of_a_record_do_not_depend_on_the_window() -> None:
    full = load_trace(AZURE_CONV, vocab_size=4096, seed=5, length_scale=0.1)
    windowed = load_trace(AZURE_CONV, vocab_size=4096, seed=5, length_scale=0.1, start_s=5.0)
    by_line = {r.tags["line"]: r.prompt_token_ids for r in full.requests}
    assert all(by_line[r.tags["line"]] == r.prompt_token_ids for r in windowed.requests)
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


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_round_trip_mooncake_and_azure_byte_exact(tmp_path, suffix: str) -> None:
    trace = parse_trace(MOONCAKE_CONV)
    out = tmp_path / f"m.jsonl{suffix}"
    write_mooncake(trace.records, out)
    assert parse_trace(out).records == trace.records
    if not suffix:
        assert out.read_bytes() == MOONCAKE_CONV.read_bytes()
    azure = parse_trace(AZURE_CONV)
    out = tmp_path / f"a.csv{suffix}"
    write_azure(azure.records, out, azure.time_origin)
    assert parse_trace(out).records == azure.records
    if not suffix:
        assert out.read_bytes() == AZURE_CONV.read_bytes()


def test_round_trip_burstgpt(tmp_path) -> None:
    trace = parse_trace(BURSTGPT)
    out = tmp_path / "b.csv"
    write_burstgpt(trace.records, out)
    again = parse_trace(out)

    def fields(t):
        return [(r.timestamp_s, r.input_length, r.output_length, r.tags) for r in t.records]

    assert fields(again) == fields(trace)  # lines differ: the failed request was not written
    assert again.counters["num_failed_requests_skipped"] == 0
