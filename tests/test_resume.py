"""Restart after SIGKILL: reconciliation of the logs (fast, synthetic) and real killed runs."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

import pytest
import zstandard
from test_demo import _cmd, _external_trainer_args
from test_trajlog import make_group

from orchestrator.config import load_config
from orchestrator.errors import ConfigError, TrajlogError
from orchestrator.offline.resimulate import resimulate
from orchestrator.record.accounting import account
from orchestrator.record.events import EventLog, read_events
from orchestrator.record.frames import parts, scan_frames
from orchestrator.record.resume import (
    LOST_REASON,
    LoggedRun,
    check_run_dir,
    external_version,
    read_run,
    reconcile,
    start,
)
from orchestrator.record.trajlog import TrajectoryLog, batch_records, episode_records
from orchestrator.run import RunSummary
from orchestrator.types import Batch, GroupDecision
from policies.board import Board


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
    assert rec.reconstructed.version == 1
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
    batch = Batch(version=0, groups=groups[:2], decisions=kept[:2])
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
def _orchestrate(tmp_path: Path, model_dir: Path, *extra: str, train: bool = False) -> list[str]:
    return _cmd(
        tmp_path, model_dir, "--trainer.max_steps", "4", *extra, command="train" if train else None
    )


def _resume(tmp_path: Path, model_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run the demo again with ``--run.resume true``; it must finish."""
    again = subprocess.run(
        _orchestrate(tmp_path, model_dir, "--run.resume", "true"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    return again


def _kill_after(
    proc: subprocess.Popen[str],
    marker: str,
    count: int = 1,
    sig: signal.Signals = signal.SIGKILL,
) -> tuple[str, str]:
    """Send ``sig`` to ``proc`` once ``marker`` appeared ``count`` times on its stderr; its
    stderr up to then, and its stdout (empty when not piped)."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and sum(marker in line for line in lines) < count:
        line = proc.stderr.readline()
        assert line, "".join(lines[-20:])
        lines.append(line)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    return "".join(lines), out or ""


def _drop_last_batch_record(traj: Path) -> tuple[int, list[str]] | None:
    """Remove the newest batch record (its frame); its version and groups, if there was one."""
    found = parts(traj, "batches")
    frames, _ = scan_frames(found[-1].read_bytes()) if found else ([], 0)
    if not frames:
        return None  # the kill itself came before the record
    part = found[-1]
    cctx = zstandard.ZstdCompressor(write_checksum=True)
    part.write_bytes(b"".join(cctx.compress(f) for f in frames[:-1]))
    last = json.loads(frames[-1])
    return last["produced_version"], last["groups"]


def _summary(stdout: str) -> dict[str, int]:
    """The counts of the summary ``orchestrate`` prints when a run ends (``rewards``: how many
    per-step rewards; ``resumed``: the step the last restart continued from, absent when the run
    never resumed)."""
    found = {
        "steps": re.search(r"^steps: +(\d+)$", stdout, re.M),
        "episodes": re.search(r"^episodes: +(\d+) ", stdout, re.M),
        "dropped": re.search(r"^episodes: .*\((\d+) groups dropped\)$", stdout, re.M),
        "resumed": re.search(r"^resumed: +at steps? (?:\d+, )*(\d+) ", stdout, re.M),
    }
    counts = {k: int(m.group(1)) for k, m in found.items() if m}
    rewards = re.search(r"^reward: +(.+)$", stdout, re.M)
    if rewards and rewards.group(1) != "n/a":
        counts["rewards"] = len(rewards.group(1).split(" → "))
    return counts


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_an_orchestrator_killed_mid_run_resumes_to_max_steps(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    proc = subprocess.Popen(
        _orchestrate(tmp_path, tiny_model_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    err, _ = _kill_after(proc, '"trainer_step"')
    engines = [json.loads(line)["pid"] for line in err.splitlines() if '"engine_started"' in line]
    assert len(engines) == 2
    assert _gone(engines), "engines outlived their killed orchestrator"
    run_dir = tmp_path / "demo"
    header = (run_dir / "trajectories" / "run.json").read_text()
    # as if the kill came between the trainer step and its batch record: the restart rebuilds it
    unrecorded = _drop_last_batch_record(run_dir / "trajectories")

    again = _resume(tmp_path, tiny_model_dir)
    assert '"trainer_resumed"' in again.stderr
    assert Board(str(run_dir / "board"), "demo").versions() == [0, 1, 2, 3, 4]
    batches = batch_records(run_dir / "trajectories")
    assert [b.produced_version for b in batches] == [1, 2, 3, 4]
    rebuilt = [b for b in batches if b.metrics.get("reconstructed") == 1.0]
    assert len(rebuilt) == 1
    if unrecorded is not None:  # FIFO: the very groups the trainer had stepped on
        assert (rebuilt[0].produced_version, rebuilt[0].groups) == unrecorded
    trained = [g for b in batches for g in b.groups]
    assert len(trained) == len(set(trained))
    assert (run_dir / "trajectories" / "run.json").read_text() == header
    resumed = [e for e in read_events(run_dir) if e["kind"] == "resumed"]
    assert len(resumed) == 1
    assert resumed[0]["reconstructed"] == rebuilt[0].produced_version
    acc = account(run_dir)
    assert acc.ok, acc.problems
    assert acc.counts()["unaccounted"] == acc.counts()["duplicated"] == 0
    assert _summary(again.stdout)["steps"] == 4  # the whole run's, not the restart's share
    assert _summary(again.stdout)["resumed"] == resumed[0]["trainer_version"]
    # admissions (budget carried over by `resumed`) and staleness decisions re-simulate exactly
    resim = resimulate(read_events(run_dir), trajectories=run_dir / "trajectories")
    assert resim.ok, resim.mismatches


@pytest.mark.slow
def test_a_resumed_run_s_summary_counts_the_whole_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Stopped (SIGINT) after its first step, then resumed: the first summary is that part's,
    the resumed one the whole run's, as the accounting counts it, with the step it resumed at."""
    proc = subprocess.Popen(
        _orchestrate(tmp_path, tiny_model_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, out = _kill_after(proc, '"trainer_step"', sig=signal.SIGINT)
    assert proc.returncode == 130
    first = _summary(out)
    assert "resumed" not in first
    assert 1 <= first["steps"] < 4

    again = _resume(tmp_path, tiny_model_dir)
    run_dir = tmp_path / "demo"
    whole = _summary(again.stdout)
    acc = account(run_dir)
    assert acc.ok, acc.problems
    counts = acc.counts()
    recorded = counts["trained"] + counts["dropped"] + counts["unbatched"]
    group_size = load_config(Path("configs/demo.toml"), {}).scheduler.group_size
    episodes = {r.episode.id for r in episode_records(run_dir / "trajectories")}
    assert whole["steps"] == counts["batches"] == 4
    assert whole["episodes"] == len(episodes) == group_size * recorded
    assert whole["episodes"] > first["episodes"]
    assert whole["dropped"] == counts["dropped"]
    resumed = [e for e in read_events(run_dir) if e["kind"] == "resumed"]
    assert whole["resumed"] == resumed[0]["trainer_version"] >= first["steps"]
    assert whole["rewards"] == 4  # one per step


@pytest.mark.slow
def test_an_external_trainer_killed_mid_run_resumes_from_its_checkpoint(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    shared = _external_trainer_args(tmp_path)

    logs = contextlib.ExitStack()  # files, not pipes: nobody reads them until the end
    orch_log = logs.enter_context((tmp_path / "orchestrator.log").open("w"))
    trainer_log = logs.enter_context((tmp_path / "trainer.log").open("w"))

    def trainer(log: IO[str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            _orchestrate(tmp_path, tiny_model_dir, *shared, train=True),
            stdout=subprocess.DEVNULL,
            stderr=log or subprocess.PIPE,
            text=True,
        )

    with logs:
        orch = subprocess.Popen(
            _orchestrate(tmp_path, tiny_model_dir, "--trainer.mode", "external", *shared),
            stdout=subprocess.PIPE,
            stderr=orch_log,
            text=True,
        )
        first = trainer()
        restarted = None
        try:
            _kill_after(first, '"trainer_step"')
            restarted = trainer(trainer_log)
            out, _ = orch.communicate(timeout=600)
            assert orch.returncode == 0, (tmp_path / "orchestrator.log").read_text()[-3000:]
            assert restarted.wait(timeout=120) == 0
        finally:
            for p in (orch, first, restarted):
                if p is not None:
                    p.kill()
                    p.communicate()
    assert '"trainer_resumed"' in (tmp_path / "trainer.log").read_text()
    assert "steps:     4" in out
    assert Board(str(tmp_path / "board"), "demo").versions() == [0, 1, 2, 3, 4]
    batches = batch_records(tmp_path / "demo" / "trajectories")
    assert [b.produced_version for b in batches] == [1, 2, 3, 4]
    assert account(tmp_path / "demo").ok


def _wait_for(path: Path, marker: str) -> None:
    deadline = time.monotonic() + 300
    while marker not in path.read_text():
        assert time.monotonic() < deadline, path.read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.slow
def test_an_orchestrator_killed_with_an_external_trainer_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The trainer goes on through the orchestrator's death; the restart waits for the version
    the batch files say the trainer owes it, and continues from there."""
    shared = _external_trainer_args(tmp_path)
    external = ["--trainer.mode", "external", *shared]
    with (tmp_path / "trainer.log").open("w") as log, (tmp_path / "orch.log").open("w") as olog:
        worker = subprocess.Popen(
            _orchestrate(tmp_path, tiny_model_dir, *shared, train=True),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        orch = subprocess.Popen(
            _orchestrate(tmp_path, tiny_model_dir, *external),
            stdout=subprocess.DEVNULL,
            stderr=olog,
        )
        try:
            _wait_for(tmp_path / "trainer.log", '"trainer_step"')
            orch.kill()
            orch.wait(timeout=60)
            again = subprocess.run(
                _orchestrate(tmp_path, tiny_model_dir, *external, "--run.resume", "true"),
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert again.returncode == 0, again.stderr[-3000:]
            assert worker.wait(timeout=120) == 0
        finally:
            for p in (orch, worker):
                p.kill()
                p.wait()
    assert Board(str(tmp_path / "board"), "demo").versions() == [0, 1, 2, 3, 4]
    batches = batch_records(tmp_path / "demo" / "trajectories")
    assert [b.produced_version for b in batches] == [1, 2, 3, 4]
    acc = account(tmp_path / "demo")
    assert acc.ok, acc.problems
