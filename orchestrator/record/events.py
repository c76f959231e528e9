"""The scheduler event log: every orchestration decision, with the inputs that made it.

Written to ``<run_dir>/events/events-NNNNNN.jsonl.zst`` (same container as the trajectory log:
independent zstd frames, torn tail skipped; see :mod:`orchestrator.record.frames`). One JSON object
per event: ``seq`` (0, 1, 2, … in emission order), ``t`` (Unix time), ``kind`` and its fields:

- ``run`` — ``max_lag``, ``groups_per_batch``, ``staleness`` (the config the decisions depend on),
  ``environment_staleness`` (environment name → its own staleness config, for the
  ``[[environments]]`` entries that override the run's) and ``dynamic_sampling``
  (``[scheduler.dynamic_sampling]`` when it is on, else null);
- ``route`` — a routing decision of the pool: ``bounds`` (min/max), ``affinity``, ``exclude``,
  ``endpoints`` (every live endpoint's routing state at that instant: ``id``, ``weight``,
  ``healthy``, ``open`` (breaker), ``applied_version``, ``outstanding``, ``limit``,
  ``max_inflight``) and ``chosen`` (an id, or null: the call waits);
- ``endpoint`` — an endpoint's health or applied version changed (``id``, ``healthy``,
  ``applied_version``): the version transitions per endpoint;
- ``served`` — a call returned (``endpoint``, ``start``, ``end``, ``latency_s``, ``attempt``);
- ``version_unavailable`` — a 409 (``endpoint``, ``applied_version``); ``call_failed`` — a failed
  call (``endpoint``, ``error``, ``attempt``, ``failover``: whether it is retried elsewhere);
- ``trainer_version`` — the trainer clock moved (``version``);
- ``island_died`` — a local engine or island went down (``endpoint``, ``reason``, ``exit_code``:
  null when it did not exit by itself, ``restarts``: spent so far); it was out of rotation before
  this was written; ``island_restarted`` — a restart serves again under the same id
  (``endpoint``, ``restart``: 1, 2, …, ``url``, ``backoff_s``: the wait before it);
  ``island_gave_up`` — ``fleet.max_restarts`` spent, out of rotation for the rest of the run
  (``endpoint``, ``restarts``, ``reason``) (:mod:`orchestrator.fleet.supervisor`);
- ``admit`` — the scheduler admitted group ``index`` (``group_id``, e.g. ``"g000012"``,
  ``task_id``, ``environment``, ``admitted`` so far, ``budget``); written to disk before the
  group's first model call; a re-run of a dropped group's task also names ``requeued_from``
  (the dropped group); ``release`` — ``n`` dropped groups gave their admission slots back;
  ``requeue`` — a group the staleness policy dropped will have its task re-run (``group_id``,
  ``task_id``, ``depth``: re-runs along its chain, ≤ ``staleness.length_bias.max_requeues``);
- ``decide`` — the staleness decision of a group (``group_id``, ``environment``,
  ``trainer_version``, ``decision``, ``max_lag``, ``reason``, and the length of its longest episode:
  ``max_sampled_tokens``, ``max_turns``, what the length-bias guard buckets by); a group dynamic
  sampling dropped is ``dropped`` with the reason
  :data:`~orchestrator.loop.batcher.EQUAL_REWARDS`;
- ``unbatched`` — at the end of a run, kept groups still waiting for a full batch
  (``group_ids``, ``reason``);
- ``lost`` — on a restart (``run.resume``), admitted groups with no record: they were in flight
  when the orchestrator was killed (``group_ids``, ``reason``);
- ``resumed`` — a restart continued the run (``trainer_version``, ``next_index``, ``admitted``,
  ``dropped``, ``restored``: kept groups put back into the batcher, ``reconstructed``: the
  ``produced_version`` of a batch record rebuilt from the log, or null, ``lost``: a count).

Events in :data:`DURABLE` (``admit``, ``unbatched``, ``lost``, ``resumed``) flush the log at once,
so the exactly-once accounting (:mod:`orchestrator.record.accounting`) survives a SIGKILL.

:func:`orchestrator.offline.resimulate.resimulate` re-derives the decisions from this log. Not
covered: events buffered when the process was killed (at most ``flush_every − 1``, never a
durable one) are lost.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from orchestrator.record.frames import FrameWriter, iter_records
from orchestrator.types import Endpoint

if TYPE_CHECKING:
    from orchestrator.config import Config
    from policies.wire.lane import VersionBounds


DURABLE = frozenset({"admit", "unbatched", "lost", "resumed"})
"""Event kinds :class:`EventLog` writes to disk as soon as they are emitted."""

STOPPED_UNTRAINED = "run stopped before the group was trained"
STOPPED_UNFINISHED = "run stopped before the group finished"
STOP_REASONS = frozenset({STOPPED_UNTRAINED, STOPPED_UNFINISHED})
"""Drop reasons of groups the run's stop (not the staleness policy) decided: re-simulation
skips them."""


class EventLog:
    """Appends events to ``directory``, one zstd frame per ``flush_every`` events, on every
    :data:`DURABLE` event, and on close. ``first_seq`` continues the numbering of a resumed run
    (a restart appends new parts to the same directory)."""

    def __init__(self, directory: Path, *, flush_every: int = 64, first_seq: int = 0) -> None:
        self._writer = FrameWriter(directory, "events")
        self.flush_every = flush_every
        self._buffer: list[dict[str, Any]] = []
        self._seq = first_seq
        self._endpoints: dict[str, tuple[bool, int | None]] = {}

    @classmethod
    def for_run(cls, directory: Path, cfg: Config, *, first_seq: int = 0) -> EventLog:
        """An event log opened with the ``run`` event the decisions depend on."""
        log = cls(directory, first_seq=first_seq)
        log.emit(
            "run",
            run=cfg.run.name,
            max_lag=cfg.scheduler.max_lag,
            groups_per_batch=cfg.scheduler.groups_per_batch,
            staleness=cfg.staleness.model_dump(mode="json"),
            environment_staleness={
                name: s.model_dump(mode="json") for name, s in cfg.environment_staleness().items()
            },
            dynamic_sampling=None
            if (ds := cfg.scheduler.filters_groups) is None
            else ds.model_dump(mode="json"),
        )
        return log

    def emit(self, kind: str, **fields: Any) -> None:
        self._buffer.append({"seq": self._seq, "t": time.time(), "kind": kind, **fields})
        self._seq += 1
        if kind in DURABLE or len(self._buffer) >= self.flush_every:
            self.flush()

    def route(
        self,
        endpoints: Iterable[Endpoint],
        bounds: VersionBounds,
        affinity: str | None,
        exclude: Iterable[str],
        chosen: Endpoint | None,
    ) -> None:
        now = anyio.current_time()
        self.emit(
            "route",
            bounds={"min": bounds.min, "max": bounds.max},
            affinity=affinity,
            exclude=sorted(exclude),
            endpoints=[e.state(now) for e in endpoints],
            chosen=chosen.id if chosen is not None else None,
        )

    def endpoint(self, ep: Endpoint) -> None:
        """Record a health / applied-version transition (nothing when neither changed)."""
        state = (ep.healthy, ep.applied_version)
        if self._endpoints.get(ep.id) != state:
            self._endpoints[ep.id] = state
            self.emit("endpoint", id=ep.id, healthy=ep.healthy, applied_version=ep.applied_version)

    def flush(self) -> None:
        self._writer.write(self._buffer)
        self._buffer = []

    def close(self) -> None:
        self.flush()
        self._writer.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every complete event of ``path`` (an events directory or a run directory), in order."""
    if (path / "events").is_dir():
        path = path / "events"
    return list(iter_records(path, "events"))
