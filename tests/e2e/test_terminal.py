"""What a person sees in a real terminal (tmux, 160 × 45): one live view redrawn in place, the log
lines above it, and the summary on the final screen (issue #45)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.support.processes import orchestrate_cmd
from tests.support.waiting import until_sync

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("tmux") is None,
        reason="tmux is not installed (scripts/install-system-deps.sh installs it)",
    ),
]

HEADER = re.compile(r"^trainer v\d+/\d+ ·")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
DONE = "__run_ended__"


def _pane(session: str, *, history: bool = False) -> list[str]:
    args = ["tmux", "capture-pane", "-p", "-t", session, *(["-S", "-"] if history else [])]
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout.splitlines()


def _inside_the_view(lines: list[str]) -> list[str]:
    """Log lines between the view's header and its last table's bottom border."""
    heads = [i for i, ln in enumerate(lines) if HEADER.match(ln)]
    if not heads:
        return []
    ends = [i for i, ln in enumerate(lines) if i > heads[0] and ln.startswith("└")]
    end = ends[-1] if ends else len(lines)
    return [ln for ln in lines[heads[0] : end] if LOG_LINE.match(ln)]


def test_a_run_in_a_real_terminal_shows_one_clean_view_that_becomes_the_summary(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """(the view left a trail: every redraw's first lines stayed behind, and log lines landed
    inside it, since the logs bypassed the console the view owns)"""
    cmd = orchestrate_cmd(tmp_path, tiny_model_dir, "--trainer.max_steps", "6")
    at = cmd.index("--log-format")
    del cmd[at : at + 2]  # a terminal's own format: pretty
    shell = f"cd {shlex.quote(str(Path.cwd()))} && {shlex.join(cmd)}; echo {DONE}; sleep 600"
    session = f"sprawl-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "45", shell], check=True
    )
    seen_view = False

    def done() -> bool:
        """Whether the run is done; every screen on the way is checked (a sample every 0.3 s)."""
        nonlocal seen_view
        screen = _pane(session)
        headers = [ln for ln in screen if HEADER.match(ln)]
        assert len(headers) <= 1, "\n".join(screen)  # a stale frame's header
        assert _inside_the_view(screen) == [], "\n".join(screen)
        seen_view = seen_view or bool(headers)
        return any(DONE in ln for ln in screen)

    try:
        until_sync(done, "the run's end in the terminal", timeout_s=600, every_s=0.3)
        final = _pane(session)
        everything = _pane(session, history=True)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    assert seen_view, "the live view never showed"
    assert any(ln.startswith("run dir:") for ln in final), "\n".join(final)
    assert any(ln.startswith("steps:     6") for ln in final), "\n".join(final)
    assert sum(bool(HEADER.match(ln)) for ln in everything) <= 1, "\n".join(everything)
    assert _inside_the_view(everything) == [], "\n".join(everything)
