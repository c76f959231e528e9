"""What patches wrote (policies.codec.written): the frames an island hands its engine, replayed as
an engine does (policies.serve.backends.engine_changes), for single patches, chains, anchors and
sharded versions."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.board import Board, BoardOptions, BoardReader, ShardedPublisher
from policies.codec import apply_patch, encode_patch
from policies.codec.digests import checksums
from policies.codec.written import Written, recording
from policies.serve.backends.engine_changes import changes
from policies.serve.backends.engine_patch import engine_frames
from tests.support.boards import adam_like_step

State = dict[str, torch.Tensor]


def _state(seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16),
        "b": (torch.randn(300, generator=g) * 0.02).to(torch.bfloat16),
        "c": torch.randn(17, generator=g),
    }


def _units(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy().view(f"<u{t.element_size()}")


def _replayed(base: State, written: Written, target: State, in_place: bool = True) -> State:
    """``base`` moved by the recorded frames, read as an engine reads them (its values gathered
    at the positions each frame writes and checked against the frame's target checksums), one
    holding its tensors in place on the host or (``in_place`` false) elsewhere, as on an
    accelerator."""
    out = {k: v.clone() for k, v in base.items()}
    frames, replaced = engine_frames(written, target, checksums(base))

    class Engine:  # holds every tensor whole, in place
        def whole(self, name: str) -> np.ndarray | None:
            return _units(out[name]) if in_place else None

        def gather(self, name: str, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return np.ones(positions.size, dtype=bool), _units(out[name])[positions].copy()

    found = changes(frames, replaced, Engine())
    for name, (positions, new, _) in found.at.items():
        _units(out[name])[positions] = new
    for name, values in found.whole.items():
        t = target[name]
        out[name] = torch.from_numpy(values.view(np.uint8).copy()).view(t.dtype).reshape(t.shape)
    return out


def _same(a: State, b: State) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), density=st.sampled_from([0.001, 0.03, 0.3, 0.9]))
def test_the_positions_a_patch_wrote_rebuild_the_target_from_the_base(
    seed: int, density: float
) -> None:
    base = _state(seed)
    target = adam_like_step(base, seed + 1, density=density, float_noise=1e-3)
    patch = encode_patch(base, target)
    view = {k: v.clone() for k, v in base.items()}
    with recording() as written:
        apply_patch(view, patch)
    assert _same(view, target)
    assert not written.replaced
    assert [f.data for f in written.frames] == [patch]  # the patch itself, nothing re-encoded
    assert _same(_replayed(base, written, target), target)
    assert _same(_replayed(base, written, target, in_place=False), target)


def test_a_chain_replays_in_order_from_the_first_base() -> None:
    states = [_state(0)]
    for v in range(1, 4):
        states.append(adam_like_step(states[-1], v, density=0.2, float_noise=1e-3))
    view = {k: v.clone() for k, v in states[0].items()}
    total = Written()
    for before, after in itertools.pairwise(states):
        with recording() as step:
            apply_patch(view, encode_patch(before, after))
        total.merge(step)
    assert len(total.frames) == 3
    assert _same(_replayed(states[0], total, states[-1]), states[-1])
    wrong = {k: v.clone() for k, v in states[0].items()}
    wrong["b"].view(torch.int16)[:] ^= 1
    for in_place in (True, False):  # checked, whether read in place or word by word
        with pytest.raises(ValueError, match="not the ones the patch starts from"):
            _replayed(wrong, total, states[-1], in_place)


def test_nothing_is_recorded_outside_a_recording_and_a_board_anchor_counts_whole(
    tmp_path: Path,
) -> None:
    board = Board(str(tmp_path / "b"), "run", options=BoardOptions(anchor_fraction=100))
    s0 = _state(0)
    s1 = adam_like_step(s0, 1, density=0.05, float_noise=1e-3)
    board.publish(0, s0, view_name="bfloat16")
    board.publish(1, s1, view_name="bfloat16")
    view: State = {}
    with recording() as written:
        board.advance(view, None, 0)  # an anchor: every tensor replaced
    assert written.replaced == set(s0)
    assert not written.frames
    with recording() as written:
        board.advance(view, 0, 1)
    assert not written.replaced
    assert written.frames
    assert _same(_replayed(s0, written, view), view)


def test_pieces_of_a_sharded_version_are_recorded_with_their_boxes(tmp_path: Path) -> None:
    pub = ShardedPublisher(str(tmp_path / "s"), "run")
    s0 = _state(0)
    s1 = adam_like_step(s0, 1, density=0.05, float_noise=1e-3)
    pub.publish(0, s0, view_name="bf16")
    pub.publish(1, s1, view_name="bf16")
    reader = BoardReader(str(tmp_path / "s"), "run")
    view: State = {}
    reader.advance(view, None, 0)
    base = {k: v.clone() for k, v in view.items()}
    with recording() as written:
        reader.advance(view, 0, 1)
    assert written.frames
    assert all(f.boxes for f in written.frames)
    assert _same(_replayed(base, written, view), view)
    wrong = {k: v.clone() for k, v in base.items()}
    wrong["a"].view(torch.int16)[:, :] ^= 1  # an engine not on the version the frames start from
    with pytest.raises(ValueError, match="not the ones the patch starts from"):
        _replayed(wrong, written, view)


def test_a_tensor_new_to_the_patch_is_shipped_and_recorded_whole() -> None:
    base = _state(0)
    target = adam_like_step(base, 3, density=0.01)
    target["d"] = torch.randn(5)  # not in the base: a "full" record
    view = {k: v.clone() for k, v in base.items()}
    with recording() as written:
        apply_patch(view, encode_patch(base, target))
    assert not written.replaced  # the frame itself carries it whole
    assert _same(_replayed(base, written, target), target)
