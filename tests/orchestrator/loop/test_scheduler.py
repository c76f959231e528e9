"""Admission, batching and exactly-once accounting over random fleets, on trio's mock clock."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase
from trio.testing import MockClock

from environments.calculator import Calculator, CalculatorConfig
from orchestrator.bench.simulate import calculator_runner
from orchestrator.loop.batcher import Batcher
from orchestrator.loop.pool import Pool
from orchestrator.loop.rl import rl_loop
from orchestrator.loop.scheduler import Scheduler, VersionClock
from orchestrator.loop.train_sink import drain
from orchestrator.types import Batch, Group, GroupDecision
from staleness.config import StalenessConfig
from tests.support.fakes import ScriptedTransport


@dataclass
class FakeTrainer:
    """Takes a random time per step; publishing makes engines catch up after a random delay."""

    transport: ScriptedTransport
    pool: Pool
    rng: random.Random
    version: int = 0
    trained: list[tuple[int, Batch]] = field(default_factory=list)

    async def train(self, batch: Batch) -> dict[str, float]:
        await anyio.sleep(self.rng.uniform(0.1, 2.0))
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
        await anyio.sleep(0.3)
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
    with anyio.move_on_after(2.0):
        await sched.run(send)
    drain(recv)
    groups = sched.abandoned()
    assert len(groups) == sched.admitted == 4  # (0 + 1 + max_lag) * groups_per_batch
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

    def scheduler(**resume: int) -> Scheduler:
        return Scheduler(
            None,  # type: ignore[arg-type]  # the task stream and the budget need no runner
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
