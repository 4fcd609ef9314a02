"""Fine-tune a stock Hugging Face GPT-2 on random tokens, parallelized by cauto: a complete loop.

    torchrun --nproc-per-node 2 packages/cauto/examples/hf_gpt2_finetune.py \
        [--steps 20] [--accumulate 2] [--max-norm 1.0] [--save-every 10 --save-dir ckpt] [--resume] [--tiny]

Each rank loads only its slice of every batch (a DataLoader with a DistributedSampler over the
plan's data-parallel axes: ``model.batch_slice()``), accumulates ``--accumulate`` micro-batches with
one gradient synchronization per optimizer step (``model.no_sync()``), clips the global gradient norm
over every shard (``model.clip_grad_norm_``), follows a warm-up + cosine learning-rate schedule and
saves a checkpoint every ``--save-every`` steps (``model.save``; ``--resume`` continues from the
latest). The plan is solved for one micro-batch (``--micro-batch`` samples over all ranks).
"""

import argparse
import contextlib
import math

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from cauto.api import autoparallelize

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
parser.add_argument("--micro-batch", type=int, default=8, help="samples per micro-batch, over all ranks")
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping (global L2 norm)")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--warmup", type=int, default=4, help="warm-up steps of the learning rate")
parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N optimizer steps (0: never)")
parser.add_argument("--save-dir", default="checkpoints/hf_gpt2")
parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
parser.add_argument("--tiny", action="store_true", help="a tiny model and dataset (CI)")
parser.add_argument("--mixed-precision", default="bf16", choices=["bf16", "none"],
                    help="bf16 compute over fp32 master weights and optimizer state (autocast), or none")
parser.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="dtype of the gradient reductions under --mixed-precision bf16")
args = parser.parse_args()

SEQ, VOCAB = (16, 128) if args.tiny else (64, 1000)
config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32 if args.tiny else 128, n_layer=2,
                    n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
example = {"input_ids": torch.zeros(args.micro_batch, SEQ, dtype=torch.long),
           "labels": torch.zeros(args.micro_batch, SEQ, dtype=torch.long)}
model = autoparallelize(lambda: GPT2LMHeadModel(config), example, (dist.get_world_size(),), memory_budget="1GiB",
                        mixed_precision=args.mixed_precision, reduce_dtype=args.reduce_dtype,
                        make_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01))
opt = model.optimizer

start = model.load(args.save_dir) if args.resume else 0  # parameters, optimizer state, RNG


def lr_factor(step: int) -> float:
    """Linear warm-up, then cosine decay to 10% over --steps."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


for group in opt.param_groups:
    group.setdefault("initial_lr", args.lr)
scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor, last_epoch=start - 1)

# A fine-tuning set (random tokens here); each rank loads its slice of each micro-batch.
data = torch.randint(0, VOCAB, (args.micro_batch * args.accumulate * 8, SEQ), generator=torch.Generator().manual_seed(1))
dataset = TensorDataset(data)
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
        for i, (tokens,) in enumerate(loader):
            if skip <= i < steps_per_epoch * args.accumulate:
                yield tokens
        epoch += 1


batches = micro_batches()
for step in range(start, args.steps):
    total = 0.0
    for i in range(args.accumulate):
        tokens = next(batches)
        with model.no_sync() if i < args.accumulate - 1 else contextlib.nullcontext():
            loss = model(input_ids=tokens, labels=tokens) / args.accumulate
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
