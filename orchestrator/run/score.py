"""Scoring a run's newest policy: fresh episodes from the real fleet, nothing trained.

:func:`score_policy` opens the run's fleet (:func:`~orchestrator.run.fleet.open_fleet`: its
engines serve the newest version on the run's board), plays ``episodes`` episodes of the run's
environments through the same episode runners as the loop
(:func:`~orchestrator.run.wiring.episode_runner`; a verifiers environment's server beside, as in
the run), each model call pinned to that version (``policy_version`` min = max = it), and returns
a :class:`PolicyScore`. Environments are picked
by weight as the scheduler picks them (:func:`~orchestrator.loop.mixture.weighted_picks`); each
environment's tasks are taken in its own order, from the first, cycling when there are fewer
than the episodes it gets. Sampling is the run's (``[sampling]``), and episode ``i`` is seeded
``SEED + i`` whatever the run's seed, so two runs of one config are scored on the same tasks with
the same seeds (paired, as the lag experiment compares them).

The tasks are the environment's own, the ones the run trained on: the score says how well the
final policy does them, not how it generalises. What it is for: a run's training reward at step
``t`` is that of the version that sampled step ``t``'s episodes, which under a lag budget ``L`` is
up to ``L`` versions old; the score compares what runs ended with.

Guarantees: every episode counts: a failed one (an environment error, a call that failed on
every endpoint) scores the reward it has (0 when the environment gave none) and is counted in
:attr:`PolicyScore.failed`. Nothing is written to the run's trajectory log or events.
"""

from __future__ import annotations

import itertools
from contextlib import AsyncExitStack
from dataclasses import dataclass

import anyio
import structlog

from orchestrator.config import Config
from orchestrator.errors import ConfigError
from orchestrator.loop.episode import EpisodeRunner
from orchestrator.loop.mixture import weighted_picks
from orchestrator.loop.verifiers_episode import VerifiersRunner
from orchestrator.models import ensure_model
from orchestrator.run.environments import load_environments, model_chats
from orchestrator.run.fleet import open_fleet
from orchestrator.run.wiring import episode_runner
from orchestrator.types import NULL_EVENTS, Episode
from policies.wire.lane import VersionBounds

log = structlog.get_logger(__name__)

SEED = 7_000_003
"""The first episode's sampling seed (episode ``i``: ``SEED + i``), the same for every run."""


@dataclass(frozen=True)
class PolicyScore:
    """Fresh episodes of one version: their rewards (in episode order) and how many failed."""

    version: int
    rewards: list[float]
    failed: int

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")


async def score_policy(cfg: Config, episodes: int) -> PolicyScore:
    """Score the newest version on ``cfg``'s board on ``episodes`` fresh episodes (module
    docstring). Raises :class:`ConfigError` when the board has no version."""
    from transformers import AutoTokenizer

    from policies.board import BoardReader

    if episodes < 1:
        raise ValueError(f"episodes must be ≥ 1, got {episodes}")
    version = BoardReader(cfg.board_url, cfg.run.name, options=cfg.board).latest()
    if version is None:
        raise ConfigError(f"run {cfg.run.name!r}: no version on the board {cfg.board_url} to score")
    envs = load_environments(cfg)
    model_dir = await anyio.to_thread.run_sync(ensure_model, cfg)
    chats = model_chats(cfg, model_dir, AutoTokenizer.from_pretrained(model_dir), envs)
    picks = list(itertools.islice(weighted_picks([e.weight for e in envs]), episodes))
    played: list[Episode | None] = [None] * episodes
    async with open_fleet(cfg, model_dir, NULL_EVENTS) as fleet, AsyncExitStack() as stack:
        runners = [episode_runner(cfg, fleet.pool, e, c) for e, c in zip(envs, chats, strict=True)]
        for runner in runners:  # verifiers environments' servers, as in the run
            if isinstance(runner, VerifiersRunner):
                await stack.enter_async_context(runner.serving())
        tasks = [e.env.tasks() for e in envs]
        taken = [0] * len(envs)
        jobs = []
        for i, k in enumerate(picks):
            jobs.append((i, runners[k], dict(tasks[k][taken[k] % len(tasks[k])])))
            taken[k] += 1
        limit = anyio.CapacityLimiter(cfg.scheduler.max_concurrent_episodes)
        bounds = VersionBounds(min=version, max=version)

        async def play(i: int, runner: EpisodeRunner, task: dict[str, object]) -> None:
            async with limit:
                played[i] = await runner.run(
                    task, f"score-{i:06d}", lambda: bounds, version, seed=SEED + i
                )

        async with anyio.create_task_group() as tg:
            tg.start_soon(fleet.pool.watch)  # what the endpoints serve, as in the loop
            async with anyio.create_task_group() as episodes_tg:
                for job in jobs:
                    episodes_tg.start_soon(play, *job)
            tg.cancel_scope.cancel()
    done = [ep for ep in played if ep is not None]
    failed = sum(ep.error is not None for ep in done)
    log.info("policy_scored", run=cfg.run.name, version=version, episodes=len(done), failed=failed)
    return PolicyScore(version, [ep.reward for ep in done], failed)
