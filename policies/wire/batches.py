"""The batch protocol: how an out-of-process trainer gets batches and announces versions.

The contract between the orchestrator and any trainer that is not the in-process reference
trainer (a user's torchrun job, TRL, verl, or ``orchestrate train``):

1. The orchestrator writes one file per trainer step, ``<batch dir>/batch-<v:08d>.json``, holding
   a :class:`BatchFile` for trainer version ``v``. Files appear atomically (written to a temporary
   name, fsynced, renamed), so a trainer never reads a partial batch. Samples are
   group-contiguous: ``group_size`` consecutive samples answer the same task (GRPO).
2. The trainer takes its optimizer step(s) on batch ``v`` and publishes version ``v + 1`` on the
   board (:meth:`policies.board.Board.publish`). Moving the board's pointer *is* the
   announcement: the orchestrator reads the pointer and sends batch ``v + 1`` once the trainer
   has caught up. Optionally it writes ``batch-<v:08d>.metrics.json`` (a flat JSON object of
   floats) before publishing; the orchestrator logs it with the step.
3. Version 0 is published by the trainer before the run starts (the orchestrator waits for it).

The same :class:`BatchFile` is what the batch feed (``trainer.mode = "feed"``,
:mod:`orchestrator.loop.feed`) serves over HTTP instead of a file; :mod:`policies.wire.feed` is
its client.

A sample's ``mask[t]`` is true where token ``t`` was sampled by the policy (the loss applies;
false everywhere in an episode the run's ``staleness.overlong = "mask"`` masked as truncated);
``behaviour_logprobs[t]`` is the engine's log prob of that token (0 elsewhere); ``reward`` is the
one advantages are computed from (the environment's, plus the soft overlong penalty when
``staleness.overlong = "soft_penalty"``: the orchestrator applies both, a trainer does nothing);
``policy_versions`` gives, per sampled segment, ``[start_token, end_token, version_start,
version_end]`` so a trainer can compute per-token lag itself. ``staleness`` is the run's
``[staleness]`` section (a :class:`staleness.config.StalenessConfig` as JSON), so a trainer can
apply the correction and loss aggregation the in-process trainer would
(:mod:`policies.train.external` does it for torch trainers); None in files of older sprawls.
``sampling`` gives, per sampled segment, ``[start_token, end_token, temperature, top_k, top_p]``:
the transforms the engine sampled those tokens with, which a trainer applies when it recomputes
their log probs (empty in files of older sprawls: the trainer then uses the run's ``[sampling]``).
``routed_experts`` (MoE engines that report routing; None otherwise) is the experts positions
``0 .. R-1`` of ``token_ids`` were routed to when the engine forwarded them, in vLLM's
``routed_experts`` form (:mod:`policies.wire.routing`, ``[R, layers, top_k]``); the positions
after ``R`` (the last sampled token and any environment reply after it) have none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Final, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, JsonValue

SCHEMA: Final = 1
"""The one batch file schema this sprawl writes and reads (a file of another is refused)."""


class SegmentSampling(NamedTuple):
    """How the tokens ``[start, end)`` of a sequence were sampled: logits / ``temperature`` (0:
    greedy), then the ``top_k`` most likely (0: all), then the smallest prefix of mass ``top_p``,
    renormalized (``policies.serve.sampling.sample_token``)."""

    start: int
    end: int
    temperature: float
    top_k: int
    top_p: float


class BatchSample(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    episode_id: str
    group_id: str
    token_ids: list[int]
    mask: list[bool]
    behaviour_logprobs: list[float]
    reward: float
    policy_versions: list[tuple[int, int, int, int]] = Field(default_factory=list)
    sampling: list[SegmentSampling] = Field(default_factory=list)
    routed_experts: str | None = None


class BatchFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: Literal[1] = SCHEMA
    version: int = Field(ge=0, description="trainer version this batch is for")
    group_size: int = Field(ge=1)
    samples: list[BatchSample]
    staleness: dict[str, JsonValue] | None = None


def batch_path(directory: Path, version: int) -> Path:
    return directory / f"batch-{version:08d}.json"


def metrics_path(directory: Path, version: int) -> Path:
    return directory / f"batch-{version:08d}.metrics.json"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see all of it or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_batch(directory: Path, batch: BatchFile) -> Path:
    path = batch_path(directory, batch.version)
    write_atomic(path, batch.model_dump_json().encode())
    return path


def read_batch(directory: Path, version: int) -> BatchFile | None:
    """Batch ``version`` if it has been written, else None."""
    try:
        return BatchFile.model_validate_json(batch_path(directory, version).read_bytes())
    except FileNotFoundError:
        return None


def read_metrics(directory: Path, version: int) -> dict[str, float]:
    try:
        raw = json.loads(metrics_path(directory, version).read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in raw.items() if isinstance(v, int | float)}
