"""A mixture of environments end to end: ``configs/mixture.toml`` for one trainer step."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator.offline.resimulate import resimulate
from orchestrator.record.events import STOP_REASONS, read_events
from orchestrator.record.frames import read_log
from tests.support.processes import orchestrate_cmd

pytestmark = pytest.mark.slow


def test_both_environments_run_under_their_own_drop_rules(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    cmd = orchestrate_cmd(
        tmp_path, tiny_model_dir, "--trainer.max_steps", "1", config="configs/mixture.toml"
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps:     1" in proc.stdout
    assert "env calculator:" in proc.stdout
    assert "env guess:" in proc.stdout

    run_dir = tmp_path / "mixture"
    records = read_log(run_dir / "trajectories")
    episodes = [r["episode"] for r in records if r["type"] == "episode"]
    assert {e["environment"] for e in episodes} == {"calculator", "guess"}
    assert len({e["id"] for e in episodes}) == len(episodes)

    events = read_events(run_dir)
    run = next(e for e in events if e["kind"] == "run")
    assert run["environment_staleness"]["guess"]["drop"] == {"statistic": "max", "max_lag": 0}
    admits = [e["environment"] for e in events if e["kind"] == "admit"]
    assert admits[:3] == ["calculator", "guess", "calculator"]  # weights 2 : 1
    rules = {"calculator": 2, "guess": 0}  # [staleness].drop, the guess entry's own drop
    decided = [e for e in events if e["kind"] == "decide" and e["reason"] not in STOP_REASONS]
    assert decided
    for ev in decided:
        kept = ev["max_lag"] <= rules[ev["environment"]]
        assert ev["decision"] == ("kept" if kept else "dropped"), ev
        if not kept and ev["environment"] == "guess":
            assert "environments[name='guess'].staleness.drop" in ev["reason"]
    again = resimulate(events, trajectories=run_dir / "trajectories")
    assert again.ok, again.mismatches
    assert again.checked["decide"] == len(decided)
