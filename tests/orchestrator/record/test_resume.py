"""Restart after SIGKILL: reconciliation of the logs (fast, synthetic) and real killed runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.errors import ConfigError, TrajlogError
from orchestrator.observe.summary import RunSummary
from orchestrator.record.accounting import account
from orchestrator.record.events import EventLog, read_events
from orchestrator.record.resume import (
    LOST_REASON,
    LoggedRun,
    check_run_dir,
    external_version,
    read_run,
    reconcile,
    start,
)
from orchestrator.record.trajlog import TrajectoryLog, batch_records
from orchestrator.types import Batch, GroupDecision
from tests.support.trajectories import make_group


def _logged(decisions: str, trained: int, *, admitted: int | None = None) -> LoggedRun:
    """Groups g0, g1, … recorded with ``decisions`` ("k" kept, "d" dropped); the first
    ``trained`` kept ones trained two per batch; ``admitted`` groups admitted in all."""
    rng = random.Random(0)
    logged = LoggedRun()
    kept = []
    for i, d in enumerate(decisions):
        group, _ = make_group(rng, i, 0, size=2)
        decision = GroupDecision(
            group_id=group.id,
            decision="kept" if d == "k" else "dropped",
            reason="" if d == "k" else "lag",
            max_lag=0,
        )
        logged.groups[group.id] = (group, decision)
        if d == "k":
            kept.append(group.id)
    logged.trained = set(kept[:trained])
    logged.last_version = trained // 2
    logged.admitted = [f"g{i:06d}" for i in range(admitted or len(decisions))]
    return logged


def test_a_run_killed_mid_step_restores_its_untrained_groups_in_order() -> None:
    logged = _logged("kkdkkk", trained=2, admitted=8)  # g6, g7 in flight
    rec = reconcile(logged, trainer_version=1, groups_per_batch=2)
    assert rec.reconstructed is None
    assert [g.id for g, _ in rec.restored] == ["g000003", "g000004", "g000005"]
    assert all(d.decision == "kept" for _, d in rec.restored)
    assert rec.lost == ["g000006", "g000007"]
    assert rec.next_index == 8
    assert rec.dropped == 3  # g2 dropped + two lost: never trained, their slots are free


def test_a_checkpoint_one_step_ahead_rebuilds_the_batch_fifo() -> None:
    logged = _logged("kkdkkk", trained=2)
    rec = reconcile(logged, trainer_version=2, groups_per_batch=2)
    assert rec.reconstructed is not None
    assert rec.reconstructed.trained_at_version == 1
    assert [g.id for g in rec.reconstructed.groups] == ["g000003", "g000004"]
    assert [d.group_id for d in rec.reconstructed.decisions] == ["g000003", "g000004"]
    assert [g.id for g, _ in rec.restored] == ["g000005"]
    assert rec.lost == []


def test_an_earlier_restart_s_lost_groups_are_not_listed_again() -> None:
    logged = _logged("kk", trained=2, admitted=4)
    logged.lost = {"g000002"}
    rec = reconcile(logged, trainer_version=1, groups_per_batch=2)
    assert rec.lost == ["g000003"]
    assert rec.dropped == 2


@pytest.mark.parametrize("version", [0, 3])
def test_a_trainer_that_does_not_match_the_log_is_refused(version: int) -> None:
    logged = _logged("kkkk", trained=4)  # last batch produced version 2
    with pytest.raises(TrajlogError, match=f"trainer is at version {version}"):
        reconcile(logged, trainer_version=version, groups_per_batch=2)


def test_one_step_ahead_without_enough_kept_groups_is_refused() -> None:
    with pytest.raises(TrajlogError, match="only 1 kept groups are untrained"):
        reconcile(_logged("kkk", trained=2), trainer_version=2, groups_per_batch=2)


def test_an_external_trainer_owns_the_batch_file_it_was_handed(tmp_path: Path) -> None:
    logged = _logged("kkkk", trained=2)  # the last batch record produced version 1
    assert external_version(tmp_path, logged) == 1
    (tmp_path / "batch-00000001.json").write_text("{}")  # written, never recorded: it steps on it
    assert external_version(tmp_path, logged) == 2


def _synthetic_run(run_dir: Path) -> None:
    """Five groups admitted: g0 g1 trained (version 1), g2 g3 kept (the trainer's second step
    ran, its batch record was never written), g4 in flight; then SIGKILL."""
    cfg = load_config(None, {"run.root": str(run_dir.parent), "run.name": run_dir.name})
    (run_dir / "config.json").parent.mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json())
    events = EventLog.for_run(run_dir / "events", cfg)
    tlog = TrajectoryLog(run_dir / "trajectories", run="r")
    rng = random.Random(1)
    groups = [make_group(rng, i, 0, size=2)[0] for i in range(4)]
    kept = [GroupDecision(group_id=g.id, decision="kept", reason="", max_lag=0) for g in groups]
    for i in range(5):
        events.emit("admit", index=i, group_id=f"g{i:06d}", task_id="t", admitted=i + 1, budget=9)
    for g, d in zip(groups, kept, strict=True):
        tlog.write_group(g, d, trainer_version=0)
    batch = Batch(trained_at_version=0, groups=groups[:2], decisions=kept[:2])
    tlog.write_batch(batch, 1, {"loss": 0.0, "reward_mean": 0.25})
    tlog.close()
    events.close()  # writes nothing more: the admits flushed everything before them


def test_a_restart_writes_what_it_reconciled_and_the_accounting_balances(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    _synthetic_run(run_dir)
    cfg = load_config(
        None,
        {"run.root": str(tmp_path), "run.name": "r", "run.resume": True, "trainer.max_steps": 2},
    )
    assert check_run_dir(cfg) == run_dir
    logged = read_run(run_dir)
    event_log = EventLog.for_run(run_dir / "events", cfg, first_seq=logged.next_seq)
    tlog = TrajectoryLog(run_dir / "trajectories", run="r", append=True, events=event_log)
    rec = start(logged, tlog, trainer_version=2, cfg=cfg)  # the checkpoint is at version 2
    tlog.close()
    assert rec.next_index == 5
    records = batch_records(run_dir / "trajectories")
    assert [(b.produced_version, b.groups) for b in records] == [
        (1, ["g000000", "g000001"]),
        (2, ["g000002", "g000003"]),
    ]
    assert records[1].metrics["reconstructed"] == 1.0
    events = read_events(run_dir)
    assert [e["seq"] for e in events] == list(range(len(events)))
    lost = next(e for e in events if e["kind"] == "lost")
    assert (lost["group_ids"], lost["reason"]) == (["g000004"], LOST_REASON)
    resumed = next(e for e in events if e["kind"] == "resumed")
    assert resumed["trainer_version"] == resumed["reconstructed"] == 2
    acc = account(run_dir)
    assert acc.ok, acc.problems
    assert acc.counts()["trained"] == 4
    assert json.loads((run_dir / "trajectories" / "run.json").read_text())["run"] == "r"


def test_a_restart_s_summary_counts_the_whole_run_from_its_logs(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    _synthetic_run(run_dir)
    cfg = load_config(None, {"run.root": str(tmp_path), "run.name": "r", "run.resume": True})
    logged = read_run(run_dir)
    event_log = EventLog.for_run(run_dir / "events", cfg, first_seq=logged.next_seq)
    tlog = TrajectoryLog(run_dir / "trajectories", run="r", append=True, events=event_log)
    rec = start(logged, tlog, trainer_version=2, cfg=cfg)  # rebuilds the second step's record
    tlog.close()
    assert rec.reconstructed is not None
    rebuilt = [e.reward for g in rec.reconstructed.groups for e in g.episodes]

    summary = RunSummary(run_dir=run_dir)
    summary.cover(read_run(run_dir))
    acc = account(run_dir).counts()
    assert summary.steps == acc["batches"] == 2
    assert summary.episodes == 2 * (acc["trained"] + acc["dropped"] + acc["unbatched"]) == 8
    assert summary.dropped_groups == acc["dropped"] == 0
    assert summary.rewards == pytest.approx([0.25, sum(rebuilt) / len(rebuilt)])
    assert summary.resumed_at == [2]
    assert "resumed:   at step 2 " in summary.render()
    assert "resumed" not in RunSummary(run_dir=run_dir, steps=2).render()  # a fresh run's


def test_resume_names_what_is_missing_or_changed(tmp_path: Path) -> None:
    base = {"run.root": str(tmp_path), "run.name": "r", "run.resume": True}
    with pytest.raises(ConfigError, match="holds no trajectory log"):
        check_run_dir(load_config(None, base))
    _synthetic_run(tmp_path / "r")
    with pytest.raises(ConfigError, match=r"run\.seed was 0 .* now 7"):
        check_run_dir(load_config(None, {**base, "run.seed": 7}))
    with pytest.raises(ConfigError, match=r"trainer\.checkpoint"):
        load_config(None, {**base, "trainer.checkpoint": False})


# -- real runs, killed with SIGKILL ---------------------------------------------------------------


def test_a_restart_counts_the_re_runs_the_task_stream_did_not_feed(tmp_path: Path) -> None:
    """Admits naming ``requeued_from`` are read back with their chain depth, so the resumed
    scheduler continues the task stream where it stopped and keeps the requeue bound
    (``Scheduler(requeue_depth=…)``)."""
    run_dir = tmp_path / "r"
    events = EventLog(run_dir / "events")
    for i, source in enumerate([None, None, "g000000", None, "g000002"]):  # g2 re-runs g0
        extra = {"requeued_from": source} if source else {}
        events.emit("admit", index=i, group_id=f"g{i:06d}", task_id="t", **extra)
    events.close()
    (run_dir / "trajectories").mkdir()
    logged = read_run(run_dir)
    assert logged.requeue_depth == {"g000002": 1, "g000004": 2}  # g4 re-ran g2, a re-run
    assert reconcile(logged, trainer_version=0, groups_per_batch=2).requeue_depth == {
        "g000002": 1,
        "g000004": 2,
    }
