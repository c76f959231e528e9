"""The sizes of ``orchestrate bench device`` (:data:`SCALES`) and the JSON files its parts write.

Every size the device bench uses is a field of :class:`Scale`: ``h200`` is the run the issue sizes
for one H200 (a 16 GiB bf16 view, the ``medium`` model and a ~1 B-parameter Qwen2 shape), ``tiny``
runs the same code on a CPU in about a minute. ``--set FIELD=VALUE`` overrides one field.

:class:`Report` is one part's JSON file (``<out>/<part>.json``), written again, whole and
atomically, each time the part adds figures: a part that is killed midway leaves the figures it
had, under ``"status": "running"``; one that raised leaves ``"status": "error"`` and the error.
No torch here.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

Device = Literal["cpu", "cuda"]
"""Where the bench's tensors live."""


@dataclass(frozen=True)
class Scale:
    """The sizes of one device bench run."""

    name: str
    view_mb: int
    """The bf16 view of the codec and publish parts, in MiB (tensors of at most 32 MiB)."""
    densities: tuple[float, ...]
    """The codec part's fractions of values changed."""
    repeats: int
    """The codec part's timings are the best of this many."""
    publish_density: float
    """The fraction of values the published version 1 changes."""
    models: tuple[str, ...]
    """The trainer part's models (:data:`orchestrator.bench.device_models.MODELS`)."""
    train_steps: int
    """Optimizer steps per model, each publishing a version."""
    train_samples: int
    """Samples per step (groups of :attr:`group_size`)."""
    group_size: int
    train_tokens: int
    """Tokens per sample (the first quarter is the prompt)."""
    lr: float
    """AdamW step size: about what RL uses, so a version changes a few % of the served values."""
    engine_model: str
    """The engine part's model."""
    concurrency: int
    """Requests in flight together for the engine's tokens per second (1 is the baseline)."""
    max_tokens: int
    rounds: int
    """Throughput is the best of this many rounds."""
    pause_trials: int
    """Versions the engine activates (in ``pause`` mode, under load) for the pause figures."""
    pause_density: float


SCALES: dict[str, Scale] = {
    "h200": Scale(
        name="h200",
        view_mb=16 << 10,
        densities=(0.001, 0.01, 0.03),
        repeats=3,
        publish_density=0.01,
        models=("medium", "qwen2-1b"),
        train_steps=6,
        train_samples=8,
        group_size=4,
        train_tokens=512,
        lr=1e-6,
        engine_model="qwen2-1b",
        concurrency=8,
        max_tokens=128,
        rounds=2,
        pause_trials=30,
        pause_density=0.01,
    ),
    "tiny": Scale(
        name="tiny",
        view_mb=40,
        densities=(0.001, 0.01, 0.03),
        repeats=2,
        publish_density=0.01,
        models=("tiny", "tiny-wide"),
        train_steps=2,
        train_samples=4,
        group_size=2,
        train_tokens=32,
        lr=1e-6,
        engine_model="tiny-wide",
        concurrency=8,
        max_tokens=8,
        rounds=1,
        pause_trials=4,
        pause_density=0.01,
    ),
}


def with_overrides(scale: Scale, items: list[str]) -> Scale:
    """``scale`` with each ``FIELD=VALUE`` of ``items`` set (a tuple field takes ``a,b,c``);
    ``ValueError`` naming the item when the field is unknown or the value does not parse."""
    known = {f.name for f in fields(scale)} - {"name"}
    changes: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in known:
            raise ValueError(f"--set {item!r}: use FIELD=VALUE, FIELD one of {sorted(known)}")
        current = getattr(scale, key)
        try:
            if isinstance(current, tuple):
                kind = type(current[0]) if current else str
                changes[key] = tuple(kind(x) for x in text.split(",") if x)
            else:
                changes[key] = type(current)(text)
        except ValueError:
            raise ValueError(
                f"--set {item!r}: {text!r} is not a {type(current).__name__}"
            ) from None
    return replace(scale, **changes)


class Report:
    """One part's JSON file, rewritten whole (temp file + rename) at every :meth:`update`."""

    def __init__(self, out: Path, part: str, **head: Any) -> None:
        self.path = out / f"{part}.json"
        self.data: dict[str, Any] = {"part": part, "status": "running", **head}
        self._t0 = time.monotonic()
        self.update()

    @classmethod
    def resume(cls, out: Path, part: str) -> Report:
        """``<out>/<part>.json`` as an earlier process left it (a new file if none), to add to."""
        path = out / f"{part}.json"
        head = json.loads(path.read_text()) if path.is_file() else {}
        for key in ("part", "status", "elapsed_s", "error"):
            head.pop(key, None)
        return cls(out, part, **head)

    def update(self, **figures: Any) -> None:
        self.data.update(figures)
        self.data["elapsed_s"] = round(time.monotonic() - self._t0, 2)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)

    def finish(self, error: BaseException | None = None) -> None:
        if error is None:
            self.update(status="ok")
        else:
            self.update(status="error", error=f"{type(error).__name__}: {error}")


def scale_dict(scale: Scale) -> dict[str, Any]:
    """``scale`` as the JSON files record it."""
    return asdict(scale)
