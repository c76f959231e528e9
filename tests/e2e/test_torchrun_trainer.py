"""examples/torchrun_trainer.py, two gloo ranks on CPU (FSDP2 + the batch feed + the sharded
publisher), trains a real run of ``orchestrate`` for two steps, with one and two optimizer steps
per batch; killed mid-run together with the orchestrator, both restart (``--checkpoint-dir``,
``run.resume``) and every batch is trained exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import IO

import psutil
import pytest

from orchestrator.offline.resimulate import resimulate
from orchestrator.record.accounting import account
from orchestrator.record.events import read_events
from orchestrator.record.trajlog import batch_records
from policies.board import BoardReader
from policies.serve.backends.base import free_port
from tests.support.processes import orchestrate_cmd
from tests.support.waiting import until_sync

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torchrun_trainer.py"
STEPS = 2
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _trainer_cmd(tmp_path: Path, model_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(EXAMPLE), "--model", str(model_dir),
        "--board", str(tmp_path / "board"), "--run-name", "demo",
        "--run-dir", str(tmp_path / "demo"), "--steps", str(steps), *extra,
    ]  # fmt: skip


def _feed_args(tmp_path: Path, steps: int) -> list[str]:
    return [
        "--trainer.mode", "feed", "--trainer.max_steps", str(steps),
        "--board.url", str(tmp_path / "board"), "--fleet.local_engines", "1",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("minibatches", [1, 2])
def test_the_torchrun_example_trains_a_run_over_the_feed(
    tmp_path: Path, tiny_model_dir: Path, minibatches: int
) -> None:
    with contextlib.ExitStack() as stack:
        orch_log = stack.enter_context((tmp_path / "orch.log").open("w"))
        trainer_log = stack.enter_context((tmp_path / "trainer.log").open("w"))
        orch = subprocess.Popen(
            orchestrate_cmd(tmp_path, tiny_model_dir, *_feed_args(tmp_path, STEPS)),
            stdout=subprocess.PIPE,
            stderr=orch_log,
            text=True,
        )
        trainer = subprocess.Popen(
            _trainer_cmd(tmp_path, tiny_model_dir, STEPS, "--minibatches", str(minibatches)),
            env=ENV,
            stdout=trainer_log,
            stderr=trainer_log,
        )
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
    reader = BoardReader(str(tmp_path / "board"), "demo")
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


def _lines(path: Path, event: str, key: str = "event") -> list[dict[str, object]]:
    """The JSON records of ``path`` whose ``key`` is ``event`` (other output is skipped). A
    record may follow another process's text on its line: the ranks share the file, and one's
    line can land before the other's newline."""
    found = []
    decoder = json.JSONDecoder()
    for line in path.read_text().splitlines():
        at = line.find('{"')
        while at >= 0:
            try:
                record, end = decoder.raw_decode(line, at)
            except ValueError:
                end = at + 1
            else:
                if isinstance(record, dict) and record.get(key) == event:
                    found.append(record)
            at = line.find('{"', end)
    return found


def _wait_for(proc: subprocess.Popen[str], path: Path, event: str, **fields: object) -> None:
    """Until ``proc`` wrote a JSON line of ``event`` with ``fields`` into ``path``."""

    def written() -> bool:
        assert proc.poll() is None, path.read_text()[-3000:]
        return any(fields.items() <= r.items() for r in _lines(path, event))

    until_sync(written, f"{event} {fields} in {path.name}", timeout_s=300, every_s=0.05)


def _tree(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """``proc`` and every process under it: torchrun starts its ranks in sessions of their own,
    so a signal to the agent (or its process group) does not reach them."""
    try:
        return [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_tree(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    for p in _tree(proc):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    tree = _tree(proc)
    _signal_tree(proc, signal.SIGKILL)
    psutil.wait_procs(tree, timeout=60)
    proc.wait(timeout=60)


@pytest.mark.slow
def test_the_orchestrator_and_the_torchrun_trainer_killed_mid_run_resume_exactly_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The orchestrator dies while the trainer steps on batch 1 and batch 2 waits on the feed
    (``max_batches = 2``); the trainer publishes version 2, cannot acknowledge, and is killed
    too. Restarted, the orchestrator finds the board one step past its last batch record (rebuilt
    from the log), forms batch 2 again from the log and offers it; the trainer resumes from its
    checkpoint at version 2 and takes it."""
    steps = 3
    run = [*_feed_args(tmp_path, steps), "--trainer.feed.max_batches", "2"]
    trainer = _trainer_cmd(tmp_path, tiny_model_dir, steps, "--checkpoint-dir", str(tmp_path / "c"))
    logs = [tmp_path / f"{name}.log" for name in ("orch-1", "orch-2", "trainer-1", "trainer-2")]
    procs: list[subprocess.Popen[str]] = []

    def start(cmd: list[str], log: IO[str], **kw: object) -> subprocess.Popen[str]:
        proc = subprocess.Popen(cmd, stderr=log, text=True, **kw)  # type: ignore[call-overload]
        procs.append(proc)
        return proc

    with contextlib.ExitStack() as stack:
        o1, o2, t1, t2 = (stack.enter_context(p.open("w")) for p in logs)
        orch = start(orchestrate_cmd(tmp_path, tiny_model_dir, *run), o1, stdout=subprocess.DEVNULL)
        first = start(trainer, t1, stdout=t1, env=ENV)
        try:
            _wait_for(first, logs[2], "batch_received", version=1)  # in the trainer's hands
            _signal_tree(first, signal.SIGSTOP)  # its step waits until batch 2 is on the feed
            _wait_for(orch, logs[0], "feed_offered", version=2)
            orch.kill()  # its engines go with it
            orch.wait(timeout=60)
            _signal_tree(first, signal.SIGCONT)
            _wait_for(first, logs[2], "trainer_step", version=2)  # published; cannot ack
            _kill_tree(first)
            again = start(
                orchestrate_cmd(tmp_path, tiny_model_dir, *run, "--run.resume", "true"),
                o2,
                stdout=subprocess.PIPE,
            )
            second = start(trainer, t2, stdout=t2, env=ENV)
            out, _ = again.communicate(timeout=600)
            assert again.returncode == 0, logs[1].read_text()[-3000:]
            assert second.wait(timeout=120) == 0, logs[3].read_text()[-3000:]
        finally:
            for p in procs:
                _kill_tree(p)
    assert f"steps:     {steps}" in out  # the whole run's
    assert BoardReader(str(tmp_path / "board"), "demo").versions() == list(range(steps + 1))
    batches = {b.produced_version: b for b in batch_records(tmp_path / "demo" / "trajectories")}
    assert sorted(batches) == list(range(1, steps + 1))  # one record per version
    assert batches[2].metrics.get("reconstructed") == 1.0  # acknowledged by the board alone
    assert all("loss" in batches[v].metrics for v in (1, 3))  # the acks'
    acc = account(tmp_path / "demo")
    assert acc.ok, acc.problems
    events = read_events(tmp_path / "demo")
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert [(e["trainer_version"], e["reconstructed"]) for e in resumed] == [(2, 2)]
    assert resumed[0]["restored"] == batches[3].groups  # batch 2, formed again from the log
    # admissions and staleness decisions (made ahead of the trainer) re-simulate exactly
    resim = resimulate(events, trajectories=tmp_path / "demo" / "trajectories")
    assert resim.ok, resim.mismatches
    assert _lines(logs[3], "trainer_resumed") == [{"event": "trainer_resumed", "version": 2}]
    # each version trained once, by one trainer or the other, on exactly its batch's groups
    steps_logged = [s for log in logs[2:] for s in _lines(log, "trainer_step")]
    assert Counter(s["version"] for s in steps_logged) == Counter(range(1, steps + 1))
    for s in steps_logged:
        assert s["groups"] == sorted(batches[int(str(s["version"]))].groups), s
    # batch 2 was delivered once, by the restarted feed; batch 1 never again after the kill
    delivered = [int(str(e["version"])) for e in _lines(logs[1], "feed_delivered")]
    assert delivered == [2], delivered
