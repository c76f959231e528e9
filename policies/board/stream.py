"""Streamed patches: a version's patches written chunk by chunk, staged by replicas as they land.

A publisher holding the previous view (:meth:`policies.board.Board.publish`) cuts the version's
tensors into chunks (:func:`plan_chunks`: whole tensors in name order, names sharing a storage
together, at least :data:`CHUNK_VIEW_BYTES` of view each) and announces them in the run's
``STREAM`` object (:class:`~policies.board.types.Stream`: version, a new id, the base (the
previous version) and its digest, each chunk's tensor names and size limit; the catch-up patches
written after the commit go through the same :func:`write_chunks`, unannounced). It then encodes
the chunks one after another, each a complete sprawl patch frame of its tensors
(:func:`policies.codec.encode_patch` with the base's digest and the target's checksums), and
writes chunk ``i`` of the patch from ``u`` to ``versions/<v>/from-<u:08d>/<i:05d>.patch``
(:func:`~policies.board.types.chunk_file`) as soon as it is encoded, while the next is encoded;
the manifest (each chunk's size and frame checksum under
:attr:`~policies.board.types.PatchRef.chunks`) and then the pointer are written only once every
chunk is durable.

A replica holding ``u`` that sees the stream (:func:`follow`) fetches chunk ``i`` by its name as
soon as it exists (:func:`fetching`: up to :data:`FETCH_AHEAD` chunks ahead of the one it
applies, asked for together, so its link carries the next chunks meanwhile and a round trip to
the board is paid once, not once a chunk; a chunk not there yet is polled only after the one
before it has landed, since the publisher writes them in order, and asked for once more whenever
another lands), applies it to its view in place and verifies every tensor it wrote against the
chunk's checksums (:func:`apply_frame`) while the publisher encodes the next; the pointer is
watched, and ``on_commit`` called, while the last chunks cross. Once the pointer reaches the
version it checks what it staged against the manifest (:func:`check_chunks`): every chunk the
one the manifest vouches for, every tensor's checksum the manifest's, every tensor covered once.
Only then is the version staged: a half-published version is never servable.

Guarantees: the reader reads at most the announced limit of a chunk; a stream whose publisher
died (no new chunk for ``stall_s``), was replaced (another ``STREAM`` id) or was overtaken (the
pointer reached the version without that chunk, e.g. a restarted publisher wrote an anchor), or
whose chunks are not the manifest's, raises :class:`BoardError` saying so — the view is then
partly advanced and must be reloaded, as after any failed :meth:`BoardReader.advance`. A chunk
that fails its own checks is also a :class:`BoardError` while the version is unpublished (the
normal path reads it again once the manifest vouches for it). Chunks of an attempt that never
committed stay in the version directory until the version is published again (overwritten or
ignored: the manifest names its chunks) or collected.

Not covered: a tensor is never split across chunks (the codec encodes whole tensors), so a view
made of one huge tensor streams as one chunk.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from policies.board.types import (
    BoardOptions,
    ChunkRef,
    Manifest,
    PatchRef,
    Stream,
    chunk_file,
    patch_file,
)
from policies.codec import apply_patch, encode_patch, read_patch_header
from policies.codec.digests import checksums, storage_key
from policies.errors import BoardError, PatchBaseMismatch, PatchError, VersionCorrupt

CHUNK_VIEW_BYTES = 16 * 2**20
"""A chunk holds whole tensors until it covers at least this much of the view."""
POLL_S = 0.005
"""How often a replica following a stream looks for the next chunk or the pointer."""
CHECK_S = 0.1
"""How often it also checks that the stream is still the one it follows (``STREAM``'s id, and
that the pointer did not reach the version without the chunk it waits for)."""
ENCODE_AHEAD = 2
"""Chunks encoded at once by a publisher (the next while one is written)."""
FETCH_AHEAD = 8
"""Chunk fetches a replica keeps in flight ahead of the one it applies: the link stays busy while
it applies, and a board a round trip away (an object store in another region) answers several
requests per round trip."""
FETCH_BYTES = 512 * 2**20
"""The most bytes (by the sizes the fetcher was given: a stream's announced limits, a published
patch's chunk sizes) fetched ahead at once; one chunk at least."""
STALL_S = 60.0
"""A stream with no new chunk (or no commit) for this long is given up as abandoned."""

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


def chunk_ref(data: bytes) -> ChunkRef:
    """How a manifest records a chunk: its size and its frame's own checksum."""
    return ChunkRef(bytes=len(data), checksum=data[-16:].hex())


@dataclass(frozen=True)
class StagedChunk:
    """A chunk applied to a view: what it was and the checksums of the tensors it wrote."""

    ref: ChunkRef
    sums: dict[str, str]


def apply_frame(
    view: MutableMapping[str, torch.Tensor],
    data: bytes,
    where: str,
    digest: str | None,
    target_digest: str | None = None,
    base_checksums: Mapping[str, str] | None = None,
) -> StagedChunk:
    """Apply one patch frame (a chunk, or a whole single-file patch) in place, every tensor it
    writes verified; ``digest`` vouches for the base (the frame's base digest must be it) and
    ``target_digest``, when given, for what it makes; ``base_checksums`` (the base's
    ``sum-128`` checksums, :func:`sum_checksums`) make the verification cost the words written.
    A damaged frame, or one making another target, is :class:`VersionCorrupt` and a frame for
    another base :class:`PatchBaseMismatch`, each naming ``where``."""
    try:
        hdr = read_patch_header(data)
        if target_digest is not None and hdr.target_digest != target_digest:
            raise VersionCorrupt(
                f"{where} makes {hdr.target_digest}, the manifest says {target_digest}"
            )
        if digest is not None and hdr.base_digest != digest:
            raise PatchBaseMismatch(
                f"{where} applies to digest {hdr.base_digest}; the view held has digest "
                f"{digest}: catch up from the version actually held"
            )
        apply_patch(view, data, base_digest=digest, base_checksums=base_checksums, verify=True)
    except PatchBaseMismatch as exc:
        raise PatchBaseMismatch(str(exc) if where in str(exc) else f"{where}: {exc}") from None
    except PatchError as exc:
        raise VersionCorrupt(f"{where}: {exc}") from None
    return StagedChunk(chunk_ref(data), hdr.checksums)


def sum_checksums(m: Manifest) -> dict[str, str] | None:
    """``m``'s tensor checksums (a patch's check from them then costs the words it writes),
    None for a sharded ``m`` (whose tensor checksums are of its pieces)."""
    if m.shards:
        return None
    return {name: e.checksum for name, e in m.tensors.items()}


def check_chunks(m: Manifest, ref: PatchRef, staged: list[StagedChunk]) -> str | None:
    """What differs between the chunks applied and the patch ``ref`` of ``m`` (module
    docstring), or None if they are the ones it vouches for."""
    if [s.ref for s in staged] != ref.chunks:
        return f"the chunks of {ref.file} are not the ones its manifest records"
    covered: dict[str, str] = {}
    for s in staged:
        if set(s.sums) & set(covered):
            return f"a tensor of {ref.file} is in more than one chunk"
        covered.update(s.sums)
    if set(covered) != set(m.tensors):
        return f"the chunks of {ref.file} do not hold exactly the manifest's tensors"
    wrong = sorted(n for n, c in covered.items() if m.tensors[n].checksum != c)
    if wrong:
        return f"the chunks of {ref.file} make {wrong[0]} with another checksum than the manifest's"
    return None


@contextmanager
def fetching(
    fetch: Callable[[int], bytes], sizes: Sequence[int], stop: threading.Event | None = None
) -> Iterator[Iterator[bytes]]:
    """``fetch(i)`` of chunks ``0 … len(sizes) - 1``, yielded in order while up to
    :data:`FETCH_AHEAD` of the next ones (at most :data:`FETCH_BYTES` of their ``sizes``, one at
    least) are fetched at once on threads of their own. Leaving the block sets ``stop`` (a
    ``fetch`` waiting for a chunk watches it) and waits for the fetches in flight."""
    pool = ThreadPoolExecutor(max_workers=FETCH_AHEAD, thread_name_prefix="board-fetch")

    def in_order() -> Iterator[bytes]:
        ahead: deque[tuple[int, Future[bytes]]] = deque()
        queued = 0
        for _ in sizes:
            while (
                queued < len(sizes)
                and len(ahead) < FETCH_AHEAD
                and (not ahead or sum(sizes[j] for j, _ in ahead) + sizes[queued] <= FETCH_BYTES)
            ):
                ahead.append((queued, pool.submit(fetch, queued)))
                queued += 1
            yield ahead.popleft()[1].result()

    try:
        yield in_order()
    finally:
        if stop is not None:
            stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class StreamSource:
    """What :func:`follow` reads: a chunk by its relative path (None while it does not exist),
    the run's ``STREAM`` (None if absent) and the pointer."""

    chunk: Callable[[str, int], bytes | None]
    stream: Callable[[], Stream | None]
    latest: Callable[[], int | None]


def follow(
    view: MutableMapping[str, torch.Tensor],
    have: int,
    stream: Stream,
    source: StreamSource,
    *,
    where: str,
    stall_s: float | None = None,
    base_checksums: Mapping[str, str] | None = None,
    on_commit: Callable[[], object] | None = None,
) -> list[StagedChunk]:
    """Apply every chunk of ``stream``'s patch from ``have`` to ``view`` as it lands, and wait
    until the pointer reaches the stream's version (watched, and then ``on_commit`` called, on a
    thread of its own once the last chunk is asked for); the chunks staged (check them against
    the manifest with :func:`check_chunks`). ``where`` names the board in errors; ``stall_s``
    defaults to :data:`STALL_S`; ``base_checksums`` are passed to :func:`apply_frame`."""
    stall_s = STALL_S if stall_s is None else stall_s
    v = stream.version
    digest = stream.bases[have]
    staged: list[StagedChunk] = []
    stop = threading.Event()  # set when the applying side gives up: the fetcher stops waiting

    def gone(why: str) -> BoardError:
        return BoardError(f"version {v} on {where}: the stream staged from {have} {why}")

    def wait(
        ready: Callable[[], bool],
        what: str,
        overtaken: Callable[[], None],
        since: threading.Event | None = None,
    ) -> None:
        """Poll ``ready``; given up after ``stall_s`` without it, counted from when ``since`` is
        set (or from now, if it is already)."""
        start = checked = time.monotonic()
        while not ready():
            now = time.monotonic()
            if since is not None and not since.is_set():
                start = now  # the stall clock has not started
            if now - checked >= CHECK_S:  # the stream's fate, less often than the next chunk
                checked = now
                current = source.stream()
                # (another id once the version is published and the next one streams: not gone)
                if (current is None or current.id != stream.id) and not ready():
                    raise gone("was replaced by another publish")
                overtaken()
            if now > start + stall_s:
                raise gone(f"stalled: no {what} for {stall_s:g} s (the publisher died?)")
            time.sleep(POLL_S)

    arrived = [threading.Event() for _ in stream.limits]
    landings: list[int] = []  # the chunks landed so far, in the order they did
    asking_last = threading.Event()
    if not stream.limits:  # nothing to fetch: only the commit to wait for
        asking_last.set()

    def fetch(i: int) -> bytes:
        rel, limit = chunk_file(have, i), stream.limits[i]
        if i == len(stream.limits) - 1:
            asking_last.set()
        # Asked for at once (the publisher is usually ahead). If it is not there yet, it is
        # polled only once the chunk before it has landed (they are written in order; its stall
        # clock starts then), and asked for once more whenever another chunk lands meanwhile
        # (the publisher got further, maybe past it): one chunk is polled at a time.
        got = [data] if (data := source.chunk(rel, limit)) is not None else []
        seen = len(landings)
        while i and not got and not arrived[i - 1].wait(POLL_S):
            if stop.is_set():
                raise gone("was given up")
            if len(landings) != seen:
                seen = len(landings)
                if (data := source.chunk(rel, limit)) is not None:
                    got.append(data)

        def landed() -> bool:
            if stop.is_set():  # the applying side raised: nothing waits for this chunk
                raise gone("was given up")
            data = None if got else source.chunk(rel, limit)
            if data is not None:
                got.append(data)
            return bool(got)

        def overtaken() -> None:
            latest = source.latest()
            if latest is not None and latest >= v and not landed():  # committed without it
                raise gone(f"was overtaken: the version was published without {rel}")

        wait(landed, f"chunk {i}", overtaken)
        arrived[i].set()
        landings.append(i)
        if len(got[0]) > limit:
            raise gone(f"read {rel} larger than its announced {limit} bytes")
        return got[0]

    given_up = threading.Event()

    def committed() -> None:
        """Wait for the pointer to reach the version, then ``on_commit``, from when the last
        chunk is asked for: their round trips to the board overlap the last chunks'. The stall
        clock starts once the last chunk has landed (the publisher may still be writing the
        ones before it)."""
        while not asking_last.wait(POLL_S):
            if given_up.is_set():
                return

        def ready() -> bool:
            return given_up.is_set() or (source.latest() or -1) >= v

        wait(ready, "commit", lambda: None, since=arrived[-1] if arrived else None)
        if on_commit is not None and not given_up.is_set():
            on_commit()

    def apply(i: int, data: bytes) -> StagedChunk:
        rel = chunk_file(have, i)
        here = f"version {v}: {rel}"
        try:
            return apply_frame(view, data, here, digest, base_checksums=base_checksums)
        except PatchError as exc:
            raise gone(f"failed at {rel} ({exc}): it is read again once published") from None
        except VersionCorrupt as exc:
            raise gone(f"failed ({exc}): it is read again once published") from None

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="board-commit") as watcher:
        commit = watcher.submit(committed)
        try:
            with fetching(fetch, stream.limits, stop) as chunks:
                for i, data in enumerate(chunks):
                    staged.append(apply(i, data))
        except BaseException:
            given_up.set()
            raise
        commit.result()
    return staged
