"""cauto's automatic plans against the hand-written plans a user would write, 35.8 M-parameter GPT, 4 gloo ranks.

The model: the zoo GPT with vocab 16384, d_model 512, 6 layers, 8 heads, seq 256, global batch 16
(35.8 M parameters). Hand plans, as a user writes them with torch.distributed:

* DDP over the 4 ranks (a quarter of the batch each);
* FSDP2 ``fully_shard`` per block and at the root (a quarter of the batch each);
* Megatron TP: ``parallelize_module`` per block over the 4 ranks (q/k/v/fc column-split, proj/out
  row-split, heads divided), the whole batch on every rank;
* DP2xTP2: the same TP over the mesh's ``tp`` axis of 2, DDP over its ``dp`` axis of 2 (torch's
  ``_pre_dp_module_transform``), half the batch per data-parallel rank.

cauto plans the same model (``checkpoint="auto"``, ``regather=True``: where no plan keeping its gathered
parameters fits, plans that gather them again in backward; on mesh (4,) and (2, 2); the plan with the least
predicted step time wins) at four per-rank budgets: none, and just under (98% of) the measured peak
of DDP, of Megatron TP and of FSDP2. Each runs as ``apply`` builds it, fed its rank's slice of the
batch (``model.input_slices()``).

One peak measure for every setup: the bytes of the rank's state (parameters, gradients, buffers,
optimizer state; each storage once) and its inputs at the start of a steady-state step, plus the peak
of the step's allocations (torch.profiler allocation events; ``cauto.runtime.verify.step_allocation_peak``,
the measure ``--verify`` uses). Under gloo some blocks are freed on gloo's threads, where no free event
is recorded; the measure dates those frees at their storage's death (``cauto.runtime.storage_deaths``). The same setups also run on a fake process group of 4 in one
process (rank 0; collectives do nothing, every free is on the main thread), where no dating is
needed: the two columns agree when the gloo measure is right.

Step time: wall time of one training step (forward, backward, AdamW, zero_grad) between barriers,
every setup in turn each round (one interleaved run), median over the rounds after a warm-up.

    python tools/bench/bench_gpt_plans.py [--rounds 3] [--calibrate] [--compile] [--small] [--write]

``--small`` runs a model of a few MB with the same setups (minutes). ``--compile``: cauto with
``compile=True`` against ``torch.compile`` of the DDP and FSDP2 models (the peaks used for the
budgets are the eager models'). ``--calibrate``: plan for this machine measured just before.
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
FULL = dict(batch=16, seq=256, vocab=16384, dim=512, layers=6, heads=8)
SMALL = dict(batch=16, seq=64, vocab=512, dim=64, layers=2, heads=4)
HANDS = ("DDP", "FSDP2", "Megatron TP", "DP2xTP2")
#: the hand plans the compiled table runs (torch.compile of the DDP and FSDP2 models)
COMPILED_HANDS = ("DDP", "FSDP2")
MiB = 2**20


def factory(kw: dict):
    from cauto.profiler.zoo import gpt
    return lambda: gpt(**kw)


def _megatron(block, mesh, ways: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    block.attn.heads //= ways
    block.attn.kv_heads //= ways
    parallelize_module(block, mesh, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                     "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                     "fc": ColwiseParallel(), "out": RowwiseParallel()})


def _returned(state, bucket):
    """DDP comm hook on the fake group, whose all-reduce gives nothing back: the bucket as it is."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def build_hand(name: str, fn, batch: dict, rank: int, fake: bool):
    """(model, this rank's inputs) of hand plan ``name``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = fn()[0]
    quarter = {k: v.chunk(WORLD)[rank] for k, v in batch.items()}
    if name == "DDP":
        ddp = DistributedDataParallel(model)
        if fake:
            ddp.register_comm_hook(None, _returned)
        return ddp, quarter
    if name == "FSDP2":
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model), quarter
    if name == "Megatron TP":
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        for block in model.blocks:
            _megatron(block, mesh, WORLD)
        return model, batch
    if name == "DP2xTP2":
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            _megatron(block, mesh["tp"], 2)
        _pre_dp_module_transform(model)
        half = {k: v.chunk(2)[mesh.get_coordinate()[0]] for k, v in batch.items()}
        ddp = DistributedDataParallel(model, process_group=mesh["dp"].get_group())
        if fake:
            ddp.register_comm_hook(None, _returned)
        return ddp, half
    raise ValueError(name)


def build_cauto(path: str, fn, compile: bool = False):
    from cauto.plan import load_plan
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh

    plan = load_plan(path)
    mesh = make_mesh(plan.mesh["shape"], plan.mesh["axis_names"])
    model = apply(fn, plan, mesh, seed=0, compile=compile)
    torch.manual_seed(0)
    _, batch = fn()
    slices = model.input_slices()
    return model, {k: v[slices[k]].contiguous() for k, v in batch.items()}


def _uniform(model) -> bool:
    from torch.distributed.tensor import DTensor
    return len({isinstance(p, DTensor) for p in model.parameters()}) == 1


def time_interleaved(setups: dict, opts: dict, rounds: int):
    """(stepper, times): ``stepper(name)`` is one training step of setup ``name`` (its model called on
    its inputs, backward, its optimizer's step); ``times[name]`` the seconds of its steps over
    ``rounds`` rounds in which the setups take turns, every rank together (a barrier around each
    step); round 0 warms up (optimizer state, lowering) and is not timed."""
    import torch.distributed as dist

    def stepper(name):
        model, inputs = setups[name]

        def step():
            model(**inputs).backward()
            opts[name].step()
            opts[name].zero_grad()
        return step

    times: dict[str, list[float]] = {k: [] for k in setups}
    for r in range(rounds + 1):
        for name in setups:
            dist.barrier()
            start = time.perf_counter()
            stepper(name)()
            dist.barrier()
            if r:
                times[name].append(time.perf_counter() - start)
    return stepper, times


def peak_bytes(step, model, opt, inputs: dict) -> int:
    """The one peak measure (module docstring)."""
    from cauto.runtime.verify import live_state_bytes, step_allocation_peak

    base = live_state_bytes(model, opt) + sum(v.numel() * v.element_size() for v in inputs.values())
    return base + step_allocation_peak(step)


def worker(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    if args.worker == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank = dist.get_rank()
    kw = SMALL if args.small else FULL
    fn = factory(kw)
    torch.manual_seed(0)
    _, batch = fn()
    setups = {}
    for name in [h for h in args.hands.split(",") if h]:
        model, inputs = build_hand(name, fn, batch, rank, args.worker == "fake")
        setups[name] = (torch.compile(model) if args.compile else model, inputs)
    for label, path in json.loads(args.plans).items():
        setups[label] = build_cauto(path, fn, args.compile)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=_uniform(m) or None) for k, (m, _) in setups.items()}

    stepper, times = time_interleaved(setups, opts, args.rounds if args.worker == "gloo" else 0)
    peaks = {name: peak_bytes(stepper(name), setups[name][0], opts[name], setups[name][1]) for name in setups}
    collectives = {}
    if args.worker == "gloo":
        from cauto.runtime.verify import verify_step
        for name, (model, inputs) in setups.items():
            if hasattr(model, "plan") and hasattr(model, "executable"):
                report = verify_step(model, ((), inputs), opts[name])
                collectives[name] = all(report[ph]["predicted"] == report[ph]["executed"]
                                        for ph in ("forward", "backward"))
    gathered = [None] * dist.get_world_size()
    if args.worker == "gloo":
        dist.all_gather_object(gathered, peaks)
    else:
        gathered = [peaks]
    if rank == 0:
        print("RESULT " + json.dumps({
            "times": {k: statistics.median(v) for k, v in times.items() if v},
            "peaks": {k: [g[k] for g in gathered] for k in peaks}, "collectives_ok": collectives}), flush=True)
    dist.destroy_process_group()


def launch(args, mode: str, hands: list[str], plans: dict[str, str]) -> dict:
    from cauto.runtime.dist_utils import free_port
    argv = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--hands", ",".join(hands),
            "--plans", json.dumps(plans), "--rounds", str(args.rounds)] + (["--small"] if args.small else []) \
        + (["--compile"] if args.compile and mode == "gloo" else [])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    n = WORLD if mode == "gloo" else 1
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(n)]
    logs = [p.communicate(timeout=3600)[0] for p in procs]
    line = next((ln for ln in logs[0].splitlines() if ln.startswith("RESULT ")), None)
    if line is None or any(p.returncode for p in procs):
        sys.exit(f"{mode} run failed:\n" + "\n".join(log[-3000:] for log in logs))
    return json.loads(line[len("RESULT "):])


def calibrate(out_dir: str) -> str:
    """This machine's cluster spec, measured now by tools/calibrate.py (4 ranks at once)."""
    path = os.path.join(out_dir, "cluster.json")
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "calibrate.py")
    done = subprocess.run([sys.executable, tool, "-o", path, "--world", str(WORLD)], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode:
        sys.exit("calibration failed:\n" + done.stdout[-2000:] + done.stderr[-2000:])
    print(done.stdout.strip(), file=sys.stderr)
    return path


def automatic_plans(graph, budgets: dict[str, int | None], out_dir: str,
                    hardware: str) -> tuple[dict[str, str], dict[str, dict]]:
    """cauto's plan per budget: the least predicted step time over meshes (4,) and (2, 2); a budget
    whose plan is the same as an earlier budget's shares its run."""
    from cauto.plan import dump
    from cauto.solver import InfeasibleBudgetError, cluster_for_mesh, plan

    paths, info, seen = {}, {}, {}
    for label, budget in budgets.items():
        best, tried = None, []
        for mesh in ((WORLD,), (2, 2)):
            start = time.perf_counter()
            try:
                doc = plan(graph, cluster_for_mesh(hardware, mesh), memory_budget=budget, checkpoint="auto",
                           regather=True)
            except InfeasibleBudgetError as exc:
                tried.append(f"{mesh}: {exc.needed_bytes / MiB:.0f} MiB needed")
                continue
            seconds = time.perf_counter() - start
            if best is None or doc["predictions"]["step_time_s"]["total"] < best[0]["predictions"]["step_time_s"]["total"]:
                best = (doc, seconds)
        if best is None:
            info[label] = {"infeasible": "; ".join(tried)}
            continue
        doc, seconds = best
        key = json.dumps({k: doc[k] for k in ("mesh", "nodes", "params", "edges", "checkpoint") if k in doc},
                         sort_keys=True)
        if key in seen:
            info[label] = {**info[seen[key]], "same_as": seen[key], "budget": budget}
            continue
        seen[key] = label
        path = os.path.join(out_dir, f"plan_{len(paths)}.json")
        dump(doc, path)
        paths[label] = path
        info[label] = {"mesh": doc["mesh"]["shape"], "predicted_s": doc["predictions"]["step_time_s"]["total"],
                       "predicted_peak": doc["predictions"]["peak_bytes"], "budget": budget, "solve_s": seconds,
                       "regions": len((doc.get("checkpoint") or {}).get("regions", [])),
                       "summary": _summary(doc)}
    return paths, info


def _summary(doc: dict) -> str:
    """Parameters' placements in a few words: how many are replicated, sharded, or split over a tp axis."""
    kinds = {}
    for entry in doc["params"].values():
        kinds[",".join(entry["placements"])] = kinds.get(",".join(entry["placements"]), 0) + 1
    return "; ".join(f"{n}x[{k}]" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--compile", action="store_true",
                    help="the compiled table: cauto with compile=True against torch.compile of DDP and FSDP2")
    ap.add_argument("--calibrate", action="store_true",
                    help="plan with this machine measured now (tools/calibrate.py) instead of the cpu-gloo preset")
    ap.add_argument("--worker", choices=["gloo", "fake"], help=argparse.SUPPRESS)
    ap.add_argument("--hands", default="", help=argparse.SUPPRESS)
    ap.add_argument("--plans", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from cauto.profiler import profile

    kw = SMALL if args.small else FULL
    start = time.perf_counter()
    graph = profile(factory(kw)).to_graph()
    profile_s = time.perf_counter() - start
    hands_fake = launch(args, "fake", list(HANDS), {})["peaks"]  # eager models: the budgets
    budgets = {"none": None}
    for hand in ("DDP", "Megatron TP", "FSDP2"):
        budgets[f"under {hand}"] = int(0.98 * max(hands_fake[hand]))
    out_dir = tempfile.mkdtemp(prefix="bench_gpt_plans_")
    hardware = calibrate(out_dir) if args.calibrate else "cpu-gloo"
    plans, info = automatic_plans(graph, budgets, out_dir, hardware)
    labels = {f"cauto ({label})": path for label, path in plans.items()}
    fake = {**hands_fake, **launch(args, "fake", [], labels)["peaks"]}  # eager, for the compiled table too
    real = launch(args, "gloo", list(COMPILED_HANDS if args.compile else HANDS), labels)
    rows = ["| setup | budget (MiB) | mesh | predicted step (s) | measured step (s) | predicted peak (MiB) | "
            "measured peak, gloo, max over ranks (MiB) | measured peak, fake group (MiB) | fits | collectives |",
            "|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for name in COMPILED_HANDS if args.compile else HANDS:
        rows.append(f"| {name} | | | | {real['times'][name]:.2f} | | {max(real['peaks'][name]) / MiB:.1f} | "
                    f"{max(fake[name]) / MiB:.1f} | | |")
    verdicts = []
    for label, budget in budgets.items():
        name = f"cauto ({label})"
        if "infeasible" in info[label]:
            rows.append(f"| {name} | {budget / MiB:.1f} | no plan: {info[label]['infeasible']} | | | | | | | |")
            continue
        i = info[label]
        name = f"cauto ({i.get('same_as', label)})"
        peak = max(real["peaks"][name])
        fits = budget is None or peak <= budget
        if "same_as" in i:
            rows.append(f"| cauto ({label}) | {budget / MiB:.1f} | the plan of {i['same_as']} | | | | | | "
                        f"{'yes' if fits else 'NO'} | |")
        else:
            rows.append(f"| {name} | {'' if budget is None else f'{budget / MiB:.1f}'} | {tuple(i['mesh'])}, "
                        f"{i['regions']} regions | {i['predicted_s']:.2f} | {real['times'][name]:.2f} | "
                        f"{i['predicted_peak'] / MiB:.1f} | {peak / MiB:.1f} | {max(fake[name]) / MiB:.1f} | "
                        f"{'yes' if fits else 'NO'} | {'as planned' if real['collectives_ok'].get(name) else 'DIFF'} |")
        fitting = [h for h in (COMPILED_HANDS if args.compile else HANDS) if budget is None or max(real["peaks"][h]) <= budget]
        if fitting:
            fastest = min(fitting, key=lambda h: real["times"][h])
            verdicts.append(f"{label}: cauto {real['times'][name]:.2f} s vs {fastest} {real['times'][fastest]:.2f} s "
                            f"(the fastest hand plan within the budget): {real['times'][name] / real['times'][fastest]:.2f}x")
        else:
            named = label.removeprefix("under ")  # the hand plan whose peak the budget is just under
            against = (f" ({named}, {max(real['peaks'][named]) / MiB:.1f} MiB, runs in {real['times'][named]:.2f} s: "
                       f"cauto {real['times'][name] / real['times'][named]:.2f}x)" if named in real["times"] else "")
            verdicts.append(f"{label}: no hand plan fits; cauto {'fits' if fits else 'does NOT fit'}{against}")
    predicted = [info[lb]["predicted_s"] for lb in plans]
    measured = [real["times"][f"cauto ({lb})"] for lb in plans]
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured)]

    # plans predicted within 2% of each other (the same plan at several budgets: 7.17 s thrice) have no
    # order to keep; every other pair must be measured in the order predicted
    pairs = [(i, j) for i in range(len(plans)) for j in range(i + 1, len(plans))
             if abs(predicted[i] / predicted[j] - 1) > 0.02]
    discordant = [(i, j) for i, j in pairs if (predicted[i] < predicted[j]) != (measured[i] < measured[j])]
    machine = ("the cpu-gloo preset" if hardware == "cpu-gloo" else
               "this machine as tools/calibrate.py measured it just before (4 ranks at once): "
               + json.dumps(json.load(open(hardware))["device"]) + ", link " + json.dumps(json.load(open(hardware))["intra_node"]))
    body = (f"Command: `python tools/bench/bench_gpt_plans.py{' --calibrate' if args.calibrate else ''} --write`\n\n"
            f"Zoo GPT {kw} (profiled in {profile_s:.1f} s); 4 gloo ranks on this machine (2 cores), planned for {machine}; "
            f"median of {args.rounds} steps after a warm-up, every setup in turn each round. Peak: one measure "
            "for every setup (module docstring of the script); the fake-group column is the same measure on a "
            "fake process group of 4 in one process, where every free is recorded.\n\n" + "\n".join(rows)
            + "\n\nAutomatic plan against the fastest hand plan that fits the same budget:\n\n"
            + "\n".join(f"* {v}" for v in verdicts)
            + f"\n\nStep-time prediction of cauto's plans: median error {statistics.median(errors) * 100:.0f}% "
            f"(each: {', '.join(f'{e * 100:.0f}%' for e in errors)}); plans predicted more than 2% apart measured "
            f"in the predicted order: {len(pairs) - len(discordant)} of {len(pairs)} pairs.\n")
    print(body)
    if args.write:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from results_md import replace_section
        title = "Automatic plans against hand-written plans: " + ("small GPT" if args.small else "35.8 M GPT") \
            + ", 4 gloo ranks" + (", compiled" if args.compile else "")
        replace_section(title, body)


if __name__ == "__main__":
    main()
