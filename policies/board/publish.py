"""The version board: immutable policy versions and one forward-only pointer, on any fsspec URL.

Layout under ``<url>/<run>/``::

    base/                     config.json, generation_config.json, tokenizer files (written once)
    versions/<v:08d>/         manifest.json, and
        model.safetensors     the full served view (anchors only; HF layout, tied names once)
        from-<u:08d>/<i:05d>.patch  chunk i of the bitwise patch u → v (policies.codec): the
                              delta from the previous version and squashed catch-up patches
                              (policies.board.plan), streamed chunk by chunk
                              (policies.board.stream); ``from-<u:08d>.patch`` (one file) in
                              versions of format 2
        shards/<r:05d>/       a sharded version's files, rank by rank (policies.board.sharded)
    POINTER                   {"version": v, "digest": …} — the newest durable version
    STREAM                    the version being streamed now (policies.board.stream)

Publishing (:meth:`Board.publish`) writes a delta against the previous version unless an anchor
is due (``BoardOptions.anchor_every`` versions since the last one, or the delta bytes since it
would pass ``anchor_fraction`` of a full view, or the publisher does not hold the previous view);
an anchor version also stores its patches, so readers one version behind never fetch it whole.
The publisher keeps the views it will patch from in memory (at most ``catchup_levels + 1``; it
holds references, so callers must not modify a view after publishing it) and never re-reads the
board to publish (only ``base/``, once, when :meth:`Board.create` was not called). Every
manifest records the run's base files (size and checksum) and is sealed: a digest over all its
fields (:func:`~policies.board.manifest.manifest_seal`), patch names and sizes included.

Guarantees:

- the delta from the previous version is streamed: ``STREAM``, then each chunk as soon as it is
  encoded, so readers stage chunks while the rest is encoded (:mod:`policies.board.stream`);
  the version is committed (manifest, pointer) as soon as the delta (and an anchor's file) is
  durable, and only then are the catch-up patches written and the manifest written again with
  them: a reader one version behind serves the version without waiting for patches it does not
  need (a reader that read the manifest before plans without them);
- bytes are durable before a manifest names them and before the pointer moves: data files, then
  the manifest, then the pointer, each written atomically (local: temp file + fsync + rename +
  directory fsync; object stores: one PUT per object);
- the pointer only moves forward, and readers see only versions at or below it
  (:meth:`versions`, :meth:`load` refuse newer ones), so no reader observes a half-written
  version; a reader verifies what it reads anyway: every anchor tensor's xxh3-128 checksum, every
  patch's frame checksum, base digest and written-tensor checksums, and the target digest,
  each manifest's seal, and (once it has read them) that a version records the base files it
  serves (:meth:`BoardReader.base_files`); no read goes past the size the manifest records, and
  patch names outside the version's directory are refused;
- a version written by another sprawl's manifest format raises :class:`BoardFormatError`;
- a patch names its base's digest and is refused against any other (:class:`PatchBaseMismatch`);
- damaged, truncated or missing files raise :class:`VersionCorrupt` (a :class:`BoardError`)
  naming the version and file; storage failures raise :class:`BoardError` with the URL's
  credentials and any configured secret removed (the original exception is not chained);
- :meth:`gc` keeps every version a reader holding ``≥ keep_from`` (or starting fresh) needs.

A view on a device (a GPU trainer's) is never copied to the host whole when the publisher holds the
previous version: the changes are found on the device and only they cross
(:func:`policies.board.host.host_side`, through :func:`policies.codec.scan.host_copy`, builds the
host copy the catch-up patches and the next publish need from the previous host copy, and its
checksums from the previous version's and the changes: nothing of it is hashed), and the delta from
the previous version is scanned on the device too; the publisher then also keeps a reference to the
device view (one more served view of device memory; the caller must not modify it after
publishing). ``board.published`` logs the bytes that crossed to the host as ``to_host_bytes``. A
publisher's first version, and a view whose tensors are the previous one's storage (live parameters
the optimizer changed in place: pass a copy, as the trainers do), are copied whole.

Not covered: concurrent publishers to one run (one trainer publishes; the forward-only check is
not atomic against another writer); a reader racing :meth:`gc` below ``keep_from``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import structlog
import torch

from policies.board import plan as board_plan
from policies.board.anchors import anchor_payload
from policies.board.host import DeviceView, HostSide, host_side
from policies.board.manifest import file_entries, manifest_digest, manifest_seal
from policies.board.read import BoardReader
from policies.board.stream_publish import announce, write_chunks
from policies.board.types import (
    BASE_FILES,
    FORMAT,
    MANIFEST,
    MAX_VERSION,
    STREAM,
    WEIGHTS,
    BoardOptions,
    Manifest,
    PatchRef,
    Pointer,
    TensorEntry,
)
from policies.codec import CODEC
from policies.codec import scan as device_scan
from policies.codec.digests import checksums, storage_key
from policies.errors import BoardError, BoardFormatError, PointerMalformed, VersionCorrupt

log = structlog.get_logger(__name__)


@dataclass
class _Held:
    view: dict[str, torch.Tensor]
    digest: str
    checksums: dict[str, str]
    """The view's ``sum-128`` tensor checksums (a device view's next host copy is summed from
    them and its changes)."""


class Board(BoardReader):
    """A run's board as its one publisher (the trainer) uses it: reading, plus writing versions
    and retention. The publisher keeps the views it will patch from in memory."""

    def __init__(
        self,
        url: str,
        run: str,
        *,
        options: BoardOptions | None = None,
        storage_options: Mapping[str, object] | None = None,
        **fields: int | float | None,
    ) -> None:
        super().__init__(url, run, options=options, storage_options=storage_options, **fields)
        self._held: dict[int, _Held] = {}
        self._head: Manifest | None = None
        self._device: DeviceView | None = None
        """The newest version's view on its device, when it was published from one."""

    def _write(self, path: str, data: bytes) -> None:
        self.store.write(path, data)

    def _write_in(self, vdir: str, rel: str, data: bytes) -> None:
        self._write(f"{vdir}/{rel}", data)

    def _write_manifest(self, vdir: str, manifest: Manifest) -> Manifest:
        """``manifest`` sealed, and written."""
        sealed = manifest.model_copy(update={"seal": manifest_seal(manifest)})
        self._write(f"{vdir}/{MANIFEST}", sealed.model_dump_json(indent=1).encode())
        return sealed

    # -- writing ---------------------------------------------------------------------------------
    def create(self, model_dir: Path) -> None:
        """Make ``base/`` hold exactly the static model files (config, tokenizer) of
        ``model_dir`` (a base file it lacks is removed from ``base/``); idempotent. Versions
        published from here on record these files."""
        from policies.board.gguf import base_files  # the one reader of a model dir's base files

        files = base_files(model_dir)
        for name in BASE_FILES:
            path = f"{self.root}/base/{name}"
            if name in files:
                self._write(path, files[name])
            elif self.store.call(f"checking {path}", partial(self.fs.exists, path)):
                self.store.call(f"deleting {path}", partial(self.fs.rm, path))
        self._base = files

    def publish(
        self, version: int, view: Mapping[str, torch.Tensor], *, view_name: str
    ) -> Manifest:
        """Write ``version`` (a delta, or an anchor when due), then move the pointer to it: the
        delta's chunks (and an anchor's file), the manifest, the pointer, then the catch-up
        patches and the manifest again, with them (module docstring)."""
        latest = self._forward_to(version)
        head = self._head if self._head is not None and self._head.version == latest else None
        held = self._held if head is not None else {}
        before = device_scan.host_bytes.total
        prev = held.get(latest) if latest is not None else None
        side = host_side(
            view,
            latest,
            self._device,
            prev.view if prev else None,
            prev.checksums if prev else None,
        )
        bases = board_plan.patch_bases(version, latest, held, self.options.catchup_levels)
        order = sorted(bases, key=lambda b: (b != latest, -b))  # the previous version first
        stream_id = uuid.uuid4().hex
        previous = {b: held[b] for b in order[:1]}
        sums, patches = self._stream_delta(version, side, previous, stream_id)
        manifest = self._write_version(version, latest, view_name, head, side.view, sums, patches)
        self._move_pointer(manifest)
        if len(order) > 1:  # served already; then the patches for readers further behind
            later = {b: held[b] for b in order[1:]}
            manifest = self._write_catch_up(manifest, side.view, sums, later, stream_id)
        self._keep(manifest, held, side, sums)
        crossed = {"to_host_bytes": device_scan.host_bytes.total - before} if side.device else {}
        anchor_file = manifest.bytes if manifest.kind == "anchor" else 0
        log.info(
            "board.published", board=self.safe_url, run=self.run, version=version,
            kind=manifest.kind, bytes=manifest.bytes, patches=len(manifest.patches),
            stored=anchor_file + sum(r.bytes for r in manifest.patches), **crossed,
        )  # fmt: skip
        if self.options.retain_versions is not None:
            self.gc(version - self.options.retain_versions + 1)
        return manifest

    def _forward_to(self, version: int) -> int | None:
        """The version the pointer names now (:meth:`_durable_latest`), once ``version`` is a
        version number past it."""
        if type(version) is not int or not 0 <= version <= MAX_VERSION:
            raise BoardError(f"version {version!r} is not an integer in 0..{MAX_VERSION}")
        latest = self._durable_latest()
        if latest is not None and version <= latest:
            raise BoardError(f"pointer only moves forward: version {version} <= current {latest}")
        return latest

    def _stream_delta(
        self, version: int, side: HostSide, base: Mapping[int, _Held], stream_id: str
    ) -> tuple[dict[str, str], dict[int, PatchRef]]:
        """Step 1: the checksums of the version's tensors, and the delta from ``base`` (the
        previous version, when held) streamed: ``STREAM`` announced, then each chunk written
        as soon as it is encoded (:mod:`policies.board.stream`)."""
        if not base:
            return checksums(side.view), {}
        stream = announce(version, side.view, {b: h.digest for b, h in base.items()}, stream_id)
        self._write(f"{self.root}/{STREAM}", stream.model_dump_json().encode())
        return write_chunks(
            stream,
            {b: h.view for b, h in base.items()},
            side.view,
            self.options,
            partial(self._write_in, self._vdir(version)),
            scan_on=side.scan_on,
            known=side.checksums,
        )

    def _write_version(
        self,
        version: int,
        latest: int | None,
        view_name: str,
        head: Manifest | None,
        tensors: Mapping[str, torch.Tensor],
        sums: Mapping[str, str],
        patches: Mapping[int, PatchRef],
    ) -> Manifest:
        """Step 2: an anchor's file, when one is due, then the version's manifest (written
        sealed; returned as built)."""
        opts = self.options
        entries = {
            k: TensorEntry(
                dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), checksum=sums[k]
            )
            for k, t in tensors.items()
        }
        full_bytes = sum(t.nbytes for t in {storage_key(t): t for t in tensors.values()}.values())
        delta = patches.get(latest) if latest is not None else None
        is_anchor = (
            head is None
            or delta is None
            or head.anchor is None
            or version - head.anchor >= opts.anchor_every
            or head.chain_bytes + delta.bytes > opts.anchor_fraction * full_bytes
        )
        vdir = self._vdir(version)
        aliases: dict[str, str] = {}
        payload = b""
        if is_anchor:
            payload, aliases = anchor_payload(tensors)
            self._write(f"{vdir}/{WEIGHTS}", payload)
        manifest = Manifest(
            version=version,
            kind="anchor" if is_anchor else "delta",
            base=None if is_anchor else latest,
            view=view_name,
            codec="safetensors" if is_anchor else CODEC,
            tensors=entries,
            digest=manifest_digest(entries),
            bytes=len(payload) if is_anchor else delta.bytes if delta else 0,
            created_at=time.time(),
            patches=list(patches.values()),
            aliases=aliases,
            anchor=version if is_anchor else head.anchor if head else None,
            chain_bytes=0
            if is_anchor or delta is None or head is None
            else head.chain_bytes + delta.bytes,
            full_bytes=full_bytes,
            format=FORMAT,
            base_files=file_entries(self.base_files()),
        )
        self._write_manifest(vdir, manifest)
        return manifest

    def _move_pointer(self, manifest: Manifest) -> None:
        """Step 3: the pointer names the version (its manifest is durable): it is served."""
        pointer = Pointer(version=manifest.version, digest=manifest.digest)
        self._write(f"{self.root}/POINTER", pointer.model_dump_json().encode())

    def _write_catch_up(
        self,
        manifest: Manifest,
        tensors: Mapping[str, torch.Tensor],
        sums: Mapping[str, str],
        bases: Mapping[int, _Held],
        stream_id: str,
    ) -> Manifest:
        """Step 4: the squashed catch-up patches from ``bases``, chunk by chunk, then the
        manifest again with them; that manifest, sealed."""
        version = manifest.version
        later = announce(version, tensors, {b: h.digest for b, h in bases.items()}, stream_id)
        views = {b: h.view for b, h in bases.items()}
        write = partial(self._write_in, self._vdir(version))
        _, more = write_chunks(later, views, tensors, self.options, write, known=sums)
        patches = [*manifest.patches, *more.values()]
        return self._write_manifest(
            self._vdir(version), manifest.model_copy(update={"patches": patches})
        )

    def _keep(
        self, manifest: Manifest, held: Mapping[int, _Held], side: HostSide, sums: dict[str, str]
    ) -> None:
        """Step 5: keep the views later versions patch from, and the version's device view."""
        version = manifest.version
        views = {**held, version: _Held(side.view, manifest.digest, sums)}
        kept = board_plan.keep_views(version, views, self.options.catchup_levels)
        self._held = {v: views[v] for v in kept}
        self._head = manifest
        self._device = (version, side.device) if side.device is not None else None

    def _durable_latest(self) -> int | None:
        """The pointer's version; if the pointer is malformed or names a version without a
        manifest (damaged), the newest version that has one, so the next publish repairs it."""
        try:
            latest = self.latest()
        except PointerMalformed as exc:
            newest = self._newest_manifest()
            log.error("board.pointer_malformed", run=self.run, error=str(exc), newest=newest)
            return newest
        if latest is None or (self._head is not None and self._head.version == latest):
            return latest  # nothing, or the version this publisher wrote last
        try:
            self.manifest(latest)
            return latest
        except (VersionCorrupt, BoardFormatError):
            raise
        except BoardError:
            newest = self._newest_manifest()
            log.error("board.pointer_dangling", run=self.run, pointer=latest, newest=newest)
            return newest

    def _newest_manifest(self) -> int | None:
        try:
            found = self.store.dirs_with(f"{self.root}/versions", MANIFEST)
        except FileNotFoundError:
            return None
        return max((int(d) for d in found if d.isascii() and d.isdigit()), default=None)

    # -- retention -------------------------------------------------------------------------------
    def gc(self, keep_from: int) -> list[int]:
        """Delete versions no reader holding ``≥ keep_from`` (or starting fresh) needs.

        Keeps the newest anchor at or before ``keep_from`` and everything after it; returns
        the versions deleted. Call it with the oldest version any live reader may still hold.
        """
        vs = self.versions()
        kinds: dict[int, str] = {}
        for v in reversed(vs):
            kinds[v] = "unknown"
            if v <= keep_from:
                kinds[v] = self.manifest(v).kind
                if kinds[v] == "anchor":
                    break
        kinds.update({v: "unknown" for v in vs if v not in kinds})
        gone = board_plan.removable(kinds, keep_from, vs[-1] if vs else None)
        for v in gone:
            self._manifests.pop(v, None)
            vdir = self._vdir(v)
            self.store.remove_dir(vdir, MANIFEST)  # manifest first: never listed half-deleted
        if gone:
            log.info(
                "board.gc",
                board=self.safe_url,
                run=self.run,
                keep_from=keep_from,
                deleted=len(gone),
            )
        return gone
