"""Built-in model factories: small plain models for tests and demos, stock Hugging Face models.

Every factory returns ``(model, inputs)`` and is meant to be called by cauto on the meta or fake
device: nothing here loads weights. Sizes are keyword arguments with small defaults; the
``*_small`` presets are GPT-2-small-sized. Hugging Face factories need ``transformers``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from cauto.profiler.kept_functions import declare_elementwise


class MLP(nn.Module):
    """Three linear layers with GELU; loss is MSE against a target."""

    def __init__(self, dim: int = 64, hidden: int = 256, layers: int = 3):
        super().__init__()
        sizes = [dim] + [hidden] * (layers - 1) + [dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return F.mse_loss(x, target)


class StraightThroughRound(torch.autograd.Function):
    """Rounds to multiples of ``1 / scale``; backward passes the gradient straight through (autodiff of the
    forward would give 0): a model whose training depends on its custom backward being kept."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@declare_elementwise
class ShardableStraightThroughRound(StraightThroughRound):
    """The same Function, declared elementwise: its kept op may run on shards."""


class QuantizedMLP(MLP):
    """The MLP with its hidden activations rounded by a straight-through estimator (a custom Function)."""

    def __init__(self, dim: int = 64, hidden: int = 256, layers: int = 3, shardable: bool = False):
        super().__init__(dim, hidden, layers)
        self.round = ShardableStraightThroughRound if shardable else StraightThroughRound

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.round.apply(F.gelu(x), 4.0)
        return F.mse_loss(x, target)


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with BatchNorm and a residual."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """A small ResNet-style CNN; loss is cross entropy over classes."""

    def __init__(self, width: int = 16, blocks: int = 2, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        chans = [width * 2**i for i in range(blocks)]
        self.blocks = nn.Sequential(*[BasicBlock(c_in, c_out, 1 if i == 0 else 2)
                                      for i, (c_in, c_out) in enumerate(zip([width] + chans[:-1], chans))])
        self.fc = nn.Linear(chans[-1], classes)

    def forward(self, x, labels):
        x = self.blocks(self.stem(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return F.cross_entropy(self.fc(x), labels)


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections and grouped KV heads."""

    def __init__(self, dim: int, heads: int, kv_heads: int | None = None, rope: bool = False, bias: bool = True):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = dim // heads
        self.rope = rope
        self.q = nn.Linear(dim, heads * self.head_dim, bias=bias)
        self.k = nn.Linear(dim, self.kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(dim, self.kv_heads * self.head_dim, bias=bias)
        self.proj = nn.Linear(heads * self.head_dim, dim, bias=bias)

    def forward(self, x, cos=None, sin=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


def apply_rope(x, cos, sin):
    """Rotary position embedding on the last dim (half-split convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-style decoder (nanoGPT shape): learned positions, LayerNorm, GELU MLP, tied head."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, seq: int = 32,
                 checkpoint: bool = False):
        super().__init__()
        self.checkpoint = checkpoint
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, rope=True, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 hidden: int = 172, seq: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, dim=-1), persistent=False)

    def forward(self, idx, targets):
        s = idx.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _tokens(batch: int, seq: int, vocab: int) -> dict:
    idx = torch.randint(0, vocab, (batch, seq))
    return {"idx": idx, "targets": torch.randint(0, vocab, (batch, seq))}


def mlp(batch: int = 32, dim: int = 64, hidden: int = 256, layers: int = 3):
    return MLP(dim, hidden, layers), (torch.randn(batch, dim), torch.randn(batch, dim))


def mlp_finetune(batch: int = 32, dim: int = 64, hidden: int = 256, layers: int = 4):
    """The MLP fine-tuned: every layer but the last frozen (a frozen backbone under a trainable head)."""
    model = MLP(dim, hidden, layers)
    for layer in model.layers[:-1]:
        layer.requires_grad_(False)
    return model, (torch.randn(batch, dim), torch.randn(batch, dim))


def mlp_straight_through(batch: int = 32, dim: int = 64, hidden: int = 256, layers: int = 3,
                         shardable: bool = False):
    """The MLP with a custom autograd.Function (straight-through rounding) after each hidden layer;
    ``shardable``: the Function is declared elementwise (cauto.profiler.declare_elementwise)."""
    return QuantizedMLP(dim, hidden, layers, shardable), (torch.randn(batch, dim), torch.randn(batch, dim))


def cnn(batch: int = 8, width: int = 16, blocks: int = 2, image: int = 16, classes: int = 10):
    return ResNet(width, blocks, classes), (torch.randn(batch, 3, image, image), torch.randint(0, classes, (batch,)))


def gpt(batch: int = 4, seq: int = 32, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4,
        checkpoint: bool = False):
    """``checkpoint=True`` wraps every block in non-reentrant torch.utils.checkpoint."""
    return GPT(vocab, dim, layers, heads, seq, checkpoint), _tokens(batch, seq, vocab)


def llama(batch: int = 4, seq: int = 32, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4,
          kv_heads: int = 2, hidden: int = 172):
    return Llama(vocab, dim, layers, heads, kv_heads, hidden, seq), _tokens(batch, seq, vocab)


def gpt2_small(batch: int = 8, seq: int = 1024):
    """A GPT-2-small-sized plain GPT (12 layers, 768 hidden, 50257 vocab): about 124M parameters."""
    return gpt(batch=batch, seq=seq, vocab=50257, dim=768, layers=12, heads=12)


def _hf_tokens(batch: int, seq: int, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "labels": torch.randint(0, vocab, (batch, seq))}


def hf_gpt2(batch: int = 2, seq: int = 32, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4,
            checkpoint: bool = False):
    """Stock transformers GPT2LMHeadModel from a config (random init, dropout off).

    ``checkpoint=True`` turns on Hugging Face gradient checkpointing (non-reentrant)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=max(seq, 32), n_embd=dim, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    if checkpoint:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, _hf_tokens(batch, seq, vocab)


def hf_llama(batch: int = 2, seq: int = 32, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4,
             kv_heads: int = 2, hidden: int = 172, dtype: torch.dtype | None = None):
    """Stock transformers LlamaForCausalLM from a config (random init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max(seq, 32),
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    return model, _hf_tokens(batch, seq, vocab)


def hf_mixtral(batch: int = 2, seq: int = 16, vocab: int = 128, dim: int = 32, layers: int = 1, heads: int = 4,
               kv_heads: int = 2, hidden: int = 64, experts: int = 4, top_k: int = 2):
    """Stock transformers MixtralForCausalLM (mixture of experts) from a config (random init).

    Its experts count tokens per expert by the device they run on and multiply through the
    ``transformers::grouped_mm_fallback`` library op (one graph node, its registered backward)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads,
                           max_position_embeddings=max(seq, 32), num_local_experts=experts,
                           num_experts_per_tok=top_k, router_aux_loss_coef=0.0, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
    return MixtralForCausalLM(config), _hf_tokens(batch, seq, vocab)


def hf_llama2_7b(batch: int = 1, seq: int = 4096):
    """Llama-2-7B shapes (32 layers, 4096 hidden, 11008 MLP, 32000 vocab) in bf16."""
    return hf_llama(batch=batch, seq=seq, vocab=32000, dim=4096, layers=32, heads=32, kv_heads=32, hidden=11008,
                    dtype=torch.bfloat16)


def hf_bert(batch: int = 2, seq: int = 32, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4):
    """Stock transformers BertForMaskedLM from a config (dropout off)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=4 * dim, max_position_embeddings=max(seq, 32),
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config), _hf_tokens(batch, seq, vocab)


def hf_clip(batch: int = 4, seq: int = 16, vocab: int = 99, dim: int = 32, layers: int = 2, heads: int = 4,
            image: int = 32, patch: int = 8):
    """Stock transformers CLIPModel (a dual encoder) from a config, trained with its contrastive loss:
    the inputs carry ``return_loss=True``, a non-tensor input (a constant of the capture)."""
    from transformers import CLIPConfig, CLIPModel

    encoder = dict(hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers, num_attention_heads=heads,
                   attention_dropout=0.0)
    config = CLIPConfig(text_config=dict(encoder, vocab_size=vocab, max_position_embeddings=seq, eos_token_id=2,
                                         bos_token_id=1, pad_token_id=0),
                        vision_config=dict(encoder, image_size=image, patch_size=patch), projection_dim=dim // 2)
    return CLIPModel(config), {"input_ids": torch.randint(3, vocab, (batch, seq)),
                               "pixel_values": torch.randn(batch, 3, image, image), "return_loss": True}


def hf_t5(batch: int = 2, seq: int = 16, target: int = 8, vocab: int = 64, dim: int = 32, layers: int = 2,
          heads: int = 4):
    """Stock transformers T5ForConditionalGeneration (encoder-decoder) from a config (dropout off).
    Its learned relative position bias is a float attention mask that requires grad."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=vocab, d_model=dim, d_kv=dim // heads, d_ff=2 * dim, num_layers=layers,
                      num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(config), {"input_ids": torch.randint(2, vocab, (batch, seq)),
                                                "labels": torch.randint(2, vocab, (batch, target))}


def hf_vit(batch: int = 4, image: int = 32, patch: int = 8, dim: int = 32, layers: int = 2, heads: int = 4,
           classes: int = 5):
    """A small Hugging Face ViT image classifier (no dropout), random weights, with labels."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=image, patch_size=patch, hidden_size=dim, num_hidden_layers=layers,
                       num_attention_heads=heads, intermediate_size=2 * dim, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, num_labels=classes)
    return ViTForImageClassification(config), {"pixel_values": torch.randn(batch, 3, image, image),
                                               "labels": torch.randint(0, classes, (batch,))}


def hf_swin(batch: int = 2, image: int = 32, dim: int = 16, depths: tuple = (1, 1), heads: tuple = (2, 2),
            window: int = 4, classes: int = 5):
    """Stock transformers SwinForImageClassification (hierarchical vision) from a config (dropout and
    drop path off). Its relative position bias is a float attention mask that requires grad."""
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(image_size=image, patch_size=2, embed_dim=dim, depths=list(depths), num_heads=list(heads),
                        window_size=window, num_labels=classes, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return SwinForImageClassification(config), {"pixel_values": torch.randn(batch, 3, image, image),
                                                "labels": torch.randint(0, classes, (batch,))}


def hf_convnext(batch: int = 2, image: int = 32, dims: tuple = (16, 32), depths: tuple = (1, 1), classes: int = 5):
    """Stock transformers ConvNextForImageClassification from a config (drop path off): depthwise
    convolutions and layer norms over channels-last permutes."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_stages=len(depths), hidden_sizes=list(dims), depths=list(depths), num_labels=classes,
                            drop_path_rate=0.0)
    return ConvNextForImageClassification(config), {"pixel_values": torch.randn(batch, 3, image, image),
                                                    "labels": torch.randint(0, classes, (batch,))}


def hf_resnet(batch: int = 4, image: int = 32, dims: tuple = (16, 32, 64, 128), depths: tuple = (2, 2, 2, 2),
              classes: int = 5, dtype: str | None = None):
    """Stock transformers ResNetForImageClassification, ResNet-18's layout (basic blocks, 2-2-2-2) at
    small widths: BatchNorm after every convolution. ``dtype``: 'float64' for parity checks below fp32 noise."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=dims[0], hidden_sizes=list(dims), depths=list(depths), layer_type="basic",
                          num_labels=classes)
    floating = getattr(torch, dtype) if dtype else torch.float32
    return ResNetForImageClassification(config).to(floating), {
        "pixel_values": torch.randn(batch, 3, image, image).to(floating),
        "labels": torch.randint(0, classes, (batch,))}


ZOO = {"mlp": mlp, "mlp_finetune": mlp_finetune, "mlp_straight_through": mlp_straight_through, "cnn": cnn, "gpt": gpt, "llama": llama, "gpt2_small": gpt2_small,
       "hf_gpt2": hf_gpt2, "hf_llama": hf_llama, "hf_mixtral": hf_mixtral, "hf_bert": hf_bert,
       "hf_llama2_7b": hf_llama2_7b, "hf_clip": hf_clip,
       "hf_t5": hf_t5, "hf_vit": hf_vit, "hf_swin": hf_swin, "hf_convnext": hf_convnext, "hf_resnet": hf_resnet}
