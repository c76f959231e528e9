"""``orchestrate bench sparsity``: every served view under every scale policy, on the same steps,
for AdamW and Muon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from orchestrator.bench import optimizer_steps, sparsity


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


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    muon, adamw = optimizer_steps.optimizers(model, "muon", lr=1e-6)
    assert isinstance(muon, torch.optim.Muon)
    assert isinstance(adamw, torch.optim.AdamW)
    hidden = [p for g in muon.param_groups for p in g["params"]]
    rest = [p for g in adamw.param_groups for p in g["params"]]
    assert all(p.ndim == 2 for p in hidden)
    embed = model.get_input_embeddings().weight
    assert all(p is not embed for p in hidden)
    assert any(p is embed for p in rest)
    assert any(p.ndim == 1 for p in rest)
    assert {id(p) for p in hidden} | {id(p) for p in rest} == {id(p) for p in model.parameters()}
    assert muon.param_groups[0]["lr"] == optimizer_steps.MUON_LR
    assert adamw.param_groups[0]["lr"] == 1e-6


@pytest.mark.slow
def test_both_optimizers_are_reported_on_the_same_steps(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(tiny_model_dir), "--steps", "2", "--ks", "1", "--lr", "1e-6"]
    args += ["--optimizer", "adamw,muon", "--scale-policies", "pow2", "--json"]
    assert sparsity.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["optimizers"] == ["adamw", "muon"]
    assert (report["muon_lr"], report["muon_adjust_lr"]) == (0.02, "original")
    rows = report["rows"]
    for optimizer in ("adamw", "muon"):
        mine = [r for r in rows if r["optimizer"] == optimizer]
        assert {(r["view"], r["step"]) for r in mine} == {
            (v, s) for v in sparsity.VIEWS for s in (1, 2)
        }

    def bf16(optimizer: str) -> float:
        (s,) = [s for s in report["summary"] if (s["optimizer"], s["view"]) == (optimizer, "bf16")]
        return float(s["mean_changed_fraction"])

    # Muon's orthogonalised steps at lr 0.02 are far above half a bf16 ulp; AdamW's at 1e-6 are not
    assert bf16("muon") > 4 * bf16("adamw")


def test_an_unknown_optimizer_is_named(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        sparsity.main(["--model", str(tiny_model_dir), "--optimizer", "adamw,lion"])
    assert exit_.value.code == 2
    assert "--optimizer: 'lion' is not one of adamw, muon" in capsys.readouterr().err
