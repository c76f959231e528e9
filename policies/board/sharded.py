"""Sharded publishing: every rank of a distributed trainer publishes its own shard of a version.

A trainer under torchrun (FSDP2 ``fully_shard``, tensor parallelism) calls, on every rank::

    pub = ShardedPublisher(url, run, options=BoardOptions(...))  # default process group
    pub.create(model_dir)                                        # only rank 0 writes base/
    pub.publish(version, model.state_dict(), view_name="bf16")   # collective

``state`` maps full tensor names to ``DTensor``s (the rank publishes its local shard: its box of
the full tensor comes from the placements, via torch's
``compute_local_shape_and_global_offset``) or plain tensors (replicated: rank 0 publishes them).
Of a ``DTensor`` replicated over some mesh dimensions only the ranks at coordinate 0 of those
dimensions publish. Names whose local tensors share one storage (tied embeddings) are one tensor
served under both names. Without an initialised ``torch.distributed`` the publisher is rank 0 of
a world of one.

Layout of a sharded version::

    versions/<v:08d>/shards/<r:05d>/from-<u:08d>.patch   rank r's patch u → v of its pieces
    versions/<v:08d>/shards/<r:05d>/model.safetensors    rank r's pieces (anchor versions only)
    versions/<v:08d>/manifest.json                       every rank's pieces, patches and digest

Commit protocol (every step a collective over the process group, so all ranks agree on it):

1. rank 0 reads the pointer; all ranks exchange the version, their tied names and what they
   publish (names, dtypes, full shapes must agree);
2. each rank builds the served view of its pieces (the cast of ``view_name``) and encodes its
   patches from the views it holds (the delta and the squashed catch-up patches, as
   :meth:`policies.board.Board.publish`); the ranks exchange their delta sizes, so all decide
   alike whether the version is an anchor;
3. each rank writes its files (durably: :meth:`policies.board.store.Store.write`) and sends its
   :class:`~policies.board.types.ShardEntry` to the others;
4. only once every rank's entry arrived, rank 0 writes the manifest, then the pointer, and tells
   every rank; each then keeps its pieces' view for later patches (at most
   ``catchup_levels + 1`` views of its own shard, never the full model).

A rank whose shard lives on a GPU casts it there and, holding its previous version, moves only
the changes to the host (as :meth:`policies.board.Board.publish` does for a device view; the rank
then also keeps its previous shard view on the device). A rank's pieces, the view it serves of
them and the manifest assembled from every rank's entry are
:mod:`policies.board.sharded_layout`; this module is the protocol (the collectives and the
writes).

Guarantees: a version is visible (a manifest at or below the pointer) only after every rank's
files are durable; a failure on any rank (an error, which every rank then raises as
:class:`BoardError` naming the rank; or a rank that dies, which ends the collective) before
step 4 leaves no visible version and the pointer where it was. Files an uncommitted version left
behind are overwritten when that version is published again, or ignored (the manifest names what
a version holds); a restarted publisher holds no views, so its first version is an anchor. What a
reader verifies (per-piece checksums, per-rank patch digests, the manifest's consistency and
seal) is in :mod:`policies.board.read` and :mod:`policies.board.manifest`.

Not covered: quantized views (a quantization block or a per-tensor scale spans ranks); DTensor
placements other than ``Shard`` and ``Replicate`` (``Partial`` needs a reduction first; strided
shards from FSDP2 + TP are refused); a rank that hangs instead of dying (the collective waits for
the process group's timeout).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from policies.board import plan as board_plan
from policies.board.anchors import anchor_payload
from policies.board.host import DeviceView, encode_patches, host_side
from policies.board.manifest import file_entries
from policies.board.publish import Board
from policies.board.sharded_layout import (
    CAST_VIEWS,
    Piece,
    rank_piece,
    served_view,
    sharded_manifest,
    tensor_meta,
    tied_names,
)
from policies.board.stream_publish import ScanOn
from policies.board.types import (
    MANIFEST,
    MAX_VERSION,
    WEIGHTS,
    BoardOptions,
    Manifest,
    PatchRef,
    PieceEntry,
    Pointer,
    ShardEntry,
    shard_dir,
)
from policies.codec.digests import bytes_checksum, state_digest
from policies.errors import BoardError

log = structlog.get_logger(__name__)


@dataclass
class _Held:
    pieces: dict[str, torch.Tensor]
    digest: str
    """The digest of ``pieces`` (this rank's patches' base digest)."""
    version_digest: str
    checksums: dict[str, str]
    """The pieces' ``sum-128`` checksums (a device view's next host copy is summed from them)."""


class ShardedPublisher:
    """One rank's side of publishing sharded versions (module docstring)."""

    def __init__(
        self,
        url: str,
        run: str,
        *,
        options: BoardOptions | None = None,
        storage_options: Mapping[str, object] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.board = Board(url, run, options=options, storage_options=storage_options)
        self.options = self.board.options
        if dist.is_available() and dist.is_initialized():
            self.group = process_group
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        elif process_group is not None:
            raise BoardError("a process_group was given but torch.distributed is not initialised")
        else:
            self.group, self.rank, self.world_size = None, 0, 1
        self._held: dict[int, _Held] = {}
        self._head: Manifest | None = None
        self._device: DeviceView | None = None
        """The newest version's view of this rank's pieces on their device, if not the host."""

    def create(self, model_dir: Path) -> None:
        """Rank 0 makes ``base/`` hold the static model files of ``model_dir``
        (:meth:`policies.board.Board.create`); other ranks do nothing. Not a collective."""
        if self.rank == 0:
            self.board.create(model_dir)

    def latest(self) -> int | None:
        """The version the pointer names (:meth:`policies.board.BoardReader.latest`)."""
        return self.board.latest()

    def publish(
        self, version: int, state: Mapping[str, torch.Tensor], *, view_name: str = "bf16"
    ) -> Manifest:
        """Publish this rank's shard of ``state`` as ``version`` (a collective: every rank calls
        it with the same version); the committed manifest, on every rank."""
        latest, pieces, aliases = self._start(version, state, view_name)
        dtype = CAST_VIEWS[view_name]
        held = self._held if self._head is not None and self._head.version == latest else {}
        err: BaseException | None = None
        view: dict[str, torch.Tensor] = {}
        device: dict[str, torch.Tensor] | None = None
        sums: dict[str, str] = {}
        patches: dict[int, tuple[bytes, PatchRef]] = {}
        try:
            prev = held.get(latest) if latest is not None else None
            view, device, scan_on, known = host_side(
                served_view(pieces, aliases, dtype),
                latest,
                self._device,
                prev.pieces if prev else None,
                prev.checksums if prev else None,
            )
            sums, patches = self._encode(version, latest, view, held, scan_on, known)
        except Exception as exc:  # sent to the other ranks, then raised here unchanged
            err = exc
        digest = state_digest(view, known=sums)
        full_bytes = sum(t.nbytes for t in view.values())  # tied names are left out of a view
        delta = patches.get(latest) if latest is not None else None
        sizes = self._agree(
            "encoding its patches", (None if delta is None else delta[1].bytes, full_bytes), err
        )
        total = sum(f for _, f in sizes)
        is_anchor = self._anchor_due(version, latest, [d for d, _ in sizes], total)
        entry: ShardEntry | None = None
        try:
            entry = self._write(version, pieces, view, sums, digest, patches, is_anchor)
        except Exception as exc:  # sent to the other ranks, then raised here unchanged
            err = exc
        entries: list[ShardEntry] = self._agree("writing its shard", entry, err)
        committed: str | None = None
        try:
            if self.rank == 0:
                m = self._manifest(
                    version, latest, view_name, tensor_meta(pieces, dtype), aliases, entries,
                    held, is_anchor, total,
                )  # fmt: skip
                self._commit(m)
                committed = m.model_dump_json()
        except Exception as exc:  # sent to the other ranks, then raised here unchanged
            err = exc
        manifest = Manifest.model_validate_json(self._agree("committing", committed, err)[0])
        held = {**held, version: _Held(view, digest, manifest.digest, sums)}
        kept = board_plan.keep_views(version, held, self.options.catchup_levels)
        self._held = {v: held[v] for v in kept}
        self._head = manifest
        self._device = (version, device) if device is not None else None
        log.info(
            "board.shard_published", run=self.board.run, version=version, rank=self.rank,
            kind=manifest.kind, stored=(entry.bytes if entry else 0) + sum(
                r.bytes for _, r in patches.values()
            ),
        )  # fmt: skip
        if self.rank == 0 and self.options.retain_versions is not None:
            self.board.gc(version - self.options.retain_versions + 1)
        return manifest

    # -- collectives -----------------------------------------------------------------------------
    def _exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (a collective)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _agree(self, step: str, result: Any, error: BaseException | None) -> list[Any]:
        """Every rank's ``result``; raised on every rank if any rank failed (``error``): the
        failing rank raises its own error, the others a :class:`BoardError` naming it."""
        got = self._exchange((result, None if error is None else str(error)))
        failed = [(r, e) for r, (_, e) in enumerate(got) if e is not None]
        if error is not None:
            raise error
        if failed:
            r, e = failed[0]
            raise BoardError(f"sharded publish failed on rank {r} while {step}: {e}")
        return [res for res, _ in got]

    # -- the steps -------------------------------------------------------------------------------
    def _start(
        self, version: int, state: Mapping[str, torch.Tensor], view_name: str
    ) -> tuple[int | None, dict[str, Piece], dict[str, str]]:
        """Step 1: the pointer's version (rank 0 reads it), this rank's pieces and the tied
        names, once every rank asks for the same version and publishes the same tensors."""
        err: BaseException | None = None
        latest: int | None = None
        pieces: dict[str, Piece] = {}
        ties: dict[str, str] = {}
        meta = ""
        try:
            if view_name not in CAST_VIEWS:
                raise BoardError(
                    f"view {view_name!r} cannot be published sharded: use one of "
                    f"{', '.join(CAST_VIEWS)} (quantized views need whole quantization blocks on "
                    "one rank and are not supported by ShardedPublisher)"
                )
            if type(version) is not int or not 0 <= version <= MAX_VERSION:
                raise BoardError(f"version {version!r} is not an integer in 0..{MAX_VERSION}")
            if self.rank == 0:
                latest = self.board._durable_latest()
                if latest is not None and version <= latest:
                    raise BoardError(
                        f"pointer only moves forward: version {version} <= current {latest}"
                    )
            pieces = {name: rank_piece(name, t, self.rank) for name, t in state.items()}
            ties = tied_names(pieces)
            tensors = sorted(tensor_meta(pieces, CAST_VIEWS[view_name]).items())
            meta = bytes_checksum(repr(tensors).encode())
        except Exception as exc:  # sent to the other ranks, then raised here unchanged
            err = exc
        got = self._agree("starting", (version, latest, meta, ties), err)
        if len({v for v, _, _, _ in got}) > 1:
            raise BoardError(
                f"ranks publish different versions ({[v for v, _, _, _ in got]} by rank): every "
                "rank must call publish with the same version"
            )
        differ = [r for r, (_, _, n, _) in enumerate(got) if n != got[0][2]]
        if differ:
            raise BoardError(
                f"ranks {differ} publish other tensor names, dtypes or shapes than rank 0: every "
                "rank must pass the same state dict keys"
            )
        aliases: dict[str, str] = {}
        for _, _, _, theirs in got:
            aliases.update(theirs)
        latest0: int | None = got[0][1]
        return latest0, pieces, aliases

    def _encode(
        self,
        version: int,
        latest: int | None,
        view: Mapping[str, torch.Tensor],
        held: Mapping[int, _Held],
        scan_on: ScanOn | None,
        known: Mapping[str, str] | None,
    ) -> tuple[dict[str, str], dict[int, tuple[bytes, PatchRef]]]:
        """Step 2: the checksums of this rank's pieces and its patches into ``version``, by base
        (as :meth:`Board.publish`; :func:`policies.board.host.encode_patches`)."""
        bases = board_plan.patch_bases(version, latest, held, self.options.catchup_levels)
        pieces = {b: (held[b].pieces, held[b].digest) for b in bases}
        return encode_patches(pieces, view, self.options, scan_on=scan_on, known=known)

    def _anchor_due(
        self, version: int, latest: int | None, deltas: list[int | None], full_bytes: int
    ) -> bool:
        """Whether ``version`` is an anchor (:meth:`Board.publish`'s rule over the ranks' delta
        sizes summed); the same answer on every rank, which all have the same inputs."""
        head = self._head if self._head is not None and self._head.version == latest else None
        if head is None or head.anchor is None or any(d is None for d in deltas):
            return True
        delta = sum(d for d in deltas if d is not None)
        opts = self.options
        return (
            version - head.anchor >= opts.anchor_every
            or head.chain_bytes + delta > opts.anchor_fraction * full_bytes
        )

    def _write(
        self,
        version: int,
        pieces: Mapping[str, Piece],
        view: Mapping[str, torch.Tensor],
        sums: Mapping[str, str],
        digest: str,
        patches: Mapping[int, tuple[bytes, PatchRef]],
        is_anchor: bool,
    ) -> ShardEntry:
        """Step 3: this rank's files, durable; its entry for the manifest."""
        sdir = f"{self.board._vdir(version)}/{shard_dir(self.rank)}"
        for data, ref in patches.values():
            self.board.store.write(f"{sdir}/{ref.file}", data)
        payload = b""
        if is_anchor:
            payload, _ = anchor_payload(view)
            self.board.store.write(f"{sdir}/{WEIGHTS}", payload)
        return ShardEntry(
            rank=self.rank,
            pieces={
                name: PieceEntry(
                    offset=pieces[name].offset, shape=list(t.shape), checksum=sums[name]
                )
                for name, t in view.items()
            },
            digest=digest,
            bytes=len(payload),
            patches=[ref for _, ref in patches.values()],
        )

    def _manifest(
        self,
        version: int,
        latest: int | None,
        view_name: str,
        meta: Mapping[str, tuple[str, list[int]]],
        aliases: Mapping[str, str],
        entries: list[ShardEntry],
        held: Mapping[int, _Held],
        is_anchor: bool,
        full_bytes: int,
    ) -> Manifest:
        """Step 4 (rank 0): the version's manifest from every rank's entry, sealed
        (:func:`policies.board.sharded_layout.sharded_manifest`)."""
        head = self._head if self._head is not None and self._head.version == latest else None
        return sharded_manifest(
            version, view_name, meta, aliases, entries, latest=latest, head=head,
            base_digests={b: h.version_digest for b, h in held.items()}, is_anchor=is_anchor,
            full_bytes=full_bytes, base_files=file_entries(self.board.base_files()),
        )  # fmt: skip

    def _commit(self, m: Manifest) -> None:
        """The manifest, then the pointer (every rank's files are durable by now)."""
        root = self.board.root
        self.board.store.write(
            f"{self.board._vdir(m.version)}/{MANIFEST}", m.model_dump_json(indent=1).encode()
        )
        pointer = Pointer(version=m.version, digest=m.digest)
        self.board.store.write(f"{root}/POINTER", pointer.model_dump_json().encode())
        log.info(
            "board.published", board=self.board.safe_url, run=self.board.run, version=m.version,
            kind=m.kind, bytes=m.bytes, patches=len(m.patches), ranks=len(m.shards),
        )  # fmt: skip
