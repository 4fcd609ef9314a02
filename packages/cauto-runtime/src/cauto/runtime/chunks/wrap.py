"""``wrap``: build a model, pack its state into chunks, return (model, optimizer) for a plain loop.

    model, opt = wrap(lambda: MyModel(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                      device_budget="8GiB")
    for batch in data:
        loss = model(*batch)
        opt.backward(loss)          # or loss.backward() outside fp16
        opt.step()
        opt.zero_grad()

The optimizer factory is only read (its class, Adam or AdamW, and its parameter groups with their
lr, betas, eps, weight_decay); it allocates no state. The first iteration is the warm-up.

``chunk_module`` is the entry point for the plan runtime: it chunks only the named parameters of
an already built module (those whose plan state is "chunked"), ZeRO-sharded over the given
data-parallel process group, and leaves every other parameter to the caller.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from cauto.plan.chunking import default_chunk_elems
from cauto.plan.units import parse_bytes

from .chunk import build_layout
from .manager import ChunkManager
from .model import ChunkedModel
from .optim import ChunkedAdam

_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def _param_groups(model: nn.Module, optimizer, named) -> tuple[list[dict], list[list[int]], bool]:
    index = {id(p): i for i, (_, p) in enumerate(named)}
    if optimizer is None:
        groups, decoupled = [{"params": [p for _, p in named], **_DEFAULTS}], True
    else:
        opt = optimizer(model) if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer) \
            else optimizer
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(f"chunked training supports torch.optim.Adam and AdamW, got {type(opt).__name__}")
        if any(g.get("amsgrad") for g in opt.param_groups):
            raise ValueError("amsgrad is not supported by chunked training")
        groups, decoupled = opt.param_groups, isinstance(opt, torch.optim.AdamW)
    members, seen = [], set()
    groups = [g for g in groups if any(id(p) in index for p in g["params"])]
    for g in groups:
        ids = [index[id(p)] for p in g["params"] if id(p) in index]
        seen.update(ids)
        members.append(sorted(ids))
    missing = [named[i][0] for i in range(len(named)) if i not in seen]
    if missing:
        raise ValueError(f"parameters {missing[:5]} are in no optimizer parameter group; chunked training "
                         "updates every parameter: add them to a group (frozen parameters are not supported)")
    hyper = [{k: (g[k] if k in g else _DEFAULTS[k]) for k in _DEFAULTS} for g in groups]
    return hyper, members, decoupled


def wrap(model_fn: Callable[[], nn.Module], optimizer=None, device_budget: int | str = "8GiB", *,
         device: str | torch.device | None = None, **options) -> tuple[ChunkedModel, ChunkedAdam]:
    """Build ``model_fn()`` (a module, or a ``(module, inputs)`` pair as the zoo returns), move its
    buffers to the device and chunk all its parameters; return ``(chunked model, chunked optimizer)``
    that keep device memory for model state plus non-model memory within ``device_budget``.
    ``options`` are those of :func:`chunk_module`."""
    built = model_fn()
    model = built[0] if isinstance(built, tuple) else built
    device = _resolve_device(device)
    with torch.no_grad():
        for b in model.buffers():
            b.data = b.data.to(device)
    return chunk_module(model, optimizer, device_budget, device=device, **options)


def _resolve_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def chunk_module(module: nn.Module, optimizer=None, device_budget: int | str = "8GiB", *,
                 params: list[str] | None = None, device: str | torch.device | None = None,
                 compute_dtype: torch.dtype = torch.float32, chunk_elems: int | None = None,
                 max_grad_norm: float | None = None, loss_scale: float | None = None, process_group=None,
                 warmup_arena_fraction: float | None = None, policy: str = "belady",
                 average_grads: bool = True, module_hooks: bool = True) -> tuple[ChunkedModel, ChunkedAdam]:
    """Put the parameters of ``module`` named in ``params`` (default: all) into chunks, in place;
    return ``(chunked model, chunked optimizer)``. Other parameters and buffers are left alone
    (their device and optimizer are the caller's). Parameters must be plain tensors (not DTensor).

    ``optimizer``: a factory ``module -> torch.optim.Adam/AdamW`` (read for its class and groups;
    groups are restricted to the chunked parameters). ``device_budget``: bytes (int or "8GiB") of
    device memory for chunks plus non-model memory. ``device``: "cuda" when available, else "cpu"
    (a simulated device arena). ``compute_dtype``: fp32, bf16 or fp16 parameters for forward and
    backward (fp32 master, grads, Adam state); fp16 uses loss scaling (``loss_scale``, default
    2**16, dynamic) through ``optimizer.backward``. ``chunk_elems``: chunk size; by default the size
    with least padding found by search. ``max_grad_norm``: clip the global gradient norm in every
    ``step``. ``process_group``: ZeRO over this group (default: the world group when
    torch.distributed is initialized with >1 ranks). ``warmup_arena_fraction``: share of the budget
    chunks may use in the warm-up iteration, before the non-model peak is known: by default 0.5 on
    CUDA, 1.0 on the simulated CPU device (where activations do not live in the arena).
    ``policy``: "belady" (default), "lru" (ablation) or "naive", the ZeRO-Offload-like reference
    (see :class:`~.manager.ChunkManager`). ``average_grads``: the ZeRO reduce-scatter averages the
    ranks' gradients (each rank's loss is of its own batch slice) or, False, sums them (each rank
    holds a Partial share of the global loss's gradient). ``module_hooks``: fetch chunks in module
    forward hooks; False when a program calls ``ChunkedModel.run``/``fetch``/``release`` instead.
    """
    device = _resolve_device(device)
    if process_group is None and dist.is_initialized() and dist.get_world_size() > 1:
        process_group = dist.group.WORLD
    world_size = dist.get_world_size(process_group) if process_group is not None else 1
    budget = parse_bytes(device_budget)
    if warmup_arena_fraction is None:
        warmup_arena_fraction = 0.5 if device.type == "cuda" else 1.0
    named = list(module.named_parameters())
    if params is not None:
        unknown = sorted(set(params) - {n for n, _ in named})
        if unknown:
            raise ValueError(f"parameters {unknown[:5]} named for chunking are not parameters of the module "
                             "(names as in module.named_parameters(), tied parameters under their first name)")
        named = [(n, p) for n, p in named if n in set(params)]
    hyper, members, decoupled = _param_groups(module, optimizer, named)
    if chunk_elems is None:
        numels = [[named[i][1].numel() for i in m] for m in members]
        per_elem = compute_dtype.itemsize + 4  # a param chunk and its grad chunk
        chunk_elems = default_chunk_elems(numels, world_size, budget, per_elem)
    layout = build_layout(named, members, chunk_elems, world_size)
    manager = ChunkManager(layout, compute_dtype, device, budget, int(budget * warmup_arena_fraction),
                           process_group, policy, average_grads)
    with torch.no_grad():
        for _, p in named:
            p.data = p.data.to(compute_dtype)
        manager.init_from_params()
    if compute_dtype != torch.float16:
        loss_scale = None
    elif loss_scale is None:
        loss_scale = 2.0**16
    chunked = ChunkedModel(module, manager, layout, module_hooks)
    return chunked, ChunkedAdam(chunked, hyper, decoupled, max_grad_norm, loss_scale)


def save_checkpoint(optimizer: ChunkedAdam, directory: str) -> str:
    """Write this rank's shard (``rank{r}.pt``) of model and optimizer state; return its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{optimizer.manager.rank}.pt")
    torch.save(optimizer.state_dict(), path)
    return path


def load_checkpoint(optimizer: ChunkedAdam, directory: str) -> None:
    """Load this rank's shard written by :func:`save_checkpoint` (same world size and layout)."""
    path = os.path.join(directory, f"rank{optimizer.manager.rank}.pt")
    optimizer.load_state_dict(torch.load(path, weights_only=True))
