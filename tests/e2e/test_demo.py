"""The walking skeleton end to end: real engine subprocesses, real trainer, real board."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from orchestrator.record.frames import read_log
from policies.board import Board
from tests.support.processes import alive, engine_pids, external_trainer_args, orchestrate_cmd

pytestmark = pytest.mark.slow


def test_demo_loop_two_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        orchestrate_cmd(tmp_path, tiny_model_dir, "--trainer.max_steps", "2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps:     2" in proc.stdout

    board = Board(str(tmp_path / "demo" / "board"), "demo")
    assert board.versions() == [0, 1, 2]
    assert board.latest() == 2

    records = read_log(tmp_path / "demo" / "trajectories")
    episodes = [r["episode"] for r in records if r["type"] == "episode"]
    batches = [r for r in records if r["type"] == "batch"]
    assert [b["produced_version"] for b in batches] == [1, 2]
    _assert_exactly_once(records)

    scalars = EventAccumulator(str(tmp_path / "demo" / "tensorboard"))
    scalars.Reload()
    rewards = scalars.Scalars("trainer/reward_mean")
    assert [p.step for p in rewards] == [1, 2]
    assert [p.value for p in rewards] == pytest.approx(
        [b["metrics"]["reward_mean"] for b in batches]
    )
    assert "rollout/drop_rate" in scalars.Tags()["scalars"]
    segments = [s for e in episodes for s in e["segments"]]
    assert segments, "no model call reached the log"
    for seg in segments:
        assert len(seg["token_ids"]) == len(seg["logprobs"]) > 0
        assert seg["policy_version"]["start"] <= seg["policy_version"]["end"]
    assert {s["endpoint"] for s in segments} == {"engine-0", "engine-1"}
    for e in episodes:  # every segment's tokens sit in the episode's sequence where it says
        for seg in e["segments"]:
            start = seg["prompt_len"]
            assert e["token_ids"][start : start + len(seg["token_ids"])] == seg["token_ids"]

    pids = engine_pids(proc.stderr)
    assert len(pids) == 2
    assert not any(alive(p) for p in pids)


def test_demo_loop_with_minibatches(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two optimizer steps per batch against π_prox, M2PO's mask over the batch, clip-higher and
    dual clip: one version per batch, each step's metrics with the lag in optimizer steps."""
    flags = [
        *("--trainer.max_steps", "2", "--trainer.minibatches", "2"),
        *("--trainer.clip_eps_high", "0.28", "--trainer.dual_clip_c", "3"),
        *("--staleness.correction", '{ type = "m2po", threshold = 0.04 }'),
    ]
    proc = subprocess.run(
        orchestrate_cmd(tmp_path, tiny_model_dir, *flags),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps:     2" in proc.stdout
    assert Board(str(tmp_path / "demo" / "board"), "demo").versions() == [0, 1, 2]
    records = read_log(tmp_path / "demo" / "trajectories")
    batches = [r for r in records if r["type"] == "batch"]
    assert [b["produced_version"] for b in batches] == [1, 2]
    for b in batches:
        metrics = b["metrics"]
        assert metrics["minibatches"] == 2.0
        assert metrics["lag_steps/max"] >= metrics["lag_steps/minibatch_1"] >= 1.0
    _assert_exactly_once(records)


def test_sigint_shuts_everything_down(tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = subprocess.Popen(
        orchestrate_cmd(tmp_path, tiny_model_dir, "--trainer.max_steps", "1000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if '"trainer_step"' in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "status:    interrupted" in out
    pids = engine_pids("".join(lines))
    assert len(pids) == 2
    assert not any(alive(p) for p in pids)
    records = read_log(tmp_path / "demo" / "trajectories")  # complete records only
    assert any(r["type"] == "batch" for r in records)
    _assert_exactly_once(records)
    # groups admitted but not trained when the signal came are recorded, not lost
    reasons = {r["decision"]["reason"] for r in records if r["type"] == "episode"}
    assert reasons & {
        "run stopped before the group finished",
        "run stopped before the group was trained",
    }


def _assert_exactly_once(records: list[dict[str, object]]) -> None:
    """Every admitted episode is in the log once; every group is whole; trained groups are kept."""
    episodes = [r["episode"] for r in records if r["type"] == "episode"]
    ids = [e["id"] for e in episodes]  # type: ignore[index]
    assert len(ids) == len(set(ids))
    per_group: dict[str, int] = {}
    for e in episodes:
        per_group[e["group_id"]] = per_group.get(e["group_id"], 0) + 1  # type: ignore[index]
    assert set(per_group.values()) == {4}  # demo group_size
    assert len(per_group) == max(int(g[1:]) for g in per_group) + 1  # no admitted group missing
    decisions = {
        r["decision"]["group_id"]: r["decision"]["decision"]  # type: ignore[index]
        for r in records
        if r["type"] == "episode"
    }
    trained = [g for r in records if r["type"] == "batch" for g in r["groups"]]  # type: ignore[union-attr]
    assert len(trained) == len(set(trained))
    assert all(decisions[g] == "kept" for g in trained)


def test_external_trainer_process_drives_the_loop(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The reference trainer in its own process, through batch files and the board only."""
    shared = ["--trainer.max_steps", "2", *external_trainer_args(tmp_path)]
    worker = subprocess.Popen(
        orchestrate_cmd(tmp_path, tiny_model_dir, *shared, command="train"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        orch = subprocess.run(
            orchestrate_cmd(tmp_path, tiny_model_dir, "--trainer.mode", "external", *shared),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert orch.returncode == 0, orch.stderr[-3000:]
        assert worker.wait(timeout=120) == 0
    finally:
        worker.kill()
        worker.communicate()
    board = Board(str(tmp_path / "board"), "demo")
    assert board.versions() == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "batches").glob("batch-*.json")) == [
        "batch-00000000.json",
        "batch-00000001.json",
    ]
    assert "steps:     2" in orch.stdout
