"""``bench device`` part ``publish``: ``Board.publish`` of a view that lives on the device, and a
board reader reading it back.

The ``view_mb`` bf16 view of the codec part is drawn on the device and published as version 0
(an anchor, copied to the host whole: ``anchor_s``); then ``publish_density`` of its values move
(:func:`orchestrator.bench.device_codec.moved`) and version 1 is published from the device
(``publish_s``): the publisher finds the changes on the device and only they cross to the host
(``to_host_bytes``, from :data:`policies.codec.scan.host_bytes`; ``to_host_vs_patch`` over the
delta's ``patch_bytes``). ``bytes_written``: what version 1 added to the board's files (its
patch, manifest and pointer). A reader (a :class:`policies.board.BoardReader` of its own)
loads version 0 (``reader_load_s``) and advances it to version 1 with the patch
(``reader_advance_s``); ``exact``: what it holds is the device's version 1, bit for bit, and
version 1 is a delta.

On a CPU the view is on the host: the publisher copies nothing across, and ``to_host_bytes`` is 0.
Target (issue #44): ``to_host_bytes`` ≤ 3 × the patch on an H200.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from orchestrator.bench.codec import make_view
from orchestrator.bench.device_codec import moved
from orchestrator.bench.device_scale import Device, Report, Scale
from policies.board import Board, BoardReader
from policies.codec import scan as device_scan

State = dict[str, torch.Tensor]
RUN = "bench"


def same_on_device(held: State, want: State) -> bool:
    """Whether the host view ``held`` is ``want`` (on any device) bit for bit, tensor by tensor
    moved to ``want``'s device (never the whole view at once)."""
    if held.keys() != want.keys():
        return False
    for name, t in want.items():
        got = held[name].to(t.device)
        if got.dtype != t.dtype or got.shape != t.shape:
            return False
        if not torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)):
            return False
    return True


def _files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(scale: Scale, device: Device, work: Path, report: Report) -> None:
    """The publish part, written to ``report`` step by step; the board lives under ``work`` and
    is removed at the end (a 16 GiB anchor)."""
    root = work / "boards" / "publish"
    shutil.rmtree(root, ignore_errors=True)
    try:
        _run(scale, device, root, report)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(scale: Scale, device: Device, root: Path, report: Report) -> None:
    view = make_view(scale.view_mb, seed=0, device=device)
    report.update(view_bytes=sum(t.nbytes for t in view.values()), density=scale.publish_density)
    board = Board(str(root), RUN)
    t0 = time.perf_counter()
    board.publish(0, view, view_name="bfloat16")
    report.update(anchor_s=time.perf_counter() - t0)
    anchored = _files_bytes(root)
    target = moved(view, scale.publish_density, seed=7)
    if device != "cpu":
        torch.cuda.synchronize(device)
    before = device_scan.host_bytes.total
    t0 = time.perf_counter()
    m = board.publish(1, target, view_name="bfloat16")
    publish_s = time.perf_counter() - t0
    crossed = device_scan.host_bytes.total - before
    delta = next(p for p in m.patches if p.base == 0)
    report.update(
        publish_s=publish_s,
        kind=m.kind,
        patch_bytes=delta.bytes,
        changed=delta.changed,
        bytes_written=_files_bytes(root) - anchored,
        to_host_bytes=crossed,
        to_host_vs_patch=crossed / delta.bytes,
    )
    del board, view  # the publisher's host copies (two views) are not the reader's memory
    reader = BoardReader(str(root), RUN)
    t0 = time.perf_counter()
    _, held = reader.load(0)
    report.update(reader_load_s=time.perf_counter() - t0)
    t0 = time.perf_counter()
    reader.advance(held, 0, 1)
    report.update(
        reader_advance_s=time.perf_counter() - t0,
        exact=m.kind == "delta" and same_on_device(held, target),
    )
