"""One rank of the 2-process ZeRO tests (run by test_chunks_dist.py; not a test module itself).

Every scenario trains the chunked model for 5 steps with each rank on its half of the batch and
compares with the un-chunked baseline run in the same process on both halves (loss averaged over
ranks = what data parallelism computes). Results go to ``OUT/rank{r}.json``.
"""

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cauto.profiler.zoo import gpt
from cauto.runtime.chunks import load_checkpoint, save_checkpoint, wrap

STEPS = 5


class Branchy(nn.Module):
    """A layer used only when ``use_extra``: unused on one rank; a tied output projection."""

    def __init__(self, dim=32):
        super().__init__()
        self.inp = nn.Linear(dim, 2 * dim)
        self.mid = nn.Linear(2 * dim, 2 * dim)
        self.extra = nn.Linear(2 * dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)
        self.back = nn.Linear(dim, 2 * dim, bias=False)
        self.tail = nn.Linear(2 * dim, dim)
        self.back.weight = nn.Parameter(self.out.weight.t().contiguous())  # own weight, same shape family
        self.tail.weight = self.out.weight  # tied

    def forward(self, x, y, use_extra=True):
        h = F.gelu(self.mid(F.gelu(self.inp(x))))
        if use_extra:
            h = h + F.gelu(self.extra(h))
        o = self.out(h)
        return F.mse_loss(self.tail(F.gelu(self.back(o))) + o, y)


def gpt_factory():
    torch.manual_seed(0)
    return gpt(batch=2, seq=16, dim=64, layers=2)[0]


def branchy_factory():
    torch.manual_seed(0)
    return Branchy()


def gpt_batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(10000 * step + 100 * micro + rank)
    return (torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)), {}


def branchy_batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(100 * micro + rank)  # same data every step: the loss must fall
    return (torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)), {"use_extra": rank == 0}


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def two_groups(model):
    mats = [p for p in model.parameters() if p.dim() == 2]
    vecs = [p for p in model.parameters() if p.dim() != 2]
    return torch.optim.AdamW([{"params": mats, "weight_decay": 0.1},
                              {"params": vecs, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2, fused=True)


def baseline(factory, opt_fn, batch_fn, world, accum, clip):
    model = factory()
    opt = opt_fn(model)
    losses = []
    for step in range(STEPS):
        for micro in range(accum):
            total = 0.0
            for r in range(world):
                args, kw = batch_fn(step, r, micro)
                loss = model(*args, **kw) / (accum * world)
                loss.backward()
                total += loss.item()
        losses.append(total)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, [p.detach() for p in model.parameters()]


def chunked_steps(model, opt, batch_fn, rank, steps, accum):
    losses = []
    for step in steps:
        for micro in range(accum):
            args, kw = batch_fn(step, rank, micro)
            loss = model(*args, **kw) / accum
            opt.backward(loss)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
        opt.step()
        opt.zero_grad()
    return losses


def gathered_params(model, opt):
    """Full parameters on every rank (test-only: small models), gathered chunk by chunk."""
    mgr = opt.manager
    mgr.begin_forward()
    mgr.gather_groups(mgr.num_groups)
    out = [p.detach().clone() for p in model.module.parameters()]
    mgr.begin_forward()
    return out


def scenario(name, factory, opt_fn, batch_fn, share, rank, world, accum=1, clip=None, ckpt=None,
             activation_bytes=400_000, **options):
    base_losses, base_params = baseline(factory, opt_fn, batch_fn, world, accum, clip)
    state = sum(p.numel() for p in factory().parameters()) * 16 // world
    budget = int(share * state) + activation_bytes
    model, opt = wrap(factory, optimizer=opt_fn, device_budget=budget, device="cpu", max_grad_norm=clip, **options)
    if ckpt is None:
        losses = chunked_steps(model, opt, batch_fn, rank, range(STEPS), accum)
    else:
        losses = chunked_steps(model, opt, batch_fn, rank, range(3), accum)
        save_checkpoint(opt, ckpt)
        dist.barrier()
        model, opt = wrap(factory, optimizer=opt_fn, device_budget=budget, device="cpu", max_grad_norm=clip)
        load_checkpoint(opt, ckpt)
        losses += chunked_steps(model, opt, batch_fn, rank, range(3, STEPS), accum)
    params = gathered_params(model, opt)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, base_losses))
    param_err = max(((p.float() - q).abs().max() / q.abs().max().clamp(min=1e-12)).item()
                    for p, q in zip(params, base_params))
    t = opt.manager.mover.traffic
    return {"name": name, "loss_rel_err": loss_err, "param_rel_err": param_err, "losses": losses,
            "base_losses": base_losses, "moved_bytes": t.moved_bytes, "comm_bytes": t.comm_bytes,
            "arena_bytes": opt.manager.arena.nbytes, "state_bytes_per_rank": state,
            "grad_norm": opt.last_grad_norm}


def main():
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    results = []
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        for share in (1.5, 0.25):
            results.append(scenario(f"gpt_tied_share{share}", gpt_factory, adamw, gpt_batch, share, rank, world))
        results.append(scenario("unused_on_rank1_groups_accum_clip", branchy_factory, two_groups, branchy_batch,
                                0.6, rank, world, accum=2, clip=0.05, activation_bytes=30_000))
        results.append(scenario("checkpoint_resume", gpt_factory, adamw, gpt_batch, 0.3, rank, world,
                                ckpt=os.path.join(out, "ckpt")))
        results.append(scenario("gpt_bf16", gpt_factory, adamw, gpt_batch, 0.3, rank, world,
                                compute_dtype=torch.bfloat16))
        dist.barrier()  # every rank past every collective before any closes its connections
        dist.destroy_process_group()
    except Exception:
        results.append({"error": traceback.format_exc()})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
