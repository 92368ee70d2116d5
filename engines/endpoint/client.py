"""An asyncio streaming client for OpenAI-compatible servers, run in one background thread.

The caller (the endpoint engine, on the runner's thread) submits requests and takes the
events they produce from a thread-safe queue. Every event carries the
``time.perf_counter()`` reading taken when the client saw it: the send (after the
concurrency cap let the request through), each streamed chunk's tokens, the end of the
stream, a failure. So token times are exact as received, whatever the runner's thread is
doing meanwhile.

Server-sent events (SSE) are parsed chunk by chunk: ``data: {json}`` lines until
``data: [DONE]``. A completions chunk carries ``choices[i].token_ids`` (vLLM with
``return_token_ids``) and ``text``; a chat chunk ``choices[i].delta.content``. A chunk
with text but no ids counts as one token of unknown id (-1).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

# Characters of a failed response's body kept in the per-request error.
BODY_EXCERPT_CHARS = 300
# Token id recorded for a streamed chunk that carries text but no token ids.
UNKNOWN_TOKEN_ID = -1


@dataclass(frozen=True)
class ClientRequest:
    """One HTTP request: POST ``payload`` (JSON) to ``path`` with ``"stream": true``."""

    request_id: str
    path: str
    payload: Mapping[str, Any]
    num_samples: int


@dataclass(frozen=True)
class Sent:
    """The request went out (its concurrency slot was free)."""

    request_id: str
    perf_s: float


@dataclass(frozen=True)
class Tokens:
    """One streamed chunk's tokens for sample ``sample_index``."""

    request_id: str
    sample_index: int
    token_ids: tuple[int, ...]
    perf_s: float


@dataclass(frozen=True)
class Done:
    """The stream ended with ``[DONE]``; ``perf_s`` is the last token's receipt (the end
    of the stream when no token came)."""

    request_id: str
    perf_s: float
    output_token_ids: tuple[tuple[int, ...], ...]
    # usage.prompt_tokens_details.cached_tokens; None when the server did not report it.
    num_cached_prompt_tokens: int | None


@dataclass(frozen=True)
class Failed:
    """The request failed: an HTTP error status, an error in the stream, a timeout, or a
    lost connection (``server_lost``: the server refused, reset or cut the stream)."""

    request_id: str
    perf_s: float
    reason: str
    server_lost: bool


Event = Sent | Tokens | Done | Failed


def body_excerpt(text: str) -> str:
    """``text`` on one line, at most BODY_EXCERPT_CHARS characters. Pure."""
    flat = " ".join(text.split())
    return flat if len(flat) <= BODY_EXCERPT_CHARS else flat[: BODY_EXCERPT_CHARS - 3] + "..."


def chunk_tokens(choice: Mapping[str, Any]) -> tuple[int, ...]:
    """The token ids one streamed choice carries. Pure."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return tuple(int(token) for token in ids)
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, Mapping) else choice.get("text")
    return (UNKNOWN_TOKEN_ID,) if text else ()


def cached_prompt_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` when present and an int, else None. Pure."""
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


class StreamingClient:
    """Sends ClientRequests to ``base_url`` from an asyncio loop in a daemon thread.

    At most ``max_concurrency`` requests are in flight (None: no cap); the rest wait
    client-side in submission order. Each request is bounded by ``request_timeout_s``
    (from the send to the end of the stream), so every submitted request ends in Done or
    Failed. ``headers`` (an API key) stay in memory: no event or error text contains them.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        max_concurrency: int | None = None,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._headers = dict(headers or {})
        self._max_concurrency = max_concurrency
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._loop_cpu_s = 0.0
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run_loop, name="kvbench-endpoint-client", daemon=True)
        self._thread.start()
        self._ready.wait()

    # ----------------------------------------------------------------- caller's thread
    def submit(self, request: ClientRequest) -> None:
        """Queue ``request``; it is sent as soon as a concurrency slot is free."""
        self._loop.call_soon_threadsafe(self._start, request)

    def get(self, timeout_s: float | None) -> Event | None:
        """The next event, waiting up to ``timeout_s`` (None: forever; <= 0: no wait)."""
        try:
            if timeout_s is not None and timeout_s <= 0:
                return self._events.get_nowait()
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    @property
    def loop_cpu_s(self) -> float:
        """CPU seconds the client's thread used (sending, reading and parsing streams);
        final once ``close`` returned."""
        return self._loop_cpu_s

    def close(self) -> None:
        """Cancel what is in flight, close the connections and stop the thread. Idempotent."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    # ----------------------------------------------------------------- loop thread
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        cpu_start_s = time.thread_time()
        limits = httpx.Limits(max_connections=self._max_concurrency, max_keepalive_connections=None)
        timeout = httpx.Timeout(self._request_timeout_s, connect=self._connect_timeout_s)
        self._client = httpx.AsyncClient(
            base_url=self._base_url, headers=self._headers, limits=limits, timeout=timeout
        )
        if self._max_concurrency is not None:
            self._semaphore = asyncio.Semaphore(self._max_concurrency)
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                self._loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
            self._loop.run_until_complete(self._client.aclose())
            self._loop.close()
            self._loop_cpu_s = time.thread_time() - cpu_start_s

    def _start(self, request: ClientRequest) -> None:
        task = self._loop.create_task(self._run(request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, request: ClientRequest) -> None:
        if self._semaphore is None:
            await self._send(request)
            return
        async with self._semaphore:
            await self._send(request)

    async def _send(self, request: ClientRequest) -> None:
        put = self._events.put
        put(Sent(request.request_id, time.perf_counter()))
        try:
            async with asyncio.timeout(self._request_timeout_s):
                event = await self._stream(request)
        except TimeoutError:
            event = Failed(
                request.request_id,
                time.perf_counter(),
                f"timed out after {self._request_timeout_s:g} s (engine.request_timeout_s)",
                server_lost=False,
            )
        except httpx.TransportError as exc:
            # Connection refused or reset, or the stream cut mid-response: the server is gone.
            what = type(exc).__name__
            event = Failed(
                request.request_id,
                time.perf_counter(),
                f"connection to {self._base_url} failed: {what}: {body_excerpt(str(exc)) or 'no detail'}",
                server_lost=True,
            )
        put(event)

    async def _stream(self, request: ClientRequest) -> Done | Failed:
        assert self._client is not None
        outputs: list[list[int]] = [[] for _ in range(request.num_samples)]
        put = self._events.put
        last_token_s = float("nan")
        usage: Any = None
        async with self._client.stream("POST", request.path, json=dict(request.payload)) as response:
            if response.status_code >= 400:
                body = (await response.aread()).decode(errors="replace")
                return Failed(
                    request.request_id,
                    time.perf_counter(),
                    f"HTTP {response.status_code}: {body_excerpt(body)}",
                    server_lost=False,
                )
            async for line in response.aiter_lines():
                now_s = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    end_s = last_token_s if last_token_s == last_token_s else now_s
                    outputs_ids = tuple(tuple(ids) for ids in outputs)
                    return Done(request.request_id, end_s, outputs_ids, cached_prompt_tokens(usage))
                try:
                    chunk = json.loads(data)
                except ValueError:
                    return Failed(
                        request.request_id, now_s, f"malformed stream chunk: {body_excerpt(data)}", False
                    )
                if "error" in chunk:
                    error = chunk["error"]
                    text = error.get("message", error) if isinstance(error, Mapping) else error
                    return Failed(
                        request.request_id, now_s, f"server error in stream: {body_excerpt(str(text))}", False
                    )
                if chunk.get("usage") is not None:
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    tokens = chunk_tokens(choice)
                    if not tokens:
                        continue
                    index = int(choice.get("index", 0))
                    if not 0 <= index < request.num_samples:
                        return Failed(
                            request.request_id, now_s, f"stream choice index {index} out of range", False
                        )
                    outputs[index].extend(tokens)
                    last_token_s = now_s
                    put(Tokens(request.request_id, index, tokens, now_s))
        return Failed(
            request.request_id, time.perf_counter(), "stream ended before data: [DONE]", server_lost=True
        )
