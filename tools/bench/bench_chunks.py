"""Chunk manager vs the naive ZeRO-Offload-like policy: bytes moved per step and step time.

Both run in one process on the same model, data and device budget, one step of each in turn so
machine noise hits both alike; the table reports medians after the warm-up iteration. "naive"
keeps all model state on the host, moves every parameter chunk to the device on each use and its
gradient back as soon as it is complete, and runs Adam on the host. "chunked" is the default
policy (Belady eviction on the warm-up trace, prefetch, clean chunks not copied back, optimizer
state on the device where it fits); "lru" is the same with least-recently-used eviction instead
of the warm-up trace. On CPU the device is the simulated arena (real copies).

    python tools/bench/bench_chunks.py [--dim 256 --layers 4 --shares 0.25 0.5 1.2 --steps 10] [--write]

``--write`` replaces the "## Chunk manager" section of tools/bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cauto.profiler.zoo import gpt
from cauto.runtime.chunks import wrap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 1.2],
                    help="chunk memory (device budget minus non-model peak) as shares of model state")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per policy, after the warm-up")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="write the table to tools/bench/RESULTS.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def factory():
        torch.manual_seed(0)
        return gpt(batch=args.batch, seq=args.seq, vocab=args.vocab, dim=args.dim, layers=args.layers)[0]

    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
             torch.randint(0, args.vocab, (args.batch, args.seq), generator=g))
    n_params = sum(p.numel() for p in factory().parameters())
    state = n_params * 16

    def optimizer(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)

    # measure the non-model peak once, then give every policy the same budget
    probe, probe_opt = wrap(factory, optimizer=optimizer, device_budget=4 * state, device=args.device)
    _step(probe, probe_opt, batch)
    nonmodel = probe_opt.manager.nonmodel_peak_bytes
    device = probe_opt.manager.device
    del probe, probe_opt

    lines = ["| chunk arena / model state | policy | MiB moved host<->device per step | step time (ms) |",
             "|---:|---|---:|---:|"]
    for share in args.shares:
        rows = _compare(factory, optimizer, batch, int(share * state) + nonmodel, args)
        arena_share = rows.pop("arena_bytes") / state
        for label, (mib, ms) in rows.items():
            lines.append(f"| {arena_share:.2f} | {label} | {mib:.1f} | {ms:.0f} |")
        naive, best = rows[LABELS["naive"]], rows[LABELS["belady"]]
        byte_ratio = f"{naive[0] / best[0]:.2f}x" if best[0] else "all (chunked moves 0)"
        lines.append(f"| {arena_share:.2f} | **naive / chunked** | **{byte_ratio}** | **{naive[1] / best[1]:.2f}x** |")
    header = (f"GPT dim {args.dim}, {args.layers} layers, vocab {args.vocab}, batch {args.batch}x{args.seq}; "
              f"{n_params / 1e6:.2f} M params, model state {state / 2**20:.1f} MiB (fp32 params, grads, Adam m, v); "
              f"device {device}; budget = chunk arena + measured non-model peak {nonmodel / 2**20:.2f} MiB; "
              f"medians of {args.steps} steps after the warm-up, policies interleaved step by step, "
              f"{args.threads} thread(s); all policies give identical losses.")
    table = header + "\n\n" + "\n".join(lines)
    print(table)
    if args.write:
        _write_section(table, " ".join(["python tools/bench/bench_chunks.py"] + _nondefault(ap, args)))


LABELS = {"naive": "naive (ZeRO-Offload-like)", "lru": "chunked, LRU eviction (ablation)",
          "belady": "chunked (Belady + prefetch)"}


def _compare(factory, optimizer, batch, budget, args) -> dict:
    """Train every policy under ``budget``; return {label: (MiB moved, ms)} medians and arena_bytes."""
    runs = {name: wrap(factory, optimizer=optimizer, device_budget=budget, device=args.device, policy=name)
            for name in LABELS}
    losses = {name: [] for name in runs}
    for name, (model, opt) in runs.items():  # warm-up iteration
        losses[name].append(_step(model, opt, batch)[0])
        opt.manager.mover.traffic.reset()
    times = {name: [] for name in runs}
    moved = {name: [] for name in runs}
    for _ in range(args.steps):
        for name, (model, opt) in runs.items():
            traffic = opt.manager.mover.traffic
            before = traffic.moved_bytes
            loss, seconds = _step(model, opt, batch)
            losses[name].append(loss)
            times[name].append(seconds)
            moved[name].append(traffic.moved_bytes - before)
    assert losses["naive"] == losses["lru"] == losses["belady"], "all policies must train identically"
    rows = {LABELS[name]: (statistics.median(moved[name]) / 2**20, statistics.median(times[name]) * 1e3)
            for name in runs}
    rows["arena_bytes"] = runs["belady"][1].manager.arena.nbytes
    return rows


def _step(model, opt, batch) -> tuple[float, float]:
    start = time.perf_counter()
    loss = model(*batch)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item(), time.perf_counter() - start


def _nondefault(ap, args) -> list[str]:
    out = []
    for action in ap._actions:
        if action.dest in ("help", "write"):
            continue
        value = getattr(args, action.dest)
        if value != action.default:
            out.append(f"{action.option_strings[0]} {value}")
    return out + ["--write"]


def _write_section(table: str, command: str) -> None:
    from results_md import replace_section  # tools/bench/, next to this script

    replace_section("Chunk manager", f"Command: `{command}`\n\n{table}\n\nBytes moved are counted by the copy "
                    "engine (every host<->device copy); on CPU the device is the simulated arena, so step times "
                    "show the cost of real memory copies, not of a PCIe link (see tools/gpu/check_chunks.py).")


if __name__ == "__main__":
    main()
