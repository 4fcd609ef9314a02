"""Shared pure helpers: byte sizes, chunk layout arithmetic, data-parallel axes."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cauto.plan.chunking import count_chunks, default_chunk_elems, search_chunk_elems
from cauto.plan.mesh_axes import data_parallel_axes
from cauto.plan.units import ByteSizeError, format_bytes, parse_bytes

#: the two rules parse_bytes replaced (solver CLI; runtime chunk manager): every size either accepted
#: is still accepted, with the same bytes
_CLI_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _cli_rule(text):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _CLI_UNITS:
        return None
    return int(float(m.group(1)) * _CLI_UNITS[m.group(2).lower()])


@pytest.mark.parametrize("text", ["70GiB", "1.5 MiB", "80GB", "1e9", " 512mib ", "7", "3MB", "8KiB", "2 tb", "0",
                                  ".5GiB", "12b", "1E9", "-1GiB"])
def test_parse_bytes_keeps_every_old_size(text):
    expected = _cli_rule(text)
    if expected is None:  # the runtime's rule: suffix unit, the rest read by float()
        low = text.strip().lower()
        unit = next((u for u in ("kib", "mib", "gib", "tib", "kb", "mb", "gb", "tb", "b") if low.endswith(u)), "")
        expected = int(float(low[: len(low) - len(unit)]) * (_CLI_UNITS[unit] if unit else 1))
    assert parse_bytes(text) == expected
    assert parse_bytes(7) == 7


@given(st.from_regex(r"\s*[0-9]{0,4}\.?[0-9]{1,4}(e[0-9])?\s*(|b|kb|MB|gB|tb|KiB|mib|GIB|tib)\s*", fullmatch=True))
def test_parse_bytes_agrees_with_the_cli_rule(text):
    assert parse_bytes(text) == _cli_rule(text)


@pytest.mark.parametrize("bad", ["", "GiB", "70 GB extra", "inf", "nan", "seventy", "1e999GiB"])
def test_parse_bytes_refuses(bad):
    with pytest.raises(ByteSizeError, match="is not a size like 70GiB"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(3 << 29) == "1.50 GiB"
    assert format_bytes(1536, digits=1, plain_unit="bytes") == "1.5 KiB"
    assert format_bytes(100, digits=1, plain_unit="bytes") == "100 bytes"
    assert format_bytes(2 << 40) == "2048.00 GiB" and format_bytes(2 << 40, largest="TiB") == "2.00 TiB"
    # a fixed unit at any size (the solver's error text, the memory SVG's labels)
    assert format_bytes(400 << 10, digits=1, unit="MiB") == "0.4 MiB"
    assert format_bytes(5 << 30, digits=1, unit="MiB", grouping=True) == "5,120.0 MiB"


def _old_solver_chunk_elems(numels, group_size, budget_bytes):
    def aligned(n):
        return (n + 15) // 16 * 16

    def count(size):
        c, used = 0, None
        for n in numels:
            if used is None or used + n > size:
                c, used = c + 1, 0
            used += aligned(n)
        return -(-c // group_size) * group_size

    total = sum(numels)
    hi = min(total, max(budget_bytes // 64, 1))
    step = max(1024, hi // 2000)
    lo = max(aligned(max(numels, default=1)), 16)
    hi = max(lo, hi)
    best, best_waste, size = lo, None, lo
    while size <= hi:
        waste = count(size) * size - total
        if best_waste is None or waste < best_waste:
            best, best_waste = size, waste
        size = (size // step + 1) * step
    return best


@given(st.lists(st.integers(1, 5000), max_size=30), st.sampled_from([1, 2, 4, 8]), st.integers(1, 1 << 22))
def test_default_chunk_size_is_the_old_solver_rule(numels, group_size, budget_bytes):
    assert default_chunk_elems([numels], group_size, budget_bytes, 8) == \
        _old_solver_chunk_elems(numels, group_size, budget_bytes)


def test_chunk_search():
    assert count_chunks([[1000, 1000, 1000]], 1008, 2) == 4
    assert search_chunk_elems([[100] * 10], max_elems=1200, step=1) == 212  # 2 per chunk: 100 + 112 aligned


def test_data_parallel_axes():
    assert data_parallel_axes((2, 2), None) == (0, 1)
    assert data_parallel_axes((2, 2), [1, 0]) == (0, 1)
    for bad, says in (([], "at least one"), ([2], "not an axis"), ([0, 0], "twice")):
        with pytest.raises(KeyError, match=says):
            data_parallel_axes((2, 2), bad, error=KeyError)
