"""The board's index, read: the pointer, the ``STREAM``, manifests, a version's files and the run's
base files — bytes, each read bounded and verified as bytes, no tensors.

:class:`BoardIndex` is the storage edge of :class:`policies.board.read.BoardReader` (which brings
views to versions) and so of :class:`policies.board.Board`. Guarantees: every read is bounded
(``MAX_*`` in :mod:`policies.board.types`; a larger object is refused, never read whole); a
malformed pointer is :class:`PointerMalformed`, an unreadable ``STREAM`` is logged and taken for
none; a manifest is returned only verified (:func:`~policies.board.manifest.parse_manifest`) and
cached once the pointer has passed it (immutable from then on); a version's file is returned
only with the size its manifest records (:class:`VersionCorrupt` otherwise); once the base files
are read, a manifest that does not record exactly them is refused (:meth:`BoardIndex.check_base`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import structlog
from pydantic import ValidationError

from policies.board.manifest import file_entries, one_line, parse_manifest
from policies.board.store import Store
from policies.board.types import (
    BASE_FILES,
    MANIFEST,
    MAX_BASE_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_POINTER_BYTES,
    STREAM,
    BoardOptions,
    Manifest,
    Pointer,
    Step,
    Stream,
    check_run_name,
    chunk_file,
)
from policies.errors import BoardError, PointerMalformed, VersionCorrupt

log = structlog.get_logger(__name__)

MAX_STREAM_BYTES = MAX_MANIFEST_BYTES


class BoardIndex:
    """One run's versions on an fsspec URL (a plain path means the local filesystem), as bytes.

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
        self._base: dict[str, bytes] | None = None  # the base files this reader serves

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
        or unreadable (logged as ``board.stream_unreadable``; readers then wait for the
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

    def chunk_reader(self, version: int) -> Callable[[str, int], bytes | None]:
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

    def read_patch(self, step: Step) -> bytes:
        """The bytes of one planned patch (verify them by applying with :meth:`advance`); no
        more than the manifest's size of it is read. A patch stored in chunks is
        refused: read each chunk, a complete patch (``PatchRef.chunks``, ``chunk_file``)."""
        ref = next((p for p in self.manifest(step.version).patches if p.base == step.base), None)
        if ref is not None and ref.chunks:
            raise BoardError(
                f"version {step.version}: {step.file} is stored in {len(ref.chunks)} chunks "
                f"({chunk_file(step.base, 0)} …): read those, each a complete patch"
            )
        return self.read_exact(step.version, step.file, step.bytes)

    def read_exact(self, version: int, rel: str, size: int) -> bytes:
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

    def base_files(self) -> dict[str, bytes]:
        """The run's base files (config, tokenizer: :data:`BASE_FILES` present in ``base/``),
        read once per reader; what a reader writes next to the weights it serves.

        From then on every version this reader loads or advances to must record exactly these
        files (names, sizes, checksums) in its manifest: :meth:`advance` refuses any other with
        :class:`VersionCorrupt` naming the file, so a reader never serves weights under base
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

    def check_base(self, m: Manifest) -> None:
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
