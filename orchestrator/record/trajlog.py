"""The trajectory log: versioned JSON records in rotated, zstd-compressed, append-only parts.

Layout of a log directory (``<run_dir>/trajectories/``; schema: ``docs/trajectory-schema.md``)::

    run.json                    the run header (schema version, run name, config), atomic
    episodes-000000.jsonl.zst   one ``episode`` record per line, with its group's decision
    batches-000000.jsonl.zst    one ``batch`` record per trainer step

Both streams are stored as :mod:`orchestrator.record.frames` (crash-safe, append-only zstd
frames, one per write: a group's episodes, or one batch; torn tails skipped, :func:`repair`
truncates them). Every complete part is an ordinary ``.jsonl.zst`` file
(``datasets.load_dataset("json", …)``, or :func:`to_dataset`).

Not covered: concurrent writers to one directory.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from orchestrator.errors import TrajlogError
from orchestrator.record.frames import FrameWriter, iter_records, read_regular, write_private
from orchestrator.types import NULL_EVENTS, Batch, Episode, EventSink, Group, GroupDecision

if TYPE_CHECKING:
    from datasets import Dataset

log = structlog.get_logger(__name__)

SCHEMA_VERSION = 2
"""The one schema this sprawl writes and reads (``docs/trajectory-schema.md``)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _this_schema(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(
                f"schema {v}; this sprawl reads schema {SCHEMA_VERSION} (read the log with the "
                "sprawl that wrote it)"
            )
        return v


class RunRecord(_Model):
    type: Literal["run"] = "run"
    run: str
    started_at: float
    config: dict[str, Any] | None = None


class EpisodeRecord(_Model):
    type: Literal["episode"] = "episode"
    run: str
    trainer_version: int
    logged_at: float
    decision: GroupDecision
    loss_mask: list[int]
    episode: Episode


class BatchRecord(_Model):
    type: Literal["batch"] = "batch"
    run: str
    trained_at_version: int
    produced_version: int
    logged_at: float
    groups: list[str]
    metrics: dict[str, float]


def loss_mask(episode: Episode) -> list[int]:
    """1 at every position of ``episode.token_ids`` that a model call sampled, else 0 (0
    everywhere when ``staleness.overlong = "mask"`` masked the episode: nothing is trained)."""
    mask = [0] * len(episode.token_ids)
    for seg in [] if episode.overlong_masked else episode.segments:
        mask[seg.prompt_len : seg.prompt_len + len(seg.token_ids)] = [1] * len(seg.token_ids)
    return mask


def consumed_version(episodes: list[Episode], decision: GroupDecision) -> int:
    """The trainer version a group was decided at, recovered from its decision's ``max_lag``."""
    starts = [s.policy_version.start for e in episodes for s in e.segments]
    return decision.max_lag + min(starts) if starts else 0


class TrajectoryLog:
    """Writes a run's episodes (with decisions) and trainer steps into a log directory.

    ``events``: the run's scheduler event log (:mod:`orchestrator.record.events`); each group's
    staleness decision is also emitted there as a ``decide`` event, and ``close`` closes it.
    """

    def __init__(
        self,
        directory: Path,
        *,
        run: str = "run",
        config: dict[str, Any] | None = None,
        rotate_bytes: int = 64 << 20,
        fsync: bool = False,
        append: bool = False,
        events: EventSink = NULL_EVENTS,
    ) -> None:
        """``append``: continue the log of a resumed run; an existing ``run.json`` (the run's
        original header) is kept, and new records go to new parts."""
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.events = events
        self.run = run
        if not (append and (directory / "run.json").exists()):
            header = RunRecord(run=run, started_at=time.time(), config=config)
            write_private(directory / "run.json", header.model_dump_json(indent=2))
        kw: dict[str, Any] = {"rotate_bytes": rotate_bytes, "fsync": fsync}
        self._episodes = FrameWriter(directory, "episodes", **kw)
        self._batches = FrameWriter(directory, "batches", **kw)

    def write_group(
        self, group: Group, decision: GroupDecision, *, trainer_version: int | None = None
    ) -> None:
        """All of a group's episodes as one frame, each with the group's staleness decision."""
        version = trainer_version
        if version is None:
            version = consumed_version(group.episodes, decision)
        now = time.time()
        self.events.emit(
            "decide",
            group_id=group.id,
            environment=group.episodes[0].environment if group.episodes else None,
            trainer_version=version,
            decision=decision.decision,
            max_lag=decision.max_lag,
            reason=decision.reason,
            history_rewritten=sum(e.history_rewritten for e in group.episodes),
            orchestrator_errors=sum(e.stop_reason == "orchestrator_error" for e in group.episodes),
            # the group's longest episode: the length-bias guard's unit (staleness.length_bias)
            max_sampled_tokens=max((e.n_sampled for e in group.episodes), default=0),
            max_turns=max((len(e.segments) for e in group.episodes), default=0),
        )
        self._episodes.write(
            [
                EpisodeRecord(
                    run=self.run,
                    trainer_version=version,
                    logged_at=now,
                    decision=decision,
                    loss_mask=loss_mask(e),
                    episode=e,
                ).model_dump(mode="json")
                for e in group.episodes
            ]
        )

    def write_batch(self, batch: Batch, produced_version: int, metrics: dict[str, float]) -> None:
        record = BatchRecord(
            run=self.run,
            trained_at_version=batch.trained_at_version,
            produced_version=produced_version,
            logged_at=time.time(),
            groups=[g.id for g in batch.groups],
            metrics={k: v for k, v in metrics.items() if v == v and abs(v) != float("inf")},
        )
        self._batches.write([record.model_dump(mode="json")])

    def close(self) -> None:
        self._episodes.close()
        self._batches.close()
        self.events.close()


def _not_ours(path: Path, exc: ValidationError) -> TrajlogError:
    """A record this sprawl's schema does not read, in one line naming the log and the field."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(map(str, first["loc"])) or "record"
    return TrajlogError(
        f"{path}: not a trajectory log this sprawl reads ({exc.error_count()} problems in "
        f"{exc.title} records, first {where}: {first['msg']})"
    )


def run_header(directory: Path) -> RunRecord | None:
    """The log's ``run.json``, validated (None when there is none)."""
    path = directory / "run.json"
    if not path.exists():
        return None
    try:
        return RunRecord.model_validate_json(read_regular(path))
    except ValidationError as exc:
        raise _not_ours(path, exc) from None


def episode_records(path: Path) -> list[EpisodeRecord]:
    """Every complete episode record, validated against the schema (:class:`TrajlogError` in
    one line for a record it does not read)."""
    try:
        return [EpisodeRecord.model_validate(r) for r in iter_records(path, "episodes")]
    except ValidationError as exc:
        raise _not_ours(path, exc) from None


def batch_records(path: Path) -> list[BatchRecord]:
    """Every complete batch record, validated, in trainer-step order (errors as
    :func:`episode_records`)."""
    try:
        return [BatchRecord.model_validate(r) for r in iter_records(path, "batches")]
    except ValidationError as exc:
        raise _not_ours(path, exc) from None


def to_dataset(path: Path, stream: Literal["episodes", "batches"] = "episodes") -> Dataset:
    """One stream of a log as a ``datasets.Dataset`` (torn tails skipped; rows as in the files).

    Complete parts also load directly:
    ``load_dataset("json", data_files="…/episodes-*.jsonl.zst")``.
    """
    from datasets import Dataset

    return Dataset.from_list(list(iter_records(path, stream)))
