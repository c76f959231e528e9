"""Pure board planning: which patches a publisher writes, catch-up routes, retention."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.board.plan import keep_views, patch_bases, plan, removable
from policies.board.types import Manifest, PatchRef


def _board(n: int, levels: int, anchor_every: int) -> dict[int, Manifest]:
    """Manifests a publisher following the rules writes for versions 0..n-1 (sizes ∝ span)."""
    out: dict[int, Manifest] = {}
    held: set[int] = set()
    for v in range(n):
        bases = patch_bases(v, v - 1 if v else None, held, levels)
        anchor = v % anchor_every == 0
        refs = [
            PatchRef(base=b, file=f"from-{b:08d}.patch", bytes=10 * (v - b), changed=1, units=1,
                     base_digest="x")
            for b in bases
        ]  # fmt: skip
        out[v] = Manifest(
            version=v, kind="anchor" if anchor else "delta", base=None if anchor else v - 1,
            view="bf16", codec="c", tensors={}, digest="d", bytes=10_000 if anchor else 10,
            created_at=0.0, patches=refs,
        )  # fmt: skip
        held = keep_views(v, held | {v}, levels)
        assert len(held) <= levels + 1
    return out


BOARD = _board(140, levels=5, anchor_every=1000)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 138), st.integers(1, 32))
def test_catch_up_needs_at_most_log2_k_plus_one_patches(have: int, k: int) -> None:
    want = min(have + k, 139)
    k = want - have
    route = plan(BOARD, have, want)
    assert route is not None
    assert route.anchor is None
    assert len(route.steps) <= math.floor(math.log2(k)) + 1
    cur = have
    for s in route.steps:  # a connected chain from have to want
        assert s.base == cur
        cur = s.version
    assert cur == want


def test_patch_bases_are_the_previous_version_and_dyadic_boundaries() -> None:
    held = set(range(32))
    assert patch_bases(13, 12, held, 3) == [12, 8]
    assert patch_bases(16, 15, held, 4) == [15, 14, 12, 8, 0]
    assert patch_bases(16, 15, {15, 8}, 4) == [15, 8]
    assert keep_views(12, set(range(13)), 3) == {12, 8}
    assert keep_views(12, set(range(13)), 4) == {12, 8, 0}


def test_far_behind_or_fresh_replica_starts_at_an_anchor() -> None:
    board = _board(40, levels=2, anchor_every=10)
    fresh = plan(board, None, 37)
    assert fresh is not None
    assert fresh.anchor == 30
    assert len(fresh.steps) <= 3
    behind = plan(board, 1, 37)  # a patch chain exists, but the anchor route moves fewer bytes
    assert behind is not None
    assert behind.bytes <= 10_000 + 10 * 7


def test_no_route_without_an_anchor_or_chain() -> None:
    board = {v: m for v, m in _board(10, 2, 5).items() if v > 5}
    assert plan(board, None, 8) is None
    assert plan(board, 8, 8) is not None


def test_retention_keeps_the_anchor_under_keep_from_and_everything_after() -> None:
    kinds = {v: "anchor" if v % 5 == 0 else "delta" for v in range(21)}
    assert removable(kinds, 12, 20) == list(range(10))
    assert removable(kinds, 10, 20) == list(range(10))
    assert removable({v: "delta" for v in range(5)}, 3, 4) == []
    assert removable(kinds, 25, 20) == list(range(20))  # latest is always kept
