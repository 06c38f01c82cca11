"""A small progress line on stderr: only when stderr is a terminal, or when asked."""

from __future__ import annotations

import sys
import time


class Progress:
    """`with Progress(n, "calibrate") as p: ... p.step()` draws `calibrate [#####     ] 5/10 1.2s`."""

    def __init__(self, total: int, label: str, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.total = max(int(total), 0)
        self.label = label
        self.done = 0
        self.started = time.perf_counter()
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)()) and self.total > 1
        self.enabled = enabled

    def __enter__(self):
        self._draw()
        return self

    def step(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        bar = "#" * filled + " " * (width - filled)
        elapsed = time.perf_counter() - self.started
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:.1f}s")
        self.stream.flush()

    def __exit__(self, *exc):
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
        return False
