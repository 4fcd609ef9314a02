"""Plans with chunked model state: the model as written, its parameters in the chunk manager.

``apply`` hands a plan here when its ``execution.mode`` is ``"chunk_manager"`` (the solver's
``offload``, see cauto-solver's offload/ and cauto.plan.execution). What runs is pure data parallelism, the case the solver plans:

* every trainable parameter is chunked (state "chunked", Replicate on every mesh axis) and its
  value, gradient and Adam state live in ``cauto.runtime.chunks``: ``chunk_module`` with the plan's
  ``offload.device_budget_bytes`` and ``offload.chunk_elems``, ZeRO-sharded over the data-parallel
  group of the plan's ``offload.mesh_axes`` (all of them: the world group), on the mesh's device
  (CUDA, or the simulated device arena on CPU);
* the model runs as written (no FX program, no DTensor) on this rank's slice of the batch: every
  user input Shard(0) on every mesh axis of size > 1 (``local_slices``), or Replicate (whole);
* no redistribution edges, no checkpoint regions (a plan with regions runs as a program:
  chunks/in_program.py).

On the CPU the device is simulated (an arena tensor in host memory): there the chunk manager gets
the plan's ``offload.simulated_device_budget_bytes`` (the budget capped at what the chunks could
ever fill, cauto.plan.execution), which changes no result.

Anything else (host state, chunked and device parameters mixed, tensor-parallel placements, edges)
raises ``PlanMismatchError`` saying what to do.

The model is built on the CPU from the shared seed (``torch.manual_seed(seed); fn()``, the
single-device initial state) or loaded from ``state_dict``; host memory holds it once before the
chunks take it over. Chunks train in fp32.

Loss. The forward returns a loss whose value is the plan's global loss and whose gradient is this
rank's: ``local + (all_reduce(local) / W − local).detach()`` for a mean-reduced loss (the mean of
equal slices' means is the global mean; the chunk manager's reduce-scatter averages the gradients
over the group), and ``W · local + (all_reduce(local) − W · local).detach()`` for a loss the plan
marks Partial(sum) (a sum over the batch), so that the averaged gradients are the sum's.

Loop (``model.optimizer`` is the :class:`~cauto.runtime.chunks.ChunkedAdam`, built from the
``optimizer`` factory given to ``apply``: its class, Adam or AdamW, and parameter groups are read)::

    model = apply(fn, plan, mesh, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    opt = model.optimizer
    for batch in data:
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()

Do not build a torch optimizer over ``model.parameters()``: those are views into chunks that move.
Checkpoints: ``cauto.runtime.chunks.save_checkpoint(model.optimizer, directory)`` (rank shards).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cauto.plan import PlanDocument
from cauto.profiler.capture import Capture, loss_of
from cauto.runtime.chunks.model import ChunkedModel
from cauto.runtime.chunks.optim import ChunkedAdam
from cauto.runtime.chunks.wrap import chunk_module
from cauto.runtime.dist_utils import local_slices, to_placements
from cauto.runtime.errors import PlanMismatchError
from cauto.runtime.inputs import flat_inputs


def mismatch(message: str) -> PlanMismatchError:
    """The error a chunked plan that cannot run raises (message: what to change)."""
    return PlanMismatchError(message)


def chunked_targets(plan: PlanDocument) -> list[str]:
    """Names of the parameters whose plan state is "chunked" (tied ones under every name)."""
    return [e["target"] for e in plan.params.values() if e.get("state", "device") == "chunked"]


def refuse_host_state(plan: PlanDocument) -> None:
    """Raise PlanMismatchError for what no chunked plan runs: host state without chunks."""
    host = [e["target"] for e in plan.params.values() if e.get("state") == "host"]
    if host:
        raise mismatch(f"the plan keeps {len(host)} parameters on the host without chunks (first: {host[0]!r}); "
                        "the runtime runs chunked state only: solve with --offload chunked or auto")


def refuse_frozen_chunks(plan: PlanDocument, model: nn.Module) -> None:
    """Raise PlanMismatchError for a frozen parameter the plan chunks (the solver keeps frozen ones on the
    device: they have no gradient and no optimizer state to page)."""
    chunked = set(chunked_targets(plan))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and n in chunked]
    if frozen:
        raise mismatch(f"the plan chunks the frozen parameter {frozen[0]!r}; frozen parameters stay on the device "
                        "(no gradient, no optimizer state): the plan is of another model, solve again for this one")


def check_chunked(cap: Capture, plan: PlanDocument, model: nn.Module) -> None:
    """Raise PlanMismatchError unless ``plan`` is pure data parallelism with every trainable parameter chunked
    (frozen ones stay on the device, replicated, as the model has them)."""
    refuse_host_state(plan)
    refuse_frozen_chunks(plan, model)
    chunked = set(chunked_targets(plan))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    left = [n for n in trainable if n not in chunked]
    if left:
        raise mismatch(
            f"the plan chunks {len(chunked)} parameters but keeps {len(left)} on the device (first: {left[0]!r}); apply "
            "runs chunked state only when every trainable parameter is chunked (pure data parallelism): solve with "
            "--offload chunked (or auto), or with --offload none for a plan without chunks")
    bad = [e["target"] for e in plan.params.values()
           if e.get("state") == "chunked" and any(p != "R" for p in e["placements"])]
    if bad:
        raise mismatch(f"chunked parameter {bad[0]!r} is not Replicate on every mesh axis; chunked state is "
                        "ZeRO-sharded by the chunk manager itself: the plan is malformed, solve again")
    if plan.edges:
        e = plan.edges[0]
        raise mismatch(f"the plan redistributes activations ({len(plan.edges)} edges, first {e['src']} -> {e['dst']}); "
                        "with chunked state the model runs as written on each rank's batch slice: solve again with "
                        "--offload chunked, which plans pure data parallelism")
    if plan.checkpoint and plan.checkpoint.get("regions"):
        raise mismatch("the plan has checkpoint regions but execution.mode \"chunk_manager\", which runs the model "
                        "as written: the solver gives a plan with regions and chunks execution.mode \"program\"; "
                        "solve again")
    if plan.offload is None:
        raise mismatch("the plan marks parameters \"chunked\" but has no offload section; solve again with "
                        "--offload chunked")
    axes = list(plan.offload.get("mesh_axes", range(len(plan.mesh["shape"]))))
    if sorted(axes) != list(range(len(plan.mesh["shape"]))):
        raise mismatch(f"the plan runs the model as written (execution.mode \"chunk_manager\") but ZeRO-shards its "
                        f"chunks over mesh axes {axes} only; the model as written ZeRO-shards over the whole mesh. "
                        "Chunks over a subset of the axes run as a DTensor program: solve again (the solver gives "
                        "such plans execution.mode \"program\"), or set the mode to \"program\"")
    mesh = plan.mesh["shape"]
    for node in cap.graph.nodes:
        if node.op != "placeholder" or cap.placeholders[node.name][0] != "input":
            continue
        pl = tuple(plan.nodes[node.name]["outputs"][0])
        split = tuple("S(0)" if n > 1 else "R" for n in mesh)
        if pl not in (split, ("R",) * len(mesh)):
            raise mismatch(f"input {cap.placeholders[node.name][1]!r} is placed {list(pl)}; with chunked state an "
                            f"input is split on its batch dim over the whole mesh ({list(split)}) or replicated")
        shape = tuple(node.meta["val"].shape)
        world = 1
        for n in mesh:
            world *= n
        if pl == split and (not shape or shape[0] % world):
            raise mismatch(f"input {cap.placeholders[node.name][1]!r} has batch {shape[:1]}, which does not split "
                            f"evenly over {world} ranks; use a batch divisible by {world}")


def _loss_is_sum(cap: Capture, plan: PlanDocument) -> bool:
    out = next(n for n in cap.graph.nodes if n.op == "output")
    first = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    entry = plan.nodes.get(getattr(first, "name", ""), {})
    outs = entry.get("outputs") or [[]]
    return any(p == "P(sum)" for p in outs[0])


class ChunkedParallelModule(nn.Module):
    """The model on this rank, its parameters in chunks (module docstring); call it like ParallelModule.

    ``save(D, step)`` / ``load(D)`` checkpoint and resume training (training_state.py).
    Attributes: ``optimizer`` (ChunkedAdam: ``step``, ``zero_grad``, ``clip_grad_norm_``), ``chunked``
    (the ChunkedModel), ``manager`` (the ChunkManager: ``traffic``, ``arena``), ``plan``, ``mesh``, ``capture``.
    """

    def __init__(self, chunked: ChunkedModel, optimizer: ChunkedAdam, cap: Capture, plan: PlanDocument,
                 mesh: DeviceMesh, device: torch.device, process_group):
        super().__init__()
        self.chunked = chunked
        self.__dict__["capture"] = cap
        self.optimizer = optimizer
        self.plan = plan
        self.mesh = mesh
        self.device = device
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if process_group is not None else 1
        self.loss_is_sum = _loss_is_sum(cap, plan)
        self._input_names = [name for name, (kind, _) in cap.placeholders.items() if kind == "input"]
        self._kwarg_order = list(cap.kwargs)
        self._inputs = [n for n in cap.graph.nodes if n.op == "placeholder" and cap.placeholders[n.name][0] == "input"]

    @property
    def manager(self):
        """The chunk manager (where every chunk is; ``manager.mover.traffic`` counts the bytes moved)."""
        return self.chunked.manager

    @property
    def predictions(self) -> dict:
        """The plan's predictions (peak bytes, step time, collectives per step)."""
        return self.plan.predictions

    @property
    def generated_code(self) -> str:
        """What runs, in words: there is no generated program with chunked state."""
        off = self.plan.offload or {}
        return (f"# chunked plan: the model runs as written on this rank's batch slice; its parameters live in "
                f"{off.get('num_chunks', '?')} chunks of {off.get('chunk_elems', '?')} elements, ZeRO-sharded over "
                f"{self.world_size} ranks, device budget {off.get('device_budget_bytes', '?')} B\n")

    def no_sync(self):
        """Not available with chunked state: the chunk manager reduce-scatters every backward's gradients."""
        raise NotImplementedError("no_sync() with chunked parameter state: the chunk manager reduce-scatters every "
                                  "backward's gradients into its chunks; accumulate with a larger batch, or plan with "
                                  "--offload none")

    def save(self, directory, step: int = 0):
        """Checkpoint the chunked weights, Adam state, ``step`` and RNG states under ``directory`` (each rank
        writes the chunks it owns, under a device-only plan's keys: chunks/checkpoint.py); every rank calls it."""
        from cauto.runtime import training_state
        return training_state.save(self, directory, step, self.optimizer)

    def load(self, directory) -> int:
        """Load the latest complete checkpoint under ``directory`` (of any plan of this model, any mesh) in
        place; return the step it was saved at."""
        from cauto.runtime import training_state
        return training_state.load(self, directory, self.optimizer)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the chunked gradients to global norm ``max_norm``; return the norm before clipping (clip.py)."""
        from cauto.runtime.clip import clip_grad_norm_
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def batch_slice(self, uneven: str = "raise"):
        """Which slice of the global batch this rank loads: a ``cauto.runtime.data.BatchSlice`` (``index`` of
        ``count`` over the plan's data-parallel axes: a DistributedSampler's ``rank`` and ``num_replicas``).
        ``uneven="whole"``: the whole batch when the plan has no single slice (``data.batch_slice``)."""
        from cauto.runtime.data import batch_slice
        return batch_slice(self.capture, self.plan, self.mesh, uneven)

    def input_slices(self) -> dict[str, tuple[slice, ...]]:
        """Per user input: the slice of the global batch this rank uses (what local-batch mode passes)."""
        out = {}
        for node in self._inputs:
            placements = to_placements(tuple(self.plan.nodes[node.name]["outputs"][0]))
            out[self.capture.placeholders[node.name][1]] = local_slices(tuple(node.meta["val"].shape), placements,
                                                                        self.mesh)
        return out

    def _local(self, flat: list) -> list:
        slices = self.input_slices()
        out = []
        for node, x in zip(self._inputs, flat):
            name = self.capture.placeholders[node.name][1]
            if torch.is_tensor(x):
                full = tuple(node.meta["val"].shape)
                local = tuple(s.stop - s.start for s in slices[name])
                if tuple(x.shape) == full and full != local:
                    x = x[slices[name]]
                elif tuple(x.shape) != local:
                    raise ValueError(f"input {name!r} has shape {tuple(x.shape)}; expected the global batch {full} "
                                     f"or this rank's slice {local}")
                x = x.to(self.device)
            out.append(x)
        return out

    def forward(self, *args, **kwargs) -> torch.Tensor:
        constants = self.capture.constants
        local = iter(self._local(flat_inputs(args, kwargs, self._kwarg_order, self._input_names, constants)))
        local_args = [v if i in constants else next(local) for i, v in enumerate(args)]
        local_kwargs = {k: kwargs[k] if k in constants else next(local) for k in self._kwarg_order if k in kwargs}
        loss = loss_of(self.chunked(*local_args, **local_kwargs))
        w = self.world_size
        if w == 1:
            return loss
        scaled = loss * w if self.loss_is_sum else loss
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.process_group)
        value = total if self.loss_is_sum else total / w
        return scaled + (value - scaled.detach())


def device_budget_bytes(plan: PlanDocument, device: torch.device) -> int:
    """The chunk manager's device budget as the plan gives it: ``offload.device_budget_bytes`` on a real
    device, ``offload.simulated_device_budget_bytes`` on the CPU's simulated one (cauto.plan.execution)."""
    key = "simulated_device_budget_bytes" if device.type == "cpu" else "device_budget_bytes"
    return int(plan.offload[key])


def apply_chunked(fn: Callable, cap: Capture, plan: PlanDocument, mesh: DeviceMesh, *, seed: int | None,
                  state_dict: dict[str, torch.Tensor] | None, optimizer: Callable | None) -> ChunkedParallelModule:
    """Build the model of ``fn`` and put it under the chunk manager as ``plan`` says (module docstring)."""
    with torch.device("cpu"):
        if seed is not None:
            torch.manual_seed(seed)
        model, _ = fn()
    model.train()
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
    check_chunked(cap, plan, model)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    with torch.no_grad():
        for b in model.buffers():
            b.data = b.data.to(device)
        for p in model.parameters():  # frozen: on the device as the model has them (chunked ones move below)
            if not p.requires_grad:
                p.data = p.data.to(device)
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    names = set(chunked_targets(plan))
    params = [n for n, _ in model.named_parameters() if n in names]
    chunked, opt = chunk_module(model, optimizer, device_budget_bytes(plan, device), params=params, device=device,
                                chunk_elems=int(plan.offload["chunk_elems"]), process_group=group)
    return ChunkedParallelModule(chunked, opt, cap, plan, mesh, device, group)


def chunk_report(module, inputs: tuple[tuple, dict]) -> dict:
    """One training step of a module with chunked state (ChunkedParallelModule, or a ParallelModule
    with chunked parameter shards) with the chunk manager's counters: predicted vs measured host link
    bytes, arena, non-model peak, chunks in use at once, and the collectives of the step per op
    (CommDebugMode; call after the warm-up step)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from cauto.runtime.verify import executed_counts, predicted_counts
    args, kwargs = inputs
    mgr = module.manager
    mgr.mover.traffic.reset()
    with CommDebugMode() as comm, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")  # CommDebugMode's module tracker
        module(*args, **kwargs).backward()
        module.optimizer.step()
        module.optimizer.zero_grad()
    off = module.plan.offload or {}
    peak = int(module.plan.predictions["peak_bytes"])
    ws = int(off.get("working_set_bytes", 0))
    return {
        "moved_bytes": {"predicted": int(off.get("moved_bytes", 0)), "measured": mgr.mover.traffic.moved_bytes},
        "arena_bytes": {"predicted": int(off.get("arena_bytes", 0)), "measured": mgr.arena.nbytes},
        "nonmodel_peak_bytes": {"predicted": peak - ws, "measured": int(mgr.nonmodel_peak_bytes)},
        "working_set_bytes": {"predicted": ws, "measured": max(mgr.trace_pinned_bytes, default=0)},
        "comm_bytes": mgr.mover.traffic.comm_bytes,
        "collectives": {"predicted": dict(predicted_counts(module.plan, ("forward", "backward", "grad_sync", "optimizer"))),
                        "executed": dict(executed_counts(comm))},
    }


def format_chunk_report(report: dict, rank: int = 0) -> str:
    """A small predicted-vs-measured table of :func:`chunk_report`."""
    lines = [f"[rank {rank}] cauto verify (chunked state)"]
    for key in ("moved_bytes", "arena_bytes", "nonmodel_peak_bytes", "working_set_bytes"):
        r = report[key]
        lines.append(f"  {key:20s} predicted {r['predicted'] / 2**20:8.3f} MiB  measured {r['measured'] / 2**20:8.3f} MiB")
    lines.append(f"  collective bytes     {report['comm_bytes'] / 2**20:8.3f} MiB")
    coll = report["collectives"]
    for op in sorted(set(coll["predicted"]) | set(coll["executed"])):
        lines.append(f"  {op:20s} predicted {coll['predicted'].get(op, 0):5d}  executed {coll['executed'].get(op, 0):5d}")
    return "\n".join(lines)


__all__ = ["ChunkedParallelModule", "apply_chunked", "check_chunked", "chunk_report", "format_chunk_report"]
