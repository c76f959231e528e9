"""A run whose islands are Ray actors on a real Ray cluster (a head node on loopback, 2 CPUs).

Two reference-engine islands start with the run; one actor is killed mid-run and replaced
under its id; ``orchestrate fleet scale`` takes the fleet 2 → 3 → 1 while the run goes on
(removal drains first); the run, stopped with SIGINT, accounts for every group exactly once,
and no island outlives it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from orchestrator.fleet.ray_cluster import ray_head
from orchestrator.record.accounting import account
from orchestrator.record.events import read_events
from tests.support.processes import orchestrate_cmd
from tests.support.waiting import until_sync

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def _fleet(run_dir: Path, *args: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "orchestrator.cli", "fleet", *args, "--orchestrator", str(run_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _wait_for(
    proc: subprocess.Popen[str],
    lines: list[str],
    needle: str,
    *,
    after: int = 0,
    timeout_s: float = 300,
) -> None:
    """Until the run logs ``needle`` (in a line past the first ``after``)."""

    def logged() -> bool:
        assert proc.poll() is None, f"the run ended: {''.join(lines[-20:])}"
        return any(needle in line for line in lines[after:])

    until_sync(logged, f"{needle!r} in the run's log", timeout_s=timeout_s, every_s=0.2)


def test_islands_on_ray_are_replaced_and_scaled_during_a_run(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    with ray_head(tmp_path) as head:
        address = head.address
        run_dir = tmp_path / "demo"
        fleet_args = [
            "--fleet.local_engines", "0", "--fleet.restart_backoff_s", "0.5",
            "--fleet.ray.address", address, "--fleet.ray.islands", "2",
            "--fleet.ray.resources.num_cpus", "0.5",
            "--fleet.ray.work_dir", str(tmp_path / "islands"),
            "--fleet.ray.drain_timeout_s", "30",
        ]  # fmt: skip
        proc = subprocess.Popen(
            orchestrate_cmd(tmp_path, tiny_model_dir, "--trainer.max_steps", "1000", *fleet_args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        stdout, stderr = proc.stdout, proc.stderr
        assert stdout is not None
        assert stderr is not None
        lines: list[str] = []
        outs: list[str] = []
        # both pipes drained by threads (communicate() would close stderr under the reader)
        readers = [
            threading.Thread(target=lambda: lines.extend(iter(stderr.readline, ""))),
            threading.Thread(target=lambda: outs.append(stdout.read())),
        ]
        for reader in readers:
            reader.start()
        try:
            _wait_for(proc, lines, '"trainer_step"')
            ray.init(address=address, namespace="sprawl-demo", log_to_driver=False)
            [victim] = [n for n in ray.util.list_named_actors() if n.startswith("ray-0.")]
            ray.kill(ray.get_actor(victim))
            _wait_for(proc, lines, '"island_restarted"')

            three = _fleet(run_dir, "scale", "3", "--wait")["islands"]
            serving = [("ray-0", "serving"), ("ray-1", "serving"), ("ray-2", "serving")]
            assert [(i["id"], i["state"]) for i in three] == serving
            one = _fleet(run_dir, "scale", "1", "--wait")["islands"]
            assert [i["id"] for i in one] == ["ray-0"]
            _wait_for(proc, lines, '"trainer_step"', after=len(lines))  # a step on one island
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=180)
            for reader in readers:
                reader.join()
            stdout.close()
            stderr.close()
        out = "".join(outs)
        assert proc.returncode == 130, "".join(lines[-40:])
        assert "status:    interrupted" in out
        assert ray.util.list_named_actors() == []  # no island outlives the run
        ray.shutdown()

    events = read_events(run_dir)
    fleet = [e for e in events if e["kind"].startswith("island_")]
    kinds = [(e["kind"], e["endpoint"]) for e in fleet]
    assert kinds[:2] == [("island_died", "ray-0"), ("island_restarted", "ray-0")], kinds
    assert "its actor died" in fleet[0]["reason"]
    assert ("island_added", "ray-2") in kinds
    removed = {e["endpoint"]: e for e in fleet if e["kind"] == "island_removed"}
    assert set(removed) == {"ray-1", "ray-2"}
    assert all(e["drained"] for e in removed.values())
    # a draining island got no new calls once it was taken out of rotation
    for e in fleet:
        if e["kind"] == "island_draining":
            later = [r for r in events if r["seq"] > e["seq"] and r["kind"] == "route"]
            assert not [r for r in later if r["chosen"] == e["endpoint"]]

    acc = account(run_dir)
    assert acc.ok, acc.problems
    counts = acc.counts()
    assert counts["unaccounted"] == counts["duplicated"] == 0
