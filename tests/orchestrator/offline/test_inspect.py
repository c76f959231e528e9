"""``orchestrate inspect``: the summary and the transcript show what the log holds."""

from __future__ import annotations

import io
import random
import re
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.errors import TrajlogError
from orchestrator.offline.inspect_log import main, summarize
from orchestrator.record.events import EventLog
from orchestrator.record.trajlog import TrajectoryLog, batch_records, episode_records
from tests.support.trajectories import make_group, write_synthetic_log


def _render(argv: list[str]) -> str:
    buf = io.StringIO()
    assert main(argv, Console(file=buf, width=200, color_system=None)) == 0
    return buf.getvalue()


def test_summary_counts_match_the_records(tmp_path: Path) -> None:
    write_synthetic_log(tmp_path / "run" / "trajectories", steps=3, seed=5)
    records = episode_records(tmp_path / "run" / "trajectories")
    s = summarize(records, batch_records(tmp_path / "run" / "trajectories"))
    dropped_groups = {r.decision.group_id for r in records if r.decision.decision == "dropped"}
    assert s.groups_dropped == len(dropped_groups) > 0
    assert s.episodes == len(records)
    assert s.steps == 3
    assert sum(s.lags.values()) == sum(len(r.episode.segments) for r in records)
    assert sum(s.calls.values()) == sum(s.lags.values())

    out = _render([str(tmp_path / "run"), "--limit", "5"])  # a run dir resolves to its log
    assert f"{len(records)} ({s.episodes_dropped} dropped" in out
    assert f"{s.groups} ({s.groups_dropped} dropped)" in out
    assert "0→1" in out
    assert "2→3" in out
    assert len(re.findall(r"g\d{6}-e\d", out)) == 5  # --limit rows
    assert records[0].episode.id in out


def test_a_run_directory_also_shows_its_accounting(tmp_path: Path) -> None:
    write_synthetic_log(tmp_path / "run" / "trajectories", steps=2, seed=3)
    gids = sorted({r.decision.group_id for r in episode_records(tmp_path / "run" / "trajectories")})
    events = EventLog(tmp_path / "run" / "events")
    for i, gid in enumerate([*gids, "g999999"]):  # the last was admitted and never recorded
        events.emit("admit", index=i, group_id=gid, task_id="t")
    events.close()
    out = _render([str(tmp_path / "run")])
    assert f"accounting: {len(gids) + 1} groups admitted" in out
    assert "1 violations" in out
    assert "g999999: unaccounted for" in out


def test_transcript_shows_roles_tools_reward_and_versions(tmp_path: Path) -> None:
    write_synthetic_log(tmp_path, steps=1, seed=6)
    record = next(r for r in episode_records(tmp_path) if r.episode.error is not None)
    out = _render([str(tmp_path), "--episode", record.episode.id])
    seg0, seg1 = record.episode.segments
    for seg in (seg0, seg1):
        v = seg.policy_version
        stamp = f"v{v.start}" if v.start == v.end else f"v{v.start}→v{v.end}"
        assert re.search(rf"turn {seg.turn} · {stamp} · {seg.endpoint}", out)
    assert "What is 2+3?" in out
    assert 'add({"a": 2, "b": 3})' in out
    assert "tool result · call_0" in out
    assert re.search(rf"reward +{record.episode.reward:g} \(correct=", out)
    assert "error in tool: ValueError: x" in out
    assert f"{record.decision.decision} at trainer v{record.trainer_version}" in out


def test_transcript_shows_the_overlong_handling(tmp_path: Path) -> None:
    """An episode the soft penalty changed shows the reward it was trained on; a masked one says
    it carried no loss; the others say nothing of it."""
    group, decision = make_group(random.Random(1), 0, 0, size=3)
    eps = group.episodes
    eps[0] = eps[0].model_copy(update={"overlong_penalty": -0.25})
    eps[1] = eps[1].model_copy(update={"overlong_masked": True})
    tlog = TrajectoryLog(tmp_path)
    tlog.write_group(group, decision, trainer_version=0)
    tlog.close()
    out = _render([str(tmp_path), "--episode", eps[0].id])
    assert f"penalty -0.25: trained on reward {eps[0].reward - 0.25:g}" in out
    assert "no loss (staleness.overlong = mask)" in _render([str(tmp_path), "--episode", eps[1].id])
    assert "overlong" not in _render([str(tmp_path), "--episode", eps[2].id])


def test_unknown_episode_and_missing_log_are_user_errors(tmp_path: Path) -> None:
    write_synthetic_log(tmp_path, steps=1)
    with pytest.raises(TrajlogError, match="no episode 'nope'"):
        _render([str(tmp_path), "--episode", "nope"])
    with pytest.raises(TrajlogError, match="no such trajectory log"):
        _render([str(tmp_path / "absent")])
