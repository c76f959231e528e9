"""``orchestrate experiment lag``: run configs, lag accounting, the verdict, the table and page,
and a reduced run."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from orchestrator.cli import main as cli_main
from orchestrator.config import Config, load_config
from orchestrator.errors import ConfigError
from orchestrator.models import calculator_max_operand
from orchestrator.offline.experiment import RESULT, _fingerprint, _finished, run_lag_experiment
from orchestrator.offline.experiment_arms import (
    ARMS,
    ArmResult,
    Run,
    arm_config,
    check_overrides,
    drift,
    lag_histogram,
    parse_lags,
    pick_arms,
    plan,
)
from orchestrator.offline.experiment_report import render_html
from orchestrator.offline.experiment_verdict import (
    FINAL,
    checks,
    interval95,
    markdown_table,
    table,
    verdict,
)
from orchestrator.record.frames import FrameWriter
from orchestrator.warm_start import sft_phases, warm_model
from policies.errors import ModelBuildError

DEMO = Path("configs/demo.toml")
LOOP = Path("tests/support/loop.toml")  # the small loop most e2e tests run
EXPERIMENT = Path("configs/experiment-lag.toml")


def _demo_run(tmp_path: Path, run: Run, **overrides: object) -> Config:
    """The demo config of ``run`` at seed 3 and 7 steps, its model in ``tmp_path / "model"``."""
    return arm_config(
        DEMO, run, out=tmp_path, model_dir=tmp_path / "model", steps=7, seed=3, overrides=overrides
    )


def test_run_configs_differ_only_in_lag_and_correction(tmp_path: Path) -> None:
    runs = plan(pick_arms("uncorrected,tis,decoupled_ppo,token_mask"), parse_lags("4,2"))
    cfgs = {
        run.name: _demo_run(tmp_path, run, **{"scheduler.group_size": 2, "trainer.minibatches": 2})
        for run in runs
    }
    assert list(cfgs)[:3] == ["on_policy", "lag2_uncorrected", "lag2_tis"]
    assert len(cfgs) == 1 + 2 * 4  # on-policy once, every arm at every lag above 0
    assert cfgs["on_policy"].scheduler.max_lag == 0
    assert cfgs["on_policy"].staleness.correction.type == "none"
    assert [cfg.staleness.correction.type for name, cfg in cfgs.items() if "lag4" in name] == [
        "none",
        "tis",
        "decoupled_ppo",
        "token_mask",
    ]
    for name, cfg in cfgs.items():
        assert cfg.run_dir == tmp_path / "runs" / "s3" / name  # one directory per seed
        assert cfg.scheduler.max_lag == (0 if name == "on_policy" else int(name[3]))
        assert cfg.staleness.drop is None  # demo.toml's drop rule is cleared in every run
        assert (cfg.trainer.max_steps, cfg.run.seed, cfg.scheduler.group_size) == (7, 3, 2)
        assert cfg.trainer.minibatches == 2  # overrides reach every run
        assert cfg.model.path == tmp_path / "model"
        assert cfg.model.init is None
    # the lag-4 runs may keep (1 + 4) batches of episodes in flight
    assert cfgs["lag4_uncorrected"].scheduler.max_concurrent_episodes >= 5 * 2 * 2


def test_the_gspo_arm_averages_over_sequences_and_a_bad_run_is_refused_first(
    tmp_path: Path,
) -> None:
    runs = plan(pick_arms("tis,gspo"), parse_lags("2"))
    cfgs = {run.name: _demo_run(tmp_path, run) for run in runs}
    assert cfgs["lag2_gspo"].staleness.loss_agg == "seq_mean"  # GSPO's mean over sequences
    assert {cfgs[n].staleness.loss_agg for n in ("on_policy", "lag2_tis")} == {"token_mean"}
    # dr_grpo's constant cannot go with the gspo run's seq_mean: refused, naming the run, before
    # the warm start or any run
    with pytest.raises(ConfigError, match=r"run lag2_gspo \(seed 5\): (?s:.*)dr_grpo_tokens"):
        run_lag_experiment(
            DEMO,
            tmp_path / "exp",
            seed=5,
            arms=pick_arms("tis,gspo"),
            lags=(0, 2),
            overrides={"staleness.loss_agg": "dr_grpo", "staleness.dr_grpo_tokens": 40},
        )
    assert not (tmp_path / "exp" / "model").exists()


def test_a_finished_run_is_reused_only_with_the_same_config_and_model(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "sft.json").write_text('{"phases": []}')
    run = plan(pick_arms("tis"), parse_lags("2"))[1]

    def cfg(**overrides: object) -> Config:
        return _demo_run(tmp_path, run, **overrides)

    key = _fingerprint(cfg(), tmp_path / "model")
    cfg().run_dir.mkdir(parents=True)
    assert _finished(cfg(), run, key) is None  # never finished
    done = ArmResult(arm=run.name, label=run.label, rewards=[0.5], seed=3, lag_histogram={1: 4})
    (cfg().run_dir / RESULT).write_text(json.dumps({"fingerprint": key, "result": asdict(done)}))
    assert _finished(cfg(), run, key) == done
    assert _fingerprint(cfg(**{"trainer.lr": 1e-3}), tmp_path / "model") != key
    # an option at its default is code, as a new option is: the finished run still counts
    assert _fingerprint(cfg(**{"trainer.weight_decay": 0.0}), tmp_path / "model") == key
    # two kinds at their defaults still differ: the kind itself is hashed
    kinds = [load_config(None, {"staleness.correction.type": t}) for t in ("tis", "m2po")]
    assert len({_fingerprint(c, tmp_path / "model") for c in kinds}) == 2
    (tmp_path / "model" / "sft.json").write_text('{"phases": [1]}')  # a rebuilt model
    assert _fingerprint(cfg(), tmp_path / "model") != key
    (cfg().run_dir / RESULT).write_text('{"fingerprint": "')  # torn: run again
    assert _finished(cfg(), run, key) is None


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


def test_drift_is_each_runs_mean_mismatch_and_the_verdict_lists_it_per_lag(tmp_path: Path) -> None:
    batches = FrameWriter(tmp_path, "batches")
    metrics = [{"mismatch/kl_k3": 0.01, "mismatch/logp_abs_mean": 0.1}, {"mismatch/kl_k3": 0.03}]
    batches.write([{"type": "batch", "groups": [], "metrics": m} for m in metrics])
    batches.close()
    assert drift(tmp_path) == pytest.approx({"mismatch/kl_k3": 0.02, "mismatch/logp_abs_mean": 0.1})
    results = _sweep()
    for r in results:
        r.drift = {"mismatch/kl_k3": 0.001 * r.lag + 0.001 * r.seed} if r.lag else {}
    lines = verdict(results).splitlines()
    at = lines.index("behaviour μ against π_prox per lag (mean over its runs):")
    assert lines[at + 1 : at + 4] == [
        "  lag 2: mismatch/kl_k3 0.0030",
        "  lag 4: mismatch/kl_k3 0.0050",
        "  lag 8: mismatch/kl_k3 0.0090",
    ]
    assert lines[at + 4].startswith("target, uncorrected")


def _result(name: str, rewards: list[float], seed: int = 0, lag: int = 4) -> ArmResult:
    run = f"lag{lag}_{name}" if name != "on_policy" else name
    return ArmResult(
        arm=run, label=run, rewards=rewards, seed=seed, correction=name, lag=lag * (run != name)
    )


RISING = [0.1, 0.2, 0.3, 0.5, 0.52, 0.48, 0.5, 0.51, 0.49]
FLAT_LOW = [0.1, 0.1, 0.12, 0.1, 0.11, 0.1, 0.09, 0.1, 0.11]


def _sweep() -> list[ArmResult]:
    """3 seeds; tis close to on-policy at lags 4 and 8, token_mask 0.2 below, uncorrected flat
    and low at lag 4 but close at lag 2."""
    results = []
    for seed in range(3):
        shift = 0.01 * seed
        results += [
            _result("on_policy", [r + shift for r in RISING], seed),
            _result("uncorrected", [r + shift for r in RISING], seed, lag=2),
            _result("tis", [r + shift + 0.005 for r in RISING], seed),
            _result("tis", [r + shift - 0.01 for r in RISING], seed, lag=8),
            _result("token_mask", [r + shift - 0.2 for r in RISING], seed),
            _result("uncorrected", FLAT_LOW, seed),
        ]
    return results


def test_verdict_reports_each_run_across_seeds_and_the_targets() -> None:
    results = _sweep()
    text = verdict(results)
    lines = text.splitlines()
    assert lines[0].startswith("on-policy reward, first→second half (mean of 3 seed(s)): 0.285")
    assert lines[0].endswith("(rose beyond 2σ in 3 of 3)")
    assert "95% t-interval over 3 seed(s)" in lines[1]
    # second-half means 0.500 / 0.510 / 0.520 over seeds: 0.510 ± t(0.975, 2)·SE = 4.303·0.00577
    assert lines[2].lstrip().startswith("on_policy")
    assert "0.510 ± 0.025" in lines[2]
    tis = next(line for line in lines if line.lstrip().startswith("lag4_tis"))
    assert "within noise of on-policy; within noise in 3 of 3 seeds" in tis
    mask = next(line for line in lines if line.lstrip().startswith("lag4_token_mask"))
    assert "worse than on-policy" in mask
    assert lines[-2].startswith(
        "target, uncorrected below on-policy beyond 2σ pooled at lag ≥ 4: met (lag 4 Δ -0.408"
    )
    assert lines[-1].startswith(
        "target, best correction (tis) within 2σ pooled of on-policy up to lag 8: met (lag 4 Δ"
    )
    found = checks(results)
    assert [g["lag"] for g in found["uncorrected"]["lags"]] == [4]  # lag 2 is not a target lag
    assert found["best_correction"]["arm"] == "tis"
    assert [g["lag"] for g in found["best_correction"]["lags"]] == [4, 8]


def test_a_target_that_fails_says_not_met() -> None:
    results = [r for r in _sweep() if r.correction in ("on_policy", "token_mask")]
    results += [_result("uncorrected", RISING, seed) for seed in range(3)]
    found = checks(results)
    assert found["uncorrected"]["met"] is False
    assert found["best_correction"]["arm"] == "token_mask"
    assert found["best_correction"]["met"] is False
    last = verdict(results).splitlines()[-1]
    assert last.startswith("target, best correction (token_mask) within 2σ pooled of on-policy")
    assert "up to lag 8: not met (lag 4 Δ -0.200" in last
    assert "uncorrected" not in checks([_result("on_policy", RISING)])


def test_naive_ppo_is_judged_as_uncorrected_not_as_a_correction() -> None:
    """PPO clipped against μ is the other arm without a correction: it gets the uncorrected
    target of its own and is never the best correction, however high it scores."""
    results = [r for r in _sweep() if r.correction in ("on_policy", "token_mask")]
    results += [_result("naive_ppo", FLAT_LOW, seed) for seed in range(3)]
    results += [_result("naive_ppo", [r + 0.3 for r in RISING], seed, lag=8) for seed in range(3)]
    found = checks(results)
    assert "uncorrected" not in found
    assert [(g["lag"], g["worse_beyond_2sigma"]) for g in found["naive_ppo"]["lags"]] == [
        (4, True),
        (8, False),
    ]
    assert found["naive_ppo"]["met"] is False
    assert found["best_correction"]["arm"] == "token_mask"
    lines = verdict(results).splitlines()
    assert lines[-2].startswith("target, naive_ppo below on-policy beyond 2σ pooled at lag ≥ 4:")


def _scored_sweep() -> list[ArmResult]:
    """:func:`_sweep` with final-policy scores of 4 episodes: uncorrected's final policy as good
    as on-policy's (its training reward was low: a stale statistic), tis's at lag 8 and
    token_mask's far below."""
    results = _sweep()
    for r in results:
        low = (r.correction, r.lag) in (("tis", 8), ("token_mask", 4))
        r.final_rewards = [0.2, 0.3, 0.2, 0.3] if low else [0.5, 0.6, 0.5, 0.6]
    return results


def test_the_final_policy_score_is_judged_like_the_second_half_but_apart() -> None:
    results = _scored_sweep()
    assert checks(results)["uncorrected"]["met"] is True  # the statistic: unchanged
    final = checks(results, FINAL)
    assert final["uncorrected"]["met"] is False
    assert final["uncorrected"]["lags"][0]["delta"] == pytest.approx(0.0)
    assert final["best_correction"]["arm"] == "tis"
    assert [(g["lag"], g["within_2sigma"]) for g in final["best_correction"]["lags"]] == [
        (4, True),
        (8, False),
    ]
    lines = verdict(results).splitlines()
    at = lines.index(
        "final-policy reward (fresh episodes of each run's last version), 4 each, mean ± 95% "
        "t-interval over 3 seed(s); Δ against on-policy:"
    )
    assert lines[at - 1].startswith("target, best correction (tis)")  # the targets first
    assert "0.550 ± 0.000" in lines[at + 1]  # on-policy: mean 0.55, the same in every seed
    assert lines[-2].startswith("final policy: target, uncorrected below on-policy")
    assert "not met (lag 4 Δ +0.000" in lines[-2]
    assert lines[-1].startswith("final policy: target, best correction (tis) within 2σ")
    assert "final-policy" not in verdict(_sweep())  # not scored: not stated
    unscored_reference = [r for r in results if r.arm != "on_policy"] + [
        _result("on_policy", RISING, seed) for seed in range(3)
    ]
    assert "final-policy" not in verdict(unscored_reference)
    results[0].final_rewards = []  # seed 0's on-policy run was not scored: two seeds compared
    assert "4 each, mean ± 95% t-interval over 2 seed(s)" in verdict(results)
    header, rows = table(results, FINAL)
    assert header == ["arm", "lag 0 (on-policy)", "lag 2", "lag 4", "lag 8"]
    assert rows[1] == ["tis", "0.550 ± 0.000", "", "0.550 ± 0.000", "0.250 ± 0.000"]


def test_the_table_has_an_arm_per_row_and_a_lag_per_column() -> None:
    header, rows = table(_sweep())
    assert header == ["arm", "lag 0 (on-policy)", "lag 2", "lag 4", "lag 8"]
    assert [row[0] for row in rows] == ["uncorrected", "tis", "token_mask"]
    assert {row[1] for row in rows} == {"0.510 ± 0.025"}  # on-policy, shared by every arm
    assert rows[1][2] == ""  # tis ran at lags 4 and 8, not 2
    assert rows[1][4] != ""
    md = markdown_table(_sweep()).splitlines()
    assert md[0] == "| arm | lag 0 (on-policy) | lag 2 | lag 4 | lag 8 |"
    assert md[1] == "|---|---:|---:|---:|---:|"
    assert md[2] == "| uncorrected | 0.510 ± 0.025 | 0.510 ± 0.025 | 0.102 ± 0.000 |  |"


def test_the_page_holds_the_table_and_both_plots() -> None:
    page = render_html(_sweep(), verdict(_sweep()), "orchestrate experiment lag --lags 0,2,4,8")
    assert "<th>lag 0 (on-policy)</th>" in page
    assert "<td>token_mask</td>" in page
    assert page.count('src="data:image/png;base64,') == 2
    assert "Reward against lag per arm" in page
    assert "orchestrate experiment lag --lags 0,2,4,8" in page
    assert "Final-policy" not in page
    scored = render_html(_scored_sweep(), verdict(_scored_sweep()), "orchestrate experiment lag")
    assert scored.count('src="data:image/png;base64,') == 3
    assert "<h2>Final-policy reward (fresh episodes of each run&#x27;s last version)</h2>" in scored
    assert scored.count("<th>lag 0 (on-policy)</th>") == 2


def test_one_seed_has_no_interval_and_the_verdict_needs_on_policy() -> None:
    assert interval95([0.4]) == (0.4, 0.0)
    mean, half = interval95([0.4, 0.6])
    assert (round(mean, 6), round(half, 3)) == (0.5, 1.271)  # t(0.975, 1) = 12.706, SE 0.1
    with pytest.raises(ValueError, match="on_policy"):
        verdict([_result("uncorrected", FLAT_LOW)])


def test_arms_and_lags_are_parsed_with_on_policy_always_run() -> None:
    assert [a.name for a in pick_arms("m2po, tis,uncorrected")] == ["uncorrected", "tis", "m2po"]
    assert {a.name for a in ARMS} >= {"decoupled_ppo", "token_mask", "cispo", "gspo"}
    with pytest.raises(ConfigError, match="--arms: unknown arm lag4_tis"):
        pick_arms("lag4_tis")  # the old run names are not arms
    with pytest.raises(ConfigError, match="--arms: name at least one arm"):
        pick_arms(" , ")
    assert parse_lags("8,4, 2,1,4") == (0, 1, 2, 4, 8)
    for bad in ("4,-1", "two", "4,,8", "1e9"):
        with pytest.raises(ConfigError, match=r"--lags: .* is not a lag"):
            parse_lags(bad)
    assert [r.name for r in plan(pick_arms("tis"), (0,))] == ["on_policy"]


def test_overrides_of_what_each_run_sets_are_refused() -> None:
    check_overrides({"trainer.minibatches": 4, "staleness.overlong": "mask"})
    for key in ("scheduler.max_lag", "staleness.correction.cap", "staleness.drop"):
        with pytest.raises(ConfigError, match=f"--{key}: the experiment sets"):
            check_overrides({key: 1})


@pytest.mark.slow
@pytest.mark.usefixtures("cli_logging")  # the command configures logging: put it back
def test_experiment_command_runs_at_reduced_size(tmp_path: Path) -> None:
    out = tmp_path / "exp"
    argv = [
        "experiment",
        "lag",
        "--config",
        str(LOOP),
        "--steps",
        "2",
        "--seeds",
        "2",
        "--arms",
        "decoupled_ppo",
        "--lags",
        "4",
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
        "--score-episodes",
        "3",
    ]
    assert cli_main(argv) == 0
    with (out / "rewards.csv").open() as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == [
        "step",
        "on_policy/s0",
        "lag4_decoupled_ppo/s0",
        "on_policy/s1",
        "lag4_decoupled_ppo/s1",
    ]
    assert [r[0] for r in rows[1:]] == ["1", "2"]
    assert (out / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"].startswith("on-policy reward, first→second half")
    assert summary["seeds"] == [0, 1]
    assert summary["lags"] == [0, 4]
    assert [s["arm"] for s in summary["stats"]] == ["on_policy", "lag4_decoupled_ppo"]
    assert summary["checks"]["best_correction"]["arm"] == "decoupled_ppo"
    assert (out / "runs" / "s1" / "lag4_decoupled_ppo" / "trajectories").is_dir()
    tables = (out / "table.md").read_text()
    assert tables.startswith("| arm | lag 0 (on-policy) | lag 4 |\n")
    final = "final-policy reward (fresh episodes of each run's last version)"
    assert f"\n\n{final}:\n\n| arm |" in tables
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 3
    assert summary["score_episodes"] == 3
    assert summary["checks_final"]["best_correction"]["arm"] == "decoupled_ppo"
    assert "\nfinal policy: target, best correction (decoupled_ppo)" in summary["verdict"]
    phases = json.loads((out / "model" / "sft.json").read_text())["phases"]
    assert [(p["steps"], p["max_operand"]) for p in phases] == [(3, 99), (2, 99), (1, 99)]
    assert phases[-1]["after"]["episodes"] == 2
    on_policy = [a for a in summary["arms"] if a["arm"] == "on_policy"]
    assert [set(a["lag_histogram"]) for a in on_policy] == [{"0"}, {"0"}]  # never stale
    for arm in summary["arms"]:
        assert len(arm["rewards"]) == 2
        assert all(0 <= int(lag) <= 4 for lag in arm["lag_histogram"])
        assert set(arm["drift"]) == {"mismatch/kl_k3", "mismatch/logp_abs_mean"}
        assert len(arm["final_rewards"]) == 3  # scored on the last version
        assert all(0 <= r <= 1 for r in arm["final_rewards"])
    assert (
        "\nbehaviour μ against π_prox per lag (mean over its runs):\n  lag 4: "
        in summary["verdict"]
    )

    # run again, as after an interruption: finished runs are reused, the unfinished one runs
    results = sorted((out / "runs").glob("s*/*/experiment-run.json"))
    assert len(results) == 4
    results[-1].unlink()  # s1/on_policy (sorted: lag4_decoupled_ppo first)
    kept = {p: p.stat().st_mtime_ns for p in results[:-1]}
    assert cli_main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in results[:-1]} == kept
    assert results[-1].is_file()
    again = json.loads((out / "summary.json").read_text())
    assert [a for a in again["arms"] if a["seed"] == 0] == [
        a for a in summary["arms"] if a["seed"] == 0
    ]
    assert again["arms"][2]["arm"] == "on_policy"
    assert again["arms"][2]["seed"] == 1


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
