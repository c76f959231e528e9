"""Re-derive every logged decision from the event log, with the orchestrator's own code.

Each ``route`` goes through :meth:`orchestrator.loop.pool.Pool.pick` on the logged endpoint
states, each ``admit`` through :meth:`orchestrator.loop.scheduler.Scheduler.budget` on the state
rebuilt from the ``trainer_version``, ``release`` and ``resumed`` events before it, and — given
the trajectory log — each ``decide`` through :meth:`orchestrator.loop.batcher.Batcher.decide`
with the logged ``[scheduler.dynamic_sampling]`` (but the drops of a stopping run,
:data:`~orchestrator.record.events.STOP_REASONS`); a decide matches when its decision, its lag
and whether dynamic sampling dropped it do. A complete,
faithful log gives zero mismatches. Not covered: the *timing* of events (which call reached the
pool first) is taken from the log, not re-simulated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from orchestrator.config import DynamicSamplingConfig
from orchestrator.loop.batcher import EQUAL_REWARDS, Batcher
from orchestrator.loop.pool import Pool
from orchestrator.loop.scheduler import Scheduler
from orchestrator.offline.what_if import groups_of
from orchestrator.record.events import STOP_REASONS
from orchestrator.record.trajlog import episode_records
from orchestrator.types import Endpoint, EndpointRef
from policies.wire.lane import VersionBounds
from staleness.config import StalenessConfig


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
        picked = pool.pick(bounds, ev["affinity"], frozenset(ev["exclude"]))
        got = picked.id if picked is not None else None
        result.checked["route"] += 1
        if got != ev["chosen"]:
            result.mismatches.append(f"route #{ev['seq']}: logged {ev['chosen']}, re-sim {got}")


def _admissions(events: Sequence[dict[str, Any]], result: Resimulation) -> None:
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
    run = next((e for e in events if e["kind"] == "run"), None)
    if run is None:
        return
    policy = staleness or StalenessConfig.model_validate(run["staleness"])
    # the logged per-environment rules, unless a counterfactual policy replaces every rule
    per_env = (
        {}
        if staleness is not None
        else {
            name: StalenessConfig.model_validate(s)
            for name, s in run.get("environment_staleness", {}).items()
        }
    )
    version = [0]
    ds = run.get("dynamic_sampling")
    batcher = Batcher(
        policy,
        run["groups_per_batch"],
        run["max_lag"],
        lambda: version[0],
        per_env,
        dynamic_sampling=None if ds is None else DynamicSamplingConfig.model_validate(ds),
    )
    groups = {g.id: g for g, _, _ in groups_of(episode_records(trajectories))}
    for ev in events:
        if ev["kind"] != "decide" or ev["group_id"] not in groups or ev["reason"] in STOP_REASONS:
            continue
        version[0] = ev["trainer_version"]
        got = batcher.decide(groups[ev["group_id"]])
        result.checked["decide"] += 1
        logged = (ev["decision"], ev["max_lag"], ev["reason"] == EQUAL_REWARDS)
        if (got.decision, got.max_lag, got.reason == EQUAL_REWARDS) != logged:
            result.mismatches.append(
                f"decide {ev['group_id']}: logged {_said(ev['decision'], ev['reason'])} "
                f"(lag {ev['max_lag']}), re-sim {_said(got.decision, got.reason)} "
                f"(lag {got.max_lag})"
            )


def _said(decision: str, reason: str) -> str:
    """A decision as a mismatch names it: ``kept``, ``dropped``, or ``dropped (filtered)`` for a
    dynamic-sampling drop."""
    return f"{decision} (filtered)" if reason == EQUAL_REWARDS else decision
