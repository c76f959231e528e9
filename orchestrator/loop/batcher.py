"""Batching: finished groups → staleness decision → batches for the trainer.

Guarantees: every group received is either part of exactly one :class:`Batch` or recorded as
dropped with a reason; nothing is discarded silently. The staleness policy's drop rule alone
decides what is trained on: a group is dropped when ``staleness.drop`` says so, or when none of
its episodes made a model call. ``scheduler.max_lag`` is admission control (it bounds what the
scheduler requests, :mod:`orchestrator.loop.scheduler`); it is the drop rule only when
``staleness.drop`` is unset (``statistic="max"``, ``max_lag=scheduler.max_lag``: then no trained
token is older than the lag budget, even when a late group is overtaken by later ones). A rule
that is looser than the budget (a larger ``drop.max_lag``, or a ``mean`` / ``token_weighted``
statistic) keeps the overtaken groups it allows. The lag of a group is measured against the
trainer version at the moment the batch is formed (consumption time).

In a mixture (``[[environments]]``) each group is decided by its environment's staleness config
(the run's ``[staleness]`` with the entry's ``staleness`` keys replacing the run's): the
environment of a group is its episodes' ``environment``; one with no config of its own, or a
group with no episode, is decided by the run's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from orchestrator.types import Batch, Group, GroupDecision
from staleness.config import StalenessConfig
from staleness.lag import group_lag, keep
from staleness.types import SegmentVersions

NO_MODEL_CALL = "no episode produced a model call"
"""The reason of a drop that is not about lag (nothing to train on): never requeued."""


def segment_versions(group: Group) -> list[list[SegmentVersions]]:
    return [
        [
            SegmentVersions(
                start=s.policy_version.start, end=s.policy_version.end, n_tokens=len(s.token_ids)
            )
            for s in e.segments
        ]
        for e in group.episodes
    ]


class Batcher:
    """Decides each group by the staleness policy and accumulates kept groups until
    ``groups_per_batch`` are ready. ``max_lag`` is ``scheduler.max_lag``: the drop rule when
    ``staleness.drop`` is unset (:meth:`~staleness.config.StalenessConfig.effective_drop`).
    ``per_environment``: environment name → the staleness config its groups are decided by,
    where it differs from ``staleness`` (module docstring)."""

    def __init__(
        self,
        staleness: StalenessConfig,
        groups_per_batch: int,
        max_lag: int,
        trainer_version: Callable[[], int],
        per_environment: Mapping[str, StalenessConfig] | None = None,
    ) -> None:
        self.staleness = staleness
        self.per_environment = dict(per_environment or {})
        self.groups_per_batch = groups_per_batch
        self.max_lag = max_lag
        self.trainer_version = trainer_version
        self.pending: list[Group] = []
        self.decisions: list[GroupDecision] = []

    def decide(self, group: Group) -> GroupDecision:
        version = self.trainer_version()
        per_episode = [s for s in segment_versions(group) if s]
        if not per_episode:
            return GroupDecision(
                group_id=group.id,
                decision="dropped",
                max_lag=0,
                reason=NO_MODEL_CALL,
            )
        stats = group_lag(per_episode, version)
        env = group.episodes[0].environment
        staleness = self.per_environment.get(env, self.staleness)
        rule = staleness.effective_drop(self.max_lag)
        if keep(rule, stats):
            return GroupDecision(group_id=group.id, decision="kept", max_lag=stats.max, reason="")
        key = (
            "staleness.drop"
            if env not in self.per_environment
            else f"environments[name={env!r}].staleness.drop"
        )
        if staleness.drop is None:
            reason = f"max lag {stats.max} exceeds scheduler.max_lag={self.max_lag} (no {key} rule)"
        else:
            reason = f"lag {rule.statistic} exceeds {key}.max_lag={rule.max_lag}"
        return GroupDecision(
            group_id=group.id, decision="dropped", max_lag=stats.max, reason=reason
        )

    def add(self, group: Group) -> tuple[GroupDecision, Batch | None]:
        """Decide on ``group``; return a batch when one is complete."""
        decision = self.decide(group)
        self.decisions.append(decision)
        if decision.decision == "kept":
            self.pending.append(group)
        return decision, self.take()

    def restore(self, kept: list[tuple[Group, GroupDecision]]) -> None:
        """Put kept groups of a run before a restart back in front of the queue, as decided
        then (:mod:`orchestrator.record.resume`); :meth:`take` batches them first."""
        self.pending = [g for g, _ in kept] + self.pending
        self.decisions = [d for _, d in kept] + self.decisions

    def take(self) -> Batch | None:
        """The oldest ``groups_per_batch`` pending groups as a batch, if that many wait."""
        if len(self.pending) < self.groups_per_batch:
            return None
        groups, self.pending = (
            self.pending[: self.groups_per_batch],
            self.pending[self.groups_per_batch :],
        )
        ids = {g.id for g in groups}
        batch = Batch(
            trained_at_version=self.trainer_version(),
            groups=groups,
            decisions=[d for d in self.decisions if d.group_id in ids],
        )
        self.decisions = [d for d in self.decisions if d.group_id not in ids]
        return batch
