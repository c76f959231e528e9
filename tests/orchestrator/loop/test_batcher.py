"""The batcher's staleness decision: the drop rule decides; ``scheduler.max_lag`` without one."""

from __future__ import annotations

import random

from orchestrator.loop.batcher import Batcher
from orchestrator.types import Episode, Group, GroupDecision
from policies.wire.lane import VersionStamp
from staleness.config import DropRule, StalenessConfig
from tests.support.trajectories import make_episode


def _group(gid: str, calls: list[list[tuple[int, int]]]) -> Group:
    """A group with one episode per entry; each model call is (start version, sampled tokens)."""
    rng = random.Random(gid)
    episodes: list[Episode] = []
    for i, episode_calls in enumerate(calls):
        base = make_episode(rng, gid, i, version=0, turns=len(episode_calls))
        segments = [
            seg.model_copy(
                update={
                    "policy_version": VersionStamp(start=start, end=start),
                    "token_ids": seg.token_ids[:1] * n,
                    "logprobs": [-1.0] * n,
                }
            )
            for seg, (start, n) in zip(base.segments, episode_calls, strict=True)
        ]
        episodes.append(base.model_copy(update={"segments": segments}))
    return Group(id=gid, task_id=f"t{gid}", episodes=episodes)


# trained at version 5: one call at lag 2 (from version 3), one at lag 0
OVERTAKEN = [[(3, 1), (5, 30)], [(5, 10)]]


def _decide(
    staleness: StalenessConfig, calls: list[list[tuple[int, int]]], max_lag: int = 1
) -> GroupDecision:
    return Batcher(staleness, 1, max_lag, lambda: 5).decide(_group("g1", calls))


def test_without_a_drop_rule_the_lag_budget_decides() -> None:
    got = _decide(StalenessConfig(), OVERTAKEN)
    assert (got.decision, got.max_lag) == ("dropped", 2)
    assert "scheduler.max_lag=1" in got.reason
    assert _decide(StalenessConfig(), OVERTAKEN, max_lag=2).decision == "kept"


def test_a_looser_drop_rule_keeps_what_the_lag_budget_would_drop() -> None:
    """``drop.max_lag`` above ``scheduler.max_lag`` acts: the overtaken group is trained on."""
    got = _decide(StalenessConfig(drop=DropRule(statistic="max", max_lag=2)), OVERTAKEN)
    assert (got.decision, got.max_lag, got.reason) == ("kept", 2, "")


def test_token_weighted_rule_keeps_a_group_whose_max_exceeds_the_budget() -> None:
    # token-weighted lag: (2·1 + 0·30 + 0·10) / 41 ≈ 0.05; max lag 2 > scheduler.max_lag 1
    rule = DropRule(statistic="token_weighted", max_lag=1)
    got = _decide(StalenessConfig(drop=rule), OVERTAKEN)
    assert (got.decision, got.max_lag) == ("kept", 2)
    # the same rule on `max` drops it, and says which rule did
    strict = _decide(StalenessConfig(drop=DropRule(statistic="max", max_lag=1)), OVERTAKEN)
    assert strict.decision == "dropped"
    assert strict.reason == "lag max exceeds staleness.drop.max_lag=1"


def test_a_stricter_drop_rule_still_drops_within_the_budget() -> None:
    fresh = [[(4, 5)], [(5, 5)]]  # max lag 1, within scheduler.max_lag = 1
    assert _decide(StalenessConfig(), fresh).decision == "kept"
    got = _decide(StalenessConfig(drop=DropRule(max_lag=0)), fresh)
    assert (got.decision, got.reason) == ("dropped", "lag max exceeds staleness.drop.max_lag=0")


def test_a_group_is_decided_by_its_environments_own_rule() -> None:
    """``[[environments]]`` with a ``staleness`` table: that environment's groups follow it."""
    run = StalenessConfig(drop=DropRule(max_lag=2))
    strict = StalenessConfig(drop=DropRule(max_lag=1))
    batcher = Batcher(run, 1, 1, lambda: 5, {"strict": strict})
    group = _group("g1", OVERTAKEN)  # max lag 2
    assert batcher.decide(group).decision == "kept"  # the episodes' environment: the run's rule
    envs = [e.model_copy(update={"environment": "strict"}) for e in group.episodes]
    got = batcher.decide(group.model_copy(update={"episodes": envs}))
    assert (got.decision, got.max_lag) == ("dropped", 2)
    assert got.reason == "lag max exceeds environments[name='strict'].staleness.drop.max_lag=1"
