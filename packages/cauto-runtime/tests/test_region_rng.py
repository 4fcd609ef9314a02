"""A checkpoint region replays the random generators only when it draws from them."""

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from cauto.runtime.ops import checkpointed, draws_random


def _region(fn, *example):
    return make_fx(fn)(*example)


def test_a_region_with_dropout_draws_random_and_one_without_does_not():
    x = torch.randn(8, 16)
    assert draws_random(_region(lambda t: F.dropout(t.relu(), 0.5, training=True), x))
    assert not draws_random(_region(lambda t: (t.relu() * 2).sum(-1), x))


def test_a_nested_region_with_dropout_counts_for_its_parent():
    x = torch.randn(8, 16)
    parent = torch.nn.Module()
    parent.add_module("inner", _region(lambda t: F.dropout(t, 0.5, training=True), x))
    assert draws_random(parent)


def test_recomputing_a_region_with_dropout_replays_the_same_mask():
    x = torch.randn(64, 32, requires_grad=True)
    region = _region(lambda t: F.dropout(t * 3, 0.5, training=True), x)
    torch.manual_seed(0)
    out = checkpointed(region, x)
    out.sum().backward()
    # the gradient is 3 * mask / (1 - p): the recomputed mask equals the forward's
    kept = out.detach() != 0
    assert torch.equal(x.grad != 0, kept)
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 6.0))


def _allocations_of_forward(run) -> list[int]:
    from torch._C._profiler import _EventType

    from cauto.profiler.memory_session import memory_session

    with memory_session() as prof:
        out = run()
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.alloc_size > 0:
            sizes.append(node.extra_fields.alloc_size)
    out.sum().backward()
    return sizes


def test_a_region_without_random_ops_saves_no_generator_state():
    x = torch.randn(64, 32, requires_grad=True)
    region = _region(lambda t: (t * 3).relu(), x)
    state_bytes = torch.get_rng_state().nbytes
    # torch.utils.checkpoint's default holds the CPU generator's state from forward to backward
    default = _allocations_of_forward(lambda: torch.utils.checkpoint.checkpoint(region.forward, x, use_reentrant=False))
    assert state_bytes in default
    assert state_bytes not in _allocations_of_forward(lambda: checkpointed(region, x))
    assert torch.equal(x.grad, 2 * (x > 0).float() * 3)  # both backward passes ran
