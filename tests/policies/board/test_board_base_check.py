"""A reader whose view was damaged in memory where the next patch writes (issue #42): the patch is
refused, naming the tensor, without blaming the patch file, and a shadow reloads from an anchor
instead of serving a wrong value — for a published patch and for one followed as it streams."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from structlog.testing import capture_logs

from policies.board import Board, stream_publish
from policies.board import stream as board_stream
from policies.board.types import Stream, chunk_file
from policies.errors import BoardError, PatchBaseCorrupt
from policies.serve.backends.shadow import Shadow

MakeBoard = Callable[..., Board]
State = dict[str, torch.Tensor]
NAMES = ["embed.weight", "layers.0.weight", "layers.1.weight"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """One tensor per chunk (a streamed patch of three chunks)."""
    monkeypatch.setattr(stream_publish, "CHUNK_VIEW_BYTES", 1)


def _views() -> list[State]:
    """Three versions: each moves 1% of the values one ulp (stored as deltas, as Adam's steps)."""
    gen = torch.Generator().manual_seed(0)
    views = [{n: (torch.randn(64, 256, generator=gen) * 0.02).to(torch.bfloat16) for n in NAMES}]
    for _ in range(2):
        nxt = {}
        for n, t in views[-1].items():
            bits = t.clone().view(torch.int16).reshape(-1)
            bits[torch.randint(0, bits.numel(), (160,), generator=gen)] += 1
            nxt[n] = bits.view(torch.bfloat16).reshape(t.shape)
        views.append(nxt)
    return views


def _damaged(held: State, base: State, target: State, name: str) -> State:
    """``held`` with one bit flipped in a value of ``name`` that ``base → target`` moves, the
    only change in its 64-bit word (where the damage cancelled out of the checksum alone)."""
    b, t = base[name].view(torch.int16).reshape(-1), target[name].view(torch.int16).reshape(-1)
    per_word = (b != t).reshape(-1, 4).sum(dim=1)
    unit = int(torch.nonzero((b != t) & (per_word == 1).repeat_interleave(4))[0])
    out = {n: v.clone() for n, v in held.items()}
    out[name].view(torch.int16).reshape(-1)[unit] ^= 1 << 5
    return out


def _same(a: State, b: State) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def test_a_patch_onto_a_damaged_view_is_refused_and_the_shadow_reloads_from_an_anchor(
    make_board: MakeBoard,
) -> None:
    views = _views()
    board = make_board(anchor_every=100)
    for v, view in enumerate(views):
        board.publish(v, view, view_name="bfloat16")
    reader = make_board()
    held = _damaged(reader.load(1)[1], views[1], views[2], "layers.1.weight")
    with pytest.raises(
        PatchBaseCorrupt,
        match=r"version 2: from-00000001/00002\.patch: layers\.1\.weight: the base",
    ):
        reader.advance(held, 1, 2)
    # the patch is sound: it stays in this reader's plans
    assert [(s.base, s.version) for s in reader.catch_up(1, 2).steps] == [(1, 2)]
    shadow = Shadow("reference")
    shadow.view = _damaged(reader.load(1)[1], views[1], views[2], "layers.1.weight")
    shadow.version = 1
    with capture_logs() as logs:
        staged = shadow.stage(reader, 2)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "patch_failed_reloading_anchor"
    ]
    assert staged.version == 2
    assert shadow.view is not None
    assert _same(shadow.view, views[2])  # from the anchor, never the damaged value


def test_a_streamed_chunk_onto_a_damaged_view_is_given_up(make_board: MakeBoard) -> None:
    """Followed while it streams, the damaged view's chunk fails its check: the stream is given
    up (the shadow then reloads through the published version's anchor route)."""
    views = _views()
    board = make_board(anchor_every=100)
    for v, view in enumerate(views[:2]):
        board.publish(v, view, view_name="bfloat16")
    m = board.manifest(1)
    ref = next(p for p in m.patches if p.base == 0)
    chunks = {
        chunk_file(0, i): board.read_exact(1, chunk_file(0, i), c.bytes)
        for i, c in enumerate(ref.chunks)
    }
    stream = Stream(
        version=1,
        id="s",
        bases={0: board.manifest(0).digest},
        chunks=[[n] for n in NAMES],
        limits=[c.bytes for c in ref.chunks],
    )
    source = board_stream.StreamSource(
        chunk=lambda rel, limit: chunks.get(rel), stream=lambda: stream, latest=lambda: 0
    )
    held = _damaged(board.load(0)[1], views[0], views[1], "layers.0.weight")
    sums = board_stream.sum_checksums(board.manifest(0))
    with pytest.raises(BoardError, match=r"00001\.patch \(.*layers\.0\.weight: the base words"):
        board_stream.follow(held, 0, stream, source, where="test", base_checksums=sums)
