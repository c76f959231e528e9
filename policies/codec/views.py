"""Served views: the exact tensors an engine loads, built once from the trainer's state dict.

A view is a plain ``dict[str, Tensor]`` in the layout a serving engine expects; scales are
tensors like any other, so the patch codec ships them together with their values and the
receiver never re-quantizes. Kinds (:data:`ViewKind`), for a quantized ``<p>.weight`` of shape
``(out, in)``:

- ``bf16`` / ``fp16``: every floating tensor cast (round to nearest even).
- ``fp8_e4m3``: ``<p>.weight`` float8_e4m3fn, ``<p>.weight_scale`` fp32 scalar
  (``w ≈ q * scale``, scale = amax / 448).
- ``fp8_block``: DeepSeek-V3 layout: ``<p>.weight`` float8_e4m3fn and ``<p>.weight_scale_inv``
  fp32 of shape ``(ceil(out/128), ceil(in/128))``; despite the name it multiplies
  (``w ≈ q * scale_inv`` per 128×128 block), as vLLM and DeepSeek's ``weight_dequant`` read it.
- ``int4_group``: symmetric, group 128 along ``in``: ``<p>.weight_packed`` uint8 ``(out, in/2)``
  holding ``q + 8`` (q in [-8, 7]) two per byte, element ``2k`` in the low nibble;
  ``<p>.weight_scale`` bf16 ``(out, in/128)`` (scale = amax / 7); ``<p>.weight_shape`` int64.
- ``nvfp4``: ModelOpt layout: ``<p>.weight`` uint8 ``(out, in/2)`` of E2M1 codes (low nibble
  first), ``<p>.weight_scale`` float8_e4m3fn ``(out, in/16)`` block scales and
  ``<p>.weight_scale_2`` fp32 global scale (``w ≈ fp4(q) * scale * scale_2``).

Which tensors are quantized: 2-D floating ``*.weight`` tensors whose name matches none of
``ViewSpec.keep`` (norms, embeddings, lm_head, biases by default) and whose ``in`` is a multiple
of the group (int4: 128, nvfp4: 16); every other floating tensor is served bf16; non-floating
buffers pass through unchanged. Names that alias one tensor in the state dict (tied embeddings)
alias one tensor in the view; two names alias only when storage, offset, shape, stride and dtype
all agree (a square ``W`` and its transpose ``W.T`` share the rest but not the stride).

Scale churn: a fresh scale is a function of the tensor's (or block's) absolute maximum, so one
weight crossing the block maximum rewrites the scale and, through it, most codes of that block;
for nvfp4 a move of the global amax rescales every block scale of the tensor. Mitigations
(``ViewSpec.scale_policy``): ``pow2`` rounds every scale up to a power of two (it changes only
when the amax crosses a power of two; costs up to 1 bit of range), and
``fixed_between_anchors`` reuses the scales of the anchor view passed as ``anchor=`` (values
beyond the old range saturate until the next anchor, which recomputes them).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from policies.codec.digests import StorageKey, storage_key

ViewKind = Literal["bf16", "fp16", "fp8_e4m3", "fp8_block", "int4_group", "nvfp4"]
ScalePolicy = Literal["fresh", "pow2", "fixed_between_anchors"]

DEFAULT_KEEP = ("*norm*", "*embed*", "*lm_head*", "*wte*", "*wpe*", "*.bias")
FP8_MAX = 448.0
FP4_MAX = 6.0
INT4_MAX = 7.0
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_FP4_MIDPOINTS = (FP4_VALUES[1:] + FP4_VALUES[:-1]) / 2
_E4M3_TINY = 2.0**-9


@dataclass(frozen=True)
class ViewSpec:
    """Which view to serve and how to quantize it."""

    kind: ViewKind = "bf16"
    keep: tuple[str, ...] = DEFAULT_KEEP
    """Glob patterns (fnmatch on the full name) of tensors that stay bf16 in quantized views."""
    scale_policy: ScalePolicy = "fresh"
    block: int = 128
    """fp8_block: block edge."""
    group: int = 128
    """int4_group: group size along the input dimension."""

    @property
    def quantized(self) -> bool:
        return self.kind not in ("bf16", "fp16")


def _pow2_up(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def _scale(amax: torch.Tensor, qmax: float, policy: ScalePolicy) -> torch.Tensor:
    """Dequantization scale for ``amax`` (zero where amax is zero, so zeros stay exact)."""
    s = amax.float() / qmax
    if policy == "pow2":
        s = torch.where(s > 0, _pow2_up(s), s)
    return s


def _divide(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0)


def _quantizable(name: str, t: torch.Tensor, spec: ViewSpec) -> bool:
    if not (spec.quantized and t.is_floating_point() and t.dim() == 2):
        return False
    if not name.endswith("weight") or any(fnmatch.fnmatchcase(name, p) for p in spec.keep):
        return False
    inner = {"int4_group": spec.group, "nvfp4": 16}.get(spec.kind, 1)
    return t.shape[1] % inner == 0


def _fp8_tensor(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _divide(w, scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _blocks(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(out, in) → (out/rows, in/cols, rows, cols), zero-padded to whole blocks."""
    o, i = w.shape
    po, pi = -(-o // rows) * rows, -(-i // cols) * cols
    padded = torch.nn.functional.pad(w, (0, pi - i, 0, po - o))
    return padded.reshape(po // rows, rows, pi // cols, cols).permute(0, 2, 1, 3)


def _unblocks(b: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    nr, nc, rows, cols = b.shape
    return b.permute(0, 2, 1, 3).reshape(nr * rows, nc * cols)[: shape[0], : shape[1]]


def quantize_fp4(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (sign << 3 | magnitude index) nearest to ``x`` (saturating at ±6)."""
    idx = torch.bucketize(x.abs().float(), _FP4_MIDPOINTS)
    return (idx | (torch.signbit(x).to(torch.int64) << 3)).to(torch.uint8)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.reshape(codes.shape[0], -1, 2).to(torch.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _quantize(
    name: str, w: torch.Tensor, spec: ViewSpec, anchor: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    w = w.detach().float()
    fixed = spec.scale_policy == "fixed_between_anchors"

    def reuse(key: str, fresh: torch.Tensor) -> torch.Tensor:
        old = anchor.get(key) if fixed else None
        if old is not None and old.shape == fresh.shape and old.dtype == fresh.dtype:
            return old.clone()
        return fresh

    if spec.kind == "fp8_e4m3":
        scale = reuse(f"{name}_scale", _scale(w.abs().amax(), FP8_MAX, spec.scale_policy))
        return {name: _fp8_tensor(w, scale), f"{name}_scale": scale}
    if spec.kind == "fp8_block":
        blocks = _blocks(w, spec.block, spec.block)
        fresh = _scale(blocks.abs().amax(dim=(2, 3)), FP8_MAX, spec.scale_policy)
        scale = reuse(f"{name}_scale_inv", fresh)
        q = _fp8_tensor(blocks, scale[:, :, None, None])
        return {name: _unblocks(q, w.shape).contiguous(), f"{name}_scale_inv": scale}
    if spec.kind == "int4_group":
        stem = name.removesuffix("weight")
        groups = w.reshape(w.shape[0], -1, spec.group)
        fresh = _scale(groups.abs().amax(dim=-1), INT4_MAX, spec.scale_policy).to(torch.bfloat16)
        scale = reuse(f"{stem}weight_scale", fresh)
        q = _divide(groups, scale.float()[..., None]).round().clamp(-8, 7).to(torch.int64) + 8
        return {
            f"{stem}weight_packed": _pack_nibbles(q.reshape(w.shape)),
            f"{stem}weight_scale": scale,
            f"{stem}weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
        }
    # nvfp4
    g_fresh = _scale(w.abs().amax(), FP4_MAX * FP8_MAX, spec.scale_policy)
    g = reuse(f"{name}_scale_2", g_fresh)
    blocks = w.reshape(w.shape[0], -1, 16)
    bs = _divide(blocks.abs().amax(dim=-1) / FP4_MAX, g)
    if spec.scale_policy == "pow2":
        bs = torch.where(bs >= _E4M3_TINY, _pow2_up(bs), 0.0)
    bscale = reuse(f"{name}_scale", bs.clamp(max=FP8_MAX).to(torch.float8_e4m3fn))
    codes = quantize_fp4(_divide(blocks, bscale.float()[..., None] * g))
    return {
        name: _pack_nibbles(codes.reshape(w.shape)),
        f"{name}_scale": bscale,
        f"{name}_scale_2": g,
    }


def build_view(
    state: Mapping[str, torch.Tensor],
    spec: ViewSpec,
    *,
    anchor: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The served view of ``state`` (``anchor``: the last anchor view, for fixed scales)."""
    out: dict[str, torch.Tensor] = {}
    done: dict[StorageKey, str] = {}
    for name, t in state.items():
        key = storage_key(t)  # storage, offset, shape, stride, dtype: W and W.T are not aliases
        if key in done and not _quantizable(name, t, spec):
            out[name] = out[done[key]]
            continue
        done.setdefault(key, name)
        if _quantizable(name, t, spec):
            out.update(_quantize(name, t, spec, anchor or {}))
        elif t.is_floating_point():
            dtype = torch.float16 if spec.kind == "fp16" else torch.bfloat16
            out[name] = t.detach().to(dtype, memory_format=torch.contiguous_format, copy=True)
        else:
            out[name] = t.detach().clone()
    return out


QUANTIZED_KINDS: tuple[ViewKind, ...] = ("fp8_e4m3", "fp8_block", "int4_group", "nvfp4")
"""The view kinds whose weights an engine must dequantize (:attr:`ViewSpec.quantized`)."""
_SCALE_SUFFIXES = ("_scale_inv", "_scale_2", "_scale")


def quantized_kind(view_name: str) -> ViewKind | None:
    """The quantized kind a board manifest's ``view`` names, or None (a float cast)."""
    return next((k for k in QUANTIZED_KINDS if k == view_name), None)


_PACKED_AUX = ("weight_scale", "weight_shape")


def weight_sources(view: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """For each tensor :func:`dequantize` returns, by name, the view tensors it is computed
    from (codes first, then its scales): an engine recomputes a weight when any of them changed.

    A name is a scale (or ``weight_shape``) only when the tensor it belongs to is in the view,
    so a model's own ``*_scale`` parameter is served as itself."""
    aux: set[str] = set()
    for name in view:
        if name.endswith("weight_packed"):
            stem = name.removesuffix("weight_packed")
            aux.update(f"{stem}{a}" for a in _PACKED_AUX if f"{stem}{a}" in view)
        else:
            aux.update(f"{name}{s}" for s in _SCALE_SUFFIXES if f"{name}{s}" in view)
    out: dict[str, tuple[str, ...]] = {}
    for name in view:
        if name in aux:
            continue
        if name.endswith("weight_packed"):
            stem = name.removesuffix("weight_packed")
            out[f"{stem}weight"] = (
                name,
                *(f"{stem}{a}" for a in _PACKED_AUX if f"{stem}{a}" in aux),
            )
        else:
            out[name] = (name, *(f"{name}{s}" for s in _SCALE_SUFFIXES if f"{name}{s}" in aux))
    return out


def dequantize(
    view: Mapping[str, torch.Tensor], spec: ViewSpec, *, only: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """fp32 reconstruction of the served weights, keyed by the state dict's names (``only``:
    just those names, e.g. the weights whose :func:`weight_sources` changed); non-floating
    buffers are returned as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, sources in weight_sources(view).items():
        if only is not None and name not in only:
            continue
        t = view[sources[0]]
        scales = dict(zip((s.removeprefix(name) for s in sources[1:]), sources[1:], strict=True))
        if sources[0].endswith("weight_packed"):
            stem = name.removesuffix("weight")
            q = _unpack_nibbles(t).float() - 8
            scale = view[f"{stem}weight_scale"].float()
            groups = q.reshape(q.shape[0], -1, spec.group) * scale[..., None]
            out[name] = groups.reshape(q.shape)
        elif "_scale_inv" in scales:
            s = view[scales["_scale_inv"]].float()
            blocks = _blocks(t.float(), spec.block, spec.block) * s[:, :, None, None]
            out[name] = _unblocks(blocks, t.shape).contiguous()
        elif "_scale_2" in scales:
            codes = _unpack_nibbles(t).to(torch.int64)
            vals = FP4_VALUES[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
            scale = view[scales["_scale"]].float() * view[scales["_scale_2"]].float()
            out[name] = (vals.reshape(t.shape[0], -1, 16) * scale[..., None]).reshape(vals.shape)
        elif "_scale" in scales:
            out[name] = t.float() * view[scales["_scale"]].float()
        else:
            out[name] = t.float() if t.is_floating_point() else t
    return out
