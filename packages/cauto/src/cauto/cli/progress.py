"""A progress line on stderr for the `cauto` command's slow phases (profiling, solving, codegen).

On a terminal it redraws ``⠹ solving the ILP  3.4 s`` ten times a second; elsewhere (CI, pipes)
it prints one line when the phase ends, so logs stay clean. Torch and the solver give no
fraction-done for one export or one ILP solve, so the line shows what runs and for how long;
training steps print their own ``step k/K`` lines in the launcher.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time

_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


@contextlib.contextmanager
def progress(label: str, stream=None):
    """Show ``label`` with elapsed seconds while the block runs; print the total when it ends."""
    stream = stream or sys.stderr
    start = time.perf_counter()
    done = threading.Event()
    live = hasattr(stream, "isatty") and stream.isatty()

    def spin():
        for frame in itertools.cycle(_FRAMES):
            if done.wait(0.1):
                return
            stream.write(f"\r{frame} {label}  {time.perf_counter() - start:.1f} s")
            stream.flush()

    thread = threading.Thread(target=spin, daemon=True) if live else None
    if thread:
        thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        if thread:
            thread.join()
            stream.write("\r\033[K")
        stream.write(f"{'done' if ok else 'failed'}: {label} in {time.perf_counter() - start:.1f} s\n")
        stream.flush()
