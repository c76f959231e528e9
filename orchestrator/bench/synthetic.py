"""Synthetic served views for the benchmarks: random bf16 tensors and steps that move them.

:func:`synthetic_view` is about a given size of bf16 values in tensors of at most 32 MiB;
:func:`adam_step` moves a fraction of the values by ±1 unit in the last place, as an Adam step
at RL learning rates does, and keeps them finite; :func:`same_bits` compares two views bitwise.
Deterministic for a given seed or generator.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

View = dict[str, torch.Tensor]


def synthetic_shapes(size_mb: int) -> dict[str, tuple[int, int]]:
    """The tensors of :func:`synthetic_view`: name → (rows, cols), at most 32 MiB of bf16 each."""
    left, out, i = size_mb * 2**20 // 2, {}, 0
    while left > 0:
        n = min(left, 16 * 2**20)
        cols = 4096 if n >= 4096 else n
        rows = n // cols
        out[f"layers.{i}.weight"] = (rows, cols)
        left -= rows * cols
        i += 1
    return out


def synthetic_view(size_mb: int, seed: int = 0) -> View:
    """About ``size_mb`` MiB of bf16 values, in tensors of at most 32 MiB."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
        for name, (rows, cols) in synthetic_shapes(size_mb).items()
    }


def adam_step(view: Mapping[str, torch.Tensor], density: float, gen: torch.Generator) -> View:
    """A copy of ``view`` with ``density`` of its values moved by ±1 unit in the last place.

    Flipping the lowest mantissa bit moves a value one ulp up or down (by its parity) and keeps
    finite values finite; an index drawn twice flips back, so slightly under ``density`` change.
    """
    out = {}
    for name, t in view.items():
        bits = t.detach().clone().contiguous().view(torch.int16).reshape(-1)
        n = max(1, int(bits.numel() * density))
        idx = torch.randint(0, bits.numel(), (n,), generator=gen)
        bits[idx] ^= 1  # the last mantissa bit: ±1 ulp, never leaves the finite range
        out[name] = bits.view(t.dtype).reshape(t.shape)
    return out


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k].contiguous().view(torch.int16), b[k].contiguous().view(torch.int16))
        for k in a
    )
