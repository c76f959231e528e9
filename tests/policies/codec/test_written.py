"""Where patches wrote (policies.codec.written): the positions and old values an island turns
into an engine patch, for single patches, chains, anchors and sharded versions."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.board import Board, BoardOptions, BoardReader, ShardedPublisher
from policies.codec import apply_patch, encode_patch
from policies.codec.written import Written, recording
from tests.support.boards import adam_like_step

State = dict[str, torch.Tensor]


def _state(seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16),
        "b": (torch.randn(300, generator=g) * 0.02).to(torch.bfloat16),
        "c": torch.randn(17, generator=g),
    }


def _replayed(base: State, written: Written, target: State) -> State:
    """``base`` with the recorded positions set to ``target``'s values (what an engine does)."""
    out = {k: v.clone() for k, v in base.items()}
    for name in written.replaced:
        out[name] = target[name].clone()
    for name in written.parts:
        ch = written.take(name, target[name])
        flat = out[name].reshape(-1)
        assert torch.equal(flat[ch.positions].view(torch.uint8), ch.old.view(torch.uint8))
        flat[ch.positions] = ch.new
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
    assert _same(_replayed(base, written, target), target)
    for name in written.parts:  # every value that changed is among the positions
        changed = np.flatnonzero(
            (base[name].reshape(-1).view(torch.uint8).reshape(base[name].numel(), -1)
             != target[name].reshape(-1).view(torch.uint8).reshape(target[name].numel(), -1))
            .any(dim=1).numpy()
        )  # fmt: skip
        assert set(changed) <= set(written.take(name, target[name]).positions.tolist())


def test_a_chain_keeps_each_position_once_with_its_value_before_the_first_patch() -> None:
    states = [_state(0)]
    for v in range(1, 4):
        states.append(adam_like_step(states[-1], v, density=0.2, float_noise=1e-3))
    view = {k: v.clone() for k, v in states[0].items()}
    total = Written()
    for before, after in itertools.pairwise(states):
        with recording() as step:
            apply_patch(view, encode_patch(before, after))
        total.merge(step)
    assert _same(_replayed(states[0], total, states[-1]), states[-1])
    ch = total.take("a", states[-1]["a"])
    assert torch.equal(ch.positions, torch.unique(ch.positions))


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
    assert not written.parts
    with recording() as written:
        board.advance(view, 0, 1)
    assert not written.replaced
    assert set(written.parts) <= set(s0)
    assert _same(_replayed(s0, written, view), view)


def test_pieces_of_a_sharded_version_are_recorded_in_their_full_tensor(tmp_path: Path) -> None:
    inner = Written()
    piece = torch.arange(12, dtype=torch.int64)  # piece (3, 4) at offset (2, 4) of (6, 8)
    inner.add("w", np.array([0, 5, 11]), piece[[0, 5, 11]])
    outer = Written()
    outer.add_boxes(inner, {"w": ([3, 4], [2, 4], [6, 8])})
    got = outer.take("w", torch.zeros(6, 8, dtype=torch.int64)).positions.tolist()
    assert got == [2 * 8 + 4, 3 * 8 + 5, 4 * 8 + 7]

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
    assert written.parts
    assert _same(_replayed(base, written, view), view)


def test_a_tensor_new_to_the_patch_is_shipped_and_recorded_whole() -> None:
    base = _state(0)
    target = adam_like_step(base, 3, density=0.01)
    target["d"] = torch.randn(5)  # not in the base: a "full" record
    view = {k: v.clone() for k, v in base.items()}
    with recording() as written:
        apply_patch(view, encode_patch(base, target))
    assert written.replaced == {"d"}
    assert _same(_replayed({**base, "d": torch.zeros(5)}, written, target), target)
