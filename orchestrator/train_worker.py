"""``orchestrate train --config X``: the reference trainer as an external process.

It speaks the batch protocol (:mod:`policies.wire.batches`) exactly as any external trainer would:
publish version 0 on the board if it is empty, then for each version ``v`` wait for
``batch-<v>.json``, take the step, and publish ``v + 1``. Run the orchestrator with the same
config and ``trainer.mode = "external"``; the two share ``board.url`` and ``trainer.batch_dir``.
With ``trainer.mode = "feed"`` in the config it pulls batch ``v`` from the orchestrator's batch
feed instead (:class:`policies.wire.feed.FeedClient`, found through ``$SPRAWL_FEED_URL`` /
``$SPRAWL_FEED_TOKEN`` or ``<run dir>/feed.json``, waited for while the orchestrator starts) and
acknowledges it, with the step's metrics, once ``v + 1`` is published.

Restart after a crash: with ``trainer.checkpoint`` (the default) every step is checkpointed into
``<run dir>/trainer/ckpt`` before it is published. A trainer started on a board that already has
versions resumes from that checkpoint, republishes its version if the crash came between the
checkpoint and the publish, and continues with the batch of its version: batch files stay on
disk and the feed delivers an unacknowledged batch again, so a step the crash interrupted is taken
once, on restart (it had published nothing). A board ahead of the checkpoint (another run's, or no
checkpoint) is refused with :class:`~policies.errors.CheckpointError`. On an empty board it starts
from the model.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import structlog

from orchestrator.config import load_config, parse_overrides
from orchestrator.errors import ConfigError, TrainerError
from orchestrator.loop.train_sink import build_trainer
from orchestrator.models import ensure_model
from policies.errors import FeedUnavailable
from policies.wire.batches import BatchFile, read_batch
from policies.wire.feed import FEED_FILE, FeedClient
from policies.wire.logs import configure

log = structlog.get_logger(__name__)
T = TypeVar("T")

LAST_ACK_S = 60.0
"""How long the last step's acknowledgement is retried while the feed cannot be reached."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="orchestrate train",
        description="The reference trainer as an external process (batch files or feed + board).",
    )
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--log-format", choices=["auto", "pretty", "json"], default="auto")
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    cfg = load_config(args.config, overrides)
    if cfg.trainer.mode != "feed":
        cfg = load_config(args.config, {**overrides, "trainer.mode": "external"})
    if cfg.board.url is None:
        raise ConfigError(
            "board.url: set it (outside the run directory) so that the trainer "
            "and the orchestrator share one board"
        )
    configure(args.log_format, cfg.log.level)
    from policies.board import Board
    from policies.train.samples import TrainSample

    source: FeedSource | FileSource
    if cfg.trainer.mode == "feed":
        source = FeedSource(cfg.run_dir, cfg.board.poll_interval_s, cfg.timeouts.trainer_step_s)
    else:
        source = FileSource(
            cfg.trainer.batch_dir or cfg.run_dir / "batches", cfg.board.poll_interval_s
        )
    board = Board(cfg.board_url, cfg.run.name, options=cfg.board)
    model_dir = ensure_model(cfg)
    ckpt = cfg.run_dir / "trainer" / "ckpt" if cfg.trainer.checkpoint else None
    resume = ckpt is not None and board.latest() is not None
    trainer = build_trainer(cfg, model_dir, board, checkpoint_dir=ckpt, resume=resume)
    trainer.ensure_published()  # version 0 on a new board; the checkpoint's after a crash
    log.info("trainer_ready", version=trainer.version, source=source.where, resumed=resume)
    while trainer.version < cfg.trainer.max_steps:
        wire = source.batch(trainer.version)
        log.info("batch_received", version=wire.version, samples=len(wire.samples))
        samples = [TrainSample.from_wire(s) for s in wire.samples]
        metrics = trainer.step(samples)  # publishes version + 1: the announcement
        source.done(wire.version, metrics, last=trainer.version >= cfg.trainer.max_steps)
    return 0


class FileSource:
    """Batch files in ``directory`` (``trainer.mode = "external"``)."""

    def __init__(self, directory: Path, poll_s: float) -> None:
        self.directory = directory
        self.poll_s = poll_s
        self.where = str(directory)

    def batch(self, version: int) -> BatchFile:
        while (wire := read_batch(self.directory, version)) is None:
            time.sleep(self.poll_s)  # batch files arrive from another process
        return wire

    def done(self, version: int, metrics: dict[str, float], *, last: bool) -> None:
        """Nothing to say: the board's pointer is the announcement."""


class FeedSource:
    """The orchestrator's batch feed (``trainer.mode = "feed"``). While it cannot be reached (the
    orchestrator is starting) it is asked again every ``poll_s``, for at most ``give_up_s``
    (``timeouts.trainer_step_s``); the last step's acknowledgement for at most
    :data:`LAST_ACK_S`: the run may have ended with it (its reply lost as the feed closed), and a
    run still waiting counts the board's last version as the acknowledgement (``ACK_GRACE_S``)."""

    def __init__(self, run_dir: Path, poll_s: float, give_up_s: float) -> None:
        self.run_dir = run_dir
        self.poll_s = poll_s
        self.give_up_s = give_up_s
        self.where = str(run_dir / FEED_FILE)
        self._client: FeedClient | None = None

    def _retry(self, call: Callable[[FeedClient], T], give_up_s: float | None = None) -> T:
        give_up_s = self.give_up_s if give_up_s is None else give_up_s
        deadline = time.monotonic() + give_up_s
        while True:
            try:
                if self._client is None:  # (re)read feed.json: a restarted feed has a new port
                    self._client = FeedClient.discover(self.run_dir)
                return call(self._client)
            except FeedUnavailable as exc:
                self._client = None
                if time.monotonic() > deadline:
                    key = " (timeouts.trainer_step_s)" if give_up_s == self.give_up_s else ""
                    raise TrainerError(f"{exc}; gave up after {give_up_s}s{key}") from None
                time.sleep(self.poll_s)

    def batch(self, version: int) -> BatchFile:
        while (wire := self._retry(lambda c: c.next())) is None:
            pass  # a long poll that ended empty: ask again
        if wire.version != version:
            raise TrainerError(
                f"the batch feed sent batch {wire.version} but the trainer is at version "
                f"{version}: the trainer's checkpoint and the run disagree"
            )
        return wire

    def done(self, version: int, metrics: dict[str, float], *, last: bool) -> None:
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        if len(finite) < len(metrics):  # JSON has no NaN: said here, in the trainer's log
            log.warning("metrics_not_finite", metrics=sorted(set(metrics) - set(finite)))
        if not last:
            self._retry(lambda c: c.ack(version, finite))
            return
        try:
            self._retry(lambda c: c.ack(version, finite), min(self.give_up_s, LAST_ACK_S))
        except TrainerError as exc:  # the board's version is the announcement (class doc)
            log.warning("last_ack_undelivered", version=version, error=str(exc), metrics=finite)
