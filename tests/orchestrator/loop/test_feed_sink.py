"""The feed's sink: batches handed over ahead of the trainer (``trainer.feed.max_batches``), each
decided and recorded at the version it is trained at, steps recorded in order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from orchestrator.loop.batcher import Batcher
from orchestrator.loop.feed import BatchFeed
from orchestrator.loop.feed_sink import FeedTrainer, consume_ahead
from orchestrator.loop.scheduler import VersionClock
from orchestrator.run.wiring import RunLoop
from orchestrator.types import Batch, Group, GroupDecision
from policies.board import Board
from policies.wire.batches import BatchFile
from staleness.config import DropRule, StalenessConfig
from tests.support.trajectories import two_token_episode

pytestmark = pytest.mark.anyio


class RecordingFeed(BatchFeed):
    """The feed, with every offer's version recorded and announced."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.offered: list[int] = []
        self.offer_made = anyio.Event()

    async def offer(self, batch: BatchFile) -> None:
        await super().offer(batch)
        self.offered.append(batch.version)
        self.offer_made.set()
        self.offer_made = anyio.Event()


class Recorder:
    def __init__(self) -> None:
        self.groups: list[tuple[str, str, int, int]] = []  # id, decision, lag, version
        self.steps: list[tuple[int, int, list[str]]] = []  # trained at, produced, groups

    def group(self, group: Group, decision: GroupDecision, trainer_version: int) -> None:
        self.groups.append((group.id, decision.decision, decision.max_lag, trainer_version))

    async def step(self, batch: Batch, version: int, metrics: dict[str, float]) -> None:
        self.steps.append((batch.trained_at_version, version, [g.id for g in batch.groups]))


class Slots:
    """The scheduler's side of a drop: slots given back."""

    def __init__(self) -> None:
        self.released = 0

    async def release_dropped(self, n: int) -> None:
        self.released += n


def _group(i: int) -> Group:
    """Group ``g<i>``: two episodes whose one model call was made at version 0."""
    gid = f"g{i}"
    episodes = [
        two_token_episode(j, 1.0).model_copy(update={"id": f"{gid}-{j}", "group_id": gid})
        for j in range(2)
    ]
    return Group(id=gid, task_id=f"t{i}", episodes=episodes)


def _publish(board: Board, version: int) -> None:
    board.publish(version, {"w": torch.full((2,), float(version))}, view_name="float32")


def _setup(
    tmp_path: Path, capacity: int, drop_lag: int = 1
) -> tuple[Board, RecordingFeed, FeedTrainer, Batcher]:
    board = Board(str(tmp_path / "board"), "run")
    _publish(board, 0)
    feed = RecordingFeed(version=0, board_latest=board.latest, capacity=capacity)
    staleness = StalenessConfig(drop=DropRule(max_lag=drop_lag))
    sink = FeedTrainer(feed, group_size=2, staleness=staleness, step_timeout_s=30)
    batcher = Batcher(staleness, 2, 1, lambda: sink.next_version)
    return board, feed, sink, batcher


async def _train(board: Board, feed: BatchFeed, version: int) -> None:
    """The trainer's step on batch ``version``: take it, publish ``version + 1``, acknowledge."""
    body = await feed.next(10)
    assert body is not None
    assert BatchFile.model_validate_json(body).version == version
    await anyio.to_thread.run_sync(_publish, board, version + 1)
    await feed.ack(version, {"loss": float(version)})


async def test_batches_go_ahead_of_the_trainer_each_decided_at_its_own_version(
    tmp_path: Path,
) -> None:
    board, feed, sink, batcher = _setup(tmp_path, capacity=2)
    send, groups = anyio.create_memory_object_stream[Group](8)
    for i in range(6):
        send.send_nowait(_group(i))
    send.close()
    recorder, slots, clock = Recorder(), Slots(), VersionClock(0)
    with send, groups, anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: consume_ahead(
                    groups,
                    batcher=batcher,
                    scheduler=slots,  # type: ignore[arg-type]  # only slots are given back
                    sink=sink,
                    clock=clock,
                    recorder=recorder,
                    max_steps=4,
                )
            )
            while feed.offered != [0, 1]:
                await feed.offer_made.wait()
            assert feed.version == 0  # batch 1 is out before the trainer took batch 0
            assert [b.trained_at_version for b in sink.unacknowledged()] == [0, 1]
            await _train(board, feed, 0)
            await _train(board, feed, 1)
    # g4 and g5 would be trained at version 2: lag 2 > drop.max_lag, though the trainer was at 0
    assert recorder.groups == [
        ("g0", "kept", 0, 0),
        ("g1", "kept", 0, 0),
        ("g2", "kept", 1, 1),
        ("g3", "kept", 1, 1),
        ("g4", "dropped", 2, 2),
        ("g5", "dropped", 2, 2),
    ]
    assert slots.released == 2
    assert recorder.steps == [(0, 1, ["g0", "g1"]), (1, 2, ["g2", "g3"])]
    assert (clock.version, sink.version, sink.unacknowledged()) == (2, 2, [])


async def test_no_batch_is_formed_past_max_steps_and_the_bound_holds(tmp_path: Path) -> None:
    board, feed, sink, batcher = _setup(tmp_path, capacity=2, drop_lag=4)
    send, groups = anyio.create_memory_object_stream[Group](8)
    for i in range(8):
        send.send_nowait(_group(i))
    with send, groups, anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: consume_ahead(
                    groups,
                    batcher=batcher,
                    scheduler=Slots(),  # type: ignore[arg-type]
                    sink=sink,
                    clock=VersionClock(0),
                    recorder=Recorder(),
                    max_steps=3,
                )
            )
            while feed.offered != [0, 1]:
                await feed.offer_made.wait()
            await anyio.wait_all_tasks_blocked()
            assert (feed.offered, feed.held) == ([0, 1], 2)  # batch 2 waits for room
            assert sink.next_version == 3
            await _train(board, feed, 0)
            while feed.offered != [0, 1, 2]:
                await feed.offer_made.wait()
            await _train(board, feed, 1)
            await _train(board, feed, 2)
        assert feed.offered == [0, 1, 2]  # batch 3 would be past max_steps: never formed
        assert groups.receive_nowait().id == "g6"  # left in the stream: the run's leftovers


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.emitted.append((kind, fields))


async def test_batches_out_when_the_run_stops_are_listed_unbatched(tmp_path: Path) -> None:
    """Stopped (not killed) with batches on the feed: their groups are kept, recorded and in no
    batch record, so the run names them in an ``unbatched`` event (the accounting's rule)."""
    _, feed, sink, batcher = _setup(tmp_path, capacity=2)
    send, groups = anyio.create_memory_object_stream[Group](8)
    for i in range(4):
        send.send_nowait(_group(i))
    with send, groups, anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: consume_ahead(
                    groups,
                    batcher=batcher,
                    scheduler=Slots(),  # type: ignore[arg-type]
                    sink=sink,
                    clock=VersionClock(0),
                    recorder=Recorder(),
                    max_steps=4,
                )
            )
            while feed.offered != [0, 1]:
                await feed.offer_made.wait()
            tg.cancel_scope.cancel()  # a stop, with two batches on the feed
    out = [[g.id for g in b.groups] for b in sink.unacknowledged()]
    assert out == [["g0", "g1"], ["g2", "g3"]]
    run, events = object.__new__(RunLoop), Events()  # only what stopped() reads
    run.sink, run.batcher, run.events = sink, batcher, events  # type: ignore[assignment]
    run.stopped([])
    assert events.emitted == [
        (
            "unbatched",
            {
                "group_ids": ["g0", "g1", "g2", "g3"],
                "reason": "run stopped before the trainer acknowledged the group's batch",
            },
        )
    ]
