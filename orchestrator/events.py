"""The scheduler event log: every orchestration decision, with the inputs that made it.

Written to ``<run_dir>/events/events-NNNNNN.jsonl.zst`` (same container as the trajectory log:
independent zstd frames, torn tail skipped; see :mod:`orchestrator.trajlog`). One JSON object per
event: ``seq`` (0, 1, 2, … in emission order), ``t`` (Unix time), ``kind`` and its fields:

- ``run`` — ``max_lag``, ``groups_per_batch``, ``staleness`` (the config the decisions depend on);
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
- ``admit`` — the scheduler admitted group ``index`` (``group_id``, e.g. ``"g000012"``,
  ``task_id``, ``admitted`` so far, ``budget``); written to disk before the group's first model
  call; ``release`` — ``n`` dropped groups gave their admission slots back;
- ``decide`` — the staleness decision of a group (``group_id``, ``trainer_version``,
  ``decision``, ``max_lag``, ``reason``);
- ``unbatched`` — at the end of a run, kept groups still waiting for a full batch
  (``group_ids``, ``reason``);
- ``lost`` — on a restart (``run.resume``), admitted groups with no record: they were in flight
  when the orchestrator was killed (``group_ids``, ``reason``);
- ``resumed`` — a restart continued the run (``trainer_version``, ``next_index``, ``admitted``,
  ``dropped``, ``restored``: kept groups put back into the batcher, ``reconstructed``: the
  ``produced_version`` of a batch record rebuilt from the log, or null, ``lost``: a count).

Events in :data:`DURABLE` (``admit``, ``unbatched``, ``lost``, ``resumed``) flush the log at once,
so the exactly-once accounting (:mod:`orchestrator.accounting`) survives a SIGKILL.

:func:`resimulate` re-derives the decisions from the log with the orchestrator's own code: each
``route`` through :meth:`orchestrator.pool.Pool._pick` on the logged endpoint states, each
``admit`` through :meth:`orchestrator.scheduler.Scheduler.budget` on the state rebuilt from the
``trainer_version``, ``release`` and ``resumed`` events before it, and — given the trajectory
log — each ``decide`` through :meth:`orchestrator.batcher.Batcher.decide` (but the drops of a
stopping run, :data:`STOP_REASONS`). A complete, faithful log gives zero mismatches. Not
covered: the *timing* of events (which call reached the pool first) is taken from the log, not
re-simulated; events buffered when the process was killed (at most ``flush_every − 1``, never a
durable one) are lost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio

if TYPE_CHECKING:
    from orchestrator.config import Config
    from orchestrator.pool import Endpoint
    from policies.lane import VersionBounds
    from staleness.config import StalenessConfig


class EventSink(Protocol):
    """What the pool, the scheduler and the run call; :data:`NULL_EVENTS` does nothing."""

    def emit(self, kind: str, **fields: Any) -> None: ...

    def route(
        self,
        endpoints: Iterable[Endpoint],
        bounds: VersionBounds,
        affinity: str | None,
        exclude: Iterable[str],
        chosen: Endpoint | None,
    ) -> None: ...

    def endpoint(self, ep: Endpoint) -> None: ...

    def close(self) -> None: ...


class NullEvents:
    """An event sink that ignores everything; subclass it to handle only some events."""

    def emit(self, kind: str, **fields: Any) -> None:
        pass

    def route(
        self,
        endpoints: Iterable[Endpoint],
        bounds: VersionBounds,
        affinity: str | None,
        exclude: Iterable[str],
        chosen: Endpoint | None,
    ) -> None:
        pass

    def endpoint(self, ep: Endpoint) -> None:
        pass

    def close(self) -> None:
        pass


NULL_EVENTS: EventSink = NullEvents()


DURABLE = frozenset({"admit", "unbatched", "lost", "resumed"})
"""Event kinds :class:`EventLog` writes to disk as soon as they are emitted."""

STOPPED_UNTRAINED = "run stopped before the group was trained"
STOPPED_UNFINISHED = "run stopped before the group finished"
STOP_REASONS = frozenset({STOPPED_UNTRAINED, STOPPED_UNFINISHED})
"""Drop reasons of groups the run's stop (not the staleness policy) decided: re-simulation
skips them."""


def endpoint_state(ep: Endpoint, now: float) -> dict[str, Any]:
    """The routing-relevant state of one endpoint."""
    return {
        "id": ep.id,
        "weight": ep.ref.weight,
        "healthy": ep.healthy,
        "open": now < ep.open_until,
        "applied_version": ep.applied_version,
        "outstanding": ep.outstanding,
        "limit": ep.limit,
        "max_inflight": ep.max_inflight,
    }


class EventLog:
    """Appends events to ``directory``, one zstd frame per ``flush_every`` events, on every
    :data:`DURABLE` event, and on close. ``first_seq`` continues the numbering of a resumed run
    (a restart appends new parts to the same directory)."""

    def __init__(self, directory: Path, *, flush_every: int = 64, first_seq: int = 0) -> None:
        from orchestrator.trajlog import FrameWriter

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
            endpoints=[endpoint_state(e, now) for e in endpoints],
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
    from orchestrator.trajlog import iter_records

    if (path / "events").is_dir():
        path = path / "events"
    return list(iter_records(path, "events"))


# -- re-simulation --------------------------------------------------------------------------------
@dataclass
class Resimulation:
    """How many decisions of each kind were re-derived, and those that came out differently."""

    checked: dict[str, int] = field(default_factory=lambda: {"route": 0, "admit": 0, "decide": 0})
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


@dataclass
class _AdmissionState:
    """The attributes :meth:`Scheduler.budget` reads, rebuilt from events."""

    max_lag: int
    groups_per_batch: int
    dropped: int = 0
    clock: Any = None


@dataclass
class _Clock:
    version: int = 0


class _NoTransport:
    """The re-simulated pool makes no calls."""

    async def generate(self, ep: Any, req: Any) -> Any:
        raise AssertionError("re-simulation made a call")

    async def policy(self, ep: Any) -> Any:
        raise AssertionError("re-simulation made a call")

    async def notify(self, ep: Any) -> None:
        raise AssertionError("re-simulation made a call")


def resimulate(
    events: Sequence[dict[str, Any]],
    *,
    trajectories: Path | None = None,
    staleness: StalenessConfig | None = None,
) -> Resimulation:
    """Re-derive every logged decision with the orchestrator's own code; report mismatches."""
    result = Resimulation()
    anyio.run(_routes, events, result)
    _admissions(events, result)
    if trajectories is not None:
        _decisions(events, trajectories, staleness, result)
    return result


async def _routes(events: Sequence[dict[str, Any]], result: Resimulation) -> None:
    from orchestrator.pool import Endpoint, Pool
    from orchestrator.types import EndpointRef
    from policies.lane import VersionBounds

    pool = Pool(_NoTransport(), version_wait_s=1.0, poll_interval_s=1.0)
    for ev in events:
        if ev["kind"] != "route":
            continue
        pool.endpoints = {
            s["id"]: Endpoint(
                ref=EndpointRef(id=s["id"], url="resim://", weight=s["weight"]),
                max_inflight=s["max_inflight"],
                applied_version=s["applied_version"],
                healthy=s["healthy"],
                outstanding=s["outstanding"],
                limit=s["limit"],
                open_until=math.inf if s["open"] else -math.inf,
            )
            for s in ev["endpoints"]
        }
        bounds = VersionBounds(min=ev["bounds"]["min"], max=ev["bounds"]["max"])
        picked = pool._pick(bounds, ev["affinity"], frozenset(ev["exclude"]))
        got = picked.id if picked is not None else None
        result.checked["route"] += 1
        if got != ev["chosen"]:
            result.mismatches.append(f"route #{ev['seq']}: logged {ev['chosen']}, re-sim {got}")


def _admissions(events: Sequence[dict[str, Any]], result: Resimulation) -> None:
    from orchestrator.scheduler import Scheduler

    state: _AdmissionState | None = None
    for ev in events:
        kind = ev["kind"]
        if kind == "run":
            state = _AdmissionState(ev["max_lag"], ev["groups_per_batch"], clock=_Clock())
        elif state is None:
            continue
        elif kind == "trainer_version":
            state.clock.version = ev["version"]
        elif kind == "release":
            state.dropped += ev["n"]
        elif kind == "resumed":  # a restart carries the admission state over
            state.clock.version = ev["trainer_version"]
            state.dropped = ev["dropped"]
        elif kind == "admit":
            budget = Scheduler.budget(state)  # type: ignore[arg-type]
            result.checked["admit"] += 1
            if budget != ev["budget"] or ev["admitted"] > budget:
                result.mismatches.append(
                    f"admit #{ev['seq']}: logged budget {ev['budget']} "
                    f"(admitted {ev['admitted']}), re-sim budget {budget}"
                )


def _decisions(
    events: Sequence[dict[str, Any]],
    trajectories: Path,
    staleness: StalenessConfig | None,
    result: Resimulation,
) -> None:
    from orchestrator.batcher import Batcher
    from orchestrator.replay import groups_of
    from orchestrator.trajlog import episode_records
    from staleness.config import StalenessConfig

    run = next((e for e in events if e["kind"] == "run"), None)
    if run is None:
        return
    policy = staleness or StalenessConfig.model_validate(run["staleness"])
    version = [0]
    batcher = Batcher(policy, run["groups_per_batch"], run["max_lag"], lambda: version[0])
    groups = {g.id: g for g, _, _ in groups_of(episode_records(trajectories))}
    for ev in events:
        if ev["kind"] != "decide" or ev["group_id"] not in groups or ev["reason"] in STOP_REASONS:
            continue
        version[0] = ev["trainer_version"]
        got = batcher.decide(groups[ev["group_id"]])
        result.checked["decide"] += 1
        if (got.decision, got.max_lag) != (ev["decision"], ev["max_lag"]):
            result.mismatches.append(
                f"decide {ev['group_id']}: logged {ev['decision']} (lag {ev['max_lag']}), "
                f"re-sim {got.decision} (lag {got.max_lag})"
            )
