"""Peer benchmark: cauto's rotor checkpointing against torch's compile-time ``activation_memory_budget``.

    python tools/bench/bench_checkpoint_peer.py [--budgets 1.0,0.7,0.5,0.3,0.1] [--steps 9]
                                               [--backend inductor|aot_eager] [--write]

One small zoo model (``cauto.profiler.zoo.gpt``, fp32, CPU, one thread), real AdamW training steps:

* torch: ``torch.compile(fullgraph=True)`` of the loss with
  ``torch._functorch.config.activation_memory_budget = b`` while it compiles (each budget gets a
  fresh model and its own code object, so every budget has its own compiled graph and all can run
  side by side; the AOT autograd cache is off so no budget reuses another's partition).
* cauto: profile -> ``cauto.solver.planning.plan(graph, cluster_for_mesh("cpu-gloo", (1,)),
  memory_budget=model state + f x the store-all activation peak, checkpoint="rotor")`` -> run with
  ``cauto.runtime.apply`` on a 1-rank gloo mesh (the plan's regions become non-reentrant
  torch.utils.checkpoint calls).

The budget point f is the same number on both sides but not the same quantity: for torch a ratio of
the bytes the default partition saves, for cauto a fraction of the chain's simulated store-all
activation peak (ALGORITHMS.md §3). Measured peak = live bytes of one steady-state step (after
warm-up), counted from the CPU allocator's events under ``torch.profiler`` as
``cauto.profiler.ground_truth`` does (state that exists before the step — parameters, inputs, Adam
m and v — plus the highest running total of what the step allocates). Step time = median over
``--steps`` rounds, every configuration stepping once per round (alternated).

``--write`` replaces the "## Checkpointing vs torch activation_memory_budget" section of
tools/bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time
import traceback

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
import torch.utils._pytree as pytree
from results_md import replace_section  # tools/bench/, next to this script

from cauto.profiler import zoo
from cauto.profiler.capture import LossWrapper, split_inputs
from cauto.profiler.ground_truth import _analyse
from cauto.profiler.training import make_optimizer, unique_storage_bytes

MIB = 1 << 20
MODEL = dict(batch=8, seq=128, vocab=512, dim=128, layers=4, heads=4)
SECTION = "Checkpointing vs torch activation_memory_budget"


def factory():
    return zoo.gpt(**MODEL)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Runner:
    """One configuration: a model, its inputs, its optimizer and a ``loss()`` to train on."""

    name: str

    def __init__(self, params, buffers, inputs):
        self.params = list(params)
        self.buffers = list(buffers)
        self.inputs = inputs
        self.opt = make_optimizer("adamw", self.params, device="cpu")
        self.times: list[float] = []

    def loss(self) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> None:
        loss = self.loss()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed_step(self) -> None:
        t0 = time.perf_counter()
        self.step()
        self.times.append(time.perf_counter() - t0)

    def state_tensors(self) -> list[torch.Tensor]:
        opt_state = [t for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        inputs = [t for t in pytree.tree_leaves(self.inputs) if isinstance(t, torch.Tensor)]
        return [_local(t) for t in (*self.params, *self.buffers, *inputs, *opt_state)]

    def measured_peak(self) -> int:
        """Peak live bytes of one steady-state step (call after warm-up)."""
        gc.collect()
        baseline = unique_storage_bytes(self.state_tensors())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step()
        return _analyse(prof, baseline).peak_bytes

    @property
    def step_s(self) -> float:
        return statistics.median(self.times)


class Eager(Runner):
    def __init__(self):
        torch.manual_seed(0)
        model, inputs = factory()
        model.train()
        super().__init__(model.parameters(), model.buffers(), inputs)
        self.args, self.kwargs = split_inputs(inputs)
        self.wrapper = LossWrapper(model)
        self.name = "eager"

    def loss(self):
        return self.wrapper(*self.args, **self.kwargs)


class TorchBudget(Eager):
    """torch.compile with activation_memory_budget = budget, compiled (and warmed up) now."""

    def __init__(self, budget: float, backend: str):
        super().__init__()
        self.budget = budget
        self.name = f"torch amb {budget}"
        ns: dict = {}
        # a code object of its own per budget: dynamo caches compiled graphs per code object, so each
        # budget keeps its own graph and no torch._dynamo.reset() is needed between budgets
        exec(compile("def loss_fn(w, args, kwargs):\n    return w(*args, **kwargs)\n", f"<amb {budget}>", "exec"), ns)
        self.compiled = torch.compile(ns["loss_fn"], backend=backend, fullgraph=True)
        t0 = time.perf_counter()
        with torch._functorch.config.patch(activation_memory_budget=budget):
            for _ in range(2):
                self.step()
        self.compile_s = time.perf_counter() - t0

    def loss(self):
        return self.compiled(self.wrapper, self.args, self.kwargs)


class Cauto(Runner):
    """A cauto plan applied on the 1-rank mesh."""

    def __init__(self, plan_doc: dict, mesh, cap, frac: float):
        from cauto.runtime.apply import apply

        torch.manual_seed(0)
        _, inputs = factory()
        self.module = apply(factory, plan_doc, mesh, seed=0, captured=cap)
        super().__init__(self.module.parameters(), self.module.buffers(), inputs)
        self.args, self.kwargs = split_inputs(inputs)
        self.plan = plan_doc
        self.frac = frac
        self.name = f"cauto rotor {frac}"
        for _ in range(2):
            self.step()

    def loss(self):
        return self.module(*self.args, **self.kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cauto_plans(fracs: list[float]):
    """(graph facts, {frac: plan doc or error text}, mesh, capture) for the 1-device rotor plans."""
    from cauto.profiler import profile
    from cauto.profiler.capture import capture
    from cauto.runtime.dist_utils import make_mesh
    from cauto.solver import cluster_for_mesh
    from cauto.solver.planning import plan

    t0 = time.perf_counter()
    graph = profile(factory).to_graph()
    cluster = cluster_for_mesh("cpu-gloo", (1,))
    full = plan(graph, cluster, checkpoint="rotor")  # the device's whole memory: stores everything
    pred = full["predictions"]
    state = pred["model_state_bytes"]
    act_full = pred["activation_bytes"]
    plans: dict[float, dict | str] = {}
    for f in fracs:
        budget = int(state + f * act_full)
        try:
            plans[f] = plan(graph, cluster, memory_budget=budget, checkpoint="rotor")
        except Exception as e:  # infeasible budgets: say what they would need
            need = getattr(e, "needed_bytes", None)
            plans[f] = (f"infeasible: budget {budget / MIB:.1f} MiB, least plan needs {need / MIB:.1f} MiB" if need
                        else f"{type(e).__name__}: {e}".splitlines()[0][:160])
    plan_s = time.perf_counter() - t0
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    mesh = make_mesh((1,), full["mesh"]["axis_names"])
    return {"state": state, "act_full": act_full, "plan_s": plan_s}, plans, mesh, capture(factory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="1.0,0.7,0.5,0.3,0.1", help="budget points, comma-separated")
    ap.add_argument("--steps", type=int, default=9, help="timed rounds (median)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: same partitioner, "
                    "no inductor codegen)")
    ap.add_argument("--write", action="store_true", help="write the table to tools/bench/RESULTS.md")
    args = ap.parse_args()
    fracs = [float(b) for b in args.budgets.split(",")]
    torch.set_num_threads(1)
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.compile_threads = 1
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(fracs))
    start = time.perf_counter()
    load0 = os.getloadavg()[0]

    eager = Eager()
    for _ in range(2):
        eager.step()
    torch_runs: dict[float, TorchBudget | str] = {}
    for f in fracs:
        try:
            torch_runs[f] = TorchBudget(f, args.backend)
            print(f"torch amb {f}: compiled + 2 warm-up steps in {torch_runs[f].compile_s:.1f} s", flush=True)
        except Exception:
            torch_runs[f] = traceback.format_exc().strip().splitlines()[-1][:160]
            print(f"torch amb {f}: FAILED {torch_runs[f]}", flush=True)

    facts, plans, ours = {}, {}, {}
    cauto_error = None
    try:
        facts, plans, mesh, cap = cauto_plans(fracs)
        print(f"cauto: profiled + planned {len(fracs) + 1} plans in {facts['plan_s']:.1f} s; model state "
              f"{facts['state'] / MIB:.1f} MiB, store-all activations {facts['act_full'] / MIB:.1f} MiB", flush=True)
        for f, p in plans.items():
            if isinstance(p, str):
                continue
            try:
                ours[f] = Cauto(p, mesh, cap, f)
            except Exception:
                ours[f] = traceback.format_exc().strip().splitlines()[-1][:160]
                print(f"cauto {f}: runtime FAILED {ours[f]}", flush=True)
    except Exception:
        cauto_error = traceback.format_exc().strip().splitlines()[-1][:200]
        print(f"cauto planning FAILED: {cauto_error}", flush=True)

    runners = [eager] + [r for r in (*torch_runs.values(), *ours.values()) if isinstance(r, Runner)]
    for k in range(args.steps):  # alternate: every configuration steps once per round, order reversed every
        for r in runners if k % 2 == 0 else runners[::-1]:  # other round (no configuration always goes first)
            r.timed_step()
    peaks = {r.name: r.measured_peak() for r in runners}
    load1 = os.getloadavg()[0]

    base_t = torch_runs.get(1.0)
    base_c = ours.get(1.0)
    rows = ["| budget point | torch amb: measured peak MiB | torch step ms (vs amb 1.0) | cauto rotor: predicted "
            "peak MiB | measured peak MiB | predicted recompute ms (% of predicted compute) | regions | "
            "cauto step ms (vs f 1.0) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for f in fracs:
        t = torch_runs.get(f)
        if isinstance(t, Runner):
            rel = f" ({100 * (t.step_s / base_t.step_s - 1):+.0f}%)" if isinstance(base_t, Runner) else ""
            tcells = f"{peaks[t.name] / MIB:.1f} | {t.step_s * 1e3:.1f}{rel}"
        else:
            tcells = f"failed: {t} | -"
        p = plans.get(f)
        if isinstance(p, dict):
            pr = p["predictions"]
            rec = pr["step_time_s"].get("recompute", 0.0)
            comp = pr["step_time_s"]["compute"]
            regions = len(p.get("checkpoint", {}).get("regions", []))
            pcells = f"{pr['peak_bytes'] / MIB:.1f}"
            c = ours.get(f)
            if isinstance(c, Runner):
                rel = f" ({100 * (c.step_s / base_c.step_s - 1):+.0f}%)" if isinstance(base_c, Runner) else ""
                mcell, scell = f"{peaks[c.name] / MIB:.1f}", f"{c.step_s * 1e3:.1f}{rel}"
            else:
                mcell, scell = f"runtime failed: {c}", "-"
            ccells = f"{pcells} | {mcell} | {rec * 1e3:.2f} ({100 * rec / comp:.0f}%) | {regions} | {scell}"
        else:
            ccells = f"{p or cauto_error} | - | - | - | -"
        rows.append(f"| {f} | {tcells} | {ccells} |")
    lows = []
    for label, runs, base in (("torch amb", torch_runs, base_t), ("cauto rotor", ours, base_c)):
        ok = [(peaks[r.name], r) for r in runs.values() if isinstance(r, Runner)]
        if ok and isinstance(base, Runner):
            peak, r = min(ok, key=lambda x: x[0])
            lows.append(f"{label} {peak / MIB:.1f} MiB ({100 * (1 - peak / peaks[base.name]):.0f}% below its own "
                        f"store-all, step {100 * (r.step_s / base.step_s - 1):+.0f}%)")
    total = time.perf_counter() - start
    compile_s = [t.compile_s for t in torch_runs.values() if isinstance(t, Runner)]
    notes = [
        f"`cauto.profiler.zoo.gpt({', '.join(f'{k}={v}' for k, v in MODEL.items())})`, fp32, CPU, 1 thread, "
        f"AdamW (foreach off, as on CPU by default); torch.compile backend `{args.backend}`; step times are medians of "
        f"{args.steps} rounds with every configuration stepping once per round (order reversed every other round); peaks are of one steady-state step "
        "(allocator events, as cauto.profiler.ground_truth counts them).",
        f"Eager reference (no compile, no checkpointing): peak {peaks['eager'] / MIB:.1f} MiB, step "
        f"{eager.step_s * 1e3:.1f} ms."
        + (f" cauto plans: model state {facts['state'] / MIB:.1f} MiB, store-all activation peak (simulated) "
           f"{facts['act_full'] / MIB:.1f} MiB; cauto budget at point f = model state + f x that." if facts else ""),
        "Lowest measured peak: " + "; ".join(lows) + "." if lows else "",
        "The budget point is the same number on both sides but not the same quantity: torch's "
        "activation_memory_budget is a ratio of the bytes its default partition saves (not a peak target), "
        "cauto's is a fraction of the simulated store-all activation peak; compare rows by their measured "
        "peaks, not by the point. torch's recompute is not reported by torch: its cost shows only as step time "
        "relative to amb 1.0. cauto's predicted recompute is the solver's CPU device model, not a measurement; "
        "its measured cost is the step time relative to f 1.0 (the same runtime storing everything). The cauto "
        "runtime runs the captured aten graph eagerly with DTensor parameters on a 1-rank gloo mesh, so its "
        "baseline differs from both eager and compiled torch.",
        f"Machine: {os.cpu_count()} cores shared with other jobs; load average {load0:.1f} at start, {load1:.1f} at "
        f"end; step times carry that noise (alternation spreads it across configurations). torch compile + warm-up "
        f"{min(compile_s, default=0):.0f}-{max(compile_s, default=0):.0f} s per budget (less when inductor's on-disk FX graph cache is already warm "
        f"from an earlier run; about 30-50 s cold here); whole run {total:.0f} s.",
    ]
    table = "\n".join(rows)
    print("\n" + table + "\n\n" + "\n\n".join(n for n in notes if n))
    if args.write:
        command = "python tools/bench/bench_checkpoint_peer.py" + " ".join(
            [""] + [f"--budgets {args.budgets}"] * (args.budgets != ap.get_default("budgets"))
            + [f"--steps {args.steps}"] * (args.steps != 9)
            + [f"--backend {args.backend}"] * (args.backend != "inductor") + ["--write"])
        rest = "\n\n".join(n for n in notes[1:] if n)
        replace_section(SECTION, f"Command: `{command}`\n\n{notes[0]}\n\n{table}\n\n{rest}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
