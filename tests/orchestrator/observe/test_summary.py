"""The run summary: reward per step, the first-vs-last-quarter verdict and the two transcripts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from orchestrator.observe import summary as summary_module
from orchestrator.observe.summary import RunSummary, transcript
from orchestrator.types import Endpoint, EndpointRef, Group, GroupDecision
from tests.support.trajectories import make_episode


def _group(
    rng: random.Random, gid: str, task: str, version: int, *, kept: bool = True
) -> tuple[Group, GroupDecision]:
    episodes = [
        make_episode(rng, gid, i, version).model_copy(update={"task_id": task}) for i in range(2)
    ]
    decision = GroupDecision(
        group_id=gid, decision="kept" if kept else "dropped", reason="", max_lag=0
    )
    return Group(id=gid, task_id=task, episodes=episodes), decision


def test_samples_are_the_first_trained_group_and_the_last_of_its_task() -> None:
    rng = random.Random(0)
    summary = RunSummary(run_dir=Path("runs/x"))
    summary.count(*_group(rng, "g0", "calc-1", 0, kept=False))  # dropped: never a sample
    summary.count(*_group(rng, "g1", "calc-2", 0))
    summary.count(*_group(rng, "g2", "calc-3", 1))
    assert summary.first_sample is not None
    assert summary.first_sample.group_id == "g1"
    assert summary.last_sample is not None
    assert summary.last_sample.group_id == "g2"
    summary.count(*_group(rng, "g3", "calc-2", 5))  # the first sample's task, asked again
    summary.count(*_group(rng, "g4", "calc-4", 6))  # later, but another task
    assert summary.last_sample.group_id == "g3"
    assert summary.first_sample.id == "g1-e0"  # a group's first episode, not its best


def test_summary_ends_with_rewards_the_quarter_verdict_and_transcripts() -> None:
    rng = random.Random(1)
    summary = RunSummary(run_dir=Path("runs/x"), steps=8, report=Path("runs/x/report.html"))
    summary.rewards = [0.40, 0.41, 0.45, 0.50, 0.52, 0.55, 0.61, 0.60]
    summary.count(*_group(rng, "g1", "calc-2", 0))
    summary.count(*_group(rng, "g9", "calc-2", 7))
    text = summary.render()
    assert "report:    runs/x/report.html" in text
    before, after = text.index("before training (v"), text.index("after training (v")
    assert before < after < text.index("reward:    0.400 → 0.410")
    learning = text.splitlines()[-1]
    assert learning.startswith("learning:  first vs last quarter (steps 1–2 vs 7–8): 0.405±0.005")
    assert "(rose, Δ=+0.200" in learning


def test_transcript_shows_tool_calls_and_cuts_long_or_unprintable_text() -> None:
    episode = make_episode(random.Random(2), "g1", 0, 3)
    episode = episode.model_copy(
        update={"messages": [*episode.messages, {"role": "assistant", "content": "x\x00" * 200}]}
    )
    lines = transcript(episode, "after training")
    assert lines[0].startswith("after training (v")
    assert "task tg1, reward 0.00" in lines[0]
    assert lines[2] == '  assistant  → add({"a": 2, "b": 3})'
    assert lines[3] == "  tool       5"
    assert len(lines[-1]) == 2 + 11 + 100
    assert lines[-1].endswith("…")
    assert "\x00" not in lines[-1]


def test_calls_served_per_endpoint_stay_one_short_line() -> None:
    few = RunSummary(run_dir=Path("r"), served={"engine-0": {0: 3, 1: 5}, "engine-1": {}})
    assert "engine-0: v0×3, v1×5\nengine-1: no calls" in few.render()
    many = RunSummary(run_dir=Path("r"), served={"engine-0": {v: 2 for v in range(80)}})
    assert "engine-0: 160 calls on 80 versions, v0–v79" in many.render()


def test_a_short_run_is_not_judged_and_has_no_after_transcript_from_the_same_version() -> None:
    rng = random.Random(3)
    summary = RunSummary(run_dir=Path("r"), steps=2, rewards=[0.3, 0.4])
    summary.count(*_group(rng, "g1", "calc-1", 0))
    summary.count(*_group(rng, "g2", "calc-1", 0))  # sampled by v0 too: not "after training"
    text = summary.render()
    assert "before training (v0, task calc-1" in text
    assert "after training" not in text
    assert text.endswith("learning:  not judged (2 steps; the verdict needs 8)")


def _ep(name: str, version: int) -> Endpoint:
    return Endpoint(EndpointRef(id=name, url=f"http://{name}"), applied_version=version)


def test_the_summary_says_how_fast_the_first_version_was_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publish → every endpoint serving it, from the run's events: the first version against the
    median of the later ones (a stalled first version shows; issue #45)."""
    clock = [100.0]
    monkeypatch.setattr(summary_module.time, "monotonic", lambda: clock[0])
    summary = RunSummary(run_dir=tmp_path)
    sync = summary.sync

    def at(t: float) -> None:
        clock[0] = 100.0 + t

    for v, published, served_a, served_b in [(1, 0.0, 6.0, 6.2), (2, 10.0, 10.1, 10.3)]:
        at(published)
        sync.emit("trainer_version", version=v)
        at(served_a)
        sync.endpoint(_ep("a", v))
        sync.endpoint(_ep("a", v))  # polled again
        at(served_b)
        sync.endpoint(_ep("b", v))
    at(20.0)
    sync.emit("trainer_version", version=3)
    at(20.2)
    sync.endpoint(_ep("a", 4))  # skipped 3: served too
    assert sync.seconds == pytest.approx({1: 6.2, 2: 0.3, 3: 0.2})
    assert "versions:  first version served in 6.20 s (later ones: median 0.25 s, 2 versions)" in (
        summary.render()
    )
    assert "first version" not in RunSummary(run_dir=tmp_path).render()  # nothing published
