"""Capture takes the code paths eager training takes, where a library branches on "am I exported?".

Hugging Face's mask builders (``transformers.masking_utils``) decide whether to build an attention
mask at all by asking ``is_torchdynamo_exporting()``. Eagerly, a causal or bidirectional attention
with no padding mask builds none: it calls SDPA with ``is_causal=True`` or with no mask. Under
``torch.export`` the same call materializes a boolean mask (batch x 1 x q x kv), then a float copy
of it, and hands that to SDPA. The reason transformers gives is that an exported program may later
run with other shapes, where a baked ``is_causal=True`` would be wrong. cauto's capture has static
shapes: every program it builds runs with the shapes it was traced with. So the masked program only
costs memory (two mask tensors per mask kind, live through the forward) that the user's eager step
never allocates. That was the whole eager-peak gap on 17 of the coverage benchmark's models.

:func:`eager_mask_decisions` answers "not exporting" to those builders while capture runs. The
decision then follows eager's rule exactly: skip the mask when there is no padding mask (or the
lengths make it redundant), build it when a padding mask is given (a fake tensor: transformers does
not read its values under tracing, and neither could we). Nothing else changes: the patched name is
the module-level import inside ``masking_utils`` alone, restored on exit.

The decoder LMs have a second such branch. With no attention mask, transformers checks whether the
position ids describe packed sequences (several sequences in one row) by reading their values, and
under tracing, where it cannot read them, it assumes they might and builds the mask. The position
ids these models use when the user gives none are ``arange(seq)`` made inside the model: they depend
on no input, so their value is known at capture time. :func:`constant_value` computes such a tensor
for real (it replays the ops the trace recorded for it, none of which reads an input), and the
packed-sequence check then gets eager's answer from that value. Position ids that depend on an input
(given by the user, or computed from the tokens) keep the traced answer, the mask: their values are
the data's, unknown at capture, and skipping the mask for them could train another model.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref

import torch
import torch.fx

#: modules whose own ``is_torchdynamo_exporting`` import decides mask construction
MASK_MODULES = ("transformers.masking_utils",)


def _not_exporting() -> bool:
    return False


def _never_tracing(tensor=None) -> bool:
    return False


def constant_value(t: torch.Tensor) -> torch.Tensor | None:
    """The real value of ``t``, a tensor being traced, when it depends on no input of the trace (every
    op that made it is a factory or an op on factory outputs: ``arange(n).unsqueeze(0)``); None when it
    reads an input or a parameter, or when no trace is running. The ops run for real on CPU."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
    from torch.utils._python_dispatch import _disable_current_modes

    mode = get_proxy_mode()
    slot = get_proxy_slot(t, mode.tracer, None) if mode is not None else None
    if slot is None:
        return None
    wanted, stack = set(), [slot.proxy.node]
    while stack:
        node = stack.pop()
        if node in wanted:
            continue
        if node.op != "call_function":
            return None  # an input, a parameter or a buffer: the data's value, not a constant
        wanted.add(node)
        stack.extend(node.all_input_nodes)
    cpu = torch.device("cpu")
    values: dict[torch.fx.Node, object] = {}

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return values[a]
        return cpu if isinstance(a, torch.device) else a

    with _disable_current_modes():  # no grad-mode change here: export would record it as a region
        for node in slot.proxy.node.graph.nodes:  # graph order is a topological order
            if node in wanted:
                args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), arg)
                values[node] = node.target(*args, **kwargs)
    value = values[slot.proxy.node]
    return value if isinstance(value, torch.Tensor) else None


def _packed_sequences_as_eager(original):
    """``find_packed_sequence_indices`` answering as eager does for position ids known at capture."""
    def find_packed_sequence_indices(position_ids):
        real = constant_value(position_ids)
        if real is None:
            return original(position_ids)
        module = sys.modules[original.__module__]
        tracing, module.is_tracing = module.is_tracing, _never_tracing
        try:
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                eager = original(real)
        finally:
            module.is_tracing = tracing
        return None if eager is None else original(position_ids)  # traced only when eager builds it too
    return find_packed_sequence_indices


@contextlib.contextmanager
def eager_mask_decisions():
    """While the block runs, transformers' mask builders decide as in eager (see module doc).
    A no-op when transformers is not imported (no model of the capture can use it)."""
    patched = []
    for name in MASK_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        if hasattr(module, "is_torchdynamo_exporting"):
            patched.append((module, "is_torchdynamo_exporting", module.is_torchdynamo_exporting))
            module.is_torchdynamo_exporting = _not_exporting
        if hasattr(module, "find_packed_sequence_indices") and hasattr(module, "is_tracing"):
            original = module.find_packed_sequence_indices
            patched.append((module, "find_packed_sequence_indices", original))
            module.find_packed_sequence_indices = _packed_sequences_as_eager(original)
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


# ------------------------------------------------------------------ lifetimes Python gives in eager

class _PythonDeaths(torch.overrides.TorchFunctionMode):
    """While exporting, notes for every tensor the model's Python receives from a torch call when
    that Python object dies: the name of the newest graph node at that moment."""

    def __init__(self):
        super().__init__()
        self.deaths: dict[str, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

        mode = get_proxy_mode()
        if mode is None:
            return out
        for value in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(value, torch.Tensor):
                slot = get_proxy_slot(value, mode.tracer, None)
                if slot is not None:
                    node = slot.proxy.node
                    weakref.finalize(value, self._died, node.name, node.graph)
        return out

    def _died(self, name: str, graph: torch.fx.Graph) -> None:
        self.deaths.setdefault(name, next(reversed(graph.nodes)).name)


@contextlib.contextmanager
def python_lifetimes():
    """Records, while the block exports a model, when the model's Python drops each tensor it holds
    (a local, an attribute of a cache object, a list); yields the dict {node name: name of the newest
    node when its tensor died}, complete once the block has exited and the export's objects are gone.

    The graph frees a value at its last use; eager Python frees it when its last reference dies, which
    can be later: a KV-cache object that keeps the concatenated keys and values until the model's
    forward returns (T5's decoder), a local read again only after a long stretch. Autograd's own
    references (saved tensors) are seen too; those the profiler keeps until backward anyway.
    """
    recorder = _PythonDeaths()
    with recorder:
        yield recorder.deaths
    gc.collect()  # objects in reference cycles (module outputs, caches) die here, after the last node


def eager_holds(graph: torch.fx.Graph, deaths: dict[str, str]) -> dict[str, str | None]:
    """{node name: the node after which eager frees it} for the values eager Python keeps past their last
    use in ``graph``; None: until the forward returns (it died at or after the graph's last node)."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    order = {n.name: i for i, n in enumerate(nodes)}
    holds: dict[str, str | None] = {}
    for i, node in enumerate(nodes):
        death = deaths.get(node.name)
        if death is None or death not in order:
            continue
        last = max((order.get(u.name, len(nodes)) for u in node.users), default=i)
        if order[death] > last:
            holds[node.name] = None if order[death] >= len(nodes) - 1 else death
    return holds
