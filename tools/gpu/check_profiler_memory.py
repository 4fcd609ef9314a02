"""Profiler memory model for CUDA vs torch.cuda.max_memory_allocated on a real GPU. One command:

    python tools/gpu/check_profiler_memory.py          (finishes in well under 2 minutes on one GPU)

For a few zoo models (fp32 and bf16, one with activation checkpointing) it profiles two AdamW steps
with ``cauto.profiler.profile(fn, device="cuda")`` on this machine's CPU (meta tensors) and then
runs the same two steps for real on the GPU, printing predicted vs measured peak allocated bytes.
The cuBLAS/cuDNN workspaces that the first kernels allocate are measured separately (warm-up before
the model is built) and reported in their own column, so the table shows what the profiler models.
Works from a bare checkout: the packages' src folders are put on sys.path.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for src in sorted((ROOT / "packages").glob("*/src")):
    sys.path.insert(0, str(src))

import torch  # noqa: E402
from cuda_workspaces import warm_cuda_workspaces  # noqa: E402 (tools/gpu, beside this script)

from cauto.profiler import profile, zoo  # noqa: E402
from cauto.profiler.capture import LossWrapper, split_inputs  # noqa: E402
from cauto.profiler.training import cast_inputs, make_optimizer, run_steps  # noqa: E402

CASES = [
    ("mlp fp32", zoo.mlp, {"batch": 256, "dim": 1024, "hidden": 4096}, None),
    ("gpt fp32", zoo.gpt, {"batch": 8, "seq": 512, "vocab": 8192, "dim": 512, "layers": 4, "heads": 8}, None),
    ("gpt bf16", zoo.gpt, {"batch": 8, "seq": 512, "vocab": 8192, "dim": 512, "layers": 4, "heads": 8},
     torch.bfloat16),
    ("gpt ckpt bf16", zoo.gpt, {"batch": 8, "seq": 512, "vocab": 8192, "dim": 512, "layers": 4, "heads": 8,
                                "checkpoint": True}, torch.bfloat16),
    ("llama bf16", zoo.llama, {"batch": 4, "seq": 1024, "vocab": 8192, "dim": 1024, "layers": 4, "heads": 16,
                               "kv_heads": 16, "hidden": 2816}, torch.bfloat16),
    ("cnn fp32", zoo.cnn, {"batch": 64, "width": 64, "blocks": 3, "image": 64}, None),
    # Stock Hugging Face models: the user's eager step on CUDA (SDPA kernels chosen by eager's rules).
    ("hf gpt2 fp32", zoo.hf_gpt2, {"batch": 4, "seq": 512, "vocab": 8192, "dim": 512, "layers": 4, "heads": 8},
     None),
    ("hf llama bf16", zoo.hf_llama, {"batch": 4, "seq": 512, "vocab": 8192, "dim": 512, "layers": 4, "heads": 8,
                                     "kv_heads": 4, "hidden": 1408}, torch.bfloat16),
    ("hf bert fp32", zoo.hf_bert, {"batch": 8, "seq": 256, "vocab": 8192, "dim": 512, "layers": 4, "heads": 8},
     None),
]




def real_peak(fn, dtype) -> tuple[int, int]:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model, inputs = fn()
    if dtype is not None:
        model, inputs = model.to(dtype), cast_inputs(inputs, dtype)
    model.train()
    args, kwargs = split_inputs(inputs)
    wrapper = LossWrapper(model)
    opt = make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run_steps(lambda: wrapper(*args, **kwargs), opt, steps=2)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), 0


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    t0 = time.time()
    workspace = warm_cuda_workspaces()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuBLAS warm-up leaves {workspace} bytes allocated")
    header = f"{'case':16s} {'predicted':>14s} {'measured':>14s} {'measured-ws':>14s} {'diff':>12s} {'rel':>8s} {'prof s':>7s}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    done = 0
    for label, factory, kw, dtype in CASES:
        fn = functools.partial(factory, **kw)
        fn.__name__ = factory.__name__
        t = time.time()
        try:
            prof = profile(fn, device="cuda", dtype=dtype, device_model="h200")
        except Exception as exc:  # report and continue: one table for the whole machine loan
            print(f"{label:16s} profile failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        tp = time.time() - t
        try:
            measured, _ = real_peak(fn, dtype)
        except Exception as exc:
            print(f"{label:16s} real run failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        torch.cuda.empty_cache()
        net = measured - workspace
        diff = prof.peak_bytes - net
        rel = diff / net
        worst = max(worst, abs(rel))
        print(f"{label:16s} {prof.peak_bytes:14d} {measured:14d} {net:14d} {diff:+12d} {rel:+8.3%} {tp:7.2f}")
        done += 1
    effects = getattr(locals().get("prof"), "modelled_effects", [])
    print(f"worst relative error {worst:.3%}; modelled effects: "
          + "; ".join(e for e in effects if "CUDA" in e or "SDPA" in e or "foreach" in e))
    print(f"done in {time.time() - t0:.0f} s; {done}/{len(CASES)} cases ran")
    return 0 if done == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
