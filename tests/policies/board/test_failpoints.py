"""Failpoints: inert by default; each action damages exactly the matching writes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from policies.board import failpoints


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    failpoints.reset()
    yield monkeypatch
    failpoints.reset()


def _set(mp: pytest.MonkeyPatch, *rules: dict[str, object]) -> None:
    mp.setenv(failpoints.ENV, json.dumps(list(rules)))
    failpoints.reset()


def test_no_rules_leave_data_unchanged(faults: pytest.MonkeyPatch) -> None:
    faults.delenv(failpoints.ENV, raising=False)
    assert failpoints.mutate("board.write", "a/b.patch", b"abcdef") == b"abcdef"


def test_corrupt_and_truncate_hit_only_matching_keys_and_only_times_often(
    faults: pytest.MonkeyPatch,
) -> None:
    _set(
        faults,
        {"site": "board.write", "match": "*/00000002/*.patch", "action": "corrupt"},
        {"site": "board.write", "match": "*/00000003/*.patch", "action": "truncate", "times": 2},
    )
    data = bytes(range(10))
    assert failpoints.mutate("board.write", "r/00000001/from.patch", data) == data
    damaged = failpoints.mutate("board.write", "r/00000002/from.patch", data)
    assert len(damaged) == len(data)
    assert sum(a != b for a, b in zip(damaged, data, strict=True)) == 1
    assert failpoints.mutate("board.write", "r/00000002/from.patch", data) == data  # times = 1
    assert failpoints.mutate("board.write", "r/00000003/a.patch", data) == data[:5]
    assert failpoints.mutate("board.write", "r/00000003/b.patch", data) == data[:5]
    assert failpoints.mutate("board.write", "r/00000003/c.patch", data) == data
    assert failpoints.mutate("other.site", "r/00000002/from.patch", data) == data


def test_reorder_substitutes_the_previous_write_with_the_same_suffix(
    faults: pytest.MonkeyPatch,
) -> None:
    _set(faults, {"site": "board.write", "match": "*/00000002/*", "action": "reorder"})
    failpoints.mutate("board.write", "r/00000001/from.patch", b"patch one")
    failpoints.mutate("board.write", "r/00000001/manifest.json", b"{}")
    assert failpoints.mutate("board.write", "r/00000002/from.patch", b"patch two") == b"patch one"


def test_a_bad_rule_names_the_variable(faults: pytest.MonkeyPatch) -> None:
    _set(faults, {"site": "board.write", "match": "*", "action": "explode"})
    with pytest.raises(ValueError, match="SPRAWL_FAULTS: unknown action 'explode'"):
        failpoints.mutate("board.write", "x", b"1")
    faults.setenv(failpoints.ENV, "{not json")
    failpoints.reset()
    with pytest.raises(ValueError, match="SPRAWL_FAULTS: expected a JSON list"):
        failpoints.mutate("board.write", "x", b"1")
