"""How far fp32 noise alone moves a BatchNorm CNN's losses: the yardstick for multi-rank parity.

    OMP_NUM_THREADS=1 python tools/bench/bn_numerics.py hf_resnet '{"batch": 8, "dims": [64, 128, 256, 512], "image": 64}'

One process only, the same model, initial weights and data, 3 AdamW steps at lr 1e-2 (as the
runtime's parity worker, packages/cauto-runtime/tests/workers.py): (a) fp32; (b) fp32 with the
batch's samples in another order, the same function mathematically (batch-norm statistics, the loss
mean and the weight gradients are sums over the batch; only their order changes, as it does when
ranks hold slices); (c) fp64, the reference. Prints each step's relative loss difference.
"""

from __future__ import annotations

import json
import sys

import torch

from cauto.profiler import zoo
from cauto.profiler.capture import loss_of

name = sys.argv[1] if len(sys.argv) > 1 else "hf_resnet"
kw = json.loads(sys.argv[2]) if len(sys.argv) > 2 else dict(batch=8)
torch.set_num_threads(1)

def run(dtype, perm=None, steps=3):
    torch.manual_seed(0)
    model, inputs = zoo.ZOO[name](**kw)
    model = model.to(dtype).train()
    inputs = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    if perm is not None:
        inputs = {k: v[perm] for k, v in inputs.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = loss_of(model(**inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses

ref = run(torch.float64)
a = run(torch.float32)
perm = torch.randperm(kw.get("batch", 8), generator=torch.Generator().manual_seed(1))
b = run(torch.float32, perm)


def rel(x, y):
    return [abs(u - v) / abs(v) for u, v in zip(x, y)]


print(name, kw)
print("fp32 vs fp64:                 ", [f"{r:.1e}" for r in rel(a, ref)])
print("fp32 permuted batch vs fp64:  ", [f"{r:.1e}" for r in rel(b, ref)])
print("fp32 permuted vs fp32:        ", [f"{r:.1e}" for r in rel(b, a)])
