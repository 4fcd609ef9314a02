"""The `cauto` command: one entry point over the packages' own commands.

    cauto profile TARGET [...]         symbolic profile (cauto-profile)
    cauto plan GRAPH --mesh 2x2 [...]  solve a plan (cauto-solve)
    cauto run TARGET --plan P --nproc N [--steps K] [--verify]   torchrun wrapper
    cauto explain PLAN [--html report.html]
    cauto codegen PLAN --target T -o parallel_model.py
    cauto demo                          profile -> plan -> train a small GPT on 4 CPU ranks
"""

from __future__ import annotations

import sys

USAGE = __doc__


def _with_bars(bars, run) -> int:
    """``run(bars)``'s exit code; the bars end with "done: ..." only when it succeeded. A command that
    failed has said why in one line, and --help is no planning or profiling: nothing more is printed."""
    try:
        rc = run(bars)
    except BaseException as exc:
        bars.close(ok=False, summary=not isinstance(exc, SystemExit))
        raise
    bars.close(ok=rc == 0, summary=rc == 0)
    return rc


def _profile(argv: list[str]) -> int:
    from cauto.cli.progress import profile_bars
    from cauto.profiler.cli import main

    return _with_bars(profile_bars(), lambda bars: main(argv, progress=bars))


def _plan(argv: list[str]) -> int:
    from cauto.cli.progress import plan_bars
    from cauto.solver.cli import main

    if argv and argv[0] == "explain":
        return main(argv)
    return _with_bars(plan_bars(_time_limit_s(argv)), lambda bars: main(argv, progress=bars))


def _time_limit_s(argv: list[str], default: float = 60.0) -> float:
    """The ``--time-limit`` of a `cauto plan` command line (what the ILP bar counts against)."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--time-limit=") else \
            argv[i + 1] if arg == "--time-limit" and i + 1 < len(argv) else None
        if value is not None:
            try:
                return float(value)
            except ValueError:
                return default  # cauto-solve reports the bad value itself
    return default


def _codegen(argv: list[str]) -> int:
    from cauto.cli.progress import progress
    from cauto.runtime.codegen_cli import main

    with progress("generating the parallel code") as outcome:
        rc = main(argv)
        outcome.ok = rc == 0
        return rc


def _run(argv: list[str]) -> int:
    from cauto.cli.run import main

    return main(argv)


def _explain(argv: list[str]) -> int:
    from cauto.cli.explain import main

    return main(argv)


def _demo(argv: list[str]) -> int:
    from cauto.cli.demo import main

    return main(argv)


COMMANDS = {"profile": _profile, "plan": _plan, "run": _run, "explain": _explain, "codegen": _codegen, "demo": _demo}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a subcommand; return its exit code (2 for usage errors)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"cauto: unknown command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return COMMANDS[command](rest)


if __name__ == "__main__":
    sys.exit(main())
