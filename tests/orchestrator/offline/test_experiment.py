"""``orchestrate experiment lag``: arm configs, lag accounting, the verdict, and a reduced run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from orchestrator.cli import main as cli_main
from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.models import calculator_max_operand
from orchestrator.offline.experiment_arms import (
    ARMS,
    ArmResult,
    arm_config,
    lag_histogram,
    pick_arms,
)
from orchestrator.offline.experiment_verdict import checks, interval95, verdict
from orchestrator.record.frames import FrameWriter
from orchestrator.warm_start import sft_phases, warm_model
from policies.errors import ModelBuildError

DEMO = Path("configs/demo.toml")
LOOP = Path("tests/support/loop.toml")  # the small loop most e2e tests run
EXPERIMENT = Path("configs/experiment-lag.toml")


def test_arm_configs_differ_only_in_lag_and_correction(tmp_path: Path) -> None:
    cfgs = {
        arm.name: arm_config(
            DEMO,
            arm,
            out=tmp_path,
            model_dir=tmp_path / "model",
            steps=7,
            seed=3,
            overrides={"scheduler.group_size": 2},
        )
        for arm in ARMS
    }
    assert cfgs["on_policy"].scheduler.max_lag == 0
    lagged = [cfg for name, cfg in cfgs.items() if name != "on_policy"]
    assert {cfg.scheduler.max_lag for cfg in lagged} == {4}
    assert [cfg.staleness.correction.type for cfg in lagged] == [
        "none",
        "tis",
        "decoupled_ppo",
        "token_mask",
    ]
    for name, cfg in cfgs.items():
        assert cfg.run_dir == tmp_path / "runs" / "s3" / name  # one directory per seed
        assert cfg.staleness.drop is None  # demo.toml's drop rule is cleared in every arm
        assert (cfg.trainer.max_steps, cfg.run.seed, cfg.scheduler.group_size) == (7, 3, 2)
        assert cfg.model.path == tmp_path / "model"
        assert cfg.model.init is None
    # the lag arms may keep (1 + 4) batches of episodes in flight
    assert cfgs["lag4_none"].scheduler.max_concurrent_episodes >= 5 * 2 * 2


def test_lag_histogram_counts_model_calls_of_trained_groups(tmp_path: Path) -> None:
    def episode(group: str, starts: list[int]) -> dict[str, object]:
        segs = [{"policy_version": {"start": s, "end": s}} for s in starts]
        return {"type": "episode", "episode": {"group_id": group, "segments": segs}}

    episodes, batches = FrameWriter(tmp_path, "episodes"), FrameWriter(tmp_path, "batches")
    episodes.write(
        [episode("g1", [0, 1]), episode("g1", [1]), episode("g2", [3]), episode("gx", [0])]
    )
    batches.write(
        [
            {"type": "batch", "groups": ["g1"], "trained_at_version": 2},
            {"type": "batch", "groups": ["g2"], "trained_at_version": 3},
        ]
    )
    episodes.close()
    batches.close()
    # g1: lags 2, 1, 1; g2: lag 0; gx was never trained
    assert lag_histogram(tmp_path) == {0: 1, 1: 2, 2: 1}


def _result(name: str, rewards: list[float], seed: int = 0) -> ArmResult:
    return ArmResult(arm=name, label=name, rewards=rewards, seed=seed)


RISING = [0.1, 0.2, 0.3, 0.5, 0.52, 0.48, 0.5, 0.51, 0.49]
FLAT_LOW = [0.1, 0.1, 0.12, 0.1, 0.11, 0.1, 0.09, 0.1, 0.11]


def test_verdict_reports_each_arm_across_seeds_and_the_checks() -> None:
    results = []
    for seed in range(3):
        shift = 0.01 * seed
        results += [
            _result("on_policy", [r + shift for r in RISING], seed),
            _result("lag4_tis", [r + shift + 0.005 for r in RISING], seed),
            _result("lag4_mask", [r + shift - 0.2 for r in RISING], seed),
            _result("lag4_none", FLAT_LOW, seed),
        ]
    text = verdict(results)
    lines = text.splitlines()
    assert lines[0].startswith("on-policy reward, first→second half (mean of 3 seed(s)): 0.285")
    assert lines[0].endswith("(rose beyond 2σ in 3 of 3)")
    # second-half means 0.500 / 0.510 / 0.520 over seeds: 0.510 ± t(0.975, 2)·SE = 4.303·0.00577
    assert "0.510 ± 0.025" in lines[2]
    tis = next(line for line in lines if line.lstrip().startswith("lag4_tis"))
    assert "within noise of on-policy; within noise in 3 of 3 seeds" in tis
    mask = next(line for line in lines if line.lstrip().startswith("lag4_mask"))
    assert "worse than on-policy" in mask
    assert "best correction lag4_tis: not worse than on-policy beyond 2σ in 3 of 3 seeds" in text
    assert lines[-1].startswith("uncorrected vs on-policy, pooled: Δ -0.408")
    assert lines[-1].endswith("(worse beyond 2σ)")
    found = checks(results)
    assert found["best_correction"]["arm"] == "lag4_tis"
    assert found["best_correction"]["not_worse_every_seed"] is True
    assert found["uncorrected"]["worse_beyond_2sigma"] is True


def test_one_seed_has_no_interval_and_the_verdict_needs_on_policy() -> None:
    assert interval95([0.4]) == (0.4, 0.0)
    mean, half = interval95([0.4, 0.6])
    assert (round(mean, 6), round(half, 3)) == (0.5, 1.271)  # t(0.975, 1) = 12.706, SE 0.1
    with pytest.raises(ValueError, match="on_policy"):
        verdict([_result("lag4_none", FLAT_LOW)])


def test_arms_are_picked_by_name_with_on_policy_always_run() -> None:
    assert [a.name for a in pick_arms("lag4_mask, lag4_tis")] == [
        "on_policy",
        "lag4_tis",
        "lag4_mask",
    ]
    assert pick_arms(None) == ARMS
    with pytest.raises(ConfigError, match="--arms: unknown arm lag4_foo"):
        pick_arms("lag4_foo")


@pytest.mark.slow
@pytest.mark.usefixtures("cli_logging")  # the command configures logging: put it back
def test_experiment_command_runs_at_reduced_size(tmp_path: Path) -> None:
    out = tmp_path / "exp"
    code = cli_main(
        [
            "experiment",
            "lag",
            "--config",
            str(LOOP),
            "--steps",
            "2",
            "--seeds",
            "2",
            "--arms",
            "lag4_dppo",
            "--out",
            str(out),
            "--sft-steps",
            "5",
            "--sft-focus-steps",
            "1",
            "--sft-eval",
            "2",
            "--scheduler.group_size",
            "2",
            "--scheduler.groups_per_batch",
            "1",
            "--sampling.max_tokens",
            "16",
            "--environment.max_turns",
            "2",
            "--fleet.local_engines",
            "1",
        ]
    )
    assert code == 0
    with (out / "rewards.csv").open() as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["step", "on_policy/s0", "lag4_dppo/s0", "on_policy/s1", "lag4_dppo/s1"]
    assert [r[0] for r in rows[1:]] == ["1", "2"]
    assert (out / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"].startswith("on-policy reward, first→second half")
    assert summary["seeds"] == [0, 1]
    assert [s["arm"] for s in summary["stats"]] == ["on_policy", "lag4_dppo"]
    assert summary["checks"]["best_correction"]["arm"] == "lag4_dppo"
    assert (out / "runs" / "s1" / "lag4_dppo" / "trajectories").is_dir()
    phases = json.loads((out / "model" / "sft.json").read_text())["phases"]
    assert [(p["steps"], p["max_operand"]) for p in phases] == [(3, 99), (2, 99), (1, 99)]
    assert phases[-1]["after"]["episodes"] == 2
    on_policy = [a for a in summary["arms"] if a["arm"] == "on_policy"]
    assert [set(a["lag_histogram"]) for a in on_policy] == [{"0"}, {"0"}]  # never stale
    for arm in summary["arms"]:
        assert len(arm["rewards"]) == 2
        assert all(0 <= int(lag) <= 4 for lag in arm["lag_histogram"])


def test_flat_rewards_do_not_count_as_a_rise() -> None:
    flat = [0.3, 0.5, 0.2, 0.6, 0.4, 0.3, 0.5, 0.2, 0.6, 0.4]
    assert (
        verdict([_result("on_policy", flat)]).splitlines()[0].endswith("(rose beyond 2σ in 0 of 1)")
    )


def test_sft_curriculum_ends_on_the_runs_difficulty() -> None:
    assert sft_phases(1800, 100, 9) == [(1000, 6e-3, 99), (800, 4e-3, 99), (100, 3e-3, 9)]
    assert sft_phases(0, 0, 9) == []
    assert calculator_max_operand(load_config(EXPERIMENT)) == 9
    assert calculator_max_operand(load_config(DEMO)) == 9
    assert calculator_max_operand(load_config(LOOP)) == 99
    assert calculator_max_operand(load_config(Path("configs/guess.toml"))) is None


def test_a_model_warm_started_otherwise_is_refused_not_reused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "sft.json").write_text(json.dumps({"steps": 1000}))  # the single-phase recipe
    with pytest.raises(ModelBuildError, match=r"of an older recipe, not the warm start .*\[\(1000"):
        warm_model(model, size="tiny", seed=0, phases=sft_phases(1800, 100, 9))


def test_a_model_built_without_warm_start_is_not_fine_tuned_in_place(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ModelBuildError, match="without an SFT warm start"):
        warm_model(model, size="tiny", seed=0, phases=sft_phases(10, 0, 9))
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
