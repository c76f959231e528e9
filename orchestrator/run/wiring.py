"""The run's loop, wired from the config: :class:`RunLoop` builds the episode runners, the
scheduler and the batcher around :func:`~orchestrator.loop.rl.rl_loop`, serves the admin API and
the batch feed beside it, and records what the loop leaves: every group finished or in flight
when the run stops is recorded as dropped with its reason (never lost), and kept groups still
waiting for a full batch, or in a batch on the feed not yet acknowledged, are named in
``unbatched`` events. :class:`RunRecorder` writes every
group and step to the trajectory log and TensorBoard and keeps the run's summary.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio
import structlog
from pydantic import SecretStr

from environments.verifiers_adapter import VerifiersEnvironment
from orchestrator.config import Config
from orchestrator.fleet.ray_scale import Scaler
from orchestrator.loop.admin import serve_admin
from orchestrator.loop.batcher import Batcher
from orchestrator.loop.chat import ModelChat
from orchestrator.loop.episode import EpisodeRunner
from orchestrator.loop.feed import serve_feed
from orchestrator.loop.feed_sink import FeedTrainer
from orchestrator.loop.mixture import Source
from orchestrator.loop.pool import Pool
from orchestrator.loop.rl import Leftovers, rl_loop
from orchestrator.loop.scheduler import Scheduler, VersionClock
from orchestrator.loop.train_sink import TrainerSink
from orchestrator.loop.verifiers_episode import VerifiersRunner
from orchestrator.observe.live import LiveView
from orchestrator.observe.metrics import RunMetrics
from orchestrator.observe.scalars import Scalars
from orchestrator.observe.summary import RunSummary
from orchestrator.record import resume
from orchestrator.record.trajlog import TrajectoryLog
from orchestrator.run.environments import RunEnvironment
from orchestrator.types import Batch, EventSink, Group, GroupDecision, SamplingParams

log = structlog.get_logger(__name__)


def secret(value: SecretStr | None) -> str | None:
    """A config secret's value, where it is used (it is written out only as ``**********``)."""
    return value.get_secret_value() if value is not None else None


def episode_runner(cfg: Config, pool: Pool, env: RunEnvironment, chat: ModelChat) -> EpisodeRunner:
    """The runner of ``env``'s episodes over ``pool`` under the run's ``[sampling]``: a verifiers
    environment's runner runs its own rollout loop, with the pool as its model (a
    :class:`~orchestrator.loop.verifiers_episode.VerifiersRunner`, to be served beside)."""
    sampling = SamplingParams(
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        top_k=cfg.sampling.top_k,
        max_tokens=cfg.sampling.max_tokens,
    )
    verifiers = isinstance(env.env, VerifiersEnvironment)
    runner_cls = VerifiersRunner if verifiers else EpisodeRunner
    extra = {"run_name": cfg.run.name} if verifiers else {}
    return runner_cls(
        env.env,
        chat.chat,
        chat.parser,
        pool,
        sampling=sampling,
        max_turns=env.max_turns,
        episode_timeout_s=cfg.timeouts.episode_s,
        max_context=chat.max_context,
        name=env.name,
        **extra,
    )


class RunLoop:
    """The run's pieces around :func:`~orchestrator.loop.rl.rl_loop`: built from the config,
    with the admin API and the live view beside the loop, and every leftover recorded."""

    def __init__(
        self,
        cfg: Config,
        pool: Pool,
        envs: list[RunEnvironment],
        chats: list[ModelChat],
        sink: TrainerSink,
        trajlog: TrajectoryLog,
        summary: RunSummary,
        events: EventSink,
        rec: resume.Reconciliation | None,
    ) -> None:
        self.cfg, self.pool, self.sink = cfg, pool, sink
        sources = []
        for e, chat in zip(envs, chats, strict=True):
            runner = episode_runner(cfg, pool, e, chat)
            sources.append(Source(runner.name, runner, e.env.tasks(), e.weight))
        self.serving = [s.runner for s in sources if isinstance(s.runner, VerifiersRunner)]
        self.scheduler = Scheduler(
            None,
            None,
            VersionClock(sink.version, events=events),
            group_size=cfg.scheduler.group_size,
            groups_per_batch=cfg.scheduler.groups_per_batch,
            max_lag=cfg.scheduler.max_lag,
            max_concurrent_episodes=cfg.scheduler.max_concurrent_episodes,
            seed=cfg.run.seed,
            first_index=rec.next_index if rec else 0,
            dropped=rec.dropped if rec else 0,
            requeue_depth=rec.requeue_depth if rec else None,
            max_requeues=cfg.staleness.length_bias.max_requeues,
            events=events,
            sources=sources,
        )
        # the version the next batch is trained at: on the feed, past the batches ahead of it
        next_version = (
            (lambda: sink.next_version) if isinstance(sink, FeedTrainer) else (lambda: sink.version)
        )
        self.batcher = Batcher(
            cfg.staleness,
            cfg.scheduler.groups_per_batch,
            cfg.scheduler.max_lag,
            next_version,
            cfg.environment_staleness(),
            dynamic_sampling=cfg.scheduler.dynamic_sampling,
        )
        if rec is not None:
            self.batcher.restore(rec.restored)
        self.scalars = Scalars(cfg.run_dir / "tensorboard")
        self.recorder = RunRecorder(trajlog, summary, self.scalars)
        self.events = events

    async def run(
        self,
        metrics: RunMetrics,
        view: LiveView | None,
        supervise: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
        islands: Scaler | None = None,
    ) -> None:
        """Run the loop with the admin API (scaling ``islands``), the batch feed, the pool's
        health watch, the live view and ``supervise`` (the fleet's supervisor) beside it."""
        cfg = self.cfg
        try:
            async with AsyncExitStack() as stack, anyio.create_task_group() as tg:
                for runner in self.serving:  # verifiers environments' servers, for the run
                    await stack.enter_async_context(runner.serving())
                if cfg.admin.enabled:
                    url = await tg.start(
                        lambda task_status: serve_admin(
                            self.pool,
                            host=cfg.admin.host,
                            port=cfg.admin.port,
                            token=secret(cfg.admin.token),
                            admin_file=cfg.run_dir / "admin.json",
                            metrics=metrics,
                            islands=islands,
                            task_status=task_status,
                        )
                    )
                    log.info("admin_api", url=url)
                if isinstance(self.sink, FeedTrainer):
                    feed = self.sink.feed
                    url = await tg.start(
                        lambda task_status: serve_feed(
                            feed,
                            host=cfg.trainer.feed.host,
                            port=cfg.trainer.feed.port,
                            token=secret(cfg.trainer.feed.token),
                            feed_file=cfg.run_dir / "feed.json",
                            task_status=task_status,
                        )
                    )
                    log.info("batch_feed", url=url)
                await rl_loop(
                    self.scheduler,
                    self.batcher,
                    self.sink,
                    self.recorder,
                    max_steps=cfg.trainer.max_steps,
                    on_version=self.pool.notify_all,
                    beside=[
                        self.pool.watch,
                        *supervise,
                        *([view.run] if view is not None else []),
                    ],
                    on_stop=self.stopped,
                )
                tg.cancel_scope.cancel()
        finally:
            self.scalars.close()

    def stopped(self, leftovers: Leftovers) -> None:
        """Groups finished but not consumed, and groups still in flight, when the run stopped:
        recorded as dropped with the reason, never lost; kept groups left waiting for a full
        batch, or in a batch the feed's trainer has not acknowledged, are named in ``unbatched``
        events."""
        for group, reason in leftovers:
            decision = GroupDecision(
                group_id=group.id, decision="dropped", reason=reason, max_lag=0
            )  # shaped like every recorded group: the log holds each episode's overlong fields
            self.recorder.group(self.batcher.shape(group), decision, self.sink.version)
        if isinstance(self.sink, FeedTrainer) and self.sink.unacknowledged():
            self.events.emit(
                "unbatched",
                group_ids=[g.id for b in self.sink.unacknowledged() for g in b.groups],
                reason="run stopped before the trainer acknowledged the group's batch",
            )
        if self.batcher.pending:  # kept, never trained: the accounting needs them named
            reason = (
                "trainer.max_steps reached before the group's batch was complete"
                if self.sink.version >= self.cfg.trainer.max_steps
                else "run stopped before the group's batch was complete"
            )
            self.events.emit(
                "unbatched", group_ids=[g.id for g in self.batcher.pending], reason=reason
            )


class RunRecorder:
    """Writes the trajectory log and the TensorBoard scalars, and keeps the summary."""

    def __init__(self, trajlog: TrajectoryLog, summary: RunSummary, scalars: Scalars) -> None:
        self.trajlog = trajlog
        self.summary = summary
        self.scalars = scalars

    def group(self, group: Group, decision: GroupDecision, trainer_version: int) -> None:
        self.trajlog.write_group(group, decision, trainer_version=trainer_version)
        self.scalars.group(group, decision)
        self.summary.episodes += len(group.episodes)
        self.summary.dropped_groups += decision.decision == "dropped"
        self.summary.count(group, decision)

    async def step(self, batch: Batch, version: int, metrics: dict[str, float]) -> None:
        self.trajlog.write_batch(batch, version, metrics)
        self.scalars.step(version, metrics)
        self.summary.steps += 1
        self.summary.rewards.append(metrics["reward_mean"])
