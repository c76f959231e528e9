"""Supervision end to end: a local reference engine SIGKILLed mid-run is replaced under its id,
and the run finishes with every admitted group accounted for exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from orchestrator.record.accounting import account
from orchestrator.record.events import read_events
from tests.support.processes import alive, orchestrate_cmd


def _metrics(run_dir: Path) -> str:
    """``GET /metrics`` of the running orchestrator's admin API (``admin.json``)."""
    admin = json.loads((run_dir / "admin.json").read_text())
    req = urllib.request.Request(
        f"{admin['url']}/metrics", headers={"Authorization": f"Bearer {admin['token']}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return str(r.read().decode())


def _served_by_replacement(run_dir: Path, endpoint: str) -> bool:
    """Whether a call was served by ``endpoint`` after its ``island_restarted`` event."""
    restarted = None
    for e in read_events(run_dir):
        if e["kind"] == "island_restarted" and e["endpoint"] == endpoint:
            restarted = e["seq"]
        elif restarted is not None and e["kind"] == "served" and e["endpoint"] == endpoint:
            return True
    return False


@pytest.mark.slow
def test_a_killed_engine_is_replaced_and_the_run_accounts_for_every_group(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The run is stopped (SIGTERM) once the replacement has served a call, so how long a restart
    takes on a busy machine does not decide whether the replacement gets to serve."""
    run_dir = tmp_path / "demo"
    proc = subprocess.Popen(
        orchestrate_cmd(
            tmp_path,
            tiny_model_dir,
            "--trainer.max_steps",
            "200",  # an upper bound: the test stops the run well before
            "--fleet.restart_backoff_s",
            "0.5",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    started: dict[str, list[int]] = {}  # engine → pids, in start order
    killed: int | None = None
    metrics = ""
    stopped = False
    checked = 0.0
    lines: list[str] = []
    deadline = time.monotonic() + 600
    for line in proc.stderr:
        lines.append(line)
        assert time.monotonic() < deadline, "".join(lines[-20:])
        if '"engine_started"' in line:
            record = json.loads(line)
            started.setdefault(record["engine"], []).append(record["pid"])
        elif '"trainer_step"' in line and killed is None:
            killed = started["engine-0"][0]
            os.kill(killed, signal.SIGKILL)
        elif '"island_restarted"' in line and not metrics:
            metrics = _metrics(run_dir)  # while the run goes on
        if metrics and not stopped and time.monotonic() - checked > 0.5:
            checked = time.monotonic()
            if _served_by_replacement(run_dir, "engine-0"):
                proc.send_signal(signal.SIGTERM)
                stopped = True
    out, _ = proc.communicate(timeout=120)
    stderr = "".join(lines)
    assert killed is not None, "the run ended before its first step"
    assert stopped, "the replacement served no call before the run's 200 steps: " + stderr[-3000:]
    assert proc.returncode == 130, stderr[-3000:]  # stopped by the test's SIGTERM
    assert "status:    interrupted" in out
    assert "Traceback" not in stderr

    # replaced under the same id by a new process, which is gone with the run
    assert len(started["engine-0"]) == 2
    assert started["engine-0"][1] != killed
    assert len(started["engine-1"]) == 1
    assert not any(alive(pid) for pids in started.values() for pid in pids)

    events = read_events(run_dir)
    mine = [e for e in events if e["kind"].startswith("island_")]
    assert [e["kind"] for e in mine] == ["island_died", "island_restarted"], mine
    died, restarted = mine
    assert died["endpoint"] == restarted["endpoint"] == "engine-0"
    assert died["exit_code"] == -signal.SIGKILL
    assert "SIGKILL" in died["reason"]
    assert restarted["restart"] == 1
    assert restarted["backoff_s"] == 0.5
    # out of rotation from the death on: no route chose it until it was registered again
    between = [e for e in events if died["seq"] < e["seq"] < restarted["seq"]]
    assert not [e for e in between if e["kind"] == "route" and e["chosen"] == "engine-0"]

    assert 'sprawl_island_deaths_total{endpoint="engine-0"} 1.0' in metrics
    assert 'sprawl_island_restarts_total{endpoint="engine-0"} 1.0' in metrics

    acc = account(run_dir)  # the groups in flight at the stop are recorded as dropped
    assert acc.ok, acc.problems
    counts = acc.counts()
    assert counts["unaccounted"] == counts["duplicated"] == 0
    assert counts["batches"] >= 2  # the kill came after the first step, the stop later still


@pytest.mark.slow
def test_a_run_whose_last_engine_used_up_its_restarts_stops_with_one_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    proc = subprocess.Popen(
        orchestrate_cmd(
            tmp_path,
            tiny_model_dir,
            "--fleet.local_engines",
            "1",
            "--fleet.max_restarts",
            "0",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    pid: int | None = None
    for line in proc.stderr:
        lines.append(line)
        if '"engine_started"' in line:
            pid = json.loads(line)["pid"]
        elif '"trainer_step"' in line and pid is not None:
            os.kill(pid, signal.SIGKILL)
            pid = None
    proc.communicate(timeout=120)
    stderr = "".join(lines)
    assert proc.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    assert lines[-1].startswith(
        "orchestrate: error: no rollout endpoint is left: engine-0 died and used up their "
        "restarts (fleet.max_restarts = 0)"
    )
    run_dir = tmp_path / "demo"
    kinds = [e["kind"] for e in read_events(run_dir) if e["kind"].startswith("island_")]
    assert kinds == ["island_died", "island_gave_up"]
    acc = account(run_dir)  # the groups in flight are recorded as dropped by the stop
    assert acc.ok, acc.problems
