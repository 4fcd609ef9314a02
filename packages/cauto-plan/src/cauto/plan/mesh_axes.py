"""The data-parallel mesh axes chunked state is ZeRO-sharded over (a plan's ``offload.mesh_axes``)."""

from __future__ import annotations

from collections.abc import Sequence


def data_parallel_axes(mesh_shape: Sequence[int], mesh_axes: Sequence[int] | None, *,
                       error: type[Exception] = ValueError) -> tuple[int, ...]:
    """The axes D chunks are ZeRO-sharded over, in mesh order: ``mesh_axes``, or every axis when None.

    Raises ``error`` (the caller's error type) for an empty list, an axis outside the mesh, or an
    axis named twice."""
    if mesh_axes is None:
        return tuple(range(len(mesh_shape)))
    axes = tuple(mesh_axes)
    if not axes:
        raise error("offload axes must name at least one mesh axis")
    bad = [a for a in axes if not isinstance(a, int) or isinstance(a, bool) or not 0 <= a < len(mesh_shape)]
    if bad:
        raise error(f"offload axis {bad[0]!r} is not an axis of the {len(mesh_shape)}-D mesh "
                    f"{tuple(mesh_shape)} (axes 0 to {len(mesh_shape) - 1})")
    if len(set(axes)) != len(axes):
        raise error(f"offload axes {list(axes)} name an axis twice")
    return tuple(sorted(axes))
