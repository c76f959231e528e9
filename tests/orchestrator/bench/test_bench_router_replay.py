"""``orchestrate bench router-replay``: replay removes routing flips and the mismatch they cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.bench import router_replay


@pytest.mark.slow
def test_replay_makes_the_trainer_route_as_the_engine_and_lowers_the_mismatch(
    tiny_moe_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(tiny_moe_model_dir), "--prompts", "16", "--max-tokens", "24"]
    assert router_replay.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plain, replay = report["without_replay"], report["with_replay"]
    assert plain["routing_mismatch"] > 0  # bf16 engine vs fp32 trainer: near-ties flip
    assert replay["routing_mismatch"] == 0
    assert replay["max_abs_logprob_diff"] < plain["max_abs_logprob_diff"]
    assert replay["mean_abs_logprob_diff"] < plain["mean_abs_logprob_diff"]
    assert 0 < report["sampled_tokens"] <= 16 * 24
    # 2 layers × top-2 ids of one byte, base64: a few bytes per position
    assert 4 < report["lane_bytes_per_token"] < 40
    assert report["log_bytes_per_token"] > 0


def test_a_dense_model_is_refused(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        router_replay.main(["--model", str(tiny_model_dir), "--prompts", "1"])
    assert exit_.value.code == 2
    assert "trainer.router_replay = true needs a mixture-of-experts model" in (
        capsys.readouterr().err
    )
