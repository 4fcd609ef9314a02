"""The plan's program lowered to plain local tensors: one forward and one backward graph per rank.

``execute.build`` writes the plan as a program on DTensors. Run as it is, every ATen op of it pays
DTensor's sharding propagation and wrapping in Python, forward and backward (the interpreter cost
measured in tools/bench/bench_runtime_overhead.py). ``LocalProgram`` traces that program once,
before the first step, with AOTAutograd: DTensor parameters and inputs are unwrapped into their local
shards, each DTensor op is replaced by the local ATen ops DTensor would run, and each
redistribution by the functional collectives it issues (``_c10d_functional.all_gather_into_tensor``,
``all_reduce``, ``reduce_scatter_tensor``, ... each followed by its ``wait_tensor`` where the result is
first used). The joint graph is partitioned into a forward and a backward graph, so the backward's
collectives are explicit lines too. What runs per step is those two graphs on plain tensors, with
one autograd node for the whole step; DTensor remains only at the boundary: parameters, their
gradients and optimizer state stay DTensors (``state_dict``, ``torch.distributed.checkpoint`` and torch
optimizers keep working), unwrapped on entry and wrapped on exit.

Why AOTAutograd rather than a hand-written local-rule per op: the local graph is exactly what
DTensor executes (same kernels, same collectives, same order), so parity, the plan's collective
counts and its memory predictions carry over unchanged; the tracing costs about a second once.

``compile=True`` hands both graphs to inductor (``torch.compile``'s backend) instead of running them
as Python. The text of each graph, collective lines annotated with their mesh axis and bytes, is
what runs (``execute.compile_with_comments``) and what ``cauto codegen`` shows.

A lowered program is traced for one set of input shapes and dtypes and one grad mode; a call with
others traces again (a few per model at most: training and evaluation).
"""

from __future__ import annotations

import torch
import torch._functorch.config
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

COLLECTIVE_NAMESPACE = "_c10d_functional"


def _signature(x) -> tuple:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.requires_grad, x.device.type)
    return (type(x).__name__,)


def _axis_of_group(mesh: DeviceMesh) -> dict[str, str]:
    out = {}
    for axis in range(mesh.ndim):
        name = (mesh.mesh_dim_names or [str(a) for a in range(mesh.ndim)])[axis]
        out[mesh.get_group(axis).group_name] = f"mesh axis {axis} ({name})"
    return out


def _tensor_bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0


def annotate_collectives(gm: torch.fx.GraphModule, mesh: DeviceMesh) -> list[dict]:
    """Give each collective node of ``gm`` a comment (op, mesh axis, bytes); return them as records."""
    groups = _axis_of_group(mesh)
    records = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or COLLECTIVE_NAMESPACE not in str(node.target):
            continue
        op = str(node.target).split(".")[1]
        if op == "wait_tensor":
            node.meta["cauto_comment"] = "wait for the collective above: first use of its result"
            continue
        group = next((a for a in node.args if isinstance(a, str) and a in groups), None)
        nbytes = _tensor_bytes(node)
        where = groups.get(group, f"group {group}")
        node.meta["cauto_comment"] = f"COLLECTIVE {op} over {where}: {nbytes} bytes out"
        records.append({"op": op, "axis": where, "bytes": nbytes, "node": node.name})
    return records


class LocalProgram(torch.nn.Module):
    """The DTensor ``program`` of a plan, lowered to local forward and backward graphs on first call.

    A module (never registered in the user's model) so that module trackers (CommDebugMode in
    ``--verify``) see the step inside one module call, as they see the DTensor program. Call it with the program's own arguments (parameters and buffers as DTensors, then user inputs);
    it returns what the program returns (the loss), differentiable: ``loss.backward()`` runs the
    lowered backward graph and leaves DTensor gradients on the parameters.
    """

    def __init__(self, program: torch.fx.GraphModule, mesh: DeviceMesh, *, compile: bool = False):
        super().__init__()
        self.__dict__["program"] = program  # not a submodule: its parameters are the model's
        self.mesh = mesh
        self.compile = compile
        self._lowered: dict[tuple, object] = {}
        #: the graphs of the most recent lowering: {"forward": GraphModule, "backward": GraphModule}
        self.graphs: dict[str, torch.fx.GraphModule] = {}
        #: collectives of the most recent lowering, per graph (op, mesh axis, bytes, node)
        self.collectives: dict[str, list[dict]] = {}
        self.traces = 0

    def forward(self, *args):
        fn = self._lowered.get(self._key(args))
        if fn is None:
            fn = self._trace(args)
        return fn(*args)

    @staticmethod
    def _key(args) -> tuple:
        return (torch.is_grad_enabled(), tuple(_signature(a) for a in args if not isinstance(a, DTensor)))

    def prepare(self, state: list, inputs: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Lower now, for the training call with the global batch: ``state`` the program's parameters and
        buffers (DTensors), ``inputs`` each user input's (global shape, dtype)."""
        device = torch.device(self.mesh.device_type)
        with torch.enable_grad():
            self._trace([*state, *(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in inputs)],
                        input_device=device)

    def _trace(self, args, input_device: torch.device | None = None):
        """Lower the program for calls like ``args`` (grad mode included) and cache it.

        Traced on fake tensors of the same metadata, outside any debug dispatch mode: nothing runs, no
        collective is issued or counted (CommDebugMode in ``--verify``), and a plan that cannot be
        lowered fails here, before its first step. Forward and backward are both traced now (not the
        backward at the first ``loss.backward()``), so their code is there to read."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _disable_current_modes

        grad = torch.is_grad_enabled()
        with _disable_current_modes(), FakeTensorMode(allow_non_fake_inputs=False), \
                torch.set_grad_enabled(grad):
            fakes = [self._fake_like(a, input_device) for a in args]
            key = self._key(fakes)
            fn = self._lowered[key] = self._lower()
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                fn(*fakes)
        return fn

    @staticmethod
    def _fake_like(x, device: torch.device | None = None):
        if isinstance(x, DTensor):
            local = torch.empty_strided(x._local_tensor.shape, x._local_tensor.stride(), dtype=x.dtype,
                                        device=x._local_tensor.device)
            out = DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                     stride=x.stride())
        elif isinstance(x, torch.Tensor):
            dev = device if device is not None and x.device.type == "meta" else x.device
            out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=dev)
        else:
            return x
        return out.requires_grad_(x.requires_grad)

    def _lower(self):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_function
        from torch._functorch.partitioners import default_partition

        from cauto.runtime.execute import compile_with_comments

        def keep(kind: str):
            def compiler(gm: torch.fx.GraphModule, example_inputs):
                self.collectives[kind] = annotate_collectives(gm, self.mesh)
                compile_with_comments(gm)
                self.graphs[kind] = gm
                if self.compile:
                    from torch._inductor.compile_fx import compile_fx_inner
                    return compile_fx_inner(gm, example_inputs, is_backward=kind == "backward")
                return make_boxed_func(gm.forward)  # no module hooks: the step is one call of LocalProgram
            return compiler

        self.graphs, self.collectives = {}, {}
        self.traces += 1
        program = self.program
        return aot_function(lambda *a: program.forward(*a), fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                            inference_compiler=keep("forward"), partition_fn=default_partition)

    def code(self) -> str:
        """Source of the lowered graphs (forward, then backward once traced), as they run."""
        parts = []
        for kind in ("forward", "backward"):
            gm = self.graphs.get(kind)
            if gm is not None:
                parts.append(f"class Local{kind.title()}(torch.nn.Module):\n"
                             + "\n".join("    " + line for line in gm.code.strip("\n").splitlines()))
        return "\n\n\n".join(parts) + "\n"


__all__ = ["COLLECTIVE_NAMESPACE", "LocalProgram", "annotate_collectives"]
