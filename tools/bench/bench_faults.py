"""Faults and bad input: each fault or input through the `cauto` command, its exit code, the seconds
until exit and the line printed.

    python tools/bench/bench_faults.py [--timeout-s 10] [--no-faults] [--write]

Faults: `cauto run` of a real plan with collectives (zoo MLP, 2 gloo ranks, planned under a tight
budget) where rank 1 stops itself (SIGSTOP), is killed (SIGKILL) or hangs outside a collective, at
setup, in forward or in the optimizer step ($CAUTO_TEST_FAULT). Seconds count from the command's
start (the job's setup included; the bound is timeout + 60 s). Bad input: documents and outputs
the front door must refuse, each with exit 2 and one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = "cauto.profiler.zoo:mlp"
FAULTS = [(a, p) for a in ("SIGSTOP", "SIGKILL") for p in ("setup", "forward", "optimizer")] + [("hang", "forward")]


def cauto(*args: str, env: dict | None = None) -> tuple[int, float, str]:
    """(exit code, seconds, the last `cauto`-labelled line of stderr) of one `cauto` command."""
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "cauto.cli.main", *args], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=600)
    lines = [line for line in res.stderr.splitlines() if line.startswith("cauto")]
    return res.returncode, time.monotonic() - start, (lines[-1] if lines else res.stderr.strip()[-200:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def edited(src: Path, dst: Path, edit) -> str:
    doc = json.loads(src.read_text())
    edit(doc)
    dst.write_text(json.dumps(doc))
    return str(dst)


def bad_inputs(d: Path) -> list[tuple[str, tuple[str, ...]]]:
    graph, plan = d / "graph.json", d / "plan.json"
    shapes = {n["id"]: n["outputs"][0]["shape"] for n in json.loads(graph.read_text())["nodes"] if n["outputs"]}
    first_param = next(p for p in json.loads(plan.read_text())["params"] if len(shapes[p]) == 1)
    os.mkfifo(d / "fifo")
    (d / "link").symlink_to(d / "elsewhere.json")

    def node(key, value):
        def edit(doc):
            doc["nodes"][3][key] = value
        return edit

    def out_bytes(doc):
        doc["nodes"][3]["outputs"][0]["bytes"] = 10**30

    def peak_nan(doc):
        doc["device"]["peak_flops"] = math.nan

    def s9(doc):
        doc["params"][first_param]["placements"] = ["S(9)"]

    def ghost(doc):
        doc["nodes"]["ghost"] = next(iter(doc["nodes"].values()))

    def axes(doc):
        doc["mesh"]["axis_names"] = ["dp", "tp"]

    assert cauto("profile", TARGET, "--batch", "16", "-o", str(d / "other.json"))[0] == 0
    return [
        ("graph: a node's fwd_flops = inf", ("plan", edited(graph, d / "g1.json", node("fwd_flops", math.inf)),
                                            "--mesh", "2", "-o", str(d / "p.json"))),
        ("graph: an output's bytes = 1e30", ("plan", edited(graph, d / "g2.json", out_bytes), "--mesh", "2",
                                             "-o", str(d / "p.json"))),
        ("graph: device peak_flops = NaN", ("plan", edited(graph, d / "g3.json", peak_nan), "--mesh", "2",
                                            "-o", str(d / "p.json"))),
        ("plan: S(9) on a 1-D parameter (run)", ("run", TARGET, "--plan", edited(plan, d / "p1.json", s9),
                                                 "--nproc", "2")),
        ("plan: S(9) on a 1-D parameter (codegen)", ("codegen", str(d / "p1.json"), "--target", TARGET,
                                                     "-o", str(d / "x.py"))),
        ("plan: a node missing from the graph (run)", ("run", TARGET, "--plan", edited(plan, d / "p2.json", ghost),
                                                       "--nproc", "2")),
        ("plan: 2 axis names on a 1-D mesh", ("run", TARGET, "--plan", edited(plan, d / "p3.json", axes),
                                              "--nproc", "2")),
        ("run: --nproc 4 for a mesh of 2", ("run", TARGET, "--plan", str(plan), "--nproc", "4")),
        ("run: --nproc 1 for a mesh of 2", ("run", TARGET, "--plan", str(plan), "--nproc", "1")),
        ("run: --nnodes 2 without --rdzv-endpoint", ("run", TARGET, "--plan", str(plan), "--nproc", "1", "--nnodes", "2")),
        ("run: --nnodes 3 for a mesh of 2", ("run", TARGET, "--plan", str(plan), "--nproc", "1", "--nnodes", "3",
                                             "--rdzv-endpoint", "localhost:29400")),
        ("run: another model (--batch 16)", ("run", TARGET, "--plan", str(plan), "--nproc", "2", "--batch", "16")),
        ("explain --graph of another model", ("explain", str(plan), "--graph", str(d / "other.json"))),
        ("plan -o a FIFO", ("plan", str(graph), "--mesh", "2", "-o", str(d / "fifo"))),
        ("plan -o /dev/full", ("plan", str(graph), "--mesh", "2", "-o", "/dev/full")),
        ("codegen -o a symbolic link", ("codegen", str(plan), "--target", TARGET, "-o", str(d / "link"))),
        ("explain --html a directory", ("explain", str(plan), "--html", str(d))),
        ("plan --memory ''", ("plan", str(graph), "--mesh", "2", "--memory", "", "-o", str(d / "p.json"))),
        ("plan --memory 0", ("plan", str(graph), "--mesh", "2", "--memory", "0", "-o", str(d / "p.json"))),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-s", type=int, default=10)
    ap.add_argument("--no-faults", action="store_true", help="only the bad inputs")
    ap.add_argument("--write", action="store_true", help="update tools/bench/RESULTS.md")
    args = ap.parse_args()
    rows = ["| fault or input | exit | seconds | line printed |", "|---|---:|---:|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        assert cauto("profile", TARGET, "-o", str(d / "graph.json"))[0] == 0
        assert cauto("plan", str(d / "graph.json"), "--mesh", "2", "--memory", "1.1MiB", "-o", str(d / "plan.json"))[0] == 0
        if not args.no_faults:
            for action, phase in FAULTS:
                rc, seconds, line = cauto("run", TARGET, "--plan", str(d / "plan.json"), "--nproc", "2", "--steps", "3",
                                          "--timeout-s", str(args.timeout_s),
                                          env={"CAUTO_TEST_FAULT": f"1:{phase}:{action}"})
                rows.append(f"| rank 1 {action} in {phase} (timeout {args.timeout_s} s) | {rc} | {seconds:.1f} | `{line}` |")
                print(rows[-1], flush=True)
            endpoint = f"localhost:{free_port()}"
            rc, seconds, line = cauto("run", TARGET, "--plan", str(d / "plan.json"), "--nproc", "1", "--nnodes", "2",
                                      "--rdzv-endpoint", endpoint, "--rdzv-timeout-s", str(args.timeout_s))
            rows.append(f"| the second of 2 hosts never joins (rendezvous timeout {args.timeout_s} s) | {rc} | "
                        f"{seconds:.1f} | `{line.replace(endpoint, 'localhost:$PORT')}` |")
            print(rows[-1], flush=True)
        for name, argv in bad_inputs(d):
            rc, seconds, line = cauto(*argv)
            rows.append(f"| {name} | {rc} | {seconds:.1f} | `{line.replace(tmp, '$TMP')}` |")
            print(rows[-1], flush=True)
    body = ("Command: `python tools/bench/bench_faults.py --write`\n\n"
            f"Faults: `cauto run` of zoo MLP on 2 gloo ranks under a plan with collectives, rank 1 faulting through "
            f"the launcher's test hook; `--timeout-s {args.timeout_s}`; seconds from the command's start, setup "
            "included (the bound is timeout + 60 s). Bad input: one line each, exit 2, no file written. "
            "Machine: 2 shared CPU cores.\n\n" + "\n".join(rows))
    print(body)
    if args.write:
        sys.path.insert(0, str(Path(__file__).parent))
        from results_md import replace_section

        replace_section("Faults and bad input", body)


if __name__ == "__main__":
    main()
