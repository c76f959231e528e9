"""A sharded version's pieces, read into the full view: each piece's box in its tensor, the
checksums a view would record, a rank's patch applied to its boxes, an anchor assembled.

Guarantees (the layout is :mod:`policies.board.sharded`'s): an anchor is assembled from every
rank's pieces, each piece's checksum verified before it is copied into its box of the full tensor
(tied names alias the primary again); a patch step applies each rank's patch to the boxes of the
held view that rank published, each verified like any patch (frame checksum, base digest,
written-piece checksums, target digest = the rank's digest in the manifest), from the base's
piece checksums where the base is still on the board. A materialized sharded version is
therefore the same bytes as one published whole. Damage is :class:`VersionCorrupt` naming the
rank's file; a view that is not the base is :class:`PatchBaseMismatch`.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from contextlib import nullcontext

import torch
from safetensors.torch import load as st_load

from policies.board.index import BoardIndex
from policies.board.manifest import pieces_checksum
from policies.board.types import WEIGHTS, Manifest, PieceEntry, ShardEntry, Step, shard_dir
from policies.codec import apply_patch, read_patch_header
from policies.codec.digests import checksums, tensor_checksum
from policies.codec.written import current as current_written
from policies.codec.written import recording
from policies.errors import BoardError, PatchBaseMismatch, PatchError, VersionCorrupt


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


def piece_checksums(base: Manifest, shard: ShardEntry) -> dict[str, str] | None:
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


def apply_sharded(
    index: BoardIndex,
    view: MutableMapping[str, torch.Tensor],
    step: Step,
    digest: str | None,
    m: Manifest,
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
        base = index.manifest(step.base)
    except BoardError:  # collected: each piece written is hashed
        base = None
    for shard in m.shards:
        sums = piece_checksums(base, shard) if base is not None else None
        _apply_shard(index, view, step, shard, m, vouched=digest is not None, base_checksums=sums)
    return m.digest


def _apply_shard(
    index: BoardIndex,
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
    data = index.read_exact(step.version, rel, ref.bytes)
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
        # a damaged base held (PatchBaseCorrupt) stays one: the patch is not to blame
        raise type(exc)(str(exc) if where in str(exc) else f"{where}: {exc}") from None
    except PatchError as exc:
        raise VersionCorrupt(f"{where}: {exc}") from None
    for name, p in shard.pieces.items():
        dst = view[name][piece_box(p)]
        if out[name].data_ptr() != dst.data_ptr():  # patched into a copy (not contiguous)
            dst.copy_(out[name])


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise VersionCorrupt(f"{where}: unknown dtype {name}")
    return dtype


def read_sharded_anchor(index: BoardIndex, m: Manifest) -> dict[str, torch.Tensor]:
    """The full view of a sharded anchor: every rank's pieces, verified, in their boxes."""
    full = {
        name: torch.empty(e.shape, dtype=_dtype(e.dtype, f"version {m.version}: {name}"))
        for name, e in m.tensors.items()
        if name not in m.aliases
    }
    for shard in m.shards:
        rel = f"{shard_dir(shard.rank)}/{WEIGHTS}"
        payload = index.read_exact(m.version, rel, shard.bytes)
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
