"""The scheduler event log: real pool / scheduler / batcher emit it; re-simulation reproduces it."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
from datasets import Dataset
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.config import DynamicSamplingConfig
from orchestrator.loop.batcher import EQUAL_REWARDS, Batcher
from orchestrator.loop.rl import rl_loop
from orchestrator.loop.scheduler import Scheduler, VersionClock
from orchestrator.observe.metrics import RunMetrics, Tee
from orchestrator.offline.resimulate import resimulate
from orchestrator.offline.what_if import LOGGED, WhatIfPolicy, what_if
from orchestrator.record.events import EventLog, read_events
from orchestrator.record.trajlog import TrajectoryLog, episode_records
from orchestrator.types import (
    Batch,
    Episode,
    EventSink,
    Group,
    GroupDecision,
    SamplingParams,
    Segment,
)
from policies.wire.lane import VersionStamp
from staleness.config import DropRule, StalenessConfig
from tests.support.events import pool_run, run_in_virtual_time
from tests.support.waiting import elapse


def test_pool_decisions_resimulate_exactly(tmp_path: Path) -> None:
    t = pool_run(tmp_path)
    events = read_events(tmp_path)
    assert [e["seq"] for e in events] == list(range(len(events)))
    kinds = {e["kind"] for e in events}
    assert {"route", "served", "call_failed", "version_unavailable", "endpoint"} <= kinds
    served = [e for e in events if e["kind"] == "served"]
    assert len(served) == len(t.served)
    transitions = [(e["id"], e["applied_version"]) for e in events if e["kind"] == "endpoint"]
    assert ("a", 2) in transitions
    assert ("b", 2) in transitions
    assert any(e["kind"] == "route" and e["chosen"] is None for e in events), "nobody waited"

    result = resimulate(events)
    assert result.ok, result.mismatches
    assert result.checked["route"] == sum(e["kind"] == "route" for e in events) > 40

    tampered = copy.deepcopy(events)
    route = next(e for e in tampered if e["kind"] == "route" and e["chosen"] == "b")
    route["chosen"] = "a"
    assert resimulate(tampered).mismatches == [f"route #{route['seq']}: logged a, re-sim b"]


class _Runner:
    """A scripted episode runner: an endpoint that always serves the newest version."""

    env = SimpleNamespace(name="scripted")
    name = "scripted"  # abandoned episodes name their environment

    def __init__(self, clock: VersionClock, equal: frozenset[int] = frozenset()) -> None:
        """``equal``: the tasks whose episodes all get reward 1 (the others a random one)."""
        self.clock = clock
        self.equal = equal
        self.interrupted: list[Episode] = []

    async def run(
        self,
        task: dict[str, Any],
        group_id: str,
        bounds: Any,
        admitted_at: int,
        seed: int | None = None,
        episode_id: str | None = None,
    ) -> Episode:
        rng = random.Random(seed)
        started = anyio.current_time()
        segments = []
        ids = [1, 2, 3]
        for turn in range(rng.randint(1, 3)):
            start = self.clock.version
            await elapse(rng.random() * 1.5)
            sampled = [rng.randrange(50) for _ in range(3)]
            segments.append(
                Segment(
                    turn=turn,
                    prompt_len=len(ids),
                    token_ids=sampled,
                    logprobs=[-1.0] * 3,
                    finish_reason="stop",
                    policy_version=VersionStamp(start=start, end=self.clock.version),
                    endpoint="scripted",
                    latency_s=0.1,
                    sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=3),
                )
            )
            ids += sampled
        return Episode(
            id=episode_id or f"{group_id}-{seed}",
            group_id=group_id,
            task_id=str(task["id"]),
            environment="scripted",
            token_ids=ids,
            prompt_len=3,
            segments=segments,
            reward=1.0 if task["id"] in self.equal else rng.random(),
            stop_reason="done",
            admitted_at_version=admitted_at,
            started_at=started,
            finished_at=anyio.current_time(),
        )


class _Sink:
    def __init__(self) -> None:
        self.version = 0

    async def train(self, batch: Batch) -> dict[str, float]:
        await elapse(0.4)
        self.version += 1
        return {"reward_mean": 0.0}


class _Recorder:
    def __init__(self, trajlog: TrajectoryLog) -> None:
        self.trajlog = trajlog

    def group(self, group: Group, decision: GroupDecision, trainer_version: int) -> None:
        self.trajlog.write_group(group, decision, trainer_version=trainer_version)

    async def step(self, batch: Batch, version: int, metrics: dict[str, float]) -> None:
        self.trajlog.write_batch(batch, version, metrics)


def _scheduler_run(
    tmp_path: Path,
    staleness: StalenessConfig,
    dynamic_sampling: DynamicSamplingConfig | None = None,
    equal: frozenset[int] = frozenset(),
    also: EventSink | None = None,
) -> None:
    """A run of 6 steps in virtual time; ``equal``: tasks whose rewards are all 1; ``also``: a
    sink that gets every event too."""

    async def main() -> None:
        log = EventLog(tmp_path / "events")
        events: EventSink = log if also is None else Tee(log, also)
        events.emit(
            "run",
            max_lag=2,
            groups_per_batch=2,
            staleness=staleness.model_dump(mode="json"),
            dynamic_sampling=None
            if dynamic_sampling is None
            else dynamic_sampling.model_dump(mode="json"),
        )
        trajlog = TrajectoryLog(tmp_path / "traj", events=events)
        clock = VersionClock(0, events=events)
        sched = Scheduler(
            _Runner(clock, equal),  # type: ignore[arg-type]
            Dataset.from_list([{"id": i} for i in range(8)]),
            clock,
            group_size=3,
            groups_per_batch=2,
            max_lag=2,
            max_concurrent_episodes=5,
            seed=1,
            events=events,
        )
        sink = _Sink()
        batcher = Batcher(staleness, 2, 2, lambda: sink.version, dynamic_sampling=dynamic_sampling)
        await rl_loop(sched, batcher, sink, _Recorder(trajlog), max_steps=6)
        trajlog.close()

    run_in_virtual_time(main)


def test_admissions_and_staleness_decisions_resimulate_exactly(tmp_path: Path) -> None:
    staleness = StalenessConfig(drop=DropRule(statistic="mean", max_lag=1))
    _scheduler_run(tmp_path, staleness)
    events = read_events(tmp_path)
    decides = [e for e in events if e["kind"] == "decide"]
    assert {e["decision"] for e in decides} == {"kept", "dropped"}
    assert sum(e["n"] for e in events if e["kind"] == "release") == sum(
        e["decision"] == "dropped" for e in decides
    )
    assert [e["version"] for e in events if e["kind"] == "trainer_version"] == [1, 2, 3, 4, 5, 6]
    assert len(episode_records(tmp_path / "traj")) == 3 * len(decides)

    result = resimulate(events, trajectories=tmp_path / "traj")
    assert result.ok, result.mismatches
    assert result.checked["admit"] == sum(e["kind"] == "admit" for e in events) > 12
    assert result.checked["decide"] == len(decides)

    # a different staleness policy re-decides differently: the comparison can fail
    other = resimulate(events, trajectories=tmp_path / "traj", staleness=StalenessConfig())
    assert any(m.startswith("decide") for m in other.mismatches)
    tampered = copy.deepcopy(events)
    admit = next(e for e in tampered if e["kind"] == "admit" and e["index"] == 10)
    admit["budget"] += 1
    assert [m.split(":")[0] for m in resimulate(tampered).mismatches] == [f"admit #{admit['seq']}"]


def test_dynamic_sampling_drops_are_decisions_like_any_other(tmp_path: Path) -> None:
    """A run with dynamic sampling: the groups of the tasks whose rewards are all equal are
    dropped with their reason and their slots refilled under the same budget (admissions
    re-simulate), counted (``sprawl_groups_filtered_total``) and seen by the length-bias guard as
    drops; re-simulation and the what-if replay reproduce them, and switching the filter off in a
    what-if keeps those groups."""
    staleness = StalenessConfig(drop=DropRule(statistic="mean", max_lag=1))
    ds = DynamicSamplingConfig()
    metrics = RunMetrics()
    _scheduler_run(tmp_path, staleness, ds, equal=frozenset({0, 2, 4, 6}), also=metrics)
    events = read_events(tmp_path)
    decides = [e for e in events if e["kind"] == "decide"]
    filtered = [e["group_id"] for e in decides if e["reason"] == EQUAL_REWARDS]
    assert len(filtered) >= 4
    assert {e["decision"] for e in decides if e["reason"] != EQUAL_REWARDS} >= {"kept"}
    assert sum(e["n"] for e in events if e["kind"] == "release") == sum(
        e["decision"] == "dropped" for e in decides
    )
    records = episode_records(tmp_path / "traj")
    assert all(
        r.episode.reward == 1.0 and r.episode.task_id in {"0", "2", "4", "6"}
        for r in records
        if r.decision.group_id in filtered
    )
    samples = {
        (s.name, tuple(s.labels.items())): s.value
        for f in text_string_to_metric_families(metrics.exposition().decode())
        for s in f.samples
    }
    assert samples[("sprawl_groups_filtered_total", ())] == len(filtered)
    n_dropped = sum(e["decision"] == "dropped" for e in decides)
    assert samples[("sprawl_groups_total", (("decision", "dropped"),))] == n_dropped
    assert metrics.length_bias.dropped == n_dropped  # the guard counts them like any drop

    result = resimulate(events, trajectories=tmp_path / "traj")
    assert result.ok, result.mismatches
    assert result.checked["decide"] == len(decides)
    unfiltered = copy.deepcopy(events)
    next(e for e in unfiltered if e["kind"] == "run")["dynamic_sampling"] = None
    mismatches = resimulate(unfiltered, trajectories=tmp_path / "traj").mismatches
    assert sorted(m.split(":")[0].split()[1] for m in mismatches) == sorted(filtered)
    assert "logged dropped (filtered) (lag" in mismatches[0]

    off = WhatIfPolicy(drop=staleness.drop, dynamic_sampling=DynamicSamplingConfig(enabled=False))
    out = {
        o.name: o
        for o in what_if(records, {"run": staleness, "off": off}, max_lag=2, dynamic_sampling=ds)
    }
    logged = out[LOGGED]
    assert logged.groups_filtered == out["run"].groups_filtered == len(filtered)
    assert (out["run"].groups_kept, out["run"].groups_dropped) == (
        logged.groups_kept,
        logged.groups_dropped,
    )
    assert out["run"].by_length.as_dict() == logged.by_length.as_dict()
    assert out["off"].groups_filtered == 0
    assert out["off"].groups_kept == logged.groups_kept + len(filtered)


def test_durable_events_reach_disk_at_once_and_seq_continues(tmp_path: Path) -> None:
    """``admit`` (and the other accounting events) are on disk before the next step of the run:
    a SIGKILL right after cannot lose them. A restart numbers its events after the last one."""
    log = EventLog(tmp_path, flush_every=64)
    log.emit("served", endpoint="a")
    log.emit("admit", index=0, group_id="g000000", task_id="t0", admitted=1, budget=2)
    assert [e["kind"] for e in read_events(tmp_path)] == ["served", "admit"]
    log.emit("served", endpoint="a")
    assert len(read_events(tmp_path)) == 2  # an ordinary event waits for flush_every
    log.close()
    resumed = EventLog(tmp_path, first_seq=3)
    resumed.emit("lost", group_ids=["g000001"], reason="in flight when the orchestrator stopped")
    assert [e["seq"] for e in read_events(tmp_path)] == [0, 1, 2, 3]
    resumed.close()


def test_resimulation_carries_admission_state_across_a_restart() -> None:
    run = {"kind": "run", "max_lag": 1, "groups_per_batch": 2}
    events = [
        run,
        {"kind": "resumed", "trainer_version": 3, "dropped": 2},
        # budget (3 + 1 + 1) * 2 + 2 = 12: the restart continues from the restored state
        {"kind": "admit", "seq": 9, "index": 9, "admitted": 10, "budget": 12},
    ]
    assert resimulate(events).ok
    events[1] = {"kind": "resumed", "trainer_version": 3, "dropped": 0}
    assert resimulate(events).mismatches == [
        "admit #9: logged budget 12 (admitted 10), re-sim budget 10"
    ]
