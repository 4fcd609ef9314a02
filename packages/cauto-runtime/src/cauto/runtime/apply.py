"""``apply(fn, plan, mesh)``: the model of a factory, parallelized as a plan says, on this rank.

Order of work: capture the factory (the same capture as the profiler's, so node names are the
plan's node ids), refuse a plan made for another graph or mesh, build the model with its
parameters on meta, give each rank its own shards, rewrite the captured graph into the parallel
program (``execute.build``), and install bucketed gradient synchronization (``grad_sync``).

A plan whose parameters' state is "chunked" (the solver's offload) runs as chunks/data_parallel.py says when it
is pure data parallelism (the model as written under the chunk manager, ``ChunkedParallelModule``),
and otherwise as chunks/in_program.py says: this DTensor program, with the chunked parameters' local
shards in the chunk manager, fetched around the ops that use them.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from cauto.plan import PlanDocument, load_plan
from cauto.plan.execution import lowered_reduce_dtype, regathers_params
from cauto.plan.validate import check_plan_against_graph
from cauto.profiler.capture import Capture, capture
from cauto.runtime import execute, training_state
from cauto.runtime.chunks.data_parallel import ChunkedParallelModule, apply_chunked
from cauto.runtime.chunks.in_program import build_program, shard_into_chunks
from cauto.runtime.dist_utils import local_slices, to_placements
from cauto.runtime.errors import PlanMismatchError
from cauto.runtime.grad_sync import DEFAULT_BUCKET_BYTES, GradSync
from cauto.runtime.inputs import flat_inputs
from cauto.runtime.lowering import LocalProgram, LoweringError
from cauto.runtime.materialize import build_skeleton, materialize
from cauto.runtime.propagate import Propagation, propagate

#: ParallelModule's attributes held in its __dict__: a user's submodule, parameter or buffer of one of
#: these names cannot be kept at the top level (the runtime reads them); refused by name (_refuse_held_names)
_HELD = ("plan", "mesh", "capture", "executable", "chunked", "lowered", "optimizer", "grad_sync")
#: ParallelModule's properties and methods: a user's name among these wins (_yield_names), as ALBERT's
#: ``predictions`` head does; ours stay reachable as ``ParallelModule.<name>`` (e.g. ``.fget(module)``)
_YIELDING = ("predictions", "generated_code", "manager", "chunk_shards", "input_slices", "save", "load")


def _top_level_names(model: nn.Module) -> set[str]:
    return set(model._modules) | set(model._parameters) | set(model._buffers)


def _refuse_held_names(model: nn.Module) -> None:
    taken = sorted(_top_level_names(model) & set(_HELD))
    if taken:
        raise ValueError(f"the model's top-level {', '.join(repr(t) for t in taken)} (a submodule, parameter or "
                         f"buffer of {type(model).__name__}) has the name of an attribute of cauto's parallel "
                         f"module ({', '.join(_HELD)}); rename it in the model, or wrap the model in a module "
                         "that holds it under another name")


class _UsersName:
    """A class attribute of a per-model subclass of ParallelModule: the user's submodule, parameter or
    buffer of this name, where ParallelModule has a property or method of the same name."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        for table in ("_parameters", "_buffers", "_modules"):
            held = obj.__dict__[table]
            if self.name in held:
                return held[self.name]
        raise AttributeError(self.name)


def _yield_names(module: ParallelModule, model: nn.Module) -> None:
    """Switch ``module`` to a subclass where each of ``model``'s top-level names that is one of
    ParallelModule's properties or methods means the user's object."""
    taken = sorted(_top_level_names(model) & set(_YIELDING))
    if taken:
        module.__class__ = type(type(module).__name__, (type(module),), {t: _UsersName(t) for t in taken})


class ParallelModule(nn.Module):
    """The model on this rank: DTensor parameters placed as planned, and the parallel forward.

    Call it with the factory's inputs (the global batch on every rank, or this rank's slice: see
    ``input_slices``); it returns the loss, replicated on every rank. ``state_dict()`` holds DTensors
    under the model's own names (``torch.distributed.checkpoint`` saves and loads it shard-wise).
    Attributes: ``plan``, ``predictions``, ``generated_code``, ``executable`` (redistributions,
    mismatches), ``capture``, ``mesh``, ``optimizer`` (what ``apply``'s ``optimizer`` factory built, or None).
    ``save(D, step)`` / ``load(D)`` checkpoint and resume training (training_state.py).
    ``clip_grad_norm_`` (clip.py), ``batch_slice()`` (data.py) and ``no_sync()`` (gradient accumulation).
    With chunked parameters (chunks/in_program.py) also ``chunked`` (the ChunkedModel) and ``manager``
    (its ChunkManager); ``optimizer`` is then the ChunkedAdam and ``state_dict()`` holds only the
    device parameters and buffers (checkpoint chunked state with ``cauto.runtime.chunks.save_checkpoint``).
    """

    def __init__(self, model: nn.Module, cap: Capture, plan: PlanDocument, mesh: DeviceMesh,
                 executable: execute.ExecutableGraph, bucket_bytes: int, chunked=None, shards=None,
                 autocast_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 lowered: LocalProgram | None = None):
        super().__init__()
        _refuse_held_names(model)
        _yield_names(self, model)  # before the children are added: add_module refuses a name the class has
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model._parameters.items():
            self.register_parameter(name, p)
        for name, b in model._buffers.items():
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        self.__dict__["capture"] = cap
        self.__dict__["executable"] = executable
        self.plan = plan
        self.mesh = mesh
        self.__dict__["chunked"] = chunked
        self.__dict__["lowered"] = lowered
        #: the plan's mixed-precision compute dtype (None: the parameters' dtype)
        self.autocast_dtype = autocast_dtype
        self._shards = shards or {}
        self._state = [self._lookup(node) for node in cap.graph.nodes
                       if node.op == "placeholder" and cap.placeholders[node.name][0] != "input"]
        self._input_names = [name for name, (kind, _) in cap.placeholders.items() if kind == "input"]
        self._kwarg_order = list(cap.kwargs)
        plain_grads = {}
        if lowered is not None:
            lowered.plain = {i for i, x in enumerate(self._state)
                             if isinstance(x, nn.Parameter) and not isinstance(x, DTensor)}
            plain_grads = _PlainGradPlacements(lowered, self._state)
        self.grad_sync = GradSync([p for p in self.parameters() if isinstance(p, DTensor) or lowered is not None],
                                  mesh, bucket_bytes, plain_grad_placements=plain_grads, reduce_dtype=reduce_dtype)
        if lowered is not None:
            lowered.bucket_bytes = bucket_bytes
            self.grad_sync.in_graph = lowered.grad_buckets

    def get_submodule(self, target: str) -> nn.Module:
        """The user's submodule at ``target``, found in the module tree, never an attribute of this class:
        a name of the user's model that is also one of ours (ALBERT's ``predictions``) is the user's.
        ``get_parameter`` and ``get_buffer`` look up through this."""
        module: nn.Module = self
        for item in target.split(".") if target else ():
            if item not in module._modules:
                raise AttributeError(f"{module._get_name()} has no submodule {item!r} (looking up {target!r})")
            module = module._modules[item]
        return module

    def _lookup(self, node):
        kind, fqn = self.capture.placeholders[node.name]
        constant = self.capture.lifted_constant(node.name)
        if constant is not None:  # a constant of the trace, not a buffer of the model: replicated, on the device
            return DTensor.from_local(constant.to(self.mesh.device_type), self.mesh,
                                      [Replicate()] * self.mesh.ndim, run_check=False)
        if kind == "param" and fqn in self._shards:
            return self._shards[fqn]
        if kind == "param":
            return self.get_parameter(fqn)
        return self.get_buffer(fqn)

    @property
    def predictions(self) -> dict:
        """The plan's predictions (peak bytes, step time, collectives per step)."""
        return self.plan.predictions

    @property
    def generated_code(self) -> str:
        """The source of the parallel forward that runs (see ``cauto.runtime.codegen``)."""
        from cauto.runtime.codegen import render
        return render(self.executable, self.plan, self.lowered)

    @property
    def manager(self):
        """The chunk manager of the chunked parameters (None without them)."""
        return self.chunked.manager if self.chunked is not None else None

    @property
    def chunk_shards(self) -> dict:
        """Name -> ChunkedShard (where its local shard sits in the chunks, its DTensor placements) of
        each chunked parameter (empty without them)."""
        return dict(self._shards)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        flat = flat_inputs(args, kwargs, self._kwarg_order, self._input_names, self.capture.constants)
        if torch.is_grad_enabled() and self.chunked is None:
            reduce = self.grad_sync.begin()
            if self.lowered is not None:
                self.lowered.reduce_grads = reduce
                self.grad_sync.in_graph = self.lowered.grad_buckets
        if self.chunked is not None:
            if self.chunked.manager.recording:  # the warm-up measures non-model memory (chunks/model.py)
                from cauto.runtime.verify import input_shard_bytes
                self.chunked.input_bytes = input_shard_bytes(self)
            (loss,) = self.chunked.run(self.executable.module, *self._state, *flat)
        elif self.lowered is not None:
            (loss,) = self.lowered(*self._state, *flat)
        elif self.autocast_dtype is not None:  # the DTensor interpreter under the plan's mixed precision
            with torch.autocast(self.mesh.device_type, dtype=self.autocast_dtype):
                (loss,) = self.executable.module(*self._state, *flat)
        else:
            (loss,) = self.executable.module(*self._state, *flat)
        return loss

    def save(self, directory: str | os.PathLike, step: int = 0):
        """Checkpoint the parameters, ``self.optimizer``'s state, ``step`` and RNG states under ``directory``
        (``directory/step-N/``, complete or absent: training_state.py); every rank calls it. Return the folder."""
        return training_state.save(self, directory, step, self.optimizer)

    def load(self, directory: str | os.PathLike) -> int:
        """Load the latest complete checkpoint under ``directory`` in place (its fingerprint must be this
        model's; DCP reshards for another mesh); return the step it was saved at."""
        return training_state.load(self, directory, self.optimizer)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation, as DDP's ``no_sync``: forwards and backwards run inside accumulate this
        rank's gradients without the plan's gradient synchronization (no data-parallel all-reduce); the
        first backward after leaving it reduces the accumulated gradients in buckets, once per optimizer
        step::

            for micro in micro_batches[:-1]:
                with model.no_sync():
                    (model(**micro) / k).backward()
                (model(**micro_batches[-1]) / k).backward()   # gradients synchronized here
                opt.step(); opt.zero_grad()

        Collectives that are part of the computation (tensor parallelism's, the loss's, and the
        reduce-scatters of parameters stored sharded, FSDP-style, which autograd runs in each backward)
        still run per micro-batch. Clipping inside it raises (no rank has the global gradient).
        """
        if self.chunked is not None:
            raise NotImplementedError("no_sync() with chunked parameter state: the chunk manager reduce-scatters "
                                      "every backward's gradients into its chunks; accumulate with a larger batch, "
                                      "or plan with --offload none")
        before, self.grad_sync.sync = self.grad_sync.sync, False
        try:
            yield
        finally:
            self.grad_sync.sync = before

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the global norm of every gradient, each
        element counted once whatever its placement (sharded, replicated, chunked: clip.py); return it."""
        from cauto.runtime.clip import clip_grad_norm_
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def batch_slice(self, uneven: str = "raise"):
        """Which slice of the global batch this rank loads: a ``cauto.runtime.data.BatchSlice`` (``index`` of
        ``count`` over the plan's data-parallel axes: a DistributedSampler's ``rank`` and ``num_replicas``).
        ``uneven="whole"``: the whole batch when the plan has no single slice (``data.batch_slice``)."""
        from cauto.runtime.data import batch_slice
        return batch_slice(self.capture, self.plan, self.mesh, uneven)

    def input_slices(self) -> dict[str, tuple[slice, ...]]:
        """Per user input: the slice of the global batch this rank must load in local-batch mode."""
        out = {}
        for node in self.capture.graph.nodes:
            if node.op == "placeholder" and self.capture.placeholders[node.name][0] == "input":
                shape = tuple(node.meta["val"].shape)
                placements = to_placements(tuple(self.plan.nodes[node.name]["outputs"][0]))
                out[self.capture.placeholders[node.name][1]] = local_slices(shape, placements, self.mesh)
        return out


class _PlainGradPlacements(dict):
    """id(plain parameter) -> placements of its gradient, read off the local program's trace by position."""

    def __init__(self, lowered: LocalProgram, state: list):
        super().__init__()
        self._lowered, self._positions = lowered, {}
        for i, x in enumerate(state):
            self._positions.setdefault(id(x), []).append(i)

    def get(self, key, default=None):
        # A tied parameter is an argument more than once; the trace may keep one of them (AOTAutograd
        # deduplicates arguments): any recorded position holds the gradient's placements.
        by_position = self._lowered.grad_placements  # of the variant that ran (accumulating or not)
        for position in self._positions.get(key, ()):
            if position in by_position:
                return by_position[position]
        return default

    def __getitem__(self, key):
        found = self.get(key)
        if found is None:
            raise KeyError(key)
        return found


def _replicated_as_plain(model: nn.Module, mesh: DeviceMesh) -> bool:
    """When every parameter is replicated on every mesh axis (data parallelism), parameters become plain
    (their local tensor): the optimizer and the local program then treat them as DDP does, with no
    DTensor dispatch. Plans that shard any parameter keep all of them DTensors, as FSDP2 and tensor
    parallelism do (a foreach optimizer refuses a mix of DTensors and plain tensors). Returns whether it did."""

    params = list(model.parameters())
    if not all(isinstance(p, DTensor) and all(isinstance(q, Replicate) for q in p.placements) for p in params):
        return False
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if isinstance(p, DTensor) and all(isinstance(q, Replicate) for q in p.placements):
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(p._local_tensor.detach(), requires_grad=p.requires_grad)
                module._parameters[name] = done[id(p)]
    return True


def check_fits(cap: Capture, plan: PlanDocument, mesh: DeviceMesh, *, chunked_ok: bool = False) -> None:
    """Raise PlanMismatchError unless ``plan`` belongs to this capture, mesh and world size (and, unless
    ``chunked_ok``, keeps every parameter's state on the device: the DTensor program)."""
    fingerprint = cap.fingerprint()
    if plan.graph_fingerprint != fingerprint:
        raise PlanMismatchError(
            f"the plan was solved for graph {plan.graph_fingerprint[:12]}, but this model captures as "
            f"{fingerprint[:12]}: the model, its sizes or its inputs changed since planning; profile and solve "
            "again (cauto plan) for this model")
    shape = tuple(plan.mesh["shape"])
    if tuple(mesh.shape) != shape:
        raise PlanMismatchError(f"the plan is for a mesh of shape {shape} (axes {plan.mesh['axis_names']}), but "
                                f"the mesh given has shape {tuple(mesh.shape)}; build the mesh with "
                                f"make_mesh({list(shape)}) or solve for this mesh")
    world = dist.get_world_size() if dist.is_initialized() else 1
    size = 1
    for s in shape:
        size *= s
    if size != world:
        raise PlanMismatchError(f"the plan's mesh {shape} needs {size} processes, but the world size is {world}; "
                                f"launch with torchrun --nproc-per-node {size}")
    check_plan_against_graph(plan.to_dict(), cap.structure(), fingerprint)  # names, counts, S(d) within rank
    for section in ("nodes", "params"):
        for node_id, entry in getattr(plan, section).items():
            lists = [entry["placements"]] if section == "params" else entry["inputs"] + entry["outputs"]
            if any(len(p) != len(shape) for p in lists):
                raise PlanMismatchError(f"plan.{section}[{node_id!r}] has a placement with other than {len(shape)} "
                                        f"entries (one per mesh axis of {shape}); the plan is malformed")
    offloaded = [entry["target"] for entry in plan.params.values() if entry.get("state", "device") != "device"]
    if offloaded and not chunked_ok:
        raise PlanMismatchError(
            f"the plan keeps the state of {len(offloaded)} parameters off the device (first: {offloaded[0]!r}, "
            f"state {next(e['state'] for e in plan.params.values() if e['target'] == offloaded[0])!r}); there is no "
            "DTensor program for pure data parallelism with chunked state: apply runs the model as written under the "
            "chunk manager (chunks/data_parallel.py)")


def apply(model_or_fn: Callable, plan: PlanDocument | dict | str | os.PathLike, mesh: DeviceMesh, *,
          state_dict: dict[str, torch.Tensor] | None = None, seed: int | None = None,
          bucket_bytes: int = DEFAULT_BUCKET_BYTES, check_placements: bool = True,
          captured: Capture | None = None,
          optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
          lowering: str = "local", compile: bool = False) -> ParallelModule | ChunkedParallelModule:
    """Return the model of factory ``model_or_fn`` parallelized per ``plan`` on ``mesh`` (this rank's part).

    ``model_or_fn``: the factory the plan was made from (``() -> (model, inputs)``); ``captured``: its
    Capture when the caller already has one (skips capturing again).
    ``plan``: a PlanDocument, a dict or a path (any supported schema version; other majors refused).
    ``state_dict``: full tensors to load (each rank keeps its shard); otherwise parameters are
    initialized per rank as ``cauto.runtime.materialize`` documents, from ``seed`` (None: rank 0's
    ``torch.initial_seed()``, shared with all ranks). ``check_placements``: compare DTensor's own
    placement choices with the plan before the first step (mismatches are fixed and reported).
    ``optimizer``: a factory ``module -> torch optimizer``; the result's ``optimizer`` attribute is what it
    built (None without it). For a plan with chunked state ``optimizer`` is a ChunkedAdam built from the
    factory's class (Adam or AdamW) and parameter groups (default AdamW's), and the module is a
    ChunkedParallelModule (pure data parallelism, chunks/data_parallel.py) or a ParallelModule whose chunked
    parameter shards the program fetches (chunks/in_program.py); train through ``model.optimizer`` in every case.
    """
    plan = plan if isinstance(plan, PlanDocument) else load_plan(plan)
    if isinstance(model_or_fn, nn.Module):
        raise TypeError("apply takes a factory returning (model, inputs), not a built model: cauto builds the "
                        "model on the meta device and gives each rank only its shards")
    fn = model_or_fn
    cap = captured if captured is not None else capture(fn, device=mesh.device_type, autocast=compute_dtype(plan))
    check_fits(cap, plan, mesh, chunked_ok=True)
    if seed is None and state_dict is None:
        seed = _shared_seed()
    has_chunks = any(e.get("state", "device") != "device" for e in plan.params.values())
    compute = _compute_dtype_that_runs(plan, has_chunks, compile, lowering)
    if plan.execution["mode"] == "chunk_manager":
        return apply_chunked(fn, cap, plan, mesh, seed=seed, state_dict=state_dict, optimizer=optimizer)
    model = _materialized(fn, cap, plan, mesh, seed, state_dict)
    propagation = None
    if check_placements:
        propagation = _propagation(cap, plan, mesh)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    if has_chunks and regathers_params(plan.execution):
        raise PlanMismatchError("this plan both keeps parameter state in chunks and gathers parameters again in "
                                "backward (execution.regather_params), which do not combine: plan again (cauto plan)")
    if has_chunks:
        chunked, chunked_opt, shards = shard_into_chunks(model, plan, mesh, device, optimizer)
        executable = build_program(cap, plan, mesh, device, propagation, shards)
        module = ParallelModule(model, cap, plan, mesh, executable, bucket_bytes, chunked, shards)
        module.optimizer = chunked_opt
        return module
    executable = execute.build(cap, plan, mesh, device, propagation)
    lowering = _lowering_for_regions(plan, lowering, compile)
    regather = regathers_params(plan.execution)
    if regather and lowering != "local":
        raise PlanMismatchError(
            "this plan gathers parameters again in backward (execution.regather_params), which only the local "
            "program does, and it runs on DTensors here (" + ("lowering='dtensor' was asked" if lowering == "dtensor"
                                                             and not _nested_regions(plan) else
                                                             "its checkpoint regions are nested") +
            "): run it with lowering='local', or plan again (cauto plan) without nested regions")
    plain = lowering == "local" and _replicated_as_plain(model, mesh)
    reduce = reduce_dtype(plan)
    lowered = LocalProgram(executable.module, mesh, compile=compile, plan_nodes=plan.nodes,
                           autocast_dtype=compute, reduce_dtype=reduce, regather=regather) if lowering == "local" else None
    module = ParallelModule(model, cap, plan, mesh, executable, bucket_bytes, lowered=lowered,
                            autocast_dtype=compute, reduce_dtype=reduce)
    if lowered is not None:
        try:
            lowered.prepare(module._state, [(tuple(n.meta["val"].shape), n.meta["val"].dtype)
                                            for n in cap.graph.nodes
                                            if n.op == "placeholder" and cap.placeholders[n.name][0] == "input"])
        except LoweringError as exc:
            if plain or compile or regather or not _asks_a_value(exc):
                raise
            # DTensor asked a tensor's value while the local program was traced (its redistribution of a
            # strided shard in Mixtral's 2x2 backward): the same program runs on DTensors as written
            warnings.warn(f"cauto: the local program could not be traced ({exc}); running the plan on DTensors "
                          "(lowering='dtensor'), slower per step, the same computation", stacklevel=2)
            module.grad_sync.remove()
            module = ParallelModule(model, cap, plan, mesh, executable, bucket_bytes, lowered=None,
                                    autocast_dtype=compute, reduce_dtype=reduce)
    module.optimizer = optimizer(module) if optimizer is not None else None
    return module


def _compute_dtype_that_runs(plan: PlanDocument, has_chunks: bool, compile: bool, lowering: str) -> torch.dtype | None:
    """The plan's compute dtype (compute_dtype), after refusing what cannot run: compile=True without the
    local program, mixed precision with chunked state."""
    if compile and (has_chunks or lowering != "local"):
        raise PlanMismatchError(
            "compile=True needs the local program, and " + ("this plan keeps parameter state in chunks, which "
            "the chunk manager fetches and releases in Python between ops (no graph can hold that)" if has_chunks
            else "lowering='dtensor' was asked for") + "; run without compile, or plan without --offload")
    compute = compute_dtype(plan)
    if compute is not None and has_chunks:
        raise PlanMismatchError("this plan asks for mixed precision (execution.mixed_precision) and keeps parameter "
                                "state in chunks; the chunk manager does not run plans under autocast yet: plan "
                                "without --offload, or without --mixed-precision")
    return compute


def _materialized(fn: Callable, cap: Capture, plan: PlanDocument, mesh: DeviceMesh, seed: int | None,
                  state_dict: dict[str, torch.Tensor] | None) -> nn.Module:
    """The model of ``fn`` in training mode (no KV cache), each parameter this rank's shard of its
    planned storage placement (a tied parameter's every name placed as the one the graph uses)."""
    model, _, fills = build_skeleton(fn)
    model.train()
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
    placements = {cap.placeholders[pid][1]: ",".join(entry["placements"]) for pid, entry in plan.params.items()}
    for pid, (kind, fqn) in cap.placeholders.items():
        canonical = cap.tied.get(pid)
        if kind == "param" and canonical in plan.params:
            # one tensor, several names: it is stored as the program reads it, the name the graph uses
            placements[fqn] = ",".join(plan.params[canonical]["placements"])
    materialize(model, fills, mesh, placements, seed=seed, state_dict=state_dict)
    return model


def _propagation(cap: Capture, plan: PlanDocument, mesh: DeviceMesh) -> Propagation:
    """DTensor's own propagation from the plan's placeholder, input and output placements."""
    ph = {n.name: ",".join(plan.nodes[n.name]["outputs"][0]) for n in cap.graph.nodes if n.op == "placeholder"}
    inputs = {k: [",".join(p) for p in v["inputs"]] for k, v in plan.nodes.items()}
    outputs = {k: [",".join(p) for p in v["outputs"]] for k, v in plan.nodes.items()}
    return propagate(cap, mesh, ph, node_inputs=inputs, node_outputs=outputs)


def _nested_regions(plan: PlanDocument) -> list[int]:
    """Indices of the plan's checkpoint regions that have children."""
    return [i for i, r in enumerate((plan.checkpoint or {}).get("regions", [])) if r.get("children")]


def _lowering_for_regions(plan: PlanDocument, lowering: str, compile: bool) -> str:
    """``lowering``, or "dtensor" for the local program of a plan with nested checkpoint regions (refused
    with compile=True)."""
    nested = _nested_regions(plan)
    if nested and lowering == "local":
        if compile:
            raise PlanMismatchError(
                f"compile=True needs the local program, and checkpoint region {nested[0]} of this plan has nested "
                "regions, which the local program recomputes once where the plan counts each level; run without "
                "compile, or plan with --checkpoint none|chen")
        # The local program's partition recomputes a region op once; the plan's predictions count a nested
        # region's ops once per level (torch.utils.checkpoint within checkpoint): the interpreter runs
        # what the plan predicts.
        lowering = "dtensor"
    return lowering


def compute_dtype(plan: PlanDocument | Mapping) -> torch.dtype | None:
    """The dtype the plan's step computes in under autocast (``execution.mixed_precision.compute_dtype``),
    None where the plan has no mixed precision. The model is captured under the same autocast (its
    graph, and so its fingerprint, is that program's)."""
    execution = plan.execution if isinstance(plan, PlanDocument) else plan.get("execution")
    mixed = (execution or {}).get("mixed_precision")
    return None if mixed is None else getattr(torch, mixed["compute_dtype"])


def reduce_dtype(plan: PlanDocument | Mapping) -> torch.dtype | None:
    """The dtype the plan reduces parameters' gradients in where it is not their own fp32
    (``execution.mixed_precision.reduce_dtype`` bfloat16), else None."""
    name = lowered_reduce_dtype(plan.execution if isinstance(plan, PlanDocument) else plan.get("execution"))
    return None if name is None else getattr(torch, name)


def _asks_a_value(exc: BaseException) -> bool:
    """True when the error, or one it came from, is an op that reads a tensor's value (``.item()``):
    DTensor's internals under tracing, not the plan's placements."""
    while exc is not None:
        if "_local_scalar_dense" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _shared_seed() -> int:
    seed = [torch.initial_seed() % 2**63]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(seed, src=0)
    return int(seed[0])


__all__ = ["ChunkedParallelModule", "ParallelModule", "PlanMismatchError", "apply", "compute_dtype"]
