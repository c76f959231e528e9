"""One RL run: trainer → board → engines → scheduler → environment → staleness → trainer.

:func:`run` wires the parts together under one task group: the trainer publishes version 0, the
local fleet starts and serves it, the scheduler admits groups under the lag budget, finished
groups are decided by the staleness policy and batched, each batch is one trainer step that
publishes the next version and notifies the engines. The run ends after ``trainer.max_steps``
steps, or on SIGINT/SIGTERM, and in both cases every engine subprocess is stopped and reaped and
the trajectory log is closed cleanly.

A run has one environment (``[environment]``) or a mixture (``[[environments]]``): each
environment gets its own episode runner (its own tool schemas in the chat template), the
scheduler picks each new group's environment by weight, and the batcher decides each group by
its environment's staleness rule.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import structlog

from environments.loader import load_environment
from environments.verifiers_adapter import VerifiersEnvironment
from orchestrator.config import Config
from orchestrator.errors import ConfigError
from orchestrator.loop.admin import serve_admin
from orchestrator.loop.batcher import Batcher
from orchestrator.loop.chat import ModelChat, model_chat
from orchestrator.loop.client import HttpTransport
from orchestrator.loop.episode import EpisodeRunner
from orchestrator.loop.feed import BatchFeed, serve_feed
from orchestrator.loop.fleet import fleet_supervisor, local_fleet
from orchestrator.loop.islands import LoraServing
from orchestrator.loop.mixture import Source
from orchestrator.loop.pool import Pool
from orchestrator.loop.rl import Leftovers, rl_loop
from orchestrator.loop.scheduler import Scheduler, VersionClock
from orchestrator.loop.supervisor import Replica
from orchestrator.loop.train_sink import (
    ExternalTrainer,
    FeedTrainer,
    InProcessTrainer,
    TrainerSink,
    board_version_above,
    build_trainer,
)
from orchestrator.loop.verifiers_episode import VerifiersRunner
from orchestrator.models import ensure_model
from orchestrator.observe.live import LiveView
from orchestrator.observe.live import wanted as live_wanted
from orchestrator.observe.metrics import RunMetrics, Tee
from orchestrator.observe.scalars import Scalars
from orchestrator.observe.summary import RunSummary
from orchestrator.rayfleet.scale import Scaler
from orchestrator.record import resume
from orchestrator.record.events import EventLog
from orchestrator.record.trajlog import TrajectoryLog
from orchestrator.types import Batch, EventSink, Group, GroupDecision, SamplingParams

if TYPE_CHECKING:
    from environments.base import Environment
    from orchestrator.rayfleet.launch import RayFleet
    from policies.board import Board

log = structlog.get_logger(__name__)


def prepare_run_dir(cfg: Config) -> Path:
    """A fresh run directory (with ``config.json``), or the existing one with ``run.resume``."""
    if cfg.run.resume:
        return resume.check_run_dir(cfg)
    run_dir = cfg.run_dir
    if run_dir.exists():
        if not cfg.run.overwrite:
            raise ConfigError(
                f"run.name: {run_dir} holds an earlier run ({_started(run_dir)}); keep it and "
                "start another with --run.name NAME, continue it with --run.resume true, or "
                "replace it (deleting its logs, board and checkpoints) with --run.overwrite true"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return run_dir


def _started(run_dir: Path) -> str:
    config = run_dir / "config.json"
    if not config.exists():
        return "no config.json: not a complete run directory"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(config.stat().st_mtime))
    return f"started {when}"


async def run(cfg: Config) -> RunSummary:
    """Run the loop described by ``cfg`` until ``trainer.max_steps`` or a signal."""
    from transformers import AutoTokenizer

    from policies.board import Board

    t0 = time.perf_counter()
    envs = _load_environments(cfg)
    run_dir = prepare_run_dir(cfg)
    logged = resume.read_run(run_dir) if cfg.run.resume else None
    summary = RunSummary(run_dir=run_dir)
    model_dir = await anyio.to_thread.run_sync(ensure_model, cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # before any engine starts: a template sprawl cannot bridge stops the run here
    chats = [
        model_chat(
            model_dir,
            tokenizer,
            e.env.tool_schemas(),
            tool_parser_name=cfg.model.tool_parser,
            max_context=cfg.model.max_context,
        )
        for e in envs
    ]
    board = Board(cfg.board_url, cfg.run.name, options=cfg.board)
    sink = await _trainer_sink(cfg, run_dir, model_dir, board, logged)
    metrics = RunMetrics(cfg.staleness.length_bias)  # Prometheus, served on GET /metrics
    view = LiveView(cfg.trainer.max_steps, cfg.staleness.length_bias) if live_wanted() else None
    # the event log, the metrics and (on a terminal) the live view all read the same events
    event_log = EventLog.for_run(
        run_dir / "events", cfg, first_seq=logged.next_seq if logged else 0
    )
    events = Tee(event_log, metrics, summary.sync, *([view] if view is not None else []))
    trajlog = TrajectoryLog(
        run_dir / "trajectories",
        run=cfg.run.name,
        config=cfg.model_dump(mode="json"),
        append=cfg.run.resume,
        events=events,
    )
    rec = None
    if logged is not None:
        rec = resume.start(logged, trajlog, trainer_version=sink.version, cfg=cfg)
        if sink.version >= cfg.trainer.max_steps:  # nothing left to train
            trajlog.close()
            summary.seconds = time.perf_counter() - t0
            summary.cover(await anyio.to_thread.run_sync(resume.read_run, run_dir))
            return summary
    log.info("run_started", run_dir=str(run_dir), board=cfg.board_url)
    lora = _lora_serving(cfg, model_dir)

    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_signal, tg.cancel_scope, summary)
        try:
            async with (
                aiohttp.ClientSession() as session,
                local_fleet(
                    cfg.fleet.local_engines,
                    board_url=cfg.board_url,
                    run=cfg.run.name,
                    device=cfg.fleet.device,
                    log_dir=run_dir / "logs",
                    poll_interval_s=cfg.board.poll_interval_s,
                    startup_timeout_s=cfg.fleet.startup_timeout_s,
                    islands=cfg.fleet.islands,
                    island_dir=run_dir / "islands",
                    lora=lora,
                ) as local,
                _ray_islands(cfg, lora) as rays,
            ):
                transport = HttpTransport(
                    session, connect_s=cfg.timeouts.connect_s, call_s=cfg.timeouts.call_s
                )
                pool = Pool(
                    transport,
                    version_wait_s=cfg.timeouts.version_wait_s,
                    poll_interval_s=cfg.board.poll_interval_s,
                    max_inflight=cfg.fleet.max_inflight_per_endpoint,
                    breaker_failures=cfg.fleet.breaker_failures,
                    breaker_cooldown_s=cfg.fleet.breaker_cooldown_s,
                    events=events,
                )
                on_ray = rays.replicas if rays is not None else []
                for ref in local.refs + [r.ref for r in on_ray] + cfg.fleet.endpoint_refs():
                    pool.add(ref)
                # fleet.restart = false: a dead local engine stays in the pool, out of rotation;
                # Ray islands are always tended (the scaler adds and retires them), not restarted
                tended: list[Replica] = [*(local.replicas if cfg.fleet.restart else []), *on_ray]
                launchers = {**local.launchers, **(rays.launchers if rays is not None else {})}
                supervise: list[Callable[[], Coroutine[Any, Any, None]]] = []
                scaler = None
                if tended or rays is not None:
                    supervisor = fleet_supervisor(pool, cfg.fleet, launchers, events=events)
                    supervise.append(partial(supervisor.run, tended))
                if rays is not None and cfg.fleet.ray is not None:
                    scaler = Scaler(
                        pool,
                        supervisor,
                        [r.ref.id for r in on_ray],
                        rays.launcher,
                        drain_timeout_s=cfg.fleet.ray.drain_timeout_s,
                        events=events,
                    )
                    supervise.append(scaler.run)
                loop = _Loop(cfg, pool, envs, chats, sink, trajlog, summary, events, rec)
                try:
                    await loop.run(metrics, view, supervise, scaler)
                finally:
                    summary.served = {e.id: dict(e.served) for e in pool.endpoints.values()}
        finally:
            trajlog.close()
            summary.seconds = time.perf_counter() - t0
        tg.cancel_scope.cancel()
    if logged is not None:  # resumed: the whole run, from the logs now closed
        summary.cover(await anyio.to_thread.run_sync(resume.read_run, run_dir))
    return summary


@dataclass
class _Env:
    """One environment of the run, as loaded: its name in the run (None: the class's), its
    admission weight and turn limit."""

    env: Environment
    name: str | None
    weight: float
    max_turns: int


def _load_environments(cfg: Config) -> list[_Env]:
    """The ``[[environments]]`` of a mixture, or the one ``[environment]``."""
    if not cfg.environments:
        one = cfg.environment
        envs = [
            _Env(load_environment(one.target(), one.args, kind=one.kind), None, 1.0, one.max_turns)
        ]
    else:
        envs = [
            _Env(
                load_environment(e.target(), e.args, key=f"environments[{i}]", kind=e.kind),
                e.name,
                e.weight,
                e.max_turns,
            )
            for i, e in enumerate(cfg.environments)
        ]
    for e in envs:
        e.env.tool_timeout_s = cfg.timeouts.tool_s
    return envs


class _Loop:
    """The run's pieces around :func:`~orchestrator.loop.rl.rl_loop`: built from the config,
    with the admin API and the live view beside the loop, and every leftover recorded."""

    def __init__(
        self,
        cfg: Config,
        pool: Pool,
        envs: list[_Env],
        chats: list[ModelChat],
        sink: TrainerSink,
        trajlog: TrajectoryLog,
        summary: RunSummary,
        events: EventSink,
        rec: resume.Reconciliation | None,
    ) -> None:
        self.cfg, self.pool, self.sink = cfg, pool, sink
        sampling = SamplingParams(
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k,
            max_tokens=cfg.sampling.max_tokens,
        )
        sources = []
        for e, chat in zip(envs, chats, strict=True):
            # a verifiers environment runs its own rollout loop, with the pool as its model
            verifiers = isinstance(e.env, VerifiersEnvironment)
            runner_cls = VerifiersRunner if verifiers else EpisodeRunner
            runner = runner_cls(
                e.env,
                chat.chat,
                chat.parser,
                pool,
                sampling=sampling,
                max_turns=e.max_turns,
                episode_timeout_s=cfg.timeouts.episode_s,
                max_context=chat.max_context,
                name=e.name,
            )
            sources.append(Source(runner.name, runner, e.env.tasks(), e.weight))
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
        self.batcher = Batcher(
            cfg.staleness,
            cfg.scheduler.groups_per_batch,
            cfg.scheduler.max_lag,
            lambda: sink.version,
            cfg.environment_staleness(),
        )
        if rec is not None:
            self.batcher.restore(rec.restored)
        self.scalars = Scalars(cfg.run_dir / "tensorboard")
        self.recorder = _RunRecorder(trajlog, summary, self.scalars)
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
            async with anyio.create_task_group() as tg:
                if cfg.admin.enabled:
                    url = await tg.start(
                        lambda task_status: serve_admin(
                            self.pool,
                            host=cfg.admin.host,
                            port=cfg.admin.port,
                            token=cfg.admin.token,
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
                            token=cfg.trainer.feed.token,
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
        batch are named in an ``unbatched`` event."""
        for group, reason in leftovers:
            decision = GroupDecision(
                group_id=group.id, decision="dropped", reason=reason, max_lag=0
            )
            self.recorder.group(group, decision, self.sink.version)
        if self.batcher.pending:  # kept, never trained: the accounting needs them named
            reason = (
                "trainer.max_steps reached before the group's batch was complete"
                if self.sink.version >= self.cfg.trainer.max_steps
                else "run stopped before the group's batch was complete"
            )
            self.events.emit(
                "unbatched", group_ids=[g.id for g in self.batcher.pending], reason=reason
            )


class _RunRecorder:
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


async def _trainer_sink(
    cfg: Config, run_dir: Path, model_dir: Path, board: Board, logged: resume.LoggedRun | None
) -> TrainerSink:
    """The in-process reference trainer (publishes version 0 now, or resumes from its
    checkpoint), or an external trainer reached through batch files or the batch feed (waits for
    it to publish version 0, or the version a resumed run continues from)."""
    if cfg.trainer.mode == "feed":  # run.resume is refused in this mode: version 0 first
        log.info("waiting_for_external_trainer", feed=str(run_dir / "feed.json"), version=0)
        with anyio.fail_after(cfg.timeouts.trainer_step_s):
            latest = await board_version_above(board, -1, cfg.board.poll_interval_s)
        return FeedTrainer(
            BatchFeed(version=latest, board_latest=board.latest),
            group_size=cfg.scheduler.group_size,
            staleness=cfg.staleness,
            step_timeout_s=cfg.timeouts.trainer_step_s,
        )
    if cfg.trainer.mode == "external":
        batch_dir = cfg.trainer.batch_dir or run_dir / "batches"
        wanted = resume.external_version(batch_dir, logged) if logged else 0
        log.info("waiting_for_external_trainer", batch_dir=str(batch_dir), version=wanted)
        with anyio.fail_after(cfg.timeouts.trainer_step_s):
            latest = await board_version_above(board, wanted - 1, cfg.board.poll_interval_s)
        return ExternalTrainer(
            board,
            batch_dir,
            group_size=cfg.scheduler.group_size,
            poll_interval_s=cfg.board.poll_interval_s,
            step_timeout_s=cfg.timeouts.trainer_step_s,
            version=latest,
            staleness=cfg.staleness,
        )
    ckpt = run_dir / "trainer" / "ckpt" if cfg.trainer.checkpoint else None
    trainer = await anyio.to_thread.run_sync(
        lambda: build_trainer(cfg, model_dir, board, checkpoint_dir=ckpt, resume=cfg.run.resume)
    )
    # resumed: the board is at the checkpoint's version or one behind (the checkpoint is
    # written first); ensure_published refuses a board ahead of it
    await anyio.to_thread.run_sync(trainer.ensure_published if cfg.run.resume else trainer.publish)
    return InProcessTrainer(trainer)


def _lora_serving(cfg: Config, model_dir: Path) -> LoraServing | None:
    """How the run's engines serve its LoRA versions (``trainer.lora``), or None."""
    if cfg.trainer.lora is None:
        return None
    return LoraServing(
        base_model=model_dir, max_adapters=cfg.fleet.max_adapters, rank=cfg.trainer.lora.rank
    )


@asynccontextmanager
async def _ray_islands(cfg: Config, lora: LoraServing | None) -> AsyncIterator[RayFleet | None]:
    """The run's Ray islands (``[fleet.ray]``), or None."""
    if cfg.fleet.ray is None:
        yield None
        return
    from orchestrator.rayfleet.launch import ray_fleet

    async with ray_fleet(
        cfg.fleet.ray,
        board_url=cfg.board_url,
        run=cfg.run.name,
        device=cfg.fleet.device,
        poll_interval_s=cfg.board.poll_interval_s,
        lora=lora,
    ) as rays:
        yield rays


async def _cancel_on_signal(scope: anyio.CancelScope, summary: RunSummary) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.warning("shutting_down", signal=signal.Signals(signum).name)
            summary.interrupted = True
            scope.cancel()
            return
