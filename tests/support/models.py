"""sprawl's own models for the tests, built once per machine and cached outside the clone.

``init_model`` is deterministic for a (size, seed, chat template) on given torch / transformers
/ tokenizers versions, so its output is cached under
``${SPRAWL_MODEL_CACHE:-~/.cache/sprawl/models}`` keyed by those (the template by its file's
bytes) and by the source of the generator; each session gets its own copy (tests may write into
a model directory), so the cache is never changed after it is built.
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

from orchestrator.warm_start import Phase, warm_model
from policies.model.build import init_model
from policies.model.sizes import ModelSize

REPO = Path(__file__).resolve().parents[2]
SOURCES = (
    "policies/model/build.py",
    "policies/model/chat_template.py",
    "policies/model/corpus.py",
    "policies/model/sizes.py",
    "policies/model/tokenizer.py",
    "policies/wire/toolcalls.py",
)


def _key(size: ModelSize, seed: int, chat_template: Path | None) -> str:
    h = hashlib.sha256(f"{size}|{seed}|{torch.__version__}|{transformers.__version__}".encode())
    h.update(tokenizers.__version__.encode())
    for source in SOURCES:
        h.update((REPO / source).read_bytes())
    if chat_template is not None:
        h.update(b"|template|" + chat_template.read_bytes())
    return h.hexdigest()[:16]


def model_copy(
    size: ModelSize, into: Path, seed: int = 0, chat_template: Path | None = None
) -> Path:
    """A copy of the cached model (built first if missing) at ``into``.

    ``chat_template``: a template file to build the tokenizer for, instead of sprawl's own.
    """
    root = Path(os.environ.get("SPRAWL_MODEL_CACHE", Path.home() / ".cache" / "sprawl" / "models"))
    name = size if chat_template is None else f"{size}-{chat_template.stem}"
    cached = root / f"{name}-{seed}-{_key(size, seed, chat_template)}"
    if not (cached / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        init_model(tmp / "model", size, seed=seed, chat_template=chat_template)
        with contextlib.suppress(OSError):  # another session built it first: theirs is the same
            (tmp / "model").rename(cached)  # whole or not at all
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cached, into)
    return into


WARM_SOURCES = (*SOURCES, "orchestrator/warm_start.py", "environments/calculator.py")


def warm_model_copy(into: Path, phases: list[Phase], seed: int = 0) -> Path:
    """A copy of the tiny model warm-started by ``phases`` (``orchestrator.warm_start.warm_model``,
    the model ``[model.warm_start]`` builds), cached like :func:`model_copy`: SFT on CPU is
    deterministic for a (model, phases, seed)."""
    root = Path(os.environ.get("SPRAWL_MODEL_CACHE", Path.home() / ".cache" / "sprawl" / "models"))
    h = hashlib.sha256(f"{_key('tiny', seed, None)}|{phases}".encode())
    for source in WARM_SOURCES:
        h.update((REPO / source).read_bytes())
    cached = warm_model(
        root / f"tiny-warm-{seed}-{h.hexdigest()[:16]}", size="tiny", seed=seed, phases=phases
    )
    shutil.copytree(cached, into)
    return into
