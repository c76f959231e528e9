"""Reading the version board: the pointer, manifests, catch-up plans, verified views.

:class:`BoardReader` is everything a replica (a sidecar, ``orchestrate versions``,
``materialize``) does with a board; :class:`policies.board.Board` adds publishing and retention.
The layout and the guarantees are in :mod:`policies.board`.

Sharded versions (:mod:`policies.board.sharded`) are read into the same full view: an anchor is
assembled from every rank's pieces (each piece's checksum verified, then copied into its box of
the full tensor; tied names alias the primary again), and a patch step applies each rank's patch
to the boxes of the held view that rank published (each rank's patch verified like any patch:
frame checksum, base digest, written-piece checksums, target digest = the rank's digest in the
manifest). A materialized sharded version is therefore the same bytes as one published whole.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import structlog
import torch
from pydantic import ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from policies.board import plan as board_plan
from policies.board.manifest import file_entries, one_line, parse_manifest, pieces_checksum
from policies.board.store import Store
from policies.board.stream import (
    StagedChunk,
    StreamSource,
    apply_frame,
    check_chunks,
    fetching,
    follow,
    sum_checksums,
)
from policies.board.types import (
    BASE_FILES,
    MAX_BASE_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_POINTER_BYTES,
    BoardOptions,
    CatchUp,
    Manifest,
    PatchRef,
    PieceEntry,
    Pointer,
    ShardEntry,
    Step,
    Stream,
    check_run_name,
    chunk_file,
    shard_dir,
)
from policies.codec import apply_patch, read_patch_header
from policies.codec.digests import checksums, storage_key, tensor_checksum
from policies.codec.written import current as current_written
from policies.codec.written import recording
from policies.errors import (
    BoardError,
    PatchBaseMismatch,
    PatchError,
    PointerMalformed,
    VersionCorrupt,
)

log = structlog.get_logger(__name__)

WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"
STREAM = "STREAM"
"""The run's :class:`~policies.board.types.Stream` object: the version being streamed now."""
MAX_STREAM_BYTES = MAX_MANIFEST_BYTES


def anchor_payload(view: Mapping[str, torch.Tensor]) -> tuple[bytes, dict[str, str]]:
    """The safetensors bytes of a full view (each storage once) and the aliases left out."""
    primary: dict[object, str] = {}
    ptrs: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name in sorted(view):
        t = view[name].detach().cpu().contiguous()
        key = storage_key(t)
        if key in primary:
            aliases[name] = primary[key]
            continue
        primary[key] = name
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in ptrs and t.numel() else t
        ptrs.add(ptr)
    return st_save(tensors), aliases


def piece_box(piece: PieceEntry) -> tuple[slice, ...]:
    """The index of ``piece``'s box in its full tensor."""
    return tuple(slice(o, o + n) for o, n in zip(piece.offset, piece.shape, strict=True))


def view_checksums(view: Mapping[str, torch.Tensor], m: Manifest) -> dict[str, str]:
    """The checksums ``m`` would record for ``view`` (for a sharded ``m``: of its pieces' boxes;
    a tensor whose shape is not the manifest's gets no entry)."""
    if not m.shards:
        return checksums(view)
    pieces: dict[str, dict[int, PieceEntry]] = {}
    for shard in m.shards:
        for name, p in shard.pieces.items():
            t = view.get(name)
            if t is None or list(t.shape) != m.tensors[name].shape:
                continue
            got = tensor_checksum(t[piece_box(p)])
            pieces.setdefault(name, {})[shard.rank] = p.model_copy(update={"checksum": got})
    out = {name: pieces_checksum(by_rank) for name, by_rank in pieces.items()}
    out.update({a: out[p] for a, p in m.aliases.items() if p in out})
    return out


def _piece_checksums(base: Manifest, shard: ShardEntry) -> dict[str, str] | None:
    """The ``sum-128`` checksums ``base`` records for the pieces of ``shard`` (its rank's, in
    the same boxes; a patch's check from them then costs the words it writes), else None."""
    held = next((s for s in base.shards if s.rank == shard.rank), None)
    if held is None:
        return None
    out = {}
    for name, p in shard.pieces.items():
        was = held.pieces.get(name)
        if was is not None and (was.offset, was.shape) == (p.offset, p.shape):
            out[name] = was.checksum
    return out


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise VersionCorrupt(f"{where}: unknown dtype {name}")
    return dtype


class BoardReader:
    """One run's versions on an fsspec URL (a plain path means the local filesystem), read.

    ``options`` (or its fields as keyword arguments) matter to a publisher, except
    ``catchup_levels``, which bounds how far back a direct patch route is searched.
    ``storage_options`` go to fsspec (e.g. ``{"client_kwargs": {"endpoint_url": …}}``).
    A ``run`` that is not a valid run name (:func:`~policies.board.types.check_run_name`, e.g.
    ``../..``) raises :class:`BoardError` naming it.
    """

    def __init__(
        self,
        url: str,
        run: str,
        *,
        options: BoardOptions | None = None,
        storage_options: Mapping[str, object] | None = None,
        **fields: int | float | None,
    ) -> None:
        self.url = url
        self.run = check_run_name(run)
        self.options = options or BoardOptions.model_validate(fields)
        self.store = Store(url, storage_options)
        self.safe_url = self.store.safe_url
        self.fs = self.store.fs
        self.root = f"{self.store.root}/{run}"
        self._manifests: dict[int, Manifest] = {}
        self._seen_latest: int | None = None
        self._bad_patches: set[tuple[int, str]] = set()
        self._base: dict[str, bytes] | None = None  # the base files this reader serves

    # -- storage edge ----------------------------------------------------------------------------
    def _vdir(self, version: int) -> str:
        return f"{self.root}/versions/{version:08d}"

    def _read(self, path: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of ``path`` (more than ``limit``: the object is larger)."""
        return self.store.read(path, limit)

    def latest(self) -> int | None:
        """The version the pointer names, or None before the first publish.

        A malformed pointer (not JSON, no ``version``, or one that is not an integer in
        ``0..MAX_VERSION``) raises :class:`PointerMalformed`; a watcher logs it and keeps what it
        has, and the next publish repairs it.
        """
        try:
            raw = self._read(f"{self.root}/POINTER", MAX_POINTER_BYTES)
        except FileNotFoundError:
            return None
        where = f"{self.safe_url}/{self.run}/POINTER"
        if len(raw) > MAX_POINTER_BYTES:
            raise PointerMalformed(f"{where} is malformed (larger than {MAX_POINTER_BYTES} bytes)")
        try:
            latest = Pointer.model_validate_json(raw).version
        except ValidationError as exc:
            raise PointerMalformed(f"{where} is malformed ({one_line(exc, 'pointer')})") from None
        self._seen_latest = latest
        return latest

    def stream(self) -> Stream | None:
        """The version a publisher is streaming now (the run's ``STREAM``), or None: absent,
        or unreadable (logged as ``board.stream_unreadable``; replicas then wait for the
        pointer). It never makes a version servable; only :meth:`advance` with it does, once the
        version is published and its chunks match its manifest."""
        try:
            raw = self._read(f"{self.root}/{STREAM}", MAX_STREAM_BYTES)
        except FileNotFoundError:
            return None
        except VersionCorrupt as exc:  # not a regular file
            error = str(exc)
            log.warning("board.stream_unreadable", board=self.safe_url, run=self.run, error=error)
            return None
        try:
            if len(raw) > MAX_STREAM_BYTES:
                raise ValueError(f"larger than {MAX_STREAM_BYTES} bytes")
            return Stream.model_validate_json(raw)
        except (ValidationError, ValueError) as exc:
            error = one_line(exc, "stream") if isinstance(exc, ValidationError) else str(exc)
            log.warning("board.stream_unreadable", board=self.safe_url, run=self.run, error=error)
            return None

    def latest_and_stream(self) -> tuple[int | None, Stream | None]:
        """:meth:`latest` and :meth:`stream`, asked for together: a watcher of a board a round
        trip away reads both in one round trip, not two."""
        with ThreadPoolExecutor(1, thread_name_prefix="board-read") as pool:
            streaming = pool.submit(self.stream)
            return self.latest(), streaming.result()

    def _chunk(self, version: int) -> Callable[[str, int], bytes | None]:
        def read(rel: str, limit: int) -> bytes | None:
            try:
                return self._read(f"{self._vdir(version)}/{rel}", limit)
            except FileNotFoundError:
                return None

        return read

    def versions(self) -> list[int]:
        """Every published version (a manifest at or below the pointer), ascending."""
        return self._published(self.latest())

    def _published(self, latest: int | None) -> list[int]:
        """Every version with a manifest at or below ``latest`` (the pointer's), ascending."""
        if latest is None:
            return []
        try:
            found = self.store.dirs_with(f"{self.root}/versions", MANIFEST)
        except FileNotFoundError:
            return []
        return sorted(int(d) for d in found if d.isascii() and d.isdigit() and int(d) <= latest)

    def manifest(self, version: int) -> Manifest:
        """The manifest of ``version`` (cached once the pointer has passed it: immutable)."""
        cached = self._manifests.get(version)
        if cached is not None:
            return cached
        try:
            raw = self._read(f"{self._vdir(version)}/{MANIFEST}", MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise BoardError(
                f"version {version} is not on the board {self.safe_url}/{self.run}"
            ) from None
        if len(raw) > MAX_MANIFEST_BYTES:
            raise VersionCorrupt(
                f"version {version}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes"
            )
        m = parse_manifest(raw, version, f"{self.safe_url}/{self.run}")
        if self._seen_latest is not None and version <= self._seen_latest:
            self._manifests[version] = m
        return m

    def catch_up(self, have: int | None, want: int | None = None) -> CatchUp:
        """The patches (or anchor + patches) that take a view at ``have`` to ``want``.

        ``want`` defaults to the newest version; ``have=None`` means the replica holds nothing.
        A direct patch route is searched only when ``have`` is at most ``4 · 2**catchup_levels``
        versions behind (else the plan starts at an anchor).
        """
        return self._catch_up(have, want, self.latest())

    def _catch_up(self, have: int | None, want: int | None, latest: int | None) -> CatchUp:
        """:meth:`catch_up` with the pointer read as ``latest`` (a distant board's round trip
        is not paid again)."""
        want = latest if want is None else want
        if latest is None or want is None or want > latest:
            raise BoardError(
                f"version {want} is not published on {self.safe_url}/{self.run} (newest: {latest})"
            )
        if have == want:
            return CatchUp(have=have, want=want, anchor=None, steps=[])
        self.manifest(want)  # a version the pointer names without a manifest: say so
        horizon = 4 << self.options.catchup_levels
        direct = have is not None and have < want and want - have <= horizon
        manifests: dict[int, Manifest] = {}
        for v in reversed([v for v in self._published(latest) if v <= want]):
            found_anchor = any(m.kind == "anchor" for m in manifests.values())
            if found_anchor and (not direct or (have is not None and v <= have)):
                break
            manifests[v] = self._usable(self.manifest(v))
        route = board_plan.plan(manifests, have if direct else None, want)
        if route is None:
            raise BoardError(
                f"no route to version {want} from {have}: no anchor at or before it on "
                f"{self.safe_url}/{self.run}"
            )
        return CatchUp(
            have=have,
            want=want,
            anchor=route.anchor,
            anchor_bytes=route.anchor_bytes,
            steps=route.steps,
        )

    def _usable(self, m: Manifest) -> Manifest:
        """``m`` without the patches that failed verification here (plans route around them)."""
        bad = [p for p in m.patches if (m.version, p.file) in self._bad_patches]
        if not bad:
            return m
        return m.model_copy(update={"patches": [p for p in m.patches if p not in bad]})

    def read_patch(self, step: Step) -> bytes:
        """The bytes of one planned patch (verify them by applying with :meth:`advance`); no
        more than the manifest's size of it is read. A patch stored in chunks (format 4) is
        refused: read each chunk, a complete patch (``PatchRef.chunks``, ``chunk_file``)."""
        ref = next((p for p in self.manifest(step.version).patches if p.base == step.base), None)
        if ref is not None and ref.chunks:
            raise BoardError(
                f"version {step.version}: {step.file} is stored in {len(ref.chunks)} chunks "
                f"({chunk_file(step.base, 0)} …): read those, each a complete patch"
            )
        return self._read_exact(step.version, step.file, step.bytes)

    def _read_exact(self, version: int, rel: str, size: int) -> bytes:
        """The ``size`` bytes of ``rel`` in ``version``'s directory, or :class:`VersionCorrupt`."""
        try:
            data = self._read(f"{self._vdir(version)}/{rel}", size)
        except FileNotFoundError:
            raise VersionCorrupt(f"version {version}: {rel} is missing") from None
        if len(data) != size:
            held = f"more than {size}" if len(data) > size else str(len(data))
            raise VersionCorrupt(
                f"version {version}: {rel} holds {held} bytes, its manifest records "
                f"{size} (damaged or truncated)"
            )
        return data

    def advance(
        self,
        view: MutableMapping[str, torch.Tensor],
        have: int | None,
        want: int | None = None,
        *,
        verify_base: bool = False,
    ) -> Manifest:
        """Bring ``view`` (holding ``have``, or nothing) to ``want`` in place; its manifest.

        Patches are applied bitwise into ``view``'s tensors; an anchor in the plan replaces the
        contents. ``verify_base`` hashes the held view instead of trusting that it is ``have``.
        If this raises, ``view`` may be partly advanced: reload it (``have=None``).

        ``want`` may also be a version a publisher is streaming from ``have``
        (:meth:`stream`): its chunks are applied as they land, and this returns once it is
        published and they match its manifest (:mod:`policies.board.stream`).
        """
        latest = self._seen_latest
        if want is None or latest is None or want > latest:
            # else ``want`` is published: the pointer was seen at or past it and never moves
            # back, so a distant board is not asked again (a caller just read it)
            if have is not None and want is not None:
                latest, stream = self.latest_and_stream()
                if want > (latest or -1):
                    return self._advance_streamed(view, have, want, stream, verify_base=verify_base)
            else:
                latest = self.latest()
        plan = self._catch_up(have, want, latest)
        self._check_base(self.manifest(plan.want))
        digest: str | None = None
        if plan.anchor is not None:
            fresh = self._read_anchor(self.manifest(plan.anchor))
            view.clear()
            view.update(fresh)
            if (written := current_written()) is not None:
                written.whole(fresh)
            digest = self.manifest(plan.anchor).digest
        elif have is not None and not verify_base:
            try:
                digest = self.manifest(have).digest
            except BoardError:
                digest = None  # retired by gc: hash the view instead
        for step in plan.steps:
            digest = self._apply(view, step, digest)
        target = self.manifest(plan.want)
        if set(view) != set(target.tensors):
            raise VersionCorrupt(f"version {plan.want}: tensor names differ from the manifest")
        if plan.want == have and verify_base:
            self._check_digest(view, target)
        return target

    def _advance_streamed(
        self,
        view: MutableMapping[str, torch.Tensor],
        have: int,
        want: int,
        stream: Stream | None,
        *,
        verify_base: bool,
    ) -> Manifest:
        """:meth:`advance` to ``want`` while ``stream`` (the run's ``STREAM``, read with the
        pointer that is still below ``want``) streams it (or refuse: not published)."""
        where = f"{self.safe_url}/{self.run}"
        if stream is None or stream.version != want or have not in stream.bases:
            raise BoardError(f"version {want} is not published on {where} (newest: {have})")
        held = self.manifest(have)
        if verify_base:
            self._check_digest(view, held)
        if held.digest != stream.bases[have]:
            raise PatchBaseMismatch(
                f"version {want} is streamed from {have} with digest {stream.bases[have]}; "
                f"version {have} has digest {held.digest}"
            )
        source = StreamSource(chunk=self._chunk(want), stream=self.stream, latest=self.latest)
        staged = follow(
            view,
            have,
            stream,
            source,
            where=where,
            base_checksums=sum_checksums(held),
            on_commit=lambda: self.manifest(want),  # read while the last chunks are applied
        )
        target = self.manifest(want)
        self._check_base(target)
        ref = next((p for p in target.patches if p.base == have and p.chunks), None)
        wrong = "no streamed patch from it" if ref is None else check_chunks(target, ref, staged)
        if wrong is None and set(view) != set(target.tensors):
            wrong = "the view's tensor names differ from the manifest"
        if wrong is not None:
            raise BoardError(
                f"version {want} on {where} was published, but not as staged from {have}: {wrong}"
            )
        return target

    def _apply(
        self, view: MutableMapping[str, torch.Tensor], step: Step, digest: str | None
    ) -> str:
        try:
            return self._apply_verified(view, step, digest)
        except VersionCorrupt:
            # the file itself is wrong (damaged, truncated, or another version's patch): later
            # plans from this reader avoid it (squashed patches or an anchor route around it)
            self._bad_patches.add((step.version, step.file))
            raise

    def _apply_verified(
        self, view: MutableMapping[str, torch.Tensor], step: Step, digest: str | None
    ) -> str:
        m = self.manifest(step.version)
        if m.shards:
            return self._apply_sharded(view, step, digest, m)
        ref = next(p for p in m.patches if p.base == step.base)
        if ref.chunks:
            return self._apply_chunks(view, step, digest, m, ref)
        data = self.read_patch(step)
        where = f"version {step.version}: {step.file}"
        apply_frame(view, data, where, digest, m.digest, self._base_checksums(step.base))
        return m.digest

    def _apply_chunks(
        self,
        view: MutableMapping[str, torch.Tensor],
        step: Step,
        digest: str | None,
        m: Manifest,
        ref: PatchRef,
    ) -> str:
        """Apply a streamed patch of a published version, chunk by chunk, each verified."""
        if digest is not None and ref.base_digest != digest:
            raise PatchBaseMismatch(
                f"version {step.version}: {step.file} applies to version {step.base} (digest "
                f"{ref.base_digest}); the view held has digest {digest}: catch up from the "
                "version actually held"
            )
        staged: list[StagedChunk] = []
        sums = self._base_checksums(step.base)
        sizes = [c.bytes for c in ref.chunks]

        def fetch(i: int) -> bytes:
            return self._read_exact(step.version, chunk_file(step.base, i), sizes[i])

        with fetching(fetch, sizes) as chunks:  # the next ones cross while one is applied
            for i, data in enumerate(chunks):
                # the first chunk vouches for nothing unless the caller did: hash the base once
                where = f"version {step.version}: {chunk_file(step.base, i)}"
                staged.append(apply_frame(view, data, where, digest, base_checksums=sums))
                digest = ref.base_digest
        wrong = check_chunks(m, ref, staged)
        if wrong is not None:
            raise VersionCorrupt(f"version {step.version}: {wrong}")
        return m.digest

    def _base_checksums(self, base: int) -> dict[str, str] | None:
        """The ``sum-128`` checksums of version ``base`` (None: not such, or collected)."""
        try:
            return sum_checksums(self.manifest(base))
        except BoardError:
            return None

    def _apply_sharded(
        self, view: MutableMapping[str, torch.Tensor], step: Step, digest: str | None, m: Manifest
    ) -> str:
        """Apply every rank's patch ``step.base`` → ``step.version`` to its boxes of ``view``."""
        ref = next(p for p in m.patches if p.base == step.base)
        if digest is not None and ref.base_digest != digest:
            raise PatchBaseMismatch(
                f"version {step.version}: {step.file} applies to version {step.base} (digest "
                f"{ref.base_digest}); the view held has digest {digest}: catch up from the "
                "version actually held"
            )
        try:
            base = self.manifest(step.base)
        except BoardError:  # collected: each piece written is hashed
            base = None
        for shard in m.shards:
            sums = _piece_checksums(base, shard) if base is not None else None
            self._apply_shard(view, step, shard, m, vouched=digest is not None, base_checksums=sums)
        return m.digest

    def _apply_shard(
        self,
        view: MutableMapping[str, torch.Tensor],
        step: Step,
        shard: ShardEntry,
        m: Manifest,
        *,
        vouched: bool,
        base_checksums: Mapping[str, str] | None,
    ) -> None:
        ref = next(p for p in shard.patches if p.base == step.base)
        rel = f"{shard_dir(shard.rank)}/{ref.file}"
        where = f"version {step.version}: {rel}"
        data = self._read_exact(step.version, rel, ref.bytes)
        pieces: dict[str, torch.Tensor] = {}
        for name, p in shard.pieces.items():
            t, entry = view.get(name), m.tensors[name]
            if t is None or list(t.shape) != entry.shape or str(t.dtype) != f"torch.{entry.dtype}":
                raise PatchBaseMismatch(
                    f"{where}: the view held lacks {name} as {entry.dtype}{entry.shape}: catch up "
                    "from the version actually held"
                )
            pieces[name] = t[piece_box(p)]
        try:
            hdr = read_patch_header(data)
            if hdr.target_digest != shard.digest or hdr.base_digest != ref.base_digest:
                raise VersionCorrupt(
                    f"{where} goes {hdr.base_digest} → {hdr.target_digest}, the manifest says "
                    f"{ref.base_digest} → {shard.digest}"
                )
            if {r.name for r in hdr.tensors} != set(shard.pieces):
                raise VersionCorrupt(f"{where}: its tensors are not rank {shard.rank}'s pieces")
            outer = current_written()
            with recording() if outer is not None else nullcontext() as inner:
                out = apply_patch(
                    pieces,
                    data,
                    base_digest=ref.base_digest if vouched else None,
                    base_checksums=base_checksums,
                    verify=True,
                )
            if outer is not None and inner is not None:
                boxes = {
                    n: (tuple(p.shape), tuple(p.offset), tuple(m.tensors[n].shape))
                    for n, p in shard.pieces.items()
                }
                outer.add_boxes(inner, boxes)
        except PatchBaseMismatch as exc:
            raise PatchBaseMismatch(str(exc) if where in str(exc) else f"{where}: {exc}") from None
        except PatchError as exc:
            raise VersionCorrupt(f"{where}: {exc}") from None
        for name, p in shard.pieces.items():
            dst = view[name][piece_box(p)]
            if out[name].data_ptr() != dst.data_ptr():  # patched into a copy (not contiguous)
                dst.copy_(out[name])

    def _check_digest(self, view: Mapping[str, torch.Tensor], m: Manifest) -> None:
        sums = view_checksums(view, m)
        if any(sums.get(k) != e.checksum for k, e in m.tensors.items()):
            raise VersionCorrupt(f"version {m.version}: the view does not match its manifest")

    def _read_sharded_anchor(self, m: Manifest) -> dict[str, torch.Tensor]:
        """The full view of a sharded anchor: every rank's pieces, verified, in their boxes."""
        full = {
            name: torch.empty(e.shape, dtype=_dtype(e.dtype, f"version {m.version}: {name}"))
            for name, e in m.tensors.items()
            if name not in m.aliases
        }
        for shard in m.shards:
            rel = f"{shard_dir(shard.rank)}/{WEIGHTS}"
            payload = self._read_exact(m.version, rel, shard.bytes)
            try:
                tensors = st_load(payload)
            except Exception as exc:  # safetensors raises its own untyped errors on torn files
                raise VersionCorrupt(f"version {m.version}: {rel} unreadable: {exc}") from None
            if set(tensors) != set(shard.pieces):
                raise VersionCorrupt(f"version {m.version}: {rel} does not hold rank's pieces")
            for name, p in shard.pieces.items():
                t = tensors[name]
                if (
                    list(t.shape) != p.shape
                    or t.dtype != full[name].dtype
                    or tensor_checksum(t) != p.checksum
                ):
                    raise VersionCorrupt(
                        f"version {m.version}: checksum mismatch for rank {shard.rank}'s piece "
                        f"of {name}"
                    )
                full[name][piece_box(p)].copy_(t)
        for alias, primary in m.aliases.items():
            full[alias] = full[primary]
        return full

    def _read_anchor(self, m: Manifest) -> dict[str, torch.Tensor]:
        if m.shards:
            return self._read_sharded_anchor(m)
        try:
            payload = self._read(f"{self._vdir(m.version)}/{WEIGHTS}", m.bytes)
        except FileNotFoundError:
            raise VersionCorrupt(f"version {m.version}: {WEIGHTS} is missing") from None
        if len(payload) != m.bytes:
            held = f"more than {m.bytes}" if len(payload) > m.bytes else str(len(payload))
            raise VersionCorrupt(
                f"version {m.version}: weights unreadable: {WEIGHTS} holds {held} bytes, its "
                f"manifest records {m.bytes}"
            )
        try:
            tensors = st_load(payload)
        except Exception as exc:  # safetensors raises its own untyped errors on torn files
            raise VersionCorrupt(f"version {m.version}: weights unreadable: {exc}") from None
        for alias, primary in m.aliases.items():
            if primary not in tensors:
                raise VersionCorrupt(f"version {m.version}: alias {alias} of missing {primary}")
            tensors[alias] = tensors[primary]
        if set(tensors) != set(m.tensors):
            raise VersionCorrupt(f"version {m.version}: tensor names differ from the manifest")
        for name, entry in m.tensors.items():
            if tensor_checksum(tensors[name]) != entry.checksum:
                raise VersionCorrupt(f"version {m.version}: checksum mismatch for {name}")
        return tensors

    def load(self, version: int) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """The full served view of ``version`` (anchor + patches), verified; a fresh copy."""
        view: dict[str, torch.Tensor] = {}
        return self.advance(view, None, version), view

    def base_files(self) -> dict[str, bytes]:
        """The run's base files (config, tokenizer: :data:`BASE_FILES` present in ``base/``),
        read once per reader; what a replica writes next to the weights it serves.

        From then on every version this reader loads or advances to must record exactly these
        files (names, sizes, checksums) in its manifest: :meth:`advance` refuses any other with
        :class:`VersionCorrupt` naming the file, so a replica never serves weights under base
        files that were not published with them. A file larger than ``MAX_BASE_FILE_BYTES`` is
        a :class:`BoardError` naming it.
        """
        if self._base is None:
            files: dict[str, bytes] = {}
            for name in BASE_FILES:
                try:
                    data = self._read(f"{self.root}/base/{name}", MAX_BASE_FILE_BYTES)
                except FileNotFoundError:
                    continue
                if len(data) > MAX_BASE_FILE_BYTES:
                    raise BoardError(
                        f"base/{name} on {self.safe_url}/{self.run} is larger than "
                        f"{MAX_BASE_FILE_BYTES} bytes"
                    )
                files[name] = data
            self._base = files
        return dict(self._base)

    def _check_base(self, m: Manifest) -> None:
        """Refuse ``m`` unless it records the base files this reader read (if it read any)."""
        if self._base is None:
            return
        held = file_entries(self._base)
        for name in sorted(set(held) | set(m.base_files)):
            recorded, have = m.base_files.get(name), held.get(name)
            if recorded == have:
                continue
            if recorded is None:
                why = "is not recorded in its manifest (written after the version was published)"
            elif have is None:
                why = "is recorded in its manifest but missing from the board"
            else:
                why = (
                    f"does not match its manifest ({have.bytes} bytes, checksum {have.checksum}; "
                    f"the manifest records {recorded.bytes} bytes, checksum {recorded.checksum})"
                )
            raise VersionCorrupt(f"version {m.version}: base file base/{name} {why}")

    def materialize(self, version: int, out: Path) -> Path:
        """Write an HF checkpoint dir of ``version``, bit-identical to an anchor of it.

        All or nothing: the files are written to a temporary sibling of ``out`` and renamed into
        place only once every one is written (a new ``out`` is one rename; into an existing
        directory, each file is one rename and other files there are left alone). If this raises,
        ``out`` is as it was and the temporary directory is gone.
        """
        if out.exists() and not out.is_dir():
            raise BoardError(f"{out} exists and is not a directory")
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as exc:
            raise BoardError(f"cannot write {out}: {exc.strerror or exc}") from None
        try:
            for name, data in self.base_files().items():
                (tmp / name).write_bytes(data)
            _, tensors = self.load(version)  # refused unless it records these base files
            (tmp / WEIGHTS).write_bytes(anchor_payload(tensors)[0])
            if not out.exists():
                tmp.rename(out)
                return out
            for f in tmp.iterdir():
                f.replace(out / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out
