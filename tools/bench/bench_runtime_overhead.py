"""Rank-0 CPU per step: cauto's plans against their hand-written twins, the same plan, no collectives.

One process plays rank 0 of a fake process group of 4 (real per-rank shapes, collectives that do
nothing), and each phase of a training step is timed in thread CPU time: what the rank itself
computes, which is what differs between cauto and the twin when the plan is the same. Three plans,
each against its twin:

* data parallel (inputs split on the batch, parameters replicated) against DDP (its comm hook returns
  the bucket);
* ZeRO-3 style (parameters stored S(0), gathered for use) against FSDP2 ``fully_shard`` per block;
* Megatron tensor parallel (q/k/v/fc column-split, proj/out row-split) against ``parallelize_module``
  with ColwiseParallel/RowwiseParallel (heads per rank divided, as torchtitan does).

cauto runs each plan twice: ``dtensor``, the DTensor program op by op (the interpreter), and
``local``, the program lowered to local forward and backward graphs (cauto.runtime.lowering). AdamW
once with torch's CPU default (one parameter at a time) and once with ``foreach=True`` where the
parameters allow it (a foreach step refuses a mix of plain tensors and DTensors: the TP twin's
embeddings are plain). "DTensor ops" counts DTensor dispatches per step (forward, backward and
optimizer). Denormals are flushed: the fake group's all-gathers return uninitialized memory.

    python tools/bench/bench_runtime_overhead.py [--rounds 16] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 4
PHASES = ("forward", "backward", "optimizer", "step")
KW = dict(batch=16, seq=128, vocab=2048, dim=256, layers=4, heads=8)


class _DispatchCount(TorchDispatchMode):
    """Counts ATen ops called with a DTensor argument (each pays DTensor's sharding propagation and
    wrapping; the local program calls none). A dispatch mode sees every op before DTensor does."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(isinstance(a, DTensor) for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _megatron(layers: int) -> dict[str, str]:
    out = {}
    for i in range(layers):
        for n in ("q", "k", "v"):
            out[f"blocks.{i}.attn.{n}.weight"] = out[f"blocks.{i}.attn.{n}.bias"] = "S(0)"
        out[f"blocks.{i}.fc.weight"] = out[f"blocks.{i}.fc.bias"] = "S(0)"
        out[f"blocks.{i}.attn.proj.weight"] = out[f"blocks.{i}.out.weight"] = "S(1)"
    return out


def _twins(fn, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(fn()[0])

    def returned(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, returned)
    fsdp = fn()[0]
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    tp = fn()[0]
    for block in tp.blocks:
        parallelize_module(block, mesh, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                         "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                         "fc": ColwiseParallel(), "out": RowwiseParallel()})
        block.attn.heads //= WORLD
        block.attn.kv_heads //= WORLD
    return {"data parallel": ddp, "ZeRO-3": fsdp, "Megatron TP": tp}


def run(rounds: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cauto.profiler import capture
    from cauto.profiler.zoo import gpt
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh
    from cauto.runtime.handplan import make_plan

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    fn = lambda: gpt(**KW)  # noqa: E731
    cap = capture(fn)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    mesh = make_mesh((WORLD,), ("dp",))
    _, batch = fn()
    local = {k: v.chunk(WORLD)[0] for k, v in batch.items()}
    plans = {"data parallel": make_plan(cap, mesh, inputs="S(0)"),
             "ZeRO-3": make_plan(cap, mesh, inputs="S(0)", storage="S(0)"),
             "Megatron TP": make_plan(cap, mesh, inputs="R", params=_megatron(KW["layers"]))}
    twins = _twins(fn, mesh)
    twin_inputs = {"data parallel": local, "ZeRO-3": local, "Megatron TP": batch}
    results = {}
    for plan_name, plan in plans.items():
        models = {f"cauto {lowering}": (apply(fn, plan, mesh, seed=0, captured=cap, lowering=lowering), batch)
                  for lowering in ("dtensor", "local")}
        models["twin"] = (twins[plan_name], twin_inputs[plan_name])
        for foreach in (None, True):
            opts = {}
            for k, (m, _) in models.items():
                mixed = len({isinstance(p, DTensor) for p in m.parameters()}) > 1
                opts[k] = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=None if mixed else foreach)
            times = {k: [] for k in models}
            dispatches = {}
            for r in range(rounds + 2):  # round 0 warms up (optimizer state); the last counts dispatches
                names = list(models)
                names = names[r % len(names):] + names[:r % len(names)]  # each model goes first in turn
                for name in names:
                    model, inputs = models[name]
                    with _DispatchCount() if r == rounds + 1 else contextlib.nullcontext() as count:
                        t0 = time.thread_time()
                        loss = model(**inputs)
                        t1 = time.thread_time()
                        loss.backward()
                        t2 = time.thread_time()
                        opts[name].step()
                        t3 = time.thread_time()
                        opts[name].zero_grad()
                    if r == rounds + 1:
                        dispatches[name] = count.n
                    elif r:
                        times[name].append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
            results[(plan_name, "default" if foreach is None else "foreach")] = {
                k: ([min(x[i] for x in v) * 1e3 for i in range(len(PHASES))], dispatches[k])
                for k, v in times.items()}
    dist.destroy_process_group()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--write", action="store_true", help="update tools/bench/RESULTS.md")
    args = ap.parse_args()
    res = run(args.rounds)
    rows = ["| plan | AdamW | runs as | forward ms | backward ms | optimizer ms | step ms | DTensor ops | step / twin |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for (plan_name, opt), per in res.items():
        twin_ms = per["twin"][0][-1]
        for name, (ms, n) in per.items():
            label = {"twin": {"data parallel": "DDP", "ZeRO-3": "FSDP2 fully_shard",
                              "Megatron TP": "parallelize_module"}[plan_name]}.get(name, name)
            ratio = f"**{ms[-1] / twin_ms:.2f}**" if name == "cauto local" else f"{ms[-1] / twin_ms:.2f}"
            rows.append(f"| {plan_name} | {opt} | {label} | " + " | ".join(f"{x:.1f}" for x in ms) + f" | {n} | {ratio} |")
    body = ("Command: `python tools/bench/bench_runtime_overhead.py --write`\n\n"
            f"GPT {KW}; one process as rank 0 of a fake process group of {WORLD} (collectives do nothing; DDP's "
            f"comm hook returns its bucket), thread CPU time per phase, the least of {args.rounds} steps after a "
            "warm-up (the models take turns going first; the least is what the rank itself costs, free of other "
            "processes' interference on a shared machine). Each cauto plan is the hand-made twin's (cauto.runtime.handplan), run as the DTensor "
            "program op by op (`cauto dtensor`, the interpreter) and as the local program (`cauto local`, "
            "cauto.runtime.lowering, the default). AdamW `default`: torch's CPU default (one parameter at a time); "
            "`foreach`: `foreach=True` where the parameters are all DTensors or all plain (parallelize_module "
            "leaves embeddings plain: its rows use the default there). \"DTensor ops\": DTensor dispatches per "
            "step.\n\n" + "\n".join(rows) + "\n\n"
            "Where the data-parallel rows are above 1.00 (0.99-1.02 from run to run): torch.profiler over single steps of the same setup "
            "puts the difference in the Python that calls the lowered graphs' aten ops one by one (about 300 in "
            "forward, 450 in backward; self time of AOTAutograd's CompiledFunction 1.6 ms and "
            "CompiledFunctionBackward 3.4 ms per step) against DDP's module forward and C++ autograd engine. The "
            "kernels are the same ops, and the gradient buckets cost one copy per step (reduced in place in their "
            "concatenation, which the gradients then view) where DDP's reducer makes two. `compile=True` removes the per-op "
            "Python.\n")
    print(body)
    if args.write:
        from results_md import replace_section  # tools/bench/, next to this script

        replace_section("Runtime overhead: cauto vs its hand-written twin without collectives", body)


if __name__ == "__main__":
    main()
