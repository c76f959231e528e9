"""The chaos checker finds each kind of violation in a run directory, and passes a faithful one."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from orchestrator.chaos.invariants import check
from orchestrator.record.events import EventLog
from orchestrator.record.trajlog import TrajectoryLog
from orchestrator.types import Batch, Group, GroupDecision
from policies.board import Board
from policies.wire.lane import VersionBounds
from tests.support.trajectories import make_episode

GROUP = 2


def _board(root: Path, versions: int) -> Board:
    board = Board(str(root / "board"), "run")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 16, generator=g)
    for v in range(versions):
        board.publish(v, {"w": (w + v).to(torch.bfloat16)}, view_name="bfloat16")
    return board


def _engine_logs(run_dir: Path, board: Board, versions: dict[str, list[int]]) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for engine, vs in versions.items():
        lines = ["Traceback (not JSON, skipped)"]
        for v in vs:
            rec = {"event": "version_activated", "version": v, "digest": board.manifest(v).digest}
            lines.append(json.dumps(rec))
        (run_dir / "logs" / f"{engine}.log").write_text("\n".join(lines) + "\n")


def _run(tmp_path: Path, *, lie: bool = False, forget: bool = False) -> tuple[Path, Board]:
    """Two groups trained into versions 1 and 2, served at versions 0–1 on engine-0/1.

    ``lie``: one call served outside its bounds; ``forget``: one group admitted, never recorded.
    """
    run_dir = tmp_path / "run"
    board = _board(tmp_path, 3)
    rng = random.Random(0)
    events = EventLog(run_dir / "events")
    tlog = TrajectoryLog(run_dir / "trajectories")
    for i in range(2 + forget):
        gid = f"g{i:06d}"
        events.emit("admit", index=i, group_id=gid, task_id=f"t{gid}")
        if i == 2:
            continue
        eps = [make_episode(rng, gid, j, 1) for j in range(GROUP)]
        for ep in eps:
            for seg in ep.segments:
                seg.bounds = VersionBounds(min=max(0, seg.policy_version.start - 1))
        if lie and i == 1:
            eps[0].segments[0].bounds = VersionBounds(
                min=eps[0].segments[0].policy_version.start + 1
            )
        group = Group(id=gid, task_id=f"t{gid}", episodes=eps)
        decision = GroupDecision(group_id=gid, decision="kept", reason="", max_lag=1)
        tlog.write_group(group, decision, trainer_version=i)
        tlog.write_batch(
            Batch(trained_at_version=i, groups=[group], decisions=[decision]), i + 1, {}
        )
    tlog.close()
    events.close()
    _engine_logs(run_dir, board, {"engine-0": [0, 1], "engine-1": [0, 1]})
    return run_dir, board


def test_a_faithful_run_holds_every_invariant(tmp_path: Path) -> None:
    run_dir, board = _run(tmp_path)
    v = check(run_dir, board, group_size=GROUP, max_steps=2)
    assert v.ok, v.problems
    assert (v.episodes, v.lost, v.duplicated, v.wrong_version, v.unverified) == (4, 0, 0, 0, 0)
    assert v.final_version == 2


def test_a_call_served_outside_its_bounds_is_counted(tmp_path: Path) -> None:
    run_dir, board = _run(tmp_path, lie=True)
    v = check(run_dir, board, group_size=GROUP, max_steps=2)
    assert v.wrong_version == 1
    assert any("outside" in p for p in v.problems)


def test_a_group_never_recorded_is_lost(tmp_path: Path) -> None:
    run_dir, board = _run(tmp_path, forget=True)
    v = check(run_dir, board, group_size=GROUP, max_steps=2)
    assert (v.episodes, v.lost) == (6, 2)
    assert not v.ok


def test_a_version_served_without_a_verified_activation_is_counted(tmp_path: Path) -> None:
    run_dir, board = _run(tmp_path)
    _engine_logs(run_dir, board, {"engine-0": [0], "engine-1": [0, 1]})  # engine-0 never had v1
    v = check(run_dir, board, group_size=GROUP, max_steps=2)
    assert v.unverified > 0
    assert any("engine-0 served v1" in p for p in v.problems)


@pytest.mark.parametrize("max_steps", [3])
def test_no_progress_and_leftover_processes_are_violations(tmp_path: Path, max_steps: int) -> None:
    run_dir, board = _run(tmp_path)
    v = check(run_dir, board, group_size=GROUP, max_steps=max_steps, leftover=["pid 7: serve"])
    assert "the trainer reached v2, not v3" in v.problems
    assert "left running: pid 7: serve" in v.problems
