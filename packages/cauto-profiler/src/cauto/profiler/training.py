"""The training step that the profiler simulates and the ground truth measures: one definition.

Both the symbolic profiler (fake tensors) and the real measurement (``ground_truth``) run
:func:`run_steps`, so the order of allocations and frees is the same by construction: forward,
``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``, with the
previous step's loss alive until the next forward has produced its own (as in a plain loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

OPTIMIZERS = ("adamw", "adam", "sgd", "none")


def make_optimizer(name: str, params: Iterable[torch.Tensor], *, device: str = "cpu") -> torch.optim.Optimizer | None:
    """The optimizer a plain training loop on ``device`` uses, with its default settings.

    ``foreach`` is passed explicitly: PyTorch picks the foreach path only for CUDA tensors, and
    under FakeTensorMode it silently falls back to the per-parameter loop unless told. On CPU the
    real default is the per-parameter loop (foreach=False); on CUDA it is foreach=True.
    """
    params = list(params)
    foreach = device == "cuda"
    name = name.lower()
    if name == "none":
        return None
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=foreach)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


Mark = Callable[[str, int], None]


def run_steps(forward: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer | None, *, steps: int = 2,
              train: bool = True, mark: Mark | None = None) -> None:
    """Run ``steps`` training steps (or forward passes under no_grad when not ``train``).

    ``mark(phase, step)`` is called at the start of each phase ('forward', 'backward', 'optimizer',
    'zero_grad'), and once with ('end', steps) at the end.
    """
    mark = mark or (lambda phase, step: None)
    loss = None
    for step in range(1, steps + 1):
        mark("forward", step)
        if train:
            loss = forward()
            mark("backward", step)
            loss.backward()
            if optimizer is not None:
                mark("optimizer", step)
                optimizer.step()
                mark("zero_grad", step)
                optimizer.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                loss = forward()
    mark("end", steps)
    del loss


def cast_inputs(inputs: object, dtype: torch.dtype | None) -> object:
    """Cast floating-point tensors among the example inputs to ``dtype`` (integer ids stay)."""
    if dtype is None:
        return inputs
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                           inputs)


def with_dtype(fn: Callable, dtype: torch.dtype | None) -> Callable:
    """A factory that builds ``fn()`` and casts the model and floating inputs to ``dtype``."""
    if dtype is None:
        return fn

    def cast_factory():
        model, inputs = fn()
        return model.to(dtype), cast_inputs(inputs, dtype)

    cast_factory.__name__ = getattr(fn, "__name__", "factory")
    return cast_factory


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied parameters count once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        key = st._cdata
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total
