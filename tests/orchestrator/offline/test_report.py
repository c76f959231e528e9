"""``orchestrate report``: the page renders with every plot; headless Chromium can display it."""

from __future__ import annotations

import base64
import io
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from matplotlib.image import imread

from orchestrator.offline.report import main, render_html, report_data
from orchestrator.record.events import STOPPED_UNTRAINED, EventLog
from orchestrator.record.trajlog import TrajectoryLog
from orchestrator.types import Decision, Group, GroupDecision
from tests.support.events import pool_run
from tests.support.trajectories import make_episode, write_synthetic_log

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir: a trajectory log and a real pool's event log, with trainer versions."""
    root = tmp_path_factory.mktemp("run")
    write_synthetic_log(root / "trajectories", steps=4, seed=21)
    pool_run(root / "events")
    events = EventLog(root / "events")  # a second writer appends a new part
    for v in (1, 2):
        events.emit("trainer_version", version=v)
        events.emit("endpoint", id="a", healthy=True, applied_version=v)
    events.close()
    return root


def test_report_data_matches_the_logs(run_dir: Path) -> None:
    d = report_data(run_dir)
    assert d.run == "synthetic"
    assert d.step_versions == [1, 2, 3, 4]
    assert [t for t, _ in d.step_reward] == sorted(t for t, _ in d.step_reward)
    assert len(d.lag_kept) + len(d.lag_dropped) == d.summary.episodes
    assert all(lag <= 1 for _, lag in d.lag_kept)  # the synthetic policy keeps lag <= 1
    assert max(lag for _, lag in d.lag_dropped) > 1  # dropped by its group's max lag
    assert {"a", "b", "c"} <= set(d.endpoint_versions)
    assert [v for _, v in d.endpoint_versions["a"]][-2:] == [1, 2]
    assert [v for v, _ in d.sync["a"]] == [1, 2]
    assert all(s >= 0 for _, s in d.sync["a"])
    rates = dict(d.step_drop_rate)
    assert set(rates) == {0, 1, 2, 3}
    assert any(r > 0 for r in rates.values())
    assert d.length_bias is not None
    assert (d.length_bias.decided, d.length_bias.dropped) == (
        d.summary.groups,
        d.summary.groups_dropped,
    )


def test_page_is_self_contained_with_every_plot(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    assert main([str(run_dir), "--out", str(out)]) == 0
    page = out.read_text()
    assert "<script" not in page
    assert not re.search(r'(src|href)="(?!data:)', page), "page must not reference other files"
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    assert [t for t, _ in images] == [
        "Reward",
        "Lag over time",
        "Version per endpoint",
        "Sync durations",
        "Drop rate by sampled tokens",
        "Drop rate by turns",
        "Drop rate per step",
    ]
    for _, data in images:
        png = base64.b64decode(data)
        assert png.startswith(PNG)
        pixels = imread(io.BytesIO(png))
        assert pixels.shape[1] == 750
        assert pixels.std() > 0.05, "a blank plot"
    d = report_data(run_dir)
    assert f"{d.summary.groups} ({d.summary.groups_dropped} dropped)" in page
    assert '<h2 id="length-bias">Length bias</h2>' in page


def test_length_bias_section_leaves_out_stop_drops_and_flags_bias(tmp_path: Path) -> None:
    """Long groups dropped 80 % vs short 10 %: the section says so, with the run's thresholds;
    groups the run's stop dropped are not counted."""
    config = {"staleness": {"length_bias": {"min_groups": 10}}}
    tlog = TrajectoryLog(tmp_path / "trajectories", run="biased", config=config)
    rng = random.Random(3)
    plan: list[tuple[int, int, Decision, str]]
    plan = [(i, 1, "kept" if i % 10 else "dropped", "") for i in range(20)]
    plan += [(20 + i, 12, "dropped" if i % 5 < 4 else "kept", "") for i in range(20)]
    plan += [(50 + i, 1, "dropped", STOPPED_UNTRAINED) for i in range(6)]
    requeues = EventLog(tmp_path / "events")
    for index, turns, decision, reason in plan:
        gid = f"g{index:06d}"
        eps = [make_episode(rng, gid, i, 3, turns=turns) for i in range(2)]
        group = Group(id=gid, task_id=f"t{index}", episodes=eps)
        tlog.write_group(
            group, GroupDecision(group_id=gid, decision=decision, max_lag=1, reason=reason)
        )
        if decision == "dropped" and not reason:
            requeues.emit("requeue", group_id=gid, task_id=f"t{index}", depth=1)
    tlog.close()
    requeues.close()
    d = report_data(tmp_path)
    assert d.length_bias is not None
    assert (d.length_bias.decided, d.length_bias.dropped) == (40, 18)
    assert d.length_bias.min_groups == 10
    assert d.length_bias.verdict("turns").biased
    assert d.requeued == 18
    page = render_html(d)
    section = page[page.index('id="length-bias"') : page.index("</table>", page.index("z</th>"))]
    assert "40 groups decided by the staleness policy, 18 dropped" in section
    assert "BIASED" in section
    assert "80.0% of 20" in section
    assert "<th>groups requeued</th><td>18</td>" in page


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(
    _chromium() is None, reason="Chromium is not installed (apt-get install chromium)"
)
def test_chromium_renders_the_page(run_dir: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    assert main([str(run_dir), "--out", str(page)]) == 0
    shot = tmp_path / "shot.png"
    browser = _chromium()
    assert browser is not None
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1280,2400",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pixels = imread(shot)
    assert pixels.shape[:2] == (2400, 1280)
    # the plots are drawn: a rendered page has many non-white pixels, a broken one almost none
    ink = (pixels[..., :3].mean(axis=-1) < 0.9).mean()
    assert ink > 0.02, f"only {ink:.1%} of the page is drawn"
