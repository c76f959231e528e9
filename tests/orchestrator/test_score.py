"""Scoring a run's newest policy (:mod:`orchestrator.run.score`) on the real fleet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orchestrator.config import Config, load_config
from orchestrator.errors import ConfigError
from orchestrator.models import ensure_model
from orchestrator.run.score import score_policy
from policies.board import Board

LOOP = Path("tests/support/loop.toml")
pytestmark = pytest.mark.anyio


def _config(tmp_path: Path, **overrides: object) -> Config:
    return load_config(
        LOOP,
        {
            "run.root": str(tmp_path),
            "run.name": "scored",
            "fleet.local_engines": 1,
            "sampling.max_tokens": 12,
            "environment.max_turns": 2,
            **overrides,
        },
    )


def _publish(cfg: Config, versions: int) -> None:
    """Versions 0 … ``versions − 1`` of the run's model on its board, each a little different."""
    model_dir = ensure_model(cfg)
    board = Board(cfg.board_url, cfg.run.name)
    board.create(model_dir)
    weights = load_file(model_dir / "model.safetensors")
    for v in range(versions):
        view = {k: (t + 0.01 * v).to(torch.bfloat16) for k, t in weights.items()}
        board.publish(v, view, view_name="bfloat16")


async def test_the_newest_version_is_scored_on_the_same_tasks_and_seeds(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _publish(cfg, 2)
    first = await score_policy(cfg, 5)
    assert first.version == 1  # the newest, every call pinned to it
    assert len(first.rewards) == 5
    assert all(0 <= r <= 1 for r in first.rewards)
    assert 0 <= first.failed <= 5
    again = await score_policy(cfg, 5)
    assert again.rewards == first.rewards  # the same tasks, the same sampling seeds


async def test_a_board_without_a_version_or_no_episodes_is_refused(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    with pytest.raises(ConfigError, match=r"run 'scored': no version on the board .* to score"):
        await score_policy(cfg, 3)
    with pytest.raises(ValueError, match="episodes must be ≥ 1, got 0"):
        await score_policy(cfg, 0)
