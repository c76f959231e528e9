"""A simulated fleet and trainer, for measuring the scheduler in virtual time.

:class:`SimFleet` is a :class:`~orchestrator.types.Transport` whose endpoints take
``tokens × seconds_per_token`` to answer (lognormal generation lengths, per-endpoint speed
classes) and apply a newly published version after a per-endpoint delay — one endpoint can be
made to lag far behind. :func:`simulate` runs the real scheduler, pool, episode runner, batcher
and trainer boundary against it, with a trainer whose step takes a fixed time, on trio's mock
clock: minutes of fleet time take a second of wall time, and every run is deterministic for a
seed.

What is real: admission, routing, waiting for versions, batching, lag drops. What is simulated:
token generation (no model), engine weight sync (a delay), the trainer's step (a delay).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import anyio
from transformers import PreTrainedTokenizerBase

from environments.calculator import Calculator, CalculatorConfig
from orchestrator.errors import VersionUnavailable
from orchestrator.loop.batcher import Batcher
from orchestrator.loop.episode import EpisodeRunner
from orchestrator.loop.pool import Pool
from orchestrator.loop.rl import rl_loop
from orchestrator.loop.scheduler import Scheduler, VersionClock
from orchestrator.types import Batch, EndpointRef, Group, GroupDecision, SamplingParams
from policies.wire.chat_tokens import ChatTokens
from policies.wire.lane import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    PolicyState,
    Usage,
    VersionStamp,
)
from policies.wire.tool_parsers import tool_parser
from staleness.config import StalenessConfig


@dataclass
class SimEndpoint:
    seconds_per_token: float
    sync_delay_s: float
    version: int = 0


@dataclass
class SimFleet:
    """Endpoints that generate lognormal-length answers at their own speed."""

    endpoints: dict[str, SimEndpoint]
    rng: random.Random
    eos: int
    mean_tokens: float = 200.0
    sigma: float = 1.0
    max_tokens: int = 2000

    async def generate(self, ep: EndpointRef, req: GenerateRequest) -> GenerateResponse:
        sim = self.endpoints[ep.id]
        start = sim.version
        if not req.policy_version.admits(start):
            raise VersionUnavailable(ep.id, "outside bounds", start)
        mu = math.log(self.mean_tokens) - self.sigma**2 / 2
        n = max(1, min(self.max_tokens, int(self.rng.lognormvariate(mu, self.sigma))))
        await anyio.sleep(n * sim.seconds_per_token)
        ids = [7] * (n - 1) + [self.eos]
        return GenerateResponse(
            id="sim",
            model="sim",
            prompt_token_ids=req.prompt_token_ids,
            choices=[
                GenerateChoice(index=0, token_ids=ids, logprobs=[-1.0] * n, finish_reason="stop")
            ],
            policy_version=VersionStamp(start=start, end=sim.version),
            usage=Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=n),
        )

    async def policy(self, ep: EndpointRef) -> PolicyState:
        v = self.endpoints[ep.id].version
        return PolicyState(applied_version=v, staged_version=None, state="serving", run="sim")

    async def notify(self, ep: EndpointRef) -> None:
        return None

    async def publish(self, version: int, pool: Pool) -> None:
        """Every endpoint applies ``version`` after its own sync delay."""

        async def sync(name: str, sim: SimEndpoint) -> None:
            await anyio.sleep(sim.sync_delay_s)
            sim.version = max(sim.version, version)
            await pool.refresh(pool.endpoints[name])

        async with anyio.create_task_group() as tg:
            for name, sim in self.endpoints.items():
                tg.start_soon(sync, name, sim)


@dataclass
class SimTrainer:
    step_s: float
    fleet: SimFleet
    pool: Pool
    tg: anyio.abc.TaskGroup
    version: int = 0
    busy_s: float = 0.0
    trained_episodes: int = 0

    async def train(self, batch: Batch) -> dict[str, float]:
        await anyio.sleep(self.step_s)
        self.busy_s += self.step_s
        self.trained_episodes += sum(len(g.episodes) for g in batch.groups)
        self.version += 1
        self.tg.start_soon(self.fleet.publish, self.version, self.pool)
        return {}


async def calculator_runner(
    pool: Pool,
    endpoints: dict[str, str],
    tokenizer: PreTrainedTokenizerBase,
    *,
    num_tasks: int,
    max_tokens: int,
    max_turns: int,
    episode_timeout_s: float,
    max_context: int,
    seed: int = 0,
) -> EpisodeRunner:
    """An episode runner for the calculator on ``pool``, after adding ``endpoints`` (id → URL)
    and probing them once: the wiring the simulator, the scheduler bench and tests share."""
    for name, url in endpoints.items():
        pool.add(EndpointRef(id=name, url=url))
    await pool.refresh_all()
    env = Calculator(CalculatorConfig(num_tasks=num_tasks, seed=seed))
    return EpisodeRunner(
        env,
        ChatTokens(tokenizer, env.tool_schemas()),
        tool_parser("hermes"),
        pool,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_tokens),
        max_turns=max_turns,
        episode_timeout_s=episode_timeout_s,
        max_context=max_context,
    )


@dataclass
class _Count:
    dropped: int = 0
    lags: list[int] = field(default_factory=list)

    def group(self, group: Group, decision: GroupDecision, trainer_version: int) -> None:
        self.dropped += decision.decision == "dropped"
        self.lags.append(decision.max_lag)

    async def step(self, batch: Batch, version: int, metrics: dict[str, float]) -> None:
        return None


@dataclass(frozen=True)
class SimResult:
    max_lag: int
    steps: int
    seconds: float
    episodes_per_s: float
    trainer_idle: float
    dropped_groups: int
    mean_lag: float


async def simulate(
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_lag: int,
    steps: int = 20,
    seed: int = 0,
    group_size: int = 8,
    groups_per_batch: int = 4,
    trainer_step_s: float = 20.0,
) -> SimResult:
    """One simulated run to ``steps`` trainer steps (call inside trio with a MockClock)."""
    rng = random.Random(seed)
    classes = [0.01, 0.02, 0.04]  # seconds per token: three speed classes
    endpoints = {f"e{i}": SimEndpoint(classes[i % 3], sync_delay_s=2.0) for i in range(6)}
    endpoints["e5"].sync_delay_s = 60.0  # one island lags versions far behind
    fleet = SimFleet(endpoints, rng, eos=int(tokenizer.eos_token_id))
    pool = Pool(fleet, version_wait_s=1e9, poll_interval_s=5.0, max_inflight=8)
    runner = await calculator_runner(
        pool,
        {name: f"sim://{name}" for name in endpoints},
        tokenizer,
        num_tasks=64,
        seed=seed,
        max_tokens=2000,
        max_turns=1,
        episode_timeout_s=1e9,
        max_context=1 << 20,
    )
    env = runner.env
    clock = VersionClock(0)
    sched = Scheduler(
        runner,
        env.tasks(),
        clock,
        group_size=group_size,
        groups_per_batch=groups_per_batch,
        max_lag=max_lag,
        max_concurrent_episodes=48,
        seed=seed,
    )
    count = _Count()
    t0 = anyio.current_time()
    async with anyio.create_task_group() as tg:
        trainer = SimTrainer(trainer_step_s, fleet, pool, tg)
        batcher = Batcher(StalenessConfig(), groups_per_batch, max_lag, lambda: trainer.version)
        await rl_loop(sched, batcher, trainer, count, max_steps=steps)
        elapsed = anyio.current_time() - t0
        tg.cancel_scope.cancel()
    return SimResult(
        max_lag=max_lag,
        steps=steps,
        seconds=round(elapsed, 1),
        episodes_per_s=round(trainer.trained_episodes / elapsed, 3),
        trainer_idle=round(1 - trainer.busy_s / elapsed, 3),
        dropped_groups=count.dropped,
        mean_lag=round(sum(count.lags) / max(len(count.lags), 1), 2),
    )
