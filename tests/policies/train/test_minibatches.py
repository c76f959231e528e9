"""``trainer.minibatches``: k optimizer steps per batch against one proximal policy, on the tiny
model; clipping, lag in optimizer steps, batch-level corrections, resume."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

import policies.train.trainer as trainer_module
from policies.board import Board
from policies.errors import ScoringError
from policies.train.config import TrainerConfig
from policies.train.passes import lag_metrics, split_groups
from policies.train.samples import TrainSample
from policies.train.trainer import Trainer
from staleness.config import CISPO, GSPO, M2PO, Correction, NoCorrection, StalenessConfig

GROUP = 2


def _trainer(tmp: Path, model: Path, staleness: StalenessConfig, **kw: Any) -> Trainer:
    run = {k: kw.pop(k) for k in list(kw) if k in {"checkpoint_dir", "resume"}}
    config = TrainerConfig(**{"lr": 1e-3, "grad_clip": 1e9, **kw})
    return Trainer(
        model, Board(str(tmp), "r"), config, staleness=staleness, temperature=1.0,
        group_size=GROUP, **run,
    )  # fmt: skip


def _samples(seed: int, groups: int = 4, version: int | None = None) -> list[TrainSample]:
    """``groups`` groups of random sequences whose rewards differ within each group; each
    stamped as sampled by ``version`` when given."""
    rng = random.Random(seed)
    out = []
    for i in range(groups * GROUP):
        n_prompt, n_gen = rng.randint(3, 6), rng.randint(3, 9)
        ids = [rng.randrange(10, 2000) for _ in range(n_prompt + n_gen)]
        mask = [False] * n_prompt + [True] * n_gen
        behav = [0.0] * n_prompt + [-rng.uniform(6.0, 9.0) for _ in range(n_gen)]
        spans = [] if version is None else [(n_prompt, n_prompt + n_gen, version, version)]
        out.append(TrainSample(ids, mask, behav, float(i % 2) + 0.1 * i, policy_versions=spans))
    return out


def test_groups_split_whole_and_as_even_as_they_can() -> None:
    assert split_groups(8, 2, 1) == [range(0, 8)]
    assert split_groups(8, 2, 2) == [range(0, 4), range(4, 8)]
    assert split_groups(10, 2, 2) == [range(0, 6), range(6, 10)]  # 5 groups: 3 and 2
    assert [len(r) for r in split_groups(21, 3, 3)] == [9, 6, 6]  # 7 groups: 3, 2, 2
    with pytest.raises(ScoringError, match=r"trainer\.minibatches = 3 needs at least 3 whole"):
        split_groups(4, 2, 3)


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(π_θ, π_prox) log probs of every micro-batch the step trains, as the loss sees them."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = trainer_module.micro_batch_loss

    def record(logp: torch.Tensor, *args: Any, **kw: Any) -> Any:
        loss, scored = real(logp, *args, **kw)
        seen.append((scored.logp, scored.logp_prox))
        return loss, scored

    monkeypatch.setattr(trainer_module, "micro_batch_loss", record)
    return seen


def test_both_minibatches_use_the_pre_step_logprobs(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = _trainer(tmp_path / "b", tiny_model_dir, StalenessConfig(), minibatches=2, lr=1e-2)
    batch = _samples(0)
    before, mask = t.logprobs(batch)
    seen = _recording(monkeypatch)
    metrics = t.step(batch)
    assert len(seen) == 2
    (logp0, prox0), (logp1, prox1) = seen
    width = prox0.shape[1]
    torch.testing.assert_close(prox0, before[:4, :width], rtol=0, atol=1e-6)
    torch.testing.assert_close(prox1, before[4:, : prox1.shape[1]], rtol=0, atol=1e-6)
    m0, m1 = mask[:4, :width], mask[4:, : prox1.shape[1]]
    assert (logp0 - prox0)[m0].abs().max() < 1e-5  # the first step's ratio is 1
    assert (logp1 - prox1)[m1].abs().max() > 1e-3  # the second's is not: the weights moved
    assert metrics["minibatches"] == 2.0
    assert metrics["ratio_max"] > 1.0 or metrics["ratio_min"] < 1.0
    assert t.version == 1  # one version per batch
    state = next(iter(t.optimizer.state.values()))
    assert float(state["step"]) == 2.0  # two AdamW steps


def test_one_minibatch_scores_once(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """k = 1 takes no proximal pass: π_prox is the training pass's own log probs."""
    forwards = {}
    for k in (1, 2):
        t = _trainer(tmp_path / f"b{k}", tiny_model_dir, StalenessConfig(), minibatches=k)
        calls: list[object] = []
        handle = t.model.base_model.register_forward_hook(lambda *_, seen=calls: seen.append(1))
        t.step(_samples(1))
        handle.remove()
        forwards[k] = len(calls)
    assert forwards == {1: 1, 2: 3}  # k = 2: the proximal pass and one per minibatch


def test_clipping_acts_only_once_the_weights_have_moved(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    batch = _samples(2)
    runs = {}
    for k in (1, 2):
        t = _trainer(tmp_path / f"b{k}", tiny_model_dir, StalenessConfig(), minibatches=k,
                     lr=5e-2, clip_eps=0.01, dual_clip_c=1.5)  # fmt: skip
        runs[k] = t.step(batch)
    assert runs[1]["clip_frac"] == 0.0  # one step: the ratio is 1
    assert runs[2]["clip_frac"] > 0.0
    assert runs[2]["dual_clip_frac"] > 0.0


@pytest.mark.parametrize(
    ("correction", "loss_agg"),
    [
        (CISPO(), "token_mean"),  # μ is far from π_θ here: its ratio is capped at 5
        (CISPO(anchor="proximal", clip_eps=0.01, clip_eps_high=0.01), "token_mean"),
        (GSPO(), "seq_mean"),
    ],
    ids=str,
)
def test_surrogates_train_over_minibatches(
    tmp_path: Path, tiny_model_dir: Path, correction: Correction, loss_agg: str
) -> None:
    st = StalenessConfig(correction=correction, loss_agg=loss_agg)  # type: ignore[arg-type]
    t = _trainer(tmp_path / "b", tiny_model_dir, st, minibatches=2, lr=5e-2)
    metrics = t.step(_samples(3))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert metrics["clip_frac"] > 0.0  # the second minibatch's ratios left the band


@pytest.mark.parametrize("minibatches", [1, 2])
def test_ppo_anchored_on_behaviour_clips_from_the_first_step(
    tmp_path: Path, tiny_model_dir: Path, minibatches: int
) -> None:
    """``none`` with ``anchor="behaviour"``: the ratio is π_θ/μ, away from 1 before any step
    (μ is far from π_θ here), so the clip acts even when a batch is one step; the default anchor's
    ratio is exactly 1 then."""
    runs = {}
    for anchor in ("proximal", "behaviour"):
        st = StalenessConfig(correction=NoCorrection(anchor=anchor))  # type: ignore[arg-type]
        t = _trainer(tmp_path / anchor, tiny_model_dir, st, minibatches=minibatches)
        runs[anchor] = t.step(_samples(3))
    assert runs["behaviour"]["clip_frac"] > 0.0
    assert runs["behaviour"]["loss"] != runs["proximal"]["loss"]
    if minibatches == 1:
        assert runs["proximal"]["clip_frac"] == 0.0


def test_m2po_masks_over_the_whole_batch_whatever_the_micro_batches(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """M2PO's mask is a statistic of the batch: passes of one sample each must train the same
    tokens, with the same gradient, as one pass of all of them."""
    st = StalenessConfig(correction=M2PO(threshold=0.3))
    batch = _samples(4)
    runs = {}
    for budget in (None, 2):
        t = _trainer(tmp_path / f"b{budget}", tiny_model_dir, st, micro_batch_tokens=budget)
        metrics = t.step(batch)
        grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        runs[budget] = (metrics, grads)
    (whole, g_whole), (split, g_split) = runs[None], runs[2]
    assert 0 < whole["is/frac_masked"] < 1
    assert split["kept_tokens"] == whole["kept_tokens"]
    assert split["micro_batches"] == len(batch)
    for name, g in g_whole.items():
        torch.testing.assert_close(g_split[name], g, rtol=1e-4, atol=1e-7)


def test_micro_batches_within_minibatches_give_the_same_steps(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    batch = _samples(5)
    params, runs = [], []
    for budget in (None, 2):  # 2: one sample per pass
        t = _trainer(tmp_path / f"b{budget}", tiny_model_dir, StalenessConfig(), minibatches=2,
                     micro_batch_tokens=budget)  # fmt: skip
        runs.append(t.step(batch))
        params.append([p.detach().clone() for p in t.model.parameters()])
    assert (runs[0]["micro_batches"], runs[1]["micro_batches"]) == (2.0, len(batch))
    for key in ("loss", "grad_norm", "grad_norm_max", "ratio_min", "ratio_max"):
        assert runs[1][key] == pytest.approx(runs[0][key], rel=1e-4), key
    for a, b in zip(*params, strict=True):  # AdamW: 1e-3 per step, sign of tiny gradients aside
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_lag_counts_optimizer_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Sampled by version 0, trained at version 1 with k = 2: two steps behind in the first
    minibatch, three in the second."""
    t = _trainer(tmp_path / "b", tiny_model_dir, StalenessConfig(), minibatches=2)
    first = t.step(_samples(6, version=0))
    assert (first["lag_steps/minibatch_0"], first["lag_steps/minibatch_1"]) == (0.0, 1.0)
    second = t.step(_samples(7, version=0))
    assert (second["lag_steps/minibatch_0"], second["lag_steps/minibatch_1"]) == (2.0, 3.0)
    assert second["lag_steps/max"] == 3.0
    assert "lag_steps/mean" not in t.step(_samples(8))  # no versions reported: no lag metrics


def test_lag_metrics_weigh_tokens() -> None:
    mixed = [
        TrainSample([1, 2, 3, 4], [False, True, True, True], [0.0, -1, -1, -1], 1.0,
                    policy_versions=[(1, 2, 3, 3), (2, 4, 5, 5)]),
        TrainSample([1, 2], [False, True], [0.0, -1], 0.0, policy_versions=[(1, 2, 6, 6)]),
    ]  # fmt: skip
    got = lag_metrics(mixed, [range(0, 1), range(1, 2)], version=6)
    # row 0 (minibatch 0): 1 token at lag 3, 2 at lag 1 → steps 6, 2, 2; row 1: lag 0 → 0·2 + 1
    assert got["lag_steps/minibatch_0"] == pytest.approx(10 / 3)
    assert got["lag_steps/minibatch_1"] == 1.0
    assert got["lag_steps/mean"] == pytest.approx(11 / 4)
    assert got["lag_steps/max"] == 6.0


def test_resume_with_minibatches_is_bit_identical(tmp_path: Path, tiny_model_dir: Path) -> None:
    batches = [_samples(s) for s in range(3)]
    kw: dict[str, Any] = {"minibatches": 2, "checkpoint_dir": tmp_path / "ck"}
    whole = _trainer(tmp_path / "w", tiny_model_dir, StalenessConfig(), minibatches=2)
    for b in batches:
        whole.step(b)
    first = _trainer(tmp_path / "r", tiny_model_dir, StalenessConfig(), **kw)
    first.step(batches[0])
    resumed = _trainer(tmp_path / "r", tiny_model_dir, StalenessConfig(), resume=True, **kw)
    assert resumed.version == 1
    for b in batches[1:]:
        resumed.step(b)
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_minibatch_options_are_validated() -> None:
    for bad in ({"minibatches": 0}, {"clip_eps_high": 0.0}, {"dual_clip_c": 1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TrainerConfig(**bad)  # type: ignore[arg-type]
    assert TrainerConfig().minibatches == 1
    assert isinstance(StalenessConfig().correction, NoCorrection)
