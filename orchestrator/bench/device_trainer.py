"""``bench device`` part ``trainer``: the reference trainer's steps and publishes on the device.

For each model of ``models`` (:mod:`orchestrator.bench.device_models`, built under ``--work``):
a :class:`policies.train.trainer.Trainer` on the device (fp32 masters, AdamW at ``lr``, bf16
served view, no checkpoint) publishes version 0 (an anchor: ``anchor_s``, the whole view to the
host: the same-run baseline of a version's cost), then takes ``train_steps`` GRPO steps on one
batch of ``train_samples`` random sequences of ``train_tokens`` tokens (the last three quarters
sampled, their behaviour log probs the model's own before the first step, rewards 0/1 within
each group), each step publishing its version from the device. Per model:

- ``step_s``: the median step, its publish included, the first step left out when there are more
  (CUDA's first kernels); ``steps_per_s`` = 1 / ``step_s``; ``first_step_s``;
- ``publish_s``: the median publish of those steps (:meth:`Board.publish`, timed around it),
  ``publish_max_s``, and ``publish_vs_step`` = ``publish_s / step_s``;
- ``kinds``, ``patch_bytes`` (median delta), ``changed_fraction`` (mean, of the view's values)
  and ``to_host_bytes`` (median: what crossed to the host per publish; 0 on a CPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.bench.device_models import model_dir, parameters
from orchestrator.bench.device_scale import Device, Report, Scale
from policies.board import Board, Manifest
from policies.codec import scan as device_scan
from policies.train.config import TrainerConfig
from policies.train.samples import TrainSample
from policies.train.trainer import Trainer
from staleness.config import StalenessConfig


@dataclass(frozen=True)
class Published:
    """One publish as :class:`TimedBoard` saw it."""

    seconds: float
    to_host_bytes: int
    manifest: Manifest


class TimedBoard(Board):
    """A board that records how long each :meth:`publish` took and what crossed to the host."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(url, run)
        self.published: list[Published] = []

    def publish(
        self, version: int, view: Mapping[str, torch.Tensor], *, view_name: str
    ) -> Manifest:
        before = device_scan.host_bytes.total
        t0 = time.perf_counter()
        manifest = super().publish(version, view, view_name=view_name)
        seconds = time.perf_counter() - t0
        self.published.append(Published(seconds, device_scan.host_bytes.total - before, manifest))
        return manifest


def _sync(device: Device) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def _samples(trainer: Trainer, scale: Scale, vocab: int) -> list[TrainSample]:
    """The batch every step trains on, behaviour log probs the model's own."""
    gen = torch.Generator().manual_seed(0)
    n, length = scale.train_samples, scale.train_tokens
    prompt = max(1, length // 4)
    ids = torch.randint(0, vocab, (n, length), generator=gen).tolist()
    mask = [False] * prompt + [True] * (length - prompt)
    rewards = [float(i % 2) for i in range(n)]  # each group holds 0s and 1s: advantages ≠ 0
    draft = [TrainSample(t, mask, [0.0] * length, r) for t, r in zip(ids, rewards, strict=True)]
    logp, _ = trainer.logprobs(draft)
    behaviour = [[0.0, *row] for row in logp.float().cpu().tolist()]
    return [
        TrainSample(t, mask, [lp if m else 0.0 for lp, m in zip(b, mask, strict=True)], r)
        for t, b, r in zip(ids, behaviour, rewards, strict=True)
    ]


def _train(name: str, scale: Scale, device: Device, work: Path) -> dict[str, Any]:
    path = model_dir(work, name)
    board = TimedBoard(str(work / "boards" / f"trainer-{name}"), "bench")
    config = TrainerConfig(
        device=device, lr=scale.lr, checkpoint=False, max_steps=scale.train_steps
    )
    trainer = Trainer(
        path,
        board,
        config,
        staleness=StalenessConfig(),
        temperature=1.0,
        group_size=scale.group_size,
    )
    trainer.publish()  # version 0: an anchor
    samples = _samples(trainer, scale, int(trainer.model.config.vocab_size))
    steps: list[float] = []
    for _ in range(scale.train_steps):
        _sync(device)
        t0 = time.perf_counter()
        trainer.step(samples)
        _sync(device)
        steps.append(time.perf_counter() - t0)
    anchor, *versions = board.published
    timed = versions[1:] if len(versions) > 1 else versions
    step_s = statistics.median(steps[1:] if len(steps) > 1 else steps)
    publish_s = statistics.median(p.seconds for p in timed)
    deltas = [p.manifest for p in versions if p.manifest.kind == "delta"]
    units = [sum(r.units for r in m.patches if r.base == m.base) for m in deltas]
    changed = [sum(r.changed for r in m.patches if r.base == m.base) for m in deltas]
    return {
        "model": name,
        "parameters": parameters(path),
        "view_bytes": anchor.manifest.full_bytes,
        "steps": scale.train_steps,
        "anchor_s": anchor.seconds,
        "first_step_s": steps[0],
        "step_s": step_s,
        "steps_per_s": 1 / step_s,
        "publish_s": publish_s,
        "publish_max_s": max(p.seconds for p in versions),
        "publish_vs_step": publish_s / step_s,
        "kinds": [p.manifest.kind for p in versions],
        "patch_bytes": statistics.median(m.bytes for m in deltas) if deltas else None,
        "changed_fraction": statistics.mean(c / u for c, u in zip(changed, units, strict=True))
        if deltas
        else None,
        "to_host_bytes": statistics.median(p.to_host_bytes for p in timed),
    }


def run(scale: Scale, device: Device, work: Path, report: Report) -> None:
    """The trainer part: one entry of ``models`` per model, written to ``report`` as it comes."""
    rows: list[dict[str, Any]] = []
    report.update(lr=scale.lr, samples=scale.train_samples, tokens=scale.train_tokens, models=rows)
    for name in scale.models:
        rows.append(_train(name, scale, device, work))
        report.update(models=rows)
