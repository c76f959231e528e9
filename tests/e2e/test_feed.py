"""The batch feed end to end: the orchestrator and ``orchestrate train`` over HTTP, the trainer
SIGKILLed mid-run and restarted; every version produced once, no batch lost or trained twice."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from orchestrator.record.accounting import account
from orchestrator.record.trajlog import batch_records
from policies.board import Board
from tests.support.processes import orchestrate_cmd
from tests.support.waiting import until_sync

STEPS = 4


def _events(path: Path, kind: str) -> list[dict[str, object]]:
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == kind:
                out.append(record)
    return out


def _wait_for(proc: subprocess.Popen[str], path: Path, kind: str, count: int) -> None:
    """Until ``proc`` logged ``count`` events of ``kind`` into ``path``."""

    def logged() -> bool:
        if len(_events(path, kind)) >= count:
            return True
        assert proc.poll() is None, path.read_text()[-3000:]
        return False

    until_sync(logged, f"{count} {kind} in {path}", timeout_s=300, every_s=0.05)


@pytest.mark.slow
def test_a_trainer_on_the_feed_killed_mid_step_resumes_and_trains_each_batch_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    shared = [
        "--trainer.mode",
        "feed",
        "--trainer.max_steps",
        str(STEPS),
        "--board.url",
        str(tmp_path / "board"),
        "--fleet.local_engines",
        "1",
    ]
    logs = [tmp_path / name for name in ("orch.log", "trainer-1.log", "trainer-2.log")]
    with contextlib.ExitStack() as stack:
        orch_log, first_log, second_log = (stack.enter_context(p.open("w")) for p in logs)

        def trainer(log: object) -> subprocess.Popen[str]:
            return subprocess.Popen(
                orchestrate_cmd(tmp_path, tiny_model_dir, *shared, command="train"),
                stdout=subprocess.DEVNULL,
                stderr=log,  # type: ignore[arg-type]
                text=True,
            )

        orch = subprocess.Popen(
            orchestrate_cmd(tmp_path, tiny_model_dir, *shared),
            stdout=subprocess.PIPE,
            stderr=orch_log,
            text=True,
        )
        first = trainer(first_log)
        restarted = None
        try:
            _wait_for(first, logs[1], "batch_received", 2)  # batch 0 trained; batch 1 in its hands
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=60)
            restarted = trainer(second_log)
            out, _ = orch.communicate(timeout=600)
            assert orch.returncode == 0, logs[0].read_text()[-3000:]
            assert restarted.wait(timeout=120) == 0, logs[2].read_text()[-3000:]
        finally:
            for p in (orch, first, restarted):
                if p is not None:
                    p.kill()
                    p.wait()
    assert f"steps:     {STEPS}" in out
    assert _events(logs[2], "trainer_resumed")
    # the feed said where it is, readable by its owner only
    assert (tmp_path / "demo" / "feed.json").stat().st_mode & 0o777 == 0o600
    assert Board(str(tmp_path / "board"), "demo").versions() == list(range(STEPS + 1))
    batches = batch_records(tmp_path / "demo" / "trajectories")
    assert [b.produced_version for b in batches] == list(range(1, STEPS + 1))
    acc = account(tmp_path / "demo")
    assert acc.ok, acc.problems
    # each version was trained once: by the first trainer or by the restarted one, not both
    stepped = Counter(
        int(str(e["version"])) for log in logs[1:] for e in _events(log, "trainer_step")
    )
    assert all(n == 1 for n in stepped.values()), stepped
    assert set(stepped) >= {1, *range(3, STEPS + 1)}
    # batch 1 was in the killed trainer's hands: delivered again (same batch), or, had it
    # published version 2 before the kill, acknowledged by the board's pointer
    delivered = Counter(int(str(e["version"])) for e in _events(logs[0], "feed_delivered"))
    by_board = {int(str(e["version"])) for e in _events(logs[0], "feed_acked_by_board")}
    assert delivered[1] == 2 or 1 in by_board, (delivered, by_board)
    # the steps' metrics came with the acks (the reference trainer's loss), not only reward_mean
    assert all("loss" in b.metrics for b in batches if b.produced_version != 2 or not by_board)
