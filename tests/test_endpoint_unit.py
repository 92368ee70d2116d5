"""The endpoint engine's parts that need no inference server: request bodies, stream
parsing, the launcher's command template and process-group teardown, the runner's use of
receipt times, and configuration errors. The live-server tests are test_endpoint_live.py."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from live_server import engine_context, tiny_spec
from run_fixtures import run_kvbench

from kvbench.engines.endpoint.client import body_excerpt, cached_prompt_tokens, chunk_tokens
from kvbench.engines.endpoint.engine import EndpointEngine, request_payload
from kvbench.engines.endpoint.server import (
    ServerError,
    ServerProcess,
    free_port,
    render_command,
    server_flags,
    wait_ready,
)
from kvbench.runner import WallClock, replay
from kvbench.types import (
    FinishedRequest,
    KVUsage,
    Request,
    StepOutput,
    StepStats,
    TokenEvent,
    Workload,
)


# --------------------------------------------------------------------------- request bodies
def test_completions_payload_sends_token_ids_and_pins_the_output_length() -> None:
    request = Request("r0", 0.0, (5, 6, 7), 9, cache_salt="s")
    payload = request_payload(
        request, api="completions", model="m", prompt_text=None, extra_body={"return_token_ids": True}
    )
    assert payload == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 9,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": "s",
        "return_token_ids": True,
    }


def test_chat_payload_sends_text_messages_and_parallel_samples() -> None:
    request = Request("r0", 0.0, (5, 6), 4, n=3, temperature=0.7)
    payload = request_payload(request, api="chat", model="m", prompt_text="hello", extra_body={})
    assert payload["messages"] == [{"role": "user", "content": "hello"}]
    assert payload["n"] == 3 and payload["temperature"] == 0.7 and "prompt" not in payload


def test_stream_chunks_give_token_ids_and_cached_tokens_only_when_reported() -> None:
    assert chunk_tokens({"index": 0, "text": "", "token_ids": [4, 5]}) == (4, 5)
    assert chunk_tokens({"index": 0, "text": "ab", "token_ids": None}) == (-1,)  # text, ids unknown
    assert chunk_tokens({"index": 0, "delta": {"content": "x"}}) == (-1,)
    assert chunk_tokens({"index": 0, "delta": {"role": "assistant"}}) == ()
    assert cached_prompt_tokens({"prompt_tokens_details": {"cached_tokens": 64}}) == 64
    # Unknown is None, never 0.
    assert cached_prompt_tokens({"prompt_tokens_details": None}) is None
    assert cached_prompt_tokens({"prompt_tokens": 3}) is None
    assert cached_prompt_tokens(None) is None
    assert body_excerpt("a\n  b" + "c" * 400).startswith("a b") and len(body_excerpt("x" * 400)) == 300


# --------------------------------------------------------------------------- configuration
def test_command_template_and_server_args() -> None:
    template = ["{python}", "-m", "srv", "--model", "{model}", "--port", "{port}", "{{literal}}"]
    values = {"python": "/v/bin/python", "model": "/m", "port": "8123"}
    assert render_command(template, values) == [
        "/v/bin/python", "-m", "srv", "--model", "/m", "--port", "8123", "{literal}"
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"engine.command\[1\]: '\{prot\}': bad placeholder"):
        render_command(["x", "{prot}"], values)
    flags = server_flags(
        {"block_size": 64, "enable_prefix_caching": False, "max_num_seqs": None, "x": True, "l": [1, 2]}
    )
    assert flags == ["--block-size", "64", "--no-enable-prefix-caching", "--x", "--l", "1", "--l", "2"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of engine.url"),
        ({"url": "http://h:1", "command": ["x"]}, "exactly one of engine.url"),
        ({"url": "h:1"}, "url: must start with http"),
        ({"url": "http://h:1", "api": "chat"}, "prompt_format: api=chat sends messages"),
        ({"url": "http://h:1", "prompt_format": "text"}, "prompt_format: text needs the model's tokenizer"),
        ({"url": "http://h:1", "max_concurrency": 0}, "max_concurrency: must be >= 1"),
        ({"url": "http://h:1", "request_timeout_s": 0.0}, "request_timeout_s: must be > 0"),
    ],
)
def test_bad_engine_settings_are_refused_naming_the_key(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EndpointEngine(engine_context(tiny_spec()), **kwargs)  # type: ignore[arg-type]


def test_the_cli_names_a_missing_url_and_refuses_simulation(tmp_path: Path) -> None:
    out = run_kvbench("run", "engine=endpoint", f"run.results_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode != 0 and "engine.url" in out.stdout + out.stderr
    out = run_kvbench(
        "run", "engine=endpoint", "engine.url=http://127.0.0.1:9", "run.mode=sim", f"run.results_dir={tmp_path}",
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode != 0 and "run.mode=real" in out.stdout + out.stderr


# --------------------------------------------------------------------------- runner
class ScriptedLiveEngine:
    """An engine reporting, like the endpoint engine, events timed by perf_counter readings:
    one request sent at ``sent``, two tokens, finished at the second token."""

    name = "scripted"

    def __init__(self, times_perf_s: tuple[float, float, float]) -> None:
        self.times = times_perf_s
        self.pending: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.pending.append(request)

    def unsupported_reason(self, request: Request) -> str | None:
        return None

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def describe(self) -> dict[str, object]:
        return {}

    def step(self) -> StepOutput:
        request = self.pending.pop()
        sent, first, second = self.times
        kv = KVUsage(0, 0, 0)
        return StepOutput(
            tokens=(TokenEvent(request.request_id, 0, 11), TokenEvent(request.request_id, 0, 12)),
            first_scheduled=(request.request_id,),
            finished=(FinishedRequest(request.request_id, ((11, 12),), num_cached_prompt_tokens=None),),
            rejected=(),
            stats=StepStats(0, 0, 2, 0, 0, kv),
            token_times_perf_s=(first, second),
            first_scheduled_times_perf_s=(sent,),
            finish_times_perf_s=(second,),
        )


def test_the_runner_times_events_when_received_not_at_the_step_end() -> None:
    clock = WallClock()
    origin = clock.origin_perf_s
    engine = ScriptedLiveEngine((origin + 0.001, origin + 0.002, origin + 0.0035))
    raw = replay(engine, Workload("w", (Request("r0", 0.0, (1, 2, 3), 2),)), clock)
    row = raw.requests.iloc[0]
    assert row["first_scheduled_s"] == pytest.approx(0.001)
    assert list(row["token_times_s"]) == pytest.approx([0.002, 0.0035])
    assert row["first_token_s"] == pytest.approx(0.002) and row["finish_s"] == pytest.approx(0.0035)
    assert math.isnan(row["num_cached_tokens"])  # unknown, not 0


def test_step_output_times_must_match_their_events() -> None:
    with pytest.raises(ValueError, match="token_times_perf_s has 1 times for 0 events"):
        StepOutput((), (), (), (), StepStats(0, 0, 0, 0, 0, KVUsage(0, 0, 0)), token_times_perf_s=(1.0,))


# --------------------------------------------------------------------------- launcher
# A stand-in server process for the teardown tests: it spawns a worker of its own (as
# vLLM spawns its engine core) and both sleep until killed.
SLEEPER = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
    " print('serving', flush=True); time.sleep(600)",
]


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


def wait_until(predicate, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    server = ServerProcess(SLEEPER, tmp_path / "server.log", stop_grace_s=2.0)
    assert wait_until(lambda: len(group_members(server.pgid)) == 3, 20)  # guard, server, worker
    server.stop()
    assert group_members(server.pgid) == []
    assert "serving" in (tmp_path / "server.log").read_text()
    server.stop()  # idempotent


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_the_server_group_dies_with_the_client(sig: signal.Signals, tmp_path: Path) -> None:
    client = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from kvbench.engines.endpoint.server import ServerProcess
        server = ServerProcess({SLEEPER!r}, Path({str(tmp_path / "server.log")!r}), stop_grace_s=2.0)
        print(server.pgid, flush=True)
        try:
            time.sleep(600)
        finally:
            server.stop()
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", client], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert process.stdout is not None
    pgid = int(process.stdout.readline())
    assert wait_until(lambda: len(group_members(pgid)) == 3, 20)
    os.kill(process.pid, sig)
    process.wait(timeout=30)
    assert wait_until(lambda: not group_members(pgid), 20), f"group {pgid} outlived the client's {sig.name}"


def test_readiness_names_the_url_and_reports_a_server_that_exited(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/health"
    start_s = time.monotonic()
    with pytest.raises(ServerError, match=f"server unreachable: {url} did not answer within 0.5 s"):
        wait_ready(url, 0.5)
    assert time.monotonic() - start_s < 5
    crashing = [sys.executable, "-c", "import sys; print('bad flag --xyz', flush=True); sys.exit(3)"]
    server = ServerProcess(crashing, tmp_path / "server.log")
    try:
        with pytest.raises(ServerError, match=r"server exited with status 3 .*\n.*bad flag --xyz"):
            wait_ready(url, 30, server=server)
    finally:
        server.stop()
