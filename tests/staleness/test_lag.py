"""Lag accounting and the drop rule: hand cases and properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from staleness.config import DropRule
from staleness.errors import LagError, ShapeError
from staleness.lag import (
    LagStats,
    SegmentVersions,
    batch_token_lags,
    episode_lag,
    group_lag,
    keep,
    lag_statistic,
    segment_lag,
    token_lags,
)

Seg = SegmentVersions


def test_segment_lag_uses_the_oldest_version() -> None:
    assert segment_lag(Seg(start=3, end=5, n_tokens=10), trainer_version=7) == 4
    assert segment_lag(Seg(start=7, end=7, n_tokens=1), trainer_version=7) == 0


def test_episode_lag_hand_case() -> None:
    # lags 5 (2 tokens), 3 (6 tokens), 1 (0 tokens)
    segs = [Seg(0, 1, 2), Seg(2, 2, 6), Seg(4, 5, 0)]
    stats = episode_lag(segs, trainer_version=5)
    assert stats == LagStats(max=5, mean=3.0, token_weighted=(5 * 2 + 3 * 6) / 8, n_tokens=8)


def test_token_weighted_falls_back_to_mean_without_tokens() -> None:
    stats = episode_lag([Seg(1, 1, 0), Seg(3, 3, 0)], trainer_version=4)
    assert stats.token_weighted == stats.mean == 2.0
    assert stats.n_tokens == 0


def test_group_lag_pools_segments() -> None:
    a = [Seg(0, 0, 4)]
    b = [Seg(2, 2, 1), Seg(3, 3, 3)]
    stats = group_lag([a, b], trainer_version=3)
    assert stats == LagStats(
        max=3, mean=(3 + 1 + 0) / 3, token_weighted=(12 + 1 + 0) / 8, n_tokens=8
    )


@pytest.mark.parametrize(
    ("seg_args", "trainer_version"),
    [((2, 1, 1), 5), ((-1, 0, 1), 5), ((0, 0, -1), 5), ((3, 6, 1), 5)],
)
def test_impossible_stamps_raise(seg_args: tuple[int, int, int], trainer_version: int) -> None:
    with pytest.raises(LagError):
        segment_lag(Seg(*seg_args), trainer_version)


def test_episode_without_segments_raises() -> None:
    with pytest.raises(LagError, match="at least one segment"):
        episode_lag([], trainer_version=1)


def test_keep_hand_cases() -> None:
    stats = LagStats(max=5, mean=2.0, token_weighted=3.5, n_tokens=10)
    assert keep(None, stats)
    assert not keep(DropRule(statistic="max", max_lag=4), stats)
    assert keep(DropRule(statistic="max", max_lag=5), stats)
    assert keep(DropRule(statistic="mean", max_lag=2), stats)
    assert not keep(DropRule(statistic="mean", max_lag=1), stats)
    assert not keep(DropRule(statistic="token_weighted", max_lag=3), stats)
    assert keep(DropRule(statistic="token_weighted", max_lag=4), stats)
    assert keep(DropRule(max_lag=0), LagStats(max=0, mean=0.0, token_weighted=0.0, n_tokens=1))


def test_lag_statistic_rejects_unknown_name() -> None:
    with pytest.raises(LagError):
        lag_statistic(LagStats(max=1, mean=1.0, token_weighted=1.0, n_tokens=1), "median")


def test_token_lags_in_generation_order() -> None:
    lags = token_lags([Seg(1, 1, 2), Seg(2, 3, 0), Seg(3, 3, 3)], trainer_version=4)
    assert lags.tolist() == [3, 3, 1, 1, 1]
    assert lags.dtype == np.int64


def test_batch_token_lags_places_lags_on_mask_positions() -> None:
    mask = np.array([[False, True, True, False, True], [True, False, False, False, False]])
    out = batch_token_lags([[Seg(0, 0, 2), Seg(2, 2, 1)], [Seg(3, 3, 1)]], 3, mask)
    assert out.tolist() == [[-1, 3, 3, -1, 1], [0, -1, -1, -1, -1]]


def test_batch_token_lags_rejects_count_mismatch() -> None:
    with pytest.raises(ShapeError, match="row 0"):
        batch_token_lags([[Seg(0, 0, 2)]], 1, np.array([[True, False, False]]))
    with pytest.raises(ShapeError):
        batch_token_lags([[Seg(0, 0, 1)]], 1, np.array([True]))


@st.composite
def episodes(draw: st.DrawFn, trainer_version: int = 20) -> list[SegmentVersions]:
    n = draw(st.integers(1, 6))
    out = []
    for _ in range(n):
        start = draw(st.integers(0, trainer_version))
        end = draw(st.integers(start, trainer_version))
        out.append(Seg(start, end, draw(st.integers(0, 50))))
    return out


@given(episodes())
def test_stats_are_ordered_and_bounded(segs: list[SegmentVersions]) -> None:
    stats = episode_lag(segs, 20)
    lags = [segment_lag(s, 20) for s in segs]
    assert min(lags) <= stats.mean <= stats.max
    assert min(lags) <= stats.token_weighted <= stats.max
    assert stats.n_tokens == sum(s.n_tokens for s in segs)
    tl = token_lags(segs, 20)
    assert tl.size == stats.n_tokens
    if stats.n_tokens:
        assert tl.mean() == pytest.approx(stats.token_weighted)


@given(
    episodes(),
    st.sampled_from(["max", "mean", "token_weighted"]),
    st.integers(0, 25),
    st.integers(0, 5),
)
def test_drop_is_monotone_in_lag(
    segs: list[SegmentVersions], statistic: str, max_lag: int, later: int
) -> None:
    rule = DropRule.model_validate({"statistic": statistic, "max_lag": max_lag})
    now, then = episode_lag(segs, 20), episode_lag(segs, 20 + later)
    # The same episode consumed later is at least as stale: once dropped, it stays dropped.
    if not keep(rule, now):
        assert not keep(rule, then)
    # And the decision is exactly the rule.
    assert keep(rule, now) == (lag_statistic(now, statistic) <= max_lag)


@given(episodes(), st.integers(0, 25))
def test_max_rule_is_strictest(segs: list[SegmentVersions], max_lag: int) -> None:
    stats = episode_lag(segs, 20)
    if keep(DropRule(statistic="max", max_lag=max_lag), stats):
        assert keep(DropRule(statistic="mean", max_lag=max_lag), stats)
        assert keep(DropRule(statistic="token_weighted", max_lag=max_lag), stats)


@given(st.lists(episodes(), min_size=1, max_size=4))
def test_group_equals_pooled_episode(eps: list[list[SegmentVersions]]) -> None:
    pooled = [s for e in eps for s in e]
    assert group_lag(eps, 20) == episode_lag(pooled, 20)
    assert group_lag(eps, 20).max == max(episode_lag(e, 20).max for e in eps)
