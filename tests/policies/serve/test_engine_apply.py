"""Engine patches applied in checkpoint coordinates to a model whose loader fuses, slices and
converts as vLLM's do (param_map, engine_apply, engine_patch): exact, all or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policies.serve.backends.engine_apply import EngineWeights
from policies.serve.backends.engine_patch import (
    EngineTensor,
    delta,
    encode,
    file_digest,
    read,
    unit_sum,
    write,
)
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


def _patch(base: State, target: State, tmp: Path) -> tuple[str, str]:
    tensors = []
    for name, t in target.items():
        flat_b, flat_t = base[name].reshape(-1), t.reshape(-1)
        pos = torch.nonzero(flat_b.view(torch.int16) != flat_t.view(torch.int16)).reshape(-1)
        old, new = flat_b[pos], flat_t[pos]
        tensors.append(
            EngineTensor(name, tuple(t.shape), "delta", delta(old, new), pos, unit_sum(old))
        )
    data = encode(tensors, 1)
    path = tmp / "p"
    write(path, data)
    return str(path), file_digest(data)


def _expected(ckpt: State) -> dict[str, tuple[str, list[int]]]:
    return {n: ("bfloat16", list(t.shape)) for n, t in ckpt.items()}


def test_fused_sliced_and_converted_tensors_are_patched_exactly(tmp_path: Path) -> None:
    model, ckpt, loaded = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, loaded)
    assert engine.map.unmapped == {"norm"}  # its loader converts: no box of the checkpoint
    assert {b.param for b in engine.map.boxes["k"]} == {"qkv"}
    assert _same(_held(model), _rank1(ckpt))
    target = adam_like_step(ckpt, 1, density=0.3)
    path, digest = _patch(ckpt, target, tmp_path)
    version, tensors = read(path, digest, _expected(ckpt))
    engine.apply(version, tensors)
    assert _same(_held(model), _rank1(target))  # rank 1's rows only; the rest is rank 0's
    assert loaded == ["norm"]
    footprint = engine.footprint()
    assert footprint.held == {"q": 24, "k": 24, "v": 24, "embed": 60, "norm": 6}
    assert footprint.version == 1
    assert footprint.offered == {t.name: t.values.numel() for t in tensors}
    for t in tensors:  # of q, k and v, only the positions in rank 1's rows (24 … 47)
        assert t.positions is not None
        rows = (t.positions >= 24) & (t.positions < 48)
        mine = rows if t.name in ("q", "k", "v") else torch.ones_like(t.positions, dtype=torch.bool)
        assert footprint.written.get(t.name, 0) == int(mine.sum()), t.name
    assert engine.undo(1)
    assert engine.footprint().version is None
    assert _same(_held(model), _rank1(ckpt))
    assert not engine.undo(1)  # only the last update, once


def test_a_patch_for_other_weights_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model, ckpt, loaded = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, loaded)
    target = adam_like_step(ckpt, 1, density=0.3)
    path, digest = _patch(adam_like_step(ckpt, 9, density=0.3), target, tmp_path)  # another base
    _, tensors = read(path, digest, _expected(ckpt))
    with pytest.raises(ValueError, match="not the ones the patch starts from"):
        engine.apply(1, tensors)
    assert _same(_held(model), _rank1(ckpt))
    assert loaded == []


def test_a_write_that_fails_midway_is_undone(tmp_path: Path) -> None:
    model, ckpt, _ = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, [])

    def broken(tensors: list[tuple[str, tuple[int, ...], torch.Tensor, torch.Tensor]]) -> None:
        raise RuntimeError("the loader raised")

    target = adam_like_step(ckpt, 1, density=0.3)
    path, digest = _patch(ckpt, target, tmp_path)
    _, tensors = read(path, digest, _expected(ckpt))
    engine.load_sparse = broken
    with pytest.raises(RuntimeError, match="the loader raised"):
        engine.apply(1, tensors)
    engine.load_sparse = lambda tensors: None
    assert _same(_held(model), _rank1(ckpt))
    assert engine.last is None


@pytest.mark.parametrize(
    "damage",
    ["digest", "name", "position"],
)
def test_a_damaged_or_foreign_engine_patch_is_refused_naming_what(
    tmp_path: Path, damage: str
) -> None:
    ckpt = _checkpoint(0)
    name = "embed" if damage != "name" else "nope"
    pos = torch.tensor([3, 59 if damage != "position" else 60])
    old = ckpt["embed"].reshape(-1)[pos % 60]
    changes = delta(old, old * 2)
    data = encode([EngineTensor(name, (10, 6), "delta", changes, pos, unit_sum(old))], 1)
    path = tmp_path / "p"
    write(path, data)
    digest = file_digest(data) if damage != "digest" else "0" * 32
    expected = _expected(ckpt)
    with pytest.raises(
        ValueError, match={"digest": "digest", "name": "nope", "position": "past"}[damage]
    ):
        read(str(path), digest, expected)


def test_whole_tensors_are_copied_into_their_runs_and_undone(tmp_path: Path) -> None:
    model, ckpt, loaded = FusedModel(), _checkpoint(0), []
    engine = _engine(model, ckpt, loaded)
    target = _checkpoint(1)
    tensors = [EngineTensor(n, tuple(t.shape), "dense", t.reshape(-1)) for n, t in target.items()]
    data = encode(tensors, 1)
    write(tmp_path / "p", data)
    _, read_back = read(str(tmp_path / "p"), file_digest(data), _expected(ckpt))
    engine.apply(1, read_back)
    assert _same(_held(model), _rank1(target))
    assert loaded == ["norm"]
    assert engine.undo(1)
    assert _same(_held(model), _rank1(ckpt))
