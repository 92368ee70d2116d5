"""Errors raised for bad workload input: a trace row or a generator parameter.

Both are ValueErrors whose message fits on one screen and names where the problem is,
so a user can fix the file or the config without reading a traceback.
"""

from __future__ import annotations

from pathlib import Path

# Six 80-column lines: room for a long path, the expected form and a shown value.
MAX_MESSAGE_CHARS = 480


class TraceError(ValueError):
    """A malformed trace line or row, or a trace file that cannot be read at all.

    The message is one line, in one of three shapes:

    - ``FILE:LINE: field 'NAME': problem`` for a bad value (``field`` set);
    - ``FILE:LINE: problem`` for a line that is bad as a whole (``field`` None), such as
      bytes that are not UTF-8;
    - ``FILE: problem`` for the file as a whole (``field`` None, ``line`` 0), such as
      corrupt gzip data.

    The parts are kept as attributes (``path``, ``line``, ``field``, ``problem``) for
    callers that count or re-format them. ``line`` is 1-based; 0 means the file as a
    whole (an empty trace, an unreadable file). Characters that are not printable (a
    newline in a JSON key, an undecodable byte) are written as Python escapes, and the
    message is cut at MAX_MESSAGE_CHARS, so that a hostile file cannot split it over
    several lines or screens.
    """

    def __init__(self, path: str | Path, line: int, field: str | None, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        self.problem = problem
        if field is not None:
            message = f"{self.path}:{line}: field '{field}': {problem}"
        elif line > 0:
            message = f"{self.path}:{line}: {problem}"
        else:
            message = f"{self.path}: {problem}"
        message = printable(message)
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({len(message)} chars)"
        super().__init__(message)


def printable(text: str) -> str:
    """``text`` with every non-printable character (newline, tab, NUL, a lone surrogate)
    replaced by its Python escape, e.g. ``\\n`` or ``\\udce9``; printable text is
    returned unchanged."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


class WorkloadConfigError(ValueError):
    """An impossible generator parameter; the message starts with the parameter's path,
    for example ``prompt_len.std: must be > 0, got -1``."""
