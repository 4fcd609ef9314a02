"""The watchdog of `cauto run`: a stalled job ends, every process with it, and one line says why.

The ranks write heartbeats (cauto.runtime.heartbeat) to a temp folder; torchrun runs them. While the
job runs, the watchdog reads the heartbeats every ``POLL_S``. A rank whose last beat is older than
the job's timeout (stopped, or frozen with the GIL held), or one that has written none
``STARTUP_S`` longer than that after the start, stalls the job: the watchdog prints

    cauto run: rank R stalled in PHASE (step K) for T s; ended the job

and kills every rank's process group, every other process below torchrun, and torchrun. Other
stalls end by themselves: a rank blocked in a collective with a stuck or lost peer fails after the
process groups' timeout (the same ``--timeout-s``) and torchrun stops the rest. When torchrun exits
non-zero, ``verdict`` names the cause from the heartbeats: first a rank that died without a word
(killed by a signal), else the rank whose error came first (a collective that timed out names
itself), in one line.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from cauto.runtime.heartbeat import read_heartbeats

POLL_S = 0.25
STARTUP_S = 30.0
"""Allowance over the timeout for a rank's first heartbeat (torchrun's start and `import torch`)."""
EXIT_STALLED = 124
"""`cauto run`'s exit status when the watchdog ended a stalled job (as GNU timeout's)."""


def _where(beat: dict) -> str:
    return beat["phase"] + (f" (step {beat['step']})" if beat.get("step") else "")


class Watchdog:
    """Watches the heartbeats in ``directory`` of ``nproc`` local ranks against ``timeout_s``; a rank's
    first heartbeat may take ``startup_s`` longer (a multi-host job adds its rendezvous timeout)."""

    def __init__(self, directory: str | os.PathLike, nproc: int, timeout_s: float, startup_s: float = STARTUP_S):
        self.directory = Path(directory)
        self.nproc = nproc
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self.started = time.time()
        self.stall: str | None = None
        self._stop = threading.Event()

    def stalled(self, now: float | None = None) -> str | None:
        """The line naming a stalled rank, or None while every rank beats (or has ended)."""
        now = time.time() if now is None else now
        beats = read_heartbeats(self.directory)
        for local in range(self.nproc):
            beat = beats.get(local)
            if beat is None:
                if now - self.started > self.timeout_s + self.startup_s:
                    return (f"cauto run: local rank {local} never started (no heartbeat after {now - self.started:.0f} s); "
                            "ended the job")
                continue
            age = now - beat["beat"]
            if beat.get("ended") is None and age > self.timeout_s:
                what = "stalled" if _alive(beat["pid"]) else "stopped beating"
                return f"cauto run: rank {beat['rank']} {what} in {_where(beat)} for {age:.0f} s; ended the job"
        return None

    def verdict(self, returncode: int) -> str:
        """One line naming why a job that torchrun ended with ``returncode`` failed."""
        beats = sorted(read_heartbeats(self.directory).values(), key=lambda b: b["rank"])
        silent = [b for b in beats if b.get("ended") is None and not _alive(b["pid"])]
        if silent:
            b = silent[0]
            return (f"cauto run: rank {b['rank']} died in {_where(b)} without an error (killed by a signal: "
                    f"SIGKILL, the OOM killer or a crash); the job ended (exit {returncode})")
        failed = sorted((b for b in beats if b.get("ended") == "failed"), key=lambda b: b["beat"])
        if failed:
            b = failed[0]
            return f"cauto run: rank {b['rank']} failed in {_where(b)}: {b.get('error')}; the job ended (exit {returncode})"
        return f"cauto run: the job failed (torchrun exit {returncode}); see the ranks' output above"

    def watch(self, proc, stream) -> threading.Thread:
        """Start a thread that ends ``proc`` (torchrun) and its ranks on a stall, writing the line to ``stream``."""

        def loop():
            while proc.poll() is None and not self._stop.wait(POLL_S):
                line = self.stalled()
                if line is not None:
                    self.stall = line
                    end_job(proc.pid, read_heartbeats(self.directory).values())
                    stream.write(line + "\n")
                    stream.flush()
                    return

        thread = threading.Thread(target=loop, daemon=True, name="cauto-watchdog")
        thread.start()
        return thread

    def stop(self) -> None:
        """Stop watching (the job has ended)."""
        self._stop.set()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (dead, waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def end_job(torchrun_pid: int, beats) -> None:
    """SIGKILL the job: each rank's process group (torchrun starts each rank in its own session),
    every process below torchrun, then torchrun. SIGKILL ends stopped processes too."""
    pids = {b["pid"] for b in beats} | set(descendants(torchrun_pid))
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        os.kill(torchrun_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
