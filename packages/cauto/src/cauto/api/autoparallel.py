"""autoparallelize(): profile -> solve -> apply, with the plan cached by fingerprint and cluster.

The model factory is called on the meta device (nothing is allocated) for capture and profiling;
only the runtime materializes parameters, and each rank only its own shards. In a distributed job
rank 0 profiles and solves, then sends the plan's JSON text to the other ranks (plain bytes, no
pickle); the solver is deterministic, so a cached plan is the same on every host.

Quiet by default. ``progress=True`` draws the profiling and planning bars of the `cauto` command
on stderr (cauto.cli.progress), on rank 0 only since only rank 0 profiles and solves; a callable
``progress(phase, done, total)`` receives the same calls instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cauto.api.plan_cache import PlanCache
from cauto.plan import dumps, parse
from cauto.plan.execution import DTYPE_NAMES
from cauto.plan.options import PlanOptions
from cauto.plan.units import ByteSizeError, parse_bytes
from cauto.profiler import capture, profile
from cauto.solver import plan as solve_plan
from cauto.solver.cluster import HardwareSpec, cluster_for_mesh
from cauto.solver.errors import SolverError
from cauto.solver.planning import plan_options as solver_plan_options


def _as_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, dict):
        return {k: _as_meta(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_as_meta(v) for v in value)
    return value


def factory_of(model_fn: Callable[[], torch.nn.Module], example_inputs) -> Callable:
    """A cauto factory ``() -> (model, inputs)`` from a model builder and example inputs (shapes only)."""

    def fn():
        return model_fn(), _as_meta(example_inputs)

    fn.__name__ = getattr(model_fn, "__name__", "model")
    return fn


def _mesh_of(mesh: DeviceMesh | Sequence[int] | str, axis_names: Sequence[str] | None) -> tuple[tuple, tuple | None]:
    if isinstance(mesh, DeviceMesh):
        return tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else axis_names
    if isinstance(mesh, str):
        from cauto.solver.cluster import parse_mesh

        return parse_mesh(mesh), axis_names
    return tuple(int(s) for s in mesh), axis_names


def _budget(memory_budget: int | str | None) -> int | None:
    if memory_budget is None or isinstance(memory_budget, int):
        return memory_budget
    try:
        return parse_bytes(memory_budget)
    except ByteSizeError as exc:
        raise SolverError(str(exc)) from None


def plan_options(*, memory_budget: int | str | None = None, checkpoint: str = "none", offload: str = "none",
                 offload_axes: Sequence[int] | None = None, time_limit_s: float = 60.0,
                 mixed_precision: str = "none", reduce_dtype: str = "fp32") -> PlanOptions:
    """The PlanOptions of the API's keyword arguments (``memory_budget`` in bytes or a size like "70GiB");
    a bad one raises SolverError naming it."""
    return solver_plan_options(memory_budget=_budget(memory_budget), checkpoint=checkpoint, offload=offload,
                               offload_axes=None if offload_axes is None else tuple(offload_axes),
                               time_limit_s=time_limit_s, mixed_precision=mixed_precision,
                               reduce_dtype=reduce_dtype)


def profiled_autocast(options: PlanOptions) -> str | None:
    """The profiler's ``autocast`` for ``options``: a bf16 plan is profiled under the autocast it runs under."""
    return None if options.mixed_precision == "none" else options.mixed_precision


def plan_for(fn: Callable, mesh_shape: Sequence[int], options: PlanOptions | None = None, *,
             axis_names: Sequence[str] | None = None, hardware: str | HardwareSpec = "cpu-gloo",
             memory_budget: int | str | None = None, optimizer: str = "adamw", device: str = "cpu",
             checkpoint: str = "none", offload: str = "none", offload_axes: Sequence[int] | None = None,
             cache: PlanCache | None = None, time_limit_s: float = 60.0, verbose: bool = False,
             progress: bool | Callable[[str, int, int], None] = False, mixed_precision: str = "none",
             reduce_dtype: str = "fp32") -> dict:
    """Profile ``fn`` and solve a plan for ``mesh_shape`` (or take it from ``cache``); return the plan dict.

    ``checkpoint``: "none", or activation checkpointing solved jointly with the sharding ("auto",
    "rotor", "chen"; see cauto.solver.plan). ``offload``: "none"; "auto" (model state in chunks,
    moved between device and host, only where no device-only plan fits the budget); "chunked"
    (always). ``offload_axes``: the mesh axes the chunks are ZeRO-sharded over, the others left to
    tensor parallelism (default: the solver tries every axis and each axis alone, fastest wins).
    ``mixed_precision``: "none" or "bf16" (profiled and run under bf16 autocast, fp32 master weights and
    optimizer state; ``reduce_dtype`` "fp32" or "bf16" for the gradient reductions).
    ``options``: a PlanOptions instead of the keywords ``memory_budget``, ``checkpoint``, ``offload``,
    ``offload_axes``, ``time_limit_s``, ``mixed_precision`` and ``reduce_dtype`` (``plan_options`` builds
    one from them).
    ``progress``: module docstring."""
    cluster = cluster_for_mesh(hardware, tuple(mesh_shape), tuple(axis_names) if axis_names else None)
    if options is None:
        options = plan_options(memory_budget=memory_budget, checkpoint=checkpoint, offload=offload,
                               offload_axes=offload_axes, time_limit_s=time_limit_s,
                               mixed_precision=mixed_precision, reduce_dtype=reduce_dtype)
    autocast = profiled_autocast(options)
    cap = capture(fn, device=device, autocast=getattr(torch, DTYPE_NAMES[autocast]) if autocast else None)
    key = PlanCache.key(cap.fingerprint(), cluster.to_dict(),
                        {**options.to_dict(), "optimizer": optimizer, "device": device, "mesh": list(mesh_shape),
                         "axis_names": list(cluster.axis_names)})
    if cache is not None and (cached := cache.get(key)) is not None:
        if verbose:
            print(f"cauto: plan from cache {cache.path(key)}")
        return cached
    start = time.perf_counter()
    if progress is True:
        from cauto.cli.progress import plan_bars, profile_bars

        with profile_bars() as bars:
            graph = profile(fn, optimizer=optimizer, device=device, cap=cap, autocast=autocast,
                            progress=bars).to_graph()
        with plan_bars(options.time_limit_s) as bars:
            plan = solve_plan(graph, cluster, options, progress=bars)
    else:
        report = progress or None
        graph = profile(fn, optimizer=optimizer, device=device, cap=cap, autocast=autocast,
                        progress=report).to_graph()
        plan = solve_plan(graph, cluster, options, progress=report)
    if verbose:
        print(f"cauto: profiled and solved in {time.perf_counter() - start:.1f} s")
    if cache is not None:
        cache.put(key, plan)
    return plan


def _share_plan(plan: dict | None) -> dict:
    """Send rank 0's plan JSON to every rank as a byte tensor (no pickling)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return plan
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if dist.get_rank() == 0:
        payload = torch.frombuffer(bytearray(dumps(plan).encode()), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    if dist.get_rank() != 0:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, 0)
    return plan if dist.get_rank() == 0 else parse(bytes(payload.cpu().tolist()).decode())


def autoparallelize(model_fn: Callable[[], torch.nn.Module], example_inputs, mesh: DeviceMesh | Sequence[int] | str,
                    options: PlanOptions | None = None, *, memory_budget: int | str | None = None,
                    checkpoint: str = "none", offload: str = "none",
                    offload_axes: Sequence[int] | None = None, mixed_precision: str = "none",
                    reduce_dtype: str = "fp32",
                    hardware: str | HardwareSpec | None = None, axis_names: Sequence[str] | None = None,
                    optimizer: str = "adamw", cache_dir: str | None = None, use_cache: bool = True,
                    state_dict: dict | None = None, seed: int | None = None, verbose: bool = False,
                    progress: bool | Callable[[str, int, int], None] = False,
                    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
                    compile: bool = False,
                    timeout_s: float | None = 120.0):
    """Return ``model_fn()``'s model parallelized over ``mesh`` under ``memory_budget`` per device.

    ``example_inputs``: a tuple or dict of tensors (only shapes and dtypes are used); the returned
    module takes inputs of the same structure (by default the global batch on every rank).
    ``mesh``: a DeviceMesh (one is created from the shape when a shape is given and torch.distributed
    is initialized). ``memory_budget``: bytes or a string like "70GiB". ``hardware``: a preset
    ("cpu-gloo", "a100", "h100", "h200") or a calibrated spec file; default by the mesh's device.
    The plan and its predictions are ``model.plan`` and ``model.predictions``. ``progress=True``
    shows profiling and planning bars on rank 0's stderr (default: quiet; module docstring).
    ``offload``: "none", "auto" or "chunked", and ``offload_axes`` (``plan_for``). A plan with chunked
    state runs under the chunk manager (beside tensor parallelism where the plan has it), which owns the optimizer: pass ``make_optimizer`` (a factory ``module -> torch
    optimizer``; its class, Adam or AdamW, and parameter groups are read) and train through
    ``model.optimizer``, which is also set (the factory's optimizer) for a device-only plan.
    ``compile=True``: the plan's local program (forward and backward graphs with explicit collectives)
    is compiled by inductor; refused for plans with chunked state.
    ``mixed_precision="bf16"``: bf16 compute under autocast over fp32 master weights and optimizer state,
    gradients reduced in ``reduce_dtype`` ("fp32", default, or "bf16"), like FSDP2's
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``; profiled and planned
    under the same autocast, recorded in the plan (``execution.mixed_precision``), which the runtime
    reads. "fp16" is refused (it needs loss scaling). The model's outputs (the loss) come back as autocast
    leaves them; call ``backward()`` outside any autocast of your own.
    ``options``: a cauto.plan.PlanOptions instead of ``memory_budget``, ``checkpoint``, ``offload``,
    ``offload_axes``, ``mixed_precision`` and ``reduce_dtype``.
    ``timeout_s``: the collective timeout of the default group and the mesh's groups (a rank that dies or
    stalls makes the others fail after it instead of hanging; None leaves torch's, 30 min on gloo).
    """
    from cauto.runtime import apply
    from cauto.runtime.dist_utils import set_timeout

    shape, names = _mesh_of(mesh, axis_names)
    if not isinstance(mesh, DeviceMesh):
        device_type = "cuda" if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl" \
            else "cpu"
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=tuple(names) if names else None)
    if timeout_s is not None and dist.is_initialized():
        set_timeout(mesh, timeout_s)
    device = mesh.device_type
    hardware = hardware or ("h100" if device == "cuda" else "cpu-gloo")
    fn = factory_of(model_fn, example_inputs)
    plan = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        cache = PlanCache(cache_dir) if use_cache else None
        if options is None:  # the keyword arguments: a front that builds the PlanOptions
            options = plan_options(memory_budget=memory_budget, checkpoint=checkpoint, offload=offload,
                                   offload_axes=offload_axes, mixed_precision=mixed_precision,
                                   reduce_dtype=reduce_dtype)
        plan = plan_for(fn, shape, options, axis_names=names, hardware=hardware, optimizer=optimizer, device=device,
                        cache=cache, verbose=verbose, progress=progress)
    plan = _share_plan(plan)
    return apply(fn, plan, mesh, state_dict=state_dict, seed=seed, optimizer=make_optimizer, compile=compile)
