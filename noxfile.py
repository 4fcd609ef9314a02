"""Test, lint and demo sessions for the cauto monorepo.

`nox` runs every test session (one per package, each in a venv holding only that package and its
in-repo dependencies), the integration tests, the version-drift check and ruff: CI's run, which
leaves out the tests marked ``slow``. `nox -s slow` runs those (long multi-process parity runs and
budget sweeps). `nox -s demo` runs the main job. Every install goes through tools/constraints.txt,
the one pin file (torch==2.13.0, the CPU build on local disk).
"""

from __future__ import annotations

import os
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "tools" / "constraints.txt")

#: package -> in-repo packages it needs (itself last), and extra test-only requirements
PACKAGES = {
    "cauto-plan": (["cauto-plan"], []),
    "cauto-profiler": (["cauto-plan", "cauto-profiler"], ["transformers"]),
    "cauto-solver": (["cauto-plan", "cauto-solver"], ["highspy"]),
    "cauto-runtime": (["cauto-plan", "cauto-profiler", "cauto-runtime"], ["transformers"]),
    "cauto": (["cauto-plan", "cauto-profiler", "cauto-solver", "cauto-runtime", "cauto"], ["transformers"]),
}
TEST_TOOLS = ["pytest", "pytest-xdist", "hypothesis"]

#: pytest-xdist workers per test session (``CAUTO_TEST_WORKERS``; 0 runs the tests in the session's own
#: process). Two by default: CI's machine has two cores, and most of a session's wall time is one
#: thread (an ILP solve, a spawn, a rank waiting on its peers) beside an idle core. The integration
#: suite measured 31 min in one process, 19 min with two workers; every multi-process test allocates
#: its own free port and has its own timeout, so two at once do not collide.
TEST_WORKERS = os.environ.get("CAUTO_TEST_WORKERS", "2")

#: CI's selection. The tests marked slow each take minutes here (a 4-rank parity run on a second mesh, a
#: budget sweep on a third model, the largest stock model's plans); each has a faster sibling that CI
#: keeps, and `nox -s slow` runs them. CI took 56 min on its machine with them (40 min here); the target is 45.
FAST = ["-m", "not slow"]

nox.options.sessions = ["versions", "lint", "tests", "integration"]
nox.options.reuse_existing_virtualenvs = True


def _install(session: nox.Session, packages: list[str], extra: list[str]) -> None:
    paths = [str(ROOT / "packages" / p) for p in packages]
    session.install("-c", CONSTRAINTS, *paths, *extra, *TEST_TOOLS)


@nox.session
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """Run one package's tests in a venv holding only that package and its in-repo dependencies."""
    deps, extra = PACKAGES[package]
    _install(session, deps, extra)
    if package in ("cauto-plan", "cauto-solver"):
        # The solver must run where torch cannot be imported: prove it before its tests run.
        session.run("python", "-c", "import importlib.util, sys; "
                    "sys.exit('torch is importable in the ' + sys.argv[1] + ' session') "
                    "if importlib.util.find_spec('torch') else None", package)
    workers = [] if package == "cauto-plan" else ["-n", TEST_WORKERS]  # cauto-plan's tests take 3 s
    session.run("pytest", str(ROOT / "packages" / package / "tests"), *workers, *FAST, *session.posargs,
                env={"OMP_NUM_THREADS": "1"})


@nox.session
def integration(session: nox.Session) -> None:
    """Everything installed together: cross-package tests and the released-schema fixtures."""
    _install(session, list(PACKAGES["cauto"][0]), ["transformers", "highspy", "matplotlib"])
    session.run("pytest", str(ROOT / "integration_tests"), "-n", TEST_WORKERS, *FAST, *session.posargs,
                env={"OMP_NUM_THREADS": "1"})


@nox.session
def slow(session: nox.Session) -> None:
    """The tests CI leaves out (marked ``slow``), every package's and the integration tests, in one venv
    holding everything."""
    _install(session, list(PACKAGES["cauto"][0]), ["transformers", "highspy", "matplotlib"])
    for tests in [*(ROOT / "packages" / p / "tests" for p in PACKAGES), ROOT / "integration_tests"]:
        session.run("pytest", str(tests), "-n", TEST_WORKERS, "-m", "slow", *session.posargs,
                    env={"OMP_NUM_THREADS": "1"}, success_codes=[0, 5])  # 5: none marked there


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("-c", CONSTRAINTS, "ruff")
    session.run("ruff", "check", str(ROOT))


@nox.session(python=False)
def versions(session: nox.Session) -> None:
    """Fail when sibling packages' versions drift or their exact pins on each other disagree."""
    found = {}
    for name in PACKAGES:
        project = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]
        found[name] = (project["version"], project.get("dependencies", []))
    versions_seen = {v for v, _ in found.values()}
    if len(versions_seen) != 1:
        session.error(f"package versions drifted: { {k: v for k, (v, _) in found.items()} }")
    (version,) = versions_seen
    for name, (_, deps) in found.items():
        for dep in deps:
            dep_name = dep.split("=")[0].split(">")[0].split("<")[0].strip()
            if dep_name in PACKAGES and dep != f"{dep_name}=={version}":
                session.error(f"{name} depends on {dep!r}; siblings must pin each other exactly: {dep_name}=={version}")
    session.log(f"all {len(found)} packages at {version}, sibling pins exact")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on its built-in default (see README)."""
    _install(session, list(PACKAGES["cauto"][0]), ["transformers", "matplotlib"])
    session.run("cauto", "demo", *session.posargs, env={"OMP_NUM_THREADS": "1"})
