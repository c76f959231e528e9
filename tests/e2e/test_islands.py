"""configs/islands.toml end to end: one reference engine, one vLLM island and one llama.cpp
island serve one run; every version an endpoint served was activated there, and no process is
left behind.

Marked slow: it uses the cached engine builds (``scripts/build-vllm-env.sh``,
``scripts/build-llama-server.sh``; built first when missing) and ``runs/models/small`` (built
once when missing, minutes on 2 cores); vLLM's start-up (≈ 40 s on 2 cores) dominates the run.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from orchestrator.record.frames import read_log
from tests.support.models import model_copy
from tests.support.processes import orchestrate_cmd

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ENDPOINTS = {"engine-0", "vllm-0", "llamacpp-0"}
STOP_WITHIN_S = 600  # ``stop_when`` is given this long (vLLM's start-up included)


@pytest.fixture(scope="session")
def small_model_dir() -> Path:
    """``runs/models/small`` (what the config names), copied from the cache if it is missing."""
    path = ROOT / "runs" / "models" / "small"
    if not (path / "config.json").exists():
        model_copy("small", path)
    return path


def _activated(log: Path) -> set[int]:
    versions = set()
    for line in log.read_text().splitlines():
        if '"version_activated"' in line:
            versions.add(int(json.loads(line)["version"]))
    return versions


def _patched_everywhere(run_dir: Path) -> bool:
    """Every endpoint has activated a version after 0 (which it can only get as a patch)."""
    logs = [run_dir / "logs" / f"{endpoint}.log" for endpoint in ENDPOINTS]
    return all(log.exists() and max(_activated(log), default=0) >= 1 for log in logs)


def _served_everywhere(run_dir: Path) -> bool:
    """Every endpoint has answered a call, as the run's admin API (``GET /v1/fleet``) counts
    them: vLLM may be patched seconds after its start, before any call of its own finished."""
    try:
        admin = json.loads((run_dir / "admin.json").read_text())
        req = urllib.request.Request(
            f"{admin['url']}/v1/fleet", headers={"Authorization": f"Bearer {admin['token']}"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            fleet = json.load(resp)["endpoints"]
    except (OSError, ValueError, KeyError):  # not up yet, or going
        return False
    return {e["id"] for e in fleet if e["served"]} >= ENDPOINTS


def _run(
    tmp_path: Path,
    model: Path,
    *extra: str,
    kill_when: str | None = None,
    stop_when: Callable[[], bool] | None = None,
) -> tuple[subprocess.Popen[bytes], dict[int, psutil.Process], str]:
    """Run configs/islands.toml to the end, SIGTERM it once ``stop_when()`` holds, or SIGKILL it
    once ``kill_when`` has been logged as often as there are islands; every descendant it ever
    had, engines' own children included, and their command lines."""
    cmd = orchestrate_cmd(tmp_path, model, *extra, config="configs/islands.toml")
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + STOP_WITHIN_S
    cmdlines: list[str] = []
    with (tmp_path / "stdout").open("w") as o, (tmp_path / "stderr").open("w") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=ROOT)
        me = psutil.Process(proc.pid)
        while True:
            try:
                for child in me.children(recursive=True):
                    if child.pid not in seen:
                        seen[child.pid] = child
                        cmdlines.append(" ".join(child.cmdline()))
            except psutil.NoSuchProcess:
                pass
            if kill_when and (tmp_path / "stderr").read_text().count(kill_when) == 2:
                proc.kill()
            if stop_when is not None and (stop_when() or time.monotonic() > deadline):
                proc.terminate()  # past the deadline the test's checks say what is missing
                stop_when = None
            try:
                proc.wait(timeout=1)
                return proc, seen, "\n".join(cmdlines)
            except subprocess.TimeoutExpired:
                continue


def _summary_calls(stdout: str, endpoint: str) -> int:
    """The calls the summary says ``endpoint`` served, in either of its forms: ``v0×3, v1×5``
    or, past six versions, ``12 calls on 7 versions, v0–v6``."""
    line = re.search(rf"^{re.escape(endpoint)}: (.*)$", stdout, re.MULTILINE)
    assert line is not None, stdout
    text = line.group(1)
    total = re.fullmatch(r"(\d+) calls on \d+ versions, v\d+–v\d+", text)
    if total is not None:
        return int(total.group(1))
    return sum(int(n) for n in re.findall(r"v\d+×(\d+)", text))


def _left_behind(seen: dict[int, psutil.Process], within_s: float) -> list[str]:
    _, alive = psutil.wait_procs(list(seen.values()), timeout=within_s)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(p.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return left


def test_one_run_on_reference_vllm_and_llamacpp(tmp_path: Path, small_model_dir: Path) -> None:
    """The run goes on until every island has activated a patch and answered a call (how soon
    depends on the machine's load: vLLM starts in about a minute, llama.cpp's sidecar prewarms a
    second llama-server per version), then stops on SIGTERM as a user's Ctrl-C would."""
    run_dir = tmp_path / "islands"
    proc, seen, cmdlines = _run(
        tmp_path,
        small_model_dir,
        "--trainer.max_steps", "1000",
        stop_when=lambda: _patched_everywhere(run_dir) and _served_everywhere(run_dir),
    )  # fmt: skip
    err, out = tmp_path / "stderr", tmp_path / "stdout"
    assert proc.returncode == 130, err.read_text()[-3000:]  # interrupted, shut down cleanly
    stdout = out.read_text()
    assert "status:    interrupted" in stdout

    for name in ("orchestrator.cli serve", "orchestrator.fleet.guard", "vllm.entrypoints"):
        assert name in cmdlines
    assert "llama-server" in cmdlines
    assert not _left_behind(seen, within_s=0)

    records = read_log(run_dir / "trajectories")
    segments = [s for r in records if r["type"] == "episode" for s in r["episode"]["segments"]]
    served: dict[str, set[int]] = {}
    for seg in segments:
        stamp = seg["policy_version"]
        served.setdefault(seg["endpoint"], set()).update({stamp["start"], stamp["end"]})
    assert set(served) == ENDPOINTS
    for endpoint, versions in served.items():
        activated = _activated(run_dir / "logs" / f"{endpoint}.log")
        assert versions <= activated, (endpoint, versions, activated)
        assert max(activated) >= 1, (endpoint, activated)  # later versions came as patches
        assert _summary_calls(stdout, endpoint) > 0, stdout


def test_killed_orchestrator_leaves_no_island_behind(tmp_path: Path, small_model_dir: Path) -> None:
    """SIGKILL: nothing stops the children but their closed stdin (sidecars, vLLM's guard)."""
    proc, seen, cmdlines = _run(
        tmp_path, small_model_dir, "--trainer.max_steps", "1000", kill_when='"island_started"'
    )
    assert proc.returncode == -9, (tmp_path / "stderr").read_text()[-3000:]
    assert "vllm.entrypoints" in cmdlines
    assert "llama-server" in cmdlines
    assert not _left_behind(seen, within_s=60)
