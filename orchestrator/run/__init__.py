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

The pieces, each opened by :func:`run` in this order:

- :mod:`~orchestrator.run.environments` — the environments and their chats;
- :mod:`~orchestrator.run.run_dir` — the run directory, fresh or resumed;
- :mod:`~orchestrator.run.trainer` — the trainer the run feeds, once version 0 is published;
- :mod:`~orchestrator.run.fleet` — the fleet and the pool over it, opened and closed in one place;
- :mod:`~orchestrator.run.wiring` — the loop around :func:`~orchestrator.loop.rl.rl_loop`, and
  the recorder of what it produces.

Beside them, :mod:`~orchestrator.run.score` scores a run's newest version on fresh episodes with
the same fleet and episode runners, training nothing (the lag experiment's final-policy reward).
"""

from __future__ import annotations

import signal
import time

import anyio
import structlog

from orchestrator.config import Config
from orchestrator.models import ensure_model
from orchestrator.observe.live import LiveView
from orchestrator.observe.live import wanted as live_wanted
from orchestrator.observe.metrics import RunMetrics, Tee
from orchestrator.observe.summary import RunSummary
from orchestrator.record import resume
from orchestrator.record.events import EventLog
from orchestrator.record.trajlog import TrajectoryLog
from orchestrator.run.environments import load_environments, model_chats
from orchestrator.run.fleet import open_fleet
from orchestrator.run.run_dir import prepare_run_dir
from orchestrator.run.trainer import trainer_sink
from orchestrator.run.wiring import RunLoop

log = structlog.get_logger(__name__)


async def run(cfg: Config) -> RunSummary:
    """Run the loop described by ``cfg`` until ``trainer.max_steps`` or a signal."""
    from transformers import AutoTokenizer

    from policies.board import Board

    t0 = time.perf_counter()
    envs = load_environments(cfg)
    run_dir = prepare_run_dir(cfg)
    logged = resume.read_run(run_dir) if cfg.run.resume else None
    summary = RunSummary(run_dir=run_dir)
    model_dir = await anyio.to_thread.run_sync(ensure_model, cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # before any engine starts: a template sprawl cannot bridge stops the run here
    chats = model_chats(cfg, model_dir, tokenizer, envs)
    board = Board(cfg.board_url, cfg.run.name, options=cfg.board)
    sink = await trainer_sink(cfg, run_dir, model_dir, board, logged)
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

    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_signal, tg.cancel_scope, summary)
        try:
            async with open_fleet(cfg, model_dir, events) as fleet:
                pool = fleet.pool
                loop = RunLoop(cfg, pool, envs, chats, sink, trajlog, summary, events, rec)
                try:
                    await loop.run(metrics, view, fleet.supervise, fleet.scaler)
                finally:
                    summary.served = {e.id: dict(e.served) for e in pool.endpoints.values()}
        finally:
            trajlog.close()
            summary.seconds = time.perf_counter() - t0
        tg.cancel_scope.cancel()
    if logged is not None:  # resumed: the whole run, from the logs now closed
        summary.cover(await anyio.to_thread.run_sync(resume.read_run, run_dir))
    return summary


async def _cancel_on_signal(scope: anyio.CancelScope, summary: RunSummary) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.warning("shutting_down", signal=signal.Signals(signum).name)
            summary.interrupted = True
            scope.cancel()
            return
