"""One RL run: trainer → board → engines → scheduler → environment → staleness → trainer.

:func:`run` wires the parts together under one task group: the trainer publishes version 0, the
local fleet starts and serves it, the scheduler admits groups under the lag budget, finished
groups are decided by the staleness policy and batched, each batch is one trainer step that
publishes the next version and notifies the engines. The run ends after ``trainer.max_steps``
steps, or on SIGINT/SIGTERM, and in both cases every engine subprocess is stopped and reaped and
the trajectory log is closed cleanly.
"""

from __future__ import annotations

import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import anyio
import structlog

from environments.loader import load_environment
from orchestrator.batcher import Batcher
from orchestrator.config import Config
from orchestrator.episode import EpisodeRunner
from orchestrator.errors import ConfigError
from orchestrator.fleet import local_fleet
from orchestrator.pool import Endpoint, Pool
from orchestrator.scheduler import Scheduler, VersionClock
from orchestrator.trajlog import TrajectoryLog
from orchestrator.types import Batch, Group, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from environments.base import Environment
    from policies.trainer import Trainer, TrainSample

log = structlog.get_logger(__name__)


@dataclass
class RunSummary:
    run_dir: Path
    steps: int = 0
    episodes: int = 0
    dropped_groups: int = 0
    rewards: list[float] = field(default_factory=list)
    served: dict[str, dict[int, int]] = field(default_factory=dict)
    interrupted: bool = False
    seconds: float = 0.0

    def render(self) -> str:
        lines = [
            f"run dir:   {self.run_dir}",
            f"status:    {'interrupted' if self.interrupted else 'finished'} "
            f"in {self.seconds:.1f}s",
            f"steps:     {self.steps}",
            f"episodes:  {self.episodes} ({self.dropped_groups} groups dropped)",
            "reward:    " + (" → ".join(f"{r:.3f}" for r in self.rewards) or "n/a"),
        ]
        for ep, versions in sorted(self.served.items()):
            served = ", ".join(f"v{v}×{n}" for v, n in sorted(versions.items()))
            lines.append(f"{ep}: {served or 'no calls'}")
        return "\n".join(lines)


def ensure_model(cfg: Config) -> Path:
    """The model directory, built with sprawl's own generator when configured and missing."""
    path = cfg.model.path
    if (path / "config.json").exists():
        return path
    if cfg.model.init is None:
        raise ConfigError(
            f"model.path: {path} is not an HF model directory (and model.init "
            "is unset, so sprawl will not build one)"
        )
    from policies.modelgen import init_model

    log.info("building_model", path=str(path), size=cfg.model.init)
    return init_model(path, cfg.model.init, seed=cfg.run.seed)


def prepare_run_dir(cfg: Config) -> Path:
    run_dir = cfg.run_dir
    if run_dir.exists():
        if not cfg.run.overwrite:
            raise ConfigError(f"run.overwrite is false and {run_dir} exists")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return run_dir


def batch_samples(batch: Batch) -> list[TrainSample]:
    from policies.trainer import TrainSample

    samples = []
    for group in batch.groups:
        for ep in group.episodes:
            mask = [False] * len(ep.token_ids)
            behaviour = [0.0] * len(ep.token_ids)
            for seg in ep.segments:
                for j, lp in enumerate(seg.logprobs):
                    mask[seg.prompt_len + j] = True
                    behaviour[seg.prompt_len + j] = lp
            samples.append(
                TrainSample(
                    token_ids=ep.token_ids,
                    mask=mask,
                    behaviour_logprobs=behaviour,
                    reward=ep.reward,
                )
            )
    return samples


async def run(cfg: Config) -> RunSummary:
    """Run the loop described by ``cfg`` until ``trainer.max_steps`` or a signal."""
    from transformers import AutoTokenizer

    from policies.board import Board
    from policies.trainer import Trainer, TrainerSettings

    t0 = time.perf_counter()
    env = load_environment(cfg.environment.cls, cfg.environment.args)
    env.tool_timeout_s = cfg.timeouts.tool_s
    run_dir = prepare_run_dir(cfg)
    summary = RunSummary(run_dir=run_dir)
    model_dir = await anyio.to_thread.run_sync(ensure_model, cfg)
    board = Board(cfg.board_url, cfg.run.name)
    settings = TrainerSettings(
        lr=cfg.trainer.lr,
        weight_decay=cfg.trainer.weight_decay,
        master_dtype=cfg.trainer.master_dtype,
        served_dtype=cfg.trainer.served_dtype,
        clip_eps=cfg.trainer.clip_eps,
        grad_clip=cfg.trainer.grad_clip,
        temperature=cfg.sampling.temperature,
        group_size=cfg.scheduler.group_size,
        device=cfg.trainer.device,
        seed=cfg.run.seed,
    )
    trainer = await anyio.to_thread.run_sync(
        lambda: Trainer(model_dir, board, settings, cfg.staleness.correction)
    )
    await anyio.to_thread.run_sync(trainer.publish)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trajlog = TrajectoryLog(run_dir / "trajectories.jsonl")
    log.info("run_started", run_dir=str(run_dir), board=cfg.board_url)

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
                    max_inflight=cfg.fleet.max_inflight_per_endpoint,
                ) as local,
            ):
                remote = [
                    Endpoint(
                        id=f"remote-{i}",
                        url=e.url.rstrip("/"),
                        token=e.token,
                        weight=e.weight,
                        max_inflight=cfg.fleet.max_inflight_per_endpoint,
                    )
                    for i, e in enumerate(cfg.fleet.endpoints)
                ]
                pool = Pool(
                    local + remote,
                    session,
                    call_timeout_s=cfg.timeouts.call_s,
                    version_wait_s=cfg.timeouts.version_wait_s,
                    poll_interval_s=cfg.board.poll_interval_s,
                )
                try:
                    await _loop(
                        cfg,
                        pool,
                        env,
                        tokenizer,
                        trainer,
                        trajlog,
                        summary,
                        getattr(tokenizer, "model_max_length", 2048),
                    )
                finally:
                    summary.served = {e.id: dict(e.served) for e in pool.endpoints.values()}
        finally:
            trajlog.close()
            summary.seconds = time.perf_counter() - t0
        tg.cancel_scope.cancel()
    return summary


async def _loop(
    cfg: Config,
    pool: Pool,
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    trainer: Trainer,
    trajlog: TrajectoryLog,
    summary: RunSummary,
    model_max_length: int,
) -> None:
    clock = VersionClock(trainer.version)
    max_context = min(int(model_max_length), 2048)
    runner = EpisodeRunner(
        env,
        tokenizer,
        pool,
        sampling=SamplingParams(
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k,
            max_tokens=cfg.sampling.max_tokens,
        ),
        max_turns=cfg.environment.max_turns,
        episode_timeout_s=cfg.timeouts.episode_s,
        max_context=max_context,
    )
    sched = Scheduler(
        runner,
        env.tasks(),
        clock,
        group_size=cfg.scheduler.group_size,
        groups_per_batch=cfg.scheduler.groups_per_batch,
        max_lag=cfg.scheduler.max_lag,
        max_concurrent_episodes=cfg.scheduler.max_concurrent_episodes,
        seed=cfg.run.seed,
    )
    batcher = Batcher(cfg.staleness, cfg.scheduler.groups_per_batch, lambda: trainer.version)
    send, recv = anyio.create_memory_object_stream[Group](
        max_buffer_size=cfg.scheduler.groups_per_batch
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.watch)
        tg.start_soon(sched.run, send)
        async with recv:
            async for group in recv:
                decision, batch = batcher.add(group)
                trajlog.write_group(group, decision)
                summary.episodes += len(group.episodes)
                if decision.decision == "dropped":
                    summary.dropped_groups += 1
                    log.info("group_dropped", group=group.id, reason=decision.reason)
                    await sched.release_dropped(1)
                if batch is None:
                    continue
                samples = batch_samples(batch)
                metrics = await anyio.to_thread.run_sync(trainer.step, samples)
                trajlog.write_batch(batch, trainer.version, metrics)
                summary.steps += 1
                summary.rewards.append(metrics["reward_mean"])
                await clock.advance(trainer.version)
                await pool.notify_all()
                if trainer.version >= cfg.trainer.max_steps:
                    break
        tg.cancel_scope.cancel()


async def _cancel_on_signal(scope: anyio.CancelScope, summary: RunSummary) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.warning("shutting_down", signal=signal.Signals(signum).name)
            summary.interrupted = True
            scope.cancel()
            return
