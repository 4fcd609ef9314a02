"""Chunk layout arithmetic shared by the solver's offload model and the runtime's chunk manager.

Parameters are packed in order, one optimizer parameter group at a time, into chunks of one fixed
number of elements; a parameter never spans two chunks and starts ``ALIGN_ELEMS`` aligned (64 bytes
of fp32). The chunk count is padded to a multiple of the process group's size (ZeRO: every rank owns
the same number of chunks). The solver predicts with exactly the chunk size the runtime picks:
both call ``default_chunk_elems``.
"""

from __future__ import annotations

ALIGN_ELEMS = 16  # 64 bytes of fp32


def aligned_elems(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN_ELEMS: the room a parameter of ``n`` elements takes."""
    return (n + ALIGN_ELEMS - 1) // ALIGN_ELEMS * ALIGN_ELEMS


def chunk_indices(group_numels: list[list[int]], chunk_elems: int) -> list[list[int]]:
    """The chunk each parameter of each group (element counts, in order) is packed into, in order (a
    parameter larger than a chunk takes one of its own: the search never tries such a size, and the
    runtime's layout refuses it)."""
    out, count = [], 0
    for numels in group_numels:
        used = None
        indices = []
        for n in numels:
            if used is None or used + n > chunk_elems:
                count += 1
                used = 0
            used += aligned_elems(n)
            indices.append(count - 1)
        out.append(indices)
    return out


def count_chunks(group_numels: list[list[int]], chunk_elems: int, world_size: int = 1) -> int:
    """Chunks of the parameters of each group packed in order (``chunk_indices``), padded to a multiple
    of ``world_size``."""
    count = 1 + max((i for indices in chunk_indices(group_numels, chunk_elems) for i in indices), default=-1)
    return -(-count // world_size) * world_size


def search_chunk_elems(group_numels: list[list[int]], world_size: int = 1, min_elems: int = 0,
                       max_elems: int | None = None, step: int = 1024) -> int:
    """Return the chunk size (elements) in ``[max(largest param, min_elems), max_elems]`` whose
    layout wastes the fewest padding elements (chunk count padded to a multiple of world_size);
    ties go to the smaller chunk, which pages at a finer grain."""
    largest = max((n for numels in group_numels for n in numels), default=1)
    lo = max(aligned_elems(largest), min_elems, ALIGN_ELEMS)
    total = sum(n for numels in group_numels for n in numels)
    hi = max(lo, max_elems if max_elems is not None else sum(aligned_elems(n) for ns in group_numels for n in ns))
    best, best_waste = lo, None
    size = lo
    while size <= hi:
        waste = count_chunks(group_numels, size, world_size) * size - total
        if best_waste is None or waste < best_waste:
            best, best_waste = size, waste
        size = (size // step + 1) * step
    return best


def default_chunk_elems(group_numels: list[list[int]], world_size: int, budget_bytes: int,
                        bytes_per_elem: int) -> int:
    """The chunk size the runtime picks when none is given: the search up to an eighth of the device
    budget per chunk (``bytes_per_elem``: a parameter chunk's and its gradient chunk's bytes per element),
    at most the whole model, in steps of 1024 elements or 1/2000 of that bound."""
    hi = min(sum(map(sum, group_numels)), max(budget_bytes // (8 * bytes_per_elem), 1))
    return search_chunk_elems(group_numels, world_size, max_elems=hi, step=max(1024, hi // 2000))
