"""Train a small ResNet-style CNN (BatchNorm, residuals) on random images with cauto.

    torchrun --nproc-per-node 2 packages/cauto/examples/cnn.py
"""

import torch
import torch.distributed as dist

from cauto.api import autoparallelize
from cauto.profiler.zoo import ResNet

dist.init_process_group("gloo")
torch.manual_seed(0)
images, labels = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
model = autoparallelize(lambda: ResNet(width=16, blocks=3, classes=10), (images, labels),
                        (dist.get_world_size(),), memory_budget="1GiB")
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(5):
    images, labels = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    loss = model(images, labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.4f}")
dist.barrier()  # every rank done with its collectives before any tears its process group down
dist.destroy_process_group()
