"""Structure of the ``fastspec`` package: no import cycles, no pytest inside it.

The import graph is read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` statement of a module counts, at module level or inside a function, because
a function-level import that closes a cycle still executes the modules of that cycle in an order
that depends on who called first. Edges:

* ``import fastspec.a.b`` and ``from fastspec.a.b import name``: to ``fastspec.a.b``;
* ``from fastspec.a import b`` where ``b`` is a submodule of ``fastspec.a`` (a ``.py`` file, a
  package, or a compiled extension, built or not): to ``fastspec.a.b``; where ``b`` is a name
  bound in ``fastspec/a/__init__.py``: to ``fastspec.a``;
* relative imports are resolved against the importing module's package.

Not counted: the parent packages that Python runs before a submodule (``import fastspec.a.b``
also runs ``fastspec/__init__.py``), imports under ``if TYPE_CHECKING:`` (never executed), and
``importlib.import_module`` with a computed name.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fastspec"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(root: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node of ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        stack.extend(children)


def _bound_names(tree: ast.Module) -> set[str]:
    """Names an ``__init__.py`` binds at module level (defs, classes, assignments, imports)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def import_graph(sources: dict[str, Path], top: str = "fastspec") -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` (see the module docstring for the rules)."""
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in sources.items()}

    def known(name: str) -> str | None:  # the module itself, else its nearest enclosing package
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    def submodule(package: str, name: str) -> str | None:
        """``package.name`` if ``name`` is a submodule of ``package`` rather than a bound name."""
        full = f"{package}.{name}"
        if full in sources:
            return full
        if package in sources and sources[package].name == "__init__.py":
            folder = sources[package].parent
            if any(folder.glob(f"{name}.*.so")) or any(folder.glob(f"{name}.*.pyd")):
                return full
            if name not in _bound_names(trees[package]):
                return full  # a compiled extension not built here (or a missing module): a leaf
        return None

    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, tree in trees.items():
        package = module if sources[module].name == "__init__.py" else module.rpartition(".")[0]
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names if a.name.split(".")[0] == top]
            else:
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != top:
                    continue
                targets = [submodule(base, a.name) or known(base) for a in node.names]
            graph[module].update(t for t in targets if t and t != module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle ``[a, b, ..., a]`` of ``graph``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


# ----------------------------------------------------------------------------- the checker itself
def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return {("fastspec." + rel[:-3].replace("/", ".")).removesuffix(".__init__"): root / rel
            for rel in files}


def test_the_checker_sees_function_level_relative_and_from_package_imports(tmp_path):
    files = {
        "__init__.py": "from .a import f\nVERSION = 1\n",
        "a.py": "def f():\n    from . import b\n",                # function level, submodule
        "b.py": "from .sub import helper\n",                      # name bound in sub/__init__
        "sub/__init__.py": "from .c import helper\n",
        "sub/c.py": "import fastspec.a\n",                         # absolute: closes a -> b -> sub -> c -> a
        "d.py": "from fastspec import VERSION, _ext\n",           # a bound name; an unbuilt extension
        "e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n",
    }
    sources = {m: p for m, p in _write(tmp_path / "fastspec", files).items()}
    graph = import_graph(sources)
    assert graph["fastspec.a"] == {"fastspec.b"}
    assert graph["fastspec.b"] == {"fastspec.sub"}
    assert graph["fastspec.sub"] == {"fastspec.sub.c"}
    assert graph["fastspec.sub.c"] == {"fastspec.a"}
    assert graph["fastspec.d"] == {"fastspec", "fastspec._ext"}
    assert graph["fastspec.e"] == set()
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"fastspec.a", "fastspec.b", "fastspec.sub", "fastspec.sub.c"}
    del graph["fastspec.sub.c"]
    assert find_cycle(graph) is None


# ------------------------------------------------------------------------------ the real package
@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(_sources())


def test_bench_has_no_import_cycle(graph):
    bench = {m: {t for t in ts if t.startswith("fastspec.bench")}
             for m, ts in graph.items() if m.startswith("fastspec.bench")}
    cycle = find_cycle(bench)
    assert cycle is None, "import cycle in fastspec.bench: " + " -> ".join(cycle)


def test_package_has_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in fastspec: " + " -> ".join(cycle)


def test_bench_suites_do_not_import_the_registry_or_each_other(graph):
    """The registry (``fastspec.bench.suites``) sits above the suite modules; shared code is in
    ``case``/``models``."""
    from fastspec.bench.suites import SUITES

    suites = {m for m in graph if m.startswith("fastspec.bench.suites.")}
    # one module per suite, named after it (train_step_compiled lives with train_step)
    assert suites == {f"fastspec.bench.suites.{s}" for s in SUITES if s != "train_step_compiled"}
    for m in suites:
        assert not graph[m] & (suites | {"fastspec.bench.suites"}), (m, sorted(graph[m]))


def test_commands_are_thin_modules_the_library_does_not_import(graph):
    """Every sub-command of ``fastspec`` has its module in ``fastspec.commands`` and nothing of
    the library imports a command (the dependency runs from the command to the library)."""
    from fastspec.cli import COMMANDS

    assert {m for m, _ in COMMANDS.values()} == {f"fastspec.commands.{name}" for name in COMMANDS}
    assert {m for m in graph if m.startswith("fastspec.commands.") and not m.startswith("fastspec.commands._")} \
        == {m for m, _ in COMMANDS.values()}
    importers = {m: sorted(t for t in ts if t.startswith("fastspec.commands"))
                 for m, ts in graph.items() if not m.startswith(("fastspec.commands", "fastspec.cli"))}
    assert {m: ts for m, ts in importers.items() if ts} == {}


def test_no_module_of_the_package_imports_pytest():
    offenders = []
    for module, path in _sources().items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n.split(".")[0] in ("pytest", "_pytest") for n in names):
                offenders.append(f"{module}:{node.lineno}")
    assert offenders == [], f"pytest imported inside the installed package: {offenders}"
