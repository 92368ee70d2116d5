"""The endpoint engine against a real vLLM server on loopback (no mock stands in for it).

One server is shared by the session (tests/live_server.py); the tests that kill a server
launch their own through ``engine=vllm_cpu``, as a user's run would.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra.utils import instantiate
from live_server import REPO, LiveServer, engine_context, live_vllm, require_vllm  # noqa: F401
from omegaconf import OmegaConf
from run_fixtures import run_kvbench

from kvbench.engines.endpoint.engine import EndpointEngine
from kvbench.engines.endpoint.server import free_port
from kvbench.export import compare_greedy, reference_greedy, reference_model
from kvbench.runner import WallClock, replay
from kvbench.types import Workload

TINY = ("model=tiny-gqa", "model.vocab_size=1024")


def run_dir_of(results: Path) -> Path:
    (run_dir,) = [p for p in (results / "single").iterdir() if p.is_dir() and not p.name.startswith(".")]
    return run_dir


def live_run(url: str, tmp: Path, *overrides: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``kvbench run engine=endpoint engine.url=URL`` with a fresh cache salt (the shared
    server's prefix cache starts cold for this run); returns the output and run dir."""
    out = run_kvbench(
        "run",
        "engine=endpoint",
        f"engine.url={url}",
        f"+engine.extra_body.cache_salt={uuid.uuid4().hex}",
        *TINY,
        f"run.results_dir={tmp / 'results'}",
        "run.progress=off",
        *overrides,
        cwd=tmp,
    )
    return out, run_dir_of(tmp / "results")


@pytest.fixture(scope="module")
def chat_run(live_vllm: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The issue's 32 ``workload=chat`` requests (seed 0, vocab 1024), one at a time."""
    tmp = tmp_path_factory.mktemp("chat")
    out, run_dir = live_run(live_vllm.url, tmp, "workload=chat", "engine.max_concurrency=1")
    assert out.returncode == 0, (out.stdout, out.stderr)
    return run_dir


def test_chat_prefix_hits_match_vllm_counters_and_the_paged_engine(chat_run: Path, tmp_path: Path) -> None:
    summary = json.loads((chat_run / "run.json").read_text())["summary"]
    # The server's own counters, as this run's deltas from the scraped /metrics.
    assert summary["server_prefix_query_tokens"] == 6138
    assert summary["server_prefix_hit_tokens"] == 4000
    # The same per request, from usage.prompt_tokens_details.cached_tokens.
    requests = pd.read_parquet(chat_run / "requests.parquet")
    assert len(requests) == 32 and (requests["rejected_reason"] == "").all()
    assert requests["num_cached_tokens"].sum() == 4000
    assert (chat_run / "server_metrics.parquet").is_file()
    # kvbench's paged engine, block 32, a pool far larger than the workload, on the same
    # requests one at a time.
    out = run_kvbench(
        "run",
        "engine=paged",
        "engine.block_size=32",
        "engine.num_blocks=1024",
        "engine.max_num_seqs=1",
        "workload=chat",
        "run.mode=sim",
        *TINY,
        f"run.results_dir={tmp_path / 'results'}",
        "run.progress=off",
        cwd=tmp_path,
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    steps = pd.read_parquet(run_dir_of(tmp_path / "results") / "steps.parquet")
    assert steps["num_prefix_hit_tokens"].sum() == 4000
    assert steps["num_prefix_query_tokens"].sum() == 6138


def test_streamed_tokens_are_timestamped_one_by_one_as_received(chat_run: Path) -> None:
    requests = pd.read_parquet(chat_run / "requests.parquet")
    meta = json.loads((chat_run / "run.json").read_text())["meta"]
    assert meta["engine_kind"] == "live" and meta["block_size"] == 32
    for row in requests.itertuples():
        times = np.asarray(row.token_times_s)
        assert len(times) == row.num_output_tokens == row.num_generated_tokens > 0
        assert (np.diff(times) >= 0).all()
        # Sent after arrival; first token after the send; finish at the last token.
        assert row.arrival_s <= row.first_scheduled_s < row.first_token_s == times[0]
        assert row.finish_s == times[-1]
    # Sent one at a time: each request goes out only once the previous one finished.
    ordered = requests.sort_values("first_scheduled_s")
    assert (ordered["first_scheduled_s"].to_numpy()[1:] >= ordered["finish_s"].to_numpy()[:-1]).all()
    # Not one time per poll: a poll of 50 ms would give most gaps of 0 or of 50 ms.
    gaps = np.concatenate([np.diff(t) for t in requests["token_times_s"]])
    assert len(np.unique(gaps)) > len(gaps) // 2


def chat_workload(spec_vocab: int) -> Workload:
    node = OmegaConf.load(REPO / "conf" / "workload" / "chat.yaml")
    node.vocab_size, node.seed = spec_vocab, 0
    return instantiate(node)


def test_greedy_ids_match_kvbench_reference_where_the_margin_is_decisive(live_vllm: LiveServer) -> None:  # noqa: F811
    workload = chat_workload(live_vllm.spec.vocab_size)
    engine = EndpointEngine(
        engine_context(live_vllm.spec),
        url=live_vllm.url,
        max_concurrency=4,
        extra_body={"return_token_ids": True, "cache_salt": uuid.uuid4().hex},
    )
    engine.open(Path(os.devnull), warmup=False)
    try:
        # Offline arrivals: the whole workload at once, four in flight.
        offline = Workload("chat", tuple(dataclasses.replace(r, arrival_s=0.0) for r in workload.requests))
        raw = replay(engine, offline, WallClock())
    finally:
        engine.close()
    model, _ = reference_model(live_vllm.spec, seed=0, dtype="fp32")
    verdicts = {"identical": 0, "near_tie": 0, "mismatch": 0}
    num_decisive = 0
    for request in workload.requests:
        trace = reference_greedy(model, list(request.prompt_token_ids), request.max_new_tokens)
        result = compare_greedy(trace, raw.outputs[request.request_id][0])
        verdicts[result.verdict] += 1
        if result.decisive:
            num_decisive += 1
            assert result.verdict == "identical", (request.request_id, result)
    print(f"greedy parity vs vLLM: {verdicts}, decisive {num_decisive} of {len(workload.requests)}")
    assert verdicts["mismatch"] == 0
    assert num_decisive >= len(workload.requests) // 2  # the check is not vacuous


def test_a_4xx_on_some_requests_is_recorded_per_request_and_the_run_completes(
    live_vllm: LiveServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    # Prompts of 600-1400 tokens against --max-model-len 1024: the long ones get HTTP 400.
    out, run_dir = live_run(
        live_vllm.url,
        tmp_path,
        "workload=random",
        "workload.num_requests=8",
        "workload.prompt_len.low=600",
        "workload.prompt_len.high=1400",
        "workload.output_len.high=24",
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    requests = pd.read_parquet(run_dir / "requests.parquet")
    too_long = requests["num_prompt_tokens"] + 24 > 1024
    rejected = requests["rejected_reason"] != ""
    assert too_long.any() and (~too_long).any()
    assert rejected[requests["num_prompt_tokens"] >= 1024].all()
    assert requests.loc[rejected, "rejected_reason"].str.contains("HTTP 400").all()
    assert np.isfinite(requests.loc[~rejected, "finish_s"]).all()
    assert json.loads((run_dir / "run.json").read_text())["meta"]["status"] == "ok"


def test_the_api_key_is_sent_but_never_written(live_vllm: LiveServer, tmp_path: Path) -> None:  # noqa: F811
    secret = f"sk-kvbench-test-{uuid.uuid4().hex}"
    os.environ["KVBENCH_TEST_API_KEY"] = secret
    try:
        out, run_dir = live_run(
            live_vllm.url,
            tmp_path,
            "workload=random",
            "workload.num_requests=3",
            "engine.api_key_env=KVBENCH_TEST_API_KEY",
        )
    finally:
        del os.environ["KVBENCH_TEST_API_KEY"]
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert secret not in out.stdout + out.stderr
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"config.yaml", "run.json", "requests.parquet"} <= {p.name for p in files}
    for path in files:
        assert secret.encode() not in path.read_bytes(), path
    assert "KVBENCH_TEST_API_KEY" in (run_dir / "config.yaml").read_text()


def test_an_unreachable_server_fails_naming_the_url_within_the_readiness_timeout(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    start_s = time.monotonic()
    out = run_kvbench(
        "run",
        "engine=endpoint",
        f"engine.url={url}",
        "engine.readiness_timeout_s=2",
        f"run.results_dir={tmp_path / 'results'}",
        cwd=tmp_path,
    )
    elapsed_s = time.monotonic() - start_s
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert f"server unreachable: {url}/health did not answer within 2 s" in text, text
    assert "Traceback" not in text
    assert elapsed_s < 2 + 20  # the timeout plus kvbench's start-up, never a hang


# --------------------------------------------------------------------------- servers killed
def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def wait_for(predicate, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def start_launching_run(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen[str], int]:
    """``kvbench run engine=vllm_cpu`` in a subprocess; returns it and its server's guard
    pid (= the server's process group) once the guard runs."""
    python = require_vllm()
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbench",
            "run",
            "engine=vllm_cpu",
            f"engine.python={python}",
            *TINY,
            f"run.results_dir={tmp_path / 'results'}",
            "run.progress=off",
            *overrides,
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def guard() -> int | None:
        for pid in children_of(run.pid):
            if "kvbench.engines.endpoint.guard" in cmdline(pid):
                return pid
        return None

    return run, wait_for(guard, 60, "the server guard")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_no_server_process_outlives_a_killed_client(sig: signal.Signals, tmp_path: Path) -> None:
    run, pgid = start_launching_run(tmp_path, "workload=chat")
    try:
        # The server itself is up (a vLLM process in the group, beyond the guard).
        wait_for(
            lambda: any("vllm" in " ".join(cmdline(p)) for p in group_members(pgid)), 60, "vLLM to start"
        )
        run.send_signal(sig)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    wait_for(lambda: not group_members(pgid), 30, f"server group {pgid} to die after the client's {sig.name}")


def test_a_server_killed_mid_run_fails_the_run_and_keeps_what_was_collected(tmp_path: Path) -> None:
    run, pgid = start_launching_run(
        tmp_path, "workload=random", "workload.num_requests=100", "workload.arrival.rate_per_s=10"
    )

    def port() -> int | None:
        for pid in group_members(pgid):
            args = cmdline(pid)
            if "--port" in args:
                return int(args[args.index("--port") + 1])
        return None

    url = f"http://127.0.0.1:{wait_for(port, 60, 'the server port')}/metrics"

    def requests_served() -> bool:
        import httpx

        try:
            text = httpx.get(url, timeout=2).text
        except httpx.HTTPError:
            return False
        # One line per finished_reason label set: the run's requests end by "length".
        counts = re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        return sum(map(float, counts)) >= 5

    try:
        wait_for(requests_served, 600, "the server to finish 5 requests")
        # vLLM counts a success just before it writes the response's last bytes, so the
        # client may still be reading the fifth answer; one second is ample for loopback.
        time.sleep(1.0)
        os.killpg(pgid, signal.SIGKILL)
        output, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode != 0, output
    run_dir = run_dir_of(tmp_path / "results")
    meta = json.loads((run_dir / "run.json").read_text())["meta"]
    assert meta["status"] == "failed"
    assert "the server exited with status" in meta["error"]
    requests = pd.read_parquet(run_dir / "requests.parquet")
    completed = requests["rejected_reason"].eq("") & requests["finish_s"].map(math.isfinite)
    assert completed.sum() >= 5
    assert requests["rejected_reason"].str.contains("lost|failed|exited|connection", regex=True).any()
    assert (run_dir / "server.log").is_file()
    assert not group_members(pgid)
