"""Applying a patch: :func:`apply_patch` (re-exported by :mod:`policies.codec`).

Integrity is checked in this order: the frame checksum (:func:`parse_patch`), the base digest,
then, with ``verify=True``, every written tensor against the target's ``sum-128`` checksum. The
checksum is updated as the patch is written when the caller passes the base's checksums: the
base tensor's, plus each written word's new term less its old one
(:mod:`policies.codec.kernels_sum`), so verifying costs the words written instead of a pass over
the tensor. A sum alone would miss a word that was wrong in memory before the patch wrote it
(the patch stores deltas, so the damage survives the write and cancels out of the sum): the same
passes also sum the terms the changed words had before (fused into the scatter, which reads them
anyway), and that sum must be the record's ``old_words``, what the publisher's base held there
(:class:`PatchBaseCorrupt` otherwise, checked before the target's checksum). What that leaves
out: a word of the base that was already wrong in memory and that the patch does not change (the
caller vouched for the base, as with ``base_digest``). Inside
:func:`policies.codec.written.recording`, the frame is kept once it applied. Tensors are
decompressed, patched (compiled, :func:`policies.codec.ops.apply_section`) and verified on the
process's codec threads (:mod:`policies.codec.workers`), one tensor per task.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future, wait

import numpy as np
import numpy.typing as npt
import structlog
import torch
import zstandard

from policies.codec.digests import (
    StorageKey,
    dtype_name,
    hex_lanes,
    lanes_hex,
    state_digest,
    storage_key,
    tensor_checksum,
)
from policies.codec.format import TensorRecord, parse_patch
from policies.codec.ops import apply_section, unit_view
from policies.codec.workers import workers
from policies.codec.written import Frame, current
from policies.errors import (
    PatchBaseCorrupt,
    PatchBaseMismatch,
    PatchChecksumMismatch,
    PatchCorrupt,
    PatchError,
)

log = structlog.get_logger("policies.codec")

INCREMENTAL_DENSITY = 0.04
"""Above this fraction of changed units a written tensor is hashed whole instead: on the bench
host (``orchestrate bench codec``) the check from the written words added 0.29 of a copy's time
at 1%, 0.62 at 3% and 3.9 at 10%, where a pass of the hash costs about one."""


def _decompress(data: memoryview, name: str) -> bytes:
    try:
        return zstandard.ZstdDecompressor().decompress(data)
    except zstandard.ZstdError as exc:
        raise PatchCorrupt(f"{name}: section does not decompress: {exc}") from exc


def _apply_section(
    dst: torch.Tensor,
    rec: TensorRecord,
    data: bytes,
    chunk: int,
    acc: npt.NDArray[np.uint64] | None,
    olds: npt.NDArray[np.uint64] | None,
) -> None:
    units = unit_view(dst.reshape(-1).view(torch.uint8).numpy(), rec.width)
    if units.size != rec.units:
        raise PatchBaseMismatch(f"{rec.name}: base has {units.size} units, patch {rec.units}")
    try:
        apply_section(units, data, chunk, acc, olds)
    except ValueError as exc:
        raise PatchCorrupt(f"{rec.name}: {exc}") from exc


def _target_tensor(rec: TensorRecord, data: bytes) -> torch.Tensor:
    dtype = getattr(torch, rec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise PatchCorrupt(f"{rec.name}: unknown dtype {rec.dtype}")
    buf = bytearray(data)
    if len(buf) != rec.units * rec.width:
        raise PatchCorrupt(f"{rec.name}: {len(buf)} bytes for {rec.units} units")
    flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(rec.shape)


def _build(
    rec: TensorRecord,
    section: memoryview,
    dst: torch.Tensor | None,
    chunk: int,
    verify: bool,
    held: npt.NDArray[np.uint64] | None,
) -> torch.Tensor:
    """One target tensor: decompressed (``full``) or ``dst`` patched in place, then verified
    when ``verify``: given ``held`` (the base tensor's ``sum-128`` lanes), the base words it
    changed against the record's ``old_words``, then its checksum updated from ``held`` by the
    words written; else its checksum hashed whole."""
    incremental = held is not None and verify
    acc = np.zeros(2, dtype=np.uint64) if incremental else None
    olds = np.zeros(3, dtype=np.uint64) if incremental else None
    if dst is None:
        out = _target_tensor(rec, _decompress(section, rec.name))
    else:
        if rec.length:
            _apply_section(dst, rec, _decompress(section, rec.name), chunk, acc, olds)
        out = dst
    if verify and (dst is None or rec.length):
        if acc is not None and olds is not None and held is not None:
            _check_old_words(rec, olds)
            got = lanes_hex(held + acc)
        else:
            got = tensor_checksum(out)
        if got != rec.checksum:
            raise PatchChecksumMismatch(
                f"{rec.name}: patched tensor checksum {got} != target {rec.checksum}"
            )
    return out


def _check_old_words(rec: TensorRecord, olds: npt.NDArray[np.uint64]) -> None:
    """Refuse a base whose words the patch changed were not the patch's base's: the check from
    the words written cannot see them otherwise (their damage cancels out of it)."""
    got = lanes_hex(olds[:2])
    if got != rec.old_words:
        raise PatchBaseCorrupt(
            f"{rec.name}: the base words this patch changed sum to {got}, its base's to "
            f"{rec.old_words}: the base held is not its base there (damaged since it was "
            "verified, or already patched): reload it"
        )


def _destination(
    rec: TensorRecord,
    base: Mapping[str, torch.Tensor],
    base_groups: Mapping[StorageKey, list[str]],
    target_group: Mapping[str, str],
    in_place: bool,
) -> torch.Tensor:
    """The tensor a ``patch`` record is written into: the base tensor itself or a copy of it."""
    src = base.get(rec.name)
    if src is None or dtype_name(src) != rec.dtype or tuple(src.shape) != rec.shape:
        raise PatchBaseMismatch(
            f"{rec.name}: base lacks this tensor as {rec.dtype}{list(rec.shape)}"
        )
    if src.device.type != "cpu":
        raise PatchError(f"{rec.name}: apply_patch works on CPU tensors, got {src.device}")
    dst = src.detach()
    sharers = base_groups.get(storage_key(dst), [])
    shared = any(target_group.get(s, s) != rec.name for s in sharers if s != rec.name)
    if not in_place or (rec.length and (shared or not dst.is_contiguous())):
        dst = dst.contiguous().clone()
    return dst


def apply_patch(
    base: MutableMapping[str, torch.Tensor],
    patch: bytes,
    *,
    in_place: bool = True,
    base_digest: str | None = None,
    base_checksums: Mapping[str, str] | None = None,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """Apply ``patch`` to ``base`` and return the target state.

    ``in_place=True`` writes into the base tensors and the base mapping (no copy of the view);
    ``in_place=False`` leaves ``base`` untouched. ``base_digest`` vouches for the base (e.g. the
    digest a previous apply returned) instead of hashing it; ``base_checksums``, the base's
    ``sum-128`` checksums (e.g. its manifest's, vouched for like ``base_digest``), let a
    ``sum-128`` patch's check be updated from the words written instead of hashing each
    written tensor; the base words it changes are then checked against the patch's
    ``old_words`` (:class:`PatchBaseCorrupt`: not the base there). Tensors are decoded
    and verified on the process's codec threads (:mod:`policies.codec.workers`), all of them
    done when this returns or raises. If a check fails after writing in place, the base is
    partially patched: reload it from a verified version.
    """
    header, body = parse_patch(patch)
    bdig = base_digest if base_digest is not None else state_digest(base)
    if bdig != header.base_digest:
        raise PatchBaseMismatch(
            f"patch expects base {header.base_digest}, got base {bdig}: apply the patch to the "
            "version it was made from (or fetch a patch or anchor for this base)"
        )
    base_groups: dict[StorageKey, list[str]] = {}
    for name, t in base.items():
        base_groups.setdefault(storage_key(t), []).append(name)
    target_group = {r.name: r.alias_of or r.name for r in header.tensors}
    out: dict[str, torch.Tensor] = {}
    pool = workers("apply")
    jobs: dict[str, Future[torch.Tensor]] = {}
    try:
        for rec in header.tensors:
            if rec.op not in ("patch", "full", "alias"):
                raise PatchCorrupt(f"{rec.name}: unknown op {rec.op}")
            if rec.op == "alias":
                continue
            dst, held = None, None
            if rec.op == "patch":
                dst = _destination(rec, base, base_groups, target_group, in_place)
                if (
                    base_checksums is not None
                    and rec.name in base_checksums
                    and rec.changed <= rec.units * INCREMENTAL_DENSITY
                ):
                    held = hex_lanes(base_checksums[rec.name])
            section = body[rec.offset : rec.offset + rec.length]
            jobs[rec.name] = pool.submit(_build, rec, section, dst, header.chunk, verify, held)
        for rec in header.tensors:
            if rec.op != "alias":
                out[rec.name] = jobs[rec.name].result()
            elif rec.alias_of in out:
                out[rec.name] = out[rec.alias_of]
            else:
                raise PatchCorrupt(f"{rec.name}: alias of unknown tensor {rec.alias_of}")
    finally:
        wait(jobs.values())  # no job writes into the base once this returns or raises
    log.debug(
        "patch.applied",
        base=header.base_digest,
        target=header.target_digest,
        changed=header.changed,
        bytes=header.patch_bytes,
        verified=verify,
    )
    if (written := current()) is not None:
        sums = None if base_checksums is None else dict(base_checksums)
        written.add(Frame(bytes(patch), sums))
    if in_place:
        for name in header.removed:
            base.pop(name, None)
        base.update(out)
    return out
