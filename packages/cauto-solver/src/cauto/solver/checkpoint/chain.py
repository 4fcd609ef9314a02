"""A training step as a chain of stages: what rotor, Chen and the simulator reason about.

Notation (ALGORITHMS.md §3): stages 0..L, the last one (L) computes the loss. Stage i reads a^i
(x_i bytes; its gradient δ^i has the same size) and writes a^{i+1}. Run with autograd recording,
stage i keeps x̄_{i+1} bytes until its backward (everything its ops save, a^{i+1} included, so
x̄_{i+1} ≥ x_{i+1}). Forward and backward need ftmp_i and btmp_i bytes on top of that while they
run, and take uf_i and ub_i seconds. x_{L+1} is the loss (its gradient seeds the backward).

All numbers are per device, for one sharding: ``build_chain`` (linearize.py) divides a node's
bytes and time by its shard divisor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Chain:
    """Per-stage costs of a chain of n = L+1 stages (arrays are numpy, bytes are integers)."""

    fwd_s: np.ndarray
    """uf_i, seconds of stage i's forward, length n."""
    bwd_s: np.ndarray
    """ub_i, seconds of stage i's backward, length n."""
    x_bytes: np.ndarray
    """x_i, bytes of a^i (and of δ^i), length n+1; x_bytes[n] is the loss."""
    xbar_bytes: np.ndarray
    """x̄_i, bytes stage i−1 keeps when recorded, length n+1 (x̄_0 is unused and 0)."""
    ftmp_bytes: np.ndarray
    """Extra bytes while stage i's forward runs, length n."""
    btmp_bytes: np.ndarray
    """Extra bytes while stage i's backward runs, length n."""
    stage_nodes: tuple[tuple[str, ...], ...] = field(default=())
    """Graph op node ids of each stage (empty for synthetic chains)."""
    const_bytes: int = 0
    """Bytes alive through the whole step that no stage owns (masks, rotary tables shared by stages)."""

    def __post_init__(self):
        n = len(self.fwd_s)
        if n < 1:
            raise ValueError("a chain needs at least one stage (the loss)")
        for name, want in (("bwd_s", n), ("x_bytes", n + 1), ("xbar_bytes", n + 1), ("ftmp_bytes", n),
                           ("btmp_bytes", n)):
            got = len(getattr(self, name))
            if got != want:
                raise ValueError(f"chain of {n} stages: {name} has {got} entries, expected {want}")
        for name in ("fwd_s", "bwd_s", "x_bytes", "xbar_bytes", "ftmp_bytes", "btmp_bytes"):
            if np.any(np.asarray(getattr(self, name)) < 0):
                raise ValueError(f"chain: {name} has a negative entry")
        short = np.nonzero(self.xbar_bytes[1:] < self.x_bytes[1:])[0]
        if len(short):
            i = int(short[0])
            raise ValueError(f"chain stage {i}: keeps {int(self.xbar_bytes[i + 1])} bytes when recorded, "
                             f"less than its output a^{i + 1} ({int(self.x_bytes[i + 1])} bytes)")
        if self.stage_nodes and len(self.stage_nodes) != n:
            raise ValueError(f"chain of {n} stages has node lists for {len(self.stage_nodes)}")

    @classmethod
    def from_lists(cls, fwd_s, bwd_s, x_bytes, xbar_bytes, ftmp_bytes=None, btmp_bytes=None,
                   stage_nodes=(), const_bytes: int = 0) -> Chain:
        """A chain from plain sequences; temporaries default to 0, ``xbar_bytes`` may omit x̄_0."""
        n = len(fwd_s)
        xbar = list(xbar_bytes)
        if len(xbar) == n:
            xbar = [0, *xbar]
        return cls(
            fwd_s=np.asarray(fwd_s, dtype=float), bwd_s=np.asarray(bwd_s, dtype=float),
            x_bytes=np.asarray(x_bytes, dtype=np.int64), xbar_bytes=np.asarray(xbar, dtype=np.int64),
            ftmp_bytes=np.asarray(ftmp_bytes if ftmp_bytes is not None else [0] * n, dtype=np.int64),
            btmp_bytes=np.asarray(btmp_bytes if btmp_bytes is not None else [0] * n, dtype=np.int64),
            stage_nodes=tuple(tuple(s) for s in stage_nodes), const_bytes=int(const_bytes),
        )

    @property
    def num_stages(self) -> int:
        """n = L + 1, the loss stage included."""
        return len(self.fwd_s)

    @property
    def compute_s(self) -> float:
        """Forward plus backward time of one step without recomputation."""
        return float(self.fwd_s.sum() + self.bwd_s.sum())

    def nodes_of(self, first: int, last: int) -> list[str]:
        """Op node ids of stages first..last, in order."""
        return [nid for k in range(first, last + 1) for nid in self.stage_nodes[k]] if self.stage_nodes else []
