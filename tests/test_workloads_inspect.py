"""``kvbench trace inspect``: statistics, prefix-reuse bound, shipped traces, CLI, configs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf
from run_fixtures import run_kvbench

from kvbench.types import Request, Workload
from kvbench.workloads.inspect import format_inspect, inspect_trace, inspect_workload, main
from kvbench.workloads.replay import ReplayOptions, replay
from kvbench.workloads.traces import parse_trace

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
CONF = Path(__file__).parent.parent / "conf" / "workload"


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) for c in text]


def request(i: int, arrival_s: float, tokens: list[int], out: int = 4) -> Request:
    return Request(f"r{i}", arrival_s, tuple(tokens), out)


def test_exact_small_workload() -> None:
    workload = Workload(
        "tiny",
        (
            request(0, 0.0, [1, 2, 3, 4], out=2),
            request(1, 1.0, [1, 2, 3, 5, 6, 7], out=4),
            request(2, 2.0, [9, 9], out=6),
            request(3, 4.0, [1, 2, 3, 4, 8], out=8),
        ),
        counters={"num_skipped_invalid": 1},
    )
    summary = inspect_workload(workload, block_size=2)
    assert summary["num_requests"] == 4
    assert summary["duration_s"] == 4.0
    assert summary["arrival_rate_per_s"] == 0.75  # 3 gaps over 4 s
    assert summary["prompt_tokens"] == {
        "mean": 4.25,
        "p50": 4.5,
        "p90": 5.7,
        "p99": 5.97,
        "max": 6,
        "total": 17,
    }
    assert summary["output_tokens"]["total"] == 20 and summary["output_tokens"]["max"] == 8
    # r1 reuses block (1,2); (3,5) is new. r3 reuses (1,2) and (3,4); its partial block never counts.
    assert summary["prefix_reuse_upper_bound"] == pytest.approx(6 / 17)
    assert summary["counters"] == {"num_skipped_invalid": 1}
    # A block is reused only through its whole prefix chain: (3,4) after a different first block is new.
    chained = Workload("c", (request(0, 0, [1, 2, 3, 4]), request(1, 0, [7, 7, 3, 4])))
    assert inspect_workload(chained, block_size=2)["prefix_reuse_upper_bound"] == 0.0
    assert inspect_workload(chained, block_size=2)["arrival_rate_per_s"] is None
    # An exact repeat reuses all but the block holding its last token (always computed),
    # as the engine's prefix cache and the run metric prefix_reuse_upper_bound count.
    repeat = Workload("r", (request(0, 0, [1, 2, 3, 4]), request(1, 1, [1, 2, 3, 4])))
    assert inspect_workload(repeat, block_size=2)["prefix_reuse_upper_bound"] == 2 / 8


@pytest.mark.parametrize(
    "fixture", ["mooncake_conversation_head200.jsonl", "mooncake_synthetic_head100.jsonl"]
)
@pytest.mark.parametrize("block_size", [16, 7, 512])
def test_hash_id_reuse_equals_reuse_of_replayed_tokens(fixture: str, block_size: int) -> None:
    trace = parse_trace(FIXTURES / fixture)
    workload = replay(trace, ReplayOptions(), vocab_size=1 << 30, seed=0)
    from_records = inspect_trace(trace, block_size)
    from_tokens = inspect_workload(workload, block_size)
    assert from_records["prefix_reuse_upper_bound"] == from_tokens["prefix_reuse_upper_bound"]
    assert from_records["prefix_reuse_upper_bound"] > 0.03
    assert from_records["prompt_tokens"] == from_tokens["prompt_tokens"]
    assert from_records["duration_s"] == from_tokens["duration_s"]


@pytest.mark.parametrize(
    ("name", "expected"), [("mooncake_conversation", 0.366), ("mooncake_synthetic", 0.640)]
)
def test_full_shipped_mooncake_hash_block_reuse(name: str, expected: float) -> None:
    summary = inspect_trace(parse_trace(name))
    assert summary["hash_block_size"] == 512
    assert round(summary["hash_block_reuse"], 3) == expected
    assert summary["num_requests"] == {"mooncake_conversation": 12031, "mooncake_synthetic": 3993}[name]


def test_azure_trace_summary() -> None:
    summary = inspect_trace(parse_trace(FIXTURES / "azure_llm_2023_code_head500.csv"))
    assert summary["num_requests"] == 500
    assert summary["prefix_reuse_upper_bound"] == 0.0
    assert "hash_block_reuse" not in summary
    assert summary["arrival_rate_per_s"] == pytest.approx(499 / summary["duration_s"])


def test_format_inspect_renders_a_table() -> None:
    text = format_inspect(inspect_trace(parse_trace(FIXTURES / "mooncake_synthetic_head100.jsonl")))
    for label in ("requests", "duration (s)", "arrival rate", "prefix reuse bound (16-token blocks)",
                  "hash ids seen before (512-token blocks)", "p99", "num_skipped_invalid"):  # fmt: skip
        assert label in text
    assert "100" in text


def test_cli_json_and_table(capsys) -> None:
    assert main([str(FIXTURES / "burstgpt_small.csv"), "--json", "--block-size", "8"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_requests"] == 4 and summary["block_size"] == 8
    assert summary["counters"]["num_failed_requests_skipped"] == 1
    assert main(["chat", "--vocab-size", "4096", "--seed", "3"]) == 0
    assert "prefix reuse bound" in capsys.readouterr().out
    assert main([str(CONF / "rag.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_requests"] == 32


def test_cli_bad_input_and_skip_invalid(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\nnot json\n')
    assert main([str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}:2: field '<json>': invalid JSON")
    assert main([str(bad), "--skip-invalid", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counters"]["num_skipped_invalid"] == 1
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "no such trace file" in capsys.readouterr().err
    config = tmp_path / "bad.yaml"
    config.write_text(
        "_target_: kvbench.workloads.synthetic.random_requests\nprompt_len: {kind: normal, mean: 9, std: -2}\n"
        "vocab_size: ${model.vocab_size}\nseed: ${seed}\n"
    )
    assert main([str(config)]) == 2
    assert capsys.readouterr().err == "error: prompt_len.std: must be >= 0, got -2\n"


def test_cli_bad_bytes_and_corrupt_gzip_are_one_line(tmp_path, capsys) -> None:
    row = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(row.encode() + b'{"x\xe9": 1}\n')
    assert main([str(latin)]) == 2
    assert capsys.readouterr().err == f"error: {latin}:2: not UTF-8 (byte 0xe9 at column 4)\n"
    assert main([str(latin), "--skip-invalid", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counters"]["num_skipped_invalid"] == 1
    packed = gzip.compress(row.encode() * 100)
    for name, data in [("cut.jsonl.gz", packed[: len(packed) // 2]), ("junk.csv.gz", b"\x1f\x8bjunk")]:
        path = tmp_path / name
        path.write_bytes(data)
        for extra in ([], ["--skip-invalid"]):
            assert main([str(path), *extra]) == 2
            err = capsys.readouterr().err
            assert (
                err.startswith(f"error: {path}: corrupt or truncated gzip data (") and err.count("\n") == 1
            ), err


def test_kvbench_trace_inspect_of_a_truncated_gzip_exits_nonzero_in_one_line(tmp_path) -> None:
    """Through the installed command (kvbench/cli.py's trace path), as a user runs it."""
    packed = gzip.compress(
        b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n' * 100
    )
    (tmp_path / "bad.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    out = run_kvbench("trace", "inspect", "bad.jsonl.gz", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        f"error: {tmp_path / 'bad.jsonl.gz'}: corrupt or truncated gzip data "
        "(Compressed file ended before the end-of-stream marker was reached)\n"
    )


# *_large presets are paper-scale traffic for simulation mode (seed_claims), not for
# tiny CPU models; they get their own test below.
def workload_node(config: str) -> object:
    """The preset ``conf/workload/<config>.yaml`` as Hydra composes it (a preset may build
    on another through its defaults list), interpolations left for the caller's root."""
    from hydra import compose, initialize_config_module

    from kvbench.config import register_schemas

    register_schemas()
    with initialize_config_module("kvbench.conf", version_base="1.3"):
        composed = compose("config", overrides=[f"workload={config}"])
    return OmegaConf.to_container(composed.workload, resolve=False)


TINY_CONFIGS = sorted(p.stem for p in CONF.glob("*.yaml") if not p.stem.endswith("_large"))
LARGE_CONFIGS = sorted(p.stem for p in CONF.glob("*_large.yaml"))


@pytest.mark.parametrize("config", LARGE_CONFIGS)
def test_paper_scale_configs_fit_llama3_context(config: str) -> None:
    root = OmegaConf.create(
        {
            "model": {"vocab_size": 128256, "max_position_embeddings": 8192},
            "seed": 0,
            "workload": workload_node(config),
        }
    )
    workload = instantiate(root.workload)
    assert len(workload.requests) >= 512
    assert all(r.num_prompt_tokens + r.max_new_tokens <= 8192 for r in workload.requests)


@pytest.mark.parametrize("config", TINY_CONFIGS)
def test_every_workload_config_instantiates_for_a_tiny_model(config: str) -> None:
    root = OmegaConf.create(
        {
            "model": {"vocab_size": 4096, "max_position_embeddings": 2048},
            "seed": 0,
            "workload": workload_node(config),
        }
    )
    workload = instantiate(root.workload)
    assert isinstance(workload, Workload)
    assert 8 <= len(workload.requests) <= 64
    for r in workload.requests:
        assert r.num_prompt_tokens + r.max_new_tokens * max(1, r.beam_width) <= 2048
        assert all(3 <= t < 4096 for t in r.prompt_token_ids)
    assert instantiate(root.workload) == workload  # deterministic under Hydra too
    # A runner may pass the model's tokenizer to any workload config.
    with_tokenizer = instantiate(root.workload, tokenizer=CharTokenizer())
    assert len(with_tokenizer.requests) == len(workload.requests)


def test_required_configs_exist() -> None:
    required = {"random", "chat", "rag", "agentic", "prefix_repetition", "best_of_n", "beam_search", "long_context",
                "mooncake_conversation", "mooncake_synthetic", "azure_code", "azure_conv"}  # fmt: skip
    assert required <= {p.stem for p in CONF.glob("*.yaml")}
