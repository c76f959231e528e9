"""examples/torchrun_trainer.py, two gloo ranks on CPU (FSDP2 + the batch feed + the sharded
publisher), trains a real run of ``orchestrate`` for two steps, with one and two optimizer steps
per batch."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.record.accounting import account
from orchestrator.record.trajlog import batch_records
from policies.board import BoardReader
from policies.serve.backends.base import free_port
from tests.support.processes import orchestrate_cmd

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torchrun_trainer.py"
STEPS = 2


@pytest.mark.slow
@pytest.mark.parametrize("minibatches", [1, 2])
def test_the_torchrun_example_trains_a_run_over_the_feed(
    tmp_path: Path, tiny_model_dir: Path, minibatches: int
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
        "--steps", str(STEPS), "--minibatches", str(minibatches),
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
            deadline = time.monotonic() + 600
            while orch.poll() is None and time.monotonic() < deadline:  # fail fast if it dies
                assert trainer.poll() in (None, 0), (tmp_path / "trainer.log").read_text()[-3000:]
                time.sleep(0.5)
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
    # the acks carry the last minibatch's ratios to π_prox: 1 with one step, moved with two
    moved = [b.metrics["ratio_min"] < 1 or b.metrics["ratio_max"] > 1 for b in batches]
    assert moved == [minibatches > 1] * STEPS
    acc = account(tmp_path / "demo")
    assert acc.ok, acc.problems
