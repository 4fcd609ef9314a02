"""Two hosts simulated on this machine: two `cauto run` launchers of 2 ranks each meet at a rendezvous
on localhost and train a 2x2 plan (outer axis across the "hosts") with the losses of one process; a
launcher whose second host never comes ends within the rendezvous timeout, in one line."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from cauto.profiler import zoo

TARGET = "cauto.profiler.zoo:mlp"
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(args: list[str]) -> subprocess.Popen:
    import os

    return subprocess.Popen([sys.executable, "-m", "cauto.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _eager_losses(steps: int) -> list[float]:
    """The launcher's training on one process: seed 0 for the weights, then for the batch; AdamW lr 1e-3."""
    torch.manual_seed(0)
    model, _ = zoo.mlp()
    torch.manual_seed(0)
    _, (x, y) = zoo.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def plan_2x2(tmp_path_factory, run_cauto):
    out = tmp_path_factory.mktemp("hosts")
    assert run_cauto("profile", TARGET, "-o", str(out / "graph.json")).returncode == 0
    res = run_cauto("plan", str(out / "graph.json"), "--mesh", "2x2", "--devices-per-node", "2", "--memory", "0.8MiB",
                    "-o", str(out / "plan.json"))
    assert res.returncode == 0, res.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert {c["op"] for c in plan["predictions"]["collectives"]} & {"all_gather", "reduce_scatter"}, \
        "the plan must shard something, so its steps talk across the hosts"
    return out / "plan.json"


def test_two_launchers_train_a_2x2_plan_with_the_losses_of_one_process(plan_2x2):
    endpoint = f"localhost:{_free_port()}"
    run = ["run", TARGET, "--plan", str(plan_2x2), "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", endpoint,
           "--rdzv-timeout-s", "60", "--steps", str(STEPS), "--timeout-s", "60"]
    hosts = [_launcher(run)]
    time.sleep(1.0)  # the second host comes later, as it would
    hosts.append(_launcher(run))
    outs = [h.communicate(timeout=240) for h in hosts]
    for h, (_out, err) in zip(hosts, outs):
        assert h.returncode == 0, err[-3000:]
        assert "across hosts: mesh axis 'dp'" in err  # the outer axis is the one that crosses hosts
    printed = "".join(out for out, _ in outs)  # rank 0 prints, on whichever host the rendezvous put it
    losses = [float(x) for x in re.findall(r"^step \d+/\d+ loss (\S+)", printed, re.M)]
    assert losses == pytest.approx(_eager_losses(STEPS), rel=1e-5)


def test_a_host_that_never_joins_ends_the_job_within_the_rendezvous_timeout(plan_2x2):
    endpoint = f"localhost:{_free_port()}"
    started = time.monotonic()
    alone = _launcher(["run", TARGET, "--plan", str(plan_2x2), "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint",
                       endpoint, "--rdzv-timeout-s", "5", "--steps", str(STEPS)])
    out, err = alone.communicate(timeout=120)
    elapsed = time.monotonic() - started
    assert alone.returncode != 0
    assert elapsed < 5 + 30, elapsed  # the timeout, plus starting Python, torch and the capture check
    assert "Traceback" not in err, err
    line = [x for x in err.splitlines() if "rendezvous" in x]
    assert len(line) == 1 and f"the rendezvous at {endpoint} failed (RendezvousTimeoutError): not every host " \
        "joined within 5 s; the job needs 2 hosts of 2 ranks each" in line[0], err


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "nohost"], "is not HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "2"], "--node-rank 2 is not in 0..1"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "static"], "static needs --node-rank"),
    (["--nnodes", "3", "--rdzv-endpoint", "h:1"], "do not split evenly over 3 hosts: change --nnodes"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--", "--nnodes", "2"], "--nnodes is given twice"),
])
def test_bad_host_flags_are_refused_before_launch(plan_2x2, run_cauto, flags, message):
    cut = flags.index("--") if "--" in flags else len(flags)
    res = run_cauto("run", TARGET, "--plan", str(plan_2x2), "--nproc", "2", *flags[:cut], *flags[cut:])
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and message in res.stderr, res.stderr


def test_the_axes_that_cross_hosts_are_the_outer_ones_that_span_more_than_a_host():
    from cauto.cli.hosts import crossing_axes

    assert crossing_axes((2, 2), 2) == [0]  # dp across the two hosts, tp inside each
    assert crossing_axes((4,), 2) == [0]
    assert crossing_axes((2, 4), 2) == [0, 1]  # tp spans 4 ranks but a host holds 2: hosts split tp too
    assert crossing_axes((2, 2), 4) == []  # one host
    assert crossing_axes((1, 4), 2) == [1]  # a size-1 axis crosses nothing
