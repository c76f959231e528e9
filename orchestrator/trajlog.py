"""The trajectory log: versioned JSON records in rotated, zstd-compressed, append-only parts.

Layout of a log directory (``<run_dir>/trajectories/``; schema: ``docs/trajectory-schema.md``)::

    run.json                    the run header (schema version, run name, config), atomic
    episodes-000000.jsonl.zst   one ``episode`` record per line, with its group's decision
    batches-000000.jsonl.zst    one ``batch`` record per trainer step

Each part file is a sequence of independent zstd frames (checksummed, content size in the header),
one per ``write`` call: a group's episodes, or one batch. Every complete part is therefore an
ordinary ``.jsonl.zst`` file (``zstd -dc``, ``datasets.load_dataset("json", …)``).

Guarantees:

- Append-only: a writer never rewrites a frame; it opens a new part when the current one reaches
  ``rotate_bytes`` and a new part every time it is opened, so a restart never appends after
  damage.
- Crash-safe: a frame is written with one ``write`` and flushed, so a SIGKILL leaves at most one
  torn frame, at the end of a part. Readers accept a frame only once the decoder reaches its end
  and its checksum matches, so a torn tail is detected (logged as ``trajlog.torn_tail``) and
  skipped, and every complete record before it is read. A damaged frame that is *not* a tail is
  corruption and raises :class:`~orchestrator.errors.TrajlogError`.
- :func:`repair` truncates torn tails, after which every part loads with plain ``datasets``.

Not covered: durability across power loss (frames are flushed to the kernel, not fsync'ed unless
``fsync=True``); concurrent writers to one directory.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import structlog
import zstandard
from pydantic import BaseModel, ConfigDict

from orchestrator.errors import TrajlogError
from orchestrator.events import NULL_EVENTS, EventSink
from orchestrator.types import Batch, Episode, Group, GroupDecision

if TYPE_CHECKING:
    from datasets import Dataset

log = structlog.get_logger(__name__)

SCHEMA_VERSION = 1
"""Bumped on any change a reader of an older version would misread (see the schema doc)."""

Stream = Literal["episodes", "batches", "events"]
PART_SUFFIX = ".jsonl.zst"
_CHUNK = 1 << 16


def part_name(stream: str, index: int) -> str:
    return f"{stream}-{index:06d}{PART_SUFFIX}"


def parts(directory: Path, stream: str) -> list[Path]:
    """The part files of ``stream`` in ``directory``, oldest first."""
    return sorted(directory.glob(f"{stream}-[0-9]*{PART_SUFFIX}"))


class FrameWriter:
    """Appends JSON records to ``<directory>/<stream>-NNNNNN.jsonl.zst``, one frame per call."""

    def __init__(
        self,
        directory: Path,
        stream: str,
        *,
        rotate_bytes: int = 64 << 20,
        level: int = 3,
        fsync: bool = False,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.stream = stream
        self.rotate_bytes = rotate_bytes
        self.fsync = fsync
        self._cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
        existing = parts(directory, stream)
        self._index = int(existing[-1].name[len(stream) + 1 :][:6]) + 1 if existing else 0
        self._f: IO[bytes] | None = None
        self._size = 0

    def _open(self) -> IO[bytes]:
        path = self.directory / part_name(self.stream, self._index)
        self._index += 1
        self._size = 0
        self._f = path.open("xb")
        return self._f

    def write(self, records: list[dict[str, Any]]) -> None:
        """Write ``records`` as one frame (all or none of them survive a crash)."""
        if not records:
            return
        if self._f is None or self._size >= self.rotate_bytes:
            self.close()
            self._open()
        f = self._f
        assert f is not None
        payload = b"".join(
            json.dumps(r, separators=(",", ":"), allow_nan=False).encode() + b"\n" for r in records
        )
        frame = self._cctx.compress(payload)
        f.write(frame)
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())
        self._size += len(frame)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def scan_frames(data: bytes) -> tuple[list[bytes], int]:
    """The decoded payload of every complete frame in ``data``, and the byte offset where the
    complete frames end (``len(data)`` unless the tail is torn).

    Raises :class:`TrajlogError` when a frame is corrupt (bad magic, bad checksum).
    """
    payloads: list[bytes] = []
    pos = 0
    dctx = zstandard.ZstdDecompressor()
    while pos < len(data):
        d = dctx.decompressobj()
        chunks: list[bytes] = []
        fed = pos
        try:
            while not d.eof and fed < len(data):
                chunk = data[fed : fed + _CHUNK]
                fed += len(chunk)
                chunks.append(d.decompress(chunk))
        except zstandard.ZstdError as exc:
            raise TrajlogError(f"corrupt frame at byte {pos}: {exc}") from exc
        if not d.eof:
            return payloads, pos
        pos = fed - len(d.unused_data)
        payloads.append(b"".join(chunks))
    return payloads, pos


def read_part(path: Path) -> Iterator[dict[str, Any]]:
    """Every record of one part (``.jsonl.zst`` or plain ``.jsonl``), skipping a torn tail."""
    data = path.read_bytes()
    if path.suffix == ".jsonl":
        lines = data.split(b"\n")
        torn = lines.pop()
        if torn:
            log.warning("trajlog.torn_tail", part=str(path), bytes=len(torn))
        for line in lines:
            yield json.loads(line)
        return
    payloads, end = scan_frames(data)
    if end < len(data):
        log.warning("trajlog.torn_tail", part=str(path), offset=end, bytes=len(data) - end)
    for payload in payloads:
        for line in payload.splitlines():
            yield json.loads(line)


def iter_records(path: Path, stream: Stream | None = None) -> Iterator[dict[str, Any]]:
    """Records of a log: ``path`` is a log directory (every stream, or only ``stream``) or one
    part file. Within a stream, records come in write order."""
    if path.is_file():
        yield from read_part(path)
        return
    if not path.is_dir():
        raise TrajlogError(f"{path}: no trajectory log here")
    for name in (stream,) if stream else ("episodes", "batches"):
        for part in parts(path, name):
            yield from read_part(part)


def read_log(path: Path) -> list[dict[str, Any]]:
    """Every complete episode and batch record of a log (directory or part file)."""
    return list(iter_records(path))


def repair(directory: Path) -> list[Path]:
    """Truncate every part's torn tail so each is a valid ``.jsonl.zst``; returns parts changed."""
    changed = []
    for part in sorted(directory.glob(f"*{PART_SUFFIX}")):
        data = part.read_bytes()
        _, end = scan_frames(data)
        if end < len(data):
            with part.open("r+b") as f:
                f.truncate(end)
            changed.append(part)
            log.warning("trajlog.repaired", part=str(part), dropped_bytes=len(data) - end)
    return changed


# -- records ------------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunRecord(_Model):
    schema_version: int = SCHEMA_VERSION
    type: Literal["run"] = "run"
    run: str
    started_at: float
    config: dict[str, Any] | None = None


class EpisodeRecord(_Model):
    schema_version: int = SCHEMA_VERSION
    type: Literal["episode"] = "episode"
    run: str
    trainer_version: int
    logged_at: float
    decision: GroupDecision
    loss_mask: list[int]
    episode: Episode


class BatchRecord(_Model):
    schema_version: int = SCHEMA_VERSION
    type: Literal["batch"] = "batch"
    run: str
    trained_at_version: int
    produced_version: int
    logged_at: float
    groups: list[str]
    metrics: dict[str, float]


def loss_mask(episode: Episode) -> list[int]:
    """1 at every position of ``episode.token_ids`` that a model call sampled, else 0."""
    mask = [0] * len(episode.token_ids)
    for seg in episode.segments:
        mask[seg.prompt_len : seg.prompt_len + len(seg.token_ids)] = [1] * len(seg.token_ids)
    return mask


def consumed_version(episodes: list[Episode], decision: GroupDecision) -> int:
    """The trainer version a group was decided at, recovered from its decision's ``max_lag``."""
    starts = [s.policy_version.start for e in episodes for s in e.segments]
    return decision.max_lag + min(starts) if starts else 0


class TrajectoryLog:
    """Writes a run's episodes (with decisions) and trainer steps into a log directory.

    ``events``: the run's scheduler event log (:mod:`orchestrator.events`); each group's
    staleness decision is also emitted there as a ``decide`` event, and ``close`` closes it.
    """

    events: EventSink = NULL_EVENTS

    def __init__(
        self,
        directory: Path,
        *,
        run: str = "run",
        config: dict[str, Any] | None = None,
        rotate_bytes: int = 64 << 20,
        fsync: bool = False,
        append: bool = False,
    ) -> None:
        """``append``: continue the log of a resumed run; an existing ``run.json`` (the run's
        original header) is kept, and new records go to new parts."""
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.run = run
        if not (append and (directory / "run.json").exists()):
            header = RunRecord(run=run, started_at=time.time(), config=config)
            tmp = directory / "run.json.tmp"
            tmp.write_text(header.model_dump_json(indent=2))
            tmp.replace(directory / "run.json")
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
            trainer_version=version,
            decision=decision.decision,
            max_lag=decision.max_lag,
            reason=decision.reason,
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
            trained_at_version=batch.version,
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


def run_header(directory: Path) -> RunRecord | None:
    path = directory / "run.json"
    return RunRecord.model_validate_json(path.read_text()) if path.exists() else None


def episode_records(path: Path) -> list[EpisodeRecord]:
    """Every complete episode record, validated against the schema."""
    return [EpisodeRecord.model_validate(r) for r in iter_records(path, "episodes")]


def batch_records(path: Path) -> list[BatchRecord]:
    """Every complete batch record, validated, in trainer-step order."""
    return [BatchRecord.model_validate(r) for r in iter_records(path, "batches")]


def to_dataset(path: Path, stream: Literal["episodes", "batches"] = "episodes") -> Dataset:
    """One stream of a log as a ``datasets.Dataset`` (torn tails skipped; rows as in the files).

    Complete parts also load directly:
    ``load_dataset("json", data_files="…/episodes-*.jsonl.zst")``.
    """
    from datasets import Dataset

    return Dataset.from_list(list(iter_records(path, stream)))
