"""Build the model without its weights and give each rank only its own shards.

``build_skeleton(fn)`` calls the factory on the CPU with every parameter moved to the meta device as
it is registered (each constructor tensor lives only for a moment), so buffers keep their real
values (rotary tables, BatchNorm statistics) while parameters cost nothing.

``materialize`` then walks the modules in registration order and, per module, allocates its own
parameters in full, initializes them, keeps this rank's shard and frees the full tensor: peak
host memory is one module's own parameters, never the model.

Initialization with a seed equals ``torch.manual_seed(seed); fn()`` on one device exactly when
every parameter belongs to a module whose ``reset_parameters()`` initializes it (torch's built-in
layers), modules are constructed in the order they are registered, and the constructor draws no
other random numbers: true for the plain zoo models (mlp, cnn, gpt, llama). A parameter of a module
without ``reset_parameters`` keeps its constructor value when that value is a constant fill
(e.g. ``torch.ones``); Hugging Face models are initialized by their own ``_init_weights`` rules
per module (same distributions as a single-device build, not the same numbers). For exact values
in every case, pass ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from cauto.runtime.dist_utils import local_slices, to_placements


def build_skeleton(fn: Callable) -> tuple[nn.Module, object, dict[int, float | None]]:
    """Call the factory with parameters on meta and buffers real; return (model, inputs, fills).

    ``fills`` maps id(meta parameter) -> the constant its constructor filled it with (None if not constant).
    """
    fills: dict[int, float | None] = {}
    original = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            data = param.detach()
            flat = data.reshape(-1)
            fill = float(flat[0]) if flat.numel() and bool((flat == flat[0]).all()) else None
            param = nn.Parameter(data.to("meta"), requires_grad=param.requires_grad)
            fills[id(param)] = fill
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        model, inputs = fn()
    finally:
        nn.Module.register_parameter = original
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.device.type != "meta" and id(p) not in fills:
            raise RuntimeError(f"parameter {name!r} was not registered through nn.Module; cannot build it lazily")
    return model, inputs, fills


def shard_of(full: torch.Tensor, mesh: DeviceMesh, placements: str) -> DTensor:
    """This rank's shard of ``full`` as a DTensor (a copy: ``full`` can be freed right after)."""
    target = to_placements(placements)
    if any(not p.is_shard() and not p.is_replicate() for p in target):
        raise ValueError(f"parameters and buffers cannot be stored Partial ({placements}); use R or S(d)")
    index = local_slices(tuple(full.shape), target, mesh)
    local = full[index].to(mesh.device_type, copy=True).contiguous()
    return DTensor.from_local(local, mesh, target, run_check=False, shape=full.shape, stride=full.stride())


def _init_fn(root: nn.Module, module: nn.Module) -> Callable[[], None] | None:
    hf_init = getattr(root, "_init_weights", None)
    if hf_init is not None and hasattr(root, "config"):
        return lambda: hf_init(module)
    if hasattr(module, "reset_parameters"):
        return module.reset_parameters
    return None


def materialize(model: nn.Module, fills: dict[int, float | None], mesh: DeviceMesh,
                placements: dict[str, str], *, seed: int | None = None,
                state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, nn.Parameter]:
    """Replace every meta parameter of ``model`` by an ``nn.Parameter(DTensor)`` with ``placements[fqn]``.

    With ``state_dict`` each full tensor is taken from it (tied parameters: either name); otherwise
    it is initialized as the module docstring says, after ``torch.manual_seed(seed)`` (the global RNG
    is restored afterwards). Buffers become replicated DTensors (from ``state_dict`` when given).
    Returns fqn -> parameter (tied parameters appear under every name, as one object).
    """
    done: dict[int, nn.Parameter] = {}
    result: dict[str, nn.Parameter] = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        for prefix, module in model.named_modules():
            own = [(n, p) for n, p in module._parameters.items() if p is not None]
            if not own:
                continue
            fresh = {}
            for name, p in own:
                fqn = f"{prefix}.{name}" if prefix else name
                if id(p) in done:
                    continue
                if p.device.type != "meta":
                    fresh[name] = (fqn, p, p.detach())
                    continue
                full = torch.empty(p.shape, dtype=p.dtype)
                if state_dict is not None:
                    full.copy_(_lookup(state_dict, fqn, model, p))
                fresh[name] = (fqn, p, full)
            if state_dict is None and any(p.device.type == "meta" for _, p, _ in fresh.values()):
                _initialize(model, module, own, fresh, fills)
            for fqn, p, full in fresh.values():
                key = _placement_key(placements, fqn, model, p)
                param = nn.Parameter(shard_of(full, mesh, placements[key]), requires_grad=p.requires_grad)
                done[id(p)] = param
            for name, p in own:
                module._parameters[name] = done[id(p)]
                result[f"{prefix}.{name}" if prefix else name] = done[id(p)]
            del fresh
        for prefix, module in model.named_modules():
            for name, b in list(module._buffers.items()):
                if b is None or isinstance(b, DTensor):
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                if state_dict is not None and fqn in state_dict:
                    b = state_dict[fqn].to(b.dtype)
                if b.device.type == "meta":
                    raise RuntimeError(f"buffer {fqn!r} was created on the meta device by the model's constructor; "
                                       "create it without a device argument, or pass state_dict")
                module._buffers[name] = DTensor.from_local(b.to(mesh.device_type), mesh, [Replicate()] * mesh.ndim,
                                                           run_check=False)
    return result


def _initialize(root, module, own, fresh, fills) -> None:
    """Run the module's initializer on real full tensors (tied ones get scratch space, then dropped)."""
    saved = dict(module._parameters)
    for name, p in own:
        tensor = fresh[name][2] if name in fresh else torch.empty(p.shape, dtype=p.dtype)
        module._parameters[name] = nn.Parameter(tensor, requires_grad=p.requires_grad)
    init = _init_fn(root, module)
    try:
        if init is not None:
            init()
        else:
            for fqn, p, full in fresh.values():
                fill = fills.get(id(p))
                if fill is None:
                    raise RuntimeError(
                        f"cannot initialize parameter {fqn!r} on each rank: {type(module).__name__} has no "
                        "reset_parameters() and its constructor value is not a constant; add reset_parameters() "
                        "to the module or pass state_dict= to apply")
                full.fill_(fill)
    finally:
        for name, _ in own:
            module._parameters[name] = saved[name]


def _lookup(state_dict, fqn, model, p):
    if fqn in state_dict:
        return state_dict[fqn]
    for other, q in model.named_parameters(remove_duplicate=False):
        if q is p and other in state_dict:
            return state_dict[other]
    raise KeyError(f"state_dict has no entry for parameter {fqn!r}")


def _placement_key(placements, fqn, model, p) -> str:
    if fqn in placements:
        return fqn
    for other, q in model.named_parameters(remove_duplicate=False):
        if q is p and other in placements:
            return other
    raise KeyError(f"the plan gives no placement for parameter {fqn!r} (plan.params)")
