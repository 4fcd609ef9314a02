"""Pretrain a Llama-style model (RMSNorm, RoPE, SwiGLU, GQA) on random tokens with cauto: a complete loop.

    torchrun --nproc-per-node 4 packages/cauto/examples/llama_pretrain.py [--mesh 2x2] [--checkpoint auto] \
        [--steps 20] [--accumulate 4] [--max-norm 1.0] [--save-every 10 --save-dir ckpt] [--resume] [--tiny]

The loop of hf_gpt2_finetune.py (per-rank DataLoader from ``model.batch_slice()``, accumulation with
``model.no_sync()``, global-norm clipping with ``model.clip_grad_norm_``, warm-up + cosine schedule,
``model.save`` every ``--save-every`` steps, ``--resume``) for a model taking positional inputs
``(idx, targets)``: next-token prediction on a token stream cut into windows of SEQ + 1.
"""

import argparse
import contextlib
import math

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from cauto.api import autoparallelize
from cauto.profiler.zoo import Llama

parser = argparse.ArgumentParser()
parser.add_argument("--mesh", default=None, help="e.g. 4 or 2x2 (default: 1-D over all ranks)")
parser.add_argument("--memory", default="2GiB")
parser.add_argument("--checkpoint", default="none", choices=["none", "auto", "rotor", "chen"])
parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch, over all ranks")
parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
parser.add_argument("--max-norm", type=float, default=1.0)
parser.add_argument("--lr", type=float, default=3e-4)
parser.add_argument("--warmup", type=int, default=4)
parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N optimizer steps (0: never)")
parser.add_argument("--save-dir", default="checkpoints/llama")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--tiny", action="store_true", help="a tiny model and token stream (CI)")
parser.add_argument("--mixed-precision", default="bf16", choices=["bf16", "none"],
                    help="bf16 compute over fp32 master weights and optimizer state (autocast), or none")
parser.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="dtype of the gradient reductions under --mixed-precision bf16")
args = parser.parse_args()

SEQ, VOCAB = (16, 128) if args.tiny else (64, 512)
size = dict(dim=32, layers=2, heads=4, kv_heads=2, hidden=64) if args.tiny else \
    dict(dim=128, layers=4, heads=4, kv_heads=2, hidden=344)


class Windows(Dataset):
    """Sample i: (tokens[i*SEQ : (i+1)*SEQ], the same shifted by one) of one long token stream."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __len__(self):
        return (len(self.tokens) - 1) // SEQ

    def __getitem__(self, i):
        window = self.tokens[i * SEQ: (i + 1) * SEQ + 1]
        return window[:-1], window[1:]


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
example = (torch.zeros(args.micro_batch, SEQ, dtype=torch.long), torch.zeros(args.micro_batch, SEQ, dtype=torch.long))
model = autoparallelize(lambda: Llama(vocab=VOCAB, seq=SEQ, **size), example, args.mesh or (dist.get_world_size(),),
                        memory_budget=args.memory, checkpoint=args.checkpoint,
                        mixed_precision=args.mixed_precision, reduce_dtype=args.reduce_dtype,
                        make_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.1))
opt = model.optimizer
start = model.load(args.save_dir) if args.resume else 0


def lr_factor(step: int) -> float:
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


for group in opt.param_groups:
    group.setdefault("initial_lr", args.lr)
scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor, last_epoch=start - 1)

stream = torch.randint(0, VOCAB, (args.micro_batch * args.accumulate * 8 * SEQ + 1,),
                       generator=torch.Generator().manual_seed(1))
dataset = Windows(stream)
# which slice of each micro-batch this rank loads (the whole of it when the plan splits the inputs unevenly)
part = model.batch_slice(uneven="whole")
sampler = part.sampler(dataset, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_size=part.local_batch(args.micro_batch), sampler=sampler, drop_last=True)
steps_per_epoch = len(loader) // args.accumulate


def micro_batches():
    epoch = start // steps_per_epoch
    while True:
        sampler.set_epoch(epoch)
        skip = (start % steps_per_epoch) * args.accumulate if epoch == start // steps_per_epoch else 0
        for i, batch in enumerate(loader):
            if skip <= i < steps_per_epoch * args.accumulate:
                yield batch
        epoch += 1


batches = micro_batches()
for step in range(start, args.steps):
    total = 0.0
    for i in range(args.accumulate):
        idx, targets = next(batches)
        with model.no_sync() if i < args.accumulate - 1 else contextlib.nullcontext():
            loss = model(idx, targets) / args.accumulate
            loss.backward()
        total += loss.item()
    norm = model.clip_grad_norm_(args.max_norm)
    opt.step()
    opt.zero_grad()
    scheduler.step()
    if rank == 0:
        print(f"step {step + 1} loss {total:.5f} grad_norm {norm.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}")
    if args.save_every and (step + 1) % args.save_every == 0:
        path = model.save(args.save_dir, step + 1)
        if rank == 0:
            print(f"saved {path}")
if rank == 0:
    print(f"batch slice {part}; predicted peak per rank {model.predictions['peak_bytes'] / 2**20:.1f} MiB")
dist.barrier()  # every rank done with its collectives before any tears its process group down
dist.destroy_process_group()
