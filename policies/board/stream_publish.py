"""Streamed publish, the publisher's half: a version's patches cut into chunks, written in order.

A publisher holding the previous view (:meth:`policies.board.Board.publish`) cuts the version's
tensors into chunks (:func:`plan_chunks`: whole tensors in name order, names sharing a storage
together, at least :data:`CHUNK_VIEW_BYTES` of view each) and announces them in the run's
``STREAM`` object (:func:`announce`, a :class:`~policies.board.types.Stream`: version, a new id,
the base (the previous version) and its digest, each chunk's tensor names and size limit; the
catch-up patches written after the commit go through the same :func:`write_chunks`,
unannounced). It then encodes the chunks one after another, each a complete sprawl patch frame of
its tensors (:func:`policies.codec.encode_patch` with the base's digest and the target's
checksums), and writes chunk ``i`` of the patch from ``u`` to
``versions/<v>/from-<u:08d>/<i:05d>.patch`` (:func:`~policies.board.types.chunk_file`) as soon as
it is encoded, while the next :data:`ENCODE_AHEAD` are encoded. A reader's half (following a
stream, and what it checks) is :mod:`policies.board.stream`.

Guarantees: chunk ``i`` is written only after chunk ``i - 1`` (a reader waiting for chunk ``i``
polls it only once the one before has landed), each through the caller's ``write`` (atomic, as
every board write); :func:`write_chunks` returns each patch's record for the manifest (every
chunk's size and frame checksum, :attr:`~policies.board.types.PatchRef.chunks`) and never writes
the manifest or the pointer: the caller writes them, in that order, once every chunk is durable,
so a half-published version is never servable. A chunk's announced limit (:func:`chunk_limit`)
leaves room for its frame at any density (twice the raw bytes, plus header room); a reader
refuses a chunk past it.

Not covered: a tensor is never split across chunks (the codec encodes whole tensors), so a view
made of one huge tensor streams as one chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from policies.board.stream import chunk_ref
from policies.board.types import BoardOptions, ChunkRef, PatchRef, Stream, chunk_file, patch_file
from policies.codec import encode_patch, read_patch_header
from policies.codec.digests import checksums, storage_key

CHUNK_VIEW_BYTES = 16 * 2**20
"""A chunk holds whole tensors until it covers at least this much of the view."""
ENCODE_AHEAD = 2
"""Chunks encoded at once by a publisher (the next while one is written)."""

ScanOn = tuple[int, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]
"""A base version, and that base's view and the target view on the device they live on: the
patch from that base is scanned there (:mod:`policies.codec.scan`)."""


def plan_chunks(view: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The tensor names of each chunk: name order, names sharing a storage in one chunk (the
    codec stores a tied name once, as an alias of the first), each chunk at least
    :data:`CHUNK_VIEW_BYTES` of view but the last."""
    groups: dict[object, list[str]] = {}
    for name in sorted(view):
        groups.setdefault(storage_key(view[name]), []).append(name)
    chunks: list[list[str]] = []
    size = CHUNK_VIEW_BYTES
    for names in groups.values():
        if size >= CHUNK_VIEW_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].extend(names)
        size += view[names[0]].nbytes
    return chunks


def chunk_limit(view: Mapping[str, torch.Tensor], names: list[str]) -> int:
    """The most bytes a chunk of ``names`` may hold: twice their raw bytes (a ``full`` section
    is zstd of them) plus room for the frame and its header."""
    return 2 * sum(view[n].nbytes for n in names) + 4096 * len(names) + 2**20


def announce(
    version: int, view: Mapping[str, torch.Tensor], bases: Mapping[int, str], stream_id: str
) -> Stream:
    """The ``STREAM`` object of a version about to be streamed from ``bases`` (version → digest)."""
    chunks = plan_chunks(view)
    return Stream(
        version=version,
        id=stream_id,
        bases=dict(bases),
        chunks=chunks,
        limits=[chunk_limit(view, names) for names in chunks],
    )


def write_chunks(
    stream: Stream,
    bases: Mapping[int, Mapping[str, torch.Tensor]],
    view: Mapping[str, torch.Tensor],
    opts: BoardOptions,
    write: Callable[[str, bytes], None],
    *,
    scan_on: ScanOn | None = None,
    known: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], dict[int, PatchRef]]:
    """Encode and write every chunk of ``stream`` (``write(relative path, data)``), in order,
    while the next :data:`ENCODE_AHEAD` are encoded; the view's checksums and the manifest's
    record of each patch, by base. The patch from the stream's first base (the previous
    version) is written first. ``scan_on`` (the same bits as ``bases[version]`` and ``view``,
    on a device) has that base's patch scanned there; the checksums are always ``view``'s:
    ``known`` when given (a device view's host copy, summed from its changes), hashed from the
    host copy when scanned on a device, else summed by the first base's scan as it reads the
    view (:func:`policies.codec.encode_patch`)."""
    last = len(stream.chunks) - 1

    def encode(i: int) -> tuple[dict[str, str], list[tuple[int, bytes]]]:
        names = stream.chunks[i]
        target = {n: view[n] for n in names}
        part = (
            {n: known[n] for n in names}
            if known is not None
            else checksums(target)
            if scan_on is not None
            else None
        )
        out = []
        for b, digest in stream.bases.items():
            base, scanned = bases[b], target
            if scan_on is not None and scan_on[0] == b:
                base, scanned = scan_on[1], {n: scan_on[2][n] for n in names}
            # the last chunk also carries the names the version removed
            keep = set(names) | (set(base) - set(view) if i == last else set())
            data = encode_patch(
                {n: base[n] for n in sorted(keep) if n in base},
                scanned,
                level=opts.zstd_level,
                base_digest=digest,
                target_checksums=part,
            )
            if part is None:  # the first patch's, summed by its scan
                part = {n: c for n, c in read_patch_header(data).checksums.items() if n in names}
            out.append((b, data))
        return part or {}, out

    sums: dict[str, str] = {}
    refs: dict[int, list[tuple[ChunkRef, int, int]]] = {b: [] for b in stream.bases}
    n = len(stream.chunks)
    with ThreadPoolExecutor(max_workers=ENCODE_AHEAD, thread_name_prefix="board-chunk") as pool:
        queued: deque[Future[tuple[dict[str, str], list[tuple[int, bytes]]]]] = deque()
        for i in range(n):
            while len(queued) < ENCODE_AHEAD and i + len(queued) < n:
                queued.append(pool.submit(encode, i + len(queued)))
            part, out = queued.popleft().result()
            sums.update(part)
            for b, data in out:
                hdr = read_patch_header(data)
                refs[b].append((chunk_ref(data), hdr.changed, hdr.units))
                write(chunk_file(b, i), data)
    patches = {
        b: PatchRef(
            base=b,
            file=patch_file(b),
            bytes=sum(c.bytes for c, _, _ in rows),
            changed=sum(changed for _, changed, _ in rows),
            units=sum(units for _, _, units in rows),
            base_digest=stream.bases[b],
            chunks=[c for c, _, _ in rows],
        )
        for b, rows in refs.items()
    }
    return sums, patches
