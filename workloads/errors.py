"""Errors raised for bad workload input: a trace row or a generator parameter.

Both are ValueErrors whose message fits on one screen and names where the problem is,
so a user can fix the file or the config without reading a traceback.
"""

from __future__ import annotations

from pathlib import Path


class TraceError(ValueError):
    """A malformed trace line or row.

    The message has the shape ``FILE:LINE: field 'NAME': problem``; the parts are kept
    as attributes (``path``, ``line``, ``field``, ``problem``) for callers that count or
    re-format them. ``line`` is 1-based; 0 means the file as a whole (an empty trace).
    """

    def __init__(self, path: str | Path, line: int, field: str, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        self.problem = problem
        super().__init__(f"{self.path}:{line}: field '{field}': {problem}")


class WorkloadConfigError(ValueError):
    """An impossible generator parameter; the message starts with the parameter's path,
    for example ``prompt_len.std: must be > 0, got -1``."""
