"""``memory_session()``: a torch profiler session that records allocations, without kineto's chatter.

kineto prints ``USDT: ... profiler_start`` / ``profiler_stop`` lines to file descriptor 2 whenever a
session starts and stops (no log level turns them off in this torch). They would show in
``cauto run``, ``cauto demo`` and every ``--verify``: fd 2 is pointed at /dev/null while the session
starts and while it stops, and only then (what the step prints in between passes through).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def quiet_fd2() -> Iterator[None]:
    """Point file descriptor 2 at /dev/null for the duration (Python's sys.stderr is flushed first)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:  # no real fd 2 (embedded interpreters): let it print
        yield
        return
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def memory_session() -> Iterator[torch.profiler.profile]:
    """``torch.profiler.profile(CPU, profile_memory=True)``, started and stopped quietly."""
    session = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with quiet_fd2():
        session.__enter__()
    try:
        yield session
    finally:
        with quiet_fd2():
            session.__exit__(None, None, None)
