"""Failpoints: inert by default; each action damages exactly the matching writes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from policies.board import Board, failpoints, stream_publish
from policies.errors import BoardError, VersionCorrupt
from tests.support.waiting import until_sync


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


@pytest.mark.parametrize("action", ["corrupt", "truncate", "reorder"])
def test_a_damaged_chunk_of_a_streamed_patch_is_never_served(
    faults: pytest.MonkeyPatch, tmp_path: Path, action: str
) -> None:
    faults.setattr(stream_publish, "CHUNK_VIEW_BYTES", 1)  # one tensor per chunk
    gen = torch.Generator().manual_seed(0)
    v0 = {f"t{i}": torch.randn(64, 64, generator=gen) for i in range(3)}
    v1 = {k: t.clone() for k, t in v0.items()}
    for tensor in v1.values():
        tensor[0, :8] += 1  # a sparse step: version 1 is a delta
    pub, reader = Board(str(tmp_path), "run"), Board(str(tmp_path), "run")
    pub.publish(0, v0, view_name="fp32")
    held = reader.load(0)[1]
    # "reorder" puts chunk 0's bytes in place of chunk 1: a well-formed chunk in the wrong place
    rule = {"site": "board.write", "match": "*/from-00000000/0000[01].patch", "action": action}
    _set(faults, {**rule, "times": 2 if action == "reorder" else 1})
    errors: list[BaseException] = []

    def follow() -> None:
        until_sync(lambda: (s := reader.stream()) is not None and s.version == 1, "v1's stream")
        try:
            reader.advance(held, 0, 1)
        except BoardError as exc:
            errors.append(exc)

    t = threading.Thread(target=follow)
    t.start()
    pub.publish(1, v1, view_name="fp32")
    t.join(30)
    assert pub.manifest(1).kind == "delta"
    assert errors
    assert "version 1" in str(errors[0])
    with pytest.raises(VersionCorrupt, match=r"version 1: from-00000000/0000[01]\.patch"):
        Board(str(tmp_path), "run").load(1)  # and so does any reader of the published version
