"""Shared helpers: small clusters with round numbers, so tests do not depend on preset tuning."""

from __future__ import annotations

import pytest

from cauto.solver.cluster import AxisLink, DeviceSpec, HardwareSpec, cluster_for_mesh

#: a device where each collective and kernel costs at least 100 us (DTensor dispatch on a CPU)
TEST_HARDWARE = HardwareSpec("test", DeviceSpec("test", 64 << 30, 1e12, 1e11, 1e-4),
                             AxisLink(1e-5, 1e10), AxisLink(1e-5, 1e10), 8)


def _make_cluster(*shape: int, names: tuple[str, ...] | None = None, hardware: HardwareSpec = TEST_HARDWARE):
    return cluster_for_mesh(hardware, tuple(shape), names)


@pytest.fixture
def make_cluster():
    """make_cluster(*mesh_shape, names=None): a ClusterSpec on the test hardware."""
    return _make_cluster
