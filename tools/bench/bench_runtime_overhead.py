"""Where cauto's step time goes against DDP when the plan is the same: CPU time per phase, no collectives.

The runtime benchmark (bench_runtime.py) times 4 gloo ranks sharing this machine's 2 cores, so its
ratios carry the machine's load. Here one process plays rank 0 of a fake process group of 4 (real
per-rank shapes, collectives that do nothing; DDP gets a comm hook that returns its bucket), and
each phase of a training step is timed in thread CPU time: what the rank itself computes, which is
what differs between the two when the plan is data parallel (cauto: the captured aten graph on
DTensors; DDP: the eager model on plain tensors). AdamW once with torch's CPU default (one
parameter at a time) and once with ``foreach=True`` (one multi-tensor op per group).

    python tools/bench/bench_runtime_overhead.py [--rounds 8] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

WORLD = 4
PHASES = ("forward", "backward", "optimizer", "step")


def run(rounds: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cauto.profiler import profile
    from cauto.profiler.graphdoc import build_graph_document
    from cauto.profiler.zoo import gpt
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh
    from cauto.solver import cluster_for_mesh, solve

    torch.set_num_threads(1)
    fn = lambda: gpt(batch=16, seq=128, vocab=2048, dim=256, layers=4, heads=8)  # noqa: E731 (bench_runtime's model)
    plan = solve(build_graph_document(profile(fn)), cluster_for_mesh("cpu-gloo", (WORLD,)))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    mesh = make_mesh((WORLD,), ("dp",))
    _, batch = fn()
    local = {k: v.chunk(WORLD)[0] for k, v in batch.items()}
    results = {}
    for foreach in (None, True):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(fn()[0])

        def returned(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, returned)
        models = {"cauto": (apply(fn, plan, mesh, seed=0), batch), "DDP": (ddp, local)}
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=foreach) for k, (m, _) in models.items()}
        times = {k: [] for k in models}
        for r in range(rounds + 1):  # round 0 warms up (and creates the optimizer state)
            for name, (model, inputs) in models.items():
                t0 = time.thread_time()
                loss = model(**inputs)
                t1 = time.thread_time()
                loss.backward()
                t2 = time.thread_time()
                opts[name].step()
                t3 = time.thread_time()
                opts[name].zero_grad()
                if r:
                    times[name].append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        results["default" if foreach is None else "foreach"] = {
            k: [statistics.median(x[i] for x in v) * 1e3 for i in range(len(PHASES))] for k, v in times.items()}
    dist.destroy_process_group()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--write", action="store_true", help="update tools/bench/RESULTS.md")
    args = ap.parse_args()
    res = run(args.rounds)
    rows = ["| AdamW | setup | forward ms | backward ms | optimizer ms | step ms | step / DDP |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for opt, per in res.items():
        for name, ms in per.items():
            rows.append(f"| {opt} | {name} | " + " | ".join(f"{x:.1f}" for x in ms)
                        + f" | {ms[-1] / per['DDP'][-1]:.2f} |")
    body = ("Command: `python tools/bench/bench_runtime_overhead.py --write`\n\n"
            f"bench_runtime.py's GPT and cauto plan; one process as rank 0 of a fake process group of {WORLD} "
            "(collectives do nothing; DDP's comm hook returns its bucket), thread CPU time per phase, medians of "
            f"{args.rounds} steps after a warm-up. AdamW `default`: torch's CPU default (one parameter at a "
            "time); `foreach`: `foreach=True`.\n\n" + "\n".join(rows) + "\n\n"
            "Why DDP beats cauto's plan in the runtime benchmark although the plan is DDP's (inputs split on the "
            "batch, parameters replicated, gradients all-reduced in one bucket): cauto runs every aten op of the "
            "captured graph, forward and backward, on DTensors, and each DTensor op pays a fixed CPU cost for "
            "sharding propagation and wrapping (tens of microseconds here; a profile of this setup put it at about "
            "1,100 dispatches per step with the default AdamW); DDP's ops run on plain tensors. Collectives do not "
            "explain it (they do nothing here). The solver's cost model charges a kernel floor per op, the same for "
            "every plan, and nothing for the optimizer, so it cannot see this cost, and no plan in its space avoids "
            "it: it is the runtime's, not the plan's. With 4 ranks on 2 cores, the ranks' CPU time becomes wall time.")
    print(body)
    if args.write:
        from results_md import replace_section  # tools/bench/, next to this script

        replace_section("Runtime overhead: cauto vs DDP without collectives", body)


if __name__ == "__main__":
    main()
