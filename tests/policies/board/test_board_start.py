"""Which version a starting reader serves (the reference engine + sidecar, over HTTP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from policies.board import Board
from tests.support.boards import engine, publish_scaled, tiny_board
from tests.support.lane import policy, wait_version
from tests.support.logs import Logged

pytestmark = pytest.mark.anyio


def _damage_data(board: Board, version: int) -> None:
    """Flip one byte in every data file of ``version`` (its patches, or its anchor)."""
    vdir = Path(board.root) / "versions" / f"{version:08d}"
    for f in vdir.rglob("*"):
        if f.is_file() and f.name != "manifest.json":
            raw = bytearray(f.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            f.write_bytes(bytes(raw))


def _drop_manifest(board: Board, version: int) -> None:
    (Path(board.root) / "versions" / f"{version:08d}" / "manifest.json").unlink()
    board.store.write(f"{board.root}/POINTER", f'{{"version": {version}}}'.encode())


@pytest.mark.parametrize(
    ("damage", "why"),
    [(_damage_data, "version 2: "), (_drop_manifest, "version 2 is not on the board")],
    ids=["damaged-data", "manifest-missing"],
)
async def test_a_damaged_newest_version_starts_the_replica_on_the_newest_good_one(
    tmp_path: Path, tiny_model_dir: Path, damage: Any, why: str
) -> None:
    board = tiny_board(tmp_path, tiny_model_dir)
    publish_scaled(board, 1, tiny_model_dir, scale=0.5)
    publish_scaled(board, 2, tiny_model_dir, scale=0.25)
    damage(board, 2)
    with capture_logs() as logs:
        with anyio.fail_after(60):  # before #19 item 15 the reader never listened
            async with engine(board) as url:
                assert (await policy(url))["applied_version"] == 1
                publisher = Board(board.url, board.run)
                publish_scaled(publisher, 3, tiny_model_dir, scale=0.125)
                await wait_version(url, 3)  # it keeps following the board
    skipped = [e for e in logs if e["event"] == "version_skipped"]
    assert [(e["version"], e["trying"]) for e in skipped] == [(2, 1)]
    assert why in skipped[0]["error"]
    activated = [e["version"] for e in logs if e["event"] == "version_activated"]
    assert activated == [1, 3]


async def test_a_replica_never_serves_a_tampered_base_file(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    board = tiny_board(tmp_path, tiny_model_dir)
    publish_scaled(board, 1, tiny_model_dir, scale=0.5)
    config = Path(board.root) / "base" / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 0.1'))
    logged = Logged()

    async def start() -> None:
        async with engine(board):
            raise AssertionError("the reader listened on a tampered config.json")

    with capture_logs(processors=[logged]) as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(start)  # it waits for a version that records its base files
            for version in (0, 1):
                await logged.until("version_refused", version=version)
            tg.cancel_scope.cancel()
    refused = {e["version"]: e["error"] for e in logs if e["event"] == "version_refused"}
    assert sorted(refused) == [0, 1]
    for version, error in refused.items():
        assert f"version {version}: base file base/config.json does not match" in error
    assert not [e for e in logs if e["event"] in ("version_activated", "lane_ready")]
