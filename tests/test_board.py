from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from policies.board import Board
from policies.errors import BoardError, VersionCorrupt


def _view(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(3, generator=g),
    }


def test_publish_load_round_trip_is_bit_exact(tmp_path: Path) -> None:
    board = Board(str(tmp_path), "run")
    assert board.latest() is None
    view = _view(0)
    board.publish(0, view, view_name="bfloat16")
    manifest, loaded = board.load(0)
    assert board.latest() == 0
    assert manifest.kind == "anchor"
    for name, t in view.items():
        assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8))


def test_pointer_only_moves_forward(tmp_path: Path) -> None:
    board = Board(f"file://{tmp_path}", "run")
    board.publish(0, _view(0), view_name="bfloat16")
    board.publish(1, _view(1), view_name="bfloat16")
    with pytest.raises(BoardError, match="only moves forward"):
        board.publish(1, _view(2), view_name="bfloat16")
    assert board.versions() == [0, 1]
    assert board.latest() == 1


def test_corrupted_weights_are_refused(tmp_path: Path) -> None:
    board = Board(str(tmp_path), "run")
    board.publish(0, _view(0), view_name="bfloat16")
    weights = tmp_path / "run" / "versions" / "00000000" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(VersionCorrupt, match="checksum mismatch"):
        board.load(0)
    weights.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(VersionCorrupt):
        board.load(0)


def test_missing_version_names_it(tmp_path: Path) -> None:
    with pytest.raises(BoardError, match="version 5 is not on the board"):
        Board(str(tmp_path), "run").manifest(5)


def test_materialize_loads_as_hf_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    board = Board(str(tmp_path / "board"), "run")
    board.create(tiny_model_dir)
    board.publish(
        0,
        {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"},
        view_name="float32",
    )
    out = board.materialize(0, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(out)
    for name, t in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name
