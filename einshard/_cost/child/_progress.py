"""What a long compile shows while it runs: which table it is on, how many are done and left.

A plan of a large model compiles each candidate for minutes; without a word, a 20-minute plan
looks like a hung one. Nothing is shown for the first :data:`SHOW_AFTER` seconds (most reports
and small plans end sooner, and print nothing but their result); from then on, each table's
start and end is written to standard error: with ``rich``'s progress bar when it is installed
and standard error is a terminal, else as plain lines (a log file or a notebook's captured
stream). ``quiet=True`` shows nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, TextIO

from ..._language._text import seconds_text

__all__ = ["SHOW_AFTER", "CompileEvents", "Progress"]

SHOW_AFTER = 10.0
"""Seconds a run lasts before its progress is shown."""


class CompileEvents(Protocol):
    """What the compiles of a run tell as they go: the one interface of :class:`Progress` they use.

    The child processes (:mod:`._child`), the in-process compiles and a batch plan's rounds
    (:meth:`Progress.shifted`) write to it; pyright checks every implementation against it.
    """

    def compiling(self, index: int) -> None:
        """Table ``index`` starts compiling."""
        ...

    def finished(self, index: int, outcome: str = "compiled") -> None:
        """Table ``index`` is done (``outcome``: ``'compiled'``, ``'rejected'``, ...)."""
        ...

    def child_started(self, seconds: float) -> None:
        """A child process is ready to compile, ``seconds`` after it was started."""
        ...

    def child_memory(self, peak_bytes: int) -> None:
        """A child process's resident memory has reached ``peak_bytes`` at its largest."""
        ...


class Progress:
    """The progress of compiling one step under several tables (a plan's candidates, or one report).

    Args:
        what: Who is compiling: ``'plan'``, ``'explain_step'``.
        labels: One label per table, in order (a candidate's name).
        quiet: Show nothing.
        stream: Where to write (default: standard error when the run starts showing).
        show_after: Seconds before anything is shown (default :data:`SHOW_AFTER`).
    """

    def __init__(
        self,
        what: str,
        labels: Sequence[str],
        *,
        quiet: bool = False,
        stream: TextIO | None = None,
        show_after: float | None = None,
    ) -> None:
        self.what = what
        self.labels = list(labels)
        self.quiet = quiet
        self.stream = stream
        self.show_after = SHOW_AFTER if show_after is None else show_after
        self.started = time.perf_counter()
        self.current: int | None = None
        """The table that started compiling last, of those compiling now (children side by side)."""
        self.since: dict[int, float] = {}
        """When each table compiling now started."""
        self.seconds: dict[int, float] = {}
        self.left: dict[int, str] = {}
        self.child_seconds: list[float] = []
        """How long each child process took to start (import JAX, read the step), in order."""
        self.child_peak_bytes = 0
        """The largest resident memory of a child process so far."""
        self.shown = False
        self._bar: Any = None
        self._task: Any = None
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        if not quiet and self.labels:
            # A single compile can take minutes: the first line must not wait for it to end.
            self._timer = threading.Timer(self.show_after, self._show)
            self._timer.daemon = True
            self._timer.start()

    # --- events ------------------------------------------------------------------------------------

    def compiling(self, index: int) -> None:
        """Table ``index`` starts compiling."""
        with self._lock:
            self.current, self.since[index] = index, time.perf_counter()
            if self.shown:
                self._write_compiling()

    def finished(self, index: int, outcome: str = "compiled") -> None:
        """Table ``index`` is done (``outcome``: ``'compiled'``, ``'rejected'``, ``'killed'`` ...)."""
        with self._lock:
            self.seconds[index] = time.perf_counter() - self.since.pop(index, self.started)
            self.current = max(self.since, key=self.since.__getitem__) if self.since else None
            if self.shown:
                self._write_finished(index, outcome)

    def left_out(self, index: int, why: str) -> None:
        """Table ``index`` will not be compiled (``why``: ``'cannot win'``, ``'budget'`` ...)."""
        with self._lock:
            self.left[index] = why
            if self.shown and self._bar is None:
                self._line(f"{self.labels[index]!r} not compiled: {why}")
            elif self._bar is not None:
                self._bar.update(self._task, total=len(self.labels) - len(self.left))

    def child_started(self, seconds: float) -> None:
        """A child process is ready to compile, ``seconds`` after it was started."""
        self.child_seconds.append(seconds)

    def child_memory(self, peak_bytes: int) -> None:
        """A child process's resident memory has reached ``peak_bytes`` at its largest."""
        self.child_peak_bytes = max(self.child_peak_bytes, peak_bytes)

    def shifted(self, offset: int) -> ShiftedProgress:
        """The events of a group of compiles whose table ``i`` is this run's ``offset + i``.

        A batch plan compiles its candidates in rounds, each round's tables numbered from 0.
        """
        return ShiftedProgress(self, offset)

    def close(self) -> None:
        """The run is over: stop the timer, and end the display if one was shown."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
            elif self.shown:
                elapsed = time.perf_counter() - self.started
                left = f", {len(self.left)} not compiled" if self.left else ""
                self._line(f"{len(self.seconds)} of {len(self.labels)} done{left} in {seconds_text(elapsed)}")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- display -----------------------------------------------------------------------------------

    def _show(self) -> None:
        with self._lock:
            if self.shown or self.quiet:
                return
            self.shown = True
            stream = self.stream if self.stream is not None else sys.stderr
            self.stream = stream
            self._bar = _rich_bar(stream, self.what, len(self.labels))
            if self._bar is not None:
                self._task = self._bar.add_task(
                    self.what, total=len(self.labels), completed=len(self.seconds)
                )
            if self.current is not None:
                self._write_compiling()

    def _write_compiling(self) -> None:
        assert self.current is not None
        label = self.labels[self.current]
        done, total = len(self.seconds), len(self.labels) - len(self.left)
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.what}: compiling {label!r}", completed=done)
            return
        so_far = seconds_text(time.perf_counter() - self.started)
        self._line(f"compiling {done + len(self.since)} of {total}: {label!r} ({done} done, {so_far} so far)")

    def _write_finished(self, index: int, outcome: str) -> None:
        done, total = len(self.seconds), len(self.labels) - len(self.left)
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
            return
        self._line(
            f"{self.labels[index]!r} {outcome} in {seconds_text(self.seconds[index])} "
            f"({done} of {total} done, {total - done} left)"
        )

    def _line(self, text: str) -> None:
        assert self.stream is not None
        self.stream.write(f"{self.what}: {text}\n")
        self.stream.flush()


class ShiftedProgress:
    """A group of compiles' events, told to a :class:`Progress` with its tables' indexes shifted."""

    def __init__(self, progress: Progress, offset: int) -> None:
        self.progress = progress
        self.offset = offset

    def compiling(self, index: int) -> None:
        """Table ``offset + index`` starts compiling."""
        self.progress.compiling(self.offset + index)

    def finished(self, index: int, outcome: str = "compiled") -> None:
        """Table ``offset + index`` is done."""
        self.progress.finished(self.offset + index, outcome)

    def child_started(self, seconds: float) -> None:
        """A child process is ready (the run's own record: children serve every group)."""
        self.progress.child_started(seconds)

    def child_memory(self, peak_bytes: int) -> None:
        """A child process's peak memory so far."""
        self.progress.child_memory(peak_bytes)


def _rich_bar(stream: TextIO, what: str, total: int) -> Any:
    """``rich``'s progress bar on ``stream``, started; ``None`` without rich or a terminal."""
    if total < 2 or not getattr(stream, "isatty", lambda: False)():
        return None
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=stream),
        transient=False,
    )
    bar.start()
    return bar
