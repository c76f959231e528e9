"""A tiny torch model laid out as SGLang lays out a Qwen2 worker, for the scripted SGLang server:
q/k/v fused into ``qkv_proj`` and gate/up into ``gate_up_proj``, and under tensor parallelism each
rank holding its slice (column-parallel projections and the embedding split by rows, ``o_proj``
and ``down_proj`` by columns, norms whole). ``load_weights`` maps checkpoint tensors onto it as
SGLang's stacked-parameter loaders do: the checkpoint tensor narrowed to the rank's slice, copied
into a row range of the fused parameter. sprawl's loader learns that mapping by watching it, so
the tests exercise fused parameters and tensor-parallel slices with the real loader.

Also the allow-list unpickler SGLang deserializes ``serialized_named_tensors`` with
(``utils/safe_pickle.py``: module prefixes only; anything else refused), written here from its
rule, not copied.
"""

from __future__ import annotations

import glob
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
SAFE_PREFIXES = (
    "builtins.",
    "collections.",
    "copyreg.",
    "functools.",
    "itertools.",
    "operator.",
    "types.",
    "weakref.",
    "torch.",
    "multiprocessing.resource_sharer.",
    "multiprocessing.reduction.",
    "pickletools.",
)


class AllowListUnpickler(pickle.Unpickler):
    """SGLang's rule for a weight payload: only globals from allow-listed module prefixes."""

    def find_class(self, module: str, name: str) -> Any:
        if any((module + ".").startswith(p) for p in SAFE_PREFIXES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe class loading ({module}.{name})")


def split_dim(name: str) -> int | None:
    """The dimension tensor ``name`` is split along under tensor parallelism (None: whole)."""
    if name.endswith(ROW_PARALLEL):
        return 1
    if name.endswith("norm.weight"):
        return None
    return 0  # column-parallel projections (weights and biases), the vocab-parallel embedding


def shard(name: str, tensor: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """Rank ``rank``'s slice of checkpoint tensor ``name`` (a view)."""
    dim = split_dim(name)
    if dim is None or ranks == 1:
        return tensor
    n = tensor.shape[dim] // ranks
    return tensor.narrow(dim, rank * n, n)


def checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt", device="cpu") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (no dict)
    return out


def _target(name: str) -> tuple[str, int]:
    """The parameter holding checkpoint tensor ``name`` and its place among the fused parts."""
    for part, (fused, index) in FUSED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), index
    return name, 0


class SGLangLikeModel(torch.nn.Module):
    """One worker (tensor-parallel rank ``rank`` of ``ranks``) of the model in ``startup``,
    loaded from it through :meth:`load_weights`, as SGLang starts."""

    def __init__(
        self, startup: Path, rank: int = 0, ranks: int = 1, converted: frozenset[str] = frozenset()
    ) -> None:
        super().__init__()
        self.rank, self.ranks = rank, ranks
        self.converted = converted
        """Tensors loaded through a converted copy (as a transposing loader would): no map."""
        tensors = checkpoint(startup)
        parts: dict[str, list[tuple[int, str, torch.Size]]] = {}
        for name, t in tensors.items():
            target, index = _target(name)
            parts.setdefault(target, []).append((index, name, shard(name, t, rank, ranks).shape))
        self.where: dict[str, tuple[str, int, int]] = {}  # name → (parameter, first row, rows)
        for target, members in parts.items():
            rows = 0
            for _, name, shape in sorted(members):
                self.where[name] = (target, rows, shape[0])
                rows += shape[0]
            shape = members[0][2]
            dtype = tensors[members[0][1]].dtype
            self._put(target, torch.nn.Parameter(torch.empty(rows, *shape[1:], dtype=dtype)))
        self.load_weights(tensors.items())

    def _put(self, dotted: str, param: torch.nn.Parameter) -> None:
        *path, leaf = dotted.split(".")
        module: torch.nn.Module = self
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(leaf, param.requires_grad_(False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As SGLang's loaders: the rank's slice, copied into its rows of the parameter."""
        params = dict(self.named_parameters())
        for name, loaded in weights:
            target, first, rows = self.where[name]
            piece = shard(name, loaded, self.rank, self.ranks)
            if name in self.converted:
                piece = piece.clone()
            params[target].data.narrow(0, first, rows).copy_(piece)

    def held(self) -> dict[str, torch.Tensor]:
        """What this worker holds of every checkpoint tensor (its slice), in checkpoint form."""
        params = dict(self.named_parameters())
        return {n: params[t].data.narrow(0, a, rows) for n, (t, a, rows) in self.where.items()}
