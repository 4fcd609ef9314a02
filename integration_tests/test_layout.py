"""The layout rules of STYLE.md, checked over every package's sources with ``ast`` (nothing is imported).

* No import cycle between the modules of one package. Every ``import`` counts, at module level or
  inside a function, and under ``if TYPE_CHECKING:`` too: a function-level import only defers a cycle,
  it does not remove it. ``from pkg import name`` counts as an import of ``pkg.name`` when that is a
  module of the package, else of ``pkg`` (its ``__init__``). A package's ``__init__`` re-exporting
  its own submodules is an edge like any other.
* No private name (``_x``) imported from another module: what two modules share is public.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "src").is_dir())

#: Cycles allowed for now, each as the sorted tuple of its modules. Delete an entry once the cycle is
#: broken (the test then fails if it comes back).
ALLOWED_CYCLES: set[tuple[str, ...]] = set()


def _modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, path: Path, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: Path, known: dict[str, Path]):
    """Yield (imported module, names imported from it, line) for every import statement of ``module``."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node.level, node.module)
            plain = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield sub, (), node.lineno
                else:
                    plain.append(alias.name)
            if plain:
                yield target, tuple(plain), node.lineno


def _graph(pkg: Path) -> tuple[dict[str, set[str]], list[str]]:
    known = _modules(pkg / "src")
    edges: dict[str, set[str]] = {m: set() for m in known}
    private = []
    for module, path in sorted(known.items()):
        for target, names, line in _imports(module, path, known):
            if target in known and target != module:
                edges[module].add(target)
            if target.startswith("cauto") and target != module:
                for name in names:
                    if name.startswith("_") and not name.startswith("__"):
                        private.append(f"{path.relative_to(pkg)}:{line}: {name} from {target}")
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _without_inits(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph with the edges a package's ``__init__`` has to its own submodules dropped: the
    submodule that imports a sibling through the package (``from cauto.solver import plan``) still
    counts, the ``__init__`` re-exporting it does not (that is what an ``__init__`` is for)."""
    return {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in edges.items()}


@pytest.mark.parametrize("pkg", PACKAGES, ids=[p.name for p in PACKAGES])
def test_no_import_cycle(pkg):
    edges, _ = _graph(pkg)
    cycles = [c for c in _cycles(_without_inits(edges)) if c not in ALLOWED_CYCLES]
    assert not cycles, "import cycles between modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("pkg", PACKAGES, ids=[p.name for p in PACKAGES])
def test_no_private_name_imported_across_modules(pkg):
    _, private = _graph(pkg)
    assert not private, "private names imported from another module:\n" + "\n".join(private)


@pytest.mark.parametrize("pkg", PACKAGES, ids=[p.name for p in PACKAGES])
def test_readme_layout_matches_the_tree(pkg):
    """The README's "## Layout" section lists every module of the package, and nothing else."""
    text = (pkg / "README.md").read_text()
    assert "\n## Layout\n" in text, f"{pkg.name}/README.md has no '## Layout' section"
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    listed, block = set(), None
    for line in section.splitlines():  # blocks headed "src/cauto/<dir>/", then "  module.py  what it is"
        head = re.match(r"^src/cauto/(\S+)/$", line)
        if head:
            block = head.group(1)
        module = re.match(r"^  (\S+\.py)\b", line)
        if module and block is not None:
            listed.add(f"{block}/{module.group(1)}")
    roots = [p for p in (pkg / "src" / "cauto").iterdir() if p.is_dir() and p.name != "__pycache__"]
    actual = {f"{root.name}/{f.relative_to(root)}" for root in roots for f in root.rglob("*.py")}
    assert listed == actual, f"missing from the README: {sorted(actual - listed)}; gone from the tree: " \
                             f"{sorted(listed - actual)}"


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path):
    src = tmp_path / "pkg" / "src" / "cauto" / "demo"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "a.py").write_text("def f():\n    from cauto.demo.b import _g\n")
    (src / "b.py").write_text("from cauto.demo import a\n_g = 1\n")
    edges, private = _graph(tmp_path / "pkg")
    assert _cycles(_without_inits(edges)) == [("cauto.demo.a", "cauto.demo.b")]
    assert private and "_g from cauto.demo.b" in private[0]


def test_allowed_cycles_still_exist():
    """An allow-list entry whose cycle is gone must be deleted, so that it cannot come back unseen."""
    found = set()
    for pkg in PACKAGES:
        found.update(_cycles(_without_inits(_graph(pkg)[0])))
    stale = ALLOWED_CYCLES - found
    assert not stale, f"delete these entries of ALLOWED_CYCLES, their cycle is gone: {sorted(stale)}"


if __name__ == "__main__":  # print the current cycles and private imports of every package
    for p in PACKAGES:
        e, priv = _graph(p)
        print(p.name, _cycles(_without_inits(e)), *priv, sep=os.linesep)
