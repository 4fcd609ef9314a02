"""Chunked training equals the un-chunked baseline (same fused AdamW, same seeds) on one process.

The device is the simulated CPU arena: budgets are enforced by the arena size, every host<->device
copy is real and counted. Budgets are given as a share of model state (params + grads + Adam m, v)
plus the non-model (activation) peak that the warm-up measures.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cauto.profiler.zoo import gpt, mlp
from cauto.runtime.chunks import chunk_module, load_checkpoint, save_checkpoint, wrap

STEPS = 5


@pytest.fixture(autouse=True)
def one_thread():
    """Deterministic, and polite to the other tests sharing the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TwoGroupNet(nn.Module):
    """Linear layers, LayerNorm and a weight shared by two layers (a shared parameter)."""

    def __init__(self, dim=32):
        super().__init__()
        self.inp = nn.Linear(dim, 4 * dim)
        self.norm = nn.LayerNorm(4 * dim)
        self.mid = nn.Linear(4 * dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.again = nn.Linear(4 * dim, 4 * dim)
        self.again.weight = self.mid.weight

    def forward(self, x, y):
        h = F.gelu(self.norm(self.inp(x)))
        h = F.gelu(self.again(F.gelu(self.mid(h))))
        return F.mse_loss(self.out(h), y)


def gpt_factory():
    torch.manual_seed(0)
    return gpt(batch=2, seq=16, dim=64, layers=2)[0]


def net_factory():
    torch.manual_seed(0)
    return TwoGroupNet()


def gpt_batch(step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)


def net_batch(step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def two_groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2, fused=True)


def state_bytes(factory):
    return sum(p.numel() for p in factory().parameters()) * 16


def train_baseline(factory, opt_fn, batch_fn, accum=1, clip=None):
    model = factory()
    opt = opt_fn(model)
    losses = []
    for step in range(STEPS):
        for micro in range(accum):
            loss = model(*batch_fn(step, micro)) / accum
            loss.backward()
        losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()]


def train_chunked(factory, opt_fn, batch_fn, budget, accum=1, clip=None, steps=STEPS, **kw):
    model, opt = wrap(factory, optimizer=opt_fn, device_budget=budget, device="cpu", max_grad_norm=clip, **kw)
    losses = [run_step(model, opt, batch_fn, step, accum) for step in range(steps)]
    return model, opt, losses


def run_step(model, opt, batch_fn, step, accum=1):
    for micro in range(accum):
        loss = model(*batch_fn(step, micro)) / accum
        opt.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


@functools.cache
def nonmodel_peak(factory, batch_fn):
    model, opt, _ = train_chunked(factory, adamw, batch_fn, "1GiB", steps=1)
    return opt.manager.nonmodel_peak_bytes


def budget(factory, batch_fn, share):
    return int(share * state_bytes(factory)) + nonmodel_peak(factory, batch_fn)


def params_of(model):
    return [p.detach() for p in model.module.parameters()]


@pytest.mark.parametrize("share", [1.5, 0.5, 0.25])
def test_gpt_tied_equals_baseline_bit_exact(share):
    base_losses, base_params = train_baseline(gpt_factory, adamw, gpt_batch)
    model, opt, losses = train_chunked(gpt_factory, adamw, gpt_batch, budget(gpt_factory, gpt_batch, share))
    assert losses == base_losses
    for p, q in zip(params_of(model), base_params):
        assert torch.equal(p, q)
    traffic = opt.manager.mover.traffic
    assert traffic.moved_bytes > 0
    if share < 1:
        assert opt.manager.arena.nbytes < state_bytes(gpt_factory) * share + 4096


def test_groups_accumulation_clipping_shared_weight():
    base_losses, base_params = train_baseline(net_factory, two_groups, net_batch, accum=2, clip=0.05)
    model, opt, losses = train_chunked(net_factory, two_groups, net_batch, budget(net_factory, net_batch, 0.6),
                                       accum=2, clip=0.05)
    assert opt.last_grad_norm > 0.05  # clipping really scaled the gradients
    torch.testing.assert_close(losses, base_losses, rtol=1e-6, atol=0)
    for p, q in zip(params_of(model), base_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_model_state_four_times_the_whole_budget_trains():
    """Device budget (chunks + activations) under a quarter of model state: 16-layer MLP."""
    def factory():
        torch.manual_seed(0)
        return mlp(dim=128, hidden=128, layers=16)[0]

    def batch(step, micro=0):
        g = torch.Generator().manual_seed(0)  # one batch: the loss must fall
        return torch.randn(8, 128, generator=g), torch.randn(8, 128, generator=g)

    base_losses, base_params = train_baseline(factory, adamw, batch)
    device_budget = state_bytes(factory) * 2 // 9
    model, opt, losses = train_chunked(factory, adamw, batch, device_budget)
    assert state_bytes(factory) >= 4 * device_budget
    assert losses == base_losses and losses[-1] < losses[0]
    for p, q in zip(params_of(model), base_params):
        assert torch.equal(p, q)
    assert opt.manager.arena.peak_used_bytes <= opt.manager.arena.nbytes < device_budget


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_trains_close_to_fp32(dtype):
    base_losses, _ = train_baseline(gpt_factory, adamw, gpt_batch)
    model, opt, losses = train_chunked(gpt_factory, adamw, gpt_batch, budget(gpt_factory, gpt_batch, 0.3),
                                       compute_dtype=dtype, steps=8)
    assert all(p.dtype == dtype for p in model.module.parameters())
    if dtype == torch.float16:  # the default scale 2**16 overflows fp16 at first: steps skipped, scale backed off
        assert opt.skipped_steps >= 1 and opt.loss_scale < 2.0**16
    torch.testing.assert_close(losses[0], base_losses[0], rtol=3e-2, atol=0)  # same model, lower precision
    losses = losses[opt.skipped_steps:]
    assert losses[-1] < losses[0]


def test_checkpoint_resume_equals_continuous(tmp_path):
    share = 0.3
    b = budget(gpt_factory, gpt_batch, share)
    _, _, full = train_chunked(gpt_factory, adamw, gpt_batch, b)
    model, opt, first = train_chunked(gpt_factory, adamw, gpt_batch, b, steps=3)
    save_checkpoint(opt, str(tmp_path))
    model2, opt2 = wrap(gpt_factory, optimizer=adamw, device_budget=b, device="cpu")
    load_checkpoint(opt2, str(tmp_path))
    rest = [run_step(model2, opt2, gpt_batch, step) for step in range(3, STEPS)]
    assert first + rest == full


class SometimesUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.unused, self.b = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, y):
        return F.mse_loss(self.b(F.gelu(self.a(x))), y)


def test_never_used_parameters_are_skipped_like_torch():
    def factory():
        torch.manual_seed(0)
        return SometimesUnused()

    def batch(step, micro=0):
        g = torch.Generator().manual_seed(step)
        return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)

    base_losses, base_params = train_baseline(factory, adamw, batch)
    model, opt, losses = train_chunked(factory, adamw, batch, "1MiB")
    assert losses == base_losses
    for p, q in zip(params_of(model), base_params):
        assert torch.equal(p, q)  # includes the unused layer: no weight decay without a gradient


def test_naive_policy_trains_identically_and_moves_more():
    b = budget(gpt_factory, gpt_batch, 0.25)
    _, belady, losses = train_chunked(gpt_factory, adamw, gpt_batch, b)
    _, naive, naive_losses = train_chunked(gpt_factory, adamw, gpt_batch, b, policy="naive")
    assert losses == naive_losses
    assert naive.manager.mover.traffic.moved_bytes > 1.5 * belady.manager.mover.traffic.moved_bytes


def test_chunk_only_some_parameters():
    """What the plan runtime does for params whose state is "chunked": the rest stay plain."""
    def factory():
        torch.manual_seed(0)
        return mlp(dim=32, hidden=64)[0]

    base_losses, base_params = train_baseline(factory, adamw, net_batch)
    module = factory()
    chunked_names = ["layers.0.weight", "layers.0.bias", "layers.2.weight"]
    plain = [p for n, p in module.named_parameters() if n not in chunked_names]
    model, opt = chunk_module(module, adamw, "64KiB", params=chunked_names, device="cpu")
    plain_opt = torch.optim.AdamW(plain, lr=1e-2, fused=True)
    losses = []
    for step in range(STEPS):
        loss = model(*net_batch(step))
        loss.backward()
        opt.step()
        plain_opt.step()
        opt.zero_grad()
        plain_opt.zero_grad()
        losses.append(loss.item())
    assert losses == base_losses
    for p, q in zip(module.parameters(), base_params):
        assert torch.equal(p.detach(), q)
    assert opt.manager.layout.num_chunks >= 1 and len(opt.manager.layout.slots) == 3


class CheckpointedGPT(nn.Module):
    """The zoo GPT with every block under non-reentrant activation checkpointing."""

    def __init__(self):
        super().__init__()
        self.gpt = gpt(batch=2, seq=16, dim=64, layers=2)[0]

    def forward(self, idx, targets):
        g = self.gpt
        x = g.tok(idx) + g.pos(torch.arange(idx.shape[1]))
        for block in g.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return F.cross_entropy(g.head(g.ln_f(x)).flatten(0, 1), targets.flatten())


def test_activation_checkpointing_inside_the_model():
    def factory():
        torch.manual_seed(0)
        return CheckpointedGPT()

    base_losses, base_params = train_baseline(factory, adamw, gpt_batch)
    # the checkpointed model's own non-model peak (its recomputation in backward: 0.31 MiB measured; the
    # plain GPT's 0.42 MiB left too small an arena beside it) and 40% of the state, which still pages: a
    # recomputed block keeps its chunks pinned until its gradients are in (0.40 MiB of chunks at once)
    model, opt, losses = train_chunked(factory, adamw, gpt_batch, budget(factory, gpt_batch, 0.4))
    assert losses == base_losses
    for p, q in zip(params_of(model), base_params):
        assert torch.equal(p, q)
    assert opt.manager.mover.traffic.moved_bytes > 0


def test_cpu_warm_up_measures_every_live_byte_but_the_chunks():
    """The CPU warm-up's non-model peak (chunks/model.py) is what the step really holds beside the
    chunks, counted by hand for a 2-layer MLP (batch 256, 64 -> 256 -> 64, MSE): at the second
    linear's backward, the inputs x and y, both hidden activations (the next op keeps each), the
    output's gradient, the hidden gradient and the weight's and bias's gradients as autograd hands
    them to the chunk; and, live until ``backward`` returns, the loss (CPU ``mse_loss`` returns its
    0-dim result in a storage of the elementwise loss's size, 256 x 64 floats) and the loss's
    gradient seed (one float). The reference model run between backward and step is not counted."""
    def factory():
        torch.manual_seed(0)
        return mlp(batch=256, dim=64, hidden=256, layers=2)[0]

    x, y = torch.randn(256, 64), torch.randn(256, 64)
    model, opt = wrap(factory, optimizer=adamw, device_budget="1GiB", device="cpu")
    model(x, y).backward()
    factory()(x, y).backward()  # the caller's own work after backward
    opt.step()
    b = 4
    want = b * (2 * 256 * 64 + 2 * 256 * 256 + 256 * 64 + 256 * 256 + 64 * 256 + 64) + b * (256 * 64 + 1)
    assert opt.manager.nonmodel_peak_bytes == want
