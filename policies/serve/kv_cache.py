"""The decode batch's KV cache: per layer, ``[rows, kv_heads, L, head_dim]`` keys and values,
right-aligned, with a ``[rows, L]`` attention mask marking each row's real positions.

Pure functions over tensors (the decode batcher, :mod:`policies.serve.decode`, holds the cache):
:func:`merge` appends rows, left-padding whichever side is shorter; :func:`keep_rows` keeps some
rows and drops the leading columns that then hold only padding; :func:`pad_left` adds columns of
padding.

Guarantees: a row's real keys, values and mask entries are only moved, never changed, and stay
right-aligned; padding is zeros with mask 0, so attention gives it weight exactly zero.
"""

from __future__ import annotations

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, the keys and values of every row."""


def pad_left(kv: KV, mask: torch.Tensor, pad: int) -> tuple[KV, torch.Tensor]:
    """``kv`` and ``mask`` with ``pad`` columns of padding in front."""

    def grow(t: torch.Tensor) -> torch.Tensor:
        b, h, _, d = t.shape
        return torch.cat([t.new_zeros(b, h, pad, d), t], dim=2)

    return [(grow(k), grow(v)) for k, v in kv], torch.cat(
        [mask.new_zeros(mask.shape[0], pad), mask], dim=1
    )


def merge(
    kv: KV, mask: torch.Tensor, new_kv: KV, new_mask: torch.Tensor
) -> tuple[KV, torch.Tensor]:
    """The rows of ``kv`` / ``mask`` followed by those of ``new_kv`` / ``new_mask``, the shorter
    side left-padded to the longer one's length."""
    have, new = mask.shape[1], new_mask.shape[1]
    if new < have:
        new_kv, new_mask = pad_left(new_kv, new_mask, have - new)
    elif new > have:
        kv, mask = pad_left(kv, mask, new - have)
    merged = [
        (torch.cat([k0, k1]), torch.cat([v0, v1]))
        for (k0, v0), (k1, v1) in zip(kv, new_kv, strict=True)
    ]
    return merged, torch.cat([mask, new_mask])


def keep_rows(kv: KV, mask: torch.Tensor, rows: torch.Tensor) -> tuple[KV, torch.Tensor]:
    """The rows ``rows`` (indices, in order) of ``kv`` and ``mask``, less the leading columns
    that hold only padding in all of them."""
    mask = mask.index_select(0, rows)
    first = int(mask.any(0).to(torch.int8).argmax())
    kept = [
        (k.index_select(0, rows)[:, :, first:], v.index_select(0, rows)[:, :, first:])
        for k, v in kv
    ]
    return kept, mask[:, first:]
