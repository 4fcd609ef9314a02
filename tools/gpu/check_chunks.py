"""One-command GPU check of the chunk manager (run on a lent CUDA machine; ~1-2 minutes).

    python tools/gpu/check_chunks.py [--budget-gib 1] [--dim 1024] [--time-limit 60]

Prints three tables:
1. Host<->device bandwidth: pageable vs pinned, on a side stream (what chunk moves get).
2. Correctness: a small GPT trained 5 steps with chunks on the GPU (budget = a quarter of its model
   state plus activations) vs plain fused AdamW on the GPU: losses and max parameter difference.
3. Largest model trainable in the device budget: GPT(dim, L layers) for growing L, plain training
   (whole model + AdamW on the GPU) vs chunked, both with the CUDA allocator capped at the budget
   (torch.cuda.set_per_process_memory_fraction), so going over it is a real OOM.
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback

import torch

from cauto.profiler.zoo import gpt
from cauto.runtime.chunks import BudgetError, wrap

GiB = 2**30


def bandwidth_table(size_mib: int = 512) -> None:
    dev = torch.empty(size_mib * 2**20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    print(f"\n## 1. host<->device bandwidth ({size_mib} MiB copies, side stream)")
    print("| host memory | H2D GB/s | D2H GB/s |\n|---|---:|---:|")
    for pinned in (False, True):
        host = torch.empty(dev.numel(), dtype=torch.uint8, pin_memory=pinned)
        rates = []
        for dst, src in ((dev, host), (host, dev)):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)  # warm
                stream.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                for _ in range(5):
                    dst.copy_(src, non_blocking=True)
                end.record(stream)
            end.synchronize()
            rates.append(5 * dev.numel() / (start.elapsed_time(end) / 1e3) / 1e9)
        print(f"| {'pinned' if pinned else 'pageable'} | {rates[0]:.1f} | {rates[1]:.1f} |")


def _batch(vocab, batch, seq, step):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, vocab, (batch, seq), generator=g).cuda(),
            torch.randint(0, vocab, (batch, seq), generator=g).cuda())


def correctness_table() -> None:
    def factory():
        torch.manual_seed(0)
        return gpt(batch=4, seq=128, vocab=4096, dim=512, layers=4)[0]

    opt_fn = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)  # noqa: E731
    base = factory().cuda()
    opt = opt_fn(base)
    base_losses = []
    for step in range(5):
        loss = base(*_batch(4096, 4, 128, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        base_losses.append(loss.item())
    state = sum(p.numel() for p in base.parameters()) * 16
    model, copt = wrap(factory, optimizer=opt_fn, device_budget=state // 4 + 512 * 2**20, device="cuda")
    losses = []
    for step in range(5):
        loss = model(*_batch(4096, 4, 128, step))
        copt.backward(loss)
        copt.step()
        copt.zero_grad()
        losses.append(loss.item())
    diff = max((p.detach() - q.detach()).abs().max().item()
               for p, q in zip(model.module.parameters(), base.parameters()))
    t = copt.manager.mover.traffic
    print("\n## 2. chunked vs plain on the GPU (GPT d512 L4, 5 steps)")
    print("| run | losses | max param diff | arena MiB | MiB moved |\n|---|---|---:|---:|---:|")
    print(f"| plain | {' '.join(f'{x:.4f}' for x in base_losses)} | | | |")
    print(f"| chunked | {' '.join(f'{x:.4f}' for x in losses)} | {diff:.2e} | "
          f"{copt.manager.arena.nbytes / 2**20:.0f} | {t.moved_bytes / 2**20:.0f} |")
    del base, opt, model, copt
    gc.collect()  # the chunked model's hooks form reference cycles
    torch.cuda.empty_cache()


def _try(train) -> str:
    try:
        start = time.perf_counter()
        train()
        torch.cuda.synchronize()
        return f"ok {time.perf_counter() - start:.1f}s"
    except torch.OutOfMemoryError as e:
        return "OOM: " + str(e).split(". ")[0][:90]
    except BudgetError:
        return "over budget"
    except Exception as e:  # report and go on: one lent-machine run should show everything
        return f"error {type(e).__name__}: {str(e)[:100]}"
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def capacity_table(budget_gib: float, dim: int, time_limit_s: float) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget_gib * GiB / total)
    vocab, batch, seq = 8192, 2, 256

    def factory(layers):
        return lambda: gpt(batch=batch, seq=seq, vocab=vocab, dim=dim, layers=layers)[0]

    def plain(layers):
        def run():
            model = factory(layers)().cuda()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            for step in range(3):
                if step == 2:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                model(*_batch(vocab, batch, seq, step)).backward()
                opt.step()
                opt.zero_grad()
            torch.cuda.synchronize()
            plain_step_s[layers] = time.perf_counter() - start
        return run

    def chunked(layers):
        def run():
            # The manager plans within 85% of the cap: the cap also holds the CUDA context's
            # allocations (cuBLAS workspaces) and the caching allocator's rounding.
            model, opt = wrap(factory(layers), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
                              device_budget=int(0.85 * budget_gib * GiB), device="cuda")
            for step in range(3):
                if step == 2:
                    moved = opt.manager.mover.traffic.moved_bytes
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                opt.backward(model(*_batch(vocab, batch, seq, step)))
                opt.step()
                opt.zero_grad()
            torch.cuda.synchronize()
            stats[layers] = (time.perf_counter() - start, (opt.manager.mover.traffic.moved_bytes - moved) / 2**20,
                             torch.cuda.max_memory_allocated() / 2**20)
        return run

    stats: dict[int, tuple[float, float, float]] = {}
    plain_step_s: dict[int, float] = {}
    print(f"\n## 3. largest GPT (dim {dim}, batch {batch}x{seq}) trainable in {budget_gib} GiB of device memory")
    print("| layers | params (M) | model state GiB | plain | chunked | plain step s | chunked step s | MiB moved/step | peak MiB |\n"
          "|---:|---:|---:|---|---|---:|---:|---:|---:|")
    start = time.perf_counter()
    plain_ok = True
    layers = 1
    while time.perf_counter() - start < time_limit_s:
        n = (12 * dim * dim + 13 * dim) * layers + vocab * dim + seq * dim
        p_res = _try(plain(layers)) if plain_ok else "-"
        plain_ok = plain_ok and p_res.startswith("ok")
        torch.cuda.reset_peak_memory_stats()
        c_res = _try(chunked(layers))
        step_s, moved_mib, peak_mib = stats.get(layers, (float("nan"),) * 3)
        print(f"| {layers} | {n / 1e6:.0f} | {n * 16 / GiB:.2f} | {p_res} | {c_res} | {plain_step_s.get(layers, float('nan')):.3f} | {step_s:.3f} | {moved_mib:.0f} | "
              f"{peak_mib:.0f} |", flush=True)
        if not c_res.startswith("ok"):
            break
        layers *= 2
    torch.cuda.set_per_process_memory_fraction(1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds for the capacity sweep")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA device"
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for table in (bandwidth_table, correctness_table,
                  lambda: capacity_table(args.budget_gib, args.dim, args.time_limit)):
        try:
            table()
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
