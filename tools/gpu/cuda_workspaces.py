"""The cuBLAS workspaces a CUDA process holds once its first matmuls ran: measured, so that GPU checks
can report peaks with and without them (the profiler models the model's memory, not these)."""

from __future__ import annotations

import torch


def warm_cuda_workspaces() -> int:
    """Run one matmul (forward and backward) per dtype so cuBLAS allocates its workspaces; return the
    bytes then allocated."""
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(256, 256, device="cuda", dtype=dt, requires_grad=True)
        (a @ a).sum().backward()
        del a
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()
