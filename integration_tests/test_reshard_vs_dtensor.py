"""cauto.solver's resharding planner issues the same collectives as DTensor's ``redistribute``.

For many placement pairs on 1-D and 2-D meshes (nested shards, Shard(d) -> Shard(d'), Partial on
several axes), redistribute a DTensor under CommDebugMode on torch's fake process group (one
process, world size 4) and compare the collectives counted per type with what
``cauto.solver.cost.reshard.reshard`` predicts for the same pair.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

from cauto.solver.cost.reshard import reshard  # noqa: E402

WORLD = 4
SHAPE = (8, 8, 4)
LINKS = ((1e-5, 1e9), (1e-5, 1e9))


@pytest.fixture(scope="module")
def meshes():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield {1: init_device_mesh("cpu", (WORLD,)), 2: init_device_mesh("cpu", (2, 2))}
    dist.destroy_process_group()


def _placement(text: str):
    if text == "R":
        return Replicate()
    if text.startswith("S("):
        return Shard(int(text[2:-1]))
    return Partial(text[2:-1])


def _dtensor(mesh, placements: tuple[str, ...]) -> DTensor:
    local = list(SHAPE)
    for p, n in zip(placements, mesh.shape):
        if p.startswith("S("):
            local[int(p[2:-1])] //= n
    return DTensor.from_local(torch.zeros(local), mesh, [_placement(p) for p in placements], run_check=False,
                              shape=torch.Size(SHAPE), stride=torch.empty(SHAPE).stride())


_NAMES = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce",
          "all_to_all": "all_to_all"}


def _dtensor_counts(mesh, src, dst) -> Counter:
    t = _dtensor(mesh, src)
    with CommDebugMode() as comm:
        t.redistribute(mesh, [_placement(p) for p in dst])
    counts = Counter()
    for op, n in comm.get_comm_counts().items():
        name = str(op)
        for key, ours in _NAMES.items():
            if key in name:
                counts[ours] += n
                break
        else:
            counts[name] += n
    return counts


def _ours(mesh_shape, src, dst) -> Counter:
    # a CPU mesh: DTensor replaces all-to-all by all-gather + chunk there
    return Counter(c.op for c in reshard(tuple(src), tuple(dst), 4 * 8 * 8 * 4, tuple(mesh_shape),
                                          LINKS[: len(mesh_shape)], all_to_all=False))


def _allowed(src, dst) -> bool:
    """Public redistribute refuses to make a Partial (plans never ask for one)."""
    return all(d == s for s, d in zip(src, dst) if d.startswith("P("))


ONE_AXIS = ["R", "S(0)", "S(1)", "S(2)", "P(sum)"]
PAIRS_1D = [((a,), (b,)) for a, b in itertools.product(ONE_AXIS, ONE_AXIS) if _allowed((a,), (b,))]
TWO_AXES = list(itertools.product(["R", "S(0)", "S(1)", "P(sum)"], repeat=2))
PAIRS_2D = [(a, b) for a, b in itertools.product(TWO_AXES, TWO_AXES) if _allowed(a, b)]


@pytest.mark.parametrize("src,dst", PAIRS_1D, ids=[f"{a[0]}->{b[0]}" for a, b in PAIRS_1D])
def test_one_dim_mesh(meshes, src, dst):
    assert _ours((WORLD,), src, dst) == _dtensor_counts(meshes[1], src, dst)


@pytest.mark.parametrize("src,dst", PAIRS_2D, ids=[f"{','.join(a)}->{','.join(b)}" for a, b in PAIRS_2D])
def test_two_dim_mesh(meshes, src, dst):
    assert _ours((2, 2), src, dst) == _dtensor_counts(meshes[2], src, dst)


BACKWARD = [  # (forward src, forward dst, gradient arriving at dst)
    (("S(0)",), ("R",), ("P(sum)",)),      # ZeRO weight: all-gather forward, reduce-scatter backward
    (("S(0)",), ("R",), ("R",)),           # gradient already whole: local slice
    (("P(sum)",), ("R",), ("R",)),         # backward of all-reduce: nothing (Partial source -> Replicate)
    (("S(0)",), ("S(1)",), ("S(1)",)),     # transposed re-shard
    (("S(0)", "R"), ("R", "R"), ("P(sum)", "P(sum)")),
    (("R", "S(1)"), ("S(0)", "R"), ("S(0)", "P(sum)")),
    (("P(sum)", "S(0)"), ("R", "R"), ("R", "P(sum)")),
]


@pytest.mark.parametrize("src,dst,grad", BACKWARD, ids=[f"{','.join(a)}->{','.join(b)}|{','.join(g)}"
                                                         for a, b, g in BACKWARD])
def test_backward_of_redistribute(meshes, src, dst, grad):
    from cauto.solver.cost.reshard import backward_target

    mesh = meshes[len(src)]
    x = _dtensor(mesh, src).requires_grad_(True)
    y = x.redistribute(mesh, [_placement(p) for p in dst])
    g = _dtensor(mesh, grad)
    with CommDebugMode() as comm:
        y.backward(g)
    counts = Counter()
    for op, n in comm.get_comm_counts().items():
        counts[next((k for k in _NAMES if k in str(op)), str(op))] += n
    assert _ours(tuple(mesh.shape), grad, backward_target(grad, src)) == counts
