"""``trainer.router_replay``: the trainer routes by the engine's experts, or says why it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policies.board import Board
from policies.errors import ScoringError
from policies.model.moe import routers
from policies.train.config import TrainerConfig
from policies.train.samples import TrainSample
from policies.train.trainer import Trainer
from staleness.config import StalenessConfig


def _trainer(model_dir: Path, tmp_path: Path, **kw: object) -> Trainer:
    return Trainer(
        model_dir,
        Board(str(tmp_path / "board"), "run"),
        TrainerConfig(router_replay=True, lr=1e-3, **kw),  # type: ignore[arg-type]
        staleness=StalenessConfig(),
        temperature=1.0,
        group_size=2,
    )


def _sample(routed: torch.Tensor | None, reward: float = 1.0) -> TrainSample:
    return TrainSample(
        token_ids=[5, 9, 11, 40, 7, 3],
        mask=[False, False, False, True, True, True],
        behaviour_logprobs=[0.0, 0.0, 0.0, -2.0, -2.0, -2.0],
        reward=reward,
        routed_experts=routed,
    )


def test_replay_on_a_dense_model_is_refused_naming_the_key(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ScoringError, match=r"trainer\.router_replay = true needs a mixture"):
        _trainer(tiny_model_dir, tmp_path)


def test_replay_of_samples_without_routing_is_refused_naming_the_key(
    tiny_moe_model_dir: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tiny_moe_model_dir, tmp_path)
    with pytest.raises(ScoringError, match=r"trainer\.router_replay = true, but no sample"):
        trainer.step([_sample(None), _sample(None, 0.0)])


def test_routing_that_does_not_fit_the_sequence_is_refused() -> None:
    with pytest.raises(ScoringError, match=r"routed_experts of shape \(7, 2, 2\)"):
        _sample(torch.zeros(7, 2, 2, dtype=torch.long))


def test_a_replayed_step_uses_the_recorded_experts_and_trains_the_router(
    tiny_moe_model_dir: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tiny_moe_model_dir, tmp_path)
    forced = torch.tensor([[0, 1], [2, 3]]).expand(5, 2, 2)  # positions 0..4 (5 is the last)
    weight = routers(trainer.model)[0].weight
    assert isinstance(weight, torch.Tensor)
    before = weight.detach().clone()
    logp_forced, _ = trainer.logprobs([_sample(forced)])
    own = torch.full((5, 2, 2), -1)  # -1: the router's own choice
    logp_own, _ = trainer.logprobs([_sample(own)])
    assert not torch.allclose(logp_forced, logp_own)
    metrics = trainer.step([_sample(forced), _sample(None, 0.0)])
    assert metrics["router_replay/unrouted_samples"] == 1.0
    assert not torch.equal(weight, before)
    assert all(not r._forward_hooks for r in routers(trainer.model))  # replay leaves no hooks
