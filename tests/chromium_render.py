"""Headless Chromium for the HTML tests: render a page, collect console errors, check plots."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
)
# Prepended to a copy of the page: console.error/warn and uncaught errors become
# "KVBENCH-CONSOLE-<level>" lines on Chromium's stderr (it logs every console call as INFO).
CONSOLE_HOOK = """<script>
(function () {
  for (const level of ["error", "warn"]) {
    const original = console[level].bind(console);
    console[level] = (...args) => original("KVBENCH-CONSOLE-" + level.toUpperCase() + ": " + args.join(" "));
  }
  window.addEventListener("error", (e) => console.log("KVBENCH-CONSOLE-ERROR: " + e.message));
})();
</script>"""


def find_chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI is set but no Chromium binary was found (apt-get install -y chromium)")
    pytest.skip("no Chromium binary (apt-get install -y chromium) and CI is not set")


def run_chromium(binary: str, page: Path, tmp_path: Path, *mode: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    command = [
        binary,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        "--virtual-time-budget=20000",
        *mode,
        page.as_uri(),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)


def render(binary: str, page_path: Path, tmp_path: Path) -> tuple[str, list[str]]:
    """(DOM after scripts ran, console error lines) for a copy of the page with CONSOLE_HOOK."""
    hooked = tmp_path / f"hooked-{page_path.name}"
    hooked.write_text(page_path.read_text().replace("<head>", "<head>" + CONSOLE_HOOK, 1))
    done = run_chromium(binary, hooked, tmp_path, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    errors = [
        line
        for line in done.stderr.splitlines()
        if "KVBENCH-CONSOLE-" in line or "Uncaught" in line or "ERROR:CONSOLE" in line
    ]
    return done.stdout, errors


def unrendered_plots(dom: str, ids: list[str]) -> list[str]:
    """Plot divs whose subtree has no plotly ``main-svg`` (each fig div is followed by the next)."""
    missing = []
    positions = [dom.find(f'id="{i}"') for i in ids] + [len(dom)]
    for i, (start, end) in enumerate(zip(positions[:-1], positions[1:])):
        if start < 0 or 'class="main-svg"' not in dom[start:end]:
            missing.append(ids[i])
    return missing
