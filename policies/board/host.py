"""A publisher's host side: the host copy of the view it publishes, and the patches into it.

:meth:`policies.board.Board.publish` and :class:`policies.board.ShardedPublisher` write from a host
copy of the view (anchor files, catch-up patches and the next version's patches read it).
:func:`host_side` builds it: a view on the host is used as it is (made contiguous where it is not);
a view on a device (a GPU trainer's) whose previous version the publisher holds, on the device and
on the host, is compared with it where it lives and only the changed units cross
(:func:`policies.codec.scan.host_copy`, which also sums the host copy's ``sum-128`` checksums from
the previous version's and the changes: nothing of it is hashed), and the delta from the previous
version is then scanned on the device (:data:`~policies.board.stream_publish.ScanOn`).
:func:`encode_patches` encodes the patches into a view from each base version the publisher holds.

Guarantees: the host copy holds the view's bits, names tied on the device sharing one host
tensor, as long as the previous host copy is the previous device view's (the publisher keeps the
two together); a patch scanned on the device is the same bytes as one scanned on the host copy
(:mod:`policies.codec.encode`).

Not covered: a device view whose tensors are the previous one's storage (live parameters the
optimizer changed in place leave nothing to compare with) is copied whole, as is a publisher's
first device view; the caller must not modify a device view it published (the next one is
compared with it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from policies.board.stream_publish import ScanOn
from policies.board.types import BoardOptions, PatchRef, patch_file
from policies.codec import encode_patch, read_patch_header
from policies.codec import scan as device_scan
from policies.codec.digests import StorageKey, checksums, storage_key

DeviceView = tuple[int, dict[str, torch.Tensor]]
"""A published version and its view on the device it lives on."""


class HostSide(NamedTuple):
    """What a publisher of a view works from (:func:`host_side`)."""

    view: dict[str, torch.Tensor]
    """The view on the host."""
    device: dict[str, torch.Tensor] | None
    """Its tensors on their device (None: the view is on the host)."""
    scan_on: ScanOn | None
    """The delta to scan on the device (None: scan on the host)."""
    checksums: dict[str, str] | None
    """The host copy's checksums, when they came from the previous version's and the changes."""


def host_side(
    view: Mapping[str, torch.Tensor],
    latest: int | None,
    prev: DeviceView | None,
    prev_host: Mapping[str, torch.Tensor] | None,
    prev_checksums: Mapping[str, str] | None = None,
) -> HostSide:
    """What a publisher of ``view`` works from. With the previous version ``latest`` held on
    the device (``prev``) and on the host (``prev_host``, whose ``sum-128`` checksums are
    ``prev_checksums``), only the changes cross and the host copy's checksums are summed from
    them (module docstring); otherwise the view is copied whole."""
    if not _on_device(view):
        return HostSide(host_view(view), None, None, None)
    device = {k: v.detach() for k, v in view.items()}
    if prev is None or prev_host is None or prev[0] != latest or not _follows(prev[1], device):
        return HostSide(host_view(device), device, None, None)
    host, sums = device_scan.host_copy(prev_host, prev[1], device, prev_checksums)
    return HostSide(host, device, (prev[0], prev[1], device), sums)


def host_view(view: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``view`` on the host, contiguous, each storage copied once (tied names stay tied)."""
    made: dict[StorageKey, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in view.items():
        key = storage_key(t)
        if key not in made:
            made[key] = device_scan.to_host(t.detach()).contiguous()
        out[name] = made[key]
    return out


def _on_device(view: Mapping[str, torch.Tensor]) -> bool:
    """Whether any tensor of ``view`` lives off the host (a publisher then scans it there)."""
    return any(t.device.type != "cpu" for t in view.values())


def _follows(prev: Mapping[str, torch.Tensor], view: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``view`` can be scanned against ``prev``, the device view published before: no
    tensor of it is ``prev``'s own storage (a caller publishing its live parameters, which the
    optimizer changed in place, leaves nothing to compare them with)."""
    return not any(
        name in prev and prev[name].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        for name, t in view.items()
    )


def encode_patches(
    bases: Mapping[int, tuple[Mapping[str, torch.Tensor], str]],
    target: Mapping[str, torch.Tensor],
    opts: BoardOptions,
    *,
    scan_on: ScanOn | None = None,
    known: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], dict[int, tuple[bytes, PatchRef]]]:
    """``target``'s tensor checksums, and the patch from each base version (its view and
    digest) to ``target`` with the manifest's record of it, by base; ``scan_on`` has one base's
    patch scanned on a device. The checksums are ``known`` when given (a device view's host
    copy, :func:`host_side`), else summed by the first base's scan as it reads ``target``
    (:func:`policies.codec.encode_patch`), else (no base, or a scan on a device) hashed."""
    sums = (
        dict(known)
        if known is not None
        else checksums(target)
        if scan_on is not None or not bases
        else None
    )
    patches: dict[int, tuple[bytes, PatchRef]] = {}
    for b, (view, digest) in bases.items():
        scanned = target
        if scan_on is not None and scan_on[0] == b:
            view, scanned = scan_on[1], scan_on[2]
        data = encode_patch(
            view, scanned, level=opts.zstd_level, base_digest=digest, target_checksums=sums
        )
        hdr = read_patch_header(data)
        if sums is None:  # the first patch's, summed by its scan
            sums = {n: c for n, c in hdr.checksums.items() if n in target}
        ref = PatchRef(
            base=b, file=patch_file(b), bytes=len(data), changed=hdr.changed,
            units=hdr.units, base_digest=hdr.base_digest,
        )  # fmt: skip
        patches[b] = (data, ref)
    return sums or {}, patches
