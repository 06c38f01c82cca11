"""Headless Chromium for the HTML report tests: the DOM after the page's script ran, a screenshot.

Plain command-line flags (no playwright): `--virtual-time-budget` lets the script finish before
`--dump-dom` prints the document. Tests skip with a reason when no Chromium is installed.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest


def executable() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        pytest.skip(
            "no headless Chromium (Debian: apt-get install chromium): the page's drawing is not checked"
        )
    return found


def _run(page: Path, extra: list, fragment: str = "", timeout: int = 120) -> str:
    with tempfile.TemporaryDirectory() as profile:
        command = [
            executable(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--mute-audio",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=10000",
            "--window-size=1400,900",
            *extra,
            page.resolve().as_uri() + (f"#{fragment}" if fragment else ""),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    return done.stdout


def screenshot(page: Path, png: Path, fragment: str = "") -> Path:
    _run(page, [f"--screenshot={png}"], fragment)
    assert png.exists() and png.stat().st_size > 1000, f"no screenshot of {page}"
    return png


class Dom(HTMLParser):
    """What the drawn page holds: node boxes, regions, cast marks, and the body's flags."""

    def __init__(self):
        super().__init__()
        self.nodes, self.regions, self.open_regions, self.casts, self.body = [], [], [], [], {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "body":
            self.body = a
        elif tag == "g" and "node" in classes:
            self.nodes.append(a)
        elif tag == "g" and "region" in classes:
            (self.open_regions if "open" in classes else self.regions).append(a)
        elif tag == "g" and "cast" in classes:
            self.casts.append(int(a["data-n"]))


def dom(page: Path, fragment: str = "") -> Dom:
    parsed = Dom()
    parsed.feed(_run(page, ["--dump-dom"], fragment))
    parsed.close()
    assert parsed.body.get("data-amp-ready") == "1", f"the page's script did not finish: {parsed.body}"
    return parsed
