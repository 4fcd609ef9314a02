"""Chunk layout, chunk-size search, tensor/chunk states and the physical arena."""

import pytest
import torch
from torch import nn

from cauto.runtime.chunks import (
    Arena,
    BudgetError,
    TensorState,
    build_layout,
    chunk_state,
    parse_bytes,
    search_chunk_elems,
)


def test_search_picks_least_padding():
    numels = [[1000, 1000, 1000, 1000, 3000]]

    def waste(size):
        params = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(numels[0])]
        return build_layout(params, [list(range(5))], size).waste_elems()

    best = search_chunk_elems(numels, max_elems=8192, step=1)
    assert best >= 3008
    assert waste(best) == min(waste(s) for s in range(3008, 8193))


def test_search_respects_largest_param_and_world_size():
    numels = [[5000, 10, 10], [300]]
    size = search_chunk_elems(numels, world_size=2, max_elems=20000, step=16)
    assert size >= 5000
    layout = build_layout([(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate([5000, 10, 10, 300])],
                          [[0, 1, 2], [3]], size, world_size=2)
    assert layout.num_chunks % 2 == 0


def test_layout_packs_groups_in_order_without_spanning():
    params = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate([30, 50, 20, 70, 10])]
    layout = build_layout(params, [[0, 2, 4], [1, 3]], chunk_elems=80)
    by_name = {s.name: s for s in layout.slots}
    assert [s.name for s in layout.slots] == ["p0", "p2", "p4", "p1", "p3"]
    for s in layout.slots:
        assert s.offset + s.numel <= 80 and s.offset % 16 == 0
        assert layout.chunk_group[s.chunk] == s.group
    assert by_name["p0"].chunk == by_name["p2"].chunk  # 32 + 20 fit in 80
    with pytest.raises(ValueError, match="more than the chunk size"):
        build_layout(params, [[0, 1, 2, 3, 4]], chunk_elems=60)


def test_chunk_state_derivation():
    S = TensorState
    assert chunk_state([S.HOLD_AFTER_BWD, S.COMPUTE]) is S.COMPUTE
    assert chunk_state([S.FREE, S.FREE]) is S.FREE
    assert chunk_state([S.HOLD_AFTER_BWD, S.HOLD_AFTER_BWD]) is S.HOLD_AFTER_BWD
    assert chunk_state([S.HOLD_AFTER_BWD, S.HOLD_AFTER_FWD]) is S.HOLD_AFTER_FWD
    assert chunk_state([S.HOLD, S.HOLD_AFTER_BWD]) is S.HOLD


def test_arena_is_a_hard_limit():
    arena = Arena(1024, torch.device("cpu"))
    a = arena.alloc(500)
    b = arena.alloc(500)
    assert a is not None and b is not None and arena.alloc(100) is None
    arena.free(a, 500)
    assert arena.alloc(400) == a
    assert arena.view(b, 10, torch.float32).data_ptr() == arena.buffer.data_ptr() + b


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("1.5MiB") == 3 * 2**19 and parse_bytes(7) == 7


def test_budget_error_is_loud():
    from cauto.runtime.chunks import wrap
    model, opt = wrap(lambda: nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), device_budget=4096,
                      device="cpu", chunk_elems=64 * 64 + 64)
    with pytest.raises(BudgetError, match="does not fit in the device arena"):
        model(torch.randn(2, 64)).sum().backward()
