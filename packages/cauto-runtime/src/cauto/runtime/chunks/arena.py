"""Device arena, host buffers and the copy engine that counts every byte moved.

The device budget is enforced physically: every chunk that lives on the device occupies a slot
carved from one preallocated arena tensor (first-fit over byte ranges). When no slot can be found
after evicting everything evictable, the allocation fails with :class:`BudgetError` instead of
silently growing. On CPU the arena is a separate ``uint8`` tensor standing in for device memory, so
the same code runs, moves real bytes and counts them. On CUDA the arena is device memory, host
buffers are pinned, and copies run on a side stream that the compute stream waits on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN_BYTES = 64


class BudgetError(RuntimeError):
    """Raised when chunks that must be on the device at once do not fit in the device arena."""


def _align(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class Arena:
    """One preallocated device tensor; slots are byte ranges handed out first-fit."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = _align(max(nbytes, 0))
        self.device = device
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)] if self.nbytes else []
        self.used_bytes = 0
        self.peak_used_bytes = 0

    def alloc(self, nbytes: int) -> int | None:
        """Return the byte offset of a free slot of ``nbytes`` (aligned), or None when none fits."""
        need = _align(nbytes)
        for i, (start, end) in enumerate(self._free):
            if end - start >= need:
                if end - start == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, end)
                self.used_bytes += need
                self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return a slot to the free list, merging neighbours."""
        need = _align(nbytes)
        self.used_bytes -= need
        self._free.append((offset, offset + need))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, end in self._free:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((start, end))
        self._free = merged

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A typed 1-D view of ``numel`` elements at byte ``offset``."""
        size = numel * dtype.itemsize
        return self.buffer[offset: offset + size].view(dtype)


@dataclass
class TrafficCounter:
    """Bytes and copies between host and device since the last reset."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0
    comm_bytes: int = 0

    @property
    def moved_bytes(self) -> int:
        """Host-to-device plus device-to-host bytes."""
        return self.h2d_bytes + self.d2h_bytes

    def reset(self) -> None:
        """Zero every counter."""
        self.h2d_bytes = self.d2h_bytes = self.h2d_copies = self.d2h_copies = self.comm_bytes = 0

    def to_dict(self) -> dict:
        """The counters as a JSON-ready dict."""
        return {"h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "h2d_copies": self.h2d_copies,
                "d2h_copies": self.d2h_copies, "moved_bytes": self.moved_bytes, "comm_bytes": self.comm_bytes}


class Mover:
    """Copies between host buffers and arena slots; on CUDA through a side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.traffic = TrafficCounter()
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer (pinned on CUDA so copies can be asynchronous)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    def to_device(self, src_host: torch.Tensor, dst_dev: torch.Tensor):
        """Copy a host buffer into a device slot; returns a CUDA event to wait on before use (or None)."""
        self.traffic.h2d_bytes += src_host.numel() * src_host.element_size()
        self.traffic.h2d_copies += 1
        if not self.cuda:
            dst_dev.copy_(src_host)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst_dev.copy_(src_host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def to_host(self, src_dev: torch.Tensor, dst_host: torch.Tensor) -> None:
        """Copy a device slot to a host buffer; returns once the host buffer is valid."""
        self.traffic.d2h_bytes += src_dev.numel() * src_dev.element_size()
        self.traffic.d2h_copies += 1
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dst_host.copy_(src_dev, non_blocking=True)
            self.stream.synchronize()
        else:
            dst_host.copy_(src_dev)
