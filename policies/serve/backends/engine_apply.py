"""An engine's weights seen in checkpoint coordinates: engine patches applied in place, all or
nothing, in work proportional to the patch.

:class:`EngineWeights` holds what the engine side of an island needs
(:mod:`policies.serve.backends.vllm_transfer` builds it in each vLLM worker): the
:class:`~policies.serve.backends.param_map.ParamMap` of where checkpoint elements live in the
engine's parameters, and, for the few tensors the map could not place, a copy of each in
checkpoint form that the engine's own loader (``load_sparse``) is fed from.

:meth:`EngineWeights.plan` works out every write of an engine patch's frames without changing
anything (:mod:`policies.serve.backends.engine_changes`: the positions located in the parameters,
the values read there, the new ones computed and checked against each frame's target checksums);
it only reads the weights, so it can run while the engine serves (:class:`Updates` reads an engine
patch's parts ahead that way, as they land). :meth:`EngineWeights.commit` then writes them, all or
nothing: a write that fails midway is undone from the old values before
it raises. The last update's old values are kept, so :meth:`EngineWeights.undo` can put the
version before it back when another worker of the same engine failed.

Under tensor parallelism each worker's map holds only its rank's slice of a sharded tensor (the
engine's loader narrows the checkpoint tensor; the map records what it copied), so a worker reads
the whole engine patch but writes only the positions it holds; :meth:`EngineWeights.footprint`
says, per tensor, how many elements this worker holds and how many of the last update's it wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod

import numpy as np
import structlog
import torch

from policies.codec import encode_patch
from policies.codec.digests import checksums
from policies.codec.written import Frame
from policies.serve.backends.engine_changes import I64, Bools, Changes, UInt, changes
from policies.serve.backends.engine_patch import Expected, read
from policies.serve.backends.param_map import ParamMap

log = structlog.get_logger(__name__)

SparseLoad = Callable[[list[tuple[str, tuple[int, ...], torch.Tensor, torch.Tensor]]], None]
"""The engine's own loader for ``(name, shape, positions, values)`` in checkpoint coordinates."""


@dataclass(frozen=True)
class _Write:
    """Values for flat ``where`` of a parameter (``param``) or of an unmapped tensor's copy."""

    param: str | None
    name: str
    where: torch.Tensor | slice
    old: torch.Tensor
    new: torch.Tensor


@dataclass(frozen=True)
class Plan:
    """The writes an engine patch makes, worked out against the weights as they were at
    ``generation`` (:meth:`EngineWeights.plan`)."""

    version: int
    generation: int
    writes: list[_Write]
    offered: dict[str, int] = field(default_factory=dict)
    """Positions per tensor in the engine patch (this worker writes those it holds)."""


@dataclass(frozen=True)
class Footprint:
    """What one worker holds of each checkpoint tensor and what the last update wrote here
    (:meth:`EngineWeights.footprint`)."""

    held: dict[str, int]
    """Elements of each checkpoint tensor this worker holds (a rank's slice of a sharded one; an
    unmapped tensor: its whole copy)."""
    version: int | None
    """The last update applied here and not undone (None: none)."""
    offered: dict[str, int]
    """That update's positions per tensor, as the engine patch holds them."""
    written: dict[str, int]
    """Of them, how many this worker wrote."""


@dataclass
class EngineWeights:
    """See the module docstring."""

    map: ParamMap
    copies: dict[str, torch.Tensor]
    """Unmapped tensors in checkpoint form (flat), as the engine holds them."""
    load_sparse: SparseLoad
    last: Plan | None = field(default=None)
    """The last update's writes, with the old values an undo puts back."""
    generation: int = 0
    """Counts the writes made: a plan made at another generation is stale."""

    def whole(self, name: str) -> UInt | None:
        """``name``'s flat values in place, if this engine holds it whole as one run of a
        parameter or as a copy (:class:`~policies.serve.backends.engine_changes.Held`)."""
        if name in self.copies:
            return _units(self.copies[name])
        runs = self.map.runs(name) if name in self.map.boxes else None
        numel = prod(self.map.shapes.get(name, ()))
        if runs is None or len(runs) != 1 or runs[0][1:3] != (0, numel):
            return None
        param, _, _, at = runs[0]
        p = self.map.params[param]
        return _units(p[at : at + numel]) if p.device.type == "cpu" else None

    def gather(self, name: str, positions: I64) -> tuple[Bools, UInt]:
        """``name``'s values at ``positions`` as this engine holds them, and which it holds."""
        where = torch.from_numpy(positions)
        if name in self.copies:
            return np.ones(positions.size, dtype=bool), _units(self.copies[name][where])
        if name not in self.map.boxes:
            raise ValueError(f"{name}: the engine holds no such tensor")
        held = np.zeros(positions.size, dtype=bool)
        vals: UInt | None = None
        for param, sel, flat in self.map.locate(name, where):
            p = self.map.params[param]
            got = _units(p.index_select(0, flat.to(p.device)).cpu())
            if vals is None:
                vals = np.zeros(positions.size, dtype=got.dtype)
            mask = sel if isinstance(sel, slice) else sel.numpy()
            vals[mask], held[mask] = got, True
        return held, vals if vals is not None else np.zeros(positions.size, dtype=np.uint16)

    def _writes(self, name: str, positions: I64, new: UInt, old: UInt | None) -> list[_Write]:
        """Writes of ``new`` at ``positions`` of ``name`` (``old``: the values there, if read)."""
        where = torch.from_numpy(positions)
        if name in self.copies:
            copy = self.copies[name]
            was = copy[where] if old is None else _tensor(old, copy.dtype)
            return [_Write(None, name, where, was, _tensor(new, copy.dtype))]
        out = []
        for param, sel, flat in self.map.locate(name, where):
            p = self.map.params[param]
            mask = sel if isinstance(sel, slice) else sel.numpy()
            at = flat.to(p.device)
            was = p.index_select(0, at) if old is None else _tensor(old[mask], p.dtype, p.device)
            out.append(_Write(param, name, at, was, _tensor(new[mask], p.dtype, p.device)))
        return out

    def _whole(self, name: str, values: UInt) -> list[_Write]:
        runs = self.map.runs(name) if name in self.map.boxes else None
        if runs is None:  # a slice of it, or not held as runs: by positions
            return self._writes(name, np.arange(values.size, dtype=np.int64), values, None)
        return [  # runs of its parameters: copies, no indices
            _Write(param, name, slice(at, at + end - first), p[at : at + end - first].clone(),
                   _tensor(values[first:end], p.dtype, p.device))
            for param, first, end, at in runs
            for p in [self.map.params[param]]
        ]  # fmt: skip

    def _write(self, writes: list[_Write], values: Callable[[_Write], torch.Tensor]) -> None:
        unmapped = []
        for w in writes:
            if w.param is None:
                assert isinstance(w.where, torch.Tensor)  # unmapped tensors go by positions
                self.copies[w.name].index_copy_(0, w.where, values(w))
                unmapped.append((w.name, self.map.shapes[w.name], w.where, values(w)))
            elif isinstance(w.where, slice):
                self.map.params[w.param][w.where].copy_(values(w))
            else:
                self.map.params[w.param].index_copy_(0, w.where, values(w))
        if unmapped:
            self.load_sparse(unmapped)

    def plan(self, version: int, frames: list[Frame], replaced: set[str]) -> Plan:
        """Work out the writes of ``frames`` (an engine patch to ``version``, the last frame
        writing ``replaced`` whole), changing nothing: this only reads the weights, so it may run
        while the engine serves."""
        return self.plan_changes(version, changes(frames, replaced, self))

    def writes_of(self, found: Changes, name: str) -> list[_Write]:
        """``name``'s writes in ``found`` (:func:`~policies.serve.backends.engine_changes.changes`,
        read against these weights as they are now)."""
        if name in found.whole:
            return self._whole(name, found.whole[name])
        return self._writes(name, *found.at[name]) if name in found.at else []

    def plan_changes(
        self, version: int, found: Changes, known: dict[str, list[_Write]] | None = None
    ) -> Plan:
        """The writes of ``found``, those of ``known`` tensors worked out already."""
        known = known or {}
        writes = [
            w for n in [*found.at, *found.whole] for w in known.get(n) or self.writes_of(found, n)
        ]
        offered = {**found.offered, **{n: v.size for n, v in found.whole.items()}}
        return Plan(version, self.generation, writes, offered)

    def commit(self, plan: Plan) -> None:
        """Make ``plan``'s writes, all or nothing; a plan made before other writes is refused."""
        if plan.generation != self.generation:
            raise ValueError(f"the plan for version {plan.version} predates other writes")
        self.generation += 1
        try:
            self._write(plan.writes, lambda w: w.new)
        except BaseException:
            self._write(plan.writes[::-1], lambda w: w.old)
            raise
        self.last = plan

    def apply(self, version: int, frames: list[Frame], replaced: set[str]) -> None:
        """Write ``frames`` (an engine patch to ``version``) in place, all or nothing."""
        self.commit(self.plan(version, frames, replaced))

    def undo(self, version: int) -> bool:
        """Put back what the update to ``version`` overwrote, if it was the last one here."""
        if self.last is None or self.last.version != version:
            return False
        self.generation += 1
        self._write(self.last.writes[::-1], lambda w: w.old)
        self.last = None
        return True

    def footprint(self) -> Footprint:
        """What this worker holds of each tensor, and what the last update wrote here."""
        held = {n: self.map.held(n) for n in self.map.boxes}
        held.update({n: c.numel() for n, c in self.copies.items()})
        if self.last is None:
            return Footprint(held, None, {}, {})
        written: dict[str, int] = {}
        for w in self.last.writes:
            written[w.name] = written.get(w.name, 0) + w.new.numel()
        return Footprint(held, self.last.version, dict(self.last.offered), written)


def _units(t: torch.Tensor) -> UInt:
    """``t``'s values as unsigned integers of their width."""
    return t.contiguous().view(torch.uint8).numpy().view(f"<u{t.element_size()}")


def _tensor(units: UInt, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """Unsigned integers back to values of ``dtype`` (on ``device``: the host's by default)."""
    if not units.size:  # a box holding none of the positions (torch gives it no stride to view)
        return torch.empty(0, dtype=dtype, device=device)
    host = torch.from_numpy(np.ascontiguousarray(units).view(np.uint8).copy()).view(dtype)
    return host if device is None or device.type == "cpu" else host.to(device)


@dataclass
class _Draft:
    """The changes of the parts read so far, against the weights at ``generation``."""

    generation: int
    parts: list[tuple[str, str]] = field(default_factory=list)
    found: Changes = field(default_factory=Changes)
    writes: dict[str, list[_Write]] = field(default_factory=dict)
    version: int = -1
    failed: bool = False


class Updates:
    """One worker's side of an island's updates: the parts of an engine patch (one per landed
    chunk or so, since the version the engine serves) read and checked on a thread of its own
    while the engine serves (:meth:`prepare`), then written all or nothing (:meth:`write`), which
    reads whatever was not read ahead (or everything, when what was read is not what is
    written: another list of parts, a part that failed, weights written since)."""

    def __init__(self, weights: EngineWeights, expected: Expected) -> None:
        self.weights, self.expected = weights, expected
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="sprawl-prepare")
        self.draft: _Draft | None = None

    def prepare(self, part: int, path: str, digest: str) -> None:
        """Read part ``part`` (0: the first since the version served) ahead; returns at once."""
        self.reader.submit(self._extend, part, path, digest)

    def _extend(self, part: int, path: str, digest: str) -> None:
        draft = self.draft
        if part == 0 or draft is None or draft.generation != self.weights.generation:
            draft = self.draft = _Draft(self.weights.generation)
        if draft.failed or len(draft.parts) != part:
            draft.failed = True
            return
        try:
            self._read(draft, path, digest)
        except Exception as exc:  # the write reads it again and raises what is wrong
            draft.failed = True
            log.warning("engine.prepare_failed", path=path, error=str(exc)[:300])

    def _read(self, draft: _Draft, path: str, digest: str) -> None:
        version, frames, replaced = read(path, digest, self.expected)
        found = changes(frames, replaced, self.weights, draft.found)
        for name in found.fresh:  # worked out now, so the write holds only the writes
            draft.writes[name] = self.weights.writes_of(found, name)
        found.fresh.clear()
        draft.parts.append((path, digest))
        draft.version = version

    def write(self, parts: list[tuple[str, str]]) -> None:
        """Write the engine patch made of ``parts`` (in order), all or nothing."""
        self.reader.submit(lambda: None).result()  # every part sent before is read
        draft, self.draft = self.draft, None
        if (
            draft is None
            or draft.failed
            or draft.parts != parts
            or draft.generation != self.weights.generation
        ):
            draft = _Draft(self.weights.generation)
            for path, digest in parts:
                self._read(draft, path, digest)
        self.weights.commit(self.weights.plan_changes(draft.version, draft.found, draft.writes))

    def undo(self, version: int) -> bool:
        """:meth:`EngineWeights.undo`; a part read ahead is read again afterwards."""
        self.reader.submit(lambda: None).result()
        self.draft = None
        return self.weights.undo(version)

    def close(self) -> None:
        self.reader.shutdown(wait=False, cancel_futures=True)


def warm_up() -> None:
    """Compile the codec kernels an update uses (numba compiles at first call), so the first
    version does not pay for it."""
    base = torch.zeros(64, dtype=torch.bfloat16)
    target = base.clone()
    target[::7] = 1.0
    frame = Frame(encode_patch({"w": base}, {"w": target}), checksums({"w": base}))
    changes([frame], set(), _Units({"w": _units(base)}))


class _Units:
    """Tensors held whole, in place (what :func:`warm_up` reads)."""

    def __init__(self, tensors: dict[str, UInt]) -> None:
        self.tensors = tensors

    def whole(self, name: str) -> UInt:
        return self.tensors[name]

    def gather(self, name: str, positions: I64) -> tuple[Bools, UInt]:
        return np.ones(positions.size, dtype=bool), self.tensors[name][positions]
