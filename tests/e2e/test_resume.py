"""Restarts end to end: the orchestrator or the trainer SIGKILLed mid-run, then resumed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

import pytest
import zstandard

from orchestrator.config import load_config
from orchestrator.offline.resimulate import resimulate
from orchestrator.record.accounting import account
from orchestrator.record.events import read_events
from orchestrator.record.frames import parts, scan_frames
from orchestrator.record.trajlog import batch_records, episode_records
from policies.board import Board
from tests.support.processes import external_trainer_args, orchestrate_cmd
from tests.support.waiting import until_sync


def _orchestrate(tmp_path: Path, model_dir: Path, *extra: str, train: bool = False) -> list[str]:
    return orchestrate_cmd(
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
    def none_alive() -> bool:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        return not alive

    try:
        return until_sync(none_alive, f"{pids} gone", timeout_s=30, every_s=0.2)
    except AssertionError:
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
    group_size = load_config(Path("tests/support/loop.toml"), {}).scheduler.group_size
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
    shared = external_trainer_args(tmp_path)

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
    try:
        until_sync(lambda: marker in path.read_text(), marker, timeout_s=300, every_s=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {path.read_text()[-3000:]}") from None


@pytest.mark.slow
def test_an_orchestrator_killed_with_an_external_trainer_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The trainer goes on through the orchestrator's death; the restart waits for the version
    the batch files say the trainer owes it, and continues from there."""
    shared = external_trainer_args(tmp_path)
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
