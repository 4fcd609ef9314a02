"""Readable text for a plan: the summary `cauto-solve` prints and the per-layer `explain` table."""

from __future__ import annotations

import re
from collections import Counter, OrderedDict

from cauto.plan.units import format_bytes

_LAYER = re.compile(r"^(.*?)\.(\d+)(\..*)?$")


def fmt_s(t: float) -> str:
    """'12.3 ms' style."""
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def summary(plan: dict, top_edges: int = 5) -> str:
    """The text `cauto-solve` prints after solving: time, memory, collectives, costly edges, solver."""
    pred, solver = plan["predictions"], plan["solver"]
    st = pred["step_time_s"]
    mesh = "x".join(str(s) for s in plan["mesh"]["shape"])
    names = plan["mesh"]["axis_names"]
    lines = [
        f"mesh {mesh} ({', '.join(names)}) on {plan['cluster']['name']}",
        f"predicted step time  {fmt_s(st['total'])}  (compute {fmt_s(st['compute'])}, "
        f"communication {fmt_s(st['communication'])})",
        f"per-device peak      {format_bytes(pred['peak_bytes'])}  (model state {format_bytes(pred.get('model_state_bytes', 0))}, "
        f"activations {format_bytes(pred.get('activation_bytes', 0))}; budget "
        f"{format_bytes(pred['memory_budget_bytes']) if pred.get('memory_budget_bytes') else 'none'})",
    ]
    opts = plan.get("options")
    if opts:
        axes = "" if opts["offload_axes"] is None else f" over axes {','.join(names[a] for a in opts['offload_axes'])}"
        lines.append(f"planned with         checkpoint {opts['checkpoint']}, offload {opts['offload']}{axes}, mixed "
                     f"precision {opts['mixed_precision']}, solver {opts['solver']}")
    off = plan.get("offload")
    if off:
        chunked = sum(p.get("state") == "chunked" for p in plan["params"].values())
        zero_axes = ",".join(names[a] for a in off.get("mesh_axes", range(len(names))))
        lines.append(f"chunked state        {chunked} params in {off.get('num_chunks', '?')} chunks of "
                     f"{off['chunk_elems']} elements, ZeRO over {zero_axes}; device budget "
                     f"{format_bytes(off['device_budget_bytes'])}, "
                     f"working set {format_bytes(off.get('working_set_bytes', 0))}, host link "
                     f"{format_bytes(off.get('moved_bytes', 0))}/step ({fmt_s(st.get('offload', 0.0))})")
    counts = Counter((c.get("phase", "?"), c["op"], names[c["axis"]]) for c in pred["collectives"])
    lines.append(f"collectives per step {len(pred['collectives'])}")
    for (phase, op, axis), n in sorted(counts.items()):
        lines.append(f"  {phase:<9} {op:<15} on {axis:<6} x{n}")
    edges = sorted(plan["edges"], key=lambda e: (-e.get("cost_s", 0.0), e["dst"], e["arg"]))[:top_edges]
    if edges:
        lines.append("most expensive resharding edges (forward + backward)")
        for e in edges:
            ops = "+".join(c["op"] for c in e.get("collectives", [])) or "local"
            lines.append(f"  {fmt_s(e.get('cost_s', 0.0)):>10}  {e['src']} -> {e['dst']}[{e['arg']}]  "
                         f"{','.join(e['src_placements'])} -> {','.join(e['dst_placements'])}  ({ops})")
    gap = solver.get("gap")
    lines.append(f"solver {solver['name']}: {solver['status']}"
                 + (f", gap {gap:.2%}" if gap else "") + f", {solver.get('time_s', 0.0):.2f} s, "
                 f"{solver.get('num_variables', 0)} variables, {solver.get('num_constraints', 0)} constraints")
    return "\n".join(lines)


def _place(p: list[str]) -> str:
    return "[" + ", ".join(p) + "]"


def explain(plan: dict, graph: dict | None = None) -> str:
    """Per-layer placement table; identical repeated layers are shown once with their index range."""
    nodes = plan["nodes"]
    rows: list[tuple[str, str, str, str]] = []  # (layer, name, strategy, placement)
    modules = {n["id"]: (n.get("module") or "", n["op"]) for n in graph["nodes"]} if graph else {}
    for pid, p in plan["params"].items():
        rows.append(("param", p["target"], nodes.get(pid, {}).get("name", ""), _place(p["placements"])))
    if graph:
        for nid, n in nodes.items():
            module, op = modules.get(nid, ("", ""))
            if op in ("param", "buffer", "input") or not n["outputs"]:
                continue
            rows.append(("op", f"{module or '<root>'}: {op.removeprefix('aten.')}", n.get("name", ""),
                         " ".join(_place(o) for o in n["outputs"])))
    layers: OrderedDict[tuple[str, str], OrderedDict[int, list]] = OrderedDict()
    for kind, name, strat, place in rows:
        m = _LAYER.match(name.split(":")[0] if kind == "op" else name)
        if m:
            prefix, idx = m.group(1), int(m.group(2))
            rest = name[len(f"{prefix}.{idx}"):]
            layers.setdefault((prefix, kind), OrderedDict()).setdefault(idx, []).append((rest, strat, place))
        else:
            layers.setdefault(("", kind), OrderedDict()).setdefault(-1, []).append((name, strat, place))
    mesh = "x".join(str(s) for s in plan["mesh"]["shape"])
    out = [f"placements on mesh {mesh} ({', '.join(plan['mesh']['axis_names'])}); one entry per mesh axis"]
    for (prefix, kind), by_index in layers.items():
        groups: list[tuple[list[int], list]] = []
        for idx, entries in by_index.items():
            sig = entries
            if groups and groups[-1][1] == sig:
                groups[-1][0].append(idx)
            else:
                groups.append(([idx], sig))
        for indices, entries in groups:
            if prefix:
                span = f"{indices[0]}" if len(indices) == 1 else f"{indices[0]}..{indices[-1]}"
                out.append(f"\n{prefix}.[{span}] {kind}s" + (f" (x{len(indices)} identical)" if len(indices) > 1 else ""))
            else:
                out.append(f"\n{kind}s outside repeated layers")
            width = max(len(e[0]) for e in entries)
            swidth = max(len(e[1]) for e in entries)
            for name, strat, place in entries:
                out.append(f"  {name:<{width}}  {strat:<{swidth}}  {place}")
    return "\n".join(out)
