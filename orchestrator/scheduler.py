"""The scheduler: admits GRPO groups under the lag budget and runs their episodes.

Admission (the AReaL rule): with trainer version ``v``, ``B`` groups per batch and lag budget
``max_lag``, a new group starts only while fewer than ``(v + 1 + max_lag) · B`` groups that can
still be trained have been admitted; a group dropped by the staleness policy gives its slot back.
So no admitted group is trained more than ``max_lag`` versions after the version it was admitted
at, unless the staleness policy drops it. ``max_lag = 0`` is synchronous RL. Every model call
carries ``policy_version.min = v − max_lag`` for the trainer version ``v`` at the time of the call.

Episodes of a group run concurrently under a global cap (``max_concurrent_episodes``); a finished
group is sent downstream through a bounded stream, so a slow trainer back-pressures admission.
The scheduler never drops a group itself: every admitted group is sent downstream exactly once,
whatever its episodes' stop reasons.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectSendStream
from datasets import Dataset

from orchestrator.episode import EpisodeRunner
from orchestrator.types import Episode, Group
from policies.lane import VersionBounds

log = structlog.get_logger(__name__)


class VersionClock:
    """The trainer version, observable: waiters wake when it moves."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._changed = anyio.Condition()

    async def advance(self, version: int) -> None:
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def changed(self) -> None:
        """Block until the version or the admission budget changes."""
        async with self._changed:
            await self._changed.wait()

    async def poke(self) -> None:
        async with self._changed:
            self._changed.notify_all()


class Scheduler:
    def __init__(
        self,
        runner: EpisodeRunner,
        tasks: Dataset,
        clock: VersionClock,
        *,
        group_size: int,
        groups_per_batch: int,
        max_lag: int,
        max_concurrent_episodes: int,
        seed: int,
    ) -> None:
        self.runner = runner
        self.tasks = tasks
        self.clock = clock
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.max_lag = max_lag
        self.limiter = anyio.CapacityLimiter(max_concurrent_episodes)
        self.seed = seed
        self.admitted = 0
        self.dropped = 0

    def budget(self) -> int:
        """Groups that may be admitted in total at the current trainer version."""
        return (self.clock.version + 1 + self.max_lag) * self.groups_per_batch + self.dropped

    async def release_dropped(self, n: int) -> None:
        """A downstream stage dropped ``n`` groups: their admission slots are free again."""
        self.dropped += n
        await self.clock.poke()

    def bounds(self) -> VersionBounds:
        return VersionBounds(min=max(0, self.clock.version - self.max_lag))

    def _task_stream(self) -> Iterator[dict[str, Any]]:
        for epoch in itertools.count():
            order = self.tasks.shuffle(seed=self.seed + epoch)
            yield from order

    async def run(self, out: MemoryObjectSendStream[Group]) -> None:
        """Admit and run groups until cancelled, sending each finished group to ``out``."""
        async with out, anyio.create_task_group() as tg:
            for n, task in enumerate(self._task_stream()):
                while self.admitted >= self.budget():
                    await self.clock.changed()
                self.admitted += 1
                tg.start_soon(self._group, task, n, self.clock.version, out.clone())

    async def _group(
        self, task: dict[str, Any], index: int, admitted_at: int, out: MemoryObjectSendStream[Group]
    ) -> None:
        group_id = f"g{index:06d}"
        episodes: list[Episode | None] = [None] * self.group_size

        async def one(i: int) -> None:
            async with self.limiter:
                episodes[i] = await self.runner.run(
                    task,
                    group_id,
                    self.bounds,
                    admitted_at,
                    seed=(self.seed * 1_000_003 + index * self.group_size + i) % 2**31,
                )

        with structlog.contextvars.bound_contextvars(group=group_id):
            async with anyio.create_task_group() as tg:
                for i in range(self.group_size):
                    tg.start_soon(one, i)
            done = [e for e in episodes if e is not None]
            async with out:
                await out.send(Group(id=group_id, task_id=str(task["id"]), episodes=done))
