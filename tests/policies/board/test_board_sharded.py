"""Sharded versions (policies.board.sharded): in one process (a world of one) here, and under
torchrun with FSDP2 on two gloo ranks (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard

from policies.board import WEIGHTS, Board, BoardOptions, BoardReader, ShardedPublisher
from policies.board.manifest import manifest_seal
from policies.board.types import FORMAT, Manifest
from policies.codec import apply as codec_apply
from policies.errors import BoardError, VersionCorrupt
from policies.serve.backends.base import free_port
from policies.serve.backends.reference import ReferenceBackend
from policies.serve.engine import Engine
from policies.serve.sidecar import Sidecar
from policies.wire.lane import GenerateRequest
from tests.support.boards import adam_like_step

State = dict[str, torch.Tensor]
REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("sharded_worker.py")


def _state(seed: int = 0) -> State:
    g = torch.Generator().manual_seed(seed)
    embed = (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16)
    return {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: one tensor under two names
        "layers.0.weight": (torch.randn(96, 32, generator=g) * 0.02).to(torch.bfloat16),
        "layers.0.bias": torch.randn(96, generator=g),
        "position_ids": torch.arange(16),
    }


def _served(state: State) -> State:
    """The bf16 view a single-process publisher serves of ``state`` (tied names kept tied)."""
    made: dict[int, torch.Tensor] = {}
    for t in state.values():
        if id(t) not in made:
            made[id(t)] = t.to(torch.bfloat16) if t.is_floating_point() else t.clone()
    return {k: made[id(t)] for k, t in state.items()}


def _chain(n: int) -> list[State]:
    states = [_state()]
    for v in range(1, n):
        states.append(adam_like_step(states[-1], v, density=0.03, float_noise=1e-3))
    return states


def _bytes(reader: BoardReader, version: int, out: Path) -> bytes:
    return (reader.materialize(version, out) / WEIGHTS).read_bytes()


def _edit_manifest(board: BoardReader, version: int, edit: Any) -> None:
    path = f"{board.root}/versions/{version:08d}/manifest.json"
    m = Manifest.model_validate_json(board.fs.cat_file(path))
    m = edit(m)
    m = m.model_copy(update={"seal": manifest_seal(m)})
    board.fs.pipe_file(path, m.model_dump_json(indent=1).encode())


def test_a_world_of_one_publishes_what_a_single_process_board_does(tmp_path: Path) -> None:
    states = _chain(6)
    opts = BoardOptions(anchor_fraction=5)
    pub = ShardedPublisher(str(tmp_path / "s"), "run", options=opts)
    ref = Board(str(tmp_path / "r"), "run", options=opts)
    assert (pub.rank, pub.world_size) == (0, 1)
    for v, s in enumerate(states):
        m = pub.publish(v, s, view_name="bf16")
        ref.publish(v, _served(s), view_name="bf16")
        assert (m.format, len(m.shards)) == (FORMAT, 1)
    assert [pub.board.manifest(v).kind for v in range(6)] == ["anchor"] + ["delta"] * 5
    reader, single = (
        BoardReader(str(tmp_path / "s"), "run"),
        BoardReader(str(tmp_path / "r"), "run"),
    )
    for v in range(6):
        assert _bytes(reader, v, tmp_path / f"a{v}") == _bytes(single, v, tmp_path / f"b{v}")
    m = reader.manifest(5)
    assert m.aliases == {"lm_head.weight": "embed.weight"}
    assert set(m.tensors) == set(states[0])
    view: State = {}
    reader.advance(view, None, 1)
    reader.advance(view, 1, 5)  # squashed catch-up patches, applied piece by piece
    assert view["embed.weight"] is view["lm_head.weight"]  # tied again
    expected = single.load(5)[1]
    assert all(torch.equal(view[k], expected[k]) for k in expected)
    assert reader.catch_up(1, 5).steps[0].base == 1
    assert len(reader.catch_up(0, 4).steps) == 1


def test_bad_calls_are_refused_naming_what_was_wrong(tmp_path: Path) -> None:
    pub = ShardedPublisher(str(tmp_path / "s"), "run")
    with pytest.raises(BoardError, match=r"view 'int4_group' cannot be published sharded: use"):
        pub.publish(0, _state(), view_name="int4_group")
    with pytest.raises(BoardError, match=r"version -1 is not an integer"):
        pub.publish(-1, _state())
    pub.publish(3, _state())
    with pytest.raises(BoardError, match=r"pointer only moves forward: version 3 <= current 3"):
        pub.publish(3, _state())
    with pytest.raises(BoardError, match=r"process_group was given but torch\.distributed"):
        ShardedPublisher(str(tmp_path / "s"), "run", process_group=object())  # type: ignore[arg-type]


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[DeviceMesh]:
    """torch.distributed initialised in this process (gloo, one rank), and its device mesh."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensors_publish_their_local_shard_and_partial_ones_are_refused(
    tmp_path: Path, world_of_one: DeviceMesh
) -> None:
    plain = _state()
    state = {
        k: DTensor.from_local(t, world_of_one, [Shard(0)]) if t.dim() == 2 else t
        for k, t in plain.items()
    }
    state["lm_head.weight"] = state["embed.weight"]
    pub = ShardedPublisher(str(tmp_path / "s"), "run")
    assert (pub.rank, pub.world_size) == (0, 1)
    m = pub.publish(0, state)
    assert m.aliases == {"lm_head.weight": "embed.weight"}
    ref = Board(str(tmp_path / "r"), "run")
    ref.publish(0, _served(plain), view_name="bf16")
    reader, single = (
        BoardReader(str(tmp_path / "s"), "run"),
        BoardReader(str(tmp_path / "r"), "run"),
    )
    assert _bytes(reader, 0, tmp_path / "a") == _bytes(single, 0, tmp_path / "b")
    partial = {"w": DTensor.from_local(torch.ones(4, 4), world_of_one, [Partial()])}
    with pytest.raises(BoardError, match=r"w: DTensor placement .* cannot be published sharded"):
        pub.publish(1, partial)
    assert reader.latest() == 0


class _DiesBeforeCommit(ShardedPublisher):
    def _commit(self, m: Manifest) -> None:
        raise BoardError("the commit's storage went away")


def test_a_failed_commit_leaves_no_version_and_the_version_can_be_published_again(
    tmp_path: Path,
) -> None:
    states = _chain(3)
    url = str(tmp_path / "s")
    pub = ShardedPublisher(url, "run")
    pub.publish(0, states[0])
    pub.publish(1, states[1])
    with pytest.raises(BoardError, match="storage went away"):
        _DiesBeforeCommit(url, "run").publish(2, states[2])
    reader = BoardReader(url, "run")
    assert (reader.latest(), reader.versions()) == (1, [0, 1])
    assert (tmp_path / "s/run/versions/00000002/shards/00000/model.safetensors").exists()
    with pytest.raises(BoardError, match="version 2 is not published"):
        reader.catch_up(1, 2)
    again = ShardedPublisher(url, "run")  # a restarted trainer: holds no views, so an anchor
    assert again.publish(2, states[2]).kind == "anchor"
    ref = Board(str(tmp_path / "r"), "run")
    for v, s in enumerate(states):
        ref.publish(v, _served(s), view_name="bf16")
    single = BoardReader(str(tmp_path / "r"), "run")
    assert _bytes(reader, 2, tmp_path / "a") == _bytes(single, 2, tmp_path / "b")


def test_a_damaged_piece_or_shard_patch_is_refused_naming_it(tmp_path: Path) -> None:
    states = _chain(3)
    pub = ShardedPublisher(str(tmp_path / "s"), "run")
    for v, s in enumerate(states):
        pub.publish(v, s)
    shard = tmp_path / "s/run/versions/00000000/shards/00000"
    weights = shard / WEIGHTS
    original = weights.read_bytes()
    data = bytearray(original)
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(VersionCorrupt, match=r"version 0: checksum mismatch for rank 0's piece"):
        BoardReader(str(tmp_path / "s"), "run").load(0)
    patch = tmp_path / "s/run/versions/00000002/shards/00000/from-00000001.patch"
    patch.write_bytes(patch.read_bytes()[:-10])
    reader = BoardReader(str(tmp_path / "s"), "run")
    view: State = {}
    with pytest.raises(VersionCorrupt, match=r"version 0: checksum mismatch"):
        reader.advance(view, None, 2)
    weights.write_bytes(original)
    reader.advance(view, None, 1)
    with pytest.raises(VersionCorrupt, match=r"version 2: shards/00000/from-00000001.patch holds"):
        reader.advance(view, 1, 2)
    reader.advance(view, None, 2)  # routed around: the squashed patch from version 0
    assert reader.catch_up(1, 2).steps[0].base == 0


def test_a_replica_checks_the_pieces_it_patches_from_the_words_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = [_state()]
    for v in range(1, 3):
        states.append(adam_like_step(states[-1], v, density=0.02))
    pub = ShardedPublisher(str(tmp_path / "s"), "run")
    ref = Board(str(tmp_path / "r"), "run")
    for v, s in enumerate(states):
        pub.publish(v, s)
        ref.publish(v, _served(s), view_name="bf16")
    reader = BoardReader(str(tmp_path / "s"), "run")
    view: State = {}
    reader.advance(view, None, 1)
    hashed: list[torch.Size] = []
    whole = codec_apply.tensor_checksum

    def spy(t: torch.Tensor) -> str:
        hashed.append(t.shape)
        return whole(t)

    monkeypatch.setattr(codec_apply, "tensor_checksum", spy)
    reader.advance(view, 1, 2)
    assert hashed == []  # each piece checked as its base checksum plus what the patch wrote
    expected = BoardReader(str(tmp_path / "r"), "run").load(2)[1]
    assert all(torch.equal(view[k], expected[k]) for k in expected)
    assert reader.manifest(2).shards[0].pieces["layers.0.weight"].checksum == (
        whole(expected["layers.0.weight"])
    )  # the publisher summed it as it scanned


def test_an_inconsistent_sharded_manifest_is_refused_even_when_resealed(tmp_path: Path) -> None:
    pub = ShardedPublisher(str(tmp_path / "s"), "run")
    pub.publish(0, _state())

    def moved(m: Manifest) -> Manifest:
        shard = m.shards[0]
        piece = shard.pieces["layers.0.weight"].model_copy(update={"offset": [1, 0]})
        pieces = {**shard.pieces, "layers.0.weight": piece}
        return m.model_copy(update={"shards": [shard.model_copy(update={"pieces": pieces})]})

    _edit_manifest(pub.board, 0, moved)
    with pytest.raises(VersionCorrupt, match=r"version 0: sharded manifest inconsistent: rank 0's"):
        BoardReader(str(tmp_path / "s"), "run").manifest(0)


def test_versions_command_lists_sharded_versions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.cli import main

    pub = ShardedPublisher(str(tmp_path / "s"), "run")
    pub.publish(0, _state())
    assert main(["versions", "--board", str(tmp_path / "s"), "--run", "run", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [(r["version"], r["kind"], r["ranks"]) for r in rows] == [(0, "anchor", 1)]
    assert main(["versions", "--board", str(tmp_path / "s"), "--run", "run"]) == 0
    assert "ranks" in capsys.readouterr().out


# -- torchrun: FSDP2 on two gloo ranks -------------------------------------------------------------


def _torchrun(
    board: Path, model: Path, versions: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(WORKER), "--board", str(board),
        "--model", str(model), "--versions", versions, *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A board a 2-rank FSDP2 trainer published versions 0-2 to (run ``run``, with the same
    weights published whole to run ``ref``), whose rank 1 then died mid-publish of version 3."""
    from tests.support.models import model_copy

    root = tmp_path_factory.mktemp("sharded")
    model = model_copy("small", root / "model")
    done = _torchrun(root / "board", model, "0,1,2,3", "--kill-rank", "1", "--kill-version", "3")
    assert done.returncode != 0, done.stdout + done.stderr  # rank 1 was killed
    return root / "board", model


@pytest.mark.slow
def test_fsdp2_versions_materialize_bit_identical_to_a_single_process_publish(
    sharded_run: tuple[Path, Path], tmp_path: Path
) -> None:
    board, _ = sharded_run
    sharded, single = BoardReader(str(board), "run"), BoardReader(str(board), "ref")
    assert single.versions() == [0, 1, 2]
    kinds = [sharded.manifest(v).kind for v in (0, 1, 2)]
    assert kinds[0] == "anchor"
    assert "delta" in kinds
    for v in (0, 1, 2):
        m = sharded.manifest(v)
        assert [len(s.pieces) > 0 for s in m.shards] == [True, True]  # both ranks hold pieces
        a = sharded.materialize(v, tmp_path / f"s{v}")
        b = single.materialize(v, tmp_path / f"r{v}")
        assert (a / WEIGHTS).read_bytes() == (b / WEIGHTS).read_bytes()
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    view: State = {}
    sharded.advance(view, None, 0)
    sharded.advance(view, 0, 2)
    full = load_file(str(tmp_path / "r2" / WEIGHTS))
    assert all(torch.equal(view[k], full[k]) for k in full)


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_sidecar_follows_a_sharded_run_and_serves_it_bit_exactly(
    sharded_run: tuple[Path, Path], tmp_path: Path
) -> None:
    board, _ = sharded_run
    follower = Board(str(board), "run")
    target = follower.latest()
    assert target is not None
    single = BoardReader(str(board), "ref" if target <= 2 else "ref-again")
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    for name, data in follower.base_files().items():
        (engine_dir / name).write_bytes(data)
    engine = Engine(engine_dir, dtype=torch.bfloat16)
    sidecar = Sidecar(
        ReferenceBackend(engine), follower, poll_interval_s=3600, registry=CollectorRegistry()
    )
    try:
        await sidecar.reconcile()
        assert sidecar.applied_version == target
        expected = single.load(target)[1]
        live = engine.live_tensors()
        assert live
        assert live.keys() <= expected.keys()
        for name, t in live.items():
            assert torch.equal(t.view(torch.int16), expected[name].view(torch.int16)), name
        choice = engine.generate(
            GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=4, n=1, seed=1)
        )[0]
        assert 1 <= len(choice.token_ids) == len(choice.logprobs)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_rank_killed_mid_publish_leaves_the_previous_version_and_republishing_works(
    sharded_run: tuple[Path, Path], tmp_path: Path
) -> None:
    board, model = sharded_run
    reader = BoardReader(str(board), "run")
    assert (reader.latest(), reader.versions()) == (2, [0, 1, 2])
    assert (board / "run/versions/00000003/shards/00001").is_dir()  # its files were written
    assert not (board / "run/versions/00000003/manifest.json").exists()
    with pytest.raises(BoardError, match="version 3 is not published"):
        reader.catch_up(2, 3)
    done = _torchrun(board, model, "3,4", "--ref-run", "ref-again")  # the restarted trainer
    assert done.returncode == 0, done.stdout + done.stderr
    assert reader.versions() == [0, 1, 2, 3, 4]
    single = BoardReader(str(board), "ref-again")
    for v in (3, 4):
        a = reader.materialize(v, tmp_path / f"s{v}")
        assert (a / WEIGHTS).read_bytes() == (
            single.materialize(v, tmp_path / f"r{v}") / WEIGHTS
        ).read_bytes()
