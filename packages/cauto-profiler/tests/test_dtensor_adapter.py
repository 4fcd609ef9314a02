"""The DTensor adapter reports what DTensor did: redistributions, collectives, output placements."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from cauto.profiler.dtensor_adapter import fake_mesh, placement_is, sharded_call, to_dtensor

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def mesh():
    created = not dist.is_initialized()
    yield fake_mesh((2,))
    if created:
        dist.destroy_process_group()


def test_sharded_call_reports_outputs_and_redistributions(mesh):
    x = torch.randn(4, 6)
    same = sharded_call(torch.add, [to_dtensor(x, Shard(0), mesh), to_dtensor(x, Shard(0), mesh)], {})
    assert same.redistributed is None and same.error is None and same.collectives == 0
    assert [p[0] for p in same.output_placements] == [Shard(0)]
    assert to_dtensor(x, Shard(1), mesh).to_local().shape == (4, 3)
    # mixing shardings makes DTensor redistribute; even Replicate -> Shard (a local slice) counts
    mixed = sharded_call(torch.add, [to_dtensor(x, Shard(0), mesh), to_dtensor(x, Shard(1), mesh)], {})
    assert mixed.redistributed and not mixed.output_placements
    free = sharded_call(torch.add, [to_dtensor(x, Shard(0), mesh), to_dtensor(x, Replicate(), mesh)], {})
    assert free.redistributed and free.collectives == 0
    row = sharded_call(torch.mm, [to_dtensor(x, Shard(1), mesh), to_dtensor(x.t(), Shard(0), mesh)], {})
    assert [p[0] for p in row.output_placements] == [Partial("sum")]
    # a collective run inside the call is counted
    reduced = sharded_call(lambda t: t.full_tensor(), [to_dtensor(x, Shard(0), mesh)], {})
    assert reduced.collectives == 1
    broken = sharded_call(lambda t: t.no_such_method(), [to_dtensor(x, Shard(0), mesh)], {})
    assert broken.error and "AttributeError" in broken.error


def test_two_dimensional_mesh(mesh):
    grid = fake_mesh((2, 2))
    x = torch.randn(8, 6)
    nested = to_dtensor(x, [Shard(0), Shard(0)], grid)
    assert nested.to_local().shape == (2, 6)
    both = sharded_call(torch.add, [nested, to_dtensor(x, [Shard(0), Shard(0)], grid)], {})
    assert both.output_placements == [(Shard(0), Shard(0))] and not both.redistributed


def test_placement_is():
    assert placement_is(Shard(1), "S", 1) and not placement_is(Shard(1), "S", 0)
    assert placement_is(Replicate(), "R") and not placement_is(Shard(0), "R")
    assert placement_is(Partial("avg"), "P", reduce="avg") and not placement_is(Partial(), "P", reduce="avg")
