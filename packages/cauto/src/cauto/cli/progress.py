"""Progress of the `cauto` command's slow phases (profiling, planning, training) on a stream.

``PhaseBars(title)`` is a ``progress(phase, done, total)`` callback, the one ``cauto.profiler.profile``,
``cauto.solver.plan`` and the step counter of `cauto run` call. On a terminal it redraws one bar
per phase, ten times a second, and leaves each finished phase on its own line::

    profiling: symbolic steps  [############............]  99/198 nodes  1.2 s

Elsewhere (CI logs, pipes) it prints only milestones: one line when a phase ends, plus one at
each 25 % once a phase has run ``quiet_s`` seconds, so slow phases show they are alive and fast
ones stay one line. A phase with a time limit and no fraction (the ILP: the solver tells none)
shows its elapsed seconds against the limit. ``progress(label)`` is the spinner for work that
has no phases at all (code generation).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Mapping

_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
QUARTERS = 4
REDRAW_S = 0.05  # a terminal line is redrawn at most this often between ticks
_PAD = 16  # phase names are padded to this width on a terminal, so the bars line up


def is_tty(stream) -> bool:
    """Whether ``stream`` is a terminal (where lines may be redrawn)."""
    return bool(getattr(stream, "isatty", None)) and stream.isatty()


def is_milestone(done: int, total: int, before: int, parts: int = QUARTERS) -> bool:
    """Whether going from ``before`` to ``done`` of ``total`` crosses a 1/``parts`` mark (or ends)."""
    if total <= 0 or done <= before:
        return False
    return done >= total or done * parts // total > max(before, 0) * parts // total


def bar(fraction: float, width: int = 24) -> str:
    """``[######..................]`` filled to ``fraction`` (clamped to 0..1)."""
    filled = int(max(0.0, min(1.0, fraction)) * width)  # full only when done
    return "[" + "#" * filled + "." * (width - filled) + "]"


class PhaseBars:
    """A ``progress(phase, done, total[, note])`` callback drawing one bar per phase (module docstring).

    ``units``: phase -> what ``done`` counts ("nodes"); ``limits_s``: phase -> time limit, for phases
    reported only as 0/1 and 1/1. Use it as a context manager, or call ``close()``: both print
    ``done: TITLE in S s`` (``failed: ...`` after an exception).
    """

    def __init__(self, title: str, stream=None, *, units: Mapping[str, str] | None = None,
                 limits_s: Mapping[str, float] | None = None, width: int = 24, quiet_s: float = 2.0,
                 tick_s: float = 0.1):
        self.title = title
        self.stream = stream or sys.stderr
        self.units = dict(units or {})
        self.limits_s = dict(limits_s or {})
        self.width = width
        self.quiet_s = quiet_s
        self.live = is_tty(self.stream)
        self.started = time.perf_counter()
        self.phase: str | None = None
        self.done = self.total = self.printed = 0
        self.note = ""
        self.phase_start = self.started
        self._drawn = 0.0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ticker = None
        if self.live and tick_s:
            self._ticker = threading.Thread(target=self._tick, args=(tick_s,), daemon=True)
            self._ticker.start()

    # ----------------------------------------------------------------------------- the callback
    def __call__(self, phase: str, done: int, total: int, note: str = "") -> None:
        with self._lock:
            if phase != self.phase:
                self._end_phase()
                self.phase, self.phase_start, self.printed, self._drawn = phase, time.perf_counter(), 0, 0.0
            self.done, self.total, self.note = done, total, note
            if done >= total:
                self._end_phase()
            elif self.live:
                if time.perf_counter() - self._drawn >= REDRAW_S:
                    self._draw()
            elif time.perf_counter() - self.phase_start >= self.quiet_s and is_milestone(done, total, self.printed):
                self.printed = done
                self._write(self._line(final=False) + "\n")

    def print_line(self, text: str) -> None:
        """Print ``text`` (a line of other output) without tearing the bar being drawn."""
        with self._lock:
            if self.live and self.phase is not None:
                self._write("\r\033[K" + text.rstrip("\n") + "\n")
                self._draw()
            else:
                self._write(text.rstrip("\n") + "\n")

    def close(self, ok: bool = True, summary: bool = True) -> None:
        """Finish the current phase and, with ``summary``, print the total time (``done``/``failed``)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            self._end_phase()
            if summary:
                self._write(f"{'done' if ok else 'failed'}: {self.title} in {time.perf_counter() - self.started:.1f} s\n")

    def __enter__(self) -> PhaseBars:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)

    # ----------------------------------------------------------------------------- drawing
    def _line(self, final: bool) -> str:
        elapsed = time.perf_counter() - self.phase_start
        limit = self.limits_s.get(self.phase)
        if limit and self.total <= 1:  # no fraction: elapsed seconds against the time limit
            frac = 1.0 if final else min(elapsed / limit, 0.99)
            counts = "done" if final else f"{elapsed:.1f} s of {limit:g} s limit"
        else:
            frac = self.done / self.total if self.total > 0 else 1.0
            unit = self.units.get(self.phase, "")
            counts = f"{self.done}/{self.total}" + (f" {unit}" if unit else "")
        if self.live:
            return f"{self.title}: {self.phase:<{_PAD}} {bar(frac, self.width)}  {counts}{self.note}  {elapsed:.1f} s"
        return f"{self.title}: {self.phase} {100 * frac:.0f}% ({counts}){self.note}  {elapsed:.1f} s"

    def _draw(self) -> None:
        self._drawn = time.perf_counter()
        self._write("\r" + self._line(final=False) + "\033[K")

    def _end_phase(self) -> None:
        if self.phase is None:
            return
        text = self._line(final=self.done >= self.total)
        self._write(("\r" + text + "\033[K\n") if self.live else (text + "\n"))
        self.phase = None

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _tick(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            with self._lock:
                if self.phase is not None:
                    self._draw()


def profile_bars(stream=None) -> PhaseBars:
    """Bars for ``cauto.profiler.profile(progress=...)``: the capture, then the symbolic steps in nodes."""
    return PhaseBars("profiling", stream, units={"capture": "step", "symbolic steps": "nodes"})


def plan_bars(time_limit_s: float, stream=None) -> PhaseBars:
    """Bars for ``cauto.solver.plan(progress=...)``: strategies and costs in nodes, the ILP against
    its time limit, the checkpoint search in sharding solves."""
    return PhaseBars("planning", stream, units={"strategies": "nodes", "costs": "nodes", "checkpoint search": "solves"},
                     limits_s={"ilp": time_limit_s})


class Outcome:
    """What a ``progress`` block yields: set ``ok = False`` when the work failed and said so itself."""

    ok = True


@contextlib.contextmanager
def progress(label: str, stream=None):
    """Show ``label`` with a spinner and elapsed seconds while the block runs; print the total when it
    ends (``done``), ``failed`` after an exception, nothing after SystemExit (--help, a usage error)
    or when the block set the yielded ``Outcome.ok`` to False (its own error line says why)."""
    stream = stream or sys.stderr
    start = time.perf_counter()
    done = threading.Event()
    live = is_tty(stream)

    def spin():
        for frame in itertools.cycle(_FRAMES):
            if done.wait(0.1):
                return
            stream.write(f"\r{frame} {label}  {time.perf_counter() - start:.1f} s")
            stream.flush()

    thread = threading.Thread(target=spin, daemon=True) if live else None
    if thread:
        thread.start()
    outcome = Outcome()
    raised: BaseException | None = None
    try:
        yield outcome
    except BaseException as exc:
        raised = exc
        raise
    finally:
        done.set()
        if thread:
            thread.join()
            stream.write("\r\033[K")
        if raised is None and outcome.ok:
            stream.write(f"done: {label} in {time.perf_counter() - start:.1f} s\n")
        elif raised is not None and not isinstance(raised, SystemExit):
            stream.write(f"failed: {label} in {time.perf_counter() - start:.1f} s\n")
        stream.flush()
