"""Launch a server per configuration from a command template, probe it, always tear it down.

The command template is a list of arguments with placeholders ``{port}`` (a free
loopback port), ``{model}`` (the exported model directory) and ``{python}`` (the
server venv's interpreter); ``server_args`` (a mapping) appends ``--key value`` flags,
so a Hydra sweep over ``engine.server_args.block_size=32,64`` compares configurations.

Teardown is the point of this module. The server runs under ``guard`` (see there) as
the leader of a new process group; ``ServerProcess.stop`` kills that group (SIGTERM, then
SIGKILL after a grace period). It runs from ``finally`` blocks, from an ``atexit`` hook
and on SIGTERM (turned into SystemExit in the main thread so that ``finally`` blocks run);
Ctrl-C raises KeyboardInterrupt, which unwinds the same way. If the kvbench process is
killed outright (SIGKILL), the guard sees its pipe close and kills the group itself.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

PLACEHOLDERS = ("port", "model", "python")
# Lines of the server log shown when it fails to start.
LOG_TAIL_LINES = 15


class ServerError(RuntimeError):
    """A server that cannot be reached or started; ``str()`` is the one-screen message."""


def render_command(template: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """``template`` with ``{port}``, ``{model}``, ``{python}`` replaced from ``values``.

    Raises ValueError naming ``engine.command`` for an empty template or an unknown
    placeholder (a literal brace is written ``{{``). Pure.
    """
    if not template:
        raise ValueError("engine.command: empty; give the server's command line as a list")
    rendered = []
    for index, part in enumerate(template):
        try:
            rendered.append(str(part).format_map(values))
        except (KeyError, IndexError, ValueError) as exc:
            known = ", ".join("{" + name + "}" for name in PLACEHOLDERS)
            raise ValueError(
                f"engine.command[{index}]: {part!r}: bad placeholder {exc} (known: {known})"
            ) from None
    return rendered


def server_flags(server_args: Mapping[str, Any]) -> list[str]:
    """``{"block_size": 32, "enable_prefix_caching": false}`` as command-line flags:
    ``--block-size 32 --no-enable-prefix-caching``. True is a bare ``--flag``, false
    ``--no-flag``, null leaves the flag out, a list repeats ``--flag`` per item. Pure."""
    flags: list[str] = []
    for key, value in server_args.items():
        name = "--" + str(key).replace("_", "-")
        if value is None:
            continue
        if value is True:
            flags.append(name)
        elif value is False:
            flags.append("--no-" + name[2:])
        elif isinstance(value, (list, tuple)):
            for item in value:
                flags += [name, str(item)]
        else:
            flags += [name, str(value)]
    return flags


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def log_tail(path: Path, num_lines: int = LOG_TAIL_LINES) -> str:
    """The last ``num_lines`` lines of ``path`` ("" when unreadable)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 16384))
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


# Servers started by this process and not yet stopped: the atexit hook and the SIGTERM
# handler stop these.
_LIVE: set[ServerProcess] = set()
_LIVE_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def _stop_all() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        server.stop()


def _on_sigterm(signum: int, frame: Any) -> None:
    # Unwind the main thread like Ctrl-C does, so every finally block (and the server
    # stop in it) runs; the exit status says SIGTERM.
    raise SystemExit(128 + signum)


def _install_hooks() -> None:
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    atexit.register(_stop_all)
    # Only a default SIGTERM disposition is replaced, and only from the main thread (where
    # Python delivers signals): an application's own handler is left in charge.
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    _HOOKS_INSTALLED = True


class ServerProcess:
    """One launched server: ``command`` under the guard, output appended to ``log_path``.

    ``pgid`` is the process group every server process belongs to. ``stop`` is
    idempotent and safe from any thread.
    """

    def __init__(
        self,
        command: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        stop_grace_s: float = 10.0,
    ) -> None:
        self.command = list(command)
        self.log_path = log_path
        self._stop_grace_s = stop_grace_s
        self._stop_lock = threading.Lock()
        _install_hooks()
        read_fd, self._lifeline_fd = os.pipe()  # both close-on-exec; the guard gets read_fd
        guard = [
            sys.executable,
            "-m",
            "kvbench.engines.endpoint.guard",
            str(read_fd),
            str(stop_grace_s),
            "--",
        ]
        try:
            with open(log_path, "ab") as log:
                self._process = subprocess.Popen(
                    guard + self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {})},
                    start_new_session=True,
                    pass_fds=(read_fd,),
                )
        except OSError:
            os.close(self._lifeline_fd)
            raise
        finally:
            os.close(read_fd)
        self.pgid = self._process.pid  # the guard leads its new session's group
        with _LIVE_LOCK:
            _LIVE.add(self)

    def exit_code(self) -> int | None:
        """The server's exit status (the guard's), None while it runs."""
        return self._process.poll()

    def stop(self) -> None:
        """Kill the process group: SIGTERM, SIGKILL after the grace period; wait for the
        guard. Idempotent."""
        with self._stop_lock:
            with _LIVE_LOCK:
                if self not in _LIVE:
                    return
                _LIVE.discard(self)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGTERM)
            deadline = time.monotonic() + self._stop_grace_s
            # poll() reaps the guard once it exits: an unreaped guard (a zombie) would still
            # count as a member of its group.
            while time.monotonic() < deadline and (self._process.poll() is None or _group_alive(self.pgid)):
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
            self._process.wait()
            with contextlib.suppress(OSError):
                os.close(self._lifeline_fd)


def _group_alive(pgid: int) -> bool:
    """True while any process (not yet reaped) is in group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_ready(
    url: str,
    timeout_s: float,
    *,
    server: ServerProcess | None = None,
    headers: Mapping[str, str] | None = None,
) -> float:
    """Poll GET ``url`` until it answers 200; return the seconds it took.

    Raises ServerError naming ``url`` when it has not answered within ``timeout_s``, or as
    soon as the launched ``server`` exits (with the tail of its log).
    """
    start_s = time.monotonic()
    deadline = start_s + timeout_s
    last = "no answer yet"
    with httpx.Client(headers=dict(headers or {}), timeout=min(5.0, max(timeout_s, 0.1))) as client:
        while True:
            if server is not None and server.exit_code() is not None:
                raise ServerError(
                    f"server exited with status {server.exit_code()} before {url} answered; "
                    f"log {server.log_path}, last lines:\n{log_tail(server.log_path)}"
                )
            try:
                response = client.get(url)
                if response.status_code == 200:
                    return time.monotonic() - start_s
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if time.monotonic() >= deadline:
                where = f" (server log: {server.log_path})" if server is not None else ""
                raise ServerError(
                    f"server unreachable: {url} did not answer within {timeout_s:g} s "
                    f"(engine.readiness_timeout_s; last: {last}){where}"
                )
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
