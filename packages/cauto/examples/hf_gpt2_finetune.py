"""Fine-tune a stock Hugging Face GPT-2 on random tokens, parallelized by cauto.

    torchrun --nproc-per-node 2 packages/cauto/examples/hf_gpt2_finetune.py

The lines marked `# cauto` are the whole change from a single-process script.
"""

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from cauto.api import autoparallelize  # cauto

BATCH, SEQ, VOCAB = 8, 64, 1000
config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)

dist.init_process_group("gloo")  # cauto
torch.manual_seed(0)
tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
batch = {"input_ids": tokens, "labels": tokens}
model = autoparallelize(lambda: GPT2LMHeadModel(config), batch, (dist.get_world_size(),),  # cauto
                        memory_budget="1GiB")  # cauto
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(5):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    loss = model(input_ids=tokens, labels=tokens)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.4f}")
if dist.get_rank() == 0:
    print(f"predicted peak per rank {model.predictions['peak_bytes'] / 2**20:.1f} MiB")
dist.destroy_process_group()
