"""The server guard: the leader of a launched server's process group.

    python -m kvbench.engines.endpoint.guard FD GRACE_S -- COMMAND...

kvbench starts the guard in a new session (so the guard's pid is the group id) with the
read end FD of a pipe whose write end only the kvbench process holds. The guard starts
COMMAND (the server) in its own group and waits. When the pipe reaches end of file, the
kvbench process is gone, however it died (SIGKILL included), and the guard kills the
whole group: SIGTERM, then SIGKILL after GRACE_S seconds. Servers spawn workers of
their own (vLLM's engine core); they stay in the group, so they die with it. The guard
exits with the server's status when the server exits by itself, and on SIGTERM/SIGINT
(kvbench stopping the group) it takes the group down the same way.

Standard library only: it must start fast and depend on nothing a server needs.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

POLL_INTERVAL_S = 0.2


def kill_group(grace_s: float, child: subprocess.Popen[bytes]) -> None:
    """SIGTERM every process of this group, SIGKILL what is left after ``grace_s``
    (the guard included: it never returns from the SIGKILL)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    group = os.getpgid(0)
    os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)
    os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m kvbench.engines.endpoint.guard FD GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    fd, grace_s, command = int(argv[0]), float(argv[1]), argv[3:]
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    child = subprocess.Popen(command)
    while True:
        status = child.poll()
        if status is not None:
            return status if status >= 0 else 128 - status
        if stop:
            kill_group(grace_s, child)
        readable, _, _ = select.select([fd], [], [], POLL_INTERVAL_S)
        if readable and not os.read(fd, 1):  # end of file: the kvbench process died
            kill_group(grace_s, child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
