"""The reference trainer on sprawl's tiny model: resume, on-policy sanity, KL, entropy, bf16."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from policies.board import Board
from policies.errors import CheckpointError
from policies.serve.engine import Engine
from policies.train.config import TrainerConfig
from policies.train.samples import TrainSample
from policies.train.trainer import Trainer
from policies.wire.batches import SegmentSampling
from policies.wire.lane import GenerateRequest
from staleness.config import (
    Correction,
    LossAgg,
    NoCorrection,
    Normalizer,
    StalenessConfig,
    TokenMask,
    TruncatedIS,
)

GROUP = 4


def _trainer(
    model_dir: Path, board: Board, correction: Correction | StalenessConfig, **kw: Any
) -> Trainer:
    """A trainer with the test defaults (``correction``: the correction, or the whole
    ``[staleness]`` section); ``kw`` sets ``[trainer]`` fields or Trainer arguments."""
    run = {k: kw.pop(k) for k in list(kw) if k in {"checkpoint_dir", "resume", "temperature"}}
    config = TrainerConfig(**{"lr": 1e-3, "weight_decay": 0.01, **kw})
    return Trainer(
        model_dir,
        board,
        config,
        staleness=(
            correction
            if isinstance(correction, StalenessConfig)
            else StalenessConfig(correction=correction)
        ),
        temperature=run.pop("temperature", 1.0),
        group_size=GROUP,
        **run,
    )


def _samples(seed: int, rewards: list[float] | None = None) -> list[TrainSample]:
    """Two groups of random sequences (prompt + sampled tail) with rewards that differ."""
    rng = random.Random(seed)
    out = []
    for i in range(2 * GROUP):
        n_prompt, n_gen = rng.randint(3, 8), rng.randint(2, 10)
        ids = [rng.randrange(10, 2000) for _ in range(n_prompt + n_gen)]
        mask = [False] * n_prompt + [True] * n_gen
        behav = [0.0] * n_prompt + [-rng.uniform(6.0, 9.0) for _ in range(n_gen)]
        reward = rewards[i] if rewards is not None else float(rng.random() < 0.5) + 0.1 * i
        out.append(TrainSample(token_ids=ids, mask=mask, behaviour_logprobs=behav, reward=reward))
    return out


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def _assert_same_state(a: Trainer, b: Trainer) -> None:
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert _bits(pa[name]) == _bits(pb[name]), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert _bits(sa["state"][k][field]) == _bits(sb["state"][k][field]), (k, field)


def test_resume_is_bit_identical(tmp_path: Path, tiny_model_dir: Path) -> None:
    batches = [_samples(s) for s in range(4)]
    kw = dict(kl_coef=0.05, entropy_coef=0.01, lr_schedule="cosine", lr_final=1e-4, max_steps=4)

    straight = _trainer(
        tiny_model_dir,
        Board(str(tmp_path / "a"), "r"),
        TruncatedIS(cap=2.0),
        checkpoint_dir=tmp_path / "a-ckpt",
        **kw,
    )
    straight.publish()
    for batch in batches:
        straight.step(batch)

    board = Board(str(tmp_path / "b"), "r")
    first = _trainer(tiny_model_dir, board, TruncatedIS(), checkpoint_dir=tmp_path / "b-ckpt", **kw)
    first.publish()
    for batch in batches[:2]:
        first.step(batch)
    del first  # the "crash": only the checkpoint and the board survive
    torch.manual_seed(12345)  # a resumed process starts with whatever RNG state it has

    resumed = _trainer(
        tiny_model_dir, board, TruncatedIS(), checkpoint_dir=tmp_path / "b-ckpt", resume=True, **kw
    )
    assert resumed.version == 2
    resumed.ensure_published()  # the board already has version 2: nothing to do
    for batch in batches[2:]:
        resumed.step(batch)

    assert resumed.version == straight.version == 4
    _assert_same_state(straight, resumed)
    assert board.versions() == [0, 1, 2, 3, 4]
    assert not list((tmp_path / "b-ckpt").glob("*.tmp-*")), "temporary checkpoint left behind"


def test_resume_republishes_a_checkpointed_but_unpublished_version(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    board = Board(str(tmp_path / "board"), "r")
    t = _trainer(tiny_model_dir, board, NoCorrection(), checkpoint_dir=tmp_path / "ck")
    t.publish()
    t.step(_samples(0))
    t.version += 1  # as if the process died between writing the checkpoint and publishing
    t.save_checkpoint()
    resumed = _trainer(
        tiny_model_dir, board, NoCorrection(), checkpoint_dir=tmp_path / "ck", resume=True
    )
    assert (resumed.version, board.latest()) == (2, 1)
    resumed.ensure_published()
    assert board.latest() == 2


def test_resume_refuses_a_foreign_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> None:
    ck = tmp_path / "ck"
    t = _trainer(
        tiny_model_dir,
        Board(str(tmp_path / "b"), "r"),
        NoCorrection(),
        checkpoint_dir=ck,
    )
    t.save_checkpoint()
    with pytest.raises(CheckpointError, match="master_dtype"):
        _trainer(
            tiny_model_dir,
            Board(str(tmp_path / "c"), "r"),
            NoCorrection(),
            checkpoint_dir=ck,
            resume=True,
            master_dtype="bfloat16",
        )
    (ck / "trainer.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="unreadable"):
        _trainer(
            tiny_model_dir,
            Board(str(tmp_path / "d"), "r"),
            NoCorrection(),
            checkpoint_dir=ck,
            resume=True,
        )


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (0.7, 5, 0.8)],
)
def test_on_policy_logprobs_match_the_engine(
    tmp_path: Path,
    tiny_model_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    temperature: float,
    top_k: int,
    top_p: float,
) -> None:
    """The trainer's defaults are plain sampling: each sample's recorded segment transforms are
    what make its log probs the engine's."""
    trainer = _trainer(
        tiny_model_dir,
        Board(str(tmp_path / "b"), "r"),
        TruncatedIS(cap=2.0),
        served_view="float32",
    )
    engine = Engine(tiny_model_dir, dtype=torch.float32)
    engine.activate(trainer.served_view(), version=0)
    prompt = list(tokenizer.encode("What is 12 + 30? Use the calculator tool."))
    choices = engine.generate(
        GenerateRequest(
            prompt_token_ids=prompt,
            max_tokens=16,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            n=GROUP,
            seed=7,
        )
    )
    samples = [
        TrainSample(
            token_ids=prompt + c.token_ids,
            mask=[False] * len(prompt) + [True] * len(c.token_ids),
            behaviour_logprobs=[0.0] * len(prompt) + c.logprobs,
            reward=float(i % 2),
            sampling=[
                SegmentSampling(
                    len(prompt), len(prompt) + len(c.token_ids), temperature, top_k, top_p
                )
            ],
        )
        for i, c in enumerate(choices)
    ]
    logp, _ = trainer.logprobs(samples)
    diffs = [
        abs(float(logp[i, j - 1]) - s.behaviour_logprobs[j])
        for i, s in enumerate(samples)
        for j in range(1, len(s.token_ids))
        if s.mask[j]
    ]
    assert len(diffs) >= GROUP
    assert sum(diffs) / len(diffs) < 1e-4
    metrics = trainer.step(samples)  # π_prox = μ, so the correction is the identity
    assert metrics["mismatch/logp_abs_mean"] < 1e-4
    assert metrics["mismatch/outside_sampled_set"] == 0.0
    assert metrics["is/frac_truncated"] == 0.0
    assert abs(metrics["is/weight_mean"] - 1.0) < 1e-3


def test_a_token_outside_the_truncated_set_is_masked_not_nan(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Off-policy a sampled token may lie outside the trainer's top-k set: log π = −inf, so the
    token is left out of the loss (counted), the KL and entropy terms stay finite, and so does
    every gradient."""
    samples = _samples(0)
    t = _trainer(
        tiny_model_dir,
        Board(str(tmp_path / "b"), "r"),
        TruncatedIS(cap=2.0),
        kl_coef=0.1,
        entropy_coef=0.01,
    )
    # top_k = 1 on every other sample: only the trainer's argmax survives, and random tokens
    # are almost never it; the others are scored plainly (the trainer's defaults)
    samples = [
        TrainSample(
            token_ids=x.token_ids,
            mask=x.mask,
            behaviour_logprobs=x.behaviour_logprobs,
            reward=x.reward,
            sampling=[SegmentSampling(x.mask.index(True), len(x.token_ids), 1.0, 1, 1.0)]
            if i % 2 == 0
            else [],
        )
        for i, x in enumerate(samples)
    ]
    logp, _ = t.logprobs(samples)
    outside = int(torch.isneginf(logp).sum())
    assert outside > 0
    metrics = t.step(samples)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert metrics["mismatch/outside_sampled_set"] == outside
    assert metrics["is/nonfinite_tokens"] == outside
    assert metrics["kept_tokens"] == sum(sum(x.mask[1:]) for x in samples) - outside > 0
    assert metrics["kl_ref_excluded_tokens"] == 0.0  # π_ref = π_θ at version 0
    assert metrics["grad_norm"] > 0.0
    grads = [p.grad for p in t.model.parameters() if p.grad is not None]
    assert grads
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert all(bool(torch.isfinite(p).all()) for p in t.model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss_agg", "normalizer"),
    [("token_mean", "kept"), ("seq_mean", "original"), ("dr_grpo", "kept")],
)
def test_micro_batches_give_the_full_batch_gradient(
    tmp_path: Path, tiny_model_dir: Path, loss_agg: LossAgg, normalizer: Normalizer
) -> None:
    """One sample per pass, a few, or all at once: the same loss and the same gradient, because
    the normaliser is the whole batch's (a per-micro-batch one weighs short passes up)."""
    staleness = StalenessConfig(
        correction=TokenMask(c=2.0),  # masks some tokens per row: kept ≠ valid counts
        loss_agg=loss_agg,
        normalizer=normalizer,
        dr_grpo_tokens=16 if loss_agg == "dr_grpo" else None,
    )
    batch = _samples(3)
    runs = {}
    for budget in (None, 45, 2):  # 45: passes of 3, 3 and 2 samples
        t = _trainer(
            tiny_model_dir,
            Board(str(tmp_path / f"b{budget}"), "r"),
            staleness,
            micro_batch_tokens=budget,
            grad_clip=1e9,
            entropy_coef=0.01,
            kl_coef=0.05,
        )
        metrics = t.step(batch)
        grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        runs[budget] = (metrics, grads)
    full, grads = runs[None]
    assert full["micro_batches"] == 1.0
    assert runs[45][0]["micro_batches"] == 3.0
    assert runs[2][0]["micro_batches"] == len(batch)
    assert 0 < full["kept_tokens"] < sum(sum(x.mask[1:]) for x in batch)
    assert full["grad_norm"] > 0
    for budget in (45, 2):
        metrics, split = runs[budget]
        assert metrics["loss"] == pytest.approx(full["loss"], rel=1e-5, abs=1e-7)
        assert metrics["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-4)
        assert split.keys() == grads.keys()
        for name, g in grads.items():
            assert torch.allclose(split[name], g, rtol=1e-4, atol=1e-7), (budget, name)


def test_kl_is_zero_at_the_reference_and_grows_after_updates(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    t = _trainer(
        tiny_model_dir,
        Board(str(tmp_path / "b"), "r"),
        NoCorrection(),
        kl_coef=0.1,
        lr=5e-3,
    )
    first = t.step(_samples(0))
    assert first["kl_ref"] == 0.0  # version 0 is the reference itself
    second = t.step(_samples(1))
    assert second["kl_ref"] > 0.0


def test_entropy_bonus_raises_entropy(tmp_path: Path, tiny_model_dir: Path) -> None:
    batch = _samples(0, rewards=[1.0] * (2 * GROUP))  # equal rewards: no policy gradient at all
    t = _trainer(
        tiny_model_dir,
        Board(str(tmp_path / "b"), "r"),
        NoCorrection(),
        entropy_coef=0.5,
        lr=1e-3,
    )
    before = t.step(batch)["entropy"]
    after = t.step(batch)["entropy"]
    assert 0.0 < before < float(torch.log(torch.tensor(2048.0)))
    assert after > before


def test_each_step_takes_the_scheduled_rate(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Linear to 0 over 2 steps: 1e-3, then 5e-4, then 0 (past max_steps): that step moves no
    weight, bit for bit, though its gradient is not zero."""
    t = _trainer(
        tiny_model_dir,
        Board(str(tmp_path / "b"), "r"),
        NoCorrection(),
        lr_schedule="linear",
        max_steps=2,
        weight_decay=0.0,
    )
    rates = [t.step(_samples(s))["lr"] for s in range(2)]
    assert rates == pytest.approx([1e-3, 5e-4])
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    last = t.step(_samples(2))
    assert last["lr"] == 0.0
    assert last["grad_norm"] > 0
    for name, p in t.model.named_parameters():
        assert _bits(p) == _bits(before[name]), name


def test_bfloat16_masters_train_and_publish(tmp_path: Path, tiny_model_dir: Path) -> None:
    board = Board(str(tmp_path / "b"), "r")
    t = _trainer(tiny_model_dir, board, TruncatedIS(), master_dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in t.model.parameters())
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.publish()
    metrics = t.step(_samples(0))
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    changed = sum(int((p.detach() != before[n]).sum()) for n, p in t.model.named_parameters())
    assert changed > 0
    state = next(iter(t.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16
    assert board.latest() == 1
    _, view = board.load(1)
    assert all(v.dtype == torch.bfloat16 for v in view.values() if v.is_floating_point())


def test_staleness_loss_options_reach_the_step(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``[staleness]`` loss_agg / normalizer / sequence TIS drive the step, and one NaN engine log
    prob is masked and counted instead of turning the loss into NaN."""
    samples = _samples(0)
    broken = samples[1]
    first = broken.mask.index(True)
    behav = list(broken.behaviour_logprobs)
    behav[first] = float("nan")
    samples[1] = TrainSample(
        token_ids=broken.token_ids, mask=broken.mask, behaviour_logprobs=behav, reward=broken.reward
    )
    staleness = StalenessConfig(
        correction=TruncatedIS(cap=2.0, level="sequence"),
        loss_agg="dr_grpo",
        dr_grpo_tokens=16,
        normalizer="original",
    )
    t = _trainer(tiny_model_dir, Board(str(tmp_path / "b"), "r"), staleness)
    assert not t.staleness.scales_rewards
    metrics = t.step(samples)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert metrics["is/nonfinite_tokens"] == 1.0
    n_valid = sum(sum(s.mask[1:]) for s in samples)
    assert metrics["kept_tokens"] == n_valid - 1


def test_trainer_loss_agg_moved_to_staleness() -> None:
    with pytest.raises(ValueError, match=r"staleness\.loss_agg"):
        TrainerConfig(loss_agg="seq_mean")  # type: ignore[call-arg]


def test_tied_weights_are_served_once_and_tensors_that_only_share_an_address_are_kept() -> None:
    from policies.train.trainer import tied_once

    embed = torch.randn(8, 4)
    storage = torch.arange(12.0)
    state = {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: the same tensor
        "a.empty": torch.empty(0),
        "b.empty": torch.empty(0),  # empty tensors share address 0
        "first_half": storage[:6],
        "whole": storage,  # the same address, another shape
    }
    assert list(tied_once(state)) == ["embed.weight", "a.empty", "b.empty", "first_half", "whole"]
