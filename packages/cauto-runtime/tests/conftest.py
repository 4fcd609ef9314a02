"""Shared helpers: plans built on a fake process group, and rank processes with timeouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from cauto.runtime.handplan import make_plan  # noqa: E402

_CAPTURES: dict = {}


def zoo_capture(model: str, kwargs: dict):
    """A cached capture of a zoo factory."""
    from cauto.profiler import capture, zoo
    key = (model, json.dumps(kwargs, sort_keys=True))
    if key not in _CAPTURES:
        _CAPTURES[key] = capture(lambda: zoo.ZOO[model](**kwargs))
    return _CAPTURES[key]


def fake_world(world: int):
    """Make the default group a fake one of ``world`` ranks (planning and shape checks only)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        if dist.get_world_size() == world and dist.get_backend() == "fake":
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def plan_for(model: str, kwargs: dict, mesh_shape, axis_names, **placement) -> dict:
    """A plan document for a zoo model on a mesh (see cauto.runtime.handplan.make_plan for ``placement``)."""
    from cauto.runtime.dist_utils import make_mesh
    world = 1
    for s in mesh_shape:
        world *= s
    fake_world(world)
    cap = zoo_capture(model, kwargs)
    return make_plan(cap, make_mesh(mesh_shape, axis_names), **placement)


def run_ranks(world: int, jobs: list[dict], tmp: Path, timeout_s: float = 240) -> list[dict]:
    """Run ``jobs`` on ``world`` gloo ranks (tests/workers.py); return each rank's results. Never hangs."""
    from cauto.runtime.dist_utils import free_port
    jobs_path = tmp / "jobs.json"
    jobs_path.write_text(json.dumps(jobs))
    out = tmp / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(HERE / "workers.py"), str(r), str(world), port, str(jobs_path),
                               str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{world} ranks did not finish in {timeout_s} s")
    for r, p in enumerate(procs):
        if p.returncode != 0:
            pytest.fail(f"rank {r} exited with {p.returncode}:\n{logs[r][-3000:]}")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


@pytest.fixture(autouse=True, scope="module")
def _no_fake_world_left():
    """A fake default group left by one module (fake_world) would make the next one's chunk
    manager run ZeRO over fake collectives: tear it down after every module."""
    yield
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
