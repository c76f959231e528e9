"""The length-bias guard: power-of-two buckets, the long-vs-short z-test, a warning per crossing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from structlog.testing import capture_logs

from staleness.config import LengthBiasConfig, StalenessConfig
from staleness.length_bias import BucketCount, LengthBias, bias_test, bucket, bucket_label


def test_buckets_are_powers_of_two() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 0, 1, 2, 2, 3, 3, 4, 4, 5]
    assert [bucket_label(k) for k in range(5)] == ["0-1", "2", "3-4", "5-8", "9-16"]


@given(st.integers(0, 10**9))
def test_every_length_falls_in_its_labelled_range(n: int) -> None:
    k = bucket(n)
    lo, hi = (0, 1) if k == 0 else (2 ** (k - 1) + 1, 2**k)
    assert lo <= n <= hi


def _counts(short: tuple[int, int], long: tuple[int, int]) -> dict[int, BucketCount]:
    """Short groups in bucket 3 (5-8 tokens), long ones in bucket 9 (257-512)."""
    return {3: BucketCount(*short), 9: BucketCount(*long)}


def test_long_dropped_more_beyond_noise_is_biased() -> None:
    v = bias_test(_counts((50, 5), (50, 25)))  # 10 % vs 50 %
    assert v.biased
    assert v.split == 9
    assert v.z == pytest.approx(4.36, abs=0.01)  # (0.5 - 0.1) / sqrt(.3 * .7 * (2 / 50))
    assert (v.short.drop_rate, v.long.drop_rate) == (0.1, 0.5)


def test_noise_short_dropped_more_and_small_counts_are_not_biased() -> None:
    assert not bias_test(_counts((50, 10), (50, 14))).biased  # z ≈ 0.94: noise
    assert bias_test(_counts((50, 25), (50, 5))).z < 0  # short dropped more: not this guard
    assert not bias_test(_counts((10, 0), (10, 10))).biased  # z is large, but < 20 per half
    assert bias_test(_counts((10, 0), (10, 10)), min_groups=10).biased
    assert not bias_test({}).biased
    assert bias_test({4: BucketCount(100, 90)}).split == -1  # one bucket: nothing to compare
    assert bias_test(_counts((30, 30), (30, 30))).z == 0.0  # all dropped: no variance, no NaN


def test_halves_split_at_the_most_even_boundary() -> None:
    counts = {
        1: BucketCount(10, 0),
        2: BucketCount(10, 0),
        5: BucketCount(15, 9),
        6: BucketCount(5, 5),
    }
    v = bias_test(counts, min_groups=5)
    assert (v.split, v.short.decided, v.long.decided) == (5, 20, 20)
    assert (v.short.dropped, v.long.dropped) == (0, 14)


@given(
    st.dictionaries(
        st.integers(0, 12),
        st.tuples(st.integers(0, 200), st.integers(0, 200)).map(
            lambda t: BucketCount(max(t), min(t))
        ),
        max_size=8,
    ),
    st.floats(0.0, 1.0),
)
def test_z_is_finite_and_a_length_blind_rule_never_fires(
    counts: dict[int, BucketCount], rate: float
) -> None:
    v = bias_test(counts, min_groups=1)
    assert math.isfinite(v.z)
    assert v.short.decided + v.long.decided in (0, sum(c.decided for c in counts.values()))
    # the same drop rate in every bucket (up to rounding, one group) never fires at z ≥ 3
    blind = {k: BucketCount(c.decided, round(rate * c.decided)) for k, c in counts.items()}
    assert not bias_test(blind, min_groups=20).biased


def test_live_guard_warns_once_per_crossing() -> None:
    guard = LengthBias(warn=True)
    with capture_logs() as logs:
        for i in range(40):  # short (8 tokens, 1 turn), 10 % dropped
            guard.add(8, 1, dropped=i % 10 == 0)
        for i in range(40):  # long (400 tokens, 6 turns), 60 % dropped
            guard.add(400, 6, dropped=i % 5 < 3)
        for _ in range(10):  # more long drops: still biased, no second warning
            guard.add(400, 6, dropped=True)
    warnings = [e for e in logs if e["event"] == "length_bias"]
    assert [w["axis"] for w in warnings] == ["tokens", "turns"]
    assert all(w["log_level"] == "warning" and "requeue" in w["hint"] for w in warnings)
    assert warnings[0]["long_from"] == "257-512"
    assert guard.biased
    # back under the threshold, then over it again: a second crossing warns again
    with capture_logs() as logs:
        for _ in range(300):
            guard.add(8, 1, dropped=True)
        assert not guard.verdict("tokens").biased
        assert not guard.verdict("turns").biased
        for _ in range(400):
            guard.add(400, 6, dropped=True)
    assert [e["axis"] for e in logs if e["event"] == "length_bias"] == ["tokens", "turns"]


def test_offline_counts_are_silent_and_flat() -> None:
    with capture_logs() as logs:
        lb = LengthBias.of([(8, 1, False)] * 30 + [(400, 6, True)] * 30)
    assert not logs  # warn=False
    flat = lb.as_dict()
    assert flat["drop/rate"] == 0.5
    assert flat["drop/length_biased"] == 1.0
    assert flat["drop/tokens/rate_5-8"] == 0.0
    assert flat["drop/tokens/rate_257-512"] == 1.0
    assert flat["drop/turns/rate_long"] == 1.0
    assert (lb.decided, lb.dropped) == (60, 30)
    assert LengthBias().as_dict() == {
        "drop/rate": 0.0,
        "drop/length_biased": 0.0,
        **{
            f"drop/{a}/{k}": 0.0
            for a in ("tokens", "turns")
            for k in ("z", "rate_short", "rate_long")
        },
    }


def test_config_defaults_and_bounds() -> None:
    cfg = StalenessConfig()
    assert cfg.length_bias == LengthBiasConfig(z_threshold=3.0, min_groups=20, requeue=False)
    parsed = StalenessConfig.model_validate({"length_bias": {"requeue": True, "max_requeues": 2}})
    assert parsed.length_bias.requeue
    assert parsed.length_bias.max_requeues == 2
    for bad in ({"max_requeues": 0}, {"z_threshold": 0}, {"min_groups": 0}, {"requeue": "maybe"}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            StalenessConfig.model_validate({"length_bias": bad})
    with pytest.raises(ValidationError, match="max_requeue"):
        StalenessConfig.model_validate({"length_bias": {"max_requeue": 1}})  # misspelt
