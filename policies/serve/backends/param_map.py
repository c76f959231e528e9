"""Where each checkpoint element lives in an engine's parameters, learnt from the engine's own
loader, so a sparse patch is written in work proportional to the patch.

An engine's ``load_weights`` maps checkpoint names onto its parameters: fused projections (q, k, v
into one ``qkv_proj``), tensor-parallel slices, tied heads. :func:`learn` runs it once per
checkpoint tensor with that tensor's real values (so whatever it writes, it writes what is already
there) and watches its final ``Tensor.copy_`` calls, as vLLM's own sparse loader does
(``load_checkpoint_weight_patches``): each copy whose source is a box of the checkpoint tensor and
whose destination lies in a parameter becomes a :class:`Box`. :meth:`ParamMap.locate` then turns
flat checkpoint positions into flat positions of parameters with a few integer operations per
position. A tensor whose loader writes anything else (a converted or transposed copy, a write that
is not a ``copy_``) is left unmapped; the caller falls back to the engine's own dense path for it.
:func:`learn` checks what it learnt: every mapped element read back from the parameters equals the
checkpoint's, or that tensor is unmapped too.

Not covered: parameters processed after loading into another layout (quantized kernels, some
GPU GEMM layouts) — the check then leaves them unmapped.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open


@dataclass(frozen=True)
class Box:
    """A box of a checkpoint tensor held by one parameter: checkpoint elements ``start`` +
    ``m`` (``0 ≤ m < shape``) are the parameter's flat elements ``offset + Σ m·strides``."""

    param: str
    start: tuple[int, ...]
    shape: tuple[int, ...]
    offset: int
    strides: tuple[int, ...]


@dataclass
class ParamMap:
    """Checkpoint name → the boxes that hold it (see the module docstring)."""

    params: dict[str, torch.Tensor]
    """Each parameter's storage as one flat tensor."""
    boxes: dict[str, list[Box]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    unmapped: set[str] = field(default_factory=set)

    def held(self, name: str) -> int:
        """How many elements of checkpoint tensor ``name`` these parameters hold: all of them on
        one worker, a tensor-parallel rank's slice of a sharded one."""
        return sum(_numel(box.shape) for box in self.boxes[name])

    def runs(self, name: str) -> list[tuple[str, int, int, int]] | None:
        """``(parameter, first, end, offset)`` per box when every box of ``name`` is a run of whole
        rows held contiguously: checkpoint elements ``first … end-1`` are the parameter's
        ``offset …``; else None."""
        shape = self.shapes[name]
        strides = _contiguous(shape)
        out = []
        for box in self.boxes[name]:
            if box.shape[1:] != shape[1:] or box.strides != _contiguous(box.shape):
                return None
            first = sum(s * st for s, st in zip(box.start, strides, strict=True))
            out.append((box.param, first, first + _numel(box.shape), box.offset))
        return out

    def locate(
        self, name: str, positions: torch.Tensor
    ) -> list[tuple[str, slice | torch.Tensor, torch.Tensor]]:
        """For each box of ``name``: the parameter, which of ``positions`` (sorted) it holds (a
        slice of them, or a boolean mask) and their flat indices in it. A box that is a run of
        whole rows held contiguously (unfused tensors; fused or row-sliced ones) costs two
        binary searches and one subtraction; any other box a few integer operations a
        position."""
        shape = self.shapes[name]
        strides = _contiguous(shape)
        out: list[tuple[str, slice | torch.Tensor, torch.Tensor]] = []
        coords: list[torch.Tensor] | None = None
        for box in self.boxes[name]:
            if box.shape[1:] == shape[1:] and box.strides == _contiguous(box.shape):
                first = sum(s * st for s, st in zip(box.start, strides, strict=True))
                bounds = torch.tensor([first, first + _numel(box.shape)], dtype=positions.dtype)
                lo, hi = (int(i) for i in torch.searchsorted(positions, bounds))
                out.append((box.param, slice(lo, hi), positions[lo:hi] + (box.offset - first)))
                continue
            if coords is None:
                coords = [(positions // st) % n for st, n in zip(strides, shape, strict=True)]
            inside = torch.ones_like(positions, dtype=torch.bool)
            flat = torch.full_like(positions, box.offset)
            for c, s, n, stride in zip(coords, box.start, box.shape, box.strides, strict=True):
                m = c - s
                inside &= (m >= 0) & (m < n)
                flat += m * stride
            out.append((box.param, inside, flat[inside]))
        return out


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _flat(p: torch.Tensor) -> torch.Tensor:
    return p.detach().reshape(-1)


def _box(
    dst: torch.Tensor,
    src: torch.Tensor,
    ckpt: torch.Tensor,
    owners: dict[int, str],
    params: dict[str, torch.Tensor],
) -> Box | None:
    """The box a ``dst.copy_(src)`` moves, if ``src`` is a box of ``ckpt`` and ``dst`` lies in a
    parameter, same dtype and shape; else None."""
    owner = owners.get(dst.untyped_storage().data_ptr())
    if owner is None or dst.dtype != ckpt.dtype or src.dtype != ckpt.dtype:
        return None
    if src.untyped_storage().data_ptr() != ckpt.untyped_storage().data_ptr():
        return None
    if src.shape != dst.shape or src.dim() != ckpt.dim() or src.stride() != ckpt.stride():
        return None
    item = ckpt.element_size()
    offset = (src.data_ptr() - ckpt.data_ptr()) // item
    start = []
    for stride in ckpt.stride():
        start.append(offset // stride if stride else 0)
        offset = offset % stride if stride else offset
    base = params[owner]
    return Box(
        owner,
        tuple(start),
        tuple(src.shape),
        (dst.data_ptr() - base.data_ptr()) // item,
        tuple(dst.stride()),
    )


def learn(
    load: Callable[[list[tuple[str, torch.Tensor]]], object],
    parameters: Iterable[tuple[str, torch.Tensor]],
    checkpoint: Iterable[tuple[str, torch.Tensor]],
) -> ParamMap:
    """Learn where ``load`` (the engine's ``load_weights``) puts each tensor of ``checkpoint``
    (the values the engine holds now), then check it (module docstring)."""
    params = {n: _flat(p) for n, p in parameters if p.is_contiguous()}
    owners = {p.untyped_storage().data_ptr(): n for n, p in params.items()}
    result = ParamMap(params)
    original = torch.Tensor.copy_
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        seen.append((dst, src))
        return original(dst, src, non_blocking)

    for name, ckpt in checkpoint:
        ckpt = ckpt.contiguous()
        seen.clear()
        torch.Tensor.copy_ = copy  # type: ignore[method-assign,assignment]
        try:
            load([(name, ckpt)])
        finally:
            torch.Tensor.copy_ = original  # type: ignore[method-assign]
        boxes = [
            _box(d, s, ckpt, owners, params)
            for d, s in seen
            if d.untyped_storage().data_ptr() in owners
        ]
        result.shapes[name] = tuple(ckpt.shape)
        if not boxes or any(b is None for b in boxes) or not _holds(result, name, boxes, ckpt):
            result.unmapped.add(name)
        else:
            result.boxes[name] = [b for b in boxes if b is not None]
    return result


def _holds(result: ParamMap, name: str, boxes: list[Box | None], ckpt: torch.Tensor) -> bool:
    """Whether the parameters hold ``ckpt`` where ``boxes`` say."""
    result.boxes[name] = [b for b in boxes if b is not None]
    try:
        everything = torch.arange(ckpt.numel())
        flat = ckpt.reshape(-1)
        for param, inside, where in result.locate(name, everything):
            p = result.params[param]
            got = p.index_select(0, where.to(p.device)).cpu()  # compared on the host
            if not torch.equal(got.view(torch.uint8), flat[inside].view(torch.uint8)):
                return False
        return True
    finally:
        del result.boxes[name]


def _files(directory: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors (not the checkpoint SGLang started from)")
    return files


def checkpoint_shapes(directory: str, dtype: torch.dtype) -> dict[str, tuple[str, list[int]]]:
    """The checkpoint an engine started from (its directory's safetensors files): name → (the
    dtype the engine serves it in, shape), from the files' headers alone."""
    served = str(dtype).removeprefix("torch.")
    found: dict[str, tuple[str, list[int]]] = {}
    for path in _files(directory):
        with open(path, "rb") as f:
            meta: dict[str, Any] = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        meta.pop("__metadata__", None)
        found.update({k: (served, v["shape"]) for k, v in meta.items()})
    return found


def checkpoint_tensors(
    directory: str, dtype: torch.dtype, names: set[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (those in ``names``, if given), one at a time, in ``dtype``
    (what an engine serves them in)."""
    for path in _files(directory):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                if names is None or name in names:
                    yield name, f.get_tensor(name).to(dtype)
