"""``orchestrate train --config X``: the reference trainer as an external process.

It speaks the batch protocol (:mod:`policies.wire.batches`) exactly as any external trainer would:
publish version 0 on the board if it is empty, then for each version ``v`` wait for
``batch-<v>.json``, take the step, and publish ``v + 1``. Run the orchestrator with the same
config and ``trainer.mode = "external"``; the two share ``board.url`` and ``trainer.batch_dir``.

Restart after a crash: with ``trainer.checkpoint`` (the default) every step is checkpointed into
``<run dir>/trainer/ckpt`` before it is published. A trainer started on a board that already has
versions resumes from that checkpoint, republishes its version if the crash came between the
checkpoint and the publish, and continues with the batch file of its version: batch files stay on
disk, so a step the crash interrupted is taken once, on restart (it had published nothing). A
board ahead of the checkpoint (another run's, or no checkpoint) is refused with
:class:`~policies.errors.CheckpointError`. On an empty board it starts from the model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import structlog

from orchestrator.config import load_config, parse_overrides
from orchestrator.errors import ConfigError
from orchestrator.loop.train_sink import build_trainer
from orchestrator.models import ensure_model
from policies.wire.batches import BatchFile, read_batch
from policies.wire.logs import configure

log = structlog.get_logger(__name__)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="orchestrate train",
        description="The reference trainer as an external process (batch files + board).",
    )
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--log-format", choices=["auto", "pretty", "json"], default="auto")
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(args.config, {**parse_overrides(rest), "trainer.mode": "external"})
    if cfg.board.url is None:
        raise ConfigError(
            "board.url: set it (outside the run directory) so that the trainer "
            "and the orchestrator share one board"
        )
    configure(args.log_format, cfg.log.level)
    from policies.board import Board
    from policies.train.trainer import TrainSample

    batch_dir = cfg.trainer.batch_dir or cfg.run_dir / "batches"
    board = Board(cfg.board_url, cfg.run.name, options=cfg.board)
    model_dir = ensure_model(cfg)
    ckpt = cfg.run_dir / "trainer" / "ckpt" if cfg.trainer.checkpoint else None
    resume = ckpt is not None and board.latest() is not None
    trainer = build_trainer(cfg, model_dir, board, checkpoint_dir=ckpt, resume=resume)
    trainer.ensure_published()  # version 0 on a new board; the checkpoint's after a crash
    log.info("trainer_ready", version=trainer.version, batch_dir=str(batch_dir), resumed=resume)
    while trainer.version < cfg.trainer.max_steps:
        wire = _wait_for_batch(batch_dir, trainer.version, cfg.board.poll_interval_s)
        samples = [
            TrainSample(
                token_ids=s.token_ids,
                mask=s.mask,
                behaviour_logprobs=s.behaviour_logprobs,
                reward=s.reward,
            )
            for s in wire.samples
        ]
        trainer.step(samples)  # publishes version + 1: the announcement
    return 0


def _wait_for_batch(directory: Path, version: int, poll_s: float) -> BatchFile:
    while (wire := read_batch(directory, version)) is None:
        time.sleep(poll_s)  # batch files arrive from another process
    return wire
