"""`cauto run`: launch the runtime on N local processes through torchrun.

    cauto run TARGET --plan plan.json --nproc 4 [--steps 3] [--verify] [--timeout-s 120]
              [--accumulate K] [--max-norm X] [--save-every N --save-dir DIR] [--resume DIR]
              [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT [--rdzv-backend c10d|static]
               [--rdzv-timeout-s 300]] [-- <extra torchrun flags>]

More than one host: run the same command on every host with ``--nnodes`` (the number of hosts),
``--rdzv-endpoint`` (host:port of the rendezvous, reachable from every host; the first host's
address, any free port) and, for the static backend, each host's ``--node-rank``. Each host runs
``--nproc`` ranks; the world is ``nproc * nnodes`` ranks, numbered host by host, so the plan's mesh
is laid out row-major over hosts: the outer mesh axis is the one that crosses hosts. Solve the plan
with a cluster spec whose ``devices_per_node`` is ``--nproc`` so the solver prices that axis with
the inter-node link; `cauto run` prints a note when an axis the plan priced as intra-node crosses
hosts. The job starts when every host has joined; a host that has not joined within
``--rdzv-timeout-s`` ends the job on the others with one line that says how many hosts were expected
and where. Other torchrun flags pass through after ``--``; everything else is what
``python -m cauto.runtime.launch`` takes.

Training progress: rank 0 of the launcher prints ``step k/K loss L time T s`` (only rank 0
prints). On a terminal those lines become one redrawn bar with the loss and seconds per step;
elsewhere the first step, the steps at each 25 % and the last pass through as they are. Every
other line of the job (the --verify report, errors of any rank) passes through unchanged.

One front door: before any rank starts, the plan is validated (schema, sane numbers, mesh),
checked against ``--nproc`` (times ``--nnodes`` after ``--``) and against the model's capture (the
fingerprint, node and parameter names, placements within each tensor's rank); any failure exits 2
with one line.

Checkpoints: ``--save-every N --save-dir DIR`` saves the training state (parameters, optimizer
state, step, RNG) every N steps to ``DIR/step-N`` through torch.distributed.checkpoint, each one
complete or absent (cauto.runtime.training_state); ``--resume DIR`` continues from the latest
complete one, refused before launch when there is none or it is another model's.

Bounded time: every collective gets ``--timeout-s`` (default 120 s), and a watchdog (watchdog.py)
reads the ranks' heartbeats: a rank that stops beating for that long (SIGSTOP, frozen) ends the job
(exit 124) with ``cauto run: rank R stalled in PHASE (step K) for T s; ended the job``, and every
process of the job is killed. A job that fails by itself (a rank killed, a collective timed out)
ends with one line naming the rank and phase, or the collective.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from cauto.cli.hosts import Hosts, HostsError, RendezvousFilter, hosts_note
from cauto.cli.progress import PhaseBars, is_milestone, is_tty
from cauto.cli.watchdog import EXIT_STALLED, STARTUP_S, Watchdog
from cauto.runtime.heartbeat import ENV_DIR, read_heartbeats

DEFAULT_TIMEOUT_S = 120.0

STEP_LINE = re.compile(r"^step (\d+)/(\d+) loss (\S+) time (\S+) s$")
"""The launcher's per-step line (cauto.runtime.launch, rank 0)."""


def torchrun_command(target: str, plan: str, nproc: int, steps: int, verify: bool, extra: list[str],
                     launch_args: list[str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                     compile: bool = False) -> list[str]:
    """The torchrun command line that runs ``target`` with ``plan`` on ``nproc`` local processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *extra,
           "-m", "cauto.runtime.launch", target, "--plan", plan, "--steps", str(steps), "--timeout-s", f"{timeout_s:g}"]
    if verify:
        cmd.append("--verify")
    if compile:
        cmd.append("--compile")
    return cmd + list(launch_args or [])


def run_torchrun(cmd: list[str], env: dict | None = None, stream=None, *, nproc: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, hosts: Hosts | None = None) -> int:
    """Run ``cmd`` (a torchrun command line of ``nproc`` local ranks) under the watchdog, showing its
    step lines as progress; return its exit code (EXIT_STALLED when the watchdog ended it). With
    ``hosts`` (a multi-host job) the watchdog also allows the rendezvous its timeout before the ranks
    start, and a rendezvous that times out ends in one line (hosts.py) instead of torchrun's traceback."""
    stream = stream or sys.stdout
    with tempfile.TemporaryDirectory(prefix="cauto-heartbeats-") as beats:
        if nproc is None:  # the ranks whose first heartbeat the watchdog awaits (none for another command)
            nproc = int(cmd[cmd.index("--nproc-per-node") + 1]) if "--nproc-per-node" in cmd else 0
        watchdog = Watchdog(beats, nproc, timeout_s,
                            startup_s=STARTUP_S + (hosts.rendezvous_timeout_s if hosts is not None else 0.0))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1,
                                stderr=subprocess.PIPE if hosts is not None else None,
                                env={**(os.environ if env is None else env), ENV_DIR: beats})
        errors = RendezvousFilter(proc.stderr, sys.stderr) if hosts is not None else None
        watchdog.watch(proc, sys.stderr)
        rc = _follow(proc, stream)
        watchdog.stop()
        if errors is not None:
            errors.join()
        if watchdog.stall is not None:
            return EXIT_STALLED
        if errors is not None and errors.rendezvous_failed and not read_heartbeats(beats):
            print(hosts.missing_line(errors.rendezvous_failed), file=sys.stderr, flush=True)
        elif rc not in (0, 130):
            print(watchdog.verdict(rc), file=sys.stderr, flush=True)
        return rc


def _follow(proc: subprocess.Popen, stream) -> int:
    """Pass the job's output through (step lines as progress) until it ends; return its exit code."""
    bars = PhaseBars("training", stream) if is_tty(stream) else None
    try:
        for line in proc.stdout:
            step = STEP_LINE.match(line.rstrip("\n"))
            if step is None:
                (bars.print_line if bars else stream.write)(line)
            elif bars is not None:
                k, total, loss, step_s = step.groups()
                bars("steps", int(k), int(total), f"  loss {loss}  {float(step_s):.3f} s/step")
            elif int(step.group(1)) == 1 or is_milestone(int(step.group(1)), int(step.group(2)), int(step.group(1)) - 1):
                stream.write(line)
            stream.flush()
        return proc.wait()
    except KeyboardInterrupt:  # torchrun got the same SIGINT and stops its ranks
        return proc.wait() or 130
    finally:
        if bars is not None:
            bars.close(ok=proc.poll() == 0)


def _world_size(nproc: int, extra: list[str]) -> int | None:
    """``nproc`` times torchrun's ``--nnodes`` among ``extra`` (None for an elastic range like 1:4)."""
    nnodes = "1"
    for i, arg in enumerate(extra):
        if arg.startswith("--nnodes="):
            nnodes = arg.split("=", 1)[1]
        elif arg == "--nnodes" and i + 1 < len(extra):
            nnodes = extra[i + 1]
    return nproc * int(nnodes) if nnodes.isdigit() else None


def check_launch(target: str, plan_path: str, world_size: int | None, sizes: dict,
                 resume: str | None = None, mixed_precision: str | None = None, hosts: int = 1) -> str | None:
    """Everything a rank would check, done once here: the plan's document, its mesh against the world
    size, its mixed precision against ``mixed_precision`` (when given), the plan against the model's
    capture, and the checkpoint to resume from (complete, this model's). Return the error line, or None
    when all is well."""
    from cauto.plan import DocumentError, MismatchError, load
    from cauto.plan.validate import check_plan_against_graph, check_world_size

    try:
        plan = load(plan_path, "plan")
        if mixed_precision is not None:
            problem = check_mixed_precision(plan, mixed_precision, plan_path)
            if problem is not None:
                return problem
        if world_size is not None:
            check_world_size(plan, world_size, hosts)
        from cauto.profiler.capture import CaptureError, capture
        from cauto.profiler.target import UsageError, bind_sizes, load_target

        try:
            from cauto.runtime.apply import compute_dtype

            cap = capture(bind_sizes(load_target(target), sizes), autocast=compute_dtype(plan))
        except (UsageError, CaptureError) as exc:
            return f"cauto run: error: {str(exc).strip().splitlines()[0]}"
        except Exception as exc:  # the user's factory failed: one line, as cauto profile says it
            return f"cauto run: error: the factory {target} raised {type(exc).__name__}: {str(exc).strip()[:300]}"
        check_plan_against_graph(plan, cap.structure(), cap.fingerprint(), source=plan_path)
        if resume is not None:
            from cauto.runtime.training_state import CheckpointError, check_resumable

            try:
                check_resumable(resume, cap.fingerprint())
            except CheckpointError as exc:
                return f"cauto run: error: --resume: {exc}"
    except (DocumentError, MismatchError) as exc:
        return f"cauto run: error: {exc}"
    return None


def check_mixed_precision(plan: dict, mixed_precision: str, plan_path: str) -> str | None:
    """The error line where ``mixed_precision`` ("none", "bf16", "fp16") is refused or is not what the plan
    runs (``execution.mixed_precision``, which the runtime reads); None when they agree."""
    from cauto.plan.execution import DTYPE_NAMES
    from cauto.plan.options import OptionsError, PlanOptions

    try:
        PlanOptions(mixed_precision=mixed_precision)
    except OptionsError as exc:
        return f"cauto run: error: --mixed-precision: {exc}"
    section = (plan.get("execution") or {}).get("mixed_precision")
    planned = "none" if section is None else next(k for k, v in DTYPE_NAMES.items() if v == section["compute_dtype"])
    if planned != mixed_precision:
        return (f"cauto run: error: --mixed-precision {mixed_precision}, but {plan_path} was planned for "
                f"{planned!r}; plan again with `cauto plan --mixed-precision {mixed_precision}` (from a graph "
                f"profiled with{'out --autocast' if mixed_precision == 'none' else ' --autocast ' + mixed_precision})")
    return None


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, check the plan against the model and world size, run torchrun; return its exit
    code (2 on bad input, before any rank starts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    problem = _argument_problem(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        hosts = Hosts.from_args(args, extra)
    except HostsError as exc:
        print(f"cauto run: {exc}", file=sys.stderr)
        return 2
    if hosts is not None:
        extra = hosts.torchrun_flags() + extra
    problem = check_launch(args.target, args.plan, _world_size(args.nproc, extra),
                           {"batch": args.batch, "seq": args.seq}, args.resume, args.mixed_precision,
                           hosts.nnodes if hosts else 1)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    if args.accumulate is not None and args.accumulate < 1:
        print("cauto run: --accumulate must be at least 1", file=sys.stderr)
        return 2
    sizes = [f"--{k}={v}" for k, v in (("batch", args.batch), ("seq", args.seq), ("save-every", args.save_every or None),
                                       ("accumulate", args.accumulate), ("max-norm", args.max_norm),
                                       ("save-dir", args.save_dir), ("resume", args.resume)) if v is not None]
    cmd = torchrun_command(args.target, args.plan, args.nproc, args.steps, args.verify, extra, sizes, args.timeout_s,
                           compile=args.compile)
    if hosts is not None:
        note = hosts_note(args.plan, args.nproc)
        if note:
            print(note, file=sys.stderr, flush=True)
    return run_torchrun(cmd, nproc=args.nproc, timeout_s=args.timeout_s, hosts=hosts)


def _parser() -> argparse.ArgumentParser:
    """`cauto run`'s arguments; what follows `--` goes to torchrun and is cut off before."""
    parser = argparse.ArgumentParser(prog="cauto run", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="model factory: path/file.py:fn or pkg.module:fn")
    parser.add_argument("--plan", required=True, help="plan.json from `cauto plan`")
    parser.add_argument("--nproc", type=int, required=True, help="processes on this host (= mesh size per host)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--verify", action="store_true", help="print predicted vs measured collectives and peak")
    parser.add_argument("--batch", type=int, help="passed to the factory as batch= (as for `cauto profile`)")
    parser.add_argument("--seq", type=int, help="passed to the factory as seq= (as for `cauto profile`)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the local program (forward and backward graphs) with inductor")
    parser.add_argument("--accumulate", type=int, help="micro-batches per optimizer step (gradients synchronized "
                        "once per step; --verify counts collectives per optimizer step)")
    parser.add_argument("--max-norm", type=float, help="clip the global gradient norm to this (model.clip_grad_norm_)")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint the training state every N steps")
    parser.add_argument("--save-dir", help="where checkpoints go: DIR/step-N, each complete or absent")
    parser.add_argument("--resume", help="resume from the latest complete checkpoint in this folder")
    parser.add_argument("--mixed-precision", choices=["none", "bf16", "fp16"],
                        help="check that the plan runs this precision (the runtime reads it from the plan: "
                             "`cauto plan --mixed-precision`); fp16 is refused (no loss scaling)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help="collective timeout, and how long a rank may stall before the job is ended (default 120)")
    parser.add_argument("--nnodes", type=int, default=1, help="hosts in the job; run this command on each (default 1)")
    parser.add_argument("--node-rank", type=int, help="this host's index 0..nnodes-1 (static rendezvous only; "
                        "c10d numbers the hosts as they join)")
    parser.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on every host (the first "
                        "host's address and a free port); needed with --nnodes > 1")
    parser.add_argument("--rdzv-backend", choices=("c10d", "static"), default="c10d",
                        help="torchrun's rendezvous (default c10d)")
    parser.add_argument("--rdzv-timeout-s", type=float, default=300.0,
                        help="how long the hosts wait for each other to join before the job ends (default 300)")
    return parser


def _argument_problem(args: argparse.Namespace) -> str | None:
    """The error line for arguments that are wrong by themselves (before the plan is read); None when
    there is none."""
    if not Path(args.plan).is_file():
        return f"cauto run: plan file {args.plan!r} not found; create one with `cauto plan GRAPH -o plan.json`"
    if args.nproc < 1:
        return "cauto run: --nproc must be at least 1"
    if not 0 < args.timeout_s < float("inf"):
        return f"cauto run: --timeout-s {args.timeout_s:g} is not a positive number of seconds"
    if args.save_every < 0 or bool(args.save_every) != bool(args.save_dir):
        return "cauto run: --save-every N (N >= 1) and --save-dir DIR go together"
    return None
