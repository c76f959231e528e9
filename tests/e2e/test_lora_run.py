"""A run with ``trainer.lora`` set, end to end: the trainer publishes adapters, the local reference
engine (or the run's own vLLM island) serves them beside its untouched base weights, and every
model call is stamped.

The vLLM island's test uses the cached engine build (``scripts/build-vllm-env.sh``, built first
when missing) and the tiny model's head-dim-32 variant (vLLM's CPU attention needs ≥ 32)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.record.accounting import account
from orchestrator.record.frames import read_log
from policies.board import Board
from policies.serve.adapters import is_adapter_view
from tests.support.processes import LOOP, orchestrate_cmd
from tests.support.vllm import head_dim_32

pytestmark = pytest.mark.slow


def test_a_lora_run_publishes_adapters_and_serves_them(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    args = ["--trainer.lora.rank", "4", "--trainer.max_steps", "2", "--fleet.local_engines", "1"]
    proc = subprocess.run(
        orchestrate_cmd(tmp_path, tiny_model_dir, *args, "--fleet.max_adapters", "2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps:     2" in proc.stdout

    board = Board(str(tmp_path / "demo" / "board"), "demo")
    assert board.versions() == [0, 1, 2]
    for version in board.versions():
        assert is_adapter_view(board.manifest(version).tensors)

    records = read_log(tmp_path / "demo" / "trajectories")
    segments = [s for r in records if r["type"] == "episode" for s in r["episode"]["segments"]]
    assert segments
    assert {s["policy_version"]["start"] for s in segments} <= set(board.versions())
    for seg in segments:  # an adapter never changes under a running call
        assert seg["policy_version"]["start"] == seg["policy_version"]["end"]

    engine_log = (tmp_path / "demo" / "logs" / "engine-0.log").read_text().splitlines()
    loaded = [json.loads(line) for line in engine_log if '"adapter_loaded"' in line]
    assert [e["version"] for e in loaded][:2] == [0, 1]
    assert all(len(e["resident"]) <= 2 for e in loaded)  # fleet.max_adapters


def test_a_lora_run_on_a_vllm_island_serves_every_call_at_an_adapter(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = head_dim_32(tiny_model_dir, tmp_path / "model")
    config = tmp_path / "island.toml"
    island = '\n[[fleet.islands]]\nkind = "vllm"\nmax_model_len = 512\n'
    config.write_text(Path(LOOP).read_text() + island)
    args = ["--trainer.lora.rank", "4", "--trainer.max_steps", "2", "--fleet.local_engines", "0"]
    # No lag: the second batch must be sampled at version 1, so the running vLLM has to load
    # that adapter (with lag 1 both batches may come from version 0 before it does).
    args += ["--scheduler.max_lag", "0", "--staleness.drop.max_lag", "0"]
    proc = subprocess.run(
        orchestrate_cmd(tmp_path, model, *args, "--fleet.max_adapters", "2", config=config),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps:     2" in proc.stdout
    run_dir = tmp_path / "demo"
    started = [json.loads(line) for line in proc.stderr.splitlines() if '"vllm_started"' in line]
    assert [e["lora"] for e in started] == [True]
    engine_log = (run_dir / "logs" / "vllm-0-engine.log").read_text()  # vLLM's non-default args
    assert f"'model': '{model}'" in engine_log  # the base model, not a materialized version
    assert "'enable_lora': True, 'max_loras': 2, 'max_lora_rank': 8" in engine_log

    board = Board(str(run_dir / "board"), "demo")
    assert board.versions() == [0, 1, 2]
    assert all(is_adapter_view(board.manifest(v).tensors) for v in board.versions())
    records = read_log(run_dir / "trajectories")
    segments = [s for r in records if r["type"] == "episode" for s in r["episode"]["segments"]]
    assert segments
    for seg in segments:  # every call ran on the island, through one adapter version
        assert seg["endpoint"] == "vllm-0"
        assert seg["policy_version"]["start"] == seg["policy_version"]["end"]
        assert seg["policy_version"]["start"] in board.versions()
    sidecar_log = (run_dir / "logs" / "vllm-0.log").read_text().splitlines()
    activated = {json.loads(line)["version"] for line in sidecar_log if "version_activated" in line}
    assert {s["policy_version"]["start"] for s in segments} <= activated
    assert {0, 1} <= activated  # adapters loaded into the running vLLM
    assert 1 in {s["policy_version"]["start"] for s in segments}  # and served

    acc = account(run_dir)
    assert acc.ok, acc.problems
    counts = acc.counts()
    assert counts["unaccounted"] == counts["duplicated"] == 0
    assert counts["batches"] == 2
