"""An engine's weights seen in checkpoint coordinates: engine patches applied in place, all or
nothing, in work proportional to the patch.

:class:`EngineWeights` holds what the engine side of an island needs
(:mod:`policies.serve.backends.vllm_transfer` builds it in each vLLM worker): the
:class:`~policies.serve.backends.param_map.ParamMap` of where checkpoint elements live in the
engine's parameters, and, for the few tensors the map could not place, a copy of each in
checkpoint form that the engine's own loader (``load_sparse``) is fed from.

:meth:`EngineWeights.apply` first works out every write without changing anything: each tensor's
positions located in the parameters, the old values read there, a ``delta`` tensor's changes
added to them once the old values' sum matched the sidecar's ``old_sum`` (where this engine holds
every position of the tensor: a tensor-parallel rank holding a slice cannot check the whole
sum), and only then writes them; :meth:`EngineWeights.plan` is that first half alone (it only
reads the weights, so it can run while the engine serves) and :meth:`EngineWeights.commit` the
second. A write that fails midway is undone from the old values before it raises; the last
update's old values are kept, so :meth:`EngineWeights.undo` can put the version before it back
when another worker of the same engine failed.

Under tensor parallelism each worker's map holds only its rank's slice of a sharded tensor (the
engine's loader narrows the checkpoint tensor; the map records what it copied), so a worker reads
the whole engine patch but writes only the positions it holds; :meth:`EngineWeights.footprint`
says, per tensor, how many elements this worker holds and how many of the last update's it wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from policies.serve.backends.engine_patch import EngineTensor, apply_deltas, unit_sum
from policies.serve.backends.param_map import ParamMap

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

    def _plan(self, t: EngineTensor) -> list[_Write]:
        runs = self.map.runs(t.name) if t.positions is None and t.name in self.map.boxes else None
        if runs is not None:  # a whole tensor into runs of its parameters: copies, no indices
            return [
                _Write(param, t.name, slice(at, at + end - first), old, t.values[first:end])
                for param, first, end, at in runs
                for old in [self.map.params[param][at : at + end - first].clone()]
            ]
        positions = t.positions if t.positions is not None else torch.arange(t.values.numel())
        places: list[tuple[str | None, slice | torch.Tensor, torch.Tensor]]
        if t.name in self.copies:
            places = [(None, slice(None), positions)]
        else:
            places = list(self.map.locate(t.name, positions))
        olds = [
            (self.copies[t.name] if p is None else self.map.params[p]).index_select(0, where)
            for p, _, where in places
        ]
        if t.coding == "delta":
            held = sum(where.numel() for _, _, where in places)
            if held == positions.numel() and t.old_sum is not None:
                got = sum(unit_sum(o) for o in olds) % (1 << 64)
                if got != t.old_sum:
                    raise ValueError(
                        f"{t.name}: the engine's values are not the ones the patch starts from "
                        f"(old values sum {got}, the patch's {t.old_sum})"
                    )
        writes = []
        for (param, held_here, where), old in zip(places, olds, strict=True):
            changes = t.values[held_here]
            new = apply_deltas(old, changes) if t.coding == "delta" else changes.to(old.dtype)
            writes.append(_Write(param, t.name, where, old, new))
        return writes

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

    def plan(self, version: int, tensors: list[EngineTensor]) -> Plan:
        """Work out the writes of ``tensors`` (an engine patch to ``version``), changing nothing:
        this only reads the weights, so it may run while the engine serves."""
        writes = [w for t in tensors for w in self._plan(t)]
        return Plan(version, self.generation, writes, {t.name: t.values.numel() for t in tensors})

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

    def apply(self, version: int, tensors: list[EngineTensor]) -> None:
        """Write ``tensors`` (an engine patch to ``version``) in place, all or nothing."""
        self.commit(self.plan(version, tensors))

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
