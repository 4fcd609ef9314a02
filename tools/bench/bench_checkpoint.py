"""Checkpoint planning benchmark: rotor DP speed, rotor vs Chen, joint sharding + checkpointing.

    python tools/bench/bench_checkpoint.py [--chains 6 --stages 40 --repeats 5 --no-ilp] [--write]

Three tables, all judged by the op-sequence simulator (cauto.solver.checkpoint.simulate):

1. Rotor DP wall time for L = 80, 100 (and 160 with --long) stages and S = 500 memory slots (median).
2. Rotor vs Chen's √n at equal memory on random heterogeneous and uniform chains: for each point
   of Chen's budget grid, rotor (S = 500) runs with Chen's simulated peak as its budget; recompute
   overhead is recompute seconds / compute seconds.
3. Joint sharding + checkpointing across per-device budgets, against "ILP only" (no recompute,
   full activations) and "ILP then rotor at a fixed split" (sharding planned for 2x the budget,
   rotor on what is left): a synthetic sharding menu on a GPT-like graph, and (unless --no-ilp)
   the real sharding ILP on cauto.solver.synthetic.gpt over a 2-device mesh.

``--write`` replaces the "## Checkpointing" section of tools/bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from results_md import replace_section  # tools/bench/, next to this script

from cauto.solver.checkpoint.api import choose_schedule
from cauto.solver.checkpoint.chen import chen_grid
from cauto.solver.checkpoint.rotor import least_memory, solve_rotor
from cauto.solver.checkpoint.schedule import store_all, to_ops
from cauto.solver.checkpoint.simulate import simulate
from cauto.solver.checkpoint.synthetic import gpt_graph, random_chain, synthetic_sharding
from cauto.solver.joint import device_dict, joint_plan
from cauto.solver.planning import ilp_sharding

MIB = 1 << 20


def rotor_timing(repeats: int, long: bool) -> str:
    load = os.getloadavg()[0]
    rows = [f"Random heterogeneous chains, budget halfway between the least and the store-all peak; medians of "
            f"runs; machine load average {load:.1f} on {os.cpu_count()} cores when measured (wall time grows "
            "with the load, CPU time much less).\n",
            "| stages L | slots S | DP CPU time | DP wall time | runs |", "|---:|---:|---:|---:|---:|"]
    for n in (80, 100, 160) if long else (80, 100):
        chain = random_chain(np.random.default_rng(n), n)
        full = simulate(chain, to_ops(store_all(n))).peak_bytes
        budget = (full + least_memory(chain).peak_bytes) // 2
        cpu, wall = [], []
        for _ in range(repeats if n <= 100 else 1):
            c0, w0 = time.process_time(), time.perf_counter()
            solve_rotor(chain, budget, slots=500)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        rows.append(f"| {n} | 500 | {statistics.median(cpu):.2f} s | {statistics.median(wall):.2f} s | {len(cpu)} |")
    return "\n".join(rows)


def rotor_vs_chen(chains: int, stages: int) -> str:
    """Rotor at Chen's simulated peak, three ways: S=500 rounded up, S=500 as choose_schedule runs it
    (rounded up and to nearest, the simulator judging), and S=4000 rounded up (less rounding loss)."""
    rows = ["| chains | Chen points | Chen overhead | rotor S=500 up | rotor S=500 (plan) | rotor S=4000 up | "
            "cut vs Chen (plan): mean / median / min / max | rotor (plan) worse than Chen |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for uniform in (False, True):
        over = {"chen": [], "up": [], "plan": [], "fine": []}
        cuts, worse = [], 0
        for seed in range(chains):
            chain = random_chain(np.random.default_rng(1000 + seed), stages, uniform=uniform)
            for point in chen_grid(chain):
                chen_over = point.simulation.recompute_s(chain) / chain.compute_s
                if chen_over < 1e-9:
                    continue
                budget = point.simulation.peak_bytes
                got = {}
                for key, slots in (("up", 500), ("fine", 4000)):
                    sol = solve_rotor(chain, budget, slots=slots)
                    got[key] = (simulate(chain, to_ops(sol.schedule)).recompute_s(chain) / chain.compute_s
                                if sol.feasible else float("nan"))
                got["plan"] = choose_schedule(chain, budget, "rotor", slots=500).recompute_s / chain.compute_s
                over["chen"].append(chen_over)
                for key, value in got.items():
                    over[key].append(value)
                worse += got["plan"] > chen_over + 1e-12
                cuts.append(1 - got["plan"] / chen_over)
        mean = {k: 100 * np.nanmean(v) for k, v in over.items()}
        rows.append(f"| {'uniform' if uniform else 'heterogeneous'} x{chains}, {stages} stages | {len(cuts)} | "
                    f"{mean['chen']:.1f}% | {mean['up']:.1f}% | {mean['plan']:.1f}% | {mean['fine']:.1f}% | "
                    f"{100 * np.mean(cuts):.1f}% / {100 * np.median(cuts):.1f}% / {100 * min(cuts):.1f}% / "
                    f"{100 * max(cuts):.1f}% | {worse} |")
    return ("Overhead = recompute seconds / compute seconds, mean over every point of Chen's budget grid "
            "(rotor runs with Chen's simulated peak as its budget).\n\n" + "\n".join(rows))


def _cell(point) -> str:
    if not point.feasible:
        need = f" (needs {point.needed_bytes / MIB:.0f}" if point.needed_bytes else ""
        if need and point.checkpoint is None and point.sharding is not None:
            claim = (point.sharding.model_state_bytes + point.sharding.activation_bytes) / MIB
            need += f"; ILP model: {claim:.0f}" if point.ilp_budget_bytes == point.memory_budget_bytes else ""
        return f"infeasible{need + ')' if need else ''} | -"
    return f"{point.step_time_s * 1e3:.1f} | {point.peak_bytes / MIB:.0f}"


def joint_table(graph, solve_sharding, budgets_mib, device=None, **kwargs) -> str:
    rows = ["| budget MiB | ILP only: ms | peak MiB | fixed split: ms | peak MiB | joint: ms | peak MiB | "
            "joint sharding | activation share | recompute ms | joint solve s |",
            "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for mib in budgets_mib:
        start = time.perf_counter()
        res = joint_plan(graph, int(mib * MIB), solve_sharding, device=device, **kwargs)
        took = time.perf_counter() - start
        best = res.best
        name = "-" if best is None else str(best.sharding.plan if isinstance(best.sharding.plan, str)
                                             else _mesh_name(best.sharding.plan))
        rows.append(f"| {mib} | {_cell(res.ilp_only)} | {_cell(res.fixed_split)} | "
                    + (f"{_cell(best)} | {name} | {best.activation_share:.2f} | {best.recompute_s * 1e3:.1f}"
                       if best else f"infeasible (needs {res.needed_bytes / MIB:.0f}) | - | - | - | -")
                    + f" | {took:.1f} |")
    return "\n".join(rows)


def _mesh_name(plan: dict) -> str:
    params = plan.get("params", {}).values()
    sharded = sum(any(pl.startswith("S") for pl in p.get("placements", [])) for p in params)
    return f"ILP plan, {sharded}/{len(params)} params sharded"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=int, default=6, help="random chains per kind for rotor vs Chen")
    ap.add_argument("--stages", type=int, default=40, help="stages per random chain")
    ap.add_argument("--repeats", type=int, default=5, help="timing runs of the DP")
    ap.add_argument("--long", action="store_true", help="also time L=160")
    ap.add_argument("--no-ilp", action="store_true", help="skip the joint table on the real ILP")
    ap.add_argument("--write", action="store_true", help="write the tables to tools/bench/RESULTS.md")
    args = ap.parse_args()

    parts = ["### Rotor DP speed\n", rotor_timing(args.repeats, args.long)]
    print("\n".join(parts[-2:]), flush=True)
    parts += ["\n### Rotor vs Chen (√n) at equal memory\n", rotor_vs_chen(args.chains, args.stages)]
    print("\n".join(parts[-2:]), flush=True)

    graph = gpt_graph(layers=4, batch=16, seq=512, hidden=768, heads=12, vocab=8192)
    menu = synthetic_sharding(graph)
    menu_text = ", ".join(f"{r.plan} (state {r.model_state_bytes / MIB:.0f} MiB, activations "
                          f"{r.activation_bytes / MIB:.0f} MiB, {r.step_time_s * 1e3:.0f} ms)" for r in menu.menu)
    parts += [f"\n### Joint sharding + checkpointing: synthetic sharding menu\n\nGPT-like graph (4 layers, "
              f"h 768, batch 16 x 512), 8 devices; menu: {menu_text}.\n",
              joint_table(graph, menu, (300, 330, 360, 400, 450, 500, 600, 800, 1000, 1200, 1600, 2400, 3000),
                          slots=300)]
    print("\n".join(parts[-2:]), flush=True)
    if not args.no_ilp:
        from cauto.plan import GraphDocument
        from cauto.solver import cluster_for_mesh, synthetic
        from cauto.solver.solve import build

        g = synthetic.gpt(layers=2, batch=16, seq=64, hidden=128)
        cluster = cluster_for_mesh("cpu-gloo", (2,))
        scale = build(GraphDocument.from_dict(g), cluster)[2].activation_scale  # the ILP's calibration
        parts += ["\n### Joint sharding + checkpointing: the real sharding ILP\n\n`cauto.solver.synthetic.gpt("
                  "layers=2, batch=16, seq=64, hidden=128)` on `cpu-gloo` (2,), grid of 5 ILP budgets and the sharding ladder (0.8^k of the unconstrained need) + 2 "
                  f"refinements per row; chains use the ILP's calibrated activation scale ({scale:.3f}). "
                  "\"ILP model\" is the peak the ILP predicts for its own plan (model state + saved + transient); "
                  "the simulator also counts gradients and temporaries of the backward, so it judges the ILP's "
                  "full-activation plans infeasible where the ILP believes they fit.\n",
                  joint_table(g, ilp_sharding(g, cluster), (9, 11, 13, 15, 17, 20, 25, 30),
                              device=device_dict(cluster), activation_scale=scale, slots=300, grid_points=5,
                              refine_steps=2)]
        print("\n".join(parts[-2:]), flush=True)
    if args.write:
        command = "python tools/bench/bench_checkpoint.py" + (" --write" if not args.no_ilp else " --no-ilp --write")
        _write_section("\n".join(parts), command)


def _write_section(body: str, command: str) -> None:
    replace_section("Checkpointing", (
        f"Command: `{command}`\n\nEvery time and peak below is the op-sequence simulator's (ALGORITHMS.md §3); "
        "step times in the joint tables are the sharding solver's (compute + communication) plus simulated "
        "recompute; peaks are model state plus the simulated activation peak.\n\n" + body))


if __name__ == "__main__":
    main()
