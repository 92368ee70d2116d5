"""EndpointEngine: a kvbench Engine whose requests run on a live OpenAI-compatible server.

The runner drives it like any engine. ``add_request`` hands the request to the streaming
client (kvbench.engines.endpoint.client), which sends it at once or, past
``max_concurrency`` requests in flight, as soon as one finishes. ``step`` waits for what
the server streams back: it returns when a request finished or failed, when
``poll_interval_s`` has passed since the first event of this step, or when the runner's
next arrival is due (``set_next_arrival_s``), whichever comes first. A step is therefore a
client poll, not a server iteration: the server's own iterations and KV cache are seen
through its ``/metrics`` (kvbench.server_metrics). Event times are the client's
``perf_counter`` readings at receipt (``StepOutput.*_perf_s``), which the runner maps to
its clock, so TTFT, TPOT and ITL are exact whatever the poll interval.

The server is either already running (``url``) or launched per configuration from the
``command`` template (kvbench.engines.endpoint.server) by ``open`` and torn down by
``close``; ``kvbench.execute`` calls both around the replay (the LiveEngine protocol).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from kvbench.engines.endpoint.client import ClientRequest, Done, Event, Failed, Sent, StreamingClient, Tokens
from kvbench.engines.endpoint.server import (
    ServerError,
    ServerProcess,
    free_port,
    render_command,
    server_flags,
    wait_ready,
)
from kvbench.types import (
    EngineContext,
    FinishedRequest,
    KVUsage,
    RejectedRequest,
    Request,
    StepOutput,
    StepStats,
    TokenEvent,
)

API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Where `python: null` finds the server's interpreter: $KVBENCH_VLLM_VENV (the venv
# scripts/setup_vllm.sh made), else .venv-vllm in the working directory.
DEFAULT_VENV = ".venv-vllm"
# Extra wait, past the per-request timeout, before a step with requests in flight and no
# event at all is declared a client bug rather than a slow server.
STEP_WAIT_MARGIN_S = 30.0
_EMPTY_KV = KVUsage(capacity_bytes=0, allocated_bytes=0, token_bytes=0)


def default_server_python() -> str:
    """The server interpreter used when ``engine.python`` is null."""
    venv = os.environ.get("KVBENCH_VLLM_VENV") or DEFAULT_VENV
    return str(Path(venv) / "bin" / "python")


class EndpointEngine:
    """Replays requests against a server at ``url`` or launched from ``command``.

    Exactly one of ``url`` (e.g. ``http://host:8000``) and ``command`` (a template list with
    ``{port}``, ``{model}``, ``{python}``; ``server_args`` appended as flags,
    ``server_env`` added to its environment) is given. ``api``: the completions or chat
    endpoint. ``prompt_format``: ``token_ids`` sends the workload's ids (exact prefix
    sharing; vLLM and SGLang accept them), ``text`` the prompt decoded by the model's
    tokenizer (chat always needs text). ``api_key_env`` names the environment variable
    holding the API key: the key is read when the engine opens and only ever sent as a
    header. ``extra_body`` is merged into every request's JSON.
    """

    def __init__(
        self,
        ctx: EngineContext,
        *,
        name: str = "endpoint",
        url: str | None = None,
        command: list[str] | None = None,
        server_args: dict[str, Any] | None = None,
        server_env: dict[str, str] | None = None,
        python: str | None = None,
        model_dtype: str = "fp32",
        served_model: str | None = None,
        api: Literal["completions", "chat"] = "completions",
        prompt_format: Literal["token_ids", "text"] = "token_ids",
        max_concurrency: int | None = None,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        readiness_timeout_s: float = 600.0,
        health_path: str = "/health",
        metrics_path: str = "/metrics",
        api_key_env: str | None = None,
        poll_interval_s: float = 0.05,
        stop_grace_s: float = 10.0,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if ctx.mode != "real":
            raise ValueError("engine: the endpoint engine sends requests to a live server; use run.mode=real")
        if (url is None) == (command is None):
            raise ValueError(
                "url: give exactly one of engine.url (a running server) and engine.command (launch one)"
            )
        if api not in API_PATHS:
            raise ValueError(f"api: must be completions or chat, got {api!r}")
        if prompt_format not in ("token_ids", "text"):
            raise ValueError(f"prompt_format: must be token_ids or text, got {prompt_format!r}")
        if api == "chat" and prompt_format != "text":
            raise ValueError("prompt_format: api=chat sends messages, which are text: set prompt_format=text")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1 or null, got {max_concurrency}")
        for key, value in (
            ("request_timeout_s", request_timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("readiness_timeout_s", readiness_timeout_s),
            ("poll_interval_s", poll_interval_s),
            ("stop_grace_s", stop_grace_s),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{key}: must be > 0 and finite, got {value}")
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"url: must start with http:// or https://, got {url!r}")
        self.name = name
        self._ctx = ctx
        self._url = url.rstrip("/") if url is not None else None
        self._command = list(command) if command is not None else None
        self._server_args = dict(server_args or {})
        self._server_env = {str(k): str(v) for k, v in (server_env or {}).items()}
        self._python = python
        self._model_dtype = model_dtype
        self._served_model = served_model
        self._api = api
        self._prompt_format = prompt_format
        self._max_concurrency = max_concurrency
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._readiness_timeout_s = readiness_timeout_s
        self._health_path = health_path
        self._metrics_path = metrics_path
        self._api_key_env = api_key_env
        self._poll_interval_s = poll_interval_s
        self._stop_grace_s = stop_grace_s
        self._extra_body = dict(extra_body or {})
        self._tokenizer = _load_text_tokenizer(ctx) if prompt_format == "text" else None
        # Set by open().
        self._base_url = self._url or ""
        self._headers: dict[str, str] = {}
        self._server: ServerProcess | None = None
        self._client: StreamingClient | None = None
        self._rendered_command: list[str] = []
        self._ready_s = math.nan
        # Run state.
        self._prompt_lengths: dict[str, int] = {}
        self._num_waiting = 0  # submitted, not yet sent (the concurrency cap holds them)
        self._num_in_flight = 0  # sent, not yet done or failed
        self._num_unfinished = 0  # submitted, not yet reported done or failed by a step
        self._next_arrival_perf_s = math.inf
        self._num_streamed_tokens = 0
        self._lost: list[str] = []  # reasons of requests that lost the server

    # ----------------------------------------------------------------- LiveEngine
    def open(self, log_path: Path, *, warmup: bool) -> None:
        """Launch the server (with ``command``; output to ``log_path``) or find it at ``url``,
        wait until it is ready, resolve the served model name and start the client; with
        ``warmup`` send one short request first. Raises ServerError (unreachable, exited,
        warm-up failed) or ValueError naming ``engine.api_key_env``. ``close`` undoes it."""
        if self._api_key_env:
            key = os.environ.get(self._api_key_env)
            if not key:
                raise ValueError(f"api_key_env: the environment variable {self._api_key_env} is not set")
            self._headers = {"Authorization": f"Bearer {key}"}
        if self._command is not None:
            port = free_port()
            model_dir = _exported_model(self._ctx, self._model_dtype)
            values = {
                "port": str(port),
                "model": str(model_dir),
                "python": self._python or default_server_python(),
            }
            self._rendered_command = render_command(self._command, values) + server_flags(self._server_args)
            self._base_url = f"http://127.0.0.1:{port}"
            self._server = ServerProcess(
                self._rendered_command, log_path, env=self._server_env, stop_grace_s=self._stop_grace_s
            )
            if self._served_model is None:
                self._served_model = str(model_dir)
        self._ready_s = wait_ready(
            self._base_url + self._health_path,
            self._readiness_timeout_s,
            server=self._server,
            headers=self._headers,
        )
        if self._served_model is None:
            self._served_model = _first_served_model(self._base_url, self._headers, self._connect_timeout_s)
        self._client = StreamingClient(
            self._base_url,
            headers=self._headers,
            max_concurrency=self._max_concurrency,
            request_timeout_s=self._request_timeout_s,
            connect_timeout_s=self._connect_timeout_s,
        )
        if warmup:
            self._warm_up()

    def close(self) -> None:
        """Stop the client, then the launched server's whole process group. Idempotent."""
        try:
            if self._client is not None:
                self._client.close()
        finally:
            if self._server is not None:
                self._server.stop()

    def base_url(self) -> str:
        """``http://host:port`` of the server (set for a launched one by ``open``)."""
        return self._base_url

    def metrics_url(self) -> str:
        return self._base_url + self._metrics_path

    def request_headers(self) -> dict[str, str]:
        """Headers every request to the server carries (the API key): in memory only."""
        return dict(self._headers)

    def server_log_path(self) -> Path | None:
        """The launched server's log; None for a server given by ``url``."""
        return self._server.log_path if self._server is not None else None

    def server_failure(self) -> str:
        """Why the server failed during the run ("" when it did not): the launched server
        exited, or requests lost their connection to it."""
        parts = []
        if self._server is not None and self._server.exit_code() is not None:
            parts.append(f"the server exited with status {self._server.exit_code()} during the run")
        if self._lost:
            parts.append(
                f"{len(self._lost)} request(s) lost the connection to {self._base_url} "
                f"(first: {self._lost[0]})"
            )
        return "; ".join(parts)

    # ----------------------------------------------------------------- Engine
    def unsupported_reason(self, request: Request) -> str | None:
        if request.beam_width > 1:
            return "engine endpoint: beam search is not supported through the OpenAI API"
        return None

    def add_request(self, request: Request) -> None:
        if self._client is None:
            raise RuntimeError("endpoint engine: add_request before open()")
        self._prompt_lengths[request.request_id] = request.num_prompt_tokens
        self._num_waiting += 1
        self._num_unfinished += 1
        self._client.submit(self._client_request(request))

    def set_next_arrival_s(self, now_s: float, next_arrival_s: float) -> None:
        """The runner's next submission, converted to a perf_counter deadline."""
        self._next_arrival_perf_s = time.perf_counter() + (next_arrival_s - now_s)

    def has_unfinished(self) -> bool:
        return self._num_unfinished > 0

    def step(self) -> StepOutput:
        if self._client is None:
            raise RuntimeError("endpoint engine: step before open()")
        events = self._collect_events()
        return self._step_output(events)

    def describe(self) -> dict[str, Any]:
        """Client-side facts for run.json (the server's own come from its /metrics). Never
        the API key."""
        cpu_s = self._client.loop_cpu_s if self._client is not None else math.nan
        return {
            "engine_kind": "live",
            "server_url": self._base_url,
            "served_model": self._served_model,
            "api": self._api,
            "prompt_format": self._prompt_format,
            "max_concurrency": self._max_concurrency,
            "server_command": self._rendered_command or None,
            "server_ready_s": self._ready_s,
            "client_loop_cpu_s": cpu_s,
            "num_streamed_tokens": self._num_streamed_tokens,
            "client_cpu_us_per_token": (
                cpu_s / self._num_streamed_tokens * 1e6 if self._num_streamed_tokens else math.nan
            ),
        }

    # ----------------------------------------------------------------- internals
    def _collect_events(self) -> list[Event]:
        """Block for the first event (until the next arrival at most), then gather more for
        up to ``poll_interval_s`` unless a request finished or failed."""
        client = self._client
        assert client is not None
        start_s = time.perf_counter()
        deadline_s = self._next_arrival_perf_s
        self._next_arrival_perf_s = math.inf
        limit_s = start_s + self._request_timeout_s + self._connect_timeout_s + STEP_WAIT_MARGIN_S
        first = client.get(min(deadline_s, limit_s) - start_s)
        events: list[Event] = []
        if first is None:
            if time.perf_counter() >= limit_s:
                raise RuntimeError(
                    f"endpoint engine: no event from {self._base_url} for "
                    f"{limit_s - start_s:.0f} s with {self._num_in_flight} request(s) in flight, "
                    "past every request's timeout"
                )
            return events
        events.append(first)
        window_end_s = min(deadline_s, start_s + self._poll_interval_s)
        retired = isinstance(first, (Done, Failed))
        while not retired:
            event = client.get(window_end_s - time.perf_counter())
            if event is None:
                break
            events.append(event)
            retired = isinstance(event, (Done, Failed))
        while (event := client.get(0)) is not None:
            events.append(event)
        return events

    def _step_output(self, events: list[Event]) -> StepOutput:
        first_scheduled: list[str] = []
        first_scheduled_perf_s: list[float] = []
        tokens: list[TokenEvent] = []
        token_perf_s: list[float] = []
        finished: list[FinishedRequest] = []
        finish_perf_s: list[float] = []
        rejected: list[RejectedRequest] = []
        num_sent_prompt_tokens = 0
        for event in events:
            if isinstance(event, Sent):
                first_scheduled.append(event.request_id)
                first_scheduled_perf_s.append(event.perf_s)
                num_sent_prompt_tokens += self._prompt_lengths[event.request_id]
                self._num_waiting -= 1
                self._num_in_flight += 1
            elif isinstance(event, Tokens):
                for token_id in event.token_ids:
                    tokens.append(TokenEvent(event.request_id, event.sample_index, token_id))
                    token_perf_s.append(event.perf_s)
            elif isinstance(event, Done):
                finished.append(
                    FinishedRequest(
                        event.request_id,
                        event.output_token_ids,
                        num_cached_prompt_tokens=event.num_cached_prompt_tokens,
                    )
                )
                finish_perf_s.append(event.perf_s)
                self._num_in_flight -= 1
                self._num_unfinished -= 1
            else:
                rejected.append(RejectedRequest(event.request_id, f"engine endpoint: {event.reason}"))
                if event.server_lost:
                    self._lost.append(event.reason)
                self._num_in_flight -= 1
                self._num_unfinished -= 1
        self._num_streamed_tokens += len(tokens)
        # A client poll is not a server iteration: the split of the server's work into
        # prefill and decode is unknown here (its /metrics has it), so both stay 0 and the
        # scheduled count is the work seen moving: prompt tokens sent plus tokens received.
        stats = StepStats(
            num_running=self._num_in_flight,
            num_waiting=self._num_waiting,
            num_scheduled_tokens=num_sent_prompt_tokens + len(tokens),
            num_prefill_tokens=0,
            num_decode_tokens=0,
            kv=_EMPTY_KV,
        )
        return StepOutput(
            tokens=tuple(tokens),
            first_scheduled=tuple(first_scheduled),
            finished=tuple(finished),
            rejected=tuple(rejected),
            stats=stats,
            token_times_perf_s=tuple(token_perf_s),
            first_scheduled_times_perf_s=tuple(first_scheduled_perf_s),
            finish_times_perf_s=tuple(finish_perf_s),
        )

    def _client_request(self, request: Request) -> ClientRequest:
        request = request.with_prompt_in_memory()  # the payload lists every id
        return ClientRequest(
            request.request_id,
            API_PATHS[self._api],
            request_payload(
                request,
                api=self._api,
                model=str(self._served_model),
                prompt_text=self._prompt_text(request.prompt_token_ids),
                extra_body=self._extra_body,
            ),
            num_samples=request.n,
        )

    def _prompt_text(self, prompt_token_ids: Sequence[int]) -> str | None:
        if self._tokenizer is None:
            return None
        return str(self._tokenizer.decode(list(prompt_token_ids)))

    def _warm_up(self) -> None:
        """One short request through the client, its events discarded: the server's first
        request pays lazy initialisation that the measured run should not."""
        vocab = self._ctx.spec.vocab_size
        prompt = tuple(3 + (i * 7) % (vocab - 3) for i in range(16))
        warm = Request("warmup-0", 0.0, prompt, 4)
        client = self._client
        assert client is not None
        client.submit(self._client_request(warm))
        deadline_s = time.perf_counter() + self._request_timeout_s + self._connect_timeout_s
        while True:
            event = client.get(deadline_s - time.perf_counter())
            if event is None:
                raise ServerError(f"warm-up request to {self._base_url} got no answer")
            if isinstance(event, Failed):
                raise ServerError(f"warm-up request to {self._base_url} failed: {event.reason}")
            if isinstance(event, Done):
                return


def request_payload(
    request: Request,
    *,
    api: str,
    model: str,
    prompt_text: str | None,
    extra_body: Mapping[str, Any],
) -> dict[str, Any]:
    """The JSON body for ``request``: streamed, output length pinned by ``max_tokens`` and
    ``ignore_eos``, the prompt as token ids (``prompt_text`` None) or text. Pure."""
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_new_tokens,
        "ignore_eos": request.ignore_eos,
        "temperature": request.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.n > 1:
        payload["n"] = request.n
    if request.cache_salt is not None:
        payload["cache_salt"] = request.cache_salt
    if api == "chat":
        payload["messages"] = [{"role": "user", "content": prompt_text}]
    else:
        payload["prompt"] = (
            prompt_text if prompt_text is not None else [int(t) for t in request.prompt_token_ids]
        )
    payload.update(extra_body)
    return payload


def _load_text_tokenizer(ctx: EngineContext) -> Any:
    from kvbench.tokenizer import load_tokenizer

    if ctx.spec.weights != "smollm2":
        raise ValueError(
            f"prompt_format: text needs the model's tokenizer, and model {ctx.spec.name} has none "
            "(use prompt_format=token_ids, or a model with a tokenizer such as model=smollm2)"
        )
    return load_tokenizer("smollm2")


def _exported_model(ctx: EngineContext, dtype: str) -> Path:
    """The Hugging Face directory of kvbench's reference weights for this run's model."""
    from kvbench.export import exported_model_dir

    return exported_model_dir(ctx.spec, ctx.seed, dtype)


def _first_served_model(base_url: str, headers: Mapping[str, str], timeout_s: float) -> str:
    """The first model id ``GET /v1/models`` lists (a running server's served name)."""
    url = base_url + "/v1/models"
    try:
        response = httpx.get(url, headers=dict(headers), timeout=timeout_s)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ServerError(
            f"{url}: cannot list the served models ({type(exc).__name__}); set engine.served_model"
        ) from None
