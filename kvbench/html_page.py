"""The one way text enters kvbench's HTML pages, and the one way a page is written.

``escape`` is the only escaping path of ``report`` and ``compare``: element text,
attribute values and the strings handed to plotly (trace names, category ticks, subplot
titles, hover text) all go through it. Plotly draws those strings as pseudo-HTML in SVG
(``<b>``, ``<a href=...>`` become markup), and it decodes only ``&amp; &lt; &gt;`` and
numeric references, not ``&quot;``; so quotes are escaped numerically and one escaped
string shows as the literal text both in the page and in a plot.

``write_page`` writes a page atomically and never overwrites a file kvbench did not
write: kvbench's pages carry ``GENERATOR_META`` right after ``<meta charset>``, and an
existing file without it (a user's file, a directory, a symbolic link) is refused with
an error naming the path. Pages written before the marker existed are recognised by
their exact opening bytes (``LEGACY_HEADS``).
"""

from __future__ import annotations

import contextlib
import html
import os
import uuid
from pathlib import Path

from kvbench import __version__

GENERATOR_META = f'<meta name="generator" content="kvbench {__version__}">'
_MARKER = b'<meta name="generator" content="kvbench '
# kvbench puts the marker in the first few hundred bytes; a file is judged by this prefix only.
MARKER_SEARCH_BYTES = 1024
# The exact openings of report and compare pages written before GENERATOR_META existed.
LEGACY_HEADS: tuple[bytes, ...] = (
    b'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n<title>kvbench report: ',
    b'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>kvbench compare: ',
)


class PageOutputError(Exception):
    """A page cannot be written to its path (not kvbench's file, or an OS error); names the path."""


def escape(value: object) -> str:
    """``str(value)`` safe as HTML text, as a quoted attribute value and as a plotly label."""
    return html.escape(str(value), quote=False).replace('"', "&#34;").replace("'", "&#39;")


def is_kvbench_page(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a regular file (not a link) that kvbench wrote as a page."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(MARKER_SEARCH_BYTES)
    except OSError:
        return False
    return _MARKER in head or head.startswith(LEGACY_HEADS)


def write_page(path: str | os.PathLike[str], page: str) -> Path:
    """Write ``page`` to ``path`` atomically (temp file, then rename) and return the path.

    Parents are created. Raises PageOutputError naming the path when something that is not
    a kvbench page is there, or when the file system refuses; nothing is overwritten then,
    and no temp file is left behind.
    """
    path = Path(path)
    if GENERATOR_META not in page[:MARKER_SEARCH_BYTES]:
        raise ValueError(
            f"{path}: page lacks the kvbench generator tag in its first {MARKER_SEARCH_BYTES} bytes"
        )
    if os.path.lexists(path) and not is_kvbench_page(path):
        kind = (
            "a symbolic link"
            if path.is_symlink()
            else "a directory"
            if path.is_dir()
            else "a file kvbench did not write"
        )
        raise PageOutputError(
            f"{path}: refusing to overwrite {kind} (kvbench replaces only its own pages, recognised by "
            f'<meta name="generator" content="kvbench ...">); move it away or choose another output path'
        )
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_EXCL: the temp name is new, so no existing file is ever truncated through it.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # e.g. the parent is a file: no temp was made
            tmp.unlink(missing_ok=True)
        raise PageOutputError(f"{path}: cannot write: {exc.strerror or exc}") from exc
    return path
