"""One word per thing: a retired word never comes back in a code identifier of the five packages.

Identifiers are read from the syntax tree (names, attributes, definitions, arguments, keywords,
imports, and string constants that look like identifiers: event and metric names, fault names)
and split into words at ``_``, ``-`` and camel case, so ``LocalReplica``, ``replica_load_s`` and
``"replica-kill"`` are all caught while ``Replicate`` (torch's placement) is another word.
``docs/glossary.md`` says what each retired word became.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "policies", "environments", "sandbox", "staleness")
RETIRED = {"replica": "island (on the board's side: reader)"}
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


def words(name: str) -> set[str]:
    """The words of an identifier: split at ``_``/``-`` and camel case, lower-cased, plurals
    folded (``replicas`` is ``replica``)."""
    found: set[str] = set()
    for part in re.split(r"[_\-]+", name):
        for word in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", part):
            found.add(word.lower().removesuffix("s"))
    return found


def identifiers(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        match node:
            case ast.Name(id=name) | ast.Attribute(attr=name) | ast.arg(arg=name):
                yield name
            case ast.FunctionDef(name=name) | ast.AsyncFunctionDef(name=name):
                yield name
            case ast.ClassDef(name=name) | ast.keyword(arg=str(name)):
                yield name
            case ast.alias(name=name, asname=asname):
                yield asname or name.rsplit(".", 1)[-1]
            case ast.Constant(value=str(text)) if IDENTIFIER.fullmatch(text):
                yield text


def test_no_retired_word_is_an_identifier() -> None:
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in identifiers(ast.parse(path.read_text(), str(path))):
                if words(name) & RETIRED.keys():
                    found.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    assert found == {}, f"retired words ({RETIRED}) in identifiers: {found}"


def test_the_word_split_catches_every_spelling() -> None:
    for name in ("LocalReplica", "replica_load_s", "replica-kill", "REPLICAS", "_kill_replica"):
        assert "replica" in words(name), name
    for name in ("Replicate", "replicated", "ReplicatedLinear"):
        assert "replica" not in words(name), name
