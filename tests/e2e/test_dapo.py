"""DAPO's dynamic sampling and soft overlong penalty on the demo loop, end to end.

configs/demo.toml (the warm-started calculator model, 8 groups of 4 a step) with
``[scheduler.dynamic_sampling]`` on and ``staleness.overlong = "soft_penalty"``, ``max_tokens``
24 and a buffer of 4, so the ~22-token tool calls are penalized: the run trains, groups of equal
rewards are dropped with their reason and refilled (about one group in five at this reward level:
six steps make ~48 decisions, so none at all would happen ~1e-4 of the time), every episode's
penalty is in the log and in the reward the trainer got, every decision re-simulates, every
admitted group is accounted for, and ``replay --what-if`` reproduces the filtering and turns it off.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.loop.batcher import EQUAL_REWARDS
from orchestrator.models import calculator_max_operand
from orchestrator.offline.resimulate import resimulate
from orchestrator.record.accounting import account
from orchestrator.record.events import STOP_REASONS, read_events
from orchestrator.record.trajlog import batch_records, episode_records
from orchestrator.warm_start import sft_phases
from staleness.rewards import soft_overlong_penalty
from tests.support.models import warm_model_copy
from tests.support.processes import orchestrate_cmd

pytestmark = pytest.mark.slow

DEMO = Path("configs/demo.toml")
POLICIES = """
[policies.as_run]
drop = { statistic = "max", max_lag = 2 }
overlong = "soft_penalty"
overlong_buffer = 4

[policies.unfiltered]
drop = { statistic = "max", max_lag = 2 }
overlong = "soft_penalty"
overlong_buffer = 4
dynamic_sampling = { enabled = false }
"""


def test_dynamic_sampling_and_the_soft_penalty_on_the_demo_loop(tmp_path: Path) -> None:
    cfg = load_config(DEMO)
    warm, operand = cfg.model.warm_start, calculator_max_operand(cfg)
    assert warm is not None
    assert operand is not None
    model = warm_model_copy(
        tmp_path / "model", sft_phases(warm.steps, warm.focus_steps, operand), cfg.run.seed
    )
    extra = ["--trainer.max_steps", "6", "--sampling.max_tokens", "24"]
    extra += ["--scheduler.dynamic_sampling.max_refills", "32"]
    extra += ["--staleness.overlong", "soft_penalty", "--staleness.overlong_buffer", "4"]
    proc = subprocess.run(
        orchestrate_cmd(tmp_path, model, *extra, config=DEMO),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / cfg.run.name
    records = episode_records(run / "trajectories")
    decisions = {r.decision.group_id: r.decision for r in records}
    filtered = [g for g, d in decisions.items() if d.reason == EQUAL_REWARDS]
    assert filtered, "no group of equal rewards in six steps"
    for r in records:
        e = r.episode
        calls = [soft_overlong_penalty(len(s.token_ids), 24, 4, 1.0) for s in e.segments]
        assert e.overlong_penalty == min(calls, default=0.0)
        if r.decision.group_id in filtered:
            assert r.decision.decision == "dropped"
    penalized = [r.episode for r in records if r.episode.overlong_penalty < 0]
    assert penalized, "no call came within the buffer"
    batches = batch_records(run / "trajectories")
    assert len(batches) == 6
    assert sum(b.metrics["dynamic_sampling/filtered"] for b in batches) <= len(filtered)
    by_id = {r.episode.id: r.episode for r in records}
    for b in batches:  # the trainer's reward_mean is the penalized reward's
        eps = [e for e in by_id.values() if e.group_id in b.groups]
        mean = sum(e.reward + e.overlong_penalty for e in eps) / len(eps)
        assert b.metrics["reward_mean"] == pytest.approx(mean, abs=1e-4)
        assert not set(b.groups) & set(filtered)

    events = read_events(run)
    result = resimulate(events, trajectories=run / "trajectories")
    assert result.ok, result.mismatches
    assert account(run).ok

    (tmp_path / "p.toml").write_text(POLICIES)
    argv = ["replay", str(run), "--what-if", str(tmp_path / "p.toml"), "--json"]
    what_if = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert what_if.returncode == 0, what_if.stderr[-3000:]
    out = json.loads(what_if.stdout)
    assert out["logged"]["groups/filtered"] == out["as_run"]["groups/filtered"] == len(filtered)
    assert out["as_run"]["groups/kept"] == out["logged"]["groups/kept"]
    assert out["unfiltered"]["groups/filtered"] == 0
    assert out["unfiltered"]["groups/kept"] == out["logged"]["groups/kept"] + len(filtered)
    decided = [r for r in records if r.decision.reason not in STOP_REASONS]
    assert out["as_run"]["episodes/overlong_penalized"] == sum(
        r.episode.overlong_penalty < 0 for r in decided
    )
