"""sprawl's custom weight loader for SGLang on its own: what a command is on the wire (only
globals SGLang's allow-list admits, built without sglang) and that the loader never raises (SGLang
calls it unguarded) but reports every outcome. The loader applying versions is
``test_sglang_inplace.py``."""

from __future__ import annotations

import base64
import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch
from structlog.testing import capture_logs

from policies.board import Board
from policies.serve.backends.sglang_loader import (
    apply_engine_patch,
    command_payload,
    read_command,
)
from tests.support.boards import tiny_board
from tests.support.sglang import rank_tensors
from tests.support.sglang_model import SAFE_PREFIXES, SGLangLikeModel


class _Recorder(pickle.Unpickler):
    """Notes every global a pickle names."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.seen.add((module, name))
        return super().find_class(module, name)


def test_a_command_names_only_globals_sglang_lets_a_payload_load() -> None:
    """The sidecar builds a command with torch alone; SGLang's allow-list takes every global it
    names (a plain pickle of a CPU tensor: no shared memory, no sglang class)."""
    payload = command_payload({"op": "init", "rank": 0})
    recorder = _Recorder(base64.b64decode(payload))
    recorder.load()
    assert recorder.seen == {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch.storage", "_load_from_bytes"),
        ("collections", "OrderedDict"),
    }
    assert all(any((m + ".").startswith(p) for p in SAFE_PREFIXES) for m, _ in recorder.seen)
    assert read_command(rank_tensors(payload)) == {"op": "init", "rank": 0}


def test_the_loader_never_raises_and_reports_what_failed(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    board: Board = tiny_board(tmp_path, tiny_model_dir)
    model = SGLangLikeModel(board.materialize(0, tmp_path / "startup"))
    with capture_logs() as logs:
        apply_engine_patch(model, [("not.a.command", torch.zeros(1))])  # nowhere to report
    assert logs[0]["event"] == "sglang_loader.unreadable_command"
    result = tmp_path / "r.json"
    command = {"op": "init", "rank": 0, "result": str(result), "checkpoint": str(tmp_path / "x")}
    apply_engine_patch(model, rank_tensors(command_payload(command)))
    answer = json.loads(result.read_text())
    assert answer["ok"] is False
    assert answer["op"] == "init"
    assert str(tmp_path / "x") in answer["error"]  # no such checkpoint, said so
    startup = str(tmp_path / "startup")
    for command, error in [
        ({"op": "init", "checkpoint": startup}, None),
        ({"op": "apply", "version": 1, "path": str(tmp_path / "none"), "digest": "0"}, "none"),
        ({"op": "resize"}, "unknown command 'resize'"),
    ]:
        apply_engine_patch(model, rank_tensors(command_payload({**command, "result": str(result)})))
        answer = json.loads(result.read_text())
        assert answer["ok"] is (error is None)
        assert error is None or error in answer["error"]
