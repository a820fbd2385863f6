"""Progress for long runs: a bar for counted work (calibration, benchmarks) and a status line
(tracing, solving: the incumbent, bound and gap as they improve)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time

_thread = threading.local()


@contextlib.contextmanager
def silenced():
    """No progress from this thread meanwhile: work done alongside another's, whose lines it
    would break into (the caller reports its outcome)."""
    before = getattr(_thread, "silent", False)
    _thread.silent = True
    try:
        yield
    finally:
        _thread.silent = before


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


def wanted(stream=None) -> bool:
    """Whether to show progress: on a terminal, not under CI (``CI`` set), only on process 0, and
    not from a thread :func:`silenced`."""
    stream = stream or sys.stderr
    if getattr(_thread, "silent", False) or os.environ.get("CI") or not getattr(stream, "isatty", lambda: False)():
        return False
    import jax
    return jax.process_index() == 0


class Status:
    """One status line on stderr, rewritten in place as work proceeds; silent unless :func:`wanted`."""

    def __init__(self, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = wanted(self.stream) if enabled is None else enabled
        self.start = time.perf_counter()

    def say(self, text: str, *, whole: bool = False) -> None:
        """Rewrite the line: cut to the terminal's width (a wrapped line cannot be rewritten in
        place) unless ``whole``."""
        if self.enabled:
            line = f"shardplan {time.perf_counter() - self.start:6.1f}s {text}"
            width = max(80, shutil.get_terminal_size((160, 24)).columns - 1)
            self.stream.write("\r" + (line if whole else line[:width]).ljust(100))
            self.stream.flush()
            self.pending = True

    def done(self, text: str) -> None:
        """The last word of a stage: the line is kept, whole, and ended."""
        if self.enabled:
            self.say(text, whole=True)
            self.close()

    def close(self) -> None:
        if self.enabled and getattr(self, "pending", False):
            self.stream.write("\n")
            self.stream.flush()
            self.pending = False

    def __enter__(self) -> Status:
        return self

    def __exit__(self, *exc) -> None:
        self.close()       # an error or Ctrl-C never lands on the end of a status line


def said(text: str) -> None:
    """One finished status line (:meth:`Status.done`), where progress is shown."""
    with Status() as line:
        line.done(text)
