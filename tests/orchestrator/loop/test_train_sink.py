"""The out-of-process trainer boundary: batch files in, versions announced on the board."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import anyio
import pytest
import torch

from orchestrator.config import DynamicSamplingConfig
from orchestrator.errors import RefillsExhausted, TrainerError
from orchestrator.loop.batcher import EQUAL_REWARDS, Batcher
from orchestrator.loop.scheduler import VersionClock
from orchestrator.loop.train_sink import (
    ExternalTrainer,
    batch_samples,
    board_version_above,
    consume,
    wire_sample,
)
from orchestrator.types import Batch, Group, GroupDecision, SamplingParams
from policies.board import Board
from policies.errors import PointerMalformed
from policies.wire.batches import BatchSample, metrics_path, read_batch, write_atomic
from staleness.config import LengthBiasConfig, StalenessConfig
from tests.support.trajectories import two_token_episode
from tests.support.waiting import until_sync

pytestmark = pytest.mark.anyio


def _batch() -> Batch:
    group = Group(
        id="g0", task_id="t", episodes=[two_token_episode(0, 1.0), two_token_episode(1, 0.0)]
    )
    return Batch(trained_at_version=0, groups=[group], decisions=[])


def test_masks_cover_exactly_the_sampled_tokens() -> None:
    (a, b) = batch_samples(_batch().groups)
    assert a.mask == [False, False, False, True, True]
    assert a.behaviour_logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert (a.reward, b.reward) == (1.0, 0.0)


def test_each_segment_carries_its_sampling_transforms_to_the_trainer() -> None:
    """What the engine sampled each call with reaches the batch file and the trainer's samples,
    so log probs are rescored under the same truncation."""
    ep = two_token_episode(0, 1.0)
    second = ep.segments[0].model_copy(
        update={
            "turn": 1,
            "prompt_len": 6,
            "token_ids": [9],
            "logprobs": [-0.1],
            "sampling": SamplingParams(temperature=0.7, top_p=0.8, top_k=5, max_tokens=4),
        }
    )
    ep = ep.model_copy(
        update={"token_ids": [1, 2, 3, 7, 8, 4, 9], "segments": [*ep.segments, second]}
    )
    wire = wire_sample(ep)
    assert wire.sampling == [(3, 5, 1.0, 0, 1.0), (6, 7, 0.7, 5, 0.8)]
    assert BatchSample.model_validate_json(wire.model_dump_json()).sampling == wire.sampling
    older = wire.model_dump(exclude={"sampling"})  # a batch file of an older sprawl
    assert BatchSample.model_validate(older).sampling == []
    group = Group(id="g0", task_id="t", episodes=[ep])
    (sample,) = batch_samples([group])
    assert list(sample.sampling) == wire.sampling


async def test_external_trainer_round_trip(tmp_path: Path) -> None:
    board = Board(str(tmp_path / "board"), "run")
    board.publish(0, {"w": torch.zeros(2)}, view_name="float32")
    batches = tmp_path / "batches"
    seen: list[int] = []

    def external() -> None:  # a trainer in "another process": reads the file, publishes v1
        wire = until_sync(lambda: read_batch(batches, 0), "batch 0's file", timeout_s=30)
        seen.append(len(wire.samples))
        write_atomic(metrics_path(batches, 0), b'{"loss": 0.5}')
        board.publish(1, {"w": torch.ones(2)}, view_name="float32")

    worker = threading.Thread(target=external)
    worker.start()
    sink = ExternalTrainer(
        board, batches, group_size=2, poll_interval_s=0.01, step_timeout_s=30, version=0
    )
    metrics = await sink.train(_batch())
    worker.join()
    assert sink.version == 1
    assert seen == [2]
    assert metrics["loss"] == 0.5
    wire = read_batch(batches, 0)
    assert wire is not None
    assert wire.samples[0].policy_versions == [(3, 5, 0, 0)]


async def test_external_trainer_timeout_names_the_key(tmp_path: Path) -> None:
    board = Board(str(tmp_path / "board"), "run")
    board.publish(0, {"w": torch.zeros(2)}, view_name="float32")
    sink = ExternalTrainer(
        board, tmp_path / "b", group_size=2, poll_interval_s=0.01, step_timeout_s=0.2, version=0
    )
    with pytest.raises(TrainerError, match=r"timeouts\.trainer_step_s"):
        await sink.train(_batch())
    assert read_batch(tmp_path / "b", 0) is not None  # the batch was handed over, not lost


class _CountingSink:
    """A trainer that only counts: each batch is one version."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.batches: list[Batch] = []

    async def train(self, batch: Batch) -> dict[str, float]:
        self.batches.append(batch)
        self.version += 1
        return {"reward_mean": 0.0}


class _Steps:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def group(self, group: Group, decision: GroupDecision, trainer_version: int) -> None:
        raise AssertionError("restored groups are not recorded again")

    async def step(self, batch: Batch, version: int, metrics: dict[str, float]) -> None:
        self.versions.append(version)


async def test_groups_restored_by_a_restart_are_trained_first_as_decided() -> None:
    """A resumed run's kept groups (restored into the batcher) form batches before any new
    group arrives, oldest first, with their logged decisions; the rest wait."""
    kept = [
        (
            Group(id=f"g{i}", task_id="t", episodes=[two_token_episode(0, 1.0)]),
            GroupDecision(group_id=f"g{i}", decision="kept", reason="", max_lag=1),
        )
        for i in range(5)
    ]
    sink = _CountingSink(version=3)
    batcher = Batcher(StalenessConfig(), 2, 1, lambda: sink.version)
    batcher.restore(kept)
    send, recv = anyio.create_memory_object_stream[Group](1)
    send.close()  # no new group arrives
    recorder = _Steps()
    with recv:
        await consume(
            recv,
            batcher=batcher,
            scheduler=None,  # type: ignore[arg-type]  # nothing is dropped
            sink=sink,
            clock=VersionClock(3),
            recorder=recorder,
            max_steps=10,
        )
    assert [[g.id for g in b.groups] for b in sink.batches] == [["g0", "g1"], ["g2", "g3"]]
    assert [b.trained_at_version for b in sink.batches] == [3, 4]
    assert [d.max_lag for d in sink.batches[0].decisions] == [1, 1]
    assert recorder.versions == [4, 5]
    assert [g.id for g in batcher.pending] == ["g4"]


async def test_an_unreadable_pointer_is_read_again_not_fatal() -> None:
    """An external trainer's store may show a malformed pointer for a moment: the wait goes on."""

    class Flaky:
        def __init__(self) -> None:
            self.reads = 0

        def latest(self) -> int:
            self.reads += 1
            if self.reads == 1:
                raise PointerMalformed("pointer: version must be an integer, got 1e400")
            return 3

    board = Flaky()
    assert await board_version_above(board, 2, poll_interval_s=0.01) == 3  # type: ignore[arg-type]
    assert board.reads == 2


class _Slots:
    """The scheduler as consume sees it: slots given back, tasks requeued."""

    def __init__(self) -> None:
        self.released = 0
        self.requeued: list[str] = []

    async def release_dropped(self, n: int) -> None:
        self.released += n

    def requeue(self, group: Group) -> bool:
        self.requeued.append(group.id)
        return True


class _Groups:
    def __init__(self) -> None:
        self.decided: list[tuple[str, str, list[float]]] = []
        self.metrics: list[dict[str, float]] = []

    def group(self, group: Group, decision: GroupDecision, trainer_version: int) -> None:
        self.decided.append(
            (group.id, decision.reason, [e.overlong_penalty for e in group.episodes])
        )

    async def step(self, batch: Batch, version: int, metrics: dict[str, float]) -> None:
        self.metrics.append(metrics)


def _group(gid: str, rewards: list[float]) -> Group:
    eps = [
        two_token_episode(i, r).model_copy(update={"id": f"{gid}-{i}", "group_id": gid})
        for i, r in enumerate(rewards)
    ]
    return Group(id=gid, task_id="t", episodes=eps)


async def test_filtered_groups_free_their_slot_are_not_requeued_and_are_bounded() -> None:
    """Dynamic sampling in the loop: a filtered group is recorded (with its reason), gives its
    admission slot back (its refill) and is never requeued, even with ``requeue`` on; the batch's
    metrics count the filtered groups and carry the overlong penalty; one filtered group past
    ``max_refills`` stops the run once it is recorded."""
    staleness = StalenessConfig(
        overlong="soft_penalty",
        overlong_buffer=4,
        length_bias=LengthBiasConfig(requeue=True),
    )
    sink = _CountingSink(version=0)
    batcher = Batcher(
        staleness, 2, 1, lambda: sink.version, dynamic_sampling=DynamicSamplingConfig(max_refills=2)
    )
    rewards = [[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    send, recv = anyio.create_memory_object_stream[Group](len(rewards))
    for i, r in enumerate(rewards):
        send.send_nowait(_group(f"g{i}", r))
    send.close()
    slots, recorder = _Slots(), _Groups()
    with recv, pytest.raises(RefillsExhausted, match=r"max_refills = 2: 3 groups"):
        await consume(
            recv,
            batcher=batcher,
            scheduler=slots,  # type: ignore[arg-type]
            sink=sink,
            clock=VersionClock(0),
            recorder=recorder,
            max_steps=10,
        )
    assert [(gid, why) for gid, why, _ in recorder.decided] == [
        ("g0", ""),
        ("g1", EQUAL_REWARDS),
        ("g2", ""),
        ("g3", EQUAL_REWARDS),
        ("g4", EQUAL_REWARDS),
        ("g5", EQUAL_REWARDS),  # recorded, then the run stops
    ]
    assert recorder.decided[0][2] == [-0.5, -0.5]  # 2 tokens of max 4, buffer 4: recorded
    assert (slots.released, slots.requeued) == (3, [])  # g5 stops the run before its release
    assert [[g.id for g in b.groups] for b in sink.batches] == [["g0", "g2"]]
    assert recorder.metrics[0]["dynamic_sampling/filtered"] == 1.0
    assert recorder.metrics[0]["overlong/penalty_mean"] == -0.5
    assert [s.reward for s in batch_samples(sink.batches[0].groups)] == [0.5, -0.5, -0.5, 0.5]


class _StuckSink:
    """A trainer whose step never starts (cancelled while it waits) or fails."""

    version = 0

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    async def train(self, batch: Batch) -> dict[str, float]:
        if self.error is not None:
            raise self.error
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


@pytest.mark.parametrize("error", [None, TrainerError("the trainer did not publish")])
async def test_a_batch_whose_step_never_ran_goes_back_to_the_batcher(
    error: Exception | None,
) -> None:
    """A stop (cancellation) or a failed step leaves the batch's kept groups pending, in order
    and as decided, so the run names them (``unbatched``) and a resume trains them; a CI run
    lost two groups when a stop came as the step was about to start."""
    sink = _StuckSink(error)
    batcher = Batcher(StalenessConfig(), 2, 1, lambda: sink.version)
    send, recv = anyio.create_memory_object_stream[Group](3)
    for gid in ("g0", "g1", "g2"):
        send.send_nowait(_group(gid, [1.0, 0.0]))
    recorder = _Groups()
    with send, recv, anyio.move_on_after(0.2), contextlib.suppress(TrainerError):
        await consume(
            recv,
            batcher=batcher,
            scheduler=_Slots(),  # type: ignore[arg-type]
            sink=sink,
            clock=VersionClock(0),
            recorder=recorder,
            max_steps=10,
        )
    assert [gid for gid, _, _ in recorder.decided] == ["g0", "g1"]
    assert [g.id for g in batcher.pending] == ["g0", "g1"]
    assert [d.group_id for d in batcher.decisions] == ["g0", "g1"]
    again = batcher.take()
    assert again is not None
    assert [g.id for g in again.groups] == ["g0", "g1"]
