"""Marks on the exported graph for the regions a model checkpoints itself (torch.utils.checkpoint).

Nodes created inside a non-reentrant ``torch.utils.checkpoint`` call carry ``CHECKPOINT_KEY`` in
their meta (one number per outermost checkpoint call), so capture and the ground-truth run can tell
which activations the model recomputes.
"""

from __future__ import annotations

import contextlib
import itertools

CHECKPOINT_KEY = "cauto_checkpoint"


@contextlib.contextmanager
def mark_checkpoints():
    """While exporting, tag nodes created inside non-reentrant torch.utils.checkpoint calls."""
    import torch.fx.traceback as fx_traceback
    import torch.utils.checkpoint as ckpt

    original = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    if original is None or not hasattr(fx_traceback, "annotate"):  # older torch: no marks, no recomputation
        yield
        return
    counter = itertools.count()
    depth = [0]

    def marked(*args, **kwargs):
        gen = original(*args, **kwargs)
        if depth[0]:
            yield from gen
            return
        depth[0] += 1
        try:
            with fx_traceback.annotate({CHECKPOINT_KEY: next(counter)}):
                yield from gen
        finally:
            depth[0] -= 1

    ckpt._checkpoint_without_reentrant_generator = marked
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        ckpt._checkpoint_without_reentrant_generator = original
