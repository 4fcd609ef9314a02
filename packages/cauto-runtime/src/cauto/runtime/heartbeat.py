"""Rank heartbeats: what each rank of a launched job is doing, for the watchdog of `cauto run`.

When ``$CAUTO_HEARTBEAT_DIR`` is set (`cauto run` sets it to a fresh temp folder), each rank keeps a
file ``local<LOCAL_RANK>.json`` there::

    {"rank": 1, "pid": 4242, "phase": "forward", "step": 3, "phase_since": 1.7e9, "beat": 1.7e9,
     "ended": null, "error": null}

A daemon thread rewrites it every ``BEAT_INTERVAL_S`` (``beat``: wall-clock seconds), and every phase
change rewrites it at once. A stopped rank (SIGSTOP) or one frozen with the GIL held stops beating;
the watchdog ends the job once a beat is older than the job's timeout. ``ended`` says how a rank
ended: "done", "failed" (``error`` holds one line), or "SIGTERM" (torchrun terminated it because
another rank failed); a rank that died with ``ended`` still null was killed without a word
(SIGKILL, the OOM killer, a crash). Writes are atomic (temp file + ``os.replace``), so a reader
never sees half a file. Without the variable every method is a no-op.

Test hook: ``$CAUTO_TEST_FAULT=RANK:PHASE:ACTION[:STEP]`` makes rank RANK, on entering PHASE (at
training step STEP, default 1), send itself SIGSTOP or SIGKILL, or ``hang`` (sleep forever while
still beating: a rank stuck outside a collective). Torch-free.
"""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
from pathlib import Path

ENV_DIR = "CAUTO_HEARTBEAT_DIR"
ENV_FAULT = "CAUTO_TEST_FAULT"
BEAT_INTERVAL_S = 0.5
FAULT_ACTIONS = ("SIGSTOP", "SIGKILL", "hang")


def parse_fault(text: str | None) -> tuple[int, str, str, int] | None:
    """``"1:forward:SIGSTOP[:2]"`` -> (1, "forward", "SIGSTOP", 2); None for an empty spec."""
    if not text:
        return None
    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[0].isdigit() or parts[2] not in FAULT_ACTIONS \
            or (len(parts) == 4 and not parts[3].isdigit()):
        raise ValueError(f"{ENV_FAULT}={text!r} is not RANK:PHASE:ACTION[:STEP] with ACTION one of {FAULT_ACTIONS}")
    return int(parts[0]), parts[1], parts[2], int(parts[3]) if len(parts) == 4 else 1


class Heartbeat:
    """This rank's heartbeat file (module docstring); every method is a no-op without ``directory``."""

    def __init__(self, rank: int, local_rank: int, directory: str | os.PathLike | None,
                 interval_s: float = BEAT_INTERVAL_S, fault: str | None = None):
        self.path = Path(directory) / f"local{local_rank}.json" if directory else None
        self.interval_s = interval_s
        self.fault = parse_fault(fault)
        self.state = {"rank": rank, "pid": os.getpid(), "phase": "start", "step": None, "phase_since": time.time(),
                      "beat": time.time(), "ended": None, "error": None}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = None
        if self.path is not None:
            self._watch_sigterm()
            self._write()
            threading.Thread(target=self._beat, daemon=True, name="cauto-heartbeat").start()

    @classmethod
    def from_env(cls) -> Heartbeat:
        """The heartbeat torchrun's environment asks for (RANK, LOCAL_RANK, $CAUTO_HEARTBEAT_DIR)."""
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
                   os.environ.get(ENV_DIR) or None, fault=os.environ.get(ENV_FAULT))

    def enter(self, phase: str, step: int | None = None) -> None:
        """Record that this rank starts ``phase`` (at training ``step``); fire the test fault there."""
        if self.path is None:
            return
        with self._lock:
            self.state.update(phase=phase, step=step, phase_since=time.time())
            self._write()
        if self.fault and self.fault[0] == self.state["rank"] and self.fault[1] == phase \
                and (step is None or step == self.fault[3]):
            action = self.fault[2]
            if action == "hang":
                while True:
                    time.sleep(3600)
            os.kill(os.getpid(), getattr(signal, action))

    def end(self, how: str, error: str | None = None) -> None:
        """Record how this rank ends: "done" or "failed" (with ``error``, one line)."""
        if self.path is None:
            return
        self._stop.set()
        with self._lock:
            self.state.update(ended=how, error=error)
            self._write()

    def _write(self) -> None:
        self.state["beat"] = time.time()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)

    def _beat(self) -> None:
        while not self._stop.is_set():
            readable = select.select([self._wake], [], [], self.interval_s)[0] if self._wake is not None else \
                self._stop.wait(self.interval_s)
            with self._lock:
                if self._stop.is_set():
                    return
                if readable and signal.SIGTERM in os.read(self._wake, 64):
                    self.state["ended"] = "SIGTERM"
                    self._write()
                    os._exit(128 + signal.SIGTERM)
                self._write()

    def _watch_sigterm(self) -> None:
        """Mark a SIGTERM (torchrun ending this rank after another failed) in the file, then exit.

        The Python-level handler would run only when the main thread returns from C++ (a rank
        blocked in a collective may not for the whole timeout); the wakeup fd reaches this thread at once.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.set_wakeup_fd(write_fd)
        self._wake = read_fd


def read_heartbeats(directory: str | os.PathLike) -> dict[int, dict]:
    """Local rank -> its last heartbeat (module docstring), for every file in ``directory``."""
    beats = {}
    for path in Path(directory).glob("local*.json"):
        try:
            beats[int(path.stem[len("local"):])] = json.loads(path.read_text())
        except (ValueError, OSError):
            continue  # replaced between glob and read: the next poll reads it
    return beats
