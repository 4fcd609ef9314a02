"""Capture of models with a repeated block: export the first three repeats, stamp the others.

torch.export of a 32-layer decoder spends almost all its time tracing the same layer 32 times. When
the model holds an ``nn.ModuleList`` (or ``nn.Sequential``) of at least :data:`MIN_REPEATS`
interchangeable blocks (same classes, parameter and buffer names, shapes and dtypes, same attribute
values save index-valued ones such as ``layer_idx``, no hooks, no shared blocks), capture exports
the model twice with that list cut to its first 2 and then 3 blocks, and stamps blocks 3..N-1 from
block 2: node names, parameter placeholders, graph signature, state dict, module paths and
checkpoint regions exactly as a whole-model export names them (fx numbers nodes per op name in
creation order, so block k's ``linear_17`` is ``linear_{17 + (k-2) * n}`` with ``n`` the number of
``linear`` nodes one block creates, and the code after the blocks shifts by ``(N-3) * n``). A
block's stretch of the graph is its own nodes plus the loop code that runs after it, up to the next
block's first node.

The same stamping is first checked on the two short exports: the 3-block graph stamped from the
2-block one must equal the exported 3-block graph node for node (names, ops, arguments, shapes,
module paths, signature). That check proves, for the first three blocks, that a block's graph does
not depend on its index or on the number of blocks, that the code before the blocks does not
either, that the code after them only shifts its names, and that a block reads only the shared
values before the blocks, its own parameters and the previous block's outputs. Anything else (and
any export error of the short models) returns no program and capture exports the whole model.

The short exports also see ``config.num_hidden_layers`` (of any submodule's config equal to the
number of blocks) set to 2 and 3, so code that special-cases the last layer by the config is
caught like code that does so by the list's length. Not provable from the first three blocks: code
that branches on the loop index for later blocks only (``if i == 7``, every fourth layer
different) or a block's forward reading its ``layer_idx`` beyond a KV cache. Blocks whose
attributes differ (per-layer attention types, sliding windows) are never stamped.
``CAUTO_STAMP=0`` turns stamping off; ``CAUTO_STAMP=verify`` also exports the whole model and fails
on any difference (:func:`differences`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export.exported_program import ExportedProgram, ModuleCallEntry
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

from cauto.profiler.checkpoint_marks import CHECKPOINT_KEY
from cauto.profiler.errors import CaptureError

#: stamping needs at least one block beyond the three exported ones
MIN_REPEATS = 4
#: blocks in the two short exports; the last one is the template of the stamped blocks
SHORT_REPEATS = (2, 3)
STAMP_ENV = "CAUTO_STAMP"

_SUFFIX = re.compile(r"(.*)_(\d+)$")
_PREFIXES = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_", InputKind.CONSTANT_TENSOR: "c_"}
_MODULE_STATE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


class NoStamp(Exception):
    """Why the repeated blocks cannot be stamped (capture then exports the whole model)."""


def stamp_mode(stamp: bool | None) -> str:
    """'on', 'off' or 'verify': the argument if given, else the CAUTO_STAMP environment variable."""
    if stamp is not None:
        return "on" if stamp else "off"
    value = os.environ.get(STAMP_ENV, "1").strip().lower()
    if value == "verify":
        return "verify"
    return "off" if value in ("0", "off", "false", "no") else "on"


# ------------------------------------------------------------------------------------ finding blocks

def repeated_blocks(root: nn.Module) -> tuple[str, nn.Module] | None:
    """(path, container) of the outermost list of >= MIN_REPEATS interchangeable blocks (the longest)."""
    best: tuple[str, nn.Module] | None = None
    taken: list[str] = []
    for path, module in root.named_modules():
        if any(path.startswith(t) for t in taken):
            continue
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < MIN_REPEATS:
            continue
        if list(module._modules) != [str(i) for i in range(len(module))]:
            continue
        if interchangeable(list(module)):
            taken.append(path + ".")
            if best is None or len(module) > len(best[1]):
                best = (path, module)
    return best


def interchangeable(blocks: list[nn.Module]) -> bool:
    """True when every block is a copy of the first but for its tensors and its index-valued ints."""
    if len({id(b) for b in blocks}) != len(blocks):
        return False
    first = _describe(blocks[0])
    if first is None:
        return False
    for index, block in enumerate(blocks[1:], 1):
        other = _describe(block)
        if other is None or len(other) != len(first):
            return False
        for a, b in zip(first, other):
            if a[:2] != b[:2] or not _same_value(a[2], b[2], index):
                return False
    return True


def _describe(block: nn.Module) -> list[tuple] | None:
    """(submodule, field, value) rows of a block: types, tensor layouts, attributes; None if hooked."""
    rows: list[tuple] = []
    for name, module in block.named_modules(remove_duplicate=False):
        state = vars(module)
        if any(state.get(h) for h in _HOOKS):
            return None
        rows.append((name, "type", type(module)))
        for pname, p in module._parameters.items():
            rows.append((name, "param " + pname, None if p is None else _layout_of(p)))
        for bname, b in module._buffers.items():
            rows.append((name, "buffer " + bname,
                         None if b is None else (*_layout_of(b), bname in module._non_persistent_buffers_set)))
        for key, value in state.items():
            if key not in _MODULE_STATE and key not in _HOOKS:
                rows.append((name, "attr " + key, value))
    return rows


def _layout_of(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, tuple(t.stride()), t.requires_grad, type(t)


def _same_value(a: object, b: object, index: int) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    if type(a) is int and a == 0 and b == index:  # an index such as layer_idx; the short exports check its use
        return True
    try:
        same = a == b
    except Exception:  # noqa: BLE001 - objects whose == fails are not provably equal
        return False
    return same if isinstance(same, bool) else False


@contextlib.contextmanager
def cut_to(container: nn.Module, n: int):
    """Temporarily keep only the first ``n`` blocks of the container."""
    full = container._modules
    container._modules = type(full)(list(full.items())[:n])
    try:
        yield
    finally:
        container._modules = full


@contextlib.contextmanager
def _config_cut(root: nn.Module, total: int, n: int):
    """Temporarily say ``n`` in every module config whose ``num_hidden_layers`` is ``total``.

    The short exports then see a genuine n-block model: code that special-cases the last layer by
    the config (``i == config.num_hidden_layers - 1``) does so in both, and the check catches it.
    """
    changed = []
    for module in root.modules():
        config = getattr(module, "config", None)
        if config is None or any(config is c for c in changed) or getattr(config, "num_hidden_layers", None) != total:
            continue
        try:
            config.num_hidden_layers = n
        except Exception:  # noqa: BLE001 - a config that refuses the change is left as it is
            continue
        changed.append(config)
    try:
        yield
    finally:
        for config in changed:
            config.num_hidden_layers = total


@contextlib.contextmanager
def _without_stack_traces():
    """Tracing that leaves node.meta['stack_trace'] unset (torch.fx.config.do_not_emit_stack_traces)."""
    config = torch.fx.config
    old = getattr(config, "do_not_emit_stack_traces", False)
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = old


# ------------------------------------------------------------------------------------------ layout

@dataclass
class _Layout:
    """An exported graph cut into placeholders, the code before the blocks, the blocks, the rest."""

    prefix: str  # 'm.model.layers.'
    blocks_n: int
    specs: list[tuple[torch.fx.Node, InputSpec]]
    head: list[torch.fx.Node]
    blocks: list[list[torch.fx.Node]]
    tail: list[torch.fx.Node]
    output: torch.fx.Node
    where: dict  # node -> (block, position) for block nodes
    param_layer: dict  # placeholder node -> (block, relative target)


def _block_index(path: str, prefix: str) -> int | None:
    if not path.startswith(prefix):
        return None
    digits = path[len(prefix):].partition(".")[0]
    return int(digits) if digits.isdigit() else None


def _block_of(node: torch.fx.Node, prefix: str) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        index = _block_index(path, prefix)
        if index is not None:
            return index
    return None


def _layout(ep: ExportedProgram, prefix: str, blocks_n: int) -> _Layout:
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    specs = ep.graph_signature.input_specs
    if len(specs) != len(placeholders) or any(s.arg.name != n.name for s, n in zip(specs, placeholders)):
        raise NoStamp("graph signature and placeholders differ")
    param_layer = {}
    for node, spec in zip(placeholders, specs):
        index = _block_index(spec.target or "", prefix)
        if index is not None:
            if spec.kind not in _PREFIXES:
                raise NoStamp(f"block input {spec.arg.name} of kind {spec.kind}")
            param_layer[node] = (index, spec.target[len(prefix) + len(str(index)):])
    if ep.range_constraints or any(n.meta.get("unbacked_bindings") for n in ep.graph.nodes):
        raise NoStamp("data-dependent sizes")
    body = [n for n in ep.graph.nodes if n.op not in ("placeholder", "output")]
    outputs = [n for n in ep.graph.nodes if n.op == "output"]
    index = [_block_of(n, prefix) for n in body]
    starts = [index.index(b) if b in index else -1 for b in range(blocks_n)]
    if -1 in starts or starts != sorted(starts) or len(outputs) != 1:
        raise NoStamp(f"the {blocks_n} blocks are not found in order")
    # a block's stretch runs to the next block's first node: the block and the loop code after it
    length = starts[1] - starts[0]
    if any(b - a != length for a, b in zip(starts, starts[1:])):
        raise NoStamp("the blocks' stretches differ in length")
    blocks = [body[start:start + length] for start in starts]
    end = starts[-1] + length
    if end > len(body):
        raise NoStamp("the last block's stretch runs past the graph")
    for b, nodes in enumerate(blocks):
        for node in nodes:
            if _block_of(node, prefix) not in (None, b) or node.op != "call_function":
                raise NoStamp(f"node {node.name} in the stretch of block {b} cannot be stamped")
    if any(i is not None for i in index[end:]) or any(i is not None for i in index[:starts[0]]):
        raise NoStamp("block nodes outside the blocks' stretches")
    head, tail, output = body[:starts[0]], body[end:], outputs[0]
    where = {n: (b, i) for b, nodes in enumerate(blocks) for i, n in enumerate(nodes)}
    return _Layout(prefix, blocks_n, list(zip(placeholders, specs)), head, blocks, tail, output, where, param_layer)


# ---------------------------------------------------------------------------------------- counting

def _split(name: str) -> tuple[str, int]:
    match = _SUFFIX.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _checkpoint(node: torch.fx.Node) -> int | None:
    custom = node.meta.get("custom")
    return custom.get(CHECKPOINT_KEY) if isinstance(custom, dict) else None


@dataclass
class _PerBlock:
    """What one more block adds to the counters: fx names per op name, checkpoint regions."""

    names: dict[str, int]
    checkpoints: int


def _per_block(short: _Layout, longer: _Layout) -> _PerBlock:
    """Counter steps measured between the last two blocks of ``longer`` and the tails of both."""
    names: dict[str, int] = {}
    steps: set[int] = set()

    def learn(a: torch.fx.Node, b: torch.fx.Node) -> None:
        (base_a, num_a), (base_b, num_b) = _split(a.name), _split(b.name)
        if base_a != base_b or names.setdefault(base_a, num_b - num_a) != num_b - num_a:
            raise NoStamp(f"node names {a.name} and {b.name} do not repeat")
        ca, cb = _checkpoint(a), _checkpoint(b)
        if (ca is None) != (cb is None):
            raise NoStamp(f"checkpoint regions of {a.name} and {b.name} do not repeat")
        if ca is not None:
            steps.add(cb - ca)

    before, last = longer.blocks[-2], longer.blocks[-1]
    if len(before) != len(last) or len(short.tail) != len(longer.tail):
        raise NoStamp("blocks or the code after them differ in length")
    for a, b in zip(before, last):
        learn(a, b)
    for a, b in zip(short.tail, longer.tail):
        learn(a, b)
    if len(steps) > 1 or any(v < 0 for v in names.values()):
        raise NoStamp("counters do not grow by a fixed step per block")
    return _PerBlock(names, steps.pop() if steps else 0)


def _shifted(name: str, step: int) -> str:
    if not step:
        return name
    match = _SUFFIX.match(name)
    if not match:
        raise NoStamp(f"node {name} would need a number")
    return f"{match.group(1)}_{int(match.group(2)) + step}"


def placeholder_name(kind: InputKind, target: str) -> str:
    """The placeholder name torch.export gives a parameter/buffer/constant (torch._export.utils)."""
    return _PREFIXES[kind] + re.sub(r"[^a-zA-Z0-9]", "_", target.lower())


# ---------------------------------------------------------------------------------------- stamping

@dataclass
class Stamped:
    """A program stamped to more blocks; the attributes differences() and ExportedProgram need."""

    graph: torch.fx.Graph
    graph_signature: ExportGraphSignature
    state_dict: dict
    constants: dict
    module_call_graph: list[ModuleCallEntry]
    #: eager Python's lifetimes (cauto.profiler.eager_paths.eager_holds) in the stamped names; None: unknown
    eager_holds: dict | None = None

    def program(self, like: ExportedProgram) -> ExportedProgram:
        """An ExportedProgram of this graph (its GraphModule compiled), the rest taken from ``like``."""
        program = ExportedProgram(root=like.graph_module, graph=self.graph, graph_signature=self.graph_signature,
                               state_dict=self.state_dict, range_constraints=dict(like.range_constraints),
                               module_call_graph=self.module_call_graph, example_inputs=like.example_inputs,
                               constants=self.constants, verifiers=like.verifiers)
        program.cauto_eager_holds = self.eager_holds
        return program


def _rename(text: str, prefix: str, old: int, new: int) -> str:
    head = f"{prefix}{old}"
    if text == head or text.startswith(head + "."):
        return f"{prefix}{new}{text[len(head):]}"
    return text


def _stack(meta_stack: dict, prefix: str, old: int, new: int) -> dict:
    out = {}
    for key, (path, kind) in meta_stack.items():
        new_path = _rename(path, prefix, old, new)
        if new_path != path and key.endswith(path):
            key = key[: len(key) - len(path)] + new_path
        out[key] = (new_path, kind)
    return out


def _runs(items: list, in_last: Callable[[object], bool], copy: Callable[[object, int], object],
          first: int, end: int) -> list:
    """``items`` with, after each run of last-block items, copies of that run for blocks first..end-1."""
    out: list = []
    run: list = []
    for item in [*items, None]:
        if item is not None and in_last(item):
            run.append(item)
            out.append(item)
            continue
        if run:
            out.extend(copy(x, k) for k in range(first, end) for x in run)
            run = []
        if item is not None:
            out.append(item)
    return out


def _lookup(root: nn.Module, fqn: str) -> object:
    obj: object = root
    for part in fqn.split("."):
        obj = getattr(obj, part)
    return obj


def stamp(ep: ExportedProgram, lay: _Layout, per: _PerBlock, total: int, root: nn.Module) -> Stamped:
    """Extend ``ep`` (``lay.blocks_n`` blocks) to ``total`` blocks by stamping its last block."""
    stamper = _Stamper(lay, per, total)
    specs = stamper.placeholders()
    stamper.copy_all(lay.head, _same_name, stamper.new.__getitem__, _same_meta)
    blocks = [stamper.copy_all(nodes, _same_name, stamper.new.__getitem__, _same_meta) for nodes in lay.blocks]
    for k in range(lay.blocks_n, total):
        blocks.append(stamper.stamped_block(k, blocks[k - 1]))
    stamper.tail(blocks[-1])
    renamed = {old.name: made.name for old, made in stamper.new.items()}
    signature = ExportGraphSignature([s for _, s in specs], _output_specs(ep, renamed, lay.prefix))
    calls = _module_calls(ep, lay, total)
    return Stamped(stamper.graph, signature, _entries(ep.state_dict, lay, total, root),
                   _entries(ep.constants, lay, total, root), calls,
                   _stamped_holds(getattr(ep, "cauto_eager_holds", None), ep, lay, stamper, blocks))


def _stamped_holds(holds: dict | None, ep: ExportedProgram, lay: _Layout, stamper: _Stamper,
                   blocks: list[list[torch.fx.Node]]) -> dict | None:
    """The exported program's eager holds in the stamped graph's names: copied nodes keep theirs (their
    targets renamed); each stamped block holds as the template block does, to the same position in its own
    block, to the forward's return, or to the same node after the blocks."""
    if holds is None:
        return None
    by_name = {n.name: n for n in ep.graph.nodes}
    out: dict[str, str | None] = {}

    def target(until: str | None, block: list[torch.fx.Node] | None) -> str | None | bool:
        if until is None:
            return None
        node = by_name.get(until)
        where = lay.where.get(node, (None, None))
        if block is not None and where[0] == stamper.last:
            return block[where[1]].name
        made = stamper.new.get(node)
        return made.name if made is not None else False

    for name, until in holds.items():
        node = by_name.get(name)
        made = stamper.new.get(node)
        to = target(until, None)
        if made is not None and to is not False:
            out[made.name] = to
    for block in blocks[lay.blocks_n:]:
        for pos, node in enumerate(lay.blocks[stamper.last]):
            if node.name in holds:
                to = target(holds[node.name], block)
                if to is not False:
                    out[block[pos].name] = to
    return out


def _same_name(node: torch.fx.Node) -> str:
    return node.name


def _same_meta(node: torch.fx.Node) -> dict:
    return node.meta


class _Stamper:
    """The stamped graph as it is built, in the order a whole-model export creates its nodes:
    placeholders, the code before the blocks, the exported blocks, the stamped ones, the rest."""

    def __init__(self, lay: _Layout, per: _PerBlock, total: int):
        self.lay, self.per, self.total = lay, per, total
        self.last = lay.blocks_n - 1
        self.graph = torch.fx.Graph()
        #: node of the exported program -> its copy (placeholders, head, exported blocks, tail)
        self.new: dict[torch.fx.Node, torch.fx.Node] = {}
        #: (block, parameter target relative to the block) -> placeholder of the last and stamped blocks
        self.layer_inputs: dict[tuple[int, str], torch.fx.Node] = {}

    def create(self, node: torch.fx.Node, name: str, args, kwargs, meta: dict) -> torch.fx.Node:
        target = name if node.op == "placeholder" else node.target
        made = self.graph.create_node(node.op, target, args, kwargs, name=name, type_expr=node.type)
        if made.name != name:
            raise NoStamp(f"node name {name} is taken")
        made.meta = meta
        return made

    def placeholders(self) -> list:
        """Each run of last-block inputs followed by the same run for the stamped blocks; returns the
        (template node or (template node, block), input spec) pairs in order."""
        lay, last = self.lay, self.last

        def spec_in_last(item) -> bool:
            node, _ = item
            return lay.param_layer.get(node, (None,))[0] == last

        def spec_copy(item, k: int):
            node, spec = item
            target = _rename(spec.target, lay.prefix, last, k)
            name = placeholder_name(spec.kind, target)
            return ((node, k), InputSpec(spec.kind, TensorArgument(name), target, spec.persistent))

        specs = _runs(lay.specs, spec_in_last, spec_copy, lay.blocks_n, self.total)
        for key, spec in specs:
            if isinstance(key, tuple):  # a stamped input: (template node, block)
                node, k = key
                made = self.create(node, spec.arg.name, (), {}, dict(node.meta))
                self.layer_inputs[(k, lay.param_layer[node][1])] = made
            else:
                node = key
                made = self.create(node, node.name, (), {}, node.meta)
                if node in lay.param_layer and lay.param_layer[node][0] == last:
                    self.layer_inputs[(last, lay.param_layer[node][1])] = made
                self.new[node] = made
        return specs

    def copy_all(self, nodes: list[torch.fx.Node], rename: Callable[[torch.fx.Node], str], lookup, meta) -> list:
        made = []
        for node in nodes:
            args = torch.fx.node.map_arg(node.args, lookup)
            kwargs = torch.fx.node.map_arg(node.kwargs, lookup)
            made.append(self.create(node, rename(node), args, kwargs, meta(node)))
            self.new[node] = made[-1]
        return made

    def stamped_block(self, k: int, previous: list[torch.fx.Node]) -> list[torch.fx.Node]:
        """Block ``k`` stamped from the last exported block, reading ``previous`` (block k-1's copies)."""
        lay, last, prefix = self.lay, self.last, self.lay.prefix
        step = k - last
        made: list[torch.fx.Node] = []

        def lookup(arg: torch.fx.Node) -> torch.fx.Node:
            block, pos = lay.where.get(arg, (None, None))
            if block == last:
                return made[pos]
            if block == last - 1:
                return previous[pos]
            if block is not None:
                raise NoStamp(f"block {last} reads {arg.name} of block {block}")
            layer = lay.param_layer.get(arg)
            if layer is not None:
                if layer[0] != last:
                    raise NoStamp(f"block {last} reads {arg.name} of block {layer[0]}")
                return self.layer_inputs[(k, layer[1])]
            return self.new[arg]

        def meta(node: torch.fx.Node) -> dict:
            out = dict(node.meta)
            if "nn_module_stack" in node.meta:
                out["nn_module_stack"] = _stack(node.meta["nn_module_stack"], prefix, last, k)
            region = _checkpoint(node)
            if region is not None:
                out["custom"] = {**node.meta["custom"], CHECKPOINT_KEY: region + step * self.per.checkpoints}
            return out

        for node in lay.blocks[last]:
            args = torch.fx.node.map_arg(node.args, lookup)
            kwargs = torch.fx.node.map_arg(node.kwargs, lookup)
            made.append(self.create(node, _shifted(node.name, step * self.per.names.get(_split(node.name)[0], 0)),
                                    args, kwargs, meta(node)))
        return made

    def tail(self, final: list[torch.fx.Node]) -> None:
        """The code after the blocks, its names and checkpoint regions shifted, reading ``final`` (the
        last block's copies), and the output node."""
        lay, last, per = self.lay, self.last, self.per
        extra = self.total - lay.blocks_n

        def tail_lookup(arg: torch.fx.Node) -> torch.fx.Node:
            block, pos = lay.where.get(arg, (None, None))
            if block == last:
                return final[pos]
            return self.new[arg]

        def tail_meta(node: torch.fx.Node) -> dict:
            region = _checkpoint(node)
            if region is None:
                return node.meta
            return {**node.meta, "custom": {**node.meta["custom"], CHECKPOINT_KEY: region + extra * per.checkpoints}}

        self.copy_all(lay.tail, lambda n: _shifted(n.name, extra * per.names.get(_split(n.name)[0], 0)), tail_lookup,
                      tail_meta)
        out = lay.output
        self.create(out, out.name, torch.fx.node.map_arg(out.args, tail_lookup),
                    torch.fx.node.map_arg(out.kwargs, tail_lookup), out.meta)


def _output_specs(ep: ExportedProgram, renamed: dict[str, str], prefix: str) -> list[OutputSpec]:
    """The program's output specs with the stamped graph's node names (refused: mutated block state)."""
    outputs = []
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT and _block_index(spec.target or "", prefix) is not None:
            raise NoStamp(f"the graph mutates block state {spec.target}")
        arg = spec.arg
        if isinstance(arg, TensorArgument):
            arg = TensorArgument(renamed.get(arg.name, arg.name))
        outputs.append(OutputSpec(spec.kind, arg, spec.target))
    return outputs


def _entries(mapping: dict, lay: _Layout, total: int, root: nn.Module) -> dict:
    """A state dict or constants table with the stamped blocks' entries after the last block's, their
    values read from the whole model ``root``."""
    last = lay.blocks_n - 1
    keys = _runs(list(mapping), lambda key: _block_index(key, lay.prefix) == last,
                 lambda key, k: _rename(key, lay.prefix, last, k), lay.blocks_n, total)
    return {key: mapping[key] if key in mapping else _lookup(root, key) for key in keys}


def _module_calls(ep: ExportedProgram, lay: _Layout, total: int) -> list[ModuleCallEntry]:
    """The module call graph with entries for the stamped blocks' modules (refused: a block module
    that keeps its call signature)."""
    last = lay.blocks_n - 1

    def key_in_last(key: str) -> bool:
        return _block_index(key, lay.prefix) == last

    calls = []
    for entry in ep.module_call_graph:
        if key_in_last(entry.fqn) and entry.signature is not None:
            raise NoStamp(f"module {entry.fqn} keeps its call signature")
        calls.append(entry)
    return _runs(calls, lambda e: key_in_last(e.fqn),
                 lambda e, k: ModuleCallEntry(_rename(e.fqn, lay.prefix, last, k), None), lay.blocks_n, total)


# ------------------------------------------------------------------------------------------ driver

def stamped_export(wrapper: nn.Module, export: Callable[[], ExportedProgram]) -> tuple[ExportedProgram | None, str]:
    """(program, note): the whole-model program stamped from short exports, or (None, why not)."""
    found = repeated_blocks(wrapper)
    if found is None:
        return None, "no repeated blocks"
    path, container = found
    prefix, total = path + ".", len(container)
    try:
        short: list[tuple[ExportedProgram, _Layout]] = []
        for n in SHORT_REPEATS:
            # the 2-block export only checks the stamping: its nodes need no stack traces (faster)
            quick = _without_stack_traces() if n < SHORT_REPEATS[-1] else contextlib.nullcontext()
            with cut_to(container, n), _config_cut(wrapper, total, n), quick:
                ep = export()
            short.append((ep, _layout(ep, prefix, n)))
        (ep2, lay2), (ep3, lay3) = short
        per = _per_block(lay2, lay3)
        predicted = stamp(ep2, lay2, per, SHORT_REPEATS[1], wrapper)
        diff = differences(predicted, ep3)
        if diff:
            raise NoStamp(f"{SHORT_REPEATS[1]} blocks stamped from {SHORT_REPEATS[0]} differ from their export: "
                          f"{diff[0]}")
        program = stamp(ep3, lay3, per, total, wrapper).program(ep3)
    except NoStamp as why:
        return None, f"not stamped ({path}): {why}"
    except CaptureError:  # the model itself cannot be captured (a custom autograd.Function): say so now
        raise
    except Exception as exc:  # noqa: BLE001 - a short export that fails falls back to the whole model
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"not stamped ({path}): {type(exc).__name__}: {first[:200]}"
    name = path.removeprefix("m.")
    first = SHORT_REPEATS[1]
    stamped = f"{first}..{total - 1}" if total - 1 > first else f"{first}"
    return program, f"stamped {name}.{stamped} from {name}.{first - 1}"


# -------------------------------------------------------------------------------------- comparison

def _dims(dims) -> tuple:
    return tuple(d if isinstance(d, int) else str(d) for d in dims)  # str: no guards on symbolic sizes


def _value(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return ("tensor", _dims(v.shape), v.dtype, _dims(v.stride()))
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(v))
    return v


def _node_row(node: torch.fx.Node) -> tuple:
    refs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: ("%", a.name))
    val = tuple(_value(v) for v in pytree.tree_leaves(node.meta.get("val")))
    stack = tuple((k, p, t) for k, (p, t) in (node.meta.get("nn_module_stack") or {}).items())
    custom = node.meta.get("custom")
    return (node.name, node.op, str(node.target), repr(refs), val, stack, repr(custom))


_ROW_FIELDS = ("name", "op", "target", "arguments", "value", "module stack", "custom meta")


def differences(a, b, limit: int = 5) -> list[str]:
    """How two exported programs (or Stamped) differ: nodes, signature, state; [] when identical."""
    out: list[str] = []

    def report(text: str) -> bool:
        out.append(text)
        return len(out) >= limit

    nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
    if len(nodes_a) != len(nodes_b):
        out.append(f"{len(nodes_a)} nodes vs {len(nodes_b)}")
    for x, y in zip(nodes_a, nodes_b):
        rx, ry = _node_row(x), _node_row(y)
        if rx != ry:
            field = next(f for f, p, q in zip(_ROW_FIELDS, rx, ry) if p != q)
            if report(f"node {x.name} / {y.name}: {field} differs"):
                return out
    sig_a = [(s.kind, s.arg.name, s.target, s.persistent) for s in a.graph_signature.input_specs]
    sig_b = [(s.kind, s.arg.name, s.target, s.persistent) for s in b.graph_signature.input_specs]
    if sig_a != sig_b:
        out.append("input specs differ")
    out_a = [(s.kind, getattr(s.arg, "name", None), s.target) for s in a.graph_signature.output_specs]
    out_b = [(s.kind, getattr(s.arg, "name", None), s.target) for s in b.graph_signature.output_specs]
    if out_a != out_b:
        out.append("output specs differ")
    for label, ma, mb in (("state dict", a.state_dict, b.state_dict), ("constants", a.constants, b.constants)):
        if list(ma) != list(mb):
            out.append(f"{label} keys differ")
        elif any(_value(ma[k]) != _value(mb[k]) for k in ma):
            out.append(f"{label} tensors differ")
    if [e.fqn for e in a.module_call_graph] != [e.fqn for e in b.module_call_graph]:
        out.append("module call graphs differ")
    return out[:limit]
