"""``orchestrate --config configs/guess.toml --model.path M`` on a tiny model built with each
family's test template (``examples/chat_templates/``): the run finishes, its episodes are
multi-turn, none is an ``env_error``, and every logged sequence holds each call's sampled tokens
where its loss mask says. ``configs/retrieval.toml`` (an environment with tools) starts and runs
on the templates whose tool calls have rules of their own: Mistral's ids, gpt-oss's harmony
calls (issue #42: both exited 2 at start-up)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator.record.frames import read_log
from tests.support.models import model_copy
from tests.support.processes import orchestrate_cmd

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen3_like", "llama3_like", "mistral_like", "r1_like", "gptoss_like")


@pytest.mark.parametrize("family", FAMILIES)
def test_guess_runs_on_each_familys_template(tmp_path: Path, family: str) -> None:
    template = ROOT / "examples" / "chat_templates" / f"{family}.jinja"
    model = model_copy("tiny", tmp_path / "model", chat_template=template)
    cmd = orchestrate_cmd(tmp_path, model, "--trainer.max_steps", "1", config="configs/guess.toml")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps:     1" in proc.stdout

    records = [r for r in read_log(tmp_path / "guess" / "trajectories") if r["type"] == "episode"]
    assert records
    assert not [
        r["episode"]["error"] for r in records if r["episode"]["stop_reason"] == "env_error"
    ]
    assert max(len(r["episode"]["segments"]) for r in records) >= 2  # multi-turn
    for r in records:
        ids, mask = r["episode"]["token_ids"], r["loss_mask"]
        assert len(mask) == len(ids)
        sampled = 0
        for seg in r["episode"]["segments"]:
            at, n = seg["prompt_len"], len(seg["token_ids"])
            assert ids[at : at + n] == seg["token_ids"]
            assert mask[at : at + n] == [1] * n
            sampled += n
        assert sum(mask) == sampled


@pytest.mark.parametrize("family", ["mistral_like", "gptoss_like"])
def test_retrieval_runs_on_templates_with_their_own_call_rules(tmp_path: Path, family: str) -> None:
    template = ROOT / "examples" / "chat_templates" / f"{family}.jinja"
    model = model_copy("tiny", tmp_path / "model", chat_template=template)
    extra = ("--trainer.max_steps", "1")
    cmd = orchestrate_cmd(tmp_path, model, *extra, config="configs/retrieval.toml")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps:     1" in proc.stdout
    records = [
        r["episode"]
        for r in read_log(tmp_path / "retrieval" / "trajectories")
        if r["type"] == "episode"
    ]
    assert records
    assert not [r["error"] for r in records if r["stop_reason"].endswith("_error")]
