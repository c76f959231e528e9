"""``orchestrate replay``: what-if staleness policies and deterministic trainer replay."""

from __future__ import annotations

import io
import json
import math
import random
from pathlib import Path

import pytest
import torch
from rich.console import Console

from orchestrator.config import Config
from orchestrator.errors import ConfigError
from orchestrator.loop.batcher import EQUAL_REWARDS
from orchestrator.offline.replay import main, state_digest, train
from orchestrator.offline.what_if import LOGGED, ModelScorer, load_policies, what_if
from orchestrator.record.events import STOPPED_UNFINISHED, STOPPED_UNTRAINED
from orchestrator.record.trajlog import TrajectoryLog, episode_records
from orchestrator.types import Episode, GroupDecision, SamplingParams
from staleness.config import DropRule, StalenessConfig, TruncatedIS
from tests.support.trajectories import make_group, write_synthetic_log

POLICIES = """
[policies.same]
drop = { statistic = "max", max_lag = 1 }

[policies.strict]
drop = { statistic = "max", max_lag = 0 }

[policies.tis]
correction = { type = "tis", cap = 1.5 }

[policies.mis]
correction = { type = "mis", upper = 2.0 }
"""


def test_policy_file_loads_and_names_a_bad_key(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(POLICIES)
    policies = load_policies(path)
    assert list(policies) == ["same", "strict", "tis", "mis"]
    assert policies["tis"].correction == TruncatedIS(cap=1.5)
    path.write_text('[policies.bad]\ncorrection = { type = "tis", cap = -1 }\n')
    with pytest.raises(ConfigError, match=r"policies\.bad\.correction\.tis\.cap"):
        load_policies(path)
    path.write_text("[policies]\n")
    with pytest.raises(ConfigError, match="at least one"):
        load_policies(path)


def test_what_if_reproduces_logged_decisions_and_counts_drops(tmp_path: Path) -> None:
    write_synthetic_log(tmp_path, steps=4, seed=11)
    records = episode_records(tmp_path)
    policies = {
        "same": StalenessConfig(drop=DropRule(max_lag=1)),
        "strict": StalenessConfig(drop=DropRule(max_lag=0)),
        "keep_all": StalenessConfig(),
    }
    out = {o.name: o for o in what_if(records, policies)}
    assert list(out) == [LOGGED, "same", "strict", "keep_all"]
    logged = out[LOGGED]
    assert logged.groups_dropped > 0
    assert (out["same"].groups_kept, out["same"].groups_dropped) == (
        logged.groups_kept,
        logged.groups_dropped,
    )
    lags = {r.decision.group_id: r.decision.max_lag for r in records}
    assert out["strict"].groups_kept == sum(1 for lag in lags.values() if lag == 0)
    assert out["keep_all"].groups_dropped == 0
    assert out["keep_all"].episodes_kept == len(records)
    for o in out.values():
        for axis in ("tokens", "turns"):  # one length-bias count per group, on both axes
            rows = [c for _, c in o.by_length.rows(axis)]
            assert sum(c.decided for c in rows) == len(lags)
            assert sum(c.dropped for c in rows) == o.groups_dropped
        assert o.correction is None  # no π_prox without a scorer
    # the run's lag budget caps every policy, as the run's batcher does
    capped = {o.name: o for o in what_if(records, policies, max_lag=0)}
    assert capped["keep_all"].groups_kept == out["strict"].groups_kept


def test_what_if_keeps_shutdown_drops_and_compares_decided_groups_only(tmp_path: Path) -> None:
    """Groups the run's stop dropped are not re-decided (as kept) by any policy: a policy equal to
    the run's gives the logged drop rate, and the stopped groups are counted apart."""
    write_synthetic_log(tmp_path, steps=3, seed=21)
    decided = episode_records(tmp_path)
    rng = random.Random(5)
    tlog = TrajectoryLog(tmp_path, run="synthetic", append=True)
    for i, reason in enumerate([STOPPED_UNTRAINED] * 3 + [STOPPED_UNFINISHED] * 2):
        group, _ = make_group(rng, 900 + i, 3)
        stop = GroupDecision(group_id=group.id, decision="dropped", reason=reason, max_lag=0)
        tlog.write_group(group, stop, trainer_version=3)
    tlog.close()
    records = episode_records(tmp_path)
    assert len(records) == len(decided) + 5 * 4

    same = StalenessConfig(drop=DropRule(max_lag=1))
    out = {o.name: o for o in what_if(records, {"same": same, "keep_all": StalenessConfig()})}
    logged, again = out[LOGGED], out["same"]
    assert logged.groups_stopped == again.groups_stopped == out["keep_all"].groups_stopped == 5
    assert logged.episodes_stopped == again.episodes_stopped == 20
    assert (again.groups_kept, again.groups_dropped) == (logged.groups_kept, logged.groups_dropped)
    assert again.as_dict()["drop/rate"] == logged.as_dict()["drop/rate"]
    assert logged.as_dict()["groups/stopped"] == 5.0
    # only the decided groups are compared, and no stopped group is counted as kept
    n_decided = len({r.decision.group_id for r in decided})
    for o in out.values():
        assert o.groups_kept + o.groups_dropped == n_decided
        assert o.by_length.decided == n_decided
    assert out["keep_all"].episodes_kept == len(decided)


def test_what_if_switches_dynamic_sampling_and_overlong_handling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``replay --what-if`` on a log with dynamic-sampling drops: a policy without its own
    ``dynamic_sampling`` filters as the run did (from the log's config) and reproduces the logged
    decisions; ``enabled = false`` keeps the filtered groups; ``overlong`` policies count the
    episodes they would mask or penalize; a bad key is one line naming it."""
    cfg = Config.model_validate({"scheduler": {"max_lag": 1, "dynamic_sampling": {}}})
    tlog = TrajectoryLog(tmp_path, run="ds", config=cfg.model_dump(mode="json"))
    rng, filtered = random.Random(3), 0
    for index in range(12):
        group, decision = make_group(rng, index, 1 + index % 2)  # lag ≤ 1 at version 1
        if index % 3 == 0 and decision.decision == "kept":
            eps = [e.model_copy(update={"reward": 1.0}) for e in group.episodes]
            group = group.model_copy(update={"episodes": eps})
            decision = decision.model_copy(update={"decision": "dropped", "reason": EQUAL_REWARDS})
            filtered += 1
        if index == 1:  # its first episode's last call ran into max_tokens (8)
            ep = group.episodes[0]
            last = ep.segments[-1].model_copy(
                update={"finish_reason": "length", "token_ids": [1] * 8, "logprobs": [-1.0] * 8}
            )
            group.episodes[0] = ep.model_copy(update={"segments": [*ep.segments[:-1], last]})
        tlog.write_group(group, decision, trainer_version=1 + index % 2)
    tlog.close()
    assert filtered >= 2
    path = tmp_path / "p.toml"
    path.write_text(
        "[policies.run]\n[policies.off]\ndynamic_sampling = { enabled = false }\n"
        '[policies.mask]\noverlong = "mask"\n'
        '[policies.penalty]\noverlong = "soft_penalty"\noverlong_buffer = 4\n'
    )
    assert main([str(tmp_path), "--what-if", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[LOGGED]["groups/filtered"] == out["run"]["groups/filtered"] == filtered
    for key in ("groups/kept", "groups/dropped", "drop/rate"):
        assert out["run"][key] == out[LOGGED][key], key
    assert out["off"]["groups/filtered"] == 0
    assert out["off"]["groups/kept"] == out[LOGGED]["groups/kept"] + filtered
    masked = [out[n]["episodes/overlong_masked"] for n in (LOGGED, "run", "mask", "penalty")]
    assert masked == [0, 0, 1, 0]
    assert out["penalty"]["episodes/overlong_penalized"] >= 1
    path.write_text("[policies.x]\ndynamic_sampling = { max_refill = 3 }\n")
    with pytest.raises(ConfigError, match=r"policies\.x\.dynamic_sampling\.max_refill"):
        load_policies(path)


def test_on_policy_prox_gives_unit_weights_and_full_ess(tmp_path: Path) -> None:
    write_synthetic_log(tmp_path, steps=2, seed=12)
    records = episode_records(tmp_path)

    def behaviour(e: Episode) -> list[float]:
        return [lp for s in e.segments for lp in s.logprobs]

    policies = load_policies_text(POLICIES, tmp_path)
    for o in what_if(records, policies, behaviour):
        if o.name == LOGGED:
            continue
        assert o.correction is not None
        kept_tokens = sum(r.episode.n_sampled for r in records if keeps(o.name, r.decision.max_lag))
        assert o.correction["is/kept_tokens"] == kept_tokens
        assert o.correction["is/weight_mean"] == pytest.approx(1.0)
        assert o.correction["is/ess"] == pytest.approx(kept_tokens)
        assert o.correction["is/frac_masked"] == 0.0


def keeps(name: str, lag: int) -> bool:
    return {"same": lag <= 1, "strict": lag == 0}.get(name, True)


def load_policies_text(text: str, tmp_path: Path) -> dict[str, StalenessConfig]:
    path = tmp_path / "policies.toml"
    path.write_text(text)
    return load_policies(path)


def test_model_scorer_is_a_distribution_and_follows_temperature(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    write_synthetic_log(tmp_path, steps=1, seed=13, vocab=100)
    episode = episode_records(tmp_path)[0].episode
    scorer = ModelScorer(tiny_model_dir)
    logps = scorer(episode)
    assert len(logps) == episode.n_sampled
    assert all(lp <= 0 for lp in logps)
    hot = episode.model_copy(
        update={
            "segments": [
                s.model_copy(
                    update={
                        "sampling": SamplingParams(
                            temperature=1e6, top_p=1.0, top_k=0, max_tokens=8
                        )
                    }
                )
                for s in episode.segments
            ]
        }
    )
    vocab = scorer.model.config.vocab_size
    assert scorer(hot) == pytest.approx([-math.log(vocab)] * len(logps), abs=1e-3)
    # top-k = 1, as the trainer scores it: the most likely token is certain, any other impossible
    greedy = SamplingParams(temperature=1.0, top_p=1.0, top_k=1, max_tokens=8)
    one = episode.model_copy(
        update={"segments": [s.model_copy(update={"sampling": greedy}) for s in episode.segments]}
    )
    first = one.segments[0].prompt_len  # make the first sampled token the model's argmax there
    with torch.no_grad():
        logits = scorer.model(input_ids=torch.tensor([one.token_ids[:first]])).logits[0, -1]
    ids = list(one.token_ids)
    ids[first] = int(logits.argmax())
    seg = one.segments[0].model_copy(
        update={"token_ids": [ids[first], *one.segments[0].token_ids[1:]]}
    )
    one = one.model_copy(update={"token_ids": ids, "segments": [seg, *one.segments[1:]]})
    scores = scorer(one)
    assert scores[0] == 0.0
    assert set(scores[1:]) <= {0.0, -math.inf}
    assert -math.inf in scores  # the synthetic log's random tokens are not the argmax

    out = io.StringIO()
    (tmp_path / "p.toml").write_text(POLICIES)
    argv = [str(tmp_path), "--what-if", str(tmp_path / "p.toml"), "--model", str(tiny_model_dir)]
    assert main(argv, Console(file=out, width=200, color_system=None)) == 0
    text = out.getvalue()
    for name in (LOGGED, "same", "strict", "tis", "mis"):
        assert name in text
    (line,) = [ln for ln in text.splitlines() if "is/ess_frac" in ln]
    cells = [c.strip() for c in line.split("│")[2:-1]]
    assert cells[0] == "-"  # the logged column has no correction
    assert all(0 <= float(c) <= 1 for c in cells[1:])
    assert float(cells[3]) > 0  # tis masks nothing, so some weight survives
    assert "drop rate" in text


def _config(tmp_path: Path, model_dir: Path) -> Config:
    return Config.model_validate(
        {
            "run": {"name": "replay", "root": str(tmp_path), "seed": 3},
            "model": {"path": str(model_dir), "init": None},
            "scheduler": {"group_size": 4, "groups_per_batch": 2},
            "staleness": {"correction": {"type": "tis", "cap": 2.0}},
            "trainer": {"lr": 1e-3, "checkpoint": False},
        }
    )


@pytest.mark.slow
def test_train_replay_is_bit_identical(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    write_synthetic_log(tmp_path / "log", steps=2, seed=14, vocab=100)
    cfg = _config(tmp_path, tiny_model_dir)
    first, metrics = train(tmp_path / "log", cfg, tmp_path / "a", seed=3)
    second, _ = train(tmp_path / "log", cfg, tmp_path / "b", seed=3)
    assert first == second
    assert len(metrics) == 2
    initial = state_digest(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())
    assert first != initial, "replay did not train"
    write_synthetic_log(tmp_path / "other", steps=2, seed=15, vocab=100)
    other, _ = train(tmp_path / "other", cfg, tmp_path / "c", seed=3)
    assert other != first, "a different log must give different weights"

    toml = tmp_path / "cfg.toml"
    toml.write_text(
        f'[model]\npath = "{tiny_model_dir}"\ninit = "tiny"\n'
        '[staleness.correction]\ntype = "tis"\ncap = 2.0\n'
        '[trainer]\nlr = 1e-3\ncheckpoint = false\n[run]\nseed = 3\nname = "replay"\n'
    )
    out = io.StringIO()
    argv = [str(tmp_path / "log"), "--train", "--config", str(toml)]
    argv += ["--out", str(tmp_path / "d")]
    assert main(argv, Console(file=out, width=200, color_system=None)) == 0
    assert f"weights digest {first}" in out.getvalue()
