"""The reference trainer's checkpoint: one file, replaced atomically, read back bit for bit.

``trainer.pt`` (:data:`CHECKPOINT`) in the checkpoint dir holds the model state, the optimizer
state, the torch CPU RNG state, the version and the master dtype. :func:`write_checkpoint` writes
it to a temporary sibling, fsyncs it, renames it over the old one and fsyncs the directory, so a
crash loses at most the step in progress and never leaves a torn checkpoint;
:func:`restore_checkpoint` loads it into a model and optimizer of the same shape and restores the
RNG state, so a resumed CPU run is bit-identical to an uninterrupted one.

Guarantees: a file that does not unpickle, is of another format, holds other master dtypes than
``trainer.master_dtype`` or does not fit the model is refused with
:class:`~policies.errors.CheckpointError` naming the file. Not covered: CUDA RNG state, and
keeping more than the newest checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from policies.errors import CheckpointError

CHECKPOINT = "trainer.pt"
CHECKPOINT_FORMAT = 1


def write_checkpoint(
    path: Path,
    *,
    version: int,
    master_dtype: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Write model + optimizer + RNG + version to ``path`` atomically (module docstring)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "format": CHECKPOINT_FORMAT,
        "version": version,
        "master_dtype": master_dtype,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
    }
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def restore_checkpoint(
    path: Path,
    *,
    master_dtype: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> int:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` and restore the torch
    RNG state; return its version."""
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure means the file is not ours / damaged
        raise CheckpointError(f"{path}: unreadable checkpoint: {exc}") from exc
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r} unknown")
    if state["master_dtype"] != master_dtype:
        raise CheckpointError(
            f"{path}: checkpoint has {state['master_dtype']} masters but "
            f"trainer.master_dtype is {master_dtype}"
        )
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: checkpoint does not fit this model: {exc}") from exc
    torch.set_rng_state(state["rng"])
    return int(state["version"])
