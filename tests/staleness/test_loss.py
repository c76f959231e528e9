"""Loss math: GRPO advantages, PPO-clip composed with corrections (vs a loop reference), KL."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
from staleness.corrections import correct
from staleness.errors import ShapeError
from staleness.loss import (
    LossAgg,
    Normalizer,
    aggregate,
    group_advantages,
    kl_penalty,
    normaliser,
    policy_loss,
)
from staleness.types import Corrected

# ---- group advantages -------------------------------------------------------------------------


def test_group_advantages_hand_case() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0]), 2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0]))


def test_group_advantages_three_per_group() -> None:
    # mean 2, population std sqrt(2/3)
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0]), 3, eps=0.0)
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(adv, torch.tensor([-1 / s, 0.0, 1 / s]))


def test_equal_rewards_give_zeros_not_nan() -> None:
    adv = group_advantages(torch.tensor([0.7, 0.7, 0.7, 0.0, 0.0, 0.0]), 3)
    assert torch.equal(adv, torch.zeros(6))
    assert torch.equal(group_advantages(torch.tensor([2.0, 5.0]), 1), torch.zeros(2))


def test_equal_non_binary_rewards_give_exact_zeros() -> None:
    """A float32 mean of twelve 2.2s is an ulp off; the advantage must still be exactly 0."""
    for normalize_std in (True, False):
        adv = group_advantages(torch.full((12,), 2.2), 12, normalize_std=normalize_std)
        assert torch.equal(adv, torch.zeros(12)), adv
    mixed = torch.tensor([2.2] * 12 + [0.3] * 5 + [1e6] * 3 + [-7.1] * 4)
    for size in (4, 12):
        if mixed.shape[0] % size == 0:
            adv = group_advantages(mixed[: (mixed.shape[0] // size) * size], size)
            flat = mixed.reshape(-1, size)
            equal = (flat == flat[:, :1]).all(dim=1)
            assert torch.equal(adv.reshape(-1, size)[equal], torch.zeros_like(flat[equal]))


def test_near_equal_rewards_count_as_equal() -> None:
    r = torch.full((8,), 2.2)
    r[3] = torch.nextafter(r[3], torch.tensor(3.0))  # one ulp above: rounding noise, no signal
    assert torch.equal(group_advantages(r, 8), torch.zeros(8))
    r64 = torch.tensor([0.1 + 0.2, 0.3, 0.3, 0.1 + 0.2], dtype=torch.float64)  # one ulp apart
    assert torch.equal(group_advantages(r64, 4), torch.zeros(4, dtype=torch.float64))
    # a real difference, however small against the rewards, is still signal
    adv = group_advantages(torch.tensor([2.2, 2.2, 2.2, 2.3]), 4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1 / 3**0.5] * 3 + [3**0.5]))


def test_unnormalized_is_centred_rewards() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_integer_rewards_become_float() -> None:
    adv = group_advantages(torch.tensor([1, 0]), 2, eps=0.0)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]))


@pytest.mark.parametrize(("shape", "group_size"), [((5,), 2), ((2, 2), 2), ((4,), 0)])
def test_group_advantages_shape_errors(shape: tuple[int, ...], group_size: int) -> None:
    with pytest.raises(ShapeError):
        group_advantages(torch.zeros(shape), group_size)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.lists(st.floats(-5, 5), min_size=24, max_size=24),
    st.floats(-3, 3),
)
def test_group_advantages_properties(
    groups: int, size: int, values: list[float], shift: float
) -> None:
    r = torch.tensor(values[: groups * size], dtype=torch.float64)
    adv = group_advantages(r, size)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(
        adv.reshape(groups, size).sum(dim=1),
        torch.zeros(groups, dtype=torch.float64),
        atol=1e-9,
        rtol=0,
    )
    # Shifting a group's rewards does not change its advantages.
    torch.testing.assert_close(group_advantages(r + shift, size), adv, atol=1e-6, rtol=1e-6)
    # Normalised advantages have population std ≤ 1.
    assert (adv.reshape(groups, size).std(dim=1, correction=0) <= 1 + 1e-9).all()


# ---- PPO-clip loss ----------------------------------------------------------------------------


def _ones(b: int, t: int) -> Corrected:
    return Corrected(weights=torch.ones(b, t), mask=torch.ones(b, t, dtype=torch.bool))


@pytest.mark.parametrize(
    ("ratio", "adv", "dual", "expected_loss", "clipped"),
    [
        (1.5, 1.0, None, -1.2, True),  # positive advantage, ratio above 1+ε: clipped
        (0.5, 1.0, None, -0.5, False),  # positive advantage, ratio low: unclipped (pessimistic)
        (0.5, -1.0, None, 0.8, True),  # negative advantage, ratio below 1−ε: clipped
        (5.0, -1.0, None, 5.0, False),  # negative advantage, large ratio: unclipped
        (5.0, -1.0, 3.0, 3.0, False),  # … bounded by dual clip at −c·A
    ],
)
def test_ppo_clip_hand_cases(
    ratio: float, adv: float, dual: float | None, expected_loss: float, clipped: bool
) -> None:
    logp_prox = torch.tensor([[math.log(0.2)]])
    logp = (logp_prox + math.log(ratio)).requires_grad_()
    loss, metrics = policy_loss(
        logp, logp_prox, torch.tensor([adv]), _ones(1, 1), clip_eps=0.2, dual_clip_c=dual
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["clip_frac"] == float(clipped)
    assert metrics["dual_clip_frac"] == float(dual is not None)
    assert metrics["ratio_mean"] == pytest.approx(ratio, rel=1e-5)


def test_clip_eps_high_is_asymmetric() -> None:
    logp_prox = torch.tensor([[0.0, 0.0]]).log_softmax(-1)
    logp = logp_prox + torch.tensor([[math.log(1.25), math.log(0.75)]])
    adv = torch.tensor([1.0])
    loss, m = policy_loss(logp, logp_prox, adv, _ones(1, 2), clip_eps=0.2, clip_eps_high=0.28)
    # token 0: ratio 1.25 < 1.28 not clipped → −1.25; token 1: ratio 0.75, A>0 → −0.75 (min branch)
    assert loss.item() == pytest.approx(-(1.25 + 0.75) / 2, rel=1e-5)
    assert m["clip_frac"] == 0.0


def test_on_policy_first_step_is_vanilla_policy_gradient() -> None:
    logp_prox = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.3, 0.3, 0.9]]))
    logp = logp_prox.clone().requires_grad_()
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    corrected = correct(NoCorrection(), logp_prox=logp_prox, logp_behav=logp_prox, mask=mask)
    loss, m = policy_loss(logp, logp_prox, adv, corrected)
    assert loss.item() == pytest.approx(-(2 * 2 - 1 * 3) / 5)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = -torch.tensor([[2.0, 2.0, 0.0], [-1.0, -1.0, -1.0]]) / 5
    torch.testing.assert_close(grad, expected)
    assert m["kept_tokens"] == 5.0
    assert m["approx_kl"] == 0.0
    assert m["ratio_mean"] == 1.0


def test_weights_scale_the_loss_and_empty_mask_gives_zero() -> None:
    logp_prox = torch.zeros(1, 2)
    logp = torch.zeros(1, 2, requires_grad=True)
    half = Corrected(weights=torch.full((1, 2), 0.5), mask=torch.ones(1, 2, dtype=torch.bool))
    loss, _ = policy_loss(logp, logp_prox, torch.tensor([1.0]), half)
    assert loss.item() == pytest.approx(-0.5)
    empty = Corrected(weights=torch.zeros(1, 2), mask=torch.zeros(1, 2, dtype=torch.bool))
    loss, m = policy_loss(logp, logp_prox, torch.tensor([1.0]), empty)
    assert loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.equal(grad, torch.zeros(1, 2))
    assert m["kept_tokens"] == 0.0


def test_nan_at_masked_positions_does_not_leak() -> None:
    logp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    logp_prox = torch.tensor([[-1.2, float("inf")]])
    mask = torch.tensor([[True, False]])
    corrected = Corrected(weights=mask.float(), mask=mask)
    for agg in ("token_mean", "seq_mean"):
        loss, m = policy_loss(logp, logp_prox, torch.tensor([1.0]), corrected, loss_agg=agg)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss)
        assert torch.isfinite(grad).all()
        assert grad[0, 1] == 0.0
        assert all(math.isfinite(v) for v in m.values())


def test_policy_loss_shape_and_parameter_errors() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(ShapeError):
        policy_loss(z, z, torch.zeros(3), _ones(2, 3))
    with pytest.raises(ShapeError):
        policy_loss(z, z, torch.zeros(2), _ones(2, 2))
    with pytest.raises(ShapeError):
        policy_loss(z, torch.zeros(2, 2), torch.zeros(2), _ones(2, 3))
    with pytest.raises(ShapeError):
        policy_loss(z, z, torch.zeros(2), _ones(2, 3), clip_eps=0.0)
    with pytest.raises(ShapeError):
        policy_loss(z, z, torch.zeros(2), _ones(2, 3), dual_clip_c=1.0)


def _reference_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    adv: torch.Tensor,
    corrected: Corrected,
    eps_low: float,
    eps_high: float,
    dual: float | None,
    agg: str,
    normalizer: str = "kept",
    dr_grpo_tokens: int = 0,
) -> torch.Tensor:
    """Token-by-token PPO-clip, written as plainly as possible."""
    rows: list[list[torch.Tensor]] = []
    valid = corrected.valid if corrected.valid is not None else corrected.mask
    counts = [
        sum(
            bool(valid[b, t] if normalizer == "original" else corrected.mask[b, t])
            for t in range(logp.shape[1])
        )
        for b in range(logp.shape[0])
    ]
    for b in range(logp.shape[0]):
        row = []
        a = float(adv[b])
        for t in range(logp.shape[1]):
            if not bool(corrected.mask[b, t]):
                continue
            r = torch.exp(logp[b, t] - float(logp_prox[b, t]))
            r_clip = torch.clamp(r, 1 - eps_low, 1 + eps_high)
            term = torch.maximum(-a * r, -a * r_clip)
            if dual is not None and a < 0:
                term = torch.minimum(term, torch.tensor(-dual * a, dtype=term.dtype))
            row.append(term * float(corrected.weights[b, t]))
        rows.append(row)
    terms = [x for row in rows for x in row]
    if not terms:
        return logp.sum() * 0
    if agg == "dr_grpo":
        return torch.stack(terms).sum() / (logp.shape[0] * dr_grpo_tokens)
    if agg == "token_mean":
        return torch.stack(terms).sum() / sum(counts)
    per_seq = [
        torch.stack(row).sum() / n if row else logp.sum() * 0
        for row, n in zip(rows, counts, strict=True)
    ]
    return torch.stack([x for x, n in zip(per_seq, counts, strict=True) if n]).sum() / sum(
        1 for n in counts if n
    )


POLICIES: list[Correction] = [
    NoCorrection(),
    TruncatedIS(cap=1.5),
    TruncatedIS(cap=1.5, level="sequence"),
    MaskedIS(upper=3.0),
    DecoupledPPO(cap=2.0),
    DecoupledPPO(),
    TokenMask(c=1.5, reweight=True),
    M2PO(threshold=0.05),
]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    policy=st.sampled_from(POLICIES),
    agg=st.sampled_from(["token_mean", "seq_mean", "dr_grpo"]),
    normalizer=st.sampled_from(["kept", "original"]),
    eps_high=st.sampled_from([None, 0.28]),
    dual=st.sampled_from([None, 3.0]),
)
def test_loss_matches_loop_reference(
    seed: int,
    policy: Correction,
    agg: LossAgg,
    normalizer: Normalizer,
    eps_high: float | None,
    dual: float | None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, t = 4, 6
    logp_behav = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    logp_prox = logp_behav + 0.4 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    logp_prox = logp_prox.clamp(max=0)
    logp = (
        logp_prox + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    ).requires_grad_()
    mask = torch.rand(b, t, generator=gen) < 0.8
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    corrected = correct(policy, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
    loss, _ = policy_loss(
        logp,
        logp_prox,
        adv,
        corrected,
        clip_eps=0.2,
        clip_eps_high=eps_high,
        dual_clip_c=dual,
        loss_agg=agg,
        normalizer=normalizer,
        dr_grpo_tokens=7 if agg == "dr_grpo" else None,
    )
    high = eps_high if eps_high is not None else 0.2
    ref = _reference_loss(logp, logp_prox, adv, corrected, 0.2, high, dual, agg, normalizer, 7)
    torch.testing.assert_close(loss, ref.to(loss.dtype), rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(grad, ref_grad.to(grad.dtype), rtol=1e-5, atol=1e-7)


def test_per_token_advantages_accepted() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, 3.0]]), _ones(1, 2))
    assert loss.item() == pytest.approx(-2.0)


# ---- aggregation and KL -----------------------------------------------------------------------


def test_aggregate_modes() -> None:
    values = torch.tensor([[1.0, 3.0, 100.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(8 / 3)
    # seq means: 2 and 4; the empty third row does not count
    assert aggregate(values, mask, "seq_mean").item() == pytest.approx(3.0)
    # Dr. GRPO: the sum over the kept tokens / (rows · the constant), whatever the mask
    assert aggregate(values, mask, "dr_grpo", dr_grpo_tokens=4).item() == pytest.approx(8 / 12)
    with pytest.raises(ShapeError, match="dr_grpo_tokens"):
        aggregate(values, mask, "dr_grpo")


def test_original_normalizer_counts_the_tokens_before_masking() -> None:
    """AReaL divides by the valid tokens; sprawl's default divides by the kept ones."""
    values = torch.tensor([[1.0, 3.0, 100.0], [4.0, 50.0, 0.0], [9.0, 9.0, 9.0]])
    valid = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    kept = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    assert aggregate(values, kept, "token_mean", valid=valid).item() == pytest.approx(8 / 3)
    got = aggregate(values, kept, "token_mean", normalizer="original", valid=valid)
    assert got.item() == pytest.approx(8 / 6)
    # per sequence: 4/3, 4/2, 0/1 over the three rows that had valid tokens
    got = aggregate(values, kept, "seq_mean", normalizer="original", valid=valid)
    assert got.item() == pytest.approx((4 / 3 + 4 / 2 + 0) / 3)
    assert aggregate(values, kept, "token_mean", normalizer="original").item() == pytest.approx(
        8 / 3
    )  # no valid mask given: nothing was masked


@pytest.mark.parametrize(
    ("loss_agg", "normalizer"),
    [
        ("token_mean", "kept"),
        ("token_mean", "original"),
        ("seq_mean", "kept"),
        ("seq_mean", "original"),
        ("dr_grpo", "kept"),
    ],
)
def test_micro_batch_sums_over_the_whole_batch_normaliser_give_the_batch_loss(
    loss_agg: LossAgg, normalizer: Normalizer
) -> None:
    """Gradient accumulation: each group of rows' sum (``denominator=1``) divided by the whole
    batch's :func:`normaliser` adds up to the batch's aggregate; a per-group mean does not."""
    values = torch.tensor([[1.0, 3.0, 100.0], [4.0, 50.0, 0.0], [9.0, 9.0, 9.0], [2.0, 0.0, 5.0]])
    valid = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    kept = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 1, 1]], dtype=torch.bool)
    kw: dict[str, Any] = dict(normalizer=normalizer, valid=valid)
    if loss_agg == "dr_grpo":
        kw["dr_grpo_tokens"] = 4
    whole = aggregate(values, kept, loss_agg, **kw)
    den = normaliser(kept, loss_agg, **kw)
    split = [slice(0, 1), slice(1, 4)]  # uneven: 1 row and 3 rows
    summed = sum(
        aggregate(values[r], kept[r], loss_agg, **{**kw, "valid": valid[r]}, denominator=1.0)
        for r in split
    )
    assert float(summed) / den == pytest.approx(whole.item())
    means = sum(aggregate(values[r], kept[r], loss_agg, **{**kw, "valid": valid[r]}) for r in split)
    assert float(means) / len(split) != pytest.approx(whole.item())


def test_original_normalizer_keeps_per_token_gradients_of_kept_tokens() -> None:
    """Masking half the tokens must not double the gradient of the others ("original")."""
    logp_behav = torch.log(torch.tensor([[0.1, 0.1, 0.1, 0.1]]))
    logp_prox = logp_behav + torch.log(torch.tensor([[1.0, 1.0, 10.0, 10.0]]))
    mask = torch.ones(1, 4, dtype=torch.bool)
    corrected = correct(
        DecoupledPPO(cap=2.0), logp_prox=logp_prox, logp_behav=logp_behav, mask=mask
    )
    assert corrected.mask.tolist() == [[True, True, False, False]]
    grads = {}
    for normalizer in ("kept", "original"):
        logp = logp_prox.clone().requires_grad_()
        loss, _ = policy_loss(
            logp, logp_prox, torch.tensor([1.0]), corrected, normalizer=normalizer
        )
        (grads[normalizer],) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grads["kept"][0, :2], torch.tensor([-0.5, -0.5]))
    torch.testing.assert_close(grads["original"][0, :2], torch.tensor([-0.25, -0.25]))
    assert (grads["original"][0, 2:] == 0).all()


@pytest.mark.parametrize(
    "policy", [*POLICIES, TruncatedIS(cap=2.0), DecoupledPPO(cap=None), CISPO(), GSPO()]
)
@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
def test_one_nonfinite_engine_logprob_is_masked_not_nan(policy: Correction, bad: float) -> None:
    """A NaN (or ±inf) engine log prob on a valid token leaves the loss and gradient finite and
    equal to the loss without that token, under every correction."""
    gen = torch.Generator().manual_seed(3)
    logp_behav = -torch.rand(2, 5, generator=gen) * 2
    logp_prox = logp_behav + 0.1 * torch.randn(2, 5, generator=gen)
    mask = torch.ones(2, 5, dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5])
    dirty = logp_behav.clone()
    dirty[0, 2] = bad
    without = mask.clone()
    without[0, 2] = False
    results = []
    for behav, m in ((dirty, mask), (logp_behav, without)):
        logp = logp_prox.clone().requires_grad_()
        corrected = correct(policy, logp_prox=logp_prox, logp_behav=behav, mask=m)
        loss, metrics = policy_loss(logp, logp_prox, adv, corrected)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss), (policy, bad)
        assert torch.isfinite(grad).all()
        assert all(math.isfinite(v) for v in metrics.values())
        results.append((loss.detach(), grad, corrected))
    (loss_d, grad_d, corr_d), (loss_c, grad_c, _) = results
    assert not bool(corr_d.mask[0, 2])
    torch.testing.assert_close(loss_d, loss_c)
    torch.testing.assert_close(grad_d, grad_c)


def test_kl_estimators_hand_case() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.1]]))
    mask = torch.tensor([[True, False]])
    d = math.log(0.5)
    torch.testing.assert_close(
        kl_penalty(logp, ref, mask, estimator="k1"), torch.tensor([[-d, 0.0]])
    )
    torch.testing.assert_close(
        kl_penalty(logp, ref, mask, estimator="k2"), torch.tensor([[d * d / 2, 0.0]])
    )
    torch.testing.assert_close(
        kl_penalty(logp, ref, mask), torch.tensor([[math.exp(d) - d - 1, 0.0]])
    )


def test_k3_is_nonnegative_and_zero_at_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=gen).requires_grad_()
    ref = -torch.rand(3, 5, generator=gen)
    mask = torch.ones(3, 5, dtype=torch.bool)
    assert (kl_penalty(logp, ref, mask) >= 0).all()
    same = kl_penalty(logp, logp.detach(), mask)
    assert torch.equal(same, torch.zeros(3, 5))
    kl = aggregate(kl_penalty(logp, ref, mask), mask)
    (grad,) = torch.autograd.grad(kl, logp)
    assert torch.isfinite(grad).all()
    assert grad.abs().sum() > 0
