"""Loss math: GRPO advantages, PPO-clip composed with corrections (vs a loop reference), KL."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness.config import (
    Correction,
    DecoupledPPO,
    MaskedIS,
    NoCorrection,
    TokenMask,
    TruncatedIS,
)
from staleness.corrections import correct
from staleness.errors import ShapeError
from staleness.loss import LossAgg, aggregate, group_advantages, kl_penalty, policy_loss
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
) -> torch.Tensor:
    """Token-by-token PPO-clip, written as plainly as possible."""
    rows: list[list[torch.Tensor]] = []
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
    if agg == "token_mean":
        return torch.stack(terms).sum() / len(terms)
    per_seq = [torch.stack(row).sum() / len(row) for row in rows if row]
    return torch.stack(per_seq).sum() / len(per_seq)


POLICIES: list[Correction] = [
    NoCorrection(),
    TruncatedIS(cap=1.5),
    MaskedIS(upper=3.0),
    DecoupledPPO(cap=2.0),
    TokenMask(c=1.5, reweight=True),
]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    policy=st.sampled_from(POLICIES),
    agg=st.sampled_from(["token_mean", "seq_mean"]),
    eps_high=st.sampled_from([None, 0.28]),
    dual=st.sampled_from([None, 3.0]),
)
def test_loss_matches_loop_reference(
    seed: int, policy: Correction, agg: LossAgg, eps_high: float | None, dual: float | None
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
    )
    ref = _reference_loss(
        logp, logp_prox, adv, corrected, 0.2, eps_high if eps_high is not None else 0.2, dual, agg
    )
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
