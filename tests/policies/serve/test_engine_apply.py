"""Engine patches (the board's frames) applied in checkpoint coordinates to a model whose loader
fuses, slices and converts as vLLM's do (param_map, engine_changes, engine_apply, engine_patch):
exact, checked, all or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policies.codec import encode_patch
from policies.codec.digests import checksums
from policies.codec.written import Frame
from policies.serve.backends.engine_apply import EngineWeights
from policies.serve.backends.engine_patch import encode, file_digest, read, whole_frame, write
from policies.serve.backends.param_map import learn
from tests.support.boards import adam_like_step

State = dict[str, torch.Tensor]
BF16 = torch.bfloat16


class FusedModel(torch.nn.Module):
    """q, k and v fused into one parameter (as vLLM's ``qkv_proj``), this rank holding half of
    each's rows (tensor parallelism, rank 1 of 2); ``norm`` loaded through a conversion (no
    box of the checkpoint: left to the engine's own loader); ``embed`` plain."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * 4, 6, dtype=BF16), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(10, 6, dtype=BF16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(6, dtype=BF16), requires_grad=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            if name in ("q", "k", "v"):
                shard = "qkv".index(name)
                dst = self.qkv.data.narrow(0, 4 * shard, 4)
                dst.copy_(t.narrow(0, 4, 4))  # rank 1's half of the rows
            elif name == "embed":
                self.embed.data.copy_(t)
            else:
                self.norm.data.copy_((t.float() * 1.0).to(BF16))  # a converted copy


def _checkpoint(seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (8, 6), "k": (8, 6), "v": (8, 6), "embed": (10, 6), "norm": (6,)}
    return {n: torch.randn(s, generator=g).to(BF16) for n, s in shapes.items()}


def _engine(model: FusedModel, ckpt: State, loaded: list[str]) -> EngineWeights:
    pmap = learn(model.load_weights, model.named_parameters(), ckpt.items())
    copies = {n: ckpt[n].reshape(-1).clone() for n in pmap.unmapped}

    def load_sparse(tensors: list[tuple[str, tuple[int, ...], torch.Tensor, torch.Tensor]]) -> None:
        for name, shape, _, _ in tensors:  # the copy holds the new values already
            loaded.append(name)
            full = copies[name].view(shape).clone()
            model.load_weights([(name, full)])

    return EngineWeights(pmap, copies, load_sparse)


def _held(model: FusedModel) -> State:
    """What rank 1 holds of each checkpoint tensor, in checkpoint form."""
    return {
        "q": model.qkv[0:4].clone(),
        "k": model.qkv[4:8].clone(),
        "v": model.qkv[8:12].clone(),
        "embed": model.embed.clone(),
        "norm": model.norm.clone(),
    }


def _rank1(ckpt: State) -> State:
    return {n: (t[4:8] if n in "qkv" else t).clone() for n, t in ckpt.items()}


def _same(a: State, b: State) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def _frame(base: State, target: State, sums: bool = True) -> Frame:
    """The board's patch ``base`` → ``target``, as the shadow keeps it."""
    return Frame(encode_patch(base, target), checksums(base) if sums else None)


def _patch(
    frames: list[Frame], tmp: Path, replaced: frozenset[str] = frozenset()
) -> tuple[str, str]:
    data = encode(frames, set(replaced), 1)
    path = tmp / "p"
    write(path, data)
    return str(path), file_digest(data)


def _expected(ckpt: State) -> dict[str, tuple[str, list[int]]]:
    return {n: ("bfloat16", list(t.shape)) for n, t in ckpt.items()}


def _changed(base: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    flat_b, flat_t = base.reshape(-1).view(torch.int16), target.reshape(-1).view(torch.int16)
    return torch.nonzero(flat_b != flat_t).reshape(-1)


def test_fused_sliced_and_converted_tensors_are_patched_exactly(tmp_path: Path) -> None:
    model, ckpt, loaded = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, loaded)
    assert engine.map.unmapped == {"norm"}  # its loader converts: no box of the checkpoint
    assert {b.param for b in engine.map.boxes["k"]} == {"qkv"}
    assert _same(_held(model), _rank1(ckpt))
    target = adam_like_step(ckpt, 1, density=0.3)
    path, digest = _patch([_frame(ckpt, target)], tmp_path)
    version, frames, replaced = read(path, digest, _expected(ckpt))
    engine.apply(version, frames, replaced)
    assert _same(_held(model), _rank1(target))  # rank 1's rows only; the rest is rank 0's
    assert loaded == ["norm"]
    footprint = engine.footprint()
    assert footprint.held == {"q": 24, "k": 24, "v": 24, "embed": 60, "norm": 6}
    assert footprint.version == 1
    for name in ckpt:  # of q, k and v, only the positions in rank 1's rows (24 … 47)
        pos = _changed(ckpt[name], target[name])
        assert footprint.offered[name] >= pos.numel()  # a dense chunk offers all its units
        rows = (pos >= 24) & (pos < 48) if name in ("q", "k", "v") else torch.ones_like(pos) > 0
        assert footprint.written[name] >= int(rows.sum()), name
    assert engine.undo(1)
    assert engine.footprint().version is None
    assert _same(_held(model), _rank1(ckpt))
    assert not engine.undo(1)  # only the last update, once


def test_a_chain_of_frames_and_a_tensor_replaced_whole_end_at_the_last_version(
    tmp_path: Path,
) -> None:
    """Versions staged and not served yet travel as their frames in order; a tensor replaced
    whole (an anchor) skips its frames and is written from the last one."""
    model, ckpt, _ = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, [])
    v1 = adam_like_step(ckpt, 1, density=0.2)
    v2 = adam_like_step(v1, 2, density=0.2)
    v2["embed"] = torch.randn(10, 6).to(BF16)  # as an anchor would bring it
    frames = [_frame(ckpt, v1), _frame(v1, v2, sums=False), whole_frame({"embed": v2["embed"]})]
    path, digest = _patch(frames, tmp_path, frozenset({"embed"}))
    engine.apply(*read(path, digest, _expected(ckpt)))
    assert _same(_held(model), _rank1(v2))


def test_frames_of_pieces_are_written_into_their_tensors(tmp_path: Path) -> None:
    """A sharded board's frames cover boxes of tensors (each rank's rows)."""
    model, ckpt, _ = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, [])
    target = adam_like_step(ckpt, 1, density=0.5)
    frames = []
    for lo, hi in ((0, 4), (4, 8)):  # two trainer ranks, four rows of q each
        piece = {"q": ckpt["q"][lo:hi].clone()}
        frame = _frame(piece, {"q": target["q"][lo:hi].clone()})
        frames.append(Frame(frame.data, frame.base_checksums, {"q": ((4, 6), (lo, 0), (8, 6))}))
    path, digest = _patch(frames, tmp_path)
    engine.apply(*read(path, digest, _expected(ckpt)))
    assert torch.equal(model.qkv[0:4].view(torch.int16), target["q"][4:8].view(torch.int16))


def test_a_patch_for_other_weights_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model, ckpt, loaded = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, loaded)
    other = adam_like_step(ckpt, 9, density=0.3)
    frame = Frame(encode_patch(other, adam_like_step(other, 1, 0.3)), checksums(ckpt))
    path, digest = _patch([frame], tmp_path)  # made from another base, checked as ours
    with pytest.raises(ValueError, match="not the ones the patch starts from"):
        engine.apply(*read(path, digest, _expected(ckpt)))
    assert _same(_held(model), _rank1(ckpt))
    assert loaded == []


def _ulp_up(state: State, name: str, unit: int) -> State:
    """``state`` with value ``unit`` of ``name`` one ulp up (an Adam-sized step, stored as a
    delta) and every other tensor as it is."""
    out = {n: t.clone() for n, t in state.items()}
    out[name].view(torch.int16).reshape(-1)[unit] += 1
    return out


@pytest.mark.parametrize(
    ("name", "chain"), [("embed", False), ("norm", False), ("embed", True)]
)  # held in a parameter, as a host copy; and gathered (an earlier frame changed the tensor)
def test_a_value_held_wrong_where_the_patch_writes_is_refused(
    tmp_path: Path, name: str, chain: bool
) -> None:
    """Issue #42: a value the engine holds wrong (damaged since it was loaded) that the patch
    then changes by one ulp survived the delta and cancelled out of the checksum moved by the
    writes (one change in its word); the words the patch changes must hold what its base held
    there."""
    model, ckpt, loaded = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, loaded)
    frames = [_frame(ckpt, v1 := _ulp_up(ckpt, name, 1))]
    if chain:  # the second frame changes another word than the first
        frames.append(_frame(v1, _ulp_up(v1, name, 5)))
    held = model.embed.data if name == "embed" else engine.copies["norm"]
    held.view(torch.int16).reshape(-1)[5 if chain else 1] ^= 1 << 4
    before = _held(model)
    path, digest = _patch(frames, tmp_path)
    with pytest.raises(ValueError, match=f"{name}: .*not the ones the patch starts from"):
        engine.apply(*read(path, digest, _expected(ckpt)))
    assert _same(_held(model), before)  # nothing written
    assert loaded == []


def test_a_write_that_fails_midway_is_undone(tmp_path: Path) -> None:
    model, ckpt, _ = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, [])

    def broken(tensors: list[tuple[str, tuple[int, ...], torch.Tensor, torch.Tensor]]) -> None:
        raise RuntimeError("the loader raised")

    path, digest = _patch([_frame(ckpt, adam_like_step(ckpt, 1, density=0.3))], tmp_path)
    engine.load_sparse = broken
    with pytest.raises(RuntimeError, match="the loader raised"):
        engine.apply(*read(path, digest, _expected(ckpt)))
    engine.load_sparse = lambda tensors: None
    assert _same(_held(model), _rank1(ckpt))
    assert engine.last is None


@pytest.mark.parametrize("damage", ["digest", "frame", "name", "shape", "trailing"])
def test_a_damaged_or_foreign_engine_patch_is_refused_naming_what(
    tmp_path: Path, damage: str
) -> None:
    ckpt = _checkpoint(0)
    target = adam_like_step(ckpt, 1, density=0.3)
    expected = _expected(ckpt)
    if damage == "name":
        expected.pop("embed")
    if damage == "shape":
        expected["embed"] = ("bfloat16", [6, 10])
    data = encode([_frame(ckpt, target)], set(), 1)
    if damage == "frame":  # a byte of the frame flipped, the file's digest made to match
        data = data[:-40] + bytes([data[-40] ^ 1]) + data[-39:]
    if damage == "trailing":
        data += b"x"
    write(tmp_path / "p", data)
    digest = file_digest(data) if damage != "digest" else "0" * 32
    match = {"digest": "digest", "frame": "checksum", "name": "embed", "shape": "embed"}
    with pytest.raises(ValueError, match=match.get(damage, "after the last frame")):
        read(str(tmp_path / "p"), digest, expected)


def test_whole_tensors_are_copied_into_their_runs_and_undone(tmp_path: Path) -> None:
    model, ckpt, loaded = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, loaded)
    target = _checkpoint(1)
    path, digest = _patch([whole_frame(target)], tmp_path, frozenset(target))
    engine.apply(*read(path, digest, _expected(ckpt)))
    assert _same(_held(model), _rank1(target))
    assert loaded == ["norm"]
    assert engine.undo(1)
    assert _same(_held(model), _rank1(ckpt))
