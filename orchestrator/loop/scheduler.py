"""The scheduler: admits GRPO groups under the lag budget and runs their episodes.

Admission (the AReaL rule): with trainer version ``v``, ``B`` groups per batch and lag budget
``max_lag``, a new group starts only while fewer than ``(v + 1 + max_lag) · B`` groups that can
still be trained have been admitted; a group dropped by the staleness policy gives its slot back.
So no admitted group is trained more than ``max_lag`` versions after the version it was admitted
at, unless the staleness policy drops it. ``max_lag = 0`` is synchronous RL. Every model call
carries ``policy_version.min = max(v − max_lag, a)`` for the trainer version ``v`` at the time of
the call and the version ``a`` its group was admitted at: since the group is trained at version
``a + max_lag`` at the latest (unless later groups overtake it), no token it samples can lag more
than ``max_lag`` — the looser ``v − max_lag`` alone would allow up to twice that.

Episodes of a group run concurrently under a global cap (``max_concurrent_episodes``); a finished
group is sent downstream through a bounded stream, so a slow trainer back-pressures admission.
The scheduler never drops a group itself: every admitted group is sent downstream exactly once,
whatever its episodes' stop reasons — or, when the run is cancelled first, is listed by
:meth:`Scheduler.abandoned` with its finished and interrupted episodes.

Requeue (``staleness.length_bias.requeue``): :meth:`Scheduler.requeue` puts the task of a group the
staleness policy dropped back in front of the task stream; it is admitted next, under the same
budget (the dropped group's slot is given back), as a new group (the next index, a fresh seed) at
the trainer version of its admission, its ``admit`` event naming ``requeued_from``. A task is
re-run at most ``max_requeues`` times along one chain of drops. Not covered: a requeue still
waiting for admission when the run stops or is killed is not run (the drop is recorded).

Mixture (``[[environments]]``): each new group's environment is the next pick of
:func:`~orchestrator.loop.mixture.weighted_picks` over the sources' weights, and its task the
next of that environment's own seeded task stream; a re-run keeps its group's environment. Group
ids number admissions across all environments, so they stay unique; a resumed run replays the
picks of the admissions before the restart, so every environment's stream continues where it
stopped.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import anyio
import structlog
from anyio.streams.memory import MemoryObjectSendStream
from datasets import Dataset

from orchestrator.loop.episode import EpisodeRunner
from orchestrator.loop.mixture import Source, picks_so_far, weighted_picks
from orchestrator.types import NULL_EVENTS, Episode, EventSink, Group
from policies.wire.lane import VersionBounds

log = structlog.get_logger(__name__)


@dataclass
class _Flight:
    """An admitted group until it is delivered downstream."""

    task_id: str
    admitted_at: int
    episodes: list[Episode | None]
    source: int = 0


class VersionClock:
    """The trainer version, observable: waiters wake when it moves (each move is a
    ``trainer_version`` event)."""

    def __init__(self, version: int = 0, *, events: EventSink = NULL_EVENTS) -> None:
        self.version = version
        self.events = events
        self._changed = anyio.Condition()

    async def advance(self, version: int) -> None:
        async with self._changed:
            self.version = version
            self.events.emit("trainer_version", version=version)
            self._changed.notify_all()

    async def changed(self) -> None:
        """Block until the version or the admission budget changes."""
        async with self._changed:
            await self._changed.wait()

    async def poke(self) -> None:
        async with self._changed:
            self._changed.notify_all()


class Scheduler:
    """Admits GRPO groups under the lag budget and runs their episodes (module docstring).

    :meth:`run` admits group after group while :meth:`budget` allows, runs each group's
    episodes through the :class:`~orchestrator.loop.episode.EpisodeRunner` with the version
    bounds of the moment, and sends every finished group into the stream exactly once;
    :meth:`release_dropped` gives a dropped group's slot back; :meth:`abandoned` lists what was
    in flight when the run was cancelled. Admissions go to ``events`` (durably).
    """

    def __init__(
        self,
        runner: EpisodeRunner | None,
        tasks: Dataset | None,
        clock: VersionClock,
        *,
        group_size: int,
        groups_per_batch: int,
        max_lag: int,
        max_concurrent_episodes: int,
        seed: int,
        first_index: int = 0,
        dropped: int = 0,
        requeue_depth: Mapping[str, int] | None = None,
        max_requeues: int = 0,
        events: EventSink = NULL_EVENTS,
        sources: Sequence[Source] = (),
    ) -> None:
        """``sources``: the environments of a mixture (then ``runner`` and ``tasks`` are unused);
        without them, ``runner`` runs the episodes of ``tasks``, the one environment.
        ``first_index``, ``dropped`` and ``requeue_depth`` continue a resumed run
        (:mod:`orchestrator.record.resume`): groups ``0 … first_index − 1`` were admitted before the
        restart (group ids are never reused, and the tasks of those that were not re-runs — not in
        ``requeue_depth``, re-run group → re-runs along its chain — are skipped in the seeded task
        stream), and ``dropped`` of them will never be trained, so their admission slots are free.
        ``max_requeues``: how often :meth:`requeue` may re-run one task (0: never)."""
        if not sources:
            if tasks is None:
                raise ValueError("Scheduler: give runner and tasks, or sources")
            name = runner.name if runner is not None else ""
            sources = [Source(name, cast("EpisodeRunner", runner), tasks)]
        self.sources = list(sources)
        self._by_name = {s.name: i for i, s in enumerate(self.sources)}
        self.runner = self.sources[0].runner
        self.events = events
        self.tasks = self.sources[0].tasks
        self.clock = clock
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.max_lag = max_lag
        self.limiter = anyio.CapacityLimiter(max_concurrent_episodes)
        self.seed = seed
        self.first_index = first_index
        self.admitted = first_index  # every index below first_index was admitted
        self.dropped = dropped
        self._in_flight: dict[str, _Flight] = {}
        self._depth = dict(requeue_depth or {})  # re-run group -> re-runs along its chain
        self.requeued = len(self._depth)  # admissions that took no task of the stream
        self.max_requeues = max_requeues
        # (source, task id, from group, depth)
        self._requeue: deque[tuple[int, str, str, int]] = deque()
        self._task_rows: dict[int, dict[str, int]] = {}

    def abandoned(self) -> list[Group]:
        """Admitted groups that never finished (the run was cancelled first), whole: finished
        episodes, the runner's interrupted ones, and ``interrupted`` records for episodes that
        never started."""
        interrupted = {ep.id: ep for s in self.sources for ep in s.runner.interrupted}
        now = time.time()
        groups = []
        for gid, flight in self._in_flight.items():
            episodes = []
            for i, ep in enumerate(flight.episodes):
                eid = f"{gid}-{i}"
                episodes.append(
                    ep
                    or interrupted.get(eid)
                    or Episode(
                        id=eid,
                        group_id=gid,
                        task_id=flight.task_id,
                        environment=self.sources[flight.source].name,
                        token_ids=[],
                        prompt_len=0,
                        stop_reason="interrupted",
                        admitted_at_version=flight.admitted_at,
                        started_at=now,
                        finished_at=now,
                    )
                )
            groups.append(Group(id=gid, task_id=flight.task_id, episodes=episodes))
        return groups

    def budget(self) -> int:
        """Groups that may be admitted in total at the current trainer version."""
        return (self.clock.version + 1 + self.max_lag) * self.groups_per_batch + self.dropped

    async def release_dropped(self, n: int) -> None:
        """A downstream stage dropped ``n`` groups: their admission slots are free again."""
        self.dropped += n
        self.events.emit("release", n=n)
        await self.clock.poke()

    def requeue(self, group: Group) -> bool:
        """Re-run the task of ``group``, which the staleness policy dropped, unless its chain has
        been re-run ``max_requeues`` times already; True when queued (emits ``requeue``). The
        caller still releases the dropped group's slot (:meth:`release_dropped`)."""
        depth = self._depth.get(group.id, 0) + 1
        if depth > self.max_requeues:
            return False
        source = self._by_name.get(group.episodes[0].environment, 0) if group.episodes else 0
        self._requeue.append((source, group.task_id, group.id, depth))
        self.events.emit("requeue", group_id=group.id, task_id=group.task_id, depth=depth)
        log.info("group_requeued", group=group.id, task=group.task_id, depth=depth)
        return True

    def _task(self, source: int, task_id: str) -> dict[str, Any]:
        tasks = self.sources[source].tasks
        if source not in self._task_rows:  # built on the first requeue only
            self._task_rows[source] = {str(t): i for i, t in enumerate(tasks["id"])}
        row: dict[str, Any] = tasks[self._task_rows[source][task_id]]
        return row

    def bounds(self, admitted_at: int) -> VersionBounds:
        """Bounds of a call made now by a group admitted at ``admitted_at``."""
        return VersionBounds(min=max(admitted_at, self.clock.version - self.max_lag))

    def _task_stream(self) -> Iterator[dict[str, Any]]:
        """The tasks of :meth:`_mixed_stream`, without their sources."""
        return (task for _, task in self._mixed_stream())

    def _mixed_stream(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(source, task) from stream position ``first_index − requeued`` (as of this call:
        re-runs admitted later take no task) on, in the same order a fresh run would see them:
        the weighted picks of the admissions before are replayed, and each source's own stream
        skips the tasks its picks consumed."""
        done = self.first_index - self.requeued
        weights = [s.weight for s in self.sources]
        picks = weighted_picks(weights)
        for _ in range(done):
            next(picks)
        streams = []
        for source, taken in zip(self.sources, picks_so_far(weights, done), strict=True):
            n = len(source.tasks)
            first_epoch, skip = divmod(taken, n) if n else (0, 0)
            streams.append(self._tasks_from(source.tasks, first_epoch, skip))
        for i in picks:
            yield i, next(streams[i])

    def _tasks_from(self, tasks: Dataset, first_epoch: int, skip: int) -> Iterator[dict[str, Any]]:
        n = len(tasks)
        for epoch in itertools.count(first_epoch):
            order = tasks.shuffle(seed=self.seed + epoch)
            yield from order.select(range(skip, n)) if skip else order
            skip = 0

    async def run(self, out: MemoryObjectSendStream[Group]) -> None:
        """Admit and run groups until cancelled, sending each finished group to ``out``."""
        stream = self._mixed_stream()
        async with out, anyio.create_task_group() as tg:
            for n in itertools.count(self.first_index):
                while self.admitted >= self.budget():
                    await self.clock.changed()
                source: str | None = None
                if self._requeue:  # a dropped group's task goes before new ones
                    src, task_id, source, depth = self._requeue.popleft()
                    task = self._task(src, task_id)
                    self._depth[f"g{n:06d}"] = depth
                    self.requeued += 1
                else:
                    src, task = next(stream)
                self.admitted += 1
                group_id = f"g{n:06d}"
                # durable before the group's first model call (the event log flushes on
                # admit): the exactly-once accounting (orchestrator/record/accounting.py)
                # relies on it
                self.events.emit(
                    "admit",
                    index=n,
                    group_id=group_id,
                    task_id=str(task["id"]),
                    environment=self.sources[src].name,
                    admitted=self.admitted,
                    budget=self.budget(),
                    **({"requeued_from": source} if source is not None else {}),
                )
                # Registered before the task starts, so a group cancelled before it ran is
                # still accounted for by abandoned().
                self._in_flight[group_id] = _Flight(
                    str(task["id"]), self.clock.version, [None] * self.group_size, src
                )
                tg.start_soon(self._group, task, n, self.clock.version, out)

    async def _group(
        self, task: dict[str, Any], index: int, admitted_at: int, out: MemoryObjectSendStream[Group]
    ) -> None:
        group_id = f"g{index:06d}"
        flight = self._in_flight[group_id]
        episodes = flight.episodes
        runner = self.sources[flight.source].runner

        async def one(i: int) -> None:
            async with self.limiter:
                episodes[i] = await runner.run(
                    task,
                    group_id,
                    lambda: self.bounds(admitted_at),
                    admitted_at,
                    seed=(self.seed * 1_000_003 + index * self.group_size + i) % 2**31,
                    episode_id=f"{group_id}-{i}",
                )

        env = self.sources[flight.source].name
        with structlog.contextvars.bound_contextvars(group=group_id, environment=env):
            async with anyio.create_task_group() as tg:
                for i in range(self.group_size):
                    tg.start_soon(one, i)
        done = [e for e in episodes if e is not None]
        await out.send(Group(id=group_id, task_id=flight.task_id, episodes=done))
        del self._in_flight[group_id]  # only once delivered: a cancelled send is abandoned()
