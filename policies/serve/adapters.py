"""LoRA versions on the reference engine: several adapters resident at once, one per version.

A LoRA version's served view is its adapter (``policies.train.lora.adapter_view``): peft's
tensor names (``<layer>.lora_A.weight``, ``<layer>.lora_B.weight``) with the scaling folded into
``lora_B``, so the tensors alone define it: the rank is ``lora_A``'s first dimension and the
adapted layers are the names. :func:`adapter_config` reads that back as a ``peft.LoraConfig``.

:class:`ResidentAdapters` holds the adapters one engine serves beside its base weights, which
no adapter touches: each loaded version becomes a named peft adapter (``v<version>``) on one
``peft.PeftModel``, and a batch runs every row through its own adapter (peft's mixed-adapter
batches, ``adapter_names``). Guarantees:

- at most ``max_resident`` adapters are resident; loading one more evicts the least recently
  used (a request that picked it counts as a use) among those no in-flight row is using;
- :meth:`ResidentAdapters.pick` gives a request the newest resident version its bounds admit, or
  None (the engine answers that as out of bounds: the sidecar's 409);
- a view that is not an adapter of this model raises :class:`AdapterError` before anything
  changes.

Not covered: fetching an evicted version back on demand (a request whose bounds admit only
evicted versions gets the 409 and retries elsewhere); merging an adapter into the base weights.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, cast

import torch

from policies.board import Board
from policies.errors import AdapterError, BoardError
from policies.wire.lane import VersionBounds

# peft (~1.5 s to import) is imported where an adapter is made: serving without one never pays
if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
PEFT_PREFIX = "base_model.model."  # a PeftModel's name for the model it wraps


def adapter_name(version: int) -> str:
    """The peft adapter name of ``version``."""
    return f"v{version}"


def is_adapter_view(names: Iterable[str]) -> bool:
    """Whether a served view with these tensor names is a LoRA version's adapter."""
    names = list(names)
    return bool(names) and all(n.endswith((LORA_A, LORA_B)) for n in names)


def is_lora_version(board: Board, version: int) -> bool:
    """Whether ``version`` on ``board`` is a LoRA version (False when its manifest does not read:
    the sidecar reports why when it stages it)."""
    try:
        return is_adapter_view(board.manifest(version).tensors)
    except BoardError:
        return False


def adapter_config(view: Mapping[str, torch.Tensor]) -> LoraConfig:
    """The ``peft.LoraConfig`` of an adapter view (module docstring): every layer named has both
    matrices, of one rank; the scaling is already in ``lora_B``, so ``lora_alpha`` is the rank."""
    layers = {n.removesuffix(LORA_A) for n in view if n.endswith(LORA_A)}
    if not is_adapter_view(view) or layers != {
        n.removesuffix(LORA_B) for n in view if n.endswith(LORA_B)
    }:
        raise AdapterError(
            "a LoRA version holds a lora_A and a lora_B matrix per adapted layer and nothing "
            f"else; this one has {sorted(view)[:4]}"
        )
    ranks = {int(view[f"{layer}{LORA_A}"].shape[0]) for layer in layers}
    if len(ranks) != 1:
        raise AdapterError(f"a LoRA version's matrices have one rank; these have {sorted(ranks)}")
    rank = ranks.pop()
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted(layers))


class AdapterLRU:
    """Which versions are resident, least recently used first: the bookkeeping every engine
    kind that serves adapters shares (thread-safe)."""

    def __init__(self, max_resident: int) -> None:
        if max_resident < 1:
            raise AdapterError(f"max_resident is {max_resident}; at least one adapter is resident")
        self.max_resident = max_resident
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    def versions(self) -> list[int]:
        """The resident versions, oldest first."""
        with self._lock:
            return sorted(self._lru)

    def pick(self, bounds: VersionBounds) -> int | None:
        """The newest resident version ``bounds`` admit (now most recently used), or None."""
        with self._lock:
            fits = [v for v in self._lru if bounds.admits(v)]
            if not fits:
                return None
            version = max(fits)
            self._lru.move_to_end(version)
            return version

    def evictable(self, in_use: Collection[int]) -> bool:
        """Whether one more adapter fits without evicting one that ``in_use`` requests run on."""
        with self._lock:
            return len(self._lru) < self.max_resident or any(v not in in_use for v in self._lru)

    def add(self, version: int, in_use: Collection[int]) -> list[int]:
        """Record ``version`` as resident (most recently used); the versions to evict for it:
        the least recently used beyond the bound that no request in ``in_use`` runs on."""
        evicted: list[int] = []
        with self._lock:
            self._lru[version] = None
            self._lru.move_to_end(version)
            while len(self._lru) > self.max_resident:
                victim = next(v for v in self._lru if v not in in_use and v != version)
                del self._lru[victim]
                evicted.append(victim)
        return evicted


class ResidentAdapters:
    """The LoRA versions one reference engine holds (module docstring)."""

    def __init__(self, model: torch.nn.Module, *, max_resident: int) -> None:
        self.base = model
        self.lru = AdapterLRU(max_resident)
        self.model: PeftModel | None = None  # the base with every resident adapter injected
        self.versions = self.lru.versions
        self.pick = self.lru.pick
        self.evictable = self.lru.evictable

    def load(
        self,
        version: int,
        view: Mapping[str, torch.Tensor],
        config: LoraConfig,
        in_use: Collection[int],
    ) -> list[int]:
        """Make ``view`` resident as ``version`` (at a step boundary: no forward may run);
        return the versions evicted for it."""
        from peft import PeftModel, get_peft_model, set_peft_model_state_dict

        name = adapter_name(version)
        try:
            if self.model is None:
                with warnings.catch_warnings():
                    # peft 0.21 asks transformers 5 a deprecated question while wrapping
                    warnings.filterwarnings(
                        "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
                    )
                    self.model = cast(
                        PeftModel, get_peft_model(self.base, config, adapter_name=name)
                    )
                self.model.eval()
            else:
                self.model.add_adapter(name, config)
        except ValueError as exc:  # peft names the layers the model lacks
            raise AdapterError(
                f"version {version} is not an adapter of this model: {exc}"
            ) from None
        model = self.model
        assert model is not None
        state = {f"{PEFT_PREFIX}{k}": t for k, t in view.items()}
        try:
            loaded = set_peft_model_state_dict(model, state, adapter_name=name)
        except RuntimeError as exc:  # torch names the tensors whose shapes differ
            model.delete_adapter(name)
            first = str(exc).strip().splitlines()[-1].strip()
            raise AdapterError(
                f"version {version} does not fit this model's layers: {first}"
            ) from None
        missing, unexpected = cast(tuple[list[str], list[str]], loaded)  # torch's _IncompatibleKeys
        wrong = [k for k in unexpected if ".lora_" in k] + [k for k in missing if f".{name}." in k]
        if wrong:
            model.delete_adapter(name)
            raise AdapterError(f"version {version} does not fit this model's layers: {wrong[:3]}")
        evicted = self.lru.add(version, in_use)
        model.set_adapter(name)  # forwards name their adapters; this keeps peft off the victims
        for victim in evicted:
            model.delete_adapter(adapter_name(victim))
        return evicted

    def forward_args(self, versions: list[int]) -> dict[str, list[str]]:
        """The keyword that runs each row of a batch through its version's adapter."""
        return {"adapter_names": [adapter_name(v) for v in versions]}
