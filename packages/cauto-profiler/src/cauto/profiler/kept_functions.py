"""A custom ``torch.autograd.Function`` kept as one graph node whose backward is the user's own.

``torch.export`` (non-strict) runs a Function's forward and records its ATen ops, so the captured
program's backward would be autodiff of the forward, not the Function's ``backward``: a straight-through
estimator would silently train another model. While capture exports, each call of a user's Function is
routed instead through a ``torch.library`` custom op made for that Function (:func:`kept_op`):

* the op's kernel runs ``Function.forward`` on its tensors (no autograd inside), for real or on fake
  tensors alike, and returns the forward's outputs, plus the tensors ``ctx.save_for_backward`` kept that
  are neither an input nor an output (the backward needs them, as eager's autograd keeps them);
* its registered autograd formula builds a context like the Function's (``saved_tensors``, the
  attributes the forward set, ``needs_input_grad``) and calls ``Function.backward``.

So the program has one node (``cauto_kept::<Function>``) where the Function was called, and its gradient
is the user's. The runtime runs such an op replicated on every rank (it has no sharding rule), as it runs
any library op without one, and the op is registered again in every process that captures the model.

**Declaring a sharding rule.** Without one the op runs replicated. A Function that works element by element
on tensors of one shape (each output element depends only on the same element of its inputs: activations,
quantizers, straight-through estimators) can say so, ``cauto.profiler.declare_elementwise(MyFunction)`` (or
as a class decorator); then every tensor of the op shares one set of letters in the graph's sharding labels,
the solver may keep any split of those dims through it, and the runtime runs it on each rank's shard
(:func:`is_elementwise`). The declaration is the user's promise: cauto cannot check what a Function computes.

Non-tensor arguments (numbers, strings, None) are constants of the op: one op per Function and set of
constants. Kept as they are: a forward's non-tensor ``ctx`` attributes (read at every call). Refused by
name (CustomFunctionError): a Function whose ``ctx`` holds a tensor outside ``save_for_backward``, one
called with keyword arguments, one returning something other than tensors, and reentrant
``torch.utils.checkpoint`` (use ``use_reentrant=False``).
"""

from __future__ import annotations

import hashlib
import re
import threading

import torch

#: custom-op namespace of kept Functions
NAMESPACE = "cauto_kept"
_OPS: dict[str, tuple] = {}
_LOCK = threading.Lock()


class KeptFunctionError(Exception):
    """A Function that cannot be kept (the caller turns it into a CustomFunctionError naming the module)."""


class _Context:
    """What ``Function.forward`` and ``Function.backward`` see as ``ctx``."""

    def __init__(self, needs_input_grad: tuple = ()):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tuple(tensors)

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    def mark_dirty(self, *tensors) -> None:
        raise KeptFunctionError("it modifies an input in place (ctx.mark_dirty)")


_OWN = {"needs_input_grad", "saved_tensors", "materialize_grads"}


class _Kept:
    """One Function with one set of non-tensor arguments: the op's kernel, fake kernel and autograd."""

    def __init__(self, cls: type, template: list):
        self.cls, self.template = cls, template  # template: the apply arguments, None where a tensor goes
        self.local = threading.local()

    def _args(self, xs):
        it = iter(xs)
        return [next(it) if t is _SLOT else t for t in self.template]

    def kernel(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        ctx = _Context(tuple(t is _SLOT for t in self.template))
        with torch.no_grad():
            out = self.cls.forward(ctx, *self._args(xs))
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise KeptFunctionError("its forward returns something other than tensors")
        layout, extras = [], []
        for s in ctx.saved_tensors:
            if s is None:
                layout.append(("none", 0))
            elif any(s is x for x in xs):
                layout.append(("input", next(i for i, x in enumerate(xs) if s is x)))
            elif any(s is o for o in outs):
                layout.append(("output", next(j for j, o in enumerate(outs) if s is o)))
            else:
                layout.append(("extra", len(extras)))
                extras.append(s)
        attrs = {k: v for k, v in vars(ctx).items() if k not in _OWN or k == "materialize_grads"}
        if any(isinstance(v, torch.Tensor) for v in attrs.values()):
            raise KeptFunctionError("its ctx holds a tensor outside ctx.save_for_backward")
        # a custom op's outputs never alias its inputs or each other
        seen: list[torch.Tensor] = list(xs)
        fresh = []
        for o in outs + extras:
            fresh.append(o.clone() if any(o is s or _shares(o, s) for s in seen) else o)
            seen.append(fresh[-1])
        self.local.last = (len(outs), layout, attrs, isinstance(out, (tuple, list)))
        return fresh

    def setup_context(self, ctx, inputs, output) -> None:
        (xs,) = inputs
        n_out, layout, attrs, _ = self.local.last
        saved = []
        for kind, i in layout:
            saved.append(None if kind == "none" else xs[i] if kind == "input" else
                         output[i] if kind == "output" else output[n_out + i])
        ctx.save_for_backward(*[s for s in saved if s is not None])
        ctx.cauto_layout = [s is not None for s in saved]
        ctx.cauto_attrs, ctx.cauto_n_out = attrs, n_out
        ctx.cauto_requires = [x.requires_grad for x in xs]
        # shapes only: keeping the outputs would hold them to backward, which the Function does not
        ctx.cauto_outputs = [(o.shape, o.dtype, o.device) for o in output[:n_out]]

    def backward(self, ctx, grads):
        kept = iter(ctx.saved_tensors)
        saved = tuple(next(kept) if present else None for present in ctx.cauto_layout)
        requires = iter(ctx.cauto_requires)
        needs = tuple(next(requires) if t is _SLOT else False for t in self.template)
        user = _Context(needs)
        user.saved_tensors = saved
        for k, v in ctx.cauto_attrs.items():
            setattr(user, k, v)
        outs = [torch.zeros(shape, dtype=dtype, device=device) if g is None and user.materialize_grads else g
                for g, (shape, dtype, device) in zip(grads[:ctx.cauto_n_out], ctx.cauto_outputs)]
        result = self.cls.backward(user, *outs)
        result = list(result) if isinstance(result, (tuple, list)) else [result]
        return [g for g, t in zip(result, self.template) if t is _SLOT]


class _Slot:
    def __repr__(self) -> str:
        return "<tensor>"


_SLOT = _Slot()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != 0
    except (RuntimeError, NotImplementedError):  # fake or meta storage: identity is the test
        return False


def kept_op(cls: type, args: tuple) -> tuple[object, _Kept, list[torch.Tensor]]:
    """(the custom op for ``cls`` called with ``args``' non-tensor values, its _Kept, the tensor arguments)."""
    if any(isinstance(a, (list, tuple, dict)) and any(isinstance(x, torch.Tensor) for x in a) for a in args):
        raise KeptFunctionError("it takes tensors inside a list, tuple or dict")
    template = [_SLOT if isinstance(a, torch.Tensor) else a for a in args]
    constants = repr([t for t in template if t is not _SLOT]) + "".join("t" if t is _SLOT else "c" for t in template)
    base = re.sub(r"\W", "_", f"{cls.__module__}_{cls.__qualname__}")[-80:]
    name = f"{base}_{hashlib.sha256(constants.encode()).hexdigest()[:8]}"
    with _LOCK:
        if name not in _OPS:
            kept = _Kept(cls, template)

            def kernel(xs: list[torch.Tensor]) -> list[torch.Tensor]:
                return kept.kernel(xs)

            op = torch.library.custom_op(f"{NAMESPACE}::{name}", kernel, mutates_args=())
            op.register_fake(kernel)
            op.register_autograd(kept.backward, setup_context=kept.setup_context)
            _OPS[name] = (op, kept)
        op, kept = _OPS[name]
    return op, kept, [a for a in args if isinstance(a, torch.Tensor)]


def call_kept(cls: type, args: tuple):
    """``cls.apply(*args)`` through the kept op: the forward's outputs, one tensor or a tuple as the Function
    returns them (the op's further results, saved intermediates, stay with autograd)."""
    op, kept, tensors = kept_op(cls, args)
    result = op(tensors)
    n_out, _, _, as_tuple = kept.local.last
    return tuple(result[:n_out]) if as_tuple else result[0]


_ELEMENTWISE: set[type] = set()


def declare_elementwise(cls: type) -> type:
    """Declare that ``cls`` (a torch.autograd.Function) is elementwise over tensors of one shape (see the
    module doc): its kept op may run on shards. Returns ``cls``, so it also works as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"declare_elementwise takes a torch.autograd.Function subclass, not {cls!r}")
    _ELEMENTWISE.add(cls)
    return cls


def is_elementwise(target: object) -> bool:
    """True for the kept op (an OpOverload or its name, ``cauto_kept.<name>.default``) of a Function declared
    elementwise."""
    text = str(target)
    if not text.startswith(NAMESPACE + "."):
        return False
    entry = _OPS.get(text.split(".")[1])
    return entry is not None and entry[1].cls in _ELEMENTWISE
