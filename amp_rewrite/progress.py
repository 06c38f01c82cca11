"""A small progress line on stderr: only when stderr is a terminal, or when asked."""

from __future__ import annotations

import sys
import time


class Progress:
    """`with Progress(n, "calibrate") as p: ... p.step()` draws `calibrate [#####     ] 5/10 1.2s`.

    `enabled=None` draws only on a terminal (a log file gets no carriage-return spew); `total=None`
    counts steps without a bar; `step(note=...)` appends live figures such as loss and scale."""

    def __init__(self, total: int | None, label: str, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.total = None if total is None else max(int(total), 0)
        self.label = label
        self.done = 0
        self.note = ""
        self.started = time.perf_counter()
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)()) and (
                self.total is None or self.total > 1
            )
        self.enabled = enabled

    def __enter__(self):
        self._draw()
        return self

    def step(self, n: int = 1, note: str = "") -> None:
        self.done += n
        self.note = note
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 24
        if self.total is None:
            bar = f"{self.done} steps"
        else:
            filled = int(width * self.done / self.total) if self.total else width
            bar = f"[{'#' * filled}{' ' * (width - filled)}] {self.done}/{self.total}"
        elapsed = time.perf_counter() - self.started
        note = f" {self.note}" if self.note else ""
        self.stream.write(f"\r{self.label} {bar} {elapsed:.1f}s{note}")
        self.stream.flush()

    def __exit__(self, *exc):
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
        return False
