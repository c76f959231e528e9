"""The import graph runs one way: down the layers of the data flow, with no cycles.

Every import in every module of the five packages is read from its syntax tree (imports inside
functions and under ``TYPE_CHECKING`` included, since they are dependencies all the same). Two
rules, with no exceptions list:

- an import never reaches a module of a *higher* layer than its own (``LAYERS``: the wire
  contract at the bottom, the command line at the top);
- no two modules import each other, directly or through others (a package's ``__init__``
  counts as a module that imports what it re-exports, so code inside a package imports its
  siblings directly, never through the package).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "policies", "environments", "sandbox", "staleness")

# Bottom (0) to top. A module's layer is that of the longest prefix naming it.
LAYERS: dict[str, int] = {
    "policies.wire": 0,  # the contracts both sides of a boundary speak; torch-free
    "policies": 0,  # the package file and the policies error tree
    "sandbox": 1,
    "staleness": 1,
    "environments": 2,
    "policies.codec": 3,
    "policies.model": 3,
    "policies.board": 4,
    "policies.serve": 5,
    "policies.train": 6,
    "orchestrator": 7,  # package file, errors, types, config
    "orchestrator.record": 8,
    "orchestrator.loop": 9,
    "orchestrator.observe": 10,
    "orchestrator.fleet": 10,  # islands: started, supervised, on Ray; the fleet CLI
    "orchestrator.run": 11,
    "orchestrator.offline": 12,
    "orchestrator.train_worker": 13,
    "orchestrator.bench": 13,
    "orchestrator.chaos": 13,
    "orchestrator.cli": 14,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def layer(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def imported(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The project modules ``module`` imports (``from a import b`` → ``a.b`` when that is one)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                yield target


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: set(imported(m, p, known)) for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_import_runs_down_the_layers() -> None:
    upward = [
        f"{src} (layer {layer(src)}) imports {dst} (layer {layer(dst)})"
        for src, targets in sorted(graph().items())
        for dst in sorted(targets)
        if layer(dst) > layer(src)
    ]
    assert upward == []


def test_no_import_cycles_between_modules() -> None:
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_test_file_imports_another_test_file() -> None:
    """Shared helpers live in ``tests/support``; a test module is never imported by another."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                if name.rpartition(".")[2].startswith("test_"):
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []
