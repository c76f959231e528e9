"""The RL loop: the one wiring of scheduler → bounded stream → batcher → trainer sink.

:func:`rl_loop` is what the run, the simulator and the tests drive: the scheduler admits groups
and sends each finished group into a stream bounded at one batch (so a slow trainer
back-pressures admission), :func:`~orchestrator.loop.train_sink.consume` (for the batch feed,
:func:`~orchestrator.loop.feed_sink.consume_ahead`) decides, batches and trains until
``max_steps``, and services that must run beside the loop (the pool's health
watch, a live view, a test's fault injector) run in the same task group and are cancelled with
it.

Guarantees: when it returns or is cancelled, every group the scheduler admitted is accounted
for — trained or decided (through the recorder), or handed to ``on_stop`` as a leftover with its
reason (:data:`~orchestrator.record.events.STOPPED_UNTRAINED`: finished but not consumed;
:data:`~orchestrator.record.events.STOPPED_UNFINISHED`: still in flight), so the caller records
it as data. Not covered: groups still pending in the batcher (``batcher.pending``), or in
batches the feed's trainer has not acknowledged
(:meth:`~orchestrator.loop.feed_sink.FeedTrainer.unacknowledged`), are the caller's to name.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import anyio
import structlog

from orchestrator.loop.batcher import Batcher
from orchestrator.loop.feed_sink import FeedTrainer, consume_ahead
from orchestrator.loop.scheduler import Scheduler
from orchestrator.loop.train_sink import Recorder, TrainerSink, consume, drain
from orchestrator.record.events import STOPPED_UNFINISHED, STOPPED_UNTRAINED
from orchestrator.types import Group

log = structlog.get_logger(__name__)

Leftovers = list[tuple[Group, str]]


def log_in_flight(unfinished: Sequence[Group]) -> None:
    """One line for the groups a stop found in flight (each episode's own line is debug:
    ``episode_interrupted``); nothing when there were none."""
    if not unfinished:
        return
    n = sum(e.stop_reason == "interrupted" for g in unfinished for e in g.episodes)
    log.info(
        f"{len(unfinished)} groups in flight at stop: {n} episodes interrupted, "
        "recorded in the trajectory log",
        groups=len(unfinished),
        episodes_interrupted=n,
    )


async def rl_loop(
    scheduler: Scheduler,
    batcher: Batcher,
    sink: TrainerSink,
    recorder: Recorder,
    *,
    max_steps: int,
    on_version: Callable[[], Awaitable[None]] | None = None,
    beside: Sequence[Callable[[], Coroutine[Any, Any, object]]] = (),
    on_stop: Callable[[Leftovers], None] | None = None,
) -> None:
    """Train until ``sink`` reaches version ``max_steps``; ``on_version`` runs after each step
    (e.g. notify the endpoints), ``beside`` run until the loop ends, ``on_stop`` gets the groups
    left over when the loop ends (normally or cancelled)."""
    send, recv = anyio.create_memory_object_stream[Group](
        max_buffer_size=scheduler.groups_per_batch
    )
    try:
        async with anyio.create_task_group() as tg:
            for service in beside:
                tg.start_soon(service)
            tg.start_soon(scheduler.run, send)
            if isinstance(sink, FeedTrainer):  # batches ahead of it: trainer.feed.max_batches
                await consume_ahead(
                    recv,
                    batcher=batcher,
                    scheduler=scheduler,
                    sink=sink,
                    clock=scheduler.clock,
                    recorder=recorder,
                    max_steps=max_steps,
                    on_version=on_version,
                )
            else:
                await consume(
                    recv,
                    batcher=batcher,
                    scheduler=scheduler,
                    sink=sink,
                    clock=scheduler.clock,
                    recorder=recorder,
                    max_steps=max_steps,
                    on_version=on_version,
                )
            tg.cancel_scope.cancel()
    finally:
        leftovers = [(g, STOPPED_UNTRAINED) for g in drain(recv)]
        unfinished = scheduler.abandoned()
        leftovers += [(g, STOPPED_UNFINISHED) for g in unfinished]
        log_in_flight(unfinished)
        if on_stop is not None:
            on_stop(leftovers)
