"""A view on a device (a GPU trainer's) is published without copying it to the host whole: the
changes are found where the view lives and only they cross (policies/codec/scan.py
``host_copy``, policies/board/host.py).

Without a GPU the device path is driven with CPU tensors (``_on_device`` patched to say yes, and
every move to the host counted, wherever it comes from); the CUDA tests run where a GPU is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from policies.board import Board, BoardReader
from policies.board import host as board_host
from policies.board.sharded import ShardedPublisher
from policies.board.types import BoardOptions
from policies.codec import digests
from policies.codec import scan as device_scan
from policies.codec.digests import checksums
from policies.codec.scan import host_copy
from tests.support.boards import adam_like_step

State = dict[str, torch.Tensor]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _state(seed: int = 0) -> State:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    return {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: one storage under two names
        "layers.0.weight": torch.randn(96, 96, generator=g).to(torch.bfloat16),
        "layers.1.weight": torch.randn(96, 160, generator=g).to(torch.bfloat16),
        "norm.weight": torch.ones(96, dtype=torch.float32),
        "steps": torch.tensor([3], dtype=torch.int64),
    }


def _chain(n: int) -> list[State]:
    states = [_state()]
    for v in range(1, n):
        states.append(adam_like_step(states[-1], v, density=0.01, float_noise=1e-3))
    return states


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _same(a: State, b: State) -> bool:
    return set(a) == set(b) and all(_bits(a[k]) == _bits(b[k]) for k in a)


@pytest.fixture
def moved(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes moved through ``scan.to_host``, counted for CPU tensors too; each move makes new
    memory, as a copy from a device does."""
    counted: list[int] = []

    def counting(x: torch.Tensor) -> torch.Tensor:
        counted.append(x.numel() * x.element_size())
        return x.detach().cpu().clone()

    monkeypatch.setattr(device_scan, "to_host", counting)
    return counted


def test_the_host_copy_from_changes_is_the_target_bit_for_bit(moved: list[int]) -> None:
    base = _state()
    target = adam_like_step(base, 1, density=0.01, float_noise=1e-3)
    target["layers.1.weight"] = target["layers.1.weight"].reshape(160, 96).clone()  # reshaped
    target["new.weight"] = torch.randn(8, 8).to(torch.bfloat16)  # not in the base
    target["empty"] = torch.empty(0, dtype=torch.bfloat16)
    base["empty"] = torch.empty(0, dtype=torch.bfloat16)
    base_host = {k: v.clone() for k, v in base.items()}
    kept = {k: _bits(v) for k, v in base_host.items()}

    out, sums = host_copy(base_host, base, target)

    assert sums is None  # no base checksums given
    assert _same(out, target)
    assert out["embed.weight"] is out["lm_head.weight"]  # still tied
    assert {k: _bits(v) for k, v in base_host.items()} == kept  # the old host copy is untouched
    whole = sum(target[k].nbytes for k in ("layers.1.weight", "new.weight"))
    changed_bf16 = sum(
        int((base[k].view(torch.int16) != target[k].view(torch.int16)).sum())
        for k in ("embed.weight", "layers.0.weight")
    )
    # the changed tensors move whole; of the others only (int32 position, value) per change
    # crossed, and the float32 noise changes every value of norm.weight
    assert sum(moved) == whole + changed_bf16 * (4 + 2) + 96 * (4 + 4)


def test_the_host_copy_s_checksums_come_from_the_base_s_and_the_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given the base's ``sum-128`` checksums, a patched tensor's checksum is summed from them
    and the words its changes write; only tensors copied whole are hashed."""
    base = _state()
    target = adam_like_step(base, 1, density=0.01, float_noise=1e-3)
    target["layers.1.weight"] = target["layers.1.weight"].reshape(160, 96).clone()  # reshaped
    target["new.weight"] = torch.randn(8, 8).to(torch.bfloat16)  # not in the base
    target["same.weight"] = base["same.weight"] = torch.randn(4, 4)  # unchanged
    base_host = {k: v.clone() for k, v in base.items()}
    base_host["lm_head.weight"] = base_host["embed.weight"]  # tied on the host too
    hashed: list[str] = []

    def counting(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
        hashed.extend(tensors)
        return checksums(tensors)

    monkeypatch.setattr(device_scan, "checksums", counting)
    out, sums = host_copy(base_host, base, target, checksums(base_host))

    assert _same(out, target)
    assert sums == checksums(out)
    assert sorted(hashed) == ["layers.1.weight", "new.weight"]


def _publish_chain(board: Board, states: list[State]) -> None:
    for v, s in enumerate(states):
        board.publish(v, s, view_name="bfloat16")


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a board but the STREAM object (its id is random), by relative path."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "STREAM"
    }


def _manifests_equal(a: Path, b: Path, versions: int) -> None:
    ra, rb = BoardReader(str(a), "run"), BoardReader(str(b), "run")
    for v in range(versions):
        ma, mb = ra.manifest(v), rb.manifest(v)
        assert ma.model_dump(exclude={"created_at", "seal"}) == mb.model_dump(
            exclude={"created_at", "seal"}
        )


def test_a_device_view_publishes_the_same_versions_moving_only_its_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moved: list[int]
) -> None:
    states = _chain(6)
    opts = BoardOptions(anchor_every=4, anchor_fraction=5)
    _publish_chain(Board(str(tmp_path / "host"), "run", options=opts), states)

    monkeypatch.setattr(board_host, "_on_device", lambda view: True)
    hashed: list[int] = []
    tensor_checksum = digests.tensor_checksum

    def counting(t: torch.Tensor) -> str:
        hashed.append(t.nbytes)
        return tensor_checksum(t)

    monkeypatch.setattr(digests, "tensor_checksum", counting)
    device = Board(str(tmp_path / "device"), "run", options=opts)
    per_version, hashed_per_version = [], []
    with capture_logs() as logs:
        for v, s in enumerate(states):
            before, hashed_before = sum(moved), sum(hashed)
            device.publish(v, s, view_name="bfloat16")
            per_version.append(sum(moved) - before)
            hashed_per_version.append(sum(hashed) - hashed_before)
    # after the first version, the host copy's checksums are summed from the changes
    assert hashed_per_version[1:] == [0] * (len(states) - 1), hashed_per_version

    _manifests_equal(tmp_path / "host", tmp_path / "device", len(states))
    host_files, device_files = _files(tmp_path / "host"), _files(tmp_path / "device")
    patches = [k for k in host_files if k.endswith(".patch")]
    assert patches
    assert {k: device_files[k] for k in patches} == {k: host_files[k] for k in patches}
    reader = BoardReader(str(tmp_path / "device"), "run")
    assert all(_same(reader.load(v)[1], s) for v, s in enumerate(states))

    view_bytes = sum(t.nbytes for k, t in states[0].items() if k != "lm_head.weight")
    assert per_version[0] == view_bytes  # the first version: the whole view
    # the deltas (and the anchor at 4, built from the changes too): the float32 norm changes
    # wholly, the bf16 tensors by 1%
    assert all(n < 0.2 * view_bytes for n in per_version[1:]), per_version
    published = [e for e in logs if e["event"] == "board.published"]
    assert [e["version"] for e in published] == list(range(6))
    assert all("to_host_bytes" in e for e in published)


def test_a_restarted_device_publisher_copies_its_first_view_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moved: list[int]
) -> None:
    monkeypatch.setattr(board_host, "_on_device", lambda view: True)
    states = _chain(3)
    url = str(tmp_path / "b")
    Board(url, "run").publish(0, states[0], view_name="bfloat16")
    again = Board(url, "run")  # holds no views: anchors, copying the view whole
    moved.clear()
    m = again.publish(1, states[1], view_name="bfloat16")
    assert m.kind == "anchor"
    assert sum(moved) == sum(t.nbytes for k, t in states[1].items() if k != "lm_head.weight")
    again.publish(2, states[2], view_name="bfloat16")
    assert _same(BoardReader(url, "run").load(2)[1], states[2])


def test_live_parameters_changed_in_place_are_copied_whole_not_scanned_against_themselves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moved: list[int]
) -> None:
    monkeypatch.setattr(board_host, "_on_device", lambda view: True)
    live = _state()
    board = Board(str(tmp_path / "b"), "run")
    board.publish(0, live, view_name="bfloat16")
    for v in (1, 2):
        stepped = adam_like_step(live, v, density=0.01)
        for name, t in live.items():  # the optimizer's in-place update of the same tensors
            t.copy_(stepped[name])
        moved.clear()
        board.publish(v, live, view_name="bfloat16")
        assert sum(moved) == sum(t.nbytes for k, t in live.items() if k != "lm_head.weight")
        assert _same(BoardReader(str(tmp_path / "b"), "run").load(v)[1], live)


def test_a_sharded_publisher_on_a_device_writes_what_it_writes_from_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moved: list[int]
) -> None:
    states = _chain(4)
    opts = BoardOptions(anchor_fraction=5)
    host = ShardedPublisher(str(tmp_path / "host"), "run", options=opts)
    for v, s in enumerate(states):
        host.publish(v, s, view_name="bf16")
    monkeypatch.setattr(board_host, "_on_device", lambda view: True)
    device = ShardedPublisher(str(tmp_path / "device"), "run", options=opts)
    for v, s in enumerate(states):
        moved.clear()
        device.publish(v, s, view_name="bf16")
        if v:
            assert 0 < sum(moved) < 0.2 * sum(t.nbytes for t in states[0].values())
    _manifests_equal(tmp_path / "host", tmp_path / "device", len(states))
    reader = BoardReader(str(tmp_path / "device"), "run")
    for v in range(len(states)):
        expected = BoardReader(str(tmp_path / "host"), "run").load(v)[1]
        assert _same(reader.load(v)[1], expected)


@CUDA
def test_a_cuda_view_is_published_as_its_host_copy_and_only_its_changes_cross(
    tmp_path: Path,
) -> None:
    states = _chain(4)
    opts = BoardOptions(anchor_fraction=5)
    _publish_chain(Board(str(tmp_path / "host"), "run", options=opts), states)
    device = Board(str(tmp_path / "device"), "run", options=opts)
    with capture_logs() as logs:
        for v, s in enumerate(states):
            made: dict[int, torch.Tensor] = {}
            on_gpu = {k: made.setdefault(id(t), t.cuda()) for k, t in s.items()}
            device.publish(v, on_gpu, view_name="bfloat16")
    _manifests_equal(tmp_path / "host", tmp_path / "device", len(states))
    crossed = [e["to_host_bytes"] for e in logs if e["event"] == "board.published"]
    view_bytes = sum(t.nbytes for k, t in states[0].items() if k != "lm_head.weight")
    assert crossed[0] == view_bytes
    assert all(0 < n < 0.2 * view_bytes for n in crossed[1:]), crossed
