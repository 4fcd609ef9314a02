"""``cauto-profile TARGET``: profile a model factory symbolically and print what it costs.

TARGET is ``path/to/file.py:fn`` or ``package.module:fn`` (e.g. ``cauto.profiler.zoo:gpt2_small``);
``fn()`` returns ``(model, inputs)`` and is called on the meta device. Exit codes: 0 success,
2 bad input (target not found, factory raising, real allocations in the factory, an op that
cannot be captured or profiled). Tracebacks only with --debug; no output file unless everything
succeeded.
"""

from __future__ import annotations

import argparse
import io
import json
import sys

from cauto.plan.units import format_bytes
from cauto.profiler.target import UsageError, bind_sizes, load_target

EXIT_BAD_INPUT = 2


def _fmt_bytes(n: float) -> str:
    return format_bytes(n, largest="TiB")


def _fmt_flops(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.3g} {unit}FLOP"
        n /= 1000
    return str(n)


def _parse_hints(items: list[str]) -> dict[str, int]:
    hints = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise UsageError(f"--size-hint {item!r} must look like op=N (e.g. masked_select=4096)")
        hints[name] = int(value)
    return hints


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cauto-profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="path/to/file.py:fn or package.module:fn; fn() returns (model, inputs)")
    p.add_argument("--json", action="store_true", help="print a JSON summary to stdout instead of tables")
    p.add_argument("-o", "--output", metavar="GRAPH_JSON", help="write the cauto graph document here")
    p.add_argument("--replace-symlink", action="store_true",
                   help="replace an output that is a symbolic link with a file (refused otherwise)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="memory model (default cpu)")
    p.add_argument("--device-model", default=None, help="time model: cpu, a100, h100, h200 (default by --device)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="cast the model to this dtype")
    p.add_argument("--autocast", choices=["bf16", "fp16"], default=None, help="run forward under autocast")
    p.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "none"], default="adamw")
    p.add_argument("--batch", type=int, default=None, help="passed to fn as batch= if it accepts it")
    p.add_argument("--seq", type=int, default=None, help="passed to fn as seq= if it accepts it")
    p.add_argument("--steps", type=int, default=2, help="training steps to simulate (default 2)")
    p.add_argument("--inference", action="store_true", help="forward only, under no_grad")
    p.add_argument("--size-hint", action="append", default=[], metavar="OP=N",
                   help="size of a data-dependent op's output (repeatable), see cauto.profiler.size_hint")
    p.add_argument("--depth", type=int, default=2, help="module depth of the per-module table (default 2)")
    p.add_argument("--plot", metavar="PNG", help="plot the memory timeline (needs matplotlib)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _print_tables(prof, depth: int, out) -> None:
    s = prof.summary()
    print(f"model {prof.name}: {len(prof.nodes)} nodes, settings {json.dumps(prof.settings)}", file=out)
    print(f"peak memory {_fmt_bytes(prof.peak_bytes)} ({prof.peak_bytes} bytes) eager; model+inputs "
          f"{_fmt_bytes(prof.baseline_bytes)}; FLOPs/step {_fmt_flops(prof.flops)}; "
          f"est. time/step {prof.time_s * 1e3:.3f} ms on {prof.device_model.name}", file=out)
    if prof.peaks_differ_because is None:
        print("cauto's program of this step peaks at the same bytes", file=out)
    else:
        print(f"cauto's program of this step peaks at {_fmt_bytes(prof.program_peak_bytes)} "
              f"({prof.program_peak_bytes} bytes): {prof.peaks_differ_because}", file=out)
    print("", file=out)
    print(f"{'module':40s} {'nodes':>6s} {'fwd FLOP':>12s} {'bwd FLOP':>12s} {'saved':>12s} {'time ms':>10s}", file=out)
    for r in prof.module_table(depth=depth):
        name = r["module"] or "<model>"
        print(f"{name[:40]:40s} {r['nodes']:6d} {_fmt_flops(r['fwd_flops']):>12s} {_fmt_flops(r['bwd_flops']):>12s} "
              f"{_fmt_bytes(r['saved_bytes']):>12s} {r['time_s'] * 1e3:10.3f}", file=out)
    print("", file=out)
    print("timeline (peak live bytes per phase and step):", file=out)
    for k, v in s["phase_steps"].items():
        print(f"  {k:14s} {_fmt_bytes(v):>12s}", file=out)
    if prof.peak_event:
        i, phase, node, live = prof.peak_event
        print(f"peak at event {i} of {len(prof.timeline)}: {phase}, node {node}, {_fmt_bytes(live)}", file=out)


def _plot(prof, path: str, replace_symlink: bool) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UsageError("--plot needs matplotlib (pip install 'cauto-profiler[plot]')") from exc
    xs = [e[0] for e in prof.timeline]
    ys = [e[3] / 2**20 for e in prof.timeline]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(xs, ys, lw=0.8)
    ax.set_xlabel("allocation event")
    ax.set_ylabel("live MiB")
    ax.set_title(f"{prof.name}: peak {_fmt_bytes(prof.peak_bytes)}")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    from cauto.plan import write_atomic

    write_atomic(path, png.getvalue(), replace_symlink=replace_symlink)


def main(argv: list[str] | None = None, progress=None) -> int:
    """Entry point of `cauto-profile`; returns the exit status. ``progress(phase, done, total)``, when
    given, follows the profile (see :mod:`cauto.profiler.progress`; the `cauto` command draws it)."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args, progress)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # every failure is reported in one line; the traceback only with --debug
        if args.debug:
            raise
        from cauto.plan import DocumentError, OutputError
        from cauto.profiler.capture import CaptureError

        kind = "cannot capture/profile the model" if isinstance(exc, CaptureError) else "error"
        if isinstance(exc, UsageError):
            kind = "error"
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"cauto-profile: {kind}: {msg}", file=sys.stderr)
        if not isinstance(exc, (UsageError, CaptureError, OutputError, DocumentError)):
            print("cauto-profile: rerun with --debug for the traceback", file=sys.stderr)
        return EXIT_BAD_INPUT


def _run(args, progress=None) -> int:
    import torch

    from cauto.plan import check_output
    from cauto.profiler.capture import CaptureError
    from cauto.profiler.symbolic import profile

    for output in (args.output, args.plot):  # refuse a bad output before profiling, not after
        if output:
            check_output(output, replace_symlink=args.replace_symlink)
    fn = bind_sizes(load_target(args.target), {"batch": args.batch, "seq": args.seq})
    hints = _parse_hints(args.size_hint)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.dtype]

    def factory():
        try:
            return fn()
        except CaptureError:
            raise
        except Exception as exc:
            raise UsageError(f"the factory {args.target} raised {type(exc).__name__}: {exc}") from exc

    factory.__name__ = getattr(fn, "__name__", "model")
    prof = profile(factory, train=not args.inference, optimizer=args.optimizer, device=args.device, dtype=dtype,
                   autocast=args.autocast, steps=args.steps, device_model=args.device_model, size_hints=hints,
                   progress=progress)
    doc = prof.to_graph() if args.output else None  # build (and validate) before writing anything
    if args.plot:
        _plot(prof, args.plot, args.replace_symlink)
    if doc is not None:
        from cauto.plan import dump

        dump(doc, args.output, replace_symlink=args.replace_symlink)
    if args.json:
        print(json.dumps(prof.summary(), indent=1))
    else:
        _print_tables(prof, args.depth, sys.stdout)
        if args.output:
            print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
