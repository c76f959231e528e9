"""Staleness metrics: lag histogram, length-bias guard, IS statistics, ESS, log-prob mismatch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from staleness.config import DecoupledPPO, NoCorrection, TokenMask, TruncatedIS
from staleness.corrections import correct
from staleness.errors import ShapeError
from staleness.metrics import (
    correction_metrics,
    drop_by_duration,
    effective_sample_size,
    lag_histogram,
    logprob_mismatch,
)


def test_lag_histogram_is_dense_with_overflow_bucket() -> None:
    hist = lag_histogram([0, 0, 1, 3, 4, 9], max_lag=4)
    assert hist == {
        "lag_hist/0": 2.0,
        "lag_hist/1": 1.0,
        "lag_hist/2": 0.0,
        "lag_hist/3": 1.0,
        "lag_hist/4+": 2.0,
    }
    assert sum(lag_histogram([], max_lag=2).values()) == 0.0


def test_lag_histogram_rejects_negative_lags() -> None:
    with pytest.raises(ShapeError):
        lag_histogram([1, -1])


@given(st.lists(st.integers(0, 40)), st.integers(1, 20))
def test_lag_histogram_counts_everything(lags: list[int], max_lag: int) -> None:
    hist = lag_histogram(lags, max_lag=max_lag)
    assert sum(hist.values()) == len(lags)
    assert hist[f"lag_hist/{max_lag}+"] == sum(1 for x in lags if x >= max_lag)


def _episodes(n: int, short_drop: int, long_drop: int) -> tuple[list[float], list[bool]]:
    """n short episodes (duration 1..n) then n long ones (100..), dropping the first k of each."""
    durations = [float(i) for i in range(1, n + 1)] + [100.0 + i for i in range(n)]
    kept = [i >= short_drop for i in range(n)] + [i >= long_drop for i in range(n)]
    return durations, kept


def test_length_bias_warns_when_long_episodes_dropped_twice_as_often() -> None:
    durations, kept = _episodes(10, short_drop=2, long_drop=4)
    with capture_logs() as logs:
        result = drop_by_duration(durations, kept, n_buckets=2)
    assert [b.drop_rate for b in result.buckets] == [0.2, 0.4]
    assert result.ratio == pytest.approx(2.0)
    assert result.biased
    (event,) = [e for e in logs if e["event"] == "staleness.length_bias"]
    assert event["log_level"] == "warning"
    assert event["long_drop_rate"] == 0.4
    assert event["short_drop_rate"] == 0.2


def test_no_warning_below_the_ratio() -> None:
    durations, kept = _episodes(10, short_drop=3, long_drop=5)
    with capture_logs() as logs:
        result = drop_by_duration(durations, kept, n_buckets=2)
    assert result.ratio == pytest.approx(5 / 3)
    assert not result.biased
    assert logs == []


def test_only_long_dropped_is_infinite_ratio() -> None:
    durations, kept = _episodes(10, short_drop=0, long_drop=1)
    with capture_logs() as logs:
        result = drop_by_duration(durations, kept, n_buckets=2)
    assert math.isinf(result.ratio)
    assert result.biased
    assert len(logs) == 1


def test_small_buckets_do_not_warn() -> None:
    durations, kept = _episodes(3, short_drop=0, long_drop=3)
    with capture_logs() as logs:
        result = drop_by_duration(durations, kept, n_buckets=2, min_per_bucket=8)
    assert math.isinf(result.ratio)
    assert not result.biased
    assert logs == []


def test_buckets_are_equal_count_and_sorted() -> None:
    durations = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0]
    kept = [True] * 8
    result = drop_by_duration(durations, kept, n_buckets=4)
    assert [(b.lo, b.hi, b.episodes) for b in result.buckets] == [
        (1.0, 2.0, 2),
        (3.0, 4.0, 2),
        (5.0, 7.0, 2),
        (8.0, 9.0, 2),
    ]
    flat = result.as_dict()
    assert flat["drop/rate"] == 0.0
    assert flat["drop/length_biased"] == 0.0
    assert flat["drop/duration_max_bucket_3"] == 9.0


def test_drop_by_duration_edge_inputs() -> None:
    assert drop_by_duration([], []).buckets == ()
    assert not drop_by_duration([1.0], [False]).biased
    with pytest.raises(ShapeError):
        drop_by_duration([1.0], [])
    with pytest.raises(ShapeError):
        drop_by_duration([1.0], [True], n_buckets=1)


def test_ess_hand_cases() -> None:
    mask = torch.tensor([[True, True, True, False]])
    assert effective_sample_size(torch.tensor([[1.0, 1.0, 1.0, 50.0]]), mask) == pytest.approx(3.0)
    assert effective_sample_size(torch.tensor([[4.0, 0.0, 0.0, 1.0]]), mask) == pytest.approx(1.0)
    # (1+2+3)² / (1+4+9) = 36/14
    assert effective_sample_size(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), mask) == pytest.approx(
        36 / 14
    )
    assert effective_sample_size(torch.zeros(1, 4), mask) == 0.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.just(0.0) | st.floats(1e-6, 10.0), min_size=1, max_size=30))
def test_ess_between_one_and_n(values: list[float]) -> None:
    w = torch.tensor([values])
    mask = torch.ones_like(w, dtype=torch.bool)
    ess = effective_sample_size(w, mask)
    if sum(values) == 0:
        assert ess == 0.0
    else:
        assert 1.0 - 1e-9 <= ess <= len(values) + 1e-9


def test_logprob_mismatch_over_mask() -> None:
    prox = torch.tensor([[-1.0, -2.0, -3.0]])
    behav = torch.tensor([[-1.5, -1.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    assert logprob_mismatch(prox, behav, mask) == pytest.approx(0.75)
    assert logprob_mismatch(prox, prox, torch.ones(1, 3, dtype=torch.bool)) == 0.0
    assert logprob_mismatch(prox, behav, torch.zeros(1, 3, dtype=torch.bool)) == 0.0


def _ratio_batch(ratios: list[float]) -> dict[str, torch.Tensor]:
    behav = torch.full((1, len(ratios)), math.log(0.05))
    return {
        "logp_prox": behav + torch.tensor([ratios]).log(),
        "logp_behav": behav,
        "mask": torch.ones(1, len(ratios), dtype=torch.bool),
    }


def test_correction_metrics_tis() -> None:
    batch = _ratio_batch([0.5, 1.0, 2.0, 4.0])
    cfg = TruncatedIS(cap=1.5)
    m = correction_metrics(cfg, correct(cfg, **batch), **batch)
    assert m["is/frac_truncated"] == 0.5
    assert m["is/frac_masked"] == 0.0
    assert m["is/weight_max"] == pytest.approx(1.5)
    assert m["is/weight_p99"] == pytest.approx(1.5)
    assert m["is/weight_mean"] == pytest.approx((0.5 + 1 + 1.5 + 1.5) / 4)
    assert m["is/ess"] == pytest.approx(4.5**2 / (0.25 + 1 + 2.25 + 2.25), rel=1e-5)
    assert m["mismatch/logp_abs_mean"] == pytest.approx(
        (math.log(2) + 0 + math.log(2) + math.log(4)) / 4, rel=1e-5
    )
    expected_k3 = sum(r - 1 - math.log(r) for r in (0.5, 1.0, 2.0, 4.0)) / 4
    assert m["mismatch/kl_k3"] == pytest.approx(expected_k3, rel=1e-5)


def test_correction_metrics_masking_policies() -> None:
    batch = _ratio_batch([0.25, 1.0, 1.2, 3.0])
    for cfg in (TokenMask(c=2.0), DecoupledPPO(cap=2.0)):
        m = correction_metrics(cfg, correct(cfg, **batch), **batch)
        assert m["is/frac_truncated"] == 0.0
        assert m["is/kept_tokens"] == (2.0 if isinstance(cfg, TokenMask) else 3.0)
        assert m["is/frac_masked"] == pytest.approx(0.5 if isinstance(cfg, TokenMask) else 0.25)


def test_correction_metrics_on_policy_and_empty() -> None:
    batch = _ratio_batch([1.0, 1.0])
    m = correction_metrics(NoCorrection(), correct(NoCorrection(), **batch), **batch)
    assert m["mismatch/logp_abs_mean"] == 0.0
    assert m["is/ess_frac"] == 1.0
    empty = {**batch, "mask": torch.zeros(1, 2, dtype=torch.bool)}
    m = correction_metrics(NoCorrection(), correct(NoCorrection(), **empty), **empty)
    assert all(v == 0.0 for v in m.values())


def test_correction_metrics_count_nonfinite_tokens_and_stay_finite() -> None:
    batch = _ratio_batch([0.5, 1.0, 2.0, 4.0])
    batch["logp_behav"] = batch["logp_behav"].clone()
    batch["logp_behav"][0, 1] = float("nan")
    batch["logp_prox"] = batch["logp_prox"].clone()
    batch["logp_prox"][0, 3] = float("-inf")
    for cfg in (TruncatedIS(cap=1.5), DecoupledPPO(), NoCorrection()):
        m = correction_metrics(cfg, correct(cfg, **batch), **batch)
        assert all(math.isfinite(v) for v in m.values()), (cfg, m)
        assert m["is/nonfinite_tokens"] == 2.0
        assert m["is/kept_tokens"] == 2.0
        assert m["is/frac_masked"] == 0.5
        assert m["mismatch/logp_abs_mean"] == pytest.approx(math.log(2), rel=1e-5)
    clean = _ratio_batch([1.0, 1.0])
    m = correction_metrics(NoCorrection(), correct(NoCorrection(), **clean), **clean)
    assert m["is/nonfinite_tokens"] == 0.0


def test_correction_metrics_sequence_tis_truncation_counts_tokens_of_truncated_rows() -> None:
    behav = torch.full((2, 2), math.log(0.05))
    batch = {
        "logp_prox": behav + torch.tensor([[2.0, 2.0], [1.0, 1.1]]).log(),
        "logp_behav": behav,
        "mask": torch.ones(2, 2, dtype=torch.bool),
    }
    cfg = TruncatedIS(cap=3.0, level="sequence")
    m = correction_metrics(cfg, correct(cfg, **batch), **batch)
    assert m["is/frac_truncated"] == 0.5  # row 0: 4 > 3; row 1: 1.1 ≤ 3
    assert m["is/weight_max"] == pytest.approx(3.0)
