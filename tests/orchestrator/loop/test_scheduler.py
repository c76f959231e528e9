"""Admission, batching and exactly-once accounting over random fleets, on trio's mock clock."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from transformers import PreTrainedTokenizerBase
from trio.testing import MockClock

from environments.calculator import Calculator, CalculatorConfig
from orchestrator.bench.simulate import calculator_runner
from orchestrator.loop.batcher import Batcher
from orchestrator.loop.pool import Pool
from orchestrator.loop.rl import log_in_flight, rl_loop
from orchestrator.loop.scheduler import Scheduler, VersionClock
from orchestrator.loop.train_sink import drain
from orchestrator.types import Batch, Group, GroupDecision, NullEvents
from staleness.config import DropRule, LengthBiasConfig, StalenessConfig
from tests.support.fakes import ScriptedTransport
from tests.support.waiting import elapse


@dataclass
class FakeTrainer:
    """Takes a random time per step; publishing makes engines catch up after a random delay."""

    transport: ScriptedTransport
    pool: Pool
    rng: random.Random
    version: int = 0
    trained: list[tuple[int, Batch]] = field(default_factory=list)

    async def train(self, batch: Batch) -> dict[str, float]:
        await elapse(self.rng.uniform(0.1, 2.0))
        self.trained.append((self.version, batch))
        self.version += 1
        return {"reward_mean": 0.0}


@dataclass
class Recorder:
    groups: dict[str, GroupDecision] = field(default_factory=dict)
    versions_seen: list[int] = field(default_factory=list)

    def group(self, group: Group, decision: GroupDecision, trainer_version: int) -> None:
        assert group.id not in self.groups, f"{group.id} recorded twice"
        self.groups[group.id] = decision

    async def step(self, batch: Batch, version: int, metrics: dict[str, float]) -> None:
        self.versions_seen.append(version)


async def _catch_up(
    t: ScriptedTransport, pool: Pool, trainer: FakeTrainer, rng: random.Random, lagging: str
) -> None:
    """Engines apply the newest version after a delay; one endpoint lags far behind."""
    while True:
        await elapse(0.3)
        for name in t.versions:
            if name in t.dead:
                continue
            delay_ok = rng.random() < (0.15 if name == lagging else 0.7)
            if delay_ok:
                t.versions[name] = trainer.version
        await pool.refresh_all()


async def _run_fleet(
    tokenizer: PreTrainedTokenizerBase, seed: int, max_lag: int, n_endpoints: int, kill: bool
) -> None:
    rng = random.Random(seed)
    names = [f"e{i}" for i in range(n_endpoints)]
    t = ScriptedTransport(
        {n: 0 for n in names},
        latency={n: rng.choice([0.05, 0.2, 1.0]) for n in names},
        eos=tokenizer.eos_token_id,
    )
    if kill:
        t.fail_after[names[0]] = rng.randint(0, 10)
    pool = Pool(t, version_wait_s=600.0, poll_interval_s=0.3, max_inflight=3)
    runner = await calculator_runner(
        pool,
        {n: f"http://{n}" for n in names},
        tokenizer,
        num_tasks=8,
        seed=seed,
        max_tokens=4,
        max_turns=2,
        episode_timeout_s=120.0,
        max_context=2048,
    )
    env = runner.env
    clock = VersionClock(0)
    groups_per_batch = 2
    sched = Scheduler(
        runner,
        env.tasks(),
        clock,
        group_size=2,
        groups_per_batch=groups_per_batch,
        max_lag=max_lag,
        max_concurrent_episodes=8,
        seed=seed,
    )
    trainer = FakeTrainer(t, pool, rng)
    batcher = Batcher(StalenessConfig(), groups_per_batch, max_lag, lambda: trainer.version)
    recorder = Recorder()
    await rl_loop(
        sched,
        batcher,
        trainer,
        recorder,
        max_steps=5,
        beside=[partial(_catch_up, t, pool, trainer, rng, names[-1])],
    )

    assert trainer.version == 5
    # Every recorded group was admitted; kept groups are in exactly one batch (or pending).
    trained_ids = [g.id for _, b in trainer.trained for g in b.groups]
    assert len(trained_ids) == len(set(trained_ids))
    pending = {g.id for g in batcher.pending}
    kept = {gid for gid, d in recorder.groups.items() if d.decision == "kept"}
    assert kept == set(trained_ids) | pending
    assert len(recorder.groups) <= sched.admitted
    for d in recorder.groups.values():
        assert d.decision == "kept" or d.reason
    # No trained token is older than the lag budget at the version it was trained at.
    for version, batch in trainer.trained:
        for group in batch.groups:
            for ep in group.episodes:
                assert ep.stop_reason != "interrupted"
                for seg in ep.segments:
                    assert version - seg.policy_version.start <= max_lag
                if ep.stop_reason == "model_error":
                    assert ep.error is not None
    # Requests were never sent outside their bounds.
    for name, req, resp in t.served:
        assert req.policy_version.admits(resp.policy_version.start), name


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 10_000), max_lag=st.integers(0, 3), n=st.integers(1, 4), kill=st.booleans()
)
def test_admission_and_exactly_once_over_random_fleets(
    tokenizer: PreTrainedTokenizerBase, seed: int, max_lag: int, n: int, kill: bool
) -> None:
    if kill and n == 1:
        n = 2  # someone must survive the kill
    anyio.run(
        _run_fleet,
        tokenizer,
        seed,
        max_lag,
        n,
        kill,
        backend="trio",
        backend_options={"clock": MockClock(autojump_threshold=0)},
    )


def test_synchronous_mode_trains_only_on_policy(tokenizer: PreTrainedTokenizerBase) -> None:
    anyio.run(
        _run_fleet,
        tokenizer,
        7,
        0,
        3,
        False,
        backend="trio",
        backend_options={"clock": MockClock(autojump_threshold=0)},
    )


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:datasets")


async def _cancel_mid_flight(tokenizer: PreTrainedTokenizerBase) -> None:
    t = ScriptedTransport({"a": 0}, latency={"a": 5.0}, eos=tokenizer.eos_token_id)
    pool = Pool(t, version_wait_s=60.0, poll_interval_s=1.0, max_inflight=2)
    runner = await calculator_runner(
        pool,
        {"a": "http://a"},
        tokenizer,
        num_tasks=4,
        max_tokens=4,
        max_turns=2,
        episode_timeout_s=60.0,
        max_context=2048,
    )
    env = runner.env
    sched = Scheduler(
        runner,
        env.tasks(),
        VersionClock(0),
        group_size=3,
        groups_per_batch=2,
        max_lag=1,
        max_concurrent_episodes=4,
        seed=0,
    )
    send, recv = anyio.create_memory_object_stream[Group](max_buffer_size=2)
    with capture_logs() as logs:
        with anyio.move_on_after(2.0):
            await sched.run(send)
        drain(recv)
        groups = sched.abandoned()
        log_in_flight(groups)
    assert len(groups) == sched.admitted == 4  # (0 + 1 + max_lag) * groups_per_batch
    # what a person sees at the stop: one line, the per-episode ones at debug
    shown = [e for e in logs if e["log_level"] != "debug"]
    assert [e["event"] for e in shown] == [
        "4 groups in flight at stop: 12 episodes interrupted, recorded in the trajectory log"
    ]
    assert [e["log_level"] for e in logs if e["event"] == "episode_interrupted"] == ["debug"] * 4
    for g in groups:
        assert [e.id for e in g.episodes] == [f"{g.id}-{i}" for i in range(3)]
        assert {e.stop_reason for e in g.episodes} == {"interrupted"}
    started = [e for g in groups for e in g.episodes if e.token_ids]
    assert len(started) == 4  # max_concurrent_episodes were mid-call, with their prompts


def test_cancelled_run_accounts_for_every_admitted_episode(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    anyio.run(
        _cancel_mid_flight,
        tokenizer,
        backend="trio",
        backend_options={"clock": MockClock(autojump_threshold=0)},
    )


def test_a_resumed_scheduler_continues_the_task_stream_and_the_budget() -> None:
    """Group ids are never reused and a restart sees the tasks a fresh run would have seen next."""
    tasks = Calculator(CalculatorConfig(num_tasks=8)).tasks()

    def scheduler(**resume: Any) -> Scheduler:
        return Scheduler(
            None,  # the task stream and the budget need no runner
            tasks,
            VersionClock(3),
            group_size=2,
            groups_per_batch=2,
            max_lag=1,
            max_concurrent_episodes=4,
            seed=5,
            **resume,
        )

    fresh = scheduler()
    resumed = scheduler(first_index=11, dropped=2)
    stream = [t["id"] for t, _ in zip(fresh._task_stream(), range(30), strict=False)]
    again = [t["id"] for t, _ in zip(resumed._task_stream(), range(19), strict=False)]
    assert again == stream[11:]
    assert resumed.admitted == 11
    assert resumed.budget() == fresh.budget() + 2


class RecordingEvents(NullEvents):
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"kind": kind, **fields})


async def _requeue_run(tokenizer: PreTrainedTokenizerBase, max_requeues: int) -> None:
    rng = random.Random(3)
    names = ["e0", "e1"]
    t = ScriptedTransport(
        dict.fromkeys(names, 0), latency={"e0": 0.2, "e1": 1.0}, eos=tokenizer.eos_token_id
    )
    pool = Pool(t, version_wait_s=600.0, poll_interval_s=0.3, max_inflight=3)
    runner = await calculator_runner(
        pool,
        {n: f"http://{n}" for n in names},
        tokenizer,
        num_tasks=8,
        seed=3,
        max_tokens=4,
        max_turns=2,
        episode_timeout_s=120.0,
        max_context=2048,
    )
    events = RecordingEvents()
    sched = Scheduler(
        runner,
        runner.env.tasks(),
        VersionClock(0),
        group_size=2,
        groups_per_batch=2,
        max_lag=2,
        max_concurrent_episodes=8,
        seed=3,
        max_requeues=max_requeues,
        events=events,
    )
    trainer = FakeTrainer(t, pool, rng)
    staleness = StalenessConfig(  # stricter than admission: many groups are dropped
        drop=DropRule(max_lag=0), length_bias=LengthBiasConfig(requeue=True)
    )
    batcher = Batcher(staleness, 2, 2, lambda: trainer.version)
    recorder = Recorder()
    await rl_loop(
        sched,
        batcher,
        trainer,
        recorder,
        max_steps=4,
        beside=[partial(_catch_up, t, pool, trainer, rng, "e1")],
    )
    admits = {e["group_id"]: e for e in events.events if e["kind"] == "admit"}
    requeues = [e for e in events.events if e["kind"] == "requeue"]
    assert requeues, "the run should have dropped (and requeued) something"
    depth: dict[str, int] = {}
    for e in admits.values():  # a re-run is a new group of the same task, one per requeue
        if "requeued_from" in e:
            src = admits[e["requeued_from"]]
            assert e["task_id"] == src["task_id"]
            depth[e["group_id"]] = depth.get(src["group_id"], 0) + 1
    assert max(depth.values()) <= max_requeues
    sources = [e["requeued_from"] for e in admits.values() if "requeued_from" in e]
    assert 0 < len(sources) == len(set(sources)) == sched.requeued
    assert set(sources) <= {e["group_id"] for e in requeues}  # the rest were still waiting
    for e in requeues:  # only staleness drops, each at most once, within the bound
        decision = recorder.groups[e["group_id"]]
        assert decision.decision == "dropped"
        assert "staleness.drop.max_lag" in decision.reason
        assert e["depth"] == depth.get(e["group_id"], 0) + 1 <= max_requeues
    assert len(requeues) == len({e["group_id"] for e in requeues})
    # a dropped group that was not requeued had used up its chain's bound
    requeued = {e["group_id"] for e in requeues}
    for gid, d in recorder.groups.items():
        if d.decision == "dropped" and gid not in requeued:
            assert depth.get(gid, 0) == max_requeues
    # the budget accounting still holds: every drop gave its slot back
    assert sched.dropped == sum(d.decision == "dropped" for d in recorder.groups.values())


@pytest.mark.parametrize("max_requeues", [1, 2])
def test_requeue_reruns_dropped_tasks_bounded_and_recorded(
    tokenizer: PreTrainedTokenizerBase, max_requeues: int
) -> None:
    anyio.run(
        _requeue_run,
        tokenizer,
        max_requeues,
        backend="trio",
        backend_options={"clock": MockClock(autojump_threshold=0)},
    )


def test_a_resumed_scheduler_skips_no_task_for_requeued_groups() -> None:
    """Admission indices taken by re-runs took no task of the stream: a restart after 11
    admissions of which 3 were re-runs continues the stream at position 8, and keeps the bound."""
    tasks = Calculator(CalculatorConfig(num_tasks=8)).tasks()
    kw: dict[str, Any] = {
        "group_size": 2,
        "groups_per_batch": 2,
        "max_lag": 1,
        "max_concurrent_episodes": 4,
        "seed": 5,
    }
    fresh = Scheduler(None, tasks, VersionClock(3), **kw)
    resumed = Scheduler(
        None,  # the task stream and the budget need no runner
        tasks,
        VersionClock(3),
        first_index=11,
        requeue_depth=dict.fromkeys(["g000002", "g000005", "g000009"], 1),
        **kw,
    )
    stream = [t["id"] for t, _ in zip(fresh._task_stream(), range(30), strict=False)]
    again = [t["id"] for t, _ in zip(resumed._task_stream(), range(22), strict=False)]
    assert again == stream[8:]
    assert resumed.admitted == 11
    resumed.max_requeues = 1  # the chain depths survive the restart: g000002 was a re-run
    assert not resumed.requeue(Group(id="g000002", task_id=str(stream[0]), episodes=[]))
    assert resumed.requeue(Group(id="g000003", task_id=str(stream[1]), episodes=[]))
