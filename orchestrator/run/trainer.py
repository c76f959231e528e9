"""The trainer the run feeds: in this process, or external behind batch files or the batch feed.

:func:`trainer_sink` returns once the trainer's first version is on the board: the in-process
trainer publishes version 0 (or, resumed, makes sure its checkpoint's version is published); an
external trainer is waited for, at most ``timeouts.trainer_step_s``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import structlog

from orchestrator.config import Config
from orchestrator.loop.feed import BatchFeed
from orchestrator.loop.feed_sink import FeedTrainer
from orchestrator.loop.train_sink import (
    ExternalTrainer,
    InProcessTrainer,
    TrainerSink,
    board_version_above,
    build_trainer,
)
from orchestrator.record import resume

if TYPE_CHECKING:
    from policies.board import Board

log = structlog.get_logger(__name__)


async def trainer_sink(
    cfg: Config, run_dir: Path, model_dir: Path, board: Board, logged: resume.LoggedRun | None
) -> TrainerSink:
    """The in-process reference trainer (publishes version 0 now, or resumes from its
    checkpoint), or an external trainer reached through batch files or the batch feed (waits for
    it to publish version 0, or the version a resumed run continues from)."""
    if cfg.trainer.mode == "feed":
        # resumed: the board shows at least the last batch record's version (each is written
        # after its acknowledgement); one more if the trainer finished the batch it held
        wanted = logged.last_version if logged else 0
        log.info("waiting_for_external_trainer", feed=str(run_dir / "feed.json"), version=wanted)
        with anyio.fail_after(cfg.timeouts.trainer_step_s):
            latest = await board_version_above(board, wanted - 1, cfg.board.poll_interval_s)
        feed = BatchFeed(
            version=latest, board_latest=board.latest, capacity=cfg.trainer.feed.max_batches
        )
        return FeedTrainer(
            feed,
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
