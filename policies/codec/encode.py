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
- With ``verify=True`` every tensor the patch writes is checked against the target's xxh3-128
  checksum (:class:`PatchChecksumMismatch`). Tensors the patch does not touch are covered by the
  base digest (computed, or vouched for by the caller with ``base_digest=``).
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
    header  := {"format": 1, "base_digest", "target_digest", "chunk": C, "removed": [name…],
                "tensors": [{"name", "op", "dtype", "shape", "checksum", "units", "width",
                             "changed", "offset", "length", "alias_of"}…]}
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

Modules: this one encodes (the package names the public surface); :mod:`policies.codec.format` holds
the frame and header, :mod:`policies.codec.apply` applies patches, :mod:`policies.codec.ops` reads
and writes sections (numba-compiled loops in :mod:`policies.codec.kernels` and
:mod:`policies.codec.kernels_apply`; vectorized numpy reference of the format alongside);
:mod:`policies.codec.scan` scans device tensors.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import structlog
import torch
import xxhash
import zstandard

from policies.codec.apply import apply_patch
from policies.codec.digests import (
    StorageKey,
    checksums,
    digest_of,
    dtype_name,
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
from policies.codec.ops import (
    Changes,
    encode_section,
    start_changes,
    unit_view,
)
from policies.codec.scan import scan_tensor
from policies.codec.workers import workers
from policies.errors import PatchError

log = structlog.get_logger(__name__)

_IN_FLIGHT = 2
"""Tensors whose sections may wait to be written and compressed while the next is scanned."""
_AHEAD = 2
"""Tensors whose scans are queued ahead of the one whose section is being written."""


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


def _section(
    b: UInt | None, t: UInt | None, changes: Changes, floating: bool, level: int, chunk: int
) -> bytes:
    """The compressed section storing ``changes`` (empty when nothing changed)."""
    if not changes.changed:
        return b""
    return _compress(encode_section(b, t, changes, floating, chunk).data, level)


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
    them from the previous and current version); otherwise they are computed. ``chunk`` (units
    per chunk, a multiple of 8 up to 2**21) is recorded in the patch.
    """
    if chunk % 8 or not 8 <= chunk <= 1 << 21:
        raise ValueError(f"chunk must be a multiple of 8 in [8, 2**21], got {chunk}")
    sums = dict(target_checksums) if target_checksums is not None else checksums(target)
    sums.update(checksums({k: v for k, v in target.items() if k not in sums}))
    bdig = base_digest if base_digest is not None else state_digest(base)
    tdig = digest_of((k, dtype_name(t), list(t.shape), sums[k]) for k, t in target.items())
    records: list[dict[str, Any]] = []
    sections: list[Future[bytes] | None] = []
    scans: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (record index, base, target)
    primary: dict[StorageKey, str] = {}
    pool = workers()
    for name in sorted(target):
        t = target[name]
        rec: dict[str, Any] = {
            "name": name,
            "dtype": dtype_name(t),
            "shape": list(t.shape),
            "checksum": sums[name],
            "width": _width(t),
            "alias_of": None,
        }
        rec["units"] = t.numel() * t.element_size() // rec["width"]
        key = storage_key(t)
        b = base.get(name)
        section: Future[bytes] | None = None
        if key in primary:
            rec.update(op="alias", alias_of=primary[key], changed=0)
        elif b is None or dtype_name(b) != rec["dtype"] or tuple(b.shape) != tuple(t.shape):
            section = pool.submit(_compress, raw_bytes(t).data, level)
            rec.update(op="full", changed=rec["units"])
        else:
            scans.append((len(records), b, t))
            rec.update(op="patch")
        primary.setdefault(key, name)
        records.append(rec)
        sections.append(section)

    # Each tensor's scan is queued _AHEAD tensors before its section is written, so the
    # pool never idles between tensors; at most _IN_FLIGHT sections wait to be written
    # and compressed (which bounds the scanned changes held in memory). Sections are
    # queued ahead of the scans: behind them, they waited for the next tensors' scans.
    # (units are taken when a scan starts: a device or strided tensor is copied only then)
    def start(k: int) -> tuple[UInt | None, UInt | None, Callable[[], Changes]]:
        _, b, t = scans[k]
        w = _width(t)
        if b.device.type != "cpu" or t.device.type != "cpu":
            return None, None, pool.submit(scan_tensor, b, t, w, chunk).result
        bu, tu = unit_view(raw_bytes(b), w), unit_view(raw_bytes(t), w)
        return bu, tu, start_changes(bu, tu, pool, chunk)

    queued = deque(start(k) for k in range(min(_AHEAD, len(scans))))
    pending: deque[Future[bytes]] = deque()
    for k, (i, _, t) in enumerate(scans):
        if k + _AHEAD < len(scans):
            queued.append(start(k + _AHEAD))
        bu, tu, collect = queued.popleft()
        changes = collect()
        records[i]["changed"] = changes.changed
        floating = t.dtype.is_floating_point
        section = pool.submit_first(_section, bu, tu, changes, floating, level, chunk)
        sections[i] = section
        pending.append(section)
        if len(pending) > _IN_FLIGHT:
            pending.popleft().result()
    body = [s.result() if s is not None else b"" for s in sections]
    offset = 0
    for rec, data in zip(records, body, strict=True):
        rec.update(offset=offset, length=len(data))
        offset += len(data)
    header = {
        "format": FORMAT,
        "base_digest": bdig,
        "target_digest": tdig,
        "chunk": chunk,
        "removed": sorted(set(base) - set(target)),
        "tensors": records,
    }
    hbytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    frame = b"".join([MAGIC, U32.pack(len(hbytes)), hbytes, *body])
    log.debug(
        "patch.encoded",
        base=bdig,
        target=tdig,
        tensors=len(records),
        bytes=len(frame) + 16,
        changed=sum(r["changed"] for r in records if r["op"] != "alias"),
    )
    return frame + xxhash.xxh3_128_digest(frame)


def squash(base: Mapping[str, torch.Tensor], patches: Iterable[bytes], *, level: int = 1) -> bytes:
    """One patch equal to applying ``patches`` in order to ``base`` (catch-up v → v+k)."""
    state: dict[str, torch.Tensor] = dict(base)
    first = True
    for p in patches:
        state = apply_patch(state, p, in_place=not first)
        first = False
    return encode_patch(base, state, level=level)
