"""Boards of sprawl's tiny model for engine and sidecar tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from policies.board import Board


def publish_scaled(board: Board, version: int, model_dir: Path, scale: float = 1.0) -> None:
    """Publish the model's weights × ``scale`` as a bf16 view (scale ≠ 1 makes a new version)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    view = {
        k: (v * scale).to(torch.bfloat16)
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    board.publish(version, view, view_name="bfloat16")


def tiny_board(root: Path, model_dir: Path) -> Board:
    """A board holding the tiny model as version 0."""
    b = Board(str(root / "board"), "run")
    b.create(model_dir)
    publish_scaled(b, 0, model_dir)
    return b
