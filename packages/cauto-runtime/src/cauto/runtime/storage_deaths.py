"""``StorageDeaths``: when each storage that a training step's ops return is really freed, on any thread.

The torch profiler reports a free only on the thread that runs the profiler. In a gloo job a
collective's work object can hold the last reference to its input or output and drop it on a gloo
worker thread: that free has no event, and a peak measured from allocation events alone has to
guess its time (``cauto.runtime.verify.allocation_peak``). This dispatch mode watches every tensor an
op returns (a wrapper subclass's inner tensors: a DTensor's local tensor) and puts a weak reference on its storage. The
weak reference's callback runs when the storage is freed, whichever thread frees it, and records the
time on the profiler's clock (``time.time_ns``). ``allocation_peak`` then dates a free it did not see
at the death of the storage that lived at that address.

Only storages that an op returns are watched: a kernel's own scratch buffers are not, and keep the
profiler's dating.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class StorageDeaths(TorchDispatchMode):
    """Records ``(address, born_ns, died_ns)`` of every storage the ops under it return
    (``died_ns`` is None while it lives). Use as a context manager around the step."""

    def __init__(self) -> None:
        super().__init__()
        self._watched: dict[int, weakref.ref] = {}  # address -> weak reference of the live storage there
        self._born_ns: dict[int, int] = {}
        self.lives: list[tuple[int, int, int | None]] = []  # finished lives, then the living at ``lifetimes()``

    def _died(self, address: int, ref: weakref.ref) -> None:
        if self._watched.get(address) is ref:  # not a newer storage at the same address
            del self._watched[address]
            self.lives.append((address, self._born_ns.pop(address), time.time_ns()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._watch(t)
        return out

    def _watch(self, t: torch.Tensor) -> None:
        """Watch ``t``'s storage, or, for a wrapper subclass (DTensor), its inner tensors' (the ops on
        those run below this mode)."""
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._watch(inner)
            return
        if t.device.type != "cpu":
            return
        try:
            storage = t.untyped_storage()
            address = storage.data_ptr()
        except RuntimeError:  # a tensor without a storage of its own
            return
        if not address:
            return
        known = self._watched.get(address)
        if known is not None and known() is storage:
            return
        ref = weakref.ref(storage, lambda r, a=address: self._died(a, r))
        self._watched[address] = ref
        self._born_ns[address] = time.time_ns()

    def lifetimes(self) -> dict[int, list[tuple[int, int | None]]]:
        """address -> [(born_ns, died_ns or None), ...] in birth order."""
        out: dict[int, list[tuple[int, int | None]]] = {}
        living = [(a, self._born_ns[a], None) for a, r in list(self._watched.items()) if r() is not None]
        for address, born, died in sorted(self.lives + living, key=lambda x: x[1]):
            out.setdefault(address, []).append((born, died))
        return out
