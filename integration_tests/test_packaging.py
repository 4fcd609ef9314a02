"""The five distributions build as wheels that share the `cauto` namespace without owning it."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["cauto-plan", "cauto-profiler", "cauto-solver", "cauto-runtime", "cauto"]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    *[str(ROOT / "packages" / p) for p in PACKAGES]], check=True, timeout=600)
    return sorted(out.glob("*.whl"))


def test_every_package_builds_a_wheel(wheels):
    names = {w.name.split("-")[0].replace("_", "-") for w in wheels}
    assert names == set(PACKAGES)


def test_no_wheel_contains_a_namespace_init(wheels):
    for wheel in wheels:
        files = zipfile.ZipFile(wheel).namelist()
        assert "cauto/__init__.py" not in files, wheel.name
        assert any(f.startswith("cauto/") for f in files), wheel.name


def test_all_packages_import_together():
    code = ("import cauto.plan, cauto.profiler, cauto.solver, cauto.runtime, cauto.api, cauto.cli; "
            "import cauto; assert not hasattr(cauto, '__file__') or cauto.__file__ is None")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_solver_and_plan_declare_no_torch_dependency(wheels):
    for wheel in wheels:
        if wheel.name.startswith(("cauto_plan", "cauto_solver")):
            zf = zipfile.ZipFile(wheel)
            meta = next(n for n in zf.namelist() if n.endswith("METADATA"))
            requires = [line for line in zf.read(meta).decode().splitlines() if line.startswith("Requires-Dist")]
            assert not any("torch" in r for r in requires), requires
