"""A dependency-free progress bar for long runs (calibration, benchmarks)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, label: str = "progress", stream=None):
        self.total, self.done, self.label = total, 0, label
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        width = 24
        filled = int(width * self.done / self.total)
        line = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.start:5.1f}s {label}")
        if self.tty:
            self.stream.write("\r" + line.ljust(100) + ("\n" if self.done == self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
