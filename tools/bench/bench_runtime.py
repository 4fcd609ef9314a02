"""cauto's runtime against hand-written DDP, FSDP2 (fully_shard) and Megatron TP on the zoo GPT, 4 CPU ranks.

One run of 4 gloo ranks holds all four models; each round times one training step of each in turn
(AdamW, the same global batch), so machine noise hits all alike; medians over the rounds after a
warm-up. Per-rank peak memory: live bytes of model state plus the peak of allocations during one
step (``cauto.runtime.verify``: torch.profiler allocation events, freed-on-gloo-thread blocks
detected by address reuse).

The cauto plan is ``--plan plan.json`` if given, else the solver's plan for this mesh when
cauto-solver and the profiler's graph export work, else a hand-made data-parallel plan
(``cauto.runtime.handplan``: inputs S(0), parameters replicated).

    python tools/bench/bench_runtime.py [--dim 256 --layers 4 --seq 128 --batch 16 --rounds 5] [--plan p.json] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

WORLD = 4


def factory(args):
    from cauto.profiler.zoo import gpt
    return lambda: gpt(batch=args.batch, seq=args.seq, vocab=args.vocab, dim=args.dim, layers=args.layers,
                       heads=args.heads)


def make_cauto_plan(args, fn) -> tuple[str, str]:
    """Write the plan the benchmark runs to a file; return (path, where it came from)."""
    if args.plan:
        return args.plan, f"given ({args.plan})"
    path = os.path.join(tempfile.mkdtemp(prefix="bench_runtime_"), "plan.json")
    from cauto.plan import dump
    try:
        from cauto.profiler import profile
        from cauto.profiler.graphdoc import build_graph_document
        from cauto.solver import cluster_for_mesh, solve
        dump(solve(build_graph_document(profile(fn)), cluster_for_mesh("cpu-gloo", (WORLD,))), path)
        return path, "cauto-solver (cpu-gloo preset, no memory budget)"
    except Exception as exc:  # the solver is optional here; say why it was not used
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from cauto.profiler import capture
        from cauto.runtime.dist_utils import make_mesh
        from cauto.runtime.handplan import make_plan
        print(f"solver plan unavailable ({type(exc).__name__}: {str(exc)[:120]}); using a hand-made DP plan",
              file=sys.stderr)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
        dump(make_plan(capture(fn), make_mesh((WORLD,), ("dp",)), inputs="S(0)"), path)
        dist.destroy_process_group()
        return path, "hand-made data parallel (cauto.runtime.handplan)"


def build_all(args, mesh):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    from cauto.runtime.apply import apply

    fn = factory(args)
    rank = dist.get_rank()
    torch.manual_seed(0)
    _, batch = fn()
    local = {k: v.chunk(WORLD)[rank] for k, v in batch.items()}
    models = {"cauto": (apply(fn, args.plan, mesh, seed=0), batch)}
    torch.manual_seed(0)
    models["DDP"] = (DistributedDataParallel(fn()[0]), local)
    torch.manual_seed(0)
    m = fn()[0]
    for block in m.blocks:
        fully_shard(block)
    models["FSDP2"] = (fully_shard(m), local)
    torch.manual_seed(0)
    m = fn()[0]
    for block in m.blocks:
        block.attn.heads //= WORLD
        block.attn.kv_heads //= WORLD
        parallelize_module(block, mesh, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                         "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                         "fc": ColwiseParallel(), "out": RowwiseParallel()})
    models["Megatron TP"] = (m, batch)
    return models


def worker(args) -> None:
    import torch.distributed as dist

    from cauto.runtime.dist_utils import make_mesh
    from cauto.runtime.verify import live_state_bytes, step_allocation_peak, verify_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    mesh = make_mesh((WORLD,), ("dp",))
    models = build_all(args, mesh)
    # foreach: one multi-tensor op per parameter group (torch's CPU default steps one parameter at a time,
    # which on DTensor parameters pays the per-op dispatch once per parameter; bench_runtime_overhead.py).
    # Not where plain tensors and DTensors mix (Megatron TP leaves the embeddings plain): foreach refuses.
    from torch.distributed.tensor import DTensor

    def uniform(m):
        return len({isinstance(p, DTensor) for p in m.parameters()}) == 1

    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=uniform(m) or None) for k, (m, _) in models.items()}

    def step(name):
        model, inputs = models[name]
        loss = model(**inputs)
        loss.backward()
        opts[name].step()
        opts[name].zero_grad()

    times = {k: [] for k in models}
    for r in range(args.rounds + 1):
        for name in models:
            dist.barrier()
            start = time.perf_counter()
            step(name)
            dist.barrier()
            if r:
                times[name].append(time.perf_counter() - start)
    peaks = {}
    for name, (model, _) in models.items():
        base = live_state_bytes(model, opts[name])
        peaks[name] = base + step_allocation_peak(lambda name=name: step(name))
    report = verify_step(models["cauto"][0], ((), models["cauto"][1]), opts["cauto"])
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, peaks)
    if dist.get_rank() == 0:
        gm = models["cauto"][0].executable.module
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        runtime_ops = sum(1 for n in calls if getattr(n.target, "__module__", "") == "cauto.runtime.ops")
        out = {"graph_ops": [len(calls) - runtime_ops, runtime_ops], "verify": report, "times": {k: statistics.median(v) for k, v in times.items()},
               "peaks": {k: max(g[k] for g in gathered) for k in peaks}}
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plan", default=None)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from cauto.runtime.dist_utils import free_port
    plan_path, source = make_cauto_plan(args, factory(args))
    argv = [a for a in sys.argv[1:] if a != "--write" and a != args.plan and a != "--plan"] + ["--plan", plan_path]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker"], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    line = next((ln for ln in logs[0].splitlines() if ln.startswith("RESULT ")), None)
    if line is None or any(p.returncode for p in procs):
        sys.exit("benchmark failed:\n" + "\n".join(log[-3000:] for log in logs))
    res = json.loads(line[len("RESULT "):])
    base = res["times"]["cauto"]
    rows = ["| setup | step time (s) | time / cauto | peak per rank (MiB) |", "|---|---:|---:|---:|"]
    for name, t in res["times"].items():
        rows.append(f"| {name} | {t:.3f} | {t / base:.2f} | {res['peaks'][name] / 2**20:.1f} |")
    body = (f"Command: `python tools/bench/bench_runtime.py --write`\n\nZoo GPT dim {args.dim}, {args.layers} layers, "
            f"{args.heads} heads, vocab {args.vocab}, seq {args.seq}, global batch {args.batch}; 4 gloo ranks on this "
            f"machine, AdamW (foreach=True except Megatron TP, whose plain and DTensor parameters foreach refuses), medians of {args.rounds} steps after a warm-up, each round runs one step of each setup "
            f"in turn. cauto plan: {source}. DDP/FSDP2 ranks take a quarter of the batch; Megatron TP ranks "
            f"take all of it (4-way tensor parallel).\n\n" + "\n".join(rows))
    from cauto.runtime.verify import format_report
    pk = res["verify"]["peak_bytes"]
    body += (f"\n\ncauto `--verify` on rank 0 (predicted by the plan vs executed/measured):\n\n```\n"
             f"{format_report(res['verify'])}\n```\n\nPredicted peak per rank {pk['predicted'] / 2**20:.1f} MiB, "
             f"measured {pk['measured'] / 2**20:.1f} MiB in the verify step. The executed graph has "
             f"{res['graph_ops'][0]} ATen ops and {res['graph_ops'][1]} runtime calls (input placement, "
             "redistributions, local attention).")
    print(body)
    if args.write:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from results_md import replace_section
        replace_section("Runtime", body)


if __name__ == "__main__":
    main()
