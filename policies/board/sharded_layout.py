"""A sharded version's pieces: what one rank holds of each tensor, the view it serves of them, and
the manifest that puts every rank's pieces together.

A *piece* is one rank's box of a full tensor (:class:`Piece`): a ``DTensor``'s local shard at the
offset its placements give (torch's ``compute_local_shape_and_global_offset``), or a plain tensor
whole (replicated: rank 0 writes it). Of a ``DTensor`` replicated over some mesh dimensions only
the ranks at coordinate 0 of those dimensions write it. Names whose local tensors share one
storage are tied (:func:`tied_names`) and served once. :func:`sharded_manifest` builds the
version's manifest from every rank's :class:`~policies.board.types.ShardEntry`: each tensor's
checksum is its pieces' (:func:`policies.board.manifest.pieces_checksum`) and each patch the sum
of the ranks' patches from its base.

Nothing here writes to the board or talks to other ranks: the commit protocol that does is
:mod:`policies.board.sharded`.

Not covered: DTensor placements other than ``Shard`` and ``Replicate`` (refused, as are strided
shards); quantized views (only the casts in :data:`CAST_VIEWS`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from policies.board.manifest import manifest_digest, manifest_seal, pieces_checksum
from policies.board.types import (
    FORMAT,
    FileEntry,
    Manifest,
    PatchRef,
    PieceEntry,
    ShardEntry,
    TensorEntry,
)
from policies.codec import CODEC
from policies.codec.digests import storage_key
from policies.errors import BoardError

CAST_VIEWS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The views a sharded publish serves: every floating tensor cast to this dtype (round to
nearest even, as :func:`policies.codec.views.build_view`); other tensors unchanged."""


@dataclass(frozen=True)
class Piece:
    """This rank's piece of one tensor: its box in the full tensor, and the local tensor."""

    offset: list[int]
    local: torch.Tensor
    full_shape: list[int]
    publish: bool
    """Whether this rank writes it (readers other than the first do not)."""


def rank_piece(name: str, t: torch.Tensor, rank: int) -> Piece:
    """Rank ``rank``'s piece of ``t``: its box in the full tensor, and whether it writes it."""
    if not isinstance(t, DTensor):
        return Piece([0] * t.dim(), t.detach(), list(t.shape), rank == 0)
    for p in t.placements:
        if type(p) is not Shard and not isinstance(p, Replicate):
            raise BoardError(
                f"{name}: DTensor placement {p} cannot be published sharded: use Shard or "
                "Replicate placements (reduce a Partial tensor first)"
            )
    local = t.to_local().detach()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise BoardError(
            f"{name}: the local shard is {list(local.shape)}, its placements give "
            f"{list(shape)}: publish the DTensor as the trainer holds it"
        )
    coord = t.device_mesh.get_coordinate()
    first = coord is not None and all(
        c == 0 for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate)
    )
    return Piece(list(offset), local, list(t.shape), first)


def tied_names(pieces: Mapping[str, Piece]) -> dict[str, str]:
    """Tied names → their primary (the first in name order), as this rank sees them: two names
    whose non-empty local tensors share one storage (an empty shard shows no tie)."""
    first: dict[object, str] = {}
    ties: dict[str, str] = {}
    for name in sorted(pieces):
        p = pieces[name]
        if p.local.numel() == 0:
            continue
        key = (storage_key(p.local), tuple(p.full_shape))
        if key in first:
            ties[name] = first[key]
        else:
            first[key] = name
    return ties


def tensor_meta(
    pieces: Mapping[str, Piece], dtype: torch.dtype
) -> dict[str, tuple[str, list[int]]]:
    """Every tensor's served dtype and full shape."""
    return {
        name: (
            str(dtype if p.local.is_floating_point() else p.local.dtype).removeprefix("torch."),
            p.full_shape,
        )
        for name, p in pieces.items()
    }


def served_view(
    pieces: Mapping[str, Piece], aliases: Mapping[str, str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The served view of this rank's pieces, on their device (copies): tied names and pieces
    other ranks write left out; every floating tensor cast to ``dtype``."""
    view: dict[str, torch.Tensor] = {}
    for name, p in pieces.items():
        if name in aliases or not p.publish or p.local.numel() == 0:
            continue
        to = dtype if p.local.is_floating_point() else p.local.dtype
        view[name] = p.local.to(dtype=to, copy=True).contiguous()
    return view


def sharded_manifest(
    version: int,
    view_name: str,
    meta: Mapping[str, tuple[str, list[int]]],
    aliases: Mapping[str, str],
    entries: list[ShardEntry],
    *,
    latest: int | None,
    head: Manifest | None,
    base_digests: Mapping[int, str],
    is_anchor: bool,
    full_bytes: int,
    base_files: dict[str, FileEntry],
) -> Manifest:
    """The manifest of ``version`` from every rank's entry, sealed: ``meta`` (every tensor's
    served dtype and full shape, :func:`tensor_meta`), ``head`` (the previous version's manifest,
    when this publisher wrote it), ``base_digests`` (each patch base's version digest)."""
    by_tensor: dict[str, dict[int, PieceEntry]] = {}
    for e in entries:
        for name, p in e.pieces.items():
            by_tensor.setdefault(name, {})[e.rank] = p
    tensors = {
        name: TensorEntry(
            dtype=dtype,
            shape=shape,
            checksum=pieces_checksum(by_tensor.get(aliases.get(name, name), {})),
        )
        for name, (dtype, shape) in meta.items()
    }
    patches = []
    for ref in entries[0].patches:
        refs = [p for e in entries for p in e.patches if p.base == ref.base]
        patches.append(
            PatchRef(
                base=ref.base,
                file=ref.file,
                bytes=sum(p.bytes for p in refs),
                changed=sum(p.changed for p in refs),
                units=sum(p.units for p in refs),
                base_digest=base_digests[ref.base],
            )
        )
    delta = next((p.bytes for p in patches if p.base == latest), 0)
    m = Manifest(
        version=version,
        kind="anchor" if is_anchor else "delta",
        base=None if is_anchor else latest,
        view=view_name,
        codec="safetensors" if is_anchor else CODEC,
        tensors=tensors,
        digest=manifest_digest(tensors),
        bytes=sum(e.bytes for e in entries) if is_anchor else delta,
        created_at=time.time(),
        patches=patches,
        aliases=dict(aliases),
        anchor=version if is_anchor else head.anchor if head else None,
        chain_bytes=0 if is_anchor or head is None else head.chain_bytes + delta,
        full_bytes=full_bytes,
        format=FORMAT,
        base_files=base_files,
        shards=entries,
    )
    return m.model_copy(update={"seal": manifest_seal(m)})
