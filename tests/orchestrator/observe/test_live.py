"""The live view: drawn from real pool state and the same events as the log; TTY only."""

from __future__ import annotations

import io
from pathlib import Path

import anyio
import pytest
import structlog
from rich.console import Console
from rich.live import Live

from orchestrator.observe.live import LiveView, wanted
from orchestrator.record.events import STOPPED_UNFINISHED
from orchestrator.types import Endpoint, EndpointRef
from policies.wire.logs import configure
from staleness.config import LengthBiasConfig
from tests.support.events import pool_run
from tests.support.waiting import until


def test_frame_shows_endpoints_lag_histogram_and_progress(tmp_path: Path) -> None:
    a = Endpoint(ref=EndpointRef(id="engine-a", url="http://a"), applied_version=3, healthy=True)
    b = Endpoint(ref=EndpointRef(id="engine-b", url="http://b"), applied_version=1)
    a.outstanding, a.limit = 2, 4.0
    view = LiveView(max_steps=8)
    view.endpoint(a)
    view.endpoint(b)
    pool_run(tmp_path, also=view)  # real pool events: served calls
    assert view.calls > 0
    view.emit("trainer_version", version=4)
    for lag, decision in [(0, "kept"), (1, "kept"), (1, "kept"), (3, "dropped")]:
        view.emit("decide", group_id="g", trainer_version=4, decision=decision, max_lag=lag)
    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None).print(view.frame())
    text = buf.getvalue()
    assert "trainer v4/8" in text
    assert "groups kept 3, dropped 1" in text
    rows = {ln.split("│")[1].strip(): ln for ln in text.splitlines() if ln.count("│") >= 5}
    assert "v3" in rows["engine-a"]
    assert "2/4" in rows["engine-a"]
    assert "ok" in rows["engine-a"]
    assert "down" in rows["engine-b"]
    bars = [ln for ln in text.splitlines() if "█" in ln and "│" in ln]
    assert [ln.count("█") for ln in bars] == [10, 20, 10]  # lags 0, 1, 3


def test_only_on_a_terminal() -> None:
    assert not wanted(io.StringIO())

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert wanted(Tty())


@pytest.mark.anyio
async def test_run_redraws_until_cancelled() -> None:
    view = LiveView(max_steps=2)
    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=True, color_system=None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(view.run, console, 0.1)
        await until(lambda: buf.getvalue().count("trainer v0/2") >= 2, "a second frame")
        tg.cancel_scope.cancel()


def test_frame_shows_drop_rate_by_tokens_and_turns() -> None:
    view = LiveView(max_steps=8, length_bias=LengthBiasConfig(min_groups=10))
    for i in range(20):
        for tokens, turns, dropped in ((6, 1, i % 10 == 0), (300, 9, i % 5 < 4)):
            view.emit(
                "decide",
                group_id=f"g{i}",
                trainer_version=4,
                decision="dropped" if dropped else "kept",
                max_lag=1,
                reason="",
                max_sampled_tokens=tokens,
                max_turns=turns,
            )
    view.emit(  # the run's stop: not shown in the guard
        "decide",
        group_id="gs",
        trainer_version=4,
        decision="dropped",
        max_lag=0,
        reason=STOPPED_UNFINISHED,
        max_sampled_tokens=6,
        max_turns=1,
    )
    view.emit("requeue", group_id="g1", task_id="t1", depth=1)
    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None).print(view.frame())
    text = buf.getvalue()
    assert "groups kept 22, dropped 19" in text
    assert "requeued 1" in text
    rows = {ln.split("│")[1].strip(): ln for ln in text.splitlines() if ln.count("│") == 4}
    assert "5-8:10%(20)" in rows["tokens"]
    assert "257-512:80%(20)" in rows["tokens"]
    assert "0-1:10%(20)" in rows["turns"]
    assert "80% vs 10%" in rows["turns"]
    assert "BIASED" in rows["turns"]


def test_log_lines_print_above_the_live_view_not_into_it() -> None:
    """(fails when the logger writes to the stderr it saw at configure time: past the live
    region, whose redraws then left stale partial frames behind)"""
    before = structlog.get_config()
    configure(fmt="json")
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80)
    try:
        with Live("first frame", console=console, auto_refresh=False, transient=False) as live:
            structlog.get_logger().info("between_frames")
            live.update("second frame", refresh=True)
    finally:
        structlog.configure(**before)  # the other tests' logging, as it was
    text = out.getvalue()
    assert "between_frames" in text  # through the view's console, which clears its region first
    assert text.index("between_frames") < text.index("second frame")
