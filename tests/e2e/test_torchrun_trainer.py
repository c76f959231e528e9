"""examples/torchrun_trainer.py, two gloo ranks on CPU (FSDP2 + the batch feed + the sharded
publisher), trains a real run of ``orchestrate`` for two steps."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.record.accounting import account
from orchestrator.record.trajlog import batch_records
from policies.board import BoardReader
from policies.serve.backends.base import free_port
from tests.support.processes import orchestrate_cmd
from tests.support.waiting import until_sync

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torchrun_trainer.py"
STEPS = 2


@pytest.mark.slow
def test_the_torchrun_example_trains_a_run_over_the_feed(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    board = tmp_path / "board"
    shared = [
        "--trainer.mode",
        "feed",
        "--trainer.max_steps",
        str(STEPS),
        "--board.url",
        str(board),
    ]
    trainer_cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(EXAMPLE), "--model", str(tiny_model_dir),
        "--board", str(board), "--run-name", "demo", "--run-dir", str(tmp_path / "demo"),
        "--steps", str(STEPS),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as stack:
        orch_log = stack.enter_context((tmp_path / "orch.log").open("w"))
        trainer_log = stack.enter_context((tmp_path / "trainer.log").open("w"))
        orch = subprocess.Popen(
            orchestrate_cmd(tmp_path, tiny_model_dir, *shared, "--fleet.local_engines", "1"),
            stdout=subprocess.PIPE,
            stderr=orch_log,
            text=True,
        )
        trainer = subprocess.Popen(trainer_cmd, env=env, stdout=trainer_log, stderr=trainer_log)
        try:

            def orchestrator_done() -> bool:  # fails fast if the trainer dies
                assert trainer.poll() in (None, 0), (tmp_path / "trainer.log").read_text()[-3000:]
                return orch.poll() is not None

            until_sync(orchestrator_done, "the orchestrator's end", timeout_s=600, every_s=0.5)
            out, _ = orch.communicate(timeout=1)
            assert orch.returncode == 0, (tmp_path / "orch.log").read_text()[-3000:]
            assert trainer.wait(timeout=120) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        finally:
            for p in (orch, trainer):
                p.kill()
                p.wait()
    assert f"steps:     {STEPS}" in out
    reader = BoardReader(str(board), "demo")
    assert reader.versions() == list(range(STEPS + 1))
    assert all(len(reader.manifest(v).shards) == 2 for v in reader.versions())  # both ranks'
    batches = batch_records(tmp_path / "demo" / "trajectories")
    assert [b.produced_version for b in batches] == list(range(1, STEPS + 1))
    assert all("loss" in b.metrics and "clip_frac" in b.metrics for b in batches)  # the acks'
    acc = account(tmp_path / "demo")
    assert acc.ok, acc.problems
