"""The trainer boundary: finished groups → staleness decision → batches → trainer steps.

:func:`consume` reads finished groups from the scheduler's bounded stream, decides each one
(:class:`~orchestrator.loop.batcher.Batcher`), records it, and hands every complete batch to a
:class:`TrainerSink`. While the sink trains, the stream fills and admission stops: backpressure
runs end to end. A dropped group gives its admission slot back to the scheduler.

Guarantee: every group received is recorded exactly once (kept or dropped, with a reason), and
every kept group is in exactly one batch the sink trained, or is still pending in the batcher
when the run stops (the run then lists it in an ``unbatched`` event): a batch whose step raised
or was cancelled goes back to the batcher. Groups a resumed run put back into the batcher
(:meth:`~orchestrator.loop.batcher.Batcher.restore`) are trained first. The batch feed's
trainer takes batches ahead of its steps: :func:`~orchestrator.loop.feed_sink.consume_ahead`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream

from orchestrator.errors import TrainerError
from orchestrator.loop.batcher import EQUAL_REWARDS, NO_MODEL_CALL, Batcher
from orchestrator.loop.scheduler import Scheduler, VersionClock
from orchestrator.types import Batch, Episode, Group, GroupDecision
from policies.errors import BoardError
from policies.wire.batches import (
    BatchFile,
    BatchSample,
    SegmentSampling,
    read_metrics,
    write_batch,
)
from policies.wire.routing import join_routing

if TYPE_CHECKING:
    from orchestrator.config import Config
    from policies.board import Board
    from policies.train.samples import TrainSample
    from policies.train.trainer import Trainer
    from staleness.config import StalenessConfig

log = structlog.get_logger(__name__)


class TrainerSink(Protocol):
    """Where batches go. ``train`` returns once the next version is published on the board."""

    @property
    def version(self) -> int: ...

    async def train(self, batch: Batch) -> dict[str, float]: ...


class Recorder(Protocol):
    """What the run keeps of the stream: the trajectory log, the summary, the endpoints."""

    def group(self, group: Group, decision: GroupDecision, trainer_version: int) -> None: ...

    async def step(self, batch: Batch, version: int, metrics: dict[str, float]) -> None:
        """Record a trained batch (runs shielded from cancellation: keep it local and short)."""


class InProcessTrainer:
    """The reference trainer (:class:`policies.train.trainer.Trainer`) in this process."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    @property
    def version(self) -> int:
        return self.trainer.version

    async def train(self, batch: Batch) -> dict[str, float]:
        samples = batch_samples(batch.groups)
        return await anyio.to_thread.run_sync(self.trainer.step, samples)


async def board_version_above(board: Board, version: int, poll_interval_s: float) -> int:
    """Wait until the board's pointer names a version above ``version``; return it.

    The pointer lives in storage another process writes (a directory or a bucket), so it is
    re-read every ``poll_interval_s``: moving it is how an external trainer announces a version.
    A pointer that cannot be read (half-written by a store without atomic renames, malformed)
    is logged and read again; ``timeouts.trainer_step_s`` bounds the wait.
    """
    while True:
        try:
            latest = await anyio.to_thread.run_sync(board.latest)
        except BoardError as exc:
            log.warning("board_unreadable", error=str(exc))
        else:
            if latest is not None and latest > version:
                return latest
        await anyio.sleep(poll_interval_s)


def build_trainer(
    cfg: Config,
    model_dir: Path,
    board: Board,
    *,
    seed: int | None = None,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
) -> Trainer:
    """The reference trainer of a run config: its ``[trainer]`` section as it is, plus the
    sampling transforms, the group size, the seed and the ``[staleness]`` section; ``resume``:
    restore the checkpoint in ``checkpoint_dir`` if there is one."""
    from policies.train.trainer import Trainer

    return Trainer(
        model_dir,
        board,
        cfg.trainer,
        staleness=cfg.staleness,
        temperature=cfg.sampling.temperature,
        top_k=cfg.sampling.top_k,
        top_p=cfg.sampling.top_p,
        group_size=cfg.scheduler.group_size,
        seed=cfg.run.seed if seed is None else seed,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
    )


def wire_sample(ep: Episode) -> BatchSample:
    """One episode in the batch protocol's form: sampled tokens are the loss mask (none of them
    when ``staleness.overlong = "mask"`` masked the episode), the reward is the one advantages
    are computed from (with the overlong penalty), each segment with its policy versions and its
    sampling transforms."""
    mask = [False] * len(ep.token_ids)
    behaviour = [0.0] * len(ep.token_ids)
    spans = []
    sampling = []
    for seg in ep.segments:
        for j, lp in enumerate([] if ep.overlong_masked else seg.logprobs):
            mask[seg.prompt_len + j] = True
            behaviour[seg.prompt_len + j] = lp
        v = seg.policy_version
        end = seg.prompt_len + len(seg.token_ids)
        spans.append((seg.prompt_len, end, v.start, v.end))
        sp = seg.sampling
        sampling.append(SegmentSampling(seg.prompt_len, end, sp.temperature, sp.top_k, sp.top_p))
    return BatchSample(
        episode_id=ep.id,
        group_id=ep.group_id,
        token_ids=ep.token_ids,
        mask=mask,
        behaviour_logprobs=behaviour,
        reward=ep.trained_reward,
        policy_versions=spans,
        sampling=sampling,
        routed_experts=join_routing(
            [(seg.routed_experts_start, seg.routed_experts) for seg in ep.segments]
        ),
    )


def batch_samples(groups: Sequence[Group]) -> list[TrainSample]:
    """Episodes as the reference trainer's samples, group-contiguous."""
    from policies.train.samples import TrainSample

    return [TrainSample.from_wire(wire_sample(ep)) for g in groups for ep in g.episodes]


class ExternalTrainer:
    """A trainer in another process, reached through batch files and the board (see
    :mod:`policies.wire.batches` for the protocol)."""

    def __init__(
        self,
        board: Board,
        batch_dir: Path,
        *,
        group_size: int,
        poll_interval_s: float,
        step_timeout_s: float,
        version: int,
        staleness: StalenessConfig | None = None,
    ) -> None:
        self.board = board
        self.batch_dir = batch_dir
        self.group_size = group_size
        self.staleness = staleness
        self.poll_interval_s = poll_interval_s
        self.step_timeout_s = step_timeout_s
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    async def train(self, batch: Batch) -> dict[str, float]:
        samples = [wire_sample(ep) for g in batch.groups for ep in g.episodes]
        wire = BatchFile(
            version=batch.trained_at_version,
            group_size=self.group_size,
            samples=samples,
            staleness=None if self.staleness is None else self.staleness.model_dump(mode="json"),
        )
        await anyio.to_thread.run_sync(write_batch, self.batch_dir, wire)
        try:
            with anyio.fail_after(self.step_timeout_s):
                latest = await board_version_above(
                    self.board, batch.trained_at_version, self.poll_interval_s
                )
        except TimeoutError:
            raise TrainerError(
                "the external trainer did not publish version "
                f"{batch.trained_at_version + 1} within {self.step_timeout_s}s "
                f"(timeouts.trainer_step_s); batch file: {self.batch_dir}"
            ) from None
        self._version = latest
        metrics = read_metrics(self.batch_dir, batch.trained_at_version)
        metrics.setdefault("reward_mean", sum(s.reward for s in samples) / max(len(samples), 1))
        return metrics


async def consume(
    groups: MemoryObjectReceiveStream[Group],
    *,
    batcher: Batcher,
    scheduler: Scheduler,
    sink: TrainerSink,
    clock: VersionClock,
    recorder: Recorder,
    max_steps: int,
    on_version: Callable[[], Awaitable[None]] | None = None,
) -> None:
    r"""Train until the sink reaches version ``max_steps`` (or the stream closes).

    A group the staleness policy drops has its task re-run by the scheduler when
    ``staleness.length_bias.requeue`` is set
    (:meth:`~orchestrator.loop.scheduler.Scheduler.requeue`); one dynamic sampling drops is not
    (its slot admits a new task), and one past ``max_refills`` stops the run
    (:class:`~orchestrator.errors.RefillsExhausted`) once it is recorded.

    The caller cancels the producers and then :func:`drain`\ s ``groups``, so that no finished
    group meets a closed stream or is left unrecorded.
    """

    async def train(batch: Batch) -> bool:
        """One trainer step; True once ``max_steps`` is reached. A step that raised or was
        cancelled is not recorded, so its batch goes back in front of the batcher: a stop names
        its groups (``unbatched``), a resume trains them, or rebuilds the batch if the trainer
        got to publish it."""
        try:
            metrics = {**await sink.train(batch), **batcher.metrics(batch)}
        except BaseException:
            batcher.put_back(batch)
            raise
        with anyio.CancelScope(shield=True):  # a trained batch is always recorded
            await recorder.step(batch, sink.version, metrics)
        await clock.advance(sink.version)
        if on_version is not None:
            await on_version()
        return sink.version >= max_steps

    while (restored := batcher.take()) is not None:  # groups restored by a resumed run
        if await train(restored):
            return
    async for group in groups:
        batch = await take_group(
            group, batcher=batcher, scheduler=scheduler, recorder=recorder, version=sink.version
        )
        if batch is not None and await train(batch):
            return


async def take_group(
    group: Group, *, batcher: Batcher, scheduler: Scheduler, recorder: Recorder, version: int
) -> Batch | None:
    """Decide ``group`` and record it with ``version`` (the version its batch is trained at); a
    dropped group gives its admission slot back, and has its task re-run when
    ``staleness.length_bias.requeue`` says so (never one that dynamic sampling filtered: a new
    task refills its slot). The batch it completes, if any."""
    group, decision, batch = batcher.add(group)
    recorder.group(group, decision, version)
    if decision.decision == "dropped":
        log.info("group_dropped", group=group.id, reason=decision.reason)
        batcher.check_refills()  # dynamic sampling past its bound stops the run
        requeue = batcher.staleness.length_bias.requeue
        if requeue and decision.reason not in (NO_MODEL_CALL, EQUAL_REWARDS):
            scheduler.requeue(group)  # a staleness drop: re-run it
        await scheduler.release_dropped(1)  # a filtered group's slot admits its refill
    return batch


def drain(groups: MemoryObjectReceiveStream[Group]) -> list[Group]:
    """Close ``groups`` and return what was still buffered in it."""
    left: list[Group] = []
    while True:
        try:
            left.append(groups.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            break
    groups.close()
    return left
