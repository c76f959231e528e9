"""The feed's side of the trainer boundary: batches handed to the batch feed, ahead of the trainer.

:class:`FeedTrainer` is the run's :class:`~orchestrator.loop.train_sink.TrainerSink` in
``trainer.mode = "feed"``: it offers each batch on the :class:`~orchestrator.loop.feed.BatchFeed`
and waits for the trainer's acknowledgement. :func:`consume_ahead` is
:func:`~orchestrator.loop.train_sink.consume` for it, with up to ``trainer.feed.max_batches``
batches on the feed at once: while the trainer steps on batch ``v``, batches ``v + 1 …`` are
formed and offered, so the trainer finds its next batch ready.

Guarantees, on top of :func:`~orchestrator.loop.train_sink.consume`'s (every group recorded once,
every kept group in exactly one batch, or pending, or in a batch handed over and not
acknowledged when the run stops: :meth:`FeedTrainer.unacknowledged`, which the run lists in an
``unbatched`` event):

- batches are handed over in version order, each with ``trained_at_version`` the version it is
  trained at: the trainer's version plus the batches ahead of it on the feed
  (:attr:`FeedTrainer.next_version`, which the run's batcher reads);
- each group is decided, and recorded, against that same version, so a group's logged lag is its
  lag when it is trained, whatever the bound (``docs/staleness.md``); admission
  (``scheduler.max_lag``) is unchanged, so at most ``scheduler.max_lag + 1`` batches can be
  formed before the trainer acknowledges one;
- steps are recorded, and the version clock advanced, in version order as acknowledgements
  arrive; no batch at or past ``max_steps`` is formed;
- each acknowledgement is waited for at most ``timeouts.trainer_step_s`` from the moment the
  previous one was recorded (or the batch offered, if later): a :class:`TrainerError` naming it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from orchestrator.errors import TrainerError
from orchestrator.loop.batcher import Batcher
from orchestrator.loop.feed import BatchFeed
from orchestrator.loop.scheduler import Scheduler, VersionClock
from orchestrator.loop.train_sink import Recorder, take_group, wire_sample
from orchestrator.types import Batch, Group
from policies.wire.batches import BatchFile

if TYPE_CHECKING:
    from staleness.config import StalenessConfig


class FeedTrainer:
    """A trainer in another process or cluster, pulling batches over HTTP from the batch feed
    (:mod:`orchestrator.loop.feed`, served beside the run) and publishing on the board.

    :meth:`hand` offers a batch (waiting while the feed holds ``max_batches``), :meth:`trained`
    waits for its acknowledgement; :meth:`train` is both, one batch at a time.
    """

    def __init__(
        self,
        feed: BatchFeed,
        *,
        group_size: int,
        staleness: StalenessConfig,
        step_timeout_s: float,
    ) -> None:
        self.feed = feed
        self.group_size = group_size
        self.staleness = staleness
        self.step_timeout_s = step_timeout_s
        self.next_version = feed.version
        """The version the next batch handed over is trained at."""
        self._handed: dict[int, Batch] = {}

    @property
    def version(self) -> int:
        """The trainer's version: batches acknowledged (or shown trained by the board)."""
        return self.feed.version

    def unacknowledged(self) -> list[Batch]:
        """Batches handed over and not yet acknowledged, in version order."""
        return [self._handed[v] for v in sorted(self._handed)]

    async def hand(self, batch: Batch) -> None:
        """Offer ``batch`` (for :attr:`next_version`) on the feed, once it has room."""
        v = batch.trained_at_version
        if v != self.next_version:
            raise ValueError(f"batch for version {v} handed over; the next is {self.next_version}")
        samples = [wire_sample(ep) for g in batch.groups for ep in g.episodes]
        wire = BatchFile(
            version=v,
            group_size=self.group_size,
            samples=samples,
            staleness=self.staleness.model_dump(mode="json"),
        )
        self.next_version += 1
        self._handed[v] = batch
        await self.feed.offer(wire)

    async def trained(self, batch: Batch) -> dict[str, float]:
        """Wait until the trainer acknowledged ``batch`` (handed over before); its metrics."""
        v = batch.trained_at_version
        try:
            with anyio.fail_after(self.step_timeout_s):
                metrics = await self.feed.done(v)
        except TimeoutError:
            raise TrainerError(
                f"the trainer did not acknowledge batch {v} (publish version {v + 1}, then "
                f"POST /v1/batches/{v}/ack) within {self.step_timeout_s}s "
                "(timeouts.trainer_step_s)"
            ) from None
        del self._handed[v]
        rewards = [ep.reward for g in batch.groups for ep in g.episodes]
        metrics.setdefault("reward_mean", sum(rewards) / max(len(rewards), 1))
        return metrics

    async def train(self, batch: Batch) -> dict[str, float]:
        await self.hand(batch)
        return await self.trained(batch)


async def consume_ahead(
    groups: MemoryObjectReceiveStream[Group],
    *,
    batcher: Batcher,
    scheduler: Scheduler,
    sink: FeedTrainer,
    clock: VersionClock,
    recorder: Recorder,
    max_steps: int,
    on_version: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Train until ``sink`` reaches version ``max_steps`` (or the stream closes), with batches
    handed over ahead of the trainer (module docstring); ``batcher`` must read
    ``sink.next_version`` as its trainer version."""
    send, handed = anyio.create_memory_object_stream[Batch](max_buffer_size=sink.feed.capacity)

    async def follow() -> None:
        async with handed:
            async for batch in handed:
                metrics = await sink.trained(batch)
                version = batch.trained_at_version + 1
                with anyio.CancelScope(shield=True):  # a trained batch is always recorded
                    await recorder.step(batch, version, metrics)
                await clock.advance(version)
                if on_version is not None:
                    await on_version()

    async def hand(batch: Batch) -> bool:
        """Hand ``batch`` over; True when it is the last one ``max_steps`` allows."""
        await sink.hand(batch)
        await send.send(batch)
        return batch.trained_at_version + 1 >= max_steps

    async def produce() -> None:
        if sink.next_version >= max_steps:
            return
        while (restored := batcher.take()) is not None:  # groups restored by a resumed run
            if await hand(restored):
                return
        async for group in groups:
            batch = await take_group(
                group,
                batcher=batcher,
                scheduler=scheduler,
                recorder=recorder,
                version=sink.next_version,
            )
            if batch is not None and await hand(batch):
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(follow)
        async with send:
            await produce()
