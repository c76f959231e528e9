"""sprawl's own models for the tests, built once per machine and cached outside the clone.

``init_model`` is deterministic for a (size, seed) on given torch / transformers / tokenizers
versions, so its output is cached under ``${SPRAWL_MODEL_CACHE:-~/.cache/sprawl/models}`` keyed
by those and by the source of the generator; each session gets its own copy (tests may write
into a model directory), so the cache is never changed after it is built.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers
import torch
import transformers

from policies.model.build import ModelSize, init_model

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("policies/model/build.py", "policies/model/corpus.py", "policies/wire/toolcalls.py")


def _key(size: ModelSize, seed: int) -> str:
    h = hashlib.sha256(f"{size}|{seed}|{torch.__version__}|{transformers.__version__}".encode())
    h.update(tokenizers.__version__.encode())
    for source in SOURCES:
        h.update((REPO / source).read_bytes())
    return h.hexdigest()[:16]


def model_copy(size: ModelSize, into: Path, seed: int = 0) -> Path:
    """A copy of the cached model (built first if missing) at ``into``."""
    root = Path(os.environ.get("SPRAWL_MODEL_CACHE", Path.home() / ".cache" / "sprawl" / "models"))
    cached = root / f"{size}-{seed}-{_key(size, seed)}"
    if not (cached / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{size}-", dir=root))
        init_model(tmp / "model", size, seed=seed)
        with contextlib.suppress(OSError):  # another session built it first: theirs is the same
            (tmp / "model").rename(cached)  # whole or not at all
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cached, into)
    return into
