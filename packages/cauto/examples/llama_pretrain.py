"""Pretrain a Llama-style model (RMSNorm, RoPE, SwiGLU, GQA) on random tokens with cauto.

    torchrun --nproc-per-node 4 packages/cauto/examples/llama_pretrain.py [--mesh 2x2] [--checkpoint auto]
"""

import argparse

import torch
import torch.distributed as dist

from cauto.api import autoparallelize
from cauto.profiler.zoo import Llama

parser = argparse.ArgumentParser()
parser.add_argument("--mesh", default=None, help="e.g. 4 or 2x2 (default: 1-D over all ranks)")
parser.add_argument("--memory", default="2GiB")
parser.add_argument("--checkpoint", default="none", choices=["none", "auto", "rotor", "chen"])
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

BATCH, SEQ, VOCAB = 8, 64, 512
dist.init_process_group("gloo")
torch.manual_seed(0)
example = (torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ)))
model = autoparallelize(lambda: Llama(vocab=VOCAB, dim=128, layers=4, heads=4, kv_heads=2, hidden=344, seq=SEQ),
                        example, args.mesh or (dist.get_world_size(),), memory_budget=args.memory,
                        checkpoint=args.checkpoint)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
for step in range(args.steps):
    idx, targets = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.4f}")
dist.destroy_process_group()
