"""Batching: finished groups → overlong handling → staleness decision → batches for the trainer.

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

Overlong handling (``staleness.overlong``, DAPO): before a group is decided, :meth:`Batcher.shape`
stamps each episode with ``overlong_masked`` (``mask``: the episode is truncated,
:attr:`~orchestrator.types.Episode.truncated`; the train sink then hands it to the trainer with
an empty loss mask) or ``overlong_penalty`` (``soft_penalty``: the most negative
:func:`~staleness.rewards.soft_overlong_penalty` of its model calls, each call's sampled tokens
against the ``max_tokens`` it was sent with; the trainer's reward is ``reward`` plus it, and the
log keeps both). Stamped groups are what the log records and the trainer gets.

Dynamic sampling (``scheduler.dynamic_sampling``, DAPO; verl ``algorithm.filter_groups``): a group
the drop rule keeps is dropped after all, with reason :data:`EQUAL_REWARDS`, when its rewards as
the trainer would see them (with the overlong penalty) are all equal
(:func:`~staleness.rewards.rewards_equal`): its advantages would all be 0. Its slot goes back to
the scheduler like any drop's, which admits a replacement under the same lag budget. At most
``max_refills`` groups are so dropped while one batch forms; :meth:`Batcher.check_refills` raises
:class:`~orchestrator.errors.RefillsExhausted` at the next one (verl and SkyRL stop the run when
their bound is exceeded; 0: no bound).

In a mixture (``[[environments]]``) each group is decided by its environment's staleness config
(the run's ``[staleness]`` with the entry's ``staleness`` keys replacing the run's): the
environment of a group is its episodes' ``environment``; one with no config of its own, or a
group with no episode, is decided by the run's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from orchestrator.errors import RefillsExhausted
from orchestrator.types import Batch, Episode, Group, GroupDecision
from staleness.config import StalenessConfig
from staleness.lag import group_lag, keep
from staleness.rewards import rewards_equal, soft_overlong_penalty
from staleness.types import SegmentVersions

if TYPE_CHECKING:
    from orchestrator.config import DynamicSamplingConfig

NO_MODEL_CALL = "no episode produced a model call"
"""The reason of a drop that is not about lag (nothing to train on): never requeued."""

EQUAL_REWARDS = "rewards all equal (scheduler.dynamic_sampling)"
"""The reason of a drop by dynamic sampling: never requeued (a new task refills the slot);
counted by ``sprawl_groups_filtered_total``."""


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


def overlong_penalty(episode: Episode, staleness: StalenessConfig) -> float:
    """The soft overlong penalty of ``episode`` under ``staleness`` (0 unless ``soft_penalty``):
    the most negative of its model calls' (module docstring)."""
    buffer = staleness.overlong_buffer
    if staleness.overlong != "soft_penalty" or buffer is None:
        return 0.0
    factor = staleness.overlong_penalty_factor
    return min(
        (
            soft_overlong_penalty(len(s.token_ids), s.sampling.max_tokens, buffer, factor)
            for s in episode.segments
        ),
        default=0.0,
    )


def overlong_fields(episode: Episode, staleness: StalenessConfig) -> dict[str, Any]:
    """``overlong_penalty`` and ``overlong_masked`` of ``episode`` under ``staleness.overlong``."""
    return {
        "overlong_penalty": overlong_penalty(episode, staleness),
        "overlong_masked": staleness.overlong == "mask" and episode.truncated,
    }


class Added(NamedTuple):
    """What :meth:`Batcher.add` made of a group: the group as recorded and trained (overlong
    fields stamped), its decision, and the batch it completed, if any."""

    group: Group
    decision: GroupDecision
    batch: Batch | None


class Batcher:
    """Decides each group by the staleness policy (and dynamic sampling) and accumulates kept
    groups until ``groups_per_batch`` are ready. ``max_lag`` is ``scheduler.max_lag``: the drop
    rule when ``staleness.drop`` is unset
    (:meth:`~staleness.config.StalenessConfig.effective_drop`). ``per_environment``: environment
    name → the staleness config its groups are decided by, where it differs from ``staleness``
    (module docstring). ``dynamic_sampling``: ``scheduler.dynamic_sampling`` (off when None or
    not ``enabled``)."""

    def __init__(
        self,
        staleness: StalenessConfig,
        groups_per_batch: int,
        max_lag: int,
        trainer_version: Callable[[], int],
        per_environment: Mapping[str, StalenessConfig] | None = None,
        *,
        dynamic_sampling: DynamicSamplingConfig | None = None,
    ) -> None:
        self.staleness = staleness
        self.per_environment = dict(per_environment or {})
        self.groups_per_batch = groups_per_batch
        self.max_lag = max_lag
        self.trainer_version = trainer_version
        on = dynamic_sampling is not None and dynamic_sampling.enabled
        self.dynamic_sampling = dynamic_sampling if on else None
        self.filtered = 0  # groups dynamic sampling dropped since the last batch formed
        self.pending: list[Group] = []
        self.decisions: list[GroupDecision] = []

    def staleness_of(self, group: Group) -> StalenessConfig:
        """The staleness config ``group`` is decided by (its environment's, or the run's)."""
        env = group.episodes[0].environment if group.episodes else ""
        return self.per_environment.get(env, self.staleness)

    def shape(self, group: Group) -> Group:
        """``group`` with its episodes' overlong fields stamped (module docstring); the group
        itself when its staleness config handles no overlong episode."""
        staleness = self.staleness_of(group)
        if staleness.overlong == "none":
            return group
        episodes = [e.model_copy(update=overlong_fields(e, staleness)) for e in group.episodes]
        return group.model_copy(update={"episodes": episodes})

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
        staleness = self.staleness_of(group)
        rule = staleness.effective_drop(self.max_lag)
        if keep(rule, stats):
            if self._equal_rewards(group, staleness):
                return GroupDecision(
                    group_id=group.id, decision="dropped", max_lag=stats.max, reason=EQUAL_REWARDS
                )
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

    def _equal_rewards(self, group: Group, staleness: StalenessConfig) -> bool:
        """Dynamic sampling's test: the rewards the trainer would see are all equal. The overlong
        penalty is recomputed from ``staleness`` (a what-if policy may differ from the run's)."""
        ds = self.dynamic_sampling
        if ds is None:
            return False
        rewards = [e.reward + overlong_penalty(e, staleness) for e in group.episodes]
        return rewards_equal(rewards, ds.tolerance)

    def add(self, group: Group) -> Added:
        """Shape and decide ``group``; the batch it completes, if any."""
        group = self.shape(group)
        decision = self.decide(group)
        self.decisions.append(decision)
        if decision.decision == "kept":
            self.pending.append(group)
        elif decision.reason == EQUAL_REWARDS:
            self.filtered += 1
        return Added(group, decision, self.take())

    def check_refills(self) -> None:
        """Raise :class:`RefillsExhausted` when dynamic sampling dropped more groups since the
        last batch formed than ``max_refills`` allows (the caller records the group first)."""
        ds = self.dynamic_sampling
        if ds is None or not ds.max_refills or self.filtered <= ds.max_refills:
            return
        raise RefillsExhausted(
            f"scheduler.dynamic_sampling.max_refills = {ds.max_refills}: {self.filtered} groups "
            f"with equal rewards dropped while batch {self.trainer_version()} formed "
            f"({len(self.pending)} of {self.groups_per_batch} groups kept); the tasks are too "
            "easy or too hard for the policy (see the rewards), or raise max_refills (0: no bound)"
        )

    def metrics(self, batch: Batch) -> dict[str, float]:
        """What dynamic sampling and overlong handling did to ``batch``, for its step's metrics
        (only the keys of the parts that are on): ``dynamic_sampling/filtered``,
        ``overlong/penalty_mean``, ``overlong/penalized_frac``, ``overlong/masked_frac``."""
        out: dict[str, float] = {}
        if self.dynamic_sampling is not None:
            out["dynamic_sampling/filtered"] = float(batch.filtered)
        configs = [self.staleness, *self.per_environment.values()]
        if any(c.overlong != "none" for c in configs):
            eps = [e for g in batch.groups for e in g.episodes]
            n = max(len(eps), 1)
            out["overlong/penalty_mean"] = sum(e.overlong_penalty for e in eps) / n
            out["overlong/penalized_frac"] = sum(e.overlong_penalty < 0 for e in eps) / n
            out["overlong/masked_frac"] = sum(e.overlong_masked for e in eps) / n
        return out

    def restore(self, kept: list[tuple[Group, GroupDecision]]) -> None:
        """Put kept groups of a run before a restart back in front of the queue, as decided
        then (:mod:`orchestrator.record.resume`); :meth:`take` batches them first."""
        self.pending = [g for g, _ in kept] + self.pending
        self.decisions = [d for _, d in kept] + self.decisions

    def put_back(self, batch: Batch) -> None:
        """Put ``batch`` (from :meth:`take`, never trained) back in front of the queue, as it
        was decided; :meth:`take` forms it again."""
        self.restore(list(zip(batch.groups, batch.decisions, strict=True)))
        self.filtered += batch.filtered

    def take(self) -> Batch | None:
        """The oldest ``groups_per_batch`` pending groups as a batch, if that many wait; with the
        count of groups dynamic sampling dropped since the last batch formed."""
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
            filtered=self.filtered,
        )
        self.decisions = [d for d in self.decisions if d.group_id not in ids]
        self.filtered = 0
        return batch
