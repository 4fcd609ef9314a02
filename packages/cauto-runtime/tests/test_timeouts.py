"""Every process group of a launched job gets the collective timeout, the mesh's own groups included
(torch gives a 2-D mesh's groups its default, 30 min on gloo, whatever the default group's is)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent("""
    import torch
    from cauto.runtime.dist_utils import init_distributed, make_mesh
    init_distributed(7.0)
    mesh = make_mesh((2, 2), ("dp", "tp"))
    for axis in range(2):
        timeout = mesh.get_group(axis)._get_backend(torch.device("cpu")).options._timeout
        assert timeout.total_seconds() == 7.0, (axis, timeout)
    print("OK", flush=True)
""")


def test_a_2d_mesh_s_groups_get_the_job_s_timeout(tmp_path):
    from cauto.runtime.dist_utils import free_port

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          f"--master-port={free_port()}", str(script)], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0 and res.stdout.count("OK") == 4, res.stdout[-2000:] + res.stderr[-3000:]
