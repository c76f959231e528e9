"""Bitwise sparse patches between two versions of a served view.

A patch turns the tensors of a *base* version into those of a *target* version bit for bit.
Tensors are compared as raw unsigned integers of their element width (never as floats), so
±0, NaN payloads, infinities and subnormals round-trip, and applying a patch any number of times
in a chain cannot drift.

Guarantees:

- ``apply_patch(base, encode_patch(base, target))`` equals ``target`` bit for bit, for every
  dtype whose element size is 1, 2, 4 or 8 bytes (or a multiple of 8: compared in 8-byte units).
- A patch names its base and target by :func:`state_digest`; applying it to any other base
  raises :class:`PatchBaseMismatch` before anything is modified.
- Any change to the patch bytes (a flipped byte, truncation, appended bytes) raises
  :class:`PatchCorrupt` before anything is modified (xxh3-128 over the whole frame).
- With ``verify=True`` every tensor the patch writes is checked against the target's
  ``sum-128`` checksum (:class:`PatchChecksumMismatch`; :mod:`policies.codec.digests`), which
  the encoder computes from the whole target tensor, not from the changes it found. Tensors the
  patch does not touch are covered by the base digest (computed, or vouched for by the caller
  with ``base_digest=``). Given the base's checksums too (``base_checksums=``), the check costs
  the words the patch writes, not a pass over the tensor: the checksum the base tensor had, plus
  each written word's new term less its old one; and the words it changes must have held what
  the encoder's base held there (``old_words``, :class:`PatchBaseCorrupt`), so a base word
  damaged in memory that the patch then writes is caught too.
- Tensors added, or whose dtype or shape changed, are shipped whole; removed names are listed.
  Names that alias one storage in the target (tied embeddings) are encoded once and stay tied.

Device tensors: a base and target tensor on another device (a trainer's GPU) are scanned there
with torch ops (:mod:`policies.codec.scan`); only the changed positions and units, and the dense
chunks, cross to the host, and the patch is the same bytes as from CPU copies. Checksums and
digests read host copies: pass ``base_digest`` and ``target_checksums`` to skip them.

Not covered: partially overlapping views of one storage (each is patched on its own, which is
exact only when their target bytes agree); a base tensor and its target on different devices
(:class:`PatchError`); applying to device tensors (refused with :class:`PatchError`).

Wire format (all integers little-endian)::

    frame   := MAGIC(8 = b"SPRWLPT1") | u32 H | header (H bytes, UTF-8 JSON) | body | xxh3-128(16)
    header  := {"format": 3, "base_digest", "target_digest", "chunk": C, "removed": [name…],
                "tensors": [{"name", "op", "dtype", "shape", "checksum", "units", "width",
                             "changed", "offset", "length", "alias_of", "old_words"}…]}
    op      := "patch" (section at body[offset:offset+length]; length 0 = unchanged)
             | "full"  (section = zstd(raw target bytes))  | "alias" (no section)

A ``patch`` section is one zstd frame of::

    CODING u8 | K u8 | N_VALUES u64 | N_BITMASK u64 | K × u64 plane lengths
    | MODES (one u8 per chunk) | K gap planes | N_BITMASK × C/8 bytes | N_VALUES × width bytes

The tensor is read as ``units`` unsigned integers of ``width`` bytes, cut into chunks of C units.
MODES: 0 unchanged, 1 sparse (< C/8 changes), 2 bitmask (C/8 … C/2), 3 dense (> C/2). The
changes in sparse chunks, taken together in order, are stored as gaps ``g0 = p0``,
``gi = pi - p(i-1) - 1``, each a 7-bit-group varint (low group first, high bit = more follows)
split into byte planes: plane k holds the k-th byte of every gap that has one (K ≤ 8). Each
bitmask chunk stores C/8 bytes, bit ``i % 8`` of byte ``i // 8`` marking unit ``i`` of the chunk.
Dense chunks store no positions. Values, in order: sparse changes, bitmask changes, then every
unit of every dense chunk (chunk order), each transformed by CODING — 0 ``xor`` (base ^ target),
1 ``delta`` (zigzag of target - base, wrapping), 2 ``odelta`` (the same after mapping
sign-magnitude floats to ordered integers) — and split into ``width`` byte planes, low byte
first. The encoder picks the coding with the lowest order-0 entropy on the first 16k values.
A ``patch`` record's ``old_words`` is the hex of the two ``sum-128`` lanes (no byte count) of
the base's 64-bit words that differ from the target's, each once (:mod:`policies.codec.digests`;
null for other ops).

Modules: this one encodes (the package names the public surface); :mod:`policies.codec.format` holds
the frame and header, :mod:`policies.codec.apply` applies patches, :mod:`policies.codec.ops` reads
and writes sections (numba-compiled loops in :mod:`policies.codec.kernels` and
:mod:`policies.codec.kernels_apply`; vectorized numpy reference of the format alongside);
:mod:`policies.codec.scan` scans device tensors.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any, NamedTuple

import structlog
import torch
import xxhash
import zstandard

from policies.codec.apply import apply_patch
from policies.codec.changes import JOB_UNITS, Changes, find_changes, start_changes
from policies.codec.digests import (
    StorageKey,
    checksums,
    digest_of,
    dtype_name,
    lanes_hex,
    raw_bytes,
    state_digest,
    storage_key,
)
from policies.codec.format import (
    CHUNK,
    FORMAT,
    MAGIC,
    U32,
)
from policies.codec.kernels import UInt
from policies.codec.ops import encode_section, unit_view
from policies.codec.scan import scan_tensor
from policies.codec.workers import Pool, workers
from policies.errors import PatchError

log = structlog.get_logger(__name__)

_WINDOW_UNITS = 3 << 24
"""Units of the tensors being scanned or written at once (three 32 MiB bf16 tensors; at least
two tensors whatever their size): bounds the scanned changes held in memory."""


# -- encoding -------------------------------------------------------------------------------------


def _width(t: torch.Tensor) -> int:
    size = t.element_size()
    if size in (1, 2, 4, 8):
        return size
    if size % 8 == 0:
        return 8
    raise PatchError(f"unsupported element size {size} for dtype {t.dtype}")


def _compress(raw: bytes | memoryview, level: int) -> bytes:
    # zstd's multi-threaded mode emits the same bytes for any worker count ≥ 1; below a few MiB
    # it would not split the input anyway.
    threads = 2 if len(raw) > 1 << 22 else 0
    return zstandard.ZstdCompressor(level=level, threads=threads).compress(raw)


Section = tuple[int, bytes, str | None, str | None]
"""A tensor's changed units, its compressed section, the target's ``sum-128`` checksum when
the scan summed it (None: computed from the tensor) and the record's ``old_words`` (None for a
tensor shipped whole)."""


def _whole(raw: bytes | memoryview, units: int, level: int) -> Section:
    """A tensor shipped whole: every unit changed, its bytes compressed."""
    return units, _compress(raw, level), None, None


def _section(
    b: UInt | None, t: UInt | None, changes: Changes, floating: bool, level: int, chunk: int
) -> Section:
    """The changed units and the compressed section storing ``changes`` (empty if none)."""
    lanes = changes.target_sum
    checksum = lanes_hex(lanes) if lanes is not None else None
    if changes.old_words is None:
        raise PatchError("the change scan did not sum the base words it found changed")
    old_words = lanes_hex(changes.old_words)
    if not changes.changed:
        return 0, b"", checksum, old_words
    section = _compress(encode_section(b, t, changes, floating, chunk).data, level)
    return changes.changed, section, checksum, old_words


def _one_job(
    b: torch.Tensor,
    t: torch.Tensor,
    w: int,
    floating: bool,
    level: int,
    chunk: int,
    summing: bool,
) -> Section:
    """A tensor of at most :data:`JOB_UNITS` units scanned and written by one job."""
    bu, tu = unit_view(raw_bytes(b), w), unit_view(raw_bytes(t), w)
    changes = find_changes(bu, tu, chunk, summing=summing)
    return _section(bu, tu, changes, floating, level, chunk)


def _start(
    pool: Pool,
    b: torch.Tensor,
    t: torch.Tensor,
    units: int,
    level: int,
    chunk: int,
    summing: bool,
) -> Future[Section]:
    """Queue one tensor's scan, then its section (the thread that finishes the scan queues the
    section ahead of other tensors' scans: what the encode waits on comes first); ``summing``:
    a host scan sums the target's checksum (a caller that knows it passes False).

    A small CPU tensor is one job, views taken there too: the caller's thread does next to
    nothing per tensor, where taking a tensor's views (torch calls, each of which hands the
    GIL over) while the pool's threads ran cost ~0.4 ms a tensor, and the pool idled.
    """
    w, floating = _width(t), t.dtype.is_floating_point
    if b.device.type != "cpu" or t.device.type != "cpu":
        scan = pool.submit(scan_tensor, b, t, w, chunk)
        return pool.then([scan], lambda ch: _section(None, None, ch[0], floating, level, chunk))
    if units <= JOB_UNITS:
        return pool.submit(_one_job, b, t, w, floating, level, chunk, summing)
    # units are taken when the scan is queued: a strided tensor is copied only then
    bu, tu = unit_view(raw_bytes(b), w), unit_view(raw_bytes(t), w)
    jobs, assemble = start_changes(bu, tu, pool, chunk, summing=summing)
    return pool.then(jobs, lambda parts: _section(bu, tu, assemble(parts), floating, level, chunk))


Record = dict[str, Any]
"""A tensor's header record (the wire format's ``tensors`` entry), filled in as it is encoded."""


class _Plan(NamedTuple):
    """What encoding a target takes, tensor by tensor in name order (:func:`_plan`)."""

    records: list[Record]
    sections: list[Future[Section] | None]
    """Each record's section, once queued (None: no section, or its scan is not queued yet)."""
    scans: list[tuple[int, torch.Tensor, torch.Tensor]]
    """The tensors to scan against their base: (record index, base, target)."""


def _plan(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    sums: Mapping[str, str],
    pool: Pool,
    level: int,
) -> _Plan:
    """Every target tensor's record and how it is stored: an alias of the first name sharing its
    storage, whole (added, or its dtype or shape changed: queued on ``pool`` at once), or a
    patch against its base (a scan, queued by :func:`_queue_scans`)."""
    plan = _Plan([], [], [])
    primary: dict[StorageKey, str] = {}
    for name in sorted(target):
        t = target[name]
        rec: Record = {
            "name": name,
            "dtype": dtype_name(t),
            "shape": list(t.shape),
            "checksum": sums.get(name),
            "width": _width(t),
            "alias_of": None,
            "changed": 0,
            "old_words": None,
        }
        rec["units"] = t.numel() * t.element_size() // rec["width"]
        key = storage_key(t)
        b = base.get(name)
        section: Future[Section] | None = None
        if key in primary:
            rec.update(op="alias", alias_of=primary[key])
        elif b is None or dtype_name(b) != rec["dtype"] or tuple(b.shape) != tuple(t.shape):
            section = pool.submit(_whole, raw_bytes(t).data, rec["units"], level)
            rec.update(op="full")
        else:
            plan.scans.append((len(plan.records), b, t))
            rec.update(op="patch")
        primary.setdefault(key, name)
        plan.records.append(rec)
        plan.sections.append(section)
    return plan


def _queue_scans(pool: Pool, plan: _Plan, level: int, chunk: int) -> None:
    """Queue the plan's scans, each followed by its section, into ``plan.sections``.

    Tensors are queued while those in flight hold fewer than :data:`_WINDOW_UNITS` units (two at
    least), so the pool never idles between tensors and the scanned changes held in memory stay
    bounded; each tensor's section is queued by the thread that finishes its scan.
    """
    in_flight: deque[tuple[int, Future[Section]]] = deque()
    held = 0
    for i, b, t in plan.scans:
        units = plan.records[i]["units"]
        while len(in_flight) >= 2 and held + units > _WINDOW_UNITS:
            done, oldest = in_flight.popleft()
            oldest.result()
            held -= done
        summing = plan.records[i]["checksum"] is None
        plan.sections[i] = started = _start(pool, b, t, units, level, chunk, summing)
        in_flight.append((units, started))
        held += units


def _body(plan: _Plan) -> list[bytes]:
    """The sections in record order, each record given its changes, place in the body, old
    words and (when the scan summed it) checksum."""
    body: list[bytes] = []
    offset = 0
    for rec, section in zip(plan.records, plan.sections, strict=True):
        none: Section = (0, b"", None, None)
        changed, data, summed, old_words = section.result() if section is not None else none
        rec.update(changed=changed, offset=offset, length=len(data), old_words=old_words)
        if rec["checksum"] is None:
            rec["checksum"] = summed
        body.append(data)
        offset += len(data)
    return body


def _fill_checksums(records: list[Record], target: Mapping[str, torch.Tensor]) -> None:
    """The checksums no scan summed: an alias's is its primary's; tensors shipped whole or
    scanned off the host are summed here."""
    by_name = {r["name"]: r for r in records}
    for rec in records:
        if rec["checksum"] is None and rec["alias_of"] is not None:
            rec["checksum"] = by_name[rec["alias_of"]]["checksum"]
    left = {r["name"]: target[r["name"]] for r in records if r["checksum"] is None}
    summed_now = checksums(left)
    for rec in records:
        if rec["checksum"] is None:
            rec["checksum"] = summed_now[rec["name"]]


def _frame(header: Mapping[str, Any], body: list[bytes]) -> bytes:
    """The patch frame: magic, header length, header (canonical JSON), body, xxh3-128 of it all."""
    hbytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    frame = b"".join([MAGIC, U32.pack(len(hbytes)), hbytes, *body])
    return frame + xxhash.xxh3_128_digest(frame)


def encode_patch(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    *,
    level: int = 1,
    base_digest: str | None = None,
    target_checksums: Mapping[str, str] | None = None,
    chunk: int = CHUNK,
) -> bytes:
    """Encode the patch that turns ``base`` into ``target``.

    ``base_digest`` and ``target_checksums`` may be passed when already known (a publisher has
    them from the previous version and, for a scan off the host, of the current one's host
    copy); otherwise they are computed: a tensor scanned on the host has its checksum summed
    by the scan as it reads the target (no pass of its own). ``chunk`` (units per chunk, a
    multiple of 8 up to 2**21) is recorded in the patch.
    """
    if chunk % 8 or not 8 <= chunk <= 1 << 21:
        raise ValueError(f"chunk must be a multiple of 8 in [8, 2**21], got {chunk}")
    sums = dict(target_checksums) if target_checksums is not None else {}
    bdig = base_digest if base_digest is not None else state_digest(base)
    pool = workers("encode")
    plan = _plan(base, target, sums, pool, level)
    _queue_scans(pool, plan, level, chunk)
    body = _body(plan)
    records = plan.records
    _fill_checksums(records, target)
    tdig = digest_of((r["name"], r["dtype"], r["shape"], r["checksum"]) for r in records)
    header = {
        "format": FORMAT,
        "base_digest": bdig,
        "target_digest": tdig,
        "chunk": chunk,
        "removed": sorted(set(base) - set(target)),
        "tensors": records,
    }
    patch = _frame(header, body)
    log.debug(
        "patch.encoded",
        base=bdig,
        target=tdig,
        tensors=len(records),
        bytes=len(patch),
        changed=sum(r["changed"] for r in records if r["op"] != "alias"),
    )
    return patch


def squash(base: Mapping[str, torch.Tensor], patches: Iterable[bytes], *, level: int = 1) -> bytes:
    """One patch equal to applying ``patches`` in order to ``base`` (catch-up v → v+k)."""
    state: dict[str, torch.Tensor] = dict(base)
    first = True
    for p in patches:
        state = apply_patch(state, p, in_place=not first)
        first = False
    return encode_patch(base, state, level=level)
