"""No sleep as synchronisation: a test waits on the event or the state it means (issue #43).

A sleep under ``tests/`` is a ``time``/``asyncio``/``anyio``/``trio`` ``sleep`` (or
``sleep_until``), called or passed on, however it was imported. Each one is in
``tests/support/waiting.py`` (the one poll loop, and virtual time on trio's mock clock) or named
in :data:`BEHAVIOUR` with why it is behaviour rather than a wait: a fake's latency or a process
that must run long, whose length decides no outcome. ``sleep_forever`` is a hang, not a guess
at a duration, and is left alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import anyio
import pytest
from trio.testing import MockClock

from tests.support.waiting import elapse, until, until_sync

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
HELPER = "tests/support/waiting.py"
MODULES = {"time", "asyncio", "anyio", "trio"}
SLEEPS = {"sleep", "sleep_until"}
BEHAVIOUR: dict[str, tuple[int, str]] = {
    "tests/support/fakes.py:ScriptedTransport.generate": (
        1,
        "a scripted endpoint's latency (virtual time, but for the admin API's calls)",
    ),
    "tests/policies/board/test_board_stream.py:_ReaderClock.sleep": (
        1,
        "the stream reader's own poll (POLL_S), passed through the clock the test moves",
    ),
    "tests/orchestrator/loop/test_episode_parse.py:"
    "test_a_long_turn_is_parsed_while_the_loop_goes_on.tick": (
        1,
        "a heartbeat: its ticks sample whether the event loop runs while a turn is parsed",
    ),
    "tests/orchestrator/loop/test_episode_parse.py:test_a_short_turn_is_parsed_inline.tick": (
        1,
        "a heartbeat: no tick inside the parse shows it ran inline, on the loop",
    ),
}
"""``module:qualified.function`` → (how many sleeps, why each is behaviour)."""


class _Sleeps(ast.NodeVisitor):
    """Every reference to a sleep in one module, by the function (qualified) it is in."""

    def __init__(self) -> None:
        self.modules: set[str] = set()  # names bound to time/asyncio/anyio/trio
        self.names: set[str] = set()  # names bound to a sleep itself
        self.scope: list[str] = []
        self.found: list[tuple[str, int]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in MODULES:
                self.modules.add(alias.asname or alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in MODULES:
            self.names |= {a.asname or a.name for a in node.names if a.name in SLEEPS}

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if (
            node.attr in SLEEPS
            and isinstance(node.value, ast.Name)
            and node.value.id in self.modules
        ):
            self.found.append((".".join(self.scope) or "<module>", node.lineno))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.names:
            self.found.append((".".join(self.scope) or "<module>", node.lineno))


def sleeps_in(source: str, module: str) -> list[tuple[str, int]]:
    """``(module:function, line)`` of every sleep in ``source``. Imports are read before the
    code that uses them, as at run time for the top of a module."""
    tree = ast.parse(source, module)
    finder = _Sleeps()
    for node in ast.walk(tree):  # imports anywhere (a function may import time for itself)
        if isinstance(node, ast.Import | ast.ImportFrom):
            finder.visit(node)
    finder.visit(tree)
    return [(f"{module}:{where}", line) for where, line in finder.found]


def _all_sleeps() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        module = str(path.relative_to(ROOT))
        if module == HELPER:
            continue
        for where, line in sleeps_in(path.read_text(), module):
            found.setdefault(where, []).append(line)
    return found


def test_no_test_sleeps_to_wait() -> None:
    unexplained = {
        f"{where}:{line}"
        for where, lines in _all_sleeps().items()
        if len(lines) != BEHAVIOUR.get(where, (0, ""))[0]
        for line in lines
    }
    assert unexplained == set(), (
        "wait for the event or state the test means (tests/support/waiting.py: until, "
        "until_sync; elapse on trio's mock clock), or, for a sleep that is behaviour, name it "
        f"in BEHAVIOUR with why: {sorted(unexplained)}"
    )


def test_every_behaviour_sleep_named_is_still_there() -> None:
    found = _all_sleeps()
    stale = {w: n for w, (n, _) in BEHAVIOUR.items() if len(found.get(w, [])) != n}
    assert stale == {}, f"BEHAVIOUR names sleeps that are gone (or more of them): {stale}"


def test_every_spelling_of_a_sleep_is_seen() -> None:
    source = """
import asyncio, time as clock
import anyio
from trio import sleep as nap
from anyio import sleep_forever

async def wait() -> None:
    await anyio.sleep(0.2)
    await asyncio.sleep(0)
    await nap(1)
    await sleep_forever()  # a hang: not a guess at a duration

class Poller:
    def poll(self) -> None:
        clock.sleep(0.05)
        run(clock.sleep, 1)
        import trio
        trio.sleep_until(5)
"""
    assert sleeps_in(source, "m.py") == [
        ("m.py:wait", 8),
        ("m.py:wait", 9),
        ("m.py:wait", 10),
        ("m.py:Poller.poll", 15),
        ("m.py:Poller.poll", 16),
        ("m.py:Poller.poll", 18),
    ]


def test_virtual_time_passes_only_on_trio_s_mock_clock() -> None:
    async def main() -> float:
        await elapse(3600)
        return anyio.current_time()

    clock = MockClock(autojump_threshold=0)
    assert anyio.run(main, backend="trio", backend_options={"clock": clock}) >= 3600
    for backend in ("asyncio", "trio"):  # a real clock: elapse() would be a guess
        with pytest.raises(AssertionError, match="elapse\\(\\) is for virtual time"):
            anyio.run(main, backend=backend)


def test_a_wait_that_does_not_come_names_what_it_waited_for() -> None:
    async def main() -> None:
        await until(lambda: 0, "the answer", timeout_s=0.05)

    with pytest.raises(AssertionError, match=r"the answer: not within 0.05 s \(last seen: 0\)"):
        anyio.run(main)
    with pytest.raises(AssertionError, match=r"the state: not within 0.05 s"):
        until_sync(lambda: None, "the state", timeout_s=0.05)
    calls = iter(range(5))
    assert until_sync(lambda: next(calls) == 3, "the third call") is True
