"""The batcher's decision: the drop rule decides (``scheduler.max_lag`` without one), dynamic
sampling filters groups of equal rewards, overlong handling stamps episodes."""

from __future__ import annotations

import random

import pytest

from orchestrator.config import DynamicSamplingConfig
from orchestrator.errors import RefillsExhausted
from orchestrator.loop.batcher import EQUAL_REWARDS, Batcher
from orchestrator.loop.train_sink import wire_sample
from orchestrator.record.trajlog import loss_mask
from orchestrator.types import Batch, Episode, Group, GroupDecision
from policies.wire.lane import VersionStamp
from staleness.config import DropRule, StalenessConfig
from tests.support.trajectories import make_episode, two_token_episode


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


# -- dynamic sampling and overlong handling ------------------------------------------------------
def _rewarded(gid: str, rewards: list[float], **seg: object) -> Group:
    """Episodes of ``two_token_episode`` (one call, 2 of max_tokens 4 sampled at version 0) with
    ``rewards``; ``seg`` replaces fields of each one's call."""
    episodes = []
    for i, r in enumerate(rewards):
        ep = two_token_episode(i, r)
        calls = [s.model_copy(update=seg) for s in ep.segments]
        episodes.append(
            ep.model_copy(update={"id": f"{gid}-{i}", "group_id": gid, "segments": calls})
        )
    return Group(id=gid, task_id="t", episodes=episodes)


def _filtering(
    staleness: StalenessConfig | None = None, *, per_batch: int = 1, **ds: object
) -> Batcher:
    return Batcher(
        staleness or StalenessConfig(),
        per_batch,
        1,
        lambda: 0,
        dynamic_sampling=DynamicSamplingConfig.model_validate(ds),
    )


def test_dynamic_sampling_drops_a_group_whose_rewards_are_all_equal() -> None:
    batcher = _filtering()
    for rewards in ([1.0] * 4, [0.0] * 4, [2.2] * 4):
        got = batcher.decide(_rewarded("g", rewards))
        assert (got.decision, got.reason, got.max_lag) == ("dropped", EQUAL_REWARDS, 0)
    assert batcher.decide(_rewarded("g", [1.0, 0.0, 0.0, 0.0])).decision == "kept"
    # off: no table, or enabled = false; a looser tolerance drops near-equal groups too
    for off in (Batcher(StalenessConfig(), 1, 1, lambda: 0), _filtering(enabled=False)):
        assert off.decide(_rewarded("g", [1.0] * 4)).decision == "kept"
    near = _rewarded("g", [1.0, 1.0, 1.0, 1.02])
    assert _filtering().decide(near).decision == "kept"
    assert _filtering(tolerance=0.01).decide(near).reason == EQUAL_REWARDS


def test_a_stale_group_is_dropped_for_its_lag_first() -> None:
    """Dynamic sampling only filters what the drop rule keeps; a lag drop keeps its reason (and
    can be requeued)."""
    stale = _rewarded("g", [1.0] * 2, policy_version=VersionStamp(start=0, end=0))
    batcher = Batcher(StalenessConfig(), 1, 1, lambda: 5, dynamic_sampling=DynamicSamplingConfig())
    got = batcher.decide(stale)
    assert got.decision == "dropped"
    assert got.reason == "max lag 5 exceeds scheduler.max_lag=1 (no staleness.drop rule)"


def test_refills_are_bounded_per_batch_and_counted_on_it() -> None:
    """``max_refills`` filtered groups while one batch forms are fine, one more raises (the caller
    records it first); forming a batch starts the count again; 0 is no bound."""
    batcher = _filtering(per_batch=2, max_refills=2)
    assert batcher.add(_rewarded("g0", [1.0, 0.0])).batch is None
    for gid in ("g1", "g2"):
        added = batcher.add(_rewarded(gid, [1.0, 1.0]))
        assert added.decision.reason == EQUAL_REWARDS
        batcher.check_refills()
    batch = batcher.add(_rewarded("g3", [0.0, 1.0])).batch
    assert batch is not None
    assert ([g.id for g in batch.groups], batch.filtered) == (["g0", "g3"], 2)
    assert batcher.metrics(batch) == {"dynamic_sampling/filtered": 2.0}
    for gid in ("g4", "g5"):
        batcher.add(_rewarded(gid, [0.0, 0.0]))
        batcher.check_refills()
    batcher.add(_rewarded("g6", [0.0, 0.0]))
    with pytest.raises(RefillsExhausted, match=r"max_refills = 2: 3 groups .* batch 0 formed"):
        batcher.check_refills()
    unbounded = _filtering(max_refills=0)
    for i in range(100):
        unbounded.add(_rewarded(f"g{i}", [1.0, 1.0]))
        unbounded.check_refills()


def test_overlong_mask_stamps_truncated_episodes_only() -> None:
    """``mask``: an episode whose last call ran into max_tokens, or that reached the context
    limit, carries no loss (empty loss mask, μ 0) but keeps its reward in the group."""
    masking = StalenessConfig(overlong="mask")
    group = _rewarded("g", [1.0, 0.0, 0.5], finish_reason="length")
    done = two_token_episode(9, 0.25)
    context = done.model_copy(update={"id": "g-c", "stop_reason": "context"})
    group = group.model_copy(update={"episodes": [*group.episodes, done, context]})
    shaped = Batcher(masking, 1, 1, lambda: 0).shape(group)
    assert [e.overlong_masked for e in shaped.episodes] == [True, True, True, False, True]
    assert [e.trained_reward for e in shaped.episodes] == [1.0, 0.0, 0.5, 0.25, 0.25]
    masked, kept = wire_sample(shaped.episodes[0]), wire_sample(shaped.episodes[3])
    assert (masked.mask, masked.behaviour_logprobs, masked.reward) == ([False] * 5, [0.0] * 5, 1.0)
    assert kept.mask == [False, False, False, True, True]
    assert loss_mask(shaped.episodes[0]) == [0] * 5
    assert loss_mask(shaped.episodes[3]) == [0, 0, 0, 1, 1]
    assert Batcher(StalenessConfig(), 1, 1, lambda: 0).shape(group) is group  # "none"


def test_soft_penalty_changes_the_trained_reward_and_keeps_the_environments() -> None:
    """``soft_penalty``, buffer 2 before max_tokens 4: a 3-token call gets −0.5·factor, a 4-token
    one −factor; the episode's worst call counts; ``reward`` stays the environment's."""
    staleness = StalenessConfig(
        overlong="soft_penalty", overlong_buffer=2, overlong_penalty_factor=0.5
    )
    group = _rewarded("g", [1.0, 1.0, 1.0])
    three, four = group.episodes[1], group.episodes[2]
    second = three.segments[0].model_copy(update={"turn": 1, "token_ids": [5, 6, 7]})
    group.episodes[1] = three.model_copy(update={"segments": [*three.segments, second]})
    group.episodes[2] = four.model_copy(
        update={"segments": [four.segments[0].model_copy(update={"token_ids": [1, 2, 3, 4]})]}
    )
    batcher = Batcher(staleness, 3, 1, lambda: 0, dynamic_sampling=DynamicSamplingConfig())
    added = batcher.add(group)
    eps = added.group.episodes
    assert [e.overlong_penalty for e in eps] == [0.0, -0.25, -0.5]
    assert [e.reward for e in eps] == [1.0, 1.0, 1.0]
    assert [wire_sample(e).reward for e in eps] == [1.0, 0.75, 0.5]
    # the penalty made the rewards differ: dynamic sampling keeps the group
    assert added.decision.decision == "kept"
    # ... and a penalty can make rewards equal: 1.0 − 0.5 == 0.5
    level = group.model_copy(
        update={"episodes": [eps[0].model_copy(update={"reward": 0.5}), eps[2]]}
    )
    assert batcher.decide(level).reason == EQUAL_REWARDS
    batch = Batch(trained_at_version=0, groups=[added.group], decisions=[])
    assert batcher.metrics(batch) == {
        "dynamic_sampling/filtered": 0.0,
        "overlong/penalty_mean": -0.25,
        "overlong/penalized_frac": pytest.approx(2 / 3),
        "overlong/masked_frac": 0.0,
    }
