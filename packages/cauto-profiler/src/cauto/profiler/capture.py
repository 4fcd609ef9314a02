"""One capture for profiler and runtime: a model factory -> an ATen forward graph with stable names.

``capture(fn)`` calls ``fn()`` on the meta device (nothing the size of the model is allocated),
wraps the model so that the graph ends in the training loss, and exports it, seen as fake tensors on
the device the program will run on (model code that branches on the device takes the right branch), with
``torch.export.export(strict=False)`` (training IR: ATen ops that autograd can differentiate).
Node names of that graph are the node ids of the graph document and of the plan, so the runtime,
which captures the same factory again, executes exactly the nodes the solver planned. Models with a
list of identical blocks export three of them and stamp the others (:mod:`cauto.profiler.stamp`):
the same graph, names included.

Loss rule: the output's ``.loss`` if it has one, else the output if it is a scalar, else the sum
of the first output tensor.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind

from cauto.plan import graph_fingerprint
from cauto.profiler.checkpoint_marks import CHECKPOINT_KEY, mark_checkpoints
from cauto.profiler.eager_paths import eager_holds, eager_mask_decisions, python_lifetimes
from cauto.profiler.errors import CaptureError, CustomFunctionError
from cauto.profiler.stamp import differences, stamp_mode, stamped_export

ModelFactory = Callable[[], tuple[torch.nn.Module, object]]

#: ops that produce no value worth planning (asserts, in-place detaches of caches); the runtime skips
#: them too
SKIPPED_TARGETS = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
                   "aten.sym_constrain_range_for_size.default"}
_LAYER_PATTERN = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")
_WRAPPER = "m"


def loss_of(output: object) -> torch.Tensor:
    """The training loss of a model output (see module docstring)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.sum()
    leaves = [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]
    if not leaves:
        raise CaptureError("the model returned no tensor; return a loss, logits, or an object with .loss")
    return leaves[0] if leaves[0].dim() == 0 else leaves[0].sum()


class LossWrapper(torch.nn.Module):
    """Calls the model and reduces its output to the training loss; the model is the child 'm'."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, *args, **kwargs):
        return loss_of(self.m(*args, **kwargs))


def split_inputs(inputs: object) -> tuple[tuple, dict]:
    """Normalize example inputs (tensor, tuple/list of tensors, or dict of keyword tensors)."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise CaptureError(f"inputs must be a tensor, a tuple of tensors or a dict of tensors, not {type(inputs).__name__}")


def build_on_meta(fn: ModelFactory) -> tuple[torch.nn.Module, tuple, dict]:
    """Call the factory on the meta device; refuse models that allocated real memory."""
    with torch.device("meta"):
        result = fn()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise CaptureError("the factory must return (model, inputs): an nn.Module and its example inputs")
    model, inputs = result
    real = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"]
    if real:
        raise CaptureError(
            f"the factory allocated real memory for {len(real)} tensors (first: {real[0]!r}); build the model "
            "from its config and do not load weights inside the factory (the profiler builds it on the meta device)"
        )
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False  # a KV cache is an inference feature; training graphs never need it
    args, kwargs = split_inputs(inputs)
    return model, args, kwargs


@dataclass
class Capture:
    """A captured training forward graph and what the profiler and runtime need to use it."""

    exported: torch.export.ExportedProgram
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    #: placeholder name -> (kind, fully qualified name in the model or input name)
    placeholders: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: placeholder name of a tied parameter -> placeholder that the graph really uses
    tied: dict[str, str] = field(default_factory=dict)
    #: data-dependent size symbol -> the size hint it was given (see cauto.profiler.hints)
    sym_values: dict = field(default_factory=dict)
    #: how the repeated blocks were captured: 'stamped model.layers.3..31 from model.layers.2' or why not
    stamping: str = ""
    #: example inputs that hold no tensor (CLIP's ``return_loss=True``), by position (int) or keyword (str):
    #: constants of the capture, not graph inputs (the graph was traced with these values)
    constants: dict = field(default_factory=dict)
    #: {node: node after which eager frees it, or None for "when the forward returns"}: values the model's
    #: Python keeps past their last use in the graph (:func:`cauto.profiler.eager_paths.eager_holds`);
    #: None when not known (a stamped program)
    eager_holds: dict | None = None

    @property
    def graph(self) -> torch.fx.Graph:
        return self.exported.graph

    def lifted_constant(self, placeholder: str) -> torch.Tensor | None:
        """The value of a tensor constant the trace lifted into a graph input (a ``torch.tensor(...)``
        literal in the model's forward: T5's attention), or None for any other placeholder. The graph
        document calls it a buffer; it is no tensor of the model, so its value lives here."""
        for spec in self.exported.graph_signature.input_specs:
            if spec.arg.name == placeholder and spec.kind == InputKind.CONSTANT_TENSOR:
                return self.exported.constants[spec.target]
        return None

    def value_nodes(self) -> list[torch.fx.Node]:
        """Nodes that become graph-document nodes, in execution order."""
        return [n for n in self.graph.nodes if is_value_node(n)]

    def structure(self) -> list[dict]:
        """Graph-document nodes with their structural fields (the fingerprinted part)."""
        return structure_nodes(self)

    def fingerprint(self) -> str:
        """The fingerprint of this graph, as written in graph and plan documents."""
        return graph_fingerprint(self.structure())

    def checkpoint_regions(self) -> dict[str, int]:
        """Node name -> region number for nodes that ran inside torch.utils.checkpoint (non-reentrant).

        torch.export flattens checkpointed code into the graph; capture marks it so that the profiler
        can replay the same recomputation (the outermost checkpoint call wins when they nest).
        """
        return {n.name: n.meta["custom"][CHECKPOINT_KEY] for n in self.graph.nodes
                if isinstance(n.meta.get("custom"), dict) and CHECKPOINT_KEY in n.meta["custom"]}


def capture(fn: ModelFactory, *, stamp: bool | None = None, device: str | torch.device = "cpu",
            autocast: torch.dtype | None = None) -> Capture:
    """Build the model on meta, export its loss graph as seen on ``device``, and return the Capture.

    The model's tensors are meta, but the export sees them as fake tensors on ``device`` (the device
    the program will run on: code that branches on it takes that branch, see :func:`on_fake_device`);
    the program's device arguments are meta, as the profiler and the runtime expect.

    ``autocast`` (a dtype, e.g. torch.bfloat16): export under autocast to it on that device, the
    program a mixed-precision plan runs (autocast skips meta tensors: that is one more reason the
    export sees fake tensors on a real device).

    Models with a repeated block (a ModuleList of identical layers) export only their first three
    blocks and stamp the others (:mod:`cauto.profiler.stamp`), giving the graph a whole-model export
    gives, names included. ``stamp=False`` (or ``CAUTO_STAMP=0``) always exports the whole model;
    ``CAUTO_STAMP=verify`` exports both ways and raises CaptureError if they differ.
    """
    model, args, kwargs = build_on_meta(fn)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        # fake CUDA tensors need CUDA (a CPU-only torch aborts tracing them): profiling a CUDA run on a
        # machine without one traces on meta, whose device branches are those of no real device
        device = torch.device("meta")
    if autocast is not None and device.type == "meta":
        device = torch.device("cpu")  # autocast needs a real device type; the CPU's casts are the same ops
    model.train()
    wrapper = LossWrapper(model)
    mode = stamp_mode(stamp)
    exported, note = None, "stamping off"
    if mode != "off":
        exported, note = stamped_export(wrapper, lambda: _export(wrapper, args, kwargs, device, autocast))
    if exported is None or mode == "verify":
        whole = _export(wrapper, args, kwargs, device, autocast)
        if exported is not None:
            diff = differences(exported, whole)
            if diff:
                raise CaptureError(f"the stamped graph differs from the whole-model export ({note}): "
                                   + "; ".join(diff))
            note += " (verified)"
        exported = whole
    constants = _drop_constant_inputs(exported, args, kwargs)
    cap = Capture(exported, model, args, kwargs, *_placeholders(exported))
    cap.constants = constants
    # a stamped program's names are not the short exports' names: its Python lifetimes are not known
    cap.eager_holds = getattr(exported, "cauto_eager_holds", None)
    cap.sym_values = _data_dependent_sizes(exported)
    cap.stamping = note
    return cap


def _export(wrapper: torch.nn.Module, args: tuple, kwargs: dict, device: torch.device,
            autocast: torch.dtype | None = None) -> torch.export.ExportedProgram:
    """torch.export of the loss wrapper (checkpointed regions marked) seen on ``device``, under autocast
    to ``autocast`` when given; CaptureError saying why not."""
    casting = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    try:
        with python_lifetimes() as deaths:
            with keep_autograd_functions(wrapper), mark_checkpoints(), _lazy_recompiles(), eager_mask_decisions(), \
                    on_fake_device(wrapper, (args, kwargs), device) as ((fake_args, fake_kwargs), originals), casting:
                exported = torch.export.export(wrapper, fake_args, fake_kwargs, strict=False)
        _devices_to_meta(exported, device, originals)
        exported.cauto_eager_holds = eager_holds(exported.graph, deaths)
        return exported
    except CaptureError:
        raise
    except Exception as exc:  # torch raises many types here; the message is what the user needs
        if isinstance(exc.__cause__, CustomFunctionError):
            raise exc.__cause__ from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ""
        if "data-dependent" in str(exc).lower() or "guard" in str(exc).lower():
            where = _user_frame(exc)
            hint = (f" — Python code{where} branches on or sizes with a data-dependent value (.item(), int(t), "
                    "a condition on tensor values); torch.export cannot capture that and no size hint can "
                    "apply before capture: make the size static or use torch._check (ops with data-dependent "
                    "output sizes such as nonzero/masked_select are fine: see cauto.profiler.size_hint)")
        raise CaptureError(f"torch.export could not capture the model: {first}{hint}") from exc


@contextlib.contextmanager
def on_fake_device(wrapper: torch.nn.Module, inputs: tuple[tuple, dict], device: torch.device):
    """While exporting, the model's meta parameters and buffers and the meta inputs are fake tensors on
    ``device``; yields the fake (args, kwargs) and the map from id(fake) to the meta tensor it stands for.

    Model code may branch on the device it runs on (transformers' mixture of experts counts tokens per
    expert with ``histc`` on a float copy on CPU, an int32 one elsewhere): a capture on meta takes the
    branch of no real device and bakes it into the program. Fake tensors allocate nothing, like meta
    ones, and report the device the program will run on. Afterwards the meta tensors are back in place
    (ties kept: one fake per meta tensor) and the ExportedProgram's state is the meta tensors again.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}
    originals: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            made = mode.fake_tensor_converter.from_meta_and_device(mode, t.detach(), device)
            if isinstance(t, torch.nn.Parameter):
                made = torch.nn.Parameter(made, requires_grad=t.requires_grad)
            fakes[id(t)], originals[id(made)] = made, t
        return fakes[id(t)]

    swapped = []
    for module in wrapper.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is not None and t.device.type == "meta":
                    swapped.append((slots, name, t))
                    slots[name] = fake(t)
    try:
        yield pytree.tree_map(lambda x: fake(x) if isinstance(x, torch.Tensor) and x.device.type == "meta" else x,
                              inputs), originals
    finally:
        for slots, name, t in swapped:
            slots[name] = t


def _devices_to_meta(exported: torch.export.ExportedProgram, device: torch.device,
                     originals: dict[int, torch.Tensor]) -> None:
    """The captured program as a meta capture writes it: ``device`` arguments (factory ops, ``to``)
    become meta (the runtime and the profiler put their own device there), and the state dict holds
    the model's meta tensors, not the fakes the export saw."""
    meta = torch.device("meta")
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        node.args, node.kwargs = pytree.tree_map(
            lambda a: meta if isinstance(a, torch.device) and a == device else a, (node.args, node.kwargs))
    state = exported.state_dict
    for key, t in list(state.items()):
        state[key] = originals.get(id(t), t)
    exported.graph_module.recompile()


@contextlib.contextmanager
def keep_autograd_functions(wrapper: torch.nn.Module):
    """While exporting, keep every user ``torch.autograd.Function`` as one node with its own backward
    (:mod:`cauto.profiler.kept_functions`), or raise CustomFunctionError naming the Function, the module
    that calls it and what to do, where it cannot be kept.

    Left alone, torch.export (non-strict) runs a Function's forward and records its ATen ops, so the
    graph's backward would be autodiff of the forward, not the Function's own ``backward`` (a
    straight-through estimator would silently train another model): that never happens.

    The Functions torch generates for a ``torch.library`` custom op with a registered autograd
    formula (:func:`is_registered_op_function`) pass as they are: they are how torch runs a registered
    op's autograd (kept ops included), the graph keeps the op as one node, and its backward is the
    registered formula.
    """
    from cauto.profiler.kept_functions import KeptFunctionError, call_kept

    function = torch.autograd.Function
    original = function.__dict__["apply"]
    names = {id(m): name for name, m in wrapper.named_modules()}

    def keep(cls, *args, **kwargs):
        if is_registered_op_function(cls):
            return original.__func__(cls, *args, **kwargs)
        if _is_reentrant_checkpoint(cls):
            raise CustomFunctionError(_custom_function_message(cls, _calling_module(names)))
        try:
            if kwargs:
                raise KeptFunctionError("it is called with keyword arguments")
            return call_kept(cls, args)
        except KeptFunctionError as why:
            raise CustomFunctionError(_custom_function_message(cls, _calling_module(names), str(why))) from None

    function.apply = classmethod(keep)
    try:
        yield
    finally:
        function.apply = original


def _is_reentrant_checkpoint(cls: type) -> bool:
    return cls.__qualname__ == "CheckpointFunction" and cls.__module__ == "torch.utils.checkpoint"


def is_registered_op_function(cls: type) -> bool:
    """True for the autograd.Function torch builds for a ``torch.library`` op's registered autograd
    (``torch._library.autograd.make_autograd_impl``: ``GeneratedBackwardFor_<namespace>_<op>_<overload>``),
    never for a Function a user wrote."""
    return cls.__module__ == "torch._library.autograd" and cls.__qualname__.startswith("GeneratedBackwardFor_")


def _calling_module(names: dict[int, str]) -> str:
    """The model's module whose code is running (innermost frame whose ``self`` is one of them)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        name = names.get(id(frame.f_locals.get("self")))
        if name is not None:
            return "" if name in ("", _WRAPPER) else _strip(name)
        frame = frame.f_back
    return ""


def _custom_function_message(cls: type, module: str, why: str = "") -> str:
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    where = f"module {module!r}" if module else "the model's top-level forward"
    if _is_reentrant_checkpoint(cls):
        what = ("reentrant torch.utils.checkpoint is a custom autograd.Function: call "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (or gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False}) on a Hugging Face model)")
    else:
        what = (f"cauto cannot keep it as one node with its own backward ({why}) and will not replace it by "
                "autodiff of its forward; call it with tensor and constant positional arguments, keep the "
                "tensors its backward needs in ctx.save_for_backward, or write it as plain torch code whose "
                "autodiff is the gradient you want (straight-through rounding: x + (torch.round(x) - x).detach())")
    return f"custom torch.autograd.Function {qualname} called in {where}: {what}"


def _drop_constant_inputs(exported: torch.export.ExportedProgram, args: tuple, kwargs: dict) -> dict:
    """Remove the graph inputs that hold no tensor and return the example inputs they came from.

    torch.export keeps a placeholder for every leaf of the inputs, but specializes the program on the
    value of a non-tensor one (a bool, int, float, string or None): no node uses it. Left in, it would
    be a graph-document input with no outputs. Returns {position or keyword: value} for each top-level
    example input without a tensor in it (``Capture.constants``).
    """
    graph = exported.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    specs = exported.graph_signature.input_specs
    kept = []
    for spec in specs:
        node = placeholders[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT and not isinstance(node.meta.get("val"), torch.Tensor):
            if node.users:
                raise CaptureError(f"input {spec.arg.name!r} holds no tensor but the graph uses it "
                                   f"({node.meta.get('val')!r}); pass it as a tensor or make it a constant")
            graph.erase_node(node)
        else:
            kept.append(spec)
    if len(kept) != len(specs):
        specs[:] = kept
        exported.graph_module.recompile()

    def constant(value: object) -> bool:
        return not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value))

    return {**{i: v for i, v in enumerate(args) if constant(v)},
            **{k: v for k, v in kwargs.items() if constant(v)}}


def _lazy_recompiles():
    """Export's intermediate GraphModules generate their code only if used (about 10% of an export);
    the ExportedProgram's own GraphModule is compiled as always."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def _user_frame(exc: BaseException) -> str:
    """' at file.py:12' for the innermost traceback frame outside torch/cauto, or ''."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and "/cauto/" not in f.filename and "/transformers/" not in f.filename]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _data_dependent_sizes(exported: torch.export.ExportedProgram) -> dict:
    """Map each unbacked size symbol to its size hint; CaptureError naming the op if none is given."""
    from cauto.profiler.hints import current_hints

    hints = current_hints()
    values: dict = {}
    for node in exported.graph.nodes:
        bindings = node.meta.get("unbacked_bindings")
        if not bindings:
            continue
        op = getattr(getattr(node.target, "_overloadpacket", None), "__name__", str(node.target))
        value = hints.get(node.name, hints.get(op))
        if value is None:
            raise CaptureError(
                f"{op} (node {node.name}) in module {module_path(node) or '<root>'!r} has a data-dependent output "
                f"size; give it with cauto.profiler.size_hint({op}=N) or profile(..., size_hints={{{op!r}: N}}) "
                f"(N = the expected number of selected elements/rows, or the value of .item()), "
                f"or make the size static")
        for sym in bindings:
            values[sym] = value
    return values


def concrete_int(size, cap: Capture | None = None) -> int:
    """An int for a (possibly symbolic) size, substituting data-dependent sizes by their hints."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if cap is not None and cap.sym_values:
        expr = expr.xreplace({k: v for k, v in cap.sym_values.items()})
    return int(expr)


def _strip(fqn: str) -> str:
    return fqn[len(_WRAPPER) + 1:] if fqn.startswith(_WRAPPER + ".") else fqn


def _placeholders(exported: torch.export.ExportedProgram) -> tuple[dict, dict]:
    kinds = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "buffer",
             InputKind.USER_INPUT: "input"}
    places: dict[str, tuple[str, str]] = {}
    for spec in exported.graph_signature.input_specs:
        if spec.kind not in kinds:
            raise CaptureError(f"unsupported graph input {spec.arg} of kind {spec.kind}")
        name = spec.arg.name
        places[name] = (kinds[spec.kind], _strip(spec.target) if spec.target else name)
    # Tied parameters: export keeps one placeholder per parameter name but routes every use to one.
    state = dict(exported.state_dict)
    by_identity: dict[int, str] = {}
    tied: dict[str, str] = {}
    used = {n.name for n in exported.graph.nodes if n.op == "placeholder" and n.users}
    for name, (kind, fqn) in places.items():
        if kind != "param":
            continue
        tensor = state.get(_WRAPPER + "." + fqn)
        if tensor is None:
            continue
        key = id(tensor)
        if key in by_identity:
            first = by_identity[key]
            canonical, other = (first, name) if first in used else (name, first)
            tied[other] = canonical
            by_identity[key] = canonical
        else:
            by_identity[key] = name
    # Three or more names of one tensor (T5: shared, encoder and decoder embeddings, lm_head) leave a chain
    # of placeholders the graph never reads; each must name the one it does read, whose placement it has.
    for other in tied:
        while tied[other] in tied:
            tied[other] = tied[tied[other]]
    return places, tied


def is_value_node(node: torch.fx.Node) -> bool:
    """True for placeholders and ops that produce tensors (getitem is folded into 'node#k' refs)."""
    if node.op == "placeholder":
        return True
    if node.op != "call_function" or node.target is _getitem:
        return False
    if str(node.target) in SKIPPED_TARGETS:
        return False
    val = node.meta.get("val")
    tensors = [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]
    return bool(tensors)


def _getitem(container, index):  # pragma: no cover - identity with operator.getitem below
    return container[index]


import operator  # noqa: E402

_getitem = operator.getitem  # noqa: F811


def output_tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    """The fake/meta tensors a node produces (several for tuple/list outputs)."""
    return [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensor-valued fx nodes among a node's args and kwargs, in flattened order (getitem kept)."""
    flat = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, torch.fx.Node) and output_tensors(a)]


def ref_of(node: torch.fx.Node) -> str:
    """The graph-document reference of an fx node: 'name', or 'producer#k' for getitem."""
    if node.op == "call_function" and node.target is operator.getitem:
        parent, index = node.args
        return f"{ref_of(parent)}#{index}" if "#" not in ref_of(parent) else ref_of(parent)
    return node.name


def module_path(node: torch.fx.Node) -> str:
    """The dotted path of the innermost module that ran this node ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return "" if path == _WRAPPER else _strip(path)


def layer_of(module: str) -> tuple[str | None, int | None]:
    """('transformer.h.*', 3) for 'transformer.h.3.attn': the repeat group of a module path."""
    match = _LAYER_PATTERN.match(module)
    if not match:
        return None, None
    return f"{match.group(1)}.*", int(match.group(2))


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (its logical size, not its storage): the one rule the profiler and
    the runtime use for a value's size."""
    return t.numel() * t.element_size()


def _trainable(model: torch.nn.Module, target: str) -> bool:
    """Whether parameter ``target`` of ``model`` requires grad (True where the name does not resolve)."""
    try:
        return bool(model.get_parameter(target).requires_grad)
    except AttributeError:
        return True


def structure_nodes(cap: Capture) -> list[dict]:
    """Graph-document nodes with only their structural fields, in execution order."""
    nodes = []
    for node in cap.value_nodes():
        outs = []
        for t in output_tensors(node):
            shape = [concrete_int(s, cap) for s in t.shape]
            outs.append({"shape": shape, "dtype": dtype_name(t.dtype),
                         "bytes": math.prod(shape) * t.element_size()})
        entry: dict = {"id": node.name, "outputs": outs}
        if node.op == "placeholder":
            kind, target = cap.placeholders[node.name]
            entry.update(kind=kind, op=kind, module=_parent(target) if kind != "input" else "", inputs=[],
                         target=target)
            if kind == "param":
                entry["tied_to"] = cap.tied.get(node.name)
                # frozen (fine-tuning): no gradient, no optimizer state, nothing to chunk
                entry["requires_grad"] = _trainable(cap.model, target)
        else:
            entry.update(kind="op", op=str(node.target), module=module_path(node),
                         inputs=[ref_of(a) for a in tensor_inputs(node)])
        layer, index = layer_of(entry["module"])
        entry["layer"], entry["layer_index"] = layer, index
        nodes.append(entry)
    (out,) = [n for n in cap.graph.nodes if n.op == "output"]
    loss = pytree.tree_leaves(out.args)[0]
    nodes.append({"id": "output", "kind": "output", "op": "output", "module": "", "inputs": [ref_of(loss)],
                  "outputs": [], "layer": None, "layer_index": None})
    return nodes


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]
