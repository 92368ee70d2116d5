"""Drive an engine to completion in tests, checking invariants after every step."""

from __future__ import annotations

from collections.abc import Iterable

from kvbench.types import Request


def drive_engine(engine, requests: Iterable[Request] = (), max_steps: int = 5000):  # noqa: ANN001
    """Add ``requests``, step until nothing is unfinished; return (finished, rejected, outputs).

    After every step the KV manager's and scheduler's ``check()`` run when the engine has
    them, and a request may finish or be rejected only once. Raises AssertionError when
    the engine does not finish within ``max_steps``.
    """
    for request in requests:
        engine.add_request(request)
    checks = [getattr(getattr(engine, part, None), "check", None) for part in ("kv", "scheduler")]
    finished, rejected, outputs = {}, {}, []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finished, rejected, outputs
        out = engine.step()
        for check in checks:
            if check is not None:
                check()
        outputs.append(out)
        for f in out.finished:
            assert f.request_id not in finished and f.request_id not in rejected
            finished[f.request_id] = f
        for r in out.rejected:
            assert r.request_id not in finished and r.request_id not in rejected
            rejected[r.request_id] = r
    raise AssertionError(f"engine did not finish in {max_steps} steps")
