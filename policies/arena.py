"""One huge-page-backed block of memory for a whole view: where a receiver keeps what it patches.

Applying a sparse patch is a scatter of read-modify-writes over the view; at 1% density it
touches about a quarter of the view's cache lines, spread over every page. On 4 KiB pages that
scatter takes a TLB miss on nearly every page and the hardware prefetchers stop at each page
boundary, so it runs about 1.5× slower than on 2 MiB pages (``orchestrate bench codec`` reports
both). :func:`pack` copies a view into one private anonymous mapping advised for transparent huge
pages (Linux ``MADV_HUGEPAGE``), starting on a 2 MiB boundary.

Guarantees: the packed tensors are bitwise copies, contiguous, each starting on a 64-byte cache
line; names that alias one tensor (same storage, offset, shape, stride and dtype: tied
embeddings) alias one packed tensor; the mapping lives as long as any tensor into it. Only
attempted: huge pages themselves, which the kernel grants when transparent huge pages are in
``madvise`` or ``always`` mode and it has free 2 MiB pages; otherwise the same code runs on
ordinary pages. Not covered: partial overlaps between tensors (each is packed on its own, as the
codec treats them) and tensors off the CPU (:func:`pack` refuses them).
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping

import torch

from policies.digests import StorageKey, storage_key

HUGE_PAGE = 2 << 20
LINE = 64


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


def allocate(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed uint8 memory on 2 MiB-aligned, huge-page-advised pages."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    # torch.frombuffer keeps a reference to the mapping; it is unmapped with the last tensor
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def pack(view: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``view`` in one huge-page-backed block (see the module docstring)."""
    offsets: dict[StorageKey, int] = {}
    total = 0
    for name, t in view.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name}: only CPU tensors can be packed, got {t.device}")
        key = storage_key(t)
        if key not in offsets:
            offsets[key] = total
            total = _aligned(total + t.numel() * t.element_size(), LINE)
    block = allocate(max(total, 1))
    out: dict[str, torch.Tensor] = {}
    made: dict[StorageKey, torch.Tensor] = {}
    for name, t in view.items():
        key = storage_key(t)
        if key not in made:
            at, nbytes = offsets[key], t.numel() * t.element_size()
            dst = block[at : at + nbytes].view(t.dtype).reshape(t.shape)
            made[key] = dst.copy_(t.detach())
        out[name] = made[key]
    return out
