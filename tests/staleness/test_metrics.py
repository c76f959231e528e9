"""Staleness metrics: lag histogram, IS statistics, ESS, log-prob mismatch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness.config import DecoupledPPO, NoCorrection, TokenMask, TruncatedIS
from staleness.corrections import correct
from staleness.errors import ShapeError
from staleness.metrics import (
    correction_metrics,
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
