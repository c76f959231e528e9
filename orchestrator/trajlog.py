"""The trajectory log: one JSON line per record, appended and flushed as the run goes.

Record types (field ``type``):

- ``episode`` — one :class:`~orchestrator.types.Episode` (token ids, log probs, version stamps,
  tool calls, rewards, errors, stop reason) with its group's staleness decision;
- ``batch`` — a trainer step: the version it produced, the groups it consumed, its metrics.

Every admitted episode appears exactly once, kept or dropped. Each record is written with one
``write`` call and flushed, so a crash loses at most the record being written; a torn last line
is the only possible damage. Not covered yet: compression, rotation, a versioned schema doc.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from orchestrator.types import Batch, Group, GroupDecision


class TrajectoryLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f: IO[str] = path.open("a", encoding="utf-8")

    def _write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def write_group(self, group: Group, decision: GroupDecision) -> None:
        for episode in group.episodes:
            self._write(
                {
                    "type": "episode",
                    "decision": decision.model_dump(),
                    "episode": episode.model_dump(mode="json"),
                }
            )

    def write_batch(self, batch: Batch, produced_version: int, metrics: dict[str, float]) -> None:
        self._write(
            {
                "type": "batch",
                "trained_at_version": batch.version,
                "produced_version": produced_version,
                "groups": [g.id for g in batch.groups],
                "metrics": metrics,
            }
        )

    def close(self) -> None:
        self._f.close()


def read_log(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a log, skipping a torn last line."""
    records = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if line.endswith("\n"):
                    raise
    return records
