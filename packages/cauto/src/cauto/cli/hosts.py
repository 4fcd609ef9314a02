"""More than one host for `cauto run`: torchrun's rendezvous flags, checked, and a missing host in one line.

``Hosts.from_args`` checks ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-backend`` and
``--rdzv-timeout-s`` before anything starts (HostsError: what is wrong and what to pass) and gives the
torchrun flags. torchrun numbers ranks host by host (``node * nproc + local``), so a plan's mesh,
laid out row-major, puts its outer axis across hosts; ``hosts_note`` says which axes of the plan
cross hosts and the link the plan priced them at, and warns when an inner axis crosses hosts.

When a host never joins, torchrun's rendezvous times out and torchrun ends with a traceback of its
own machinery. ``RendezvousFilter`` passes the job's stderr through line by line, holding back only
a traceback that ends in a rendezvous error; `cauto run` then prints ``Hosts.missing_line`` instead.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass

_ENDPOINT = re.compile(r"^(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")
_RENDEZVOUS_ERRORS = ("RendezvousTimeoutError", "RendezvousClosedError", "RendezvousConnectionError")


class HostsError(ValueError):
    """A multi-host flag that cannot work; the message says which and what to pass."""


@dataclass(frozen=True)
class Hosts:
    """The rendezvous of a job of ``nnodes`` hosts with ``nproc`` ranks each."""

    nnodes: int
    nproc: int
    endpoint: str
    backend: str
    rendezvous_timeout_s: float
    node_rank: int | None = None

    @classmethod
    def from_args(cls, args, extra: list[str]) -> Hosts | None:
        """The job's hosts from `cauto run`'s parsed ``args`` (None: one host, no rendezvous flags)."""
        given = args.nnodes != 1 or args.node_rank is not None or args.rdzv_endpoint or args.rdzv_backend != "c10d"
        if not given:
            return None
        clash = [f for f in ("--nnodes", "--node-rank", "--node_rank", "--rdzv-endpoint", "--rdzv_endpoint",
                             "--rdzv-backend", "--rdzv_backend") if any(a == f or a.startswith(f + "=") for a in extra)]
        if clash:
            raise HostsError(f"{clash[0]} is given twice, as a `cauto run` flag and after `--`; give it once, before `--`")
        if args.nnodes < 1:
            raise HostsError(f"--nnodes {args.nnodes}: the number of hosts must be at least 1")
        if not args.rdzv_endpoint:
            raise HostsError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every host "
                             "(the first host's address and a free port)")
        match = _ENDPOINT.match(args.rdzv_endpoint)
        if match is None or not 1 <= int(match.group("port")) <= 65535:
            raise HostsError(f"--rdzv-endpoint {args.rdzv_endpoint!r} is not HOST:PORT with a port 1..65535 "
                             "(e.g. 10.0.0.1:29400)")
        if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
            raise HostsError(f"--node-rank {args.node_rank} is not in 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
        if args.rdzv_backend == "static" and args.node_rank is None:
            raise HostsError("--rdzv-backend static needs --node-rank (0 on the host at --rdzv-endpoint, then 1, 2, ...)")
        if not 0 < args.rdzv_timeout_s < math.inf:
            raise HostsError(f"--rdzv-timeout-s {args.rdzv_timeout_s:g} is not a positive number of seconds")
        return cls(args.nnodes, args.nproc, args.rdzv_endpoint, args.rdzv_backend, args.rdzv_timeout_s, args.node_rank)

    def torchrun_flags(self) -> list[str]:
        """torchrun's flags for this rendezvous."""
        timeout = f"{max(1, math.ceil(self.rendezvous_timeout_s))}"
        flags = ["--nnodes", str(self.nnodes), "--rdzv-backend", self.backend, "--rdzv-endpoint", self.endpoint,
                 "--rdzv-conf", f"join_timeout={timeout}" if self.backend == "c10d" else f"timeout={timeout}"]
        if self.backend == "static":
            flags += ["--node-rank", str(self.node_rank)]
        return flags

    def missing_line(self, error: str) -> str:
        """The one line for a rendezvous that failed with ``error`` (torchrun's exception name)."""
        why = (f"not every host joined within {self.rendezvous_timeout_s:g} s" if "Timeout" in error else
               "it was closed" if "Closed" in error else "this host could not reach it")
        ranks = f"{self.nproc} rank" + ("s" if self.nproc != 1 else "")
        return (f"cauto run: the rendezvous at {self.endpoint} failed ({error}): {why}; the job needs {self.nnodes} "
                f"hosts of {ranks} each. Start the same cauto run command (same --nnodes, --nproc and "
                f"--rdzv-endpoint) on every host, check that {self.endpoint} is reachable from each, or raise "
                "--rdzv-timeout-s")


def crossing_axes(mesh_shape: list[int] | tuple[int, ...], nproc: int) -> list[int]:
    """The mesh axes whose ranks lie on more than one host when each host runs ``nproc`` consecutive
    ranks (row-major layout: axis i crosses hosts when the axes from i on span more than a host)."""
    return [i for i in range(len(mesh_shape)) if math.prod(mesh_shape[i:]) > nproc and mesh_shape[i] > 1]


def hosts_note(plan_path: str, nproc: int) -> str | None:
    """One line on which of the plan's axes cross hosts and the link the plan priced them at; a
    warning when an axis other than the outer one crosses hosts."""
    import json
    from pathlib import Path

    plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
    shape, names = plan["mesh"]["shape"], plan["mesh"]["axis_names"]
    links = plan.get("cluster", {}).get("axes", [])
    crossing = crossing_axes(shape, nproc)
    if not crossing:
        return None

    def priced(i: int) -> str:
        return f" at {links[i]['bandwidth_bytes_per_s'] / 1e9:g} GB/s" if i < len(links) else ""

    text = "cauto run: across hosts: " + ", ".join(f"mesh axis {names[i]!r} (size {shape[i]}, priced{priced(i)})"
                                                   for i in crossing)
    inner = [i for i in crossing if i > 0]
    if inner:
        text += (f"; axis {names[inner[0]]!r} is not the outer axis, so hosts split it: with {nproc} ranks per host "
                 f"the axes after {names[0]!r} should span at most {nproc} ranks")
    return text


class RendezvousFilter:
    """Pass ``source`` (the job's stderr) through to ``sink`` line by line on a thread, holding back a
    Python traceback until its last line, and dropping it when that line is a rendezvous error
    (``rendezvous_failed`` then holds the error's name)."""

    def __init__(self, source, sink):
        self.source = source
        self.sink = sink
        self.rendezvous_failed: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="cauto-stderr")
        self._thread.start()

    def _run(self) -> None:
        held: list[str] = []
        for line in self.source:
            if not held and line.startswith("Traceback (most recent call last):"):
                held.append(line)
                continue
            if held:
                held.append(line)
                if line[:1] in (" ", "\t") or line.startswith("Traceback") or not line.strip():
                    continue
                found = next((e for e in _RENDEZVOUS_ERRORS if e in line), None)
                if found is not None:
                    self.rendezvous_failed = found
                else:
                    self.sink.writelines(held)
                held = []
            else:
                self.sink.write(line)
            self.sink.flush()
        self.sink.writelines(held)
        self.sink.flush()

    def join(self) -> None:
        """Wait until the job's stderr has ended and every line is through."""
        self._thread.join()
