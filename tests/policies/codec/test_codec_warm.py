"""``warm_up`` compiles every kernel a version needs: a publish and a reader's apply after it
compile nothing more (policies/codec/warm.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numba
import torch

from policies.board import Board
from policies.codec import (
    kernels,
    kernels_apply,
    kernels_encode,
    kernels_read,
    kernels_scan,
    kernels_sum,
)
from policies.codec.warm import warm_up


def _signatures() -> dict[str, int]:
    out = {}
    for module in (kernels, kernels_apply, kernels_encode, kernels_read, kernels_scan, kernels_sum):
        for name, obj in vars(module).items():
            if isinstance(obj, numba.core.registry.CPUDispatcher):
                out[f"{module.__name__}.{name}"] = len(obj.signatures)
    return out


def test_after_warm_up_a_version_compiles_nothing(tmp_path: Path) -> None:
    """(fails when a kernel a publish or an apply uses is left for the first version to compile)"""
    warm_up()
    ready = _signatures()
    gen = torch.Generator().manual_seed(0)
    view = {
        "embed": torch.randn(300, 256, generator=gen).to(torch.bfloat16),
        "norm": torch.randn(256, generator=gen),
        "scales": torch.randint(0, 255, (4096,), generator=gen, dtype=torch.uint8),
    }
    board = Board(str(tmp_path / "board"), "run")
    board.publish(0, view, view_name="bfloat16")
    reader = Board(str(tmp_path / "board"), "run")
    _, held = reader.load(0)
    for v in range(1, 4):
        view = {k: t.clone() for k, t in view.items()}
        for t in view.values():
            t.view(torch.uint8).view(-1)[:: 97 * v] ^= 1
        board.publish(v, view, view_name="bfloat16")
        reader.advance(held, v - 1, v)
    grown = {k: (ready.get(k, 0), n) for k, n in _signatures().items() if n > ready.get(k, 0)}
    assert grown == {}


def test_the_kernel_cache_is_keyed_by_every_kernel_source(tmp_path: Path) -> None:
    """(fails when the cache is keyed by numba's version alone: a kernel whose callee lives in a
    changed module would keep the old callee's machine code, numba checking its own file only)"""
    package = Path(kernels.__file__).parent
    for source in package.glob("kernels*.py"):
        shutil.copy(source, tmp_path / source.name)
    before = kernels.cache_dir(tmp_path)
    assert before == kernels.cache_dir(package)  # the sources alone decide, not where they are
    assert before.name.startswith(f"{numba.__version__}-")
    callee = tmp_path / "kernels_sum.py"
    callee.write_text(callee.read_text() + "\n# a change to a callee's module\n")
    assert kernels.cache_dir(tmp_path) != before
    if not os.environ.get("NUMBA_CACHE_DIR"):
        assert str(before) == numba.config.CACHE_DIR  # what numba uses in this process
