"""Measure this machine and write a cauto cluster spec (JSON) for `cauto-solve --cluster FILE`.

    python tools/calibrate.py -o cpu-gloo.json [--world 4] [--quick]

What it measures (torch, gloo on loopback, one thread per rank):
* collectives: all-reduce, all-gather and reduce-scatter over ``--world`` spawned ranks for
  messages of 16 KiB .. 16 MiB; α (latency) and β (1/bandwidth) are fitted by least squares on the
  α-β model of cauto.solver.cost.reshard (all-gather/reduce-scatter α + β·B·(n−1)/n, all-reduce twice).
* device: matmul FLOP/s (median of square fp32 matmuls), memory bandwidth (large copies, bytes read
  plus written), kernel floor (median time of a tiny op called as the local program calls it, through
  its OpOverload), memory = physical RAM / world. Each is timed on ``--world`` ranks at once (the
  median over ranks): a step runs every rank at once, and ranks share cores when there are more
  ranks than cores.
All ranks of one host share one node, so the intra- and inter-node links are the same measurement.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "cauto-solver" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "cauto-plan" / "src"))
from cauto.solver.cluster import AxisLink, DeviceSpec, HardwareSpec, save_hardware  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _collectives(rank: int, world: int, port: int, sizes: list[int], repeats: int, out) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor collectives are what DTensor uses
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for nbytes in sizes:
        full = torch.zeros(nbytes // 4)
        shard = torch.zeros(nbytes // 4 // world)
        gathered = torch.zeros(nbytes // 4)

        def barrier_then(fn):
            def run():
                dist.barrier()
                fn()
            return run

        ops = {
            "all_reduce": lambda full=full: dist.all_reduce(full),
            "all_gather": lambda gathered=gathered, shard=shard: dist.all_gather_into_tensor(gathered, shard),
            "reduce_scatter": lambda full=full, shard=shard: dist.reduce_scatter_tensor(shard, full),
        }
        barrier = _time(dist.barrier, repeats)
        for name, fn in ops.items():
            rows.append((name, nbytes, max(0.0, _time(barrier_then(fn), repeats) - barrier)))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def measure_links(world: int, sizes: list[int], repeats: int) -> AxisLink:
    """Fit α, β of the α-β model on timed collectives; return the link."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_collectives, args=(r, world, port, sizes, repeats, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    a, y = [], []
    for name, nbytes, seconds in rows:
        factor = 2.0 if name == "all_reduce" else 1.0
        a.append([factor, factor * nbytes * (world - 1) / world])
        y.append(seconds)
    (alpha, beta), *_ = np.linalg.lstsq(np.array(a), np.array(y), rcond=None)
    alpha, beta = max(float(alpha), 1e-7), max(float(beta), 1e-13)
    print(f"collectives: alpha {alpha * 1e6:.1f} us, bandwidth {1 / beta / 1e9:.2f} GB/s "
          f"({len(rows)} timings, world {world})")
    return AxisLink(alpha, 1.0 / beta)


def _device_rank(rank: int, world: int, port: int, quick: bool, out) -> None:
    """One rank's device timings, taken while every other rank takes its own (as in a training step,
    where all ranks compute at once and share the machine's cores and memory bandwidth)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    n = 512 if quick else 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    big = torch.empty(16 << 20 if quick else 64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(big)
    x = torch.ones(1)
    add = torch.ops.aten.add.Tensor  # the local program calls each op through its OpOverload
    dist.barrier()
    flops = 2 * n**3 / _time(lambda: a @ b, 5 if quick else 10)
    dist.barrier()
    bandwidth = 2 * big.numel() / _time(lambda: dst.copy_(big), 5)
    dist.barrier()
    floor = _time(lambda: add(x, x), 200)
    out.put((rank, flops, bandwidth, floor))
    dist.barrier()
    dist.destroy_process_group()


def measure_device(world: int, quick: bool) -> DeviceSpec:
    """Matmul FLOP/s, copy bandwidth, kernel floor and memory share of one rank (one thread), each
    measured on ``world`` ranks at once (their median)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_device_rank, args=(r, world, port, quick, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=600) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
    flops, bandwidth, floor = (statistics.median(r[k] for r in rows) for k in (1, 2, 3))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"device ({world} ranks at once, {os.cpu_count()} cores): {flops / 1e9:.1f} GFLOP/s, "
          f"{bandwidth / 1e9:.1f} GB/s copy, floor {floor * 1e6:.1f} us, {ram / world / 2**30:.1f} GiB per rank")
    # the chunk manager's device arena and its host buffers are both RAM here: copies are the host link
    return DeviceSpec("cpu", int(ram // world), flops, bandwidth, floor, all_to_all=False,
                      host_link_bandwidth_bytes_per_s=bandwidth)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="cpu-gloo.json")
    parser.add_argument("--world", type=int, default=4, help="gloo ranks to measure collectives with")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about 10 s)")
    args = parser.parse_args()
    sizes = [1 << 14, 1 << 18, 1 << 22] if args.quick else [1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]
    link = measure_links(args.world, sizes, 3 if args.quick else 7)
    device = measure_device(args.world, args.quick)
    spec = HardwareSpec(f"cpu-gloo-{socket.gethostname()}", device, link, link, args.world)
    print(f"wrote {save_hardware(spec, args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
