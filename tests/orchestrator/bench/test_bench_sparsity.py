"""``orchestrate bench sparsity``: every served view under every scale policy, on the same steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.bench import sparsity


@pytest.mark.slow
def test_every_view_and_scale_policy_is_reported_on_the_same_steps(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(tiny_model_dir), "--steps", "2", "--ks", "1", "--lr", "1e-5"]
    assert sparsity.main([*args, "--anchor-every", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    pairs = {(r["view"], r["scale_policy"]) for r in rows}
    assert pairs == {("bf16", "fresh")} | {
        (v, p) for v in ("fp8_block", "int4_group", "nvfp4") for p in sparsity.POLICIES
    }
    assert all(
        {r["step"] for r in rows if (r["view"], r["scale_policy"]) == p} == {1, 2} for p in pairs
    )
    for r in rows:
        assert 0 < r["changed_fraction"] < 0.5
        assert 0 < r["patch_bytes"] < r["full_bytes"]

    def scales(view: str, policy: str, step: int) -> float:
        return next(
            float(r["changed_scales"])
            for r in rows
            if (r["view"], r["scale_policy"], r["step"]) == (view, policy, step)
        )

    assert scales("bf16", "fresh", 1) == 0.0  # no scales
    assert scales("fp8_block", "fresh", 1) == 1.0  # fp32 scales of moving amaxes: all change
    assert scales("fp8_block", "pow2", 1) < 0.5
    assert scales("fp8_block", "fixed_between_anchors", 1) == 0.0
    assert scales("fp8_block", "fixed_between_anchors", 2) == 1.0  # step 2 is an anchor
    summary = {(s["view"], s["scale_policy"]) for s in report["summary"]}
    assert summary == pairs
    assert report["anchor_every"] == 2


def test_an_unknown_scale_policy_is_named(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        sparsity.main(["--model", str(tiny_model_dir), "--scale-policies", "pow2,pow3"])
    assert exit_.value.code == 2
    assert "--scale-policies: 'pow3' is not one of" in capsys.readouterr().err
