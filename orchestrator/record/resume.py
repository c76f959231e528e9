"""Restarting a run after a crash or a stop: ``orchestrate --config X --run.resume true``.

The run directory is kept; the run continues from its logs and the trainer's checkpoint:

1. the trainer resumes from its checkpoint (:class:`policies.train.trainer.Trainer` with ``resume``)
   and republishes its version if the crash came between the checkpoint and the publish; an
   external trainer is waited for on the board: behind batch files, for the version it owes
   (:func:`external_version`); on the batch feed, for the last batch record's version at least
   (the board then shows it, or one more when the trainer finished the batch it held);
2. the logs are reconciled (:func:`reconcile`, pure; :func:`record` writes the result):

   a. the trainer one step ahead of the last batch record (killed between the trainer step and
      the record): the batch is rebuilt — the batcher is FIFO over kept groups, so it is the
      first ``groups_per_batch`` kept, untrained groups in log order — and recorded with the
      metric ``reconstructed = 1``;
   b. kept groups in no batch go back into the batcher as they were decided (not re-decided,
      not re-recorded), ahead of new ones; on the batch feed they form again, in order, the
      batches it had offered and not seen acknowledged, which it offers again (the trainer
      takes each once: :mod:`orchestrator.loop.feed`);
   c. admitted groups with no group record were in flight when the process died: one ``lost``
      event names them;
   d. the scheduler continues after the last admitted index (group ids are never reused; the
      seeded task stream skips the consumed tasks), with every dropped or lost group's
      admission slot free;

3. the trajectory and event logs are appended to (new parts; ``run.json`` keeps the original
   header), and a ``resumed`` event says what was reconciled.

Engines are fresh subprocesses (the old ones exit with their parent); ``admin.json`` is
rewritten. The accounting rule (``docs/trajectory-schema.md``) holds across the restart:
:func:`orchestrator.record.accounting.account`. When the resumed process ends, its summary counts
the whole run: :func:`read_run` again, on the closed logs
(:meth:`orchestrator.observe.summary.RunSummary.cover`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from orchestrator.config import Config
from orchestrator.errors import ConfigError, TrajlogError
from orchestrator.record.events import read_events
from orchestrator.record.trajlog import TrajectoryLog, batch_records, episode_records
from orchestrator.types import Batch, EventSink, Group, GroupDecision
from policies.wire.batches import batch_path

log = structlog.get_logger(__name__)

LOST_REASON = "in flight when the orchestrator stopped"
UNCHANGEABLE = (
    "run.seed",
    "scheduler.group_size",
    "scheduler.groups_per_batch",
    "environment.cls",
    "environment.args",
    "environments",
)
"""Settings a resumed run must share with the original (the task stream and batches depend on
them)."""


@dataclass
class LoggedRun:
    """What the logs of a run directory say, as a restart needs it."""

    admitted: list[str] = field(default_factory=list)
    """Group ids of ``admit`` events, in order."""
    groups: dict[str, tuple[Group, GroupDecision]] = field(default_factory=dict)
    """Recorded groups with their decisions, in log order."""
    trained: set[str] = field(default_factory=set)
    """Group ids in a batch record."""
    last_version: int = 0
    """``produced_version`` of the last batch record (0: none)."""
    lost: set[str] = field(default_factory=set)
    """Group ids an earlier restart already listed in a ``lost`` event."""
    next_seq: int = 0
    """The event log's next ``seq``."""
    steps: int = 0
    """Batch records: trainer steps the run has recorded."""
    rewards: list[float] = field(default_factory=list)
    """``reward_mean`` of each batch record that has one (every orchestrator's does), in order."""
    resumed_at: list[int] = field(default_factory=list)
    """Trainer version of each ``resumed`` event: the step each restart continued from."""
    requeue_depth: dict[str, int] = field(default_factory=dict)
    """Re-run groups (``admit`` events naming ``requeued_from``) → re-runs along their chain:
    their indices took no task of the stream."""

    @property
    def episodes(self) -> int:
        """Episodes in the recorded groups (each counted once)."""
        return sum(len(g.episodes) for g, _ in self.groups.values())

    @property
    def dropped_groups(self) -> int:
        """Recorded groups the staleness policy (or a stop) dropped."""
        return sum(d.decision == "dropped" for _, d in self.groups.values())


@dataclass
class Reconciliation:
    """What a restart continues from (see the module docstring)."""

    trainer_version: int
    next_index: int
    dropped: int
    restored: list[tuple[Group, GroupDecision]]
    lost: list[str]
    reconstructed: Batch | None
    requeue_depth: dict[str, int] = field(default_factory=dict)  # LoggedRun.requeue_depth


def check_run_dir(cfg: Config) -> Path:
    """The run directory to resume; raises :class:`ConfigError` when there is none to resume,
    or when a setting the run depends on changed."""
    run_dir = cfg.run_dir
    if not (run_dir / "trajectories" / "run.json").exists():
        raise ConfigError(
            f"run.resume: {run_dir} holds no trajectory log to resume "
            "(start the run without run.resume)"
        )
    original = json.loads((run_dir / "config.json").read_text())
    now = cfg.model_dump(mode="json")
    for key in UNCHANGEABLE:
        before, after = _dotted(original, key), _dotted(now, key)
        if before != after and not (before is None and after == []):  # a key added since
            raise ConfigError(
                f"run.resume: {key} was {before!r} in {run_dir}, now {after!r}: "
                "a resumed run keeps it"
            )
    return run_dir


def _dotted(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def read_run(run_dir: Path) -> LoggedRun:
    """Read the event log and the trajectory log of ``run_dir`` (every part, torn tails
    skipped)."""
    logged = LoggedRun()
    events = read_events(run_dir)
    for ev in events:
        if ev["kind"] == "admit":
            logged.admitted.append(ev.get("group_id") or f"g{ev['index']:06d}")
            if "requeued_from" in ev:
                src = logged.requeue_depth.get(ev["requeued_from"], 0)
                logged.requeue_depth[logged.admitted[-1]] = src + 1
        elif ev["kind"] == "lost":
            logged.lost.update(ev["group_ids"])
        elif ev["kind"] == "resumed":
            logged.resumed_at.append(ev["trainer_version"])
    logged.next_seq = events[-1]["seq"] + 1 if events else 0
    traj = run_dir / "trajectories"
    for r in episode_records(traj):
        gid = r.decision.group_id
        group, _ = logged.groups.setdefault(
            gid, (Group(id=gid, task_id=r.episode.task_id, episodes=[]), r.decision)
        )
        if r.episode.id not in {e.id for e in group.episodes}:
            group.episodes.append(r.episode)
    for b in batch_records(traj):
        logged.trained.update(b.groups)
        logged.last_version = max(logged.last_version, b.produced_version)
        logged.steps += 1
        if "reward_mean" in b.metrics:
            logged.rewards.append(b.metrics["reward_mean"])
    return logged


def external_version(batch_dir: Path, logged: LoggedRun) -> int:
    """The version an external trainer continues from: one past the last batch record when the
    orchestrator had handed it that batch's file before it stopped (the trainer steps on it)."""
    return logged.last_version + batch_path(batch_dir, logged.last_version).exists()


def reconcile(logged: LoggedRun, *, trainer_version: int, groups_per_batch: int) -> Reconciliation:
    """What a restart with the trainer at ``trainer_version`` continues from (pure)."""
    kept = [
        (g, d)
        for gid, (g, d) in logged.groups.items()
        if d.decision == "kept" and gid not in logged.trained
    ]
    reconstructed = None
    if trainer_version == logged.last_version + 1:
        if len(kept) < groups_per_batch:
            raise TrajlogError(
                f"cannot resume: the trainer is at version {trainer_version}, one step past the "
                f"last batch record, but only {len(kept)} kept groups are untrained (a batch "
                f"has scheduler.groups_per_batch = {groups_per_batch})"
            )
        head, kept = kept[:groups_per_batch], kept[groups_per_batch:]
        reconstructed = Batch(
            trained_at_version=logged.last_version,
            groups=[g for g, _ in head],
            decisions=[d for _, d in head],
        )
    elif trainer_version != logged.last_version:
        raise TrajlogError(
            f"cannot resume: the trainer is at version {trainer_version} but the trajectory "
            f"log's last batch produced version {logged.last_version} (a checkpoint or a board "
            "of another run?)"
        )
    unrecorded = [g for g in logged.admitted if g not in logged.groups]
    indices = [int(g[1:]) for g in [*logged.admitted, *logged.groups]]
    return Reconciliation(
        trainer_version=trainer_version,
        next_index=max(indices) + 1 if indices else 0,
        # never trained: their admission slots are free
        dropped=logged.dropped_groups + len(unrecorded),
        restored=kept,
        lost=[g for g in unrecorded if g not in logged.lost],
        reconstructed=reconstructed,
        requeue_depth=logged.requeue_depth,
    )


def record(rec: Reconciliation, trajlog: TrajectoryLog, events: EventSink) -> None:
    """Write what the restart reconciled: the rebuilt batch record, ``lost``, ``resumed``."""
    if rec.reconstructed is not None:
        rewards = [e.reward for g in rec.reconstructed.groups for e in g.episodes]
        metrics = {"reconstructed": 1.0, "reward_mean": sum(rewards) / max(len(rewards), 1)}
        trajlog.write_batch(rec.reconstructed, rec.trainer_version, metrics)
    if rec.lost:
        events.emit("lost", group_ids=rec.lost, reason=LOST_REASON)
    events.emit(
        "resumed",
        trainer_version=rec.trainer_version,
        next_index=rec.next_index,
        admitted=rec.next_index,
        dropped=rec.dropped,
        restored=[g.id for g, _ in rec.restored],
        reconstructed=rec.trainer_version if rec.reconstructed is not None else None,
        lost=len(rec.lost),
    )


def start(
    logged: LoggedRun, trajlog: TrajectoryLog, *, trainer_version: int, cfg: Config
) -> Reconciliation:
    """Reconcile the logs with the trainer at ``trainer_version`` and record it. When the run
    is already at ``trainer.max_steps``, also list the kept groups left over as ``unbatched``,
    as a run that ends does."""
    rec = reconcile(
        logged, trainer_version=trainer_version, groups_per_batch=cfg.scheduler.groups_per_batch
    )
    record(rec, trajlog, trajlog.events)
    log.info(
        "run_resumed",
        version=rec.trainer_version,
        next_index=rec.next_index,
        restored=len(rec.restored),
        lost=len(rec.lost),
        reconstructed=rec.reconstructed is not None,
    )
    if trainer_version >= cfg.trainer.max_steps and rec.restored:
        trajlog.events.emit(
            "unbatched",
            group_ids=[g.id for g, _ in rec.restored],
            reason="trainer.max_steps reached before the group's batch was complete",
        )
    return rec
