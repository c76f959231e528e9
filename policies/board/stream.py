"""Streamed patches, a reader's half: a version's chunks staged as they land, checked at commit.

A publisher streams a version's patch chunk by chunk (:mod:`policies.board.stream_publish`): it
announces the chunks in the run's ``STREAM`` (:class:`~policies.board.types.Stream`), writes
chunk ``i`` of the patch from ``u`` (:func:`~policies.board.types.chunk_file`) as soon as it is
encoded, and the manifest (each chunk's size and frame checksum) and then the pointer only once
every chunk is durable.

A reader holding ``u`` that sees the stream (:func:`follow`, a :class:`Follower`) fetches chunk
``i`` by its name as soon as it exists (:func:`fetching`: up to :data:`FETCH_AHEAD` chunks ahead
of the one it applies, asked for together, so its link carries the next chunks meanwhile and a
round trip to the board is paid once, not once a chunk; a chunk not there yet is polled only
after the one before it has landed, since the publisher writes them in order, and asked for once
more whenever another lands), applies it to its view in place and verifies every tensor it wrote
against the chunk's checksums (:func:`apply_frame`) while the publisher encodes the next; the
pointer is watched, and ``on_commit`` called, while the last chunks cross. Once the pointer
reaches the version it checks what it staged against the manifest (:func:`check_chunks`): every
chunk the one the manifest vouches for, every tensor's checksum the manifest's, every tensor
covered once. Only then is the version staged: a half-published version is never servable.

Guarantees: the reader reads at most the announced limit of a chunk; a stream whose publisher
died (no new chunk for ``stall_s``), was replaced (another ``STREAM`` id) or was overtaken (the
pointer reached the version without that chunk, e.g. a restarted publisher wrote an anchor), or
whose chunks are not the manifest's, raises :class:`BoardError` saying so — the view is then
partly advanced and must be reloaded, as after any failed :meth:`BoardReader.advance`. A chunk
that fails its own checks is also a :class:`BoardError` while the version is unpublished (the
normal path reads it again once the manifest vouches for it). A failure on the applying side
stops the fetches waiting for chunks and the commit watch at their next poll (a read in flight
finishes first), not after the stall timeout. Chunks of an attempt that never committed stay in
the version directory until the version is published again (overwritten or ignored: the manifest
names its chunks) or collected.

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
from functools import partial

import torch

from policies.board.types import ChunkRef, Manifest, PatchRef, Stream, chunk_file
from policies.codec import apply_patch, read_patch_header
from policies.errors import BoardError, PatchBaseMismatch, PatchError, VersionCorrupt

POLL_S = 0.005
"""How often a reader following a stream looks for the next chunk or the pointer."""
CHECK_S = 0.1
"""How often it also checks that the stream is still the one it follows (``STREAM``'s id, and
that the pointer did not reach the version without the chunk it waits for)."""
FETCH_AHEAD = 8
"""Chunk fetches a reader keeps in flight ahead of the one it applies: the link stays busy while
it applies, and a board a round trip away (an object store in another region) answers several
requests per round trip."""
FETCH_BYTES = 512 * 2**20
"""The most bytes (by the sizes the fetcher was given: a stream's announced limits, a published
patch's chunk sizes) fetched ahead at once; one chunk at least."""
STALL_S = 60.0
"""A stream with no new chunk (or no commit) for this long is given up as abandoned."""


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
        # a damaged base held (PatchBaseCorrupt) stays one: the patch is not to blame
        raise type(exc)(str(exc) if where in str(exc) else f"{where}: {exc}") from None
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


@dataclass
class _Pending:
    """A chunk being fetched: its file, its announced limit, and its bytes once read."""

    index: int
    rel: str
    limit: int
    data: bytes | None = None


class Follower:
    """Follows one stream from ``have``: :meth:`run` applies every chunk of ``stream``'s patch
    from ``have`` to ``view`` as it lands and returns once the pointer reaches the stream's
    version (the module docstring says what that guarantees). Its steps, each on threads of
    their own: :meth:`fetch` (one chunk, up to :data:`FETCH_AHEAD` at once), :meth:`commit` (the
    pointer, watched from when the last chunk is asked for) and :meth:`apply` (one chunk, in
    order); when a wait gives up is decided in one place, :meth:`_wait`.

    ``where`` names the board in errors; ``stall_s`` defaults to :data:`STALL_S`;
    ``base_checksums`` are passed to :func:`apply_frame`; ``on_commit`` is called (on the commit
    watch's thread) once the pointer reached the version, unless applying failed."""

    def __init__(
        self,
        view: MutableMapping[str, torch.Tensor],
        have: int,
        stream: Stream,
        source: StreamSource,
        *,
        where: str,
        stall_s: float | None = None,
        base_checksums: Mapping[str, str] | None = None,
        on_commit: Callable[[], object] | None = None,
    ) -> None:
        self.view, self.have, self.stream, self.source = view, have, stream, source
        self.where, self.base_checksums, self.on_commit = where, base_checksums, on_commit
        self.stall_s = STALL_S if stall_s is None else stall_s
        self.digest = stream.bases[have]
        self.staged: list[StagedChunk] = []
        """The chunks applied so far, in order: what :meth:`run` returns."""
        self.landed = [threading.Event() for _ in stream.limits]
        """Per chunk, set once it is fetched: the chunk after it is polled from then on, and the
        commit's stall clock starts with the last one."""
        self.landings: list[int] = []
        """The chunks landed so far, in the order they did: a fetch waiting for the chunk before
        its own asks for its own once more whenever this grows."""
        self.asking_last = threading.Event()
        """Set once the last chunk is asked for (at once for a stream of no chunks): the commit
        watch starts then, so its round trips overlap the last chunks'."""
        if not stream.limits:
            self.asking_last.set()
        self.fetches_stopped = threading.Event()
        """Set when the applying side leaves the fetches (all applied, or it failed): a fetch
        still waiting for its chunk stops."""
        self.given_up = threading.Event()
        """Set when applying failed: the commit watch stops, and ``on_commit`` is not called."""

    def run(self) -> list[StagedChunk]:
        """Fetch and apply every chunk while the commit is watched; the chunks staged (check them
        against the manifest with :func:`check_chunks`)."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="board-commit") as watch:
            committed = watch.submit(self.commit)
            try:
                with fetching(self.fetch, self.stream.limits, self.fetches_stopped) as chunks:
                    for i, data in enumerate(chunks):
                        self.staged.append(self.apply(i, data))
            except BaseException:
                self.given_up.set()
                raise
            committed.result()
        return self.staged

    def fetch(self, i: int) -> bytes:
        """Chunk ``i``, within its announced limit. Asked for at once (the publisher is usually
        ahead). If it is not there yet, it is polled only once the chunk before it has landed
        (they are written in order; its stall clock starts then), and asked for once more
        whenever another chunk lands meanwhile (the publisher got further, maybe past it): one
        chunk is polled at a time."""
        chunk = _Pending(i, chunk_file(self.have, i), self.stream.limits[i])
        if i == len(self.stream.limits) - 1:
            self.asking_last.set()
        self._ask(chunk)
        if i:
            self._await_the_one_before(chunk)
        ready = partial(self._ask, chunk)
        if not self._wait(ready, f"chunk {i}", self.fetches_stopped, published_without=chunk.rel):
            raise self._gone("was given up")  # the applying side left: nothing waits for it
        self.landed[i].set()
        self.landings.append(i)
        assert chunk.data is not None  # _wait returned: _ask read it
        if len(chunk.data) > chunk.limit:
            raise self._gone(f"read {chunk.rel} larger than its announced {chunk.limit} bytes")
        return chunk.data

    def commit(self) -> None:
        """Wait for the pointer to reach the version, then call ``on_commit``, from when the last
        chunk is asked for: their round trips to the board overlap the last chunks'. The stall
        clock starts once the last chunk has landed (the publisher may still be writing the
        ones before it)."""
        while not self.asking_last.wait(POLL_S):
            if self.given_up.is_set():
                return
        since = self.landed[-1] if self.landed else None
        published = self._wait(self._published, "commit", self.given_up, since=since)
        if published and self.on_commit is not None and not self.given_up.is_set():
            self.on_commit()

    def apply(self, i: int, data: bytes) -> StagedChunk:
        """Apply chunk ``i`` to the view, every tensor it writes verified (:func:`apply_frame`);
        a chunk that fails is a :class:`BoardError` (read again once the version is published)."""
        rel = chunk_file(self.have, i)
        here = f"version {self.stream.version}: {rel}"
        try:
            return apply_frame(
                self.view, data, here, self.digest, base_checksums=self.base_checksums
            )
        except PatchError as exc:
            raise self._gone(f"failed at {rel} ({exc}): it is read again once published") from None
        except VersionCorrupt as exc:
            raise self._gone(f"failed ({exc}): it is read again once published") from None

    # -- waiting, and when to give up --------------------------------------------------------

    def _wait(
        self,
        ready: Callable[[], bool],
        what: str,
        stop: threading.Event,
        *,
        since: threading.Event | None = None,
        published_without: str | None = None,
    ) -> bool:
        """Poll ``ready`` every :data:`POLL_S`: True once it holds, False once ``stop`` is set
        (the other side gave up). Every rule for giving up on the stream, each a
        :class:`BoardError`, is here:

        - *stalled*: ``stall_s`` without ``what``, counted from when ``since`` is set (from now
          without it): the publisher died;
        - *replaced* (checked every :data:`CHECK_S`): ``STREAM`` is gone or names another
          attempt while ``what`` has not come (once published, the next version may stream);
        - *overtaken* (likewise, given ``published_without``: the file waited for): the pointer
          reached the version without it, e.g. a restarted publisher wrote an anchor."""
        start = checked = time.monotonic()
        while not stop.is_set():
            if ready():
                return True
            now = time.monotonic()
            if since is not None and not since.is_set():
                start = now  # the stall clock has not started
            if now - checked >= CHECK_S:  # the stream's fate, less often than the next chunk
                checked = now
                current = self.source.stream()
                if (current is None or current.id != self.stream.id) and not ready():
                    raise self._gone("was replaced by another publish")
                if published_without is not None:
                    latest = self.source.latest()
                    if latest is not None and latest >= self.stream.version and not ready():
                        raise self._gone(
                            f"was overtaken: the version was published without {published_without}"
                        )
            if now > start + self.stall_s:
                raise self._gone(f"stalled: no {what} for {self.stall_s:g} s (the publisher died?)")
            time.sleep(POLL_S)
        return False

    def _gone(self, why: str) -> BoardError:
        v, have = self.stream.version, self.have
        return BoardError(f"version {v} on {self.where}: the stream staged from {have} {why}")

    def _ask(self, chunk: _Pending) -> bool:
        """Whether ``chunk`` is read, asking the board for it if it is not yet."""
        if chunk.data is None:
            chunk.data = self.source.chunk(chunk.rel, chunk.limit)
        return chunk.data is not None

    def _await_the_one_before(self, chunk: _Pending) -> None:
        """Until the chunk before ``chunk`` has landed (or ``chunk`` is read), asking for
        ``chunk`` once more whenever another chunk lands; no stall clock runs meanwhile."""
        seen = len(self.landings)
        while chunk.data is None and not self.landed[chunk.index - 1].wait(POLL_S):
            if self.fetches_stopped.is_set():
                raise self._gone("was given up")
            if len(self.landings) != seen:
                seen = len(self.landings)
                self._ask(chunk)

    def _published(self) -> bool:
        return (self.source.latest() or -1) >= self.stream.version


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
    until the pointer reaches the stream's version (:class:`Follower`, which says how); the
    chunks staged (check them against the manifest with :func:`check_chunks`)."""
    return Follower(
        view,
        have,
        stream,
        source,
        where=where,
        stall_s=stall_s,
        base_checksums=base_checksums,
        on_commit=on_commit,
    ).run()
