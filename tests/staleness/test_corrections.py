"""Lag corrections: each policy on hand-computed cases, and properties over random batches."""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from staleness.config import (
    CISPO,
    GSPO,
    M2PO,
    Correction,
    DecoupledPPO,
    MaskedIS,
    NoCorrection,
    TokenMask,
    TruncatedIS,
)
from staleness.corrections import (
    batch_level,
    cispo,
    correct,
    decoupled_ppo,
    gspo,
    log_ratio,
    m2po,
    masked_is,
    no_correction,
    nonfinite_tokens,
    token_mask,
    truncated_is,
)
from staleness.errors import ShapeError
from staleness.types import Corrected, Surrogate


class Batch(TypedDict):
    logp_prox: torch.Tensor
    logp_behav: torch.Tensor
    mask: torch.Tensor


def _batch(ratios: list[list[float]], mask: list[list[bool]] | None = None) -> Batch:
    """Log probs whose behaviour ratio π_prox/μ is exactly ``ratios`` (μ fixed at 0.1)."""
    behav = torch.full((len(ratios), len(ratios[0])), math.log(0.1), dtype=torch.float64)
    prox = behav + torch.tensor(ratios, dtype=torch.float64).log()
    m = torch.tensor(mask) if mask is not None else torch.ones_like(behav, dtype=torch.bool)
    return {"logp_prox": prox.float(), "logp_behav": behav.float(), "mask": m}


def _close(t: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), rtol=1e-5, atol=1e-6)


def test_none_is_identity_on_the_mask() -> None:
    out = no_correction(**_batch([[3.0, 0.2, 1.0]], [[True, False, True]]))
    _close(out.weights, [[1.0, 0.0, 1.0]])
    assert out.mask.tolist() == [[True, False, True]]


def test_tis_truncates_at_cap() -> None:
    out = truncated_is(3.0, **_batch([[2.0, 1.0, 4.0, 0.1]]))
    _close(out.weights, [[2.0, 1.0, 3.0, 0.1]])
    assert out.mask.all()


def test_tis_cap_below_one_caps_everything() -> None:
    out = truncated_is(0.5, **_batch([[2.0, 0.25]]))
    _close(out.weights, [[0.5, 0.25]])


def test_tis_sequence_level_truncates_the_product_per_row() -> None:
    batch = _batch(
        [[2.0, 0.75, 9.0], [2.0, 2.0, 1.0], [0.5, 0.5, 1.0], [1.0, 1.0, 1.0]],
        [[True, True, False], [True, True, True], [True, True, True], [False, False, False]],
    )
    out = truncated_is(3.0, level="sequence", **batch)
    # row 0: 2 · 0.75 = 1.5 (the masked 9.0 does not count); row 1: 4 → 3; row 2: 0.25
    assert out.mask.tolist() == batch["mask"].tolist()
    _close(out.weights, [[1.5, 1.5, 0.0], [3.0, 3.0, 3.0], [0.25, 0.25, 0.25], [0.0] * 3])


def test_mis_product_rejects_whole_sequences() -> None:
    batch = _batch(
        [[2.0, 0.75, 9.0], [2.0, 2.0, 1.0], [0.5, 0.5, 1.0], [1.0, 1.0, 1.0]],
        [[True, True, False], [True, True, True], [True, True, True], [False, False, False]],
    )
    out = masked_is(MaskedIS(upper=2.0), **batch)
    # row 0: 2 · 0.75 = 1.5 (the masked 9.0 does not count) → kept, weight 1.5
    # row 1: 4 > 2 → rejected; row 2: 0.25 < 0.5 → rejected; row 3: no valid token
    assert out.mask.tolist() == [
        [True, True, False],
        [False, False, False],
        [False, False, False],
        [False, False, False],
    ]
    _close(out.weights, [[1.5, 1.5, 0.0], [0.0] * 3, [0.0] * 3, [0.0] * 3])


def test_mis_explicit_lower_and_no_reweight() -> None:
    out = masked_is(MaskedIS(upper=2.0, lower=0.2, reweight=False), **_batch([[0.5, 0.5]]))
    assert out.mask.all()
    _close(out.weights, [[1.0, 1.0]])


def test_mis_geometric_uses_per_token_mean() -> None:
    cfg = MaskedIS(upper=1.01, aggregate="geometric", reweight=False)
    out = masked_is(cfg, **_batch([[2.0, 0.5, 1.0], [1.02, 1.02, 1.02]]))
    assert out.mask.tolist() == [[True, True, True], [False, False, False]]
    _close(out.weights, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def test_decoupled_ppo_weights_by_ratio_and_masks_above_cap() -> None:
    batch = _batch([[2.0, 4.0, 0.1]])
    capped = decoupled_ppo(3.0, **batch)
    assert capped.mask.tolist() == [[True, False, True]]
    _close(capped.weights, [[2.0, 0.0, 0.1]])


def test_decoupled_ppo_uncapped_applies_no_behaviour_weight() -> None:
    """AReaL 1.0.4 ``rejection_sampling=None``: the clip moves to π_prox, no ρ_t weight."""
    uncapped = decoupled_ppo(None, **_batch([[2.0, 4.0, 0.1]]))
    assert uncapped.mask.all()
    _close(uncapped.weights, [[1.0, 1.0, 1.0]])
    absurd = decoupled_ppo(
        None,
        logp_prox=torch.tensor([[0.0]]),
        logp_behav=torch.tensor([[-500.0]]),
        mask=torch.tensor([[True]]),
    )
    assert absurd.weights.tolist() == [[1.0]]


NONFINITE_POLICIES: list[Correction] = [
    NoCorrection(),
    NoCorrection(anchor="behaviour"),
    TruncatedIS(cap=2.0),
    TruncatedIS(cap=2.0, level="sequence"),
    MaskedIS(upper=3.0),
    MaskedIS(upper=1.5, aggregate="geometric", reweight=False),
    DecoupledPPO(),
    DecoupledPPO(cap=2.0),
    TokenMask(c=2.0, reweight=True),
    M2PO(threshold=0.01),
    CISPO(),
    GSPO(),
]


@pytest.mark.parametrize("cfg", NONFINITE_POLICIES)
@pytest.mark.parametrize(
    ("prox", "behav"),
    [(-1.0, math.nan), (-1.0, -math.inf), (math.nan, -1.0), (-math.inf, -math.inf)],
)
def test_nonfinite_log_ratio_is_masked_by_every_policy(
    cfg: Correction, prox: float, behav: float
) -> None:
    """One broken valid token: masked, counted, and the rest decided as if it were not there."""
    clean = _batch([[1.2, 0.9, 1.1], [1.0, 1.3, 0.8]])
    dirty: Batch = {
        "logp_prox": clean["logp_prox"].clone(),
        "logp_behav": clean["logp_behav"].clone(),
        "mask": clean["mask"],
    }
    dirty["logp_prox"][0, 1] = prox
    dirty["logp_behav"][0, 1] = behav
    out = correct(cfg, **dirty)
    assert torch.isfinite(out.weights).all()
    assert not bool(out.mask[0, 1])
    assert out.valid is not None
    assert out.valid.all()
    assert nonfinite_tokens(**dirty).tolist() == [[False, True, False], [False, False, False]]
    without = clean | {"mask": clean["mask"].clone()}
    without["mask"][0, 1] = False
    want = correct(cfg, **without)
    assert torch.equal(out.mask, want.mask)
    torch.testing.assert_close(out.weights, want.weights)


def test_token_mask_two_sided() -> None:
    batch = _batch([[2.0, 0.5, 2.5, 0.4, 1.0]])
    plain = token_mask(2.0, **batch)
    assert plain.mask.tolist() == [[True, True, False, False, True]]
    _close(plain.weights, [[1.0, 1.0, 0.0, 0.0, 1.0]])
    icepop = token_mask(2.0, reweight=True, **batch)
    assert icepop.mask.tolist() == plain.mask.tolist()
    _close(icepop.weights, [[2.0, 0.5, 0.0, 0.0, 1.0]])


def test_m2po_masks_the_largest_squared_log_ratios_until_the_mean_is_below_threshold() -> None:
    # (log ρ)² = 4, 1, 0.25, 0, 0, 0 over the batch (rows pooled): the means of the tails are
    # 0.875, 0.25, ... → masking the 4 leaves a mean of 0.25 < 0.3
    batch = _batch([[1.0, math.exp(-1), math.exp(-2)], [math.exp(0.5), 1.0, 1.0]])
    out = m2po(0.3, **batch)
    assert out.mask.tolist() == [[True, True, False], [True, True, True]]
    _close(out.weights, [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert m2po(0.1, **batch).mask.tolist() == [[True, False, False], [True, True, True]]
    # no tail's mean is below the threshold: every token but the smallest is masked, as AReaL
    stale = _batch([[2.0, 0.5, 4.0]])
    assert m2po(0.1, **stale).mask.tolist() == [[False, True, False]]
    # a statistic of the batch: the same row is decided differently beside another
    alone = m2po(0.3, **_batch([[1.0, math.exp(-1), math.exp(-2)]]))
    assert alone.mask.tolist() == [[True, False, False]]
    assert batch_level(M2PO())
    assert not batch_level(TokenMask())


def test_cispo_and_gspo_weight_nothing_and_name_their_term() -> None:
    batch = _batch([[2.0, 0.5, 1.3]], [[True, True, False]])
    for out in (cispo(CISPO(), **batch), gspo(GSPO(), **batch)):
        assert out.mask.tolist() == [[True, True, False]]
        _close(out.weights, [[1.0, 1.0, 0.0]])
    behaviour = cispo(CISPO(clip_eps=0.5, clip_eps_high=2.0), **batch)
    assert behaviour.surrogate == Surrogate("cispo", 0.5, 2.0)
    assert behaviour.log_rho is not None
    torch.testing.assert_close(behaviour.log_rho, log_ratio(**batch))
    assert cispo(CISPO(anchor="proximal"), **batch).log_rho is None
    assert gspo(GSPO(), **batch).surrogate == Surrogate("gspo", 3e-4, 4e-4)


def test_none_anchored_on_behaviour_weights_nothing_and_carries_the_log_ratio() -> None:
    batch = _batch([[2.0, 0.5, 1.3]], [[True, True, False]])
    out = correct(NoCorrection(anchor="behaviour"), **batch)
    assert out.mask.tolist() == [[True, True, False]]
    _close(out.weights, [[1.0, 1.0, 0.0]])
    assert out.surrogate is None
    assert out.log_rho is not None
    torch.testing.assert_close(out.log_rho, log_ratio(**batch))
    assert correct(NoCorrection(), **batch).log_rho is None


@pytest.mark.parametrize(
    "cfg",
    [
        NoCorrection(),
        TruncatedIS(cap=1.5),
        TruncatedIS(cap=1.5, level="sequence"),
        MaskedIS(upper=3.0),
        MaskedIS(upper=1.2, aggregate="geometric", reweight=False),
        DecoupledPPO(cap=2.0),
        DecoupledPPO(),
        TokenMask(c=1.5, reweight=True),
        M2PO(threshold=0.1),
        CISPO(anchor="proximal"),
        GSPO(),
    ],
)
def test_correct_dispatches_to_the_policy(cfg: Correction) -> None:
    batch = _batch([[2.0, 0.5, 1.3], [1.1, 0.9, 5.0]])
    got = correct(cfg, **batch)
    match cfg:
        case NoCorrection():
            want = no_correction(**batch)
        case TruncatedIS():
            want = truncated_is(cfg.cap, level=cfg.level, **batch)
        case MaskedIS():
            want = masked_is(cfg, **batch)
        case DecoupledPPO():
            want = decoupled_ppo(cfg.cap, **batch)
        case TokenMask():
            want = token_mask(cfg.c, reweight=cfg.reweight, **batch)
        case M2PO():
            want = m2po(cfg.threshold, **batch)
        case CISPO():
            want = cispo(cfg, **batch)
        case GSPO():
            want = gspo(cfg, **batch)
    torch.testing.assert_close(got.weights, want.weights)
    assert torch.equal(got.mask, want.mask)
    assert got.surrogate == want.surrogate


def test_shape_errors() -> None:
    good = _batch([[1.0, 2.0]])
    with pytest.raises(ShapeError):
        correct(NoCorrection(), **(good | {"mask": torch.ones(1, 3, dtype=torch.bool)}))
    with pytest.raises(ShapeError):
        correct(
            NoCorrection(), logp_prox=torch.zeros(2), logp_behav=torch.zeros(2), mask=torch.ones(2)
        )
    with pytest.raises(ShapeError, match="floating"):
        correct(NoCorrection(), **(good | {"logp_prox": torch.zeros(1, 2, dtype=torch.long)}))


# ---- properties -------------------------------------------------------------------------------

ALL_POLICIES: list[Correction] = [
    NoCorrection(),
    TruncatedIS(cap=0.7),
    TruncatedIS(cap=2.0),
    TruncatedIS(cap=0.7, level="sequence"),
    TruncatedIS(cap=2.0, level="sequence"),
    MaskedIS(upper=2.0),
    MaskedIS(upper=5.0, lower=0.5, reweight=False),
    MaskedIS(upper=1.05, aggregate="geometric", reweight=False),
    DecoupledPPO(),
    DecoupledPPO(cap=1.5),
    TokenMask(c=2.0),
    TokenMask(c=1.2, reweight=True),
    M2PO(threshold=0.04),
    M2PO(threshold=1e-6),
    CISPO(),
    CISPO(anchor="proximal"),
    GSPO(),
]


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    logp = hnp.arrays(np.float32, (b, t), elements=st.floats(-12.0, 0.0, width=32))
    mask = draw(hnp.arrays(np.bool_, (b, t)))
    return {
        "logp_prox": torch.from_numpy(draw(logp)),
        "logp_behav": torch.from_numpy(draw(logp)),
        "mask": torch.from_numpy(mask),
    }


def _bound(cfg: Correction) -> tuple[float, float]:
    """Range a kept token's weight must lie in."""
    match cfg:
        case NoCorrection():
            return 1.0, 1.0
        case TruncatedIS(cap=cap):
            return 0.0, cap
        case MaskedIS():
            return (cfg.lower_bound, cfg.upper) if cfg.reweight else (1.0, 1.0)
        case DecoupledPPO(cap=cap):
            return (0.0, cap) if cap is not None else (1.0, 1.0)
        case TokenMask(c=c, reweight=reweight):
            return (1 / c, c) if reweight else (1.0, 1.0)
        case M2PO() | CISPO() | GSPO():
            return 1.0, 1.0


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(ALL_POLICIES))
def test_weights_bounded_masks_subset_and_zero_off_mask(batch: Batch, cfg: Correction) -> None:
    out = correct(cfg, **batch)
    lo, hi = _bound(cfg)
    kept = out.weights[out.mask]
    tol = 1e-5 * max(hi, 1.0) if math.isfinite(hi) else 0.0
    assert torch.isfinite(out.weights).all()
    assert (kept >= lo - 1e-5 * max(lo, 1.0)).all()
    assert (kept <= hi + tol).all()
    assert not (out.mask & ~batch["mask"]).any()
    assert (out.weights[~out.mask] == 0).all()
    assert out.mask.dtype == torch.bool
    assert not out.weights.requires_grad


@settings(max_examples=60, deadline=None)
@given(batches())
def test_none_is_identity(batch: Batch) -> None:
    out = correct(NoCorrection(), **batch)
    assert torch.equal(out.mask, batch["mask"])
    assert torch.equal(out.weights, batch["mask"].float())


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(ALL_POLICIES), st.floats(0.0, 1.0))
def test_masks_monotone_in_ratio(batch: Batch, cfg: Correction, shrink: float) -> None:
    """Moving π_prox toward μ (shrinking every log ratio) never masks a token that was kept."""
    far = correct(cfg, **batch)
    prox = batch["logp_behav"] + shrink * (batch["logp_prox"] - batch["logp_behav"])
    near = correct(cfg, **(batch | {"logp_prox": prox}))
    assert not (far.mask & ~near.mask).any()


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(ALL_POLICIES))
def test_padding_values_never_leak(batch: Batch, cfg: Correction) -> None:
    clean = correct(cfg, **batch)
    pad = ~batch["mask"]
    dirty_prox = batch["logp_prox"].masked_fill(pad, float("nan"))
    dirty_behav = batch["logp_behav"].masked_fill(pad, float("-inf"))
    dirty = correct(cfg, logp_prox=dirty_prox, logp_behav=dirty_behav, mask=batch["mask"])
    assert torch.equal(clean.mask, dirty.mask)
    assert torch.equal(clean.weights, dirty.weights)


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(ALL_POLICIES))
def test_on_policy_keeps_everything_at_weight_one(batch: Batch, cfg: Correction) -> None:
    """π_prox == μ: every correction is the identity (TIS only where its cap is ≥ 1)."""
    out = correct(
        cfg, logp_prox=batch["logp_behav"], logp_behav=batch["logp_behav"], mask=batch["mask"]
    )
    assert torch.equal(out.mask, batch["mask"])
    expected = 0.7 if isinstance(cfg, TruncatedIS) and cfg.cap < 1 else 1.0
    torch.testing.assert_close(out.weights, batch["mask"].float() * expected)


@pytest.mark.parametrize(
    "cfg",
    [TruncatedIS(cap=1.5, level="sequence"), NoCorrection(anchor="behaviour"), CISPO(), GSPO()],
    ids=str,
)
def test_rows_of_a_batch_correction_are_the_correction_of_those_rows(cfg: Correction) -> None:
    mask = [[True] * 3, [True, True, False], [True, False, False]]  # rows 1-2 fit in 2 columns
    batch = _batch([[2.0, 0.5, 1.3], [1.1, 0.9, 5.0], [0.7, 1.0, 1.2]], mask)
    part = correct(cfg, **batch).rows(slice(1, 3), 2)
    alone = correct(cfg, **{k: v[1:3, :2] for k, v in batch.items()})  # type: ignore[misc]
    assert torch.equal(part.mask, alone.mask)
    torch.testing.assert_close(part.weights, alone.weights)
    assert part.surrogate == alone.surrogate
    assert (part.log_rho is None) == (alone.log_rho is None)


def test_corrected_is_frozen() -> None:
    out = correct(NoCorrection(), **_batch([[1.0]]))
    assert isinstance(out, Corrected)
    with pytest.raises(AttributeError):
        out.mask = out.mask  # type: ignore[misc]
