"""The pure loss math a trainer composes: GRPO advantages, PPO-clip with a lag correction, KL.

All functions are pure over tensors; the trainer owns the model, the optimizer and the forward
passes. Shapes: B sequences of T positions; ``logp`` (current policy π_θ, with grad) and
``logp_prox`` (π_prox, the policy before this update) are [B, T]; per-sequence advantages are [B]
(per-token [B, T] are accepted too); a :class:`~staleness.types.Corrected` carries the lag
correction's [B, T] weights and mask (see :mod:`staleness.corrections`).

The policy term, per valid token (``r_t = π_θ/π_prox``, ``w_t`` the correction weight)::

    ℓ_t = w_t · max(−A r_t, −A clip(r_t, 1−ε_low, 1+ε_high))      (PPO-clip, Schulman et al. 2017)
    ℓ_t = min(ℓ_t, −c A)  where A < 0, when dual_clip_c is set      (dual-clip, Ye et al. 2020)

(``r_t = π_θ/μ`` instead when the correction anchors the ratio on the behaviour policy:
``none`` with ``anchor="behaviour"``, AReaL's coupled loss);

or, when the correction names a surrogate (:mod:`staleness.surrogates`), CISPO's
``w_t · −sg(clip(π_θ/anchor)) A log π_θ`` or GSPO's one PPO-clip term per sequence on its
length-normalised ratio, each with its own clip band;

aggregated (:func:`aggregate`) by ``token_mean`` (Σ ℓ / number of tokens in the batch;
DAPO-style, long sequences weigh more), ``seq_mean`` (mean over sequences of each sequence's token
mean; GRPO-style) or ``dr_grpo`` (Σ ℓ / (B · L) for a constant L; Dr. GRPO, Liu et al. 2025).
Tokens outside ``corrected.mask`` are out of the sum. With ``normalizer="kept"`` (the default)
they are out of the normaliser too, so a rejected sequence does not dilute the others; with
``"original"`` the normaliser counts the tokens the correction was given (``corrected.valid``), as
AReaL does, so masking removes a token's gradient without scaling up the others' by
N_valid / N_kept. ``dr_grpo``'s normaliser is constant by design and ignores ``normalizer``.

Guarantees: ``logp_prox`` and the weights are treated as constants (detached); values at masked
positions (even NaN/inf) reach neither the loss nor its gradient; a batch with no kept token gives
a loss of exactly 0 that still backpropagates (zero gradient). Metrics are plain floats.
Not covered: entropy (the trainer has the logits; aggregate its per-token entropy with
:func:`aggregate`), value functions, and advantage whitening across groups.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from staleness import surrogates
from staleness.config import LossAgg, Normalizer
from staleness.errors import ShapeError
from staleness.rewards import EQUAL_ULPS
from staleness.types import Corrected

__all__ = [
    "LossAgg",
    "Normalizer",
    "aggregate",
    "group_advantages",
    "kl_penalty",
    "normaliser",
    "policy_loss",
]


_EQUAL_RTOL = EQUAL_ULPS
"""Rewards of one group whose std is ≤ this many ulps of their largest magnitude count as equal
(:func:`staleness.rewards.rewards_equal`, dynamic sampling's test, shares it)."""


def group_advantages(
    rewards: Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages: ``(r − mean_group) / (std_group + eps)`` (Shao et al. 2024, DeepSeekMath).

    ``rewards`` is [G · group_size] in group-contiguous order (the group_size samples of one prompt
    are adjacent). The std is the population std (no Bessel correction), so a group of one is
    defined. ``normalize_std=False`` returns ``r − mean_group`` (Dr. GRPO, Liu et al. 2025).
    Returns float32 (or the rewards' float dtype), same shape.

    A group whose rewards are all equal carries no learning signal and gets advantages of exactly
    0, whatever the value (``2.2`` as well as ``0`` or ``1``): the mean and std are computed in
    float64, and a group whose std is at most ``_EQUAL_RTOL`` units in the last place of its
    largest |reward| (in the rewards' own dtype) is treated as equal. Without that, the rounding
    error of the mean (≈ 1 ulp) would be divided by a std of the same size and come out as an
    advantage of order ±0.1–1 for every sample.
    """
    if group_size < 1:
        msg = f"group_size must be >= 1, got {group_size}"
        raise ShapeError(msg)
    if rewards.ndim != 1 or rewards.shape[0] % group_size != 0:
        msg = (
            f"rewards must be 1-D with a length divisible by group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
        raise ShapeError(msg)
    r = rewards.detach()
    r = r if r.is_floating_point() else r.to(torch.float32)
    grouped = r.reshape(-1, group_size).to(torch.float64)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, correction=0)
    scale = grouped.abs().amax(dim=1, keepdim=True)
    flat = std <= _EQUAL_RTOL * torch.finfo(r.dtype).eps * scale
    if normalize_std:
        centred = centred / (std + eps)
    centred = torch.where(flat, torch.zeros_like(centred), centred)
    return centred.to(r.dtype).reshape(-1)


def _counted(mask: Tensor, normalizer: Normalizer, valid: Tensor | None) -> Tensor:
    """The tokens a ``token_mean`` / ``seq_mean`` normaliser counts (bool)."""
    if normalizer == "original" and valid is not None:
        return valid.detach().to(torch.bool) | mask
    return mask


def normaliser(
    mask: Tensor,
    loss_agg: LossAgg = "token_mean",
    *,
    normalizer: Normalizer = "kept",
    valid: Tensor | None = None,
    dr_grpo_tokens: int | None = None,
) -> float:
    """What :func:`aggregate` divides the batch's sum by (at least 1), from the masks alone.

    ``token_mean``: the tokens counted (on ``mask``, or on ``valid`` for ``"original"``);
    ``seq_mean``: the rows with at least one counted token (each row's own token count divides
    its sum first); ``dr_grpo``: ``B · dr_grpo_tokens``. Every one is a sum over rows, so
    gradient accumulation computes it over the whole batch and passes it (or 1.0, dividing the
    summed gradients afterwards) as ``denominator`` to each micro-batch of whole rows: computing
    it per micro-batch instead weighs small micro-batches up.
    """
    m = mask.detach().to(torch.bool)
    if valid is not None and valid.shape != m.shape:
        msg = f"valid must have the mask's shape {tuple(m.shape)}, got {tuple(valid.shape)}"
        raise ShapeError(msg)
    if loss_agg == "dr_grpo":
        if dr_grpo_tokens is None or dr_grpo_tokens < 1:
            msg = f"loss_agg='dr_grpo' needs dr_grpo_tokens >= 1, got {dr_grpo_tokens}"
            raise ShapeError(msg)
        return float(max(m.shape[0], 1) * dr_grpo_tokens)
    counted = _counted(m, normalizer, valid)
    if loss_agg == "token_mean":
        return float(max(int(counted.sum().item()), 1))
    return float(max(int((counted.sum(dim=1) > 0).sum().item()), 1))


def aggregate(
    values: Tensor,
    mask: Tensor,
    loss_agg: LossAgg = "token_mean",
    *,
    normalizer: Normalizer = "kept",
    valid: Tensor | None = None,
    dr_grpo_tokens: int | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Reduce per-token ``values`` [B, T] over ``mask`` to a scalar (see the module docstring).

    Only tokens on ``mask`` are summed. The normaliser (:func:`normaliser`):

    - ``token_mean``: the number of tokens on ``mask`` (``normalizer="kept"``) or on ``valid``
      (``"original"``; ``valid`` ⊇ ``mask``, the tokens before a correction masked any; ``None``
      means ``mask``);
    - ``seq_mean``: per row, that row's count of the same tokens; then the mean over the rows
      that have at least one of them;
    - ``dr_grpo``: the constant ``B · dr_grpo_tokens`` (B = rows of the batch, as TRL's
      ``loss_type="dr_grpo"`` with ``max_completion_length``); ``normalizer`` plays no part.

    ``denominator`` replaces this batch's own normaliser (a micro-batch passes the whole
    batch's, or 1.0 to get the sum). Returns 0 (connected to ``values``'s graph) when nothing
    is counted.
    """
    if values.shape != mask.shape or values.ndim != 2:
        msg = f"values and mask must share one [B, T] shape, got {values.shape}, {mask.shape}"
        raise ShapeError(msg)
    if valid is not None and valid.shape != mask.shape:
        msg = f"valid must have the mask's shape {tuple(mask.shape)}, got {tuple(valid.shape)}"
        raise ShapeError(msg)
    m = mask.detach().to(torch.bool)
    den = denominator
    if den is None:
        den = normaliser(
            m, loss_agg, normalizer=normalizer, valid=valid, dr_grpo_tokens=dr_grpo_tokens
        )
    masked = torch.where(m, values, torch.zeros_like(values))
    if loss_agg == "seq_mean":
        counts = _counted(m, normalizer, valid).sum(dim=1)
        return (masked.sum(dim=1) / counts.clamp(min=1).to(values.dtype)).sum() / den
    return masked.sum() / den


def kl_penalty(
    logp: Tensor,
    logp_ref: Tensor,
    mask: Tensor,
    *,
    estimator: Literal["k1", "k2", "k3"] = "k3",
) -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from sampled-token log probs, 0 off the mask.

    With ``d = logp_ref − logp``: k1 = −d, k2 = d²/2, k3 = eᵈ − d − 1 (Schulman 2020, "Approximating
    KL divergence"; k3 is unbiased and non-negative). Differentiable in ``logp``; ``logp_ref`` is
    detached. Aggregate with :func:`aggregate`.
    """
    if logp.shape != logp_ref.shape or logp.shape != mask.shape:
        msg = f"logp, logp_ref and mask must share one shape, got {logp.shape}, {logp_ref.shape}"
        raise ShapeError(msg)
    m = mask.detach().to(torch.bool)
    d = torch.where(m, logp_ref.detach() - logp, torch.zeros_like(logp))
    match estimator:
        case "k1":
            kl = -d
        case "k2":
            kl = 0.5 * d.square()
        case "k3":
            kl = torch.expm1(d) - d
    return torch.where(m, kl, torch.zeros_like(kl))


def _broadcast_advantages(advantages: Tensor, shape: torch.Size) -> Tensor:
    if advantages.ndim == 1 and advantages.shape[0] == shape[0]:
        return advantages.detach()[:, None].expand(shape)
    if advantages.shape == shape:
        return advantages.detach()
    msg = f"advantages must be [B={shape[0]}] or [B, T]={tuple(shape)}, got {advantages.shape}"
    raise ShapeError(msg)


def policy_loss(
    logp: Tensor,
    logp_prox: Tensor,
    advantages: Tensor,
    corrected: Corrected,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    loss_agg: LossAgg = "token_mean",
    normalizer: Normalizer = "kept",
    dr_grpo_tokens: int | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip against π_prox (against μ when ``corrected.log_rho`` is set: ``none`` with
    ``anchor="behaviour"``; or the correction's surrogate), multiplied by the correction's
    weights, over its mask.

    ``clip_eps_high`` defaults to ``clip_eps`` (set it higher for DAPO's clip-higher);
    ``dual_clip_c`` (> 1) bounds the loss of negative-advantage tokens at ``−c·A``. A correction
    with a ``surrogate`` (``cispo``, ``gspo``: :mod:`staleness.surrogates`) replaces PPO-clip by
    it, with the surrogate's own clip band; ``clip_eps``, ``clip_eps_high`` and ``dual_clip_c``
    are then unused. ``loss_agg``, ``normalizer``, ``dr_grpo_tokens`` and ``denominator`` as in
    :func:`aggregate`, with ``corrected.valid`` as the original mask.
    Returns the scalar loss and metrics: ``clip_frac`` (kept tokens whose clipped branch is
    active, or whose CISPO weight / GSPO sequence ratio was clipped), ``dual_clip_frac``,
    ``ratio_mean``/``ratio_min``/``ratio_max`` of π_θ/π_prox and ``approx_kl`` (k3 estimate of
    KL(π_prox ‖ π_θ)) over kept tokens — how far the batch's steps moved π_θ, whatever the anchor
    (μ's distance from π_prox is the trainer's ``mismatch/*``) — ``kept_tokens``, ``weight_mean``.
    """
    if logp.ndim != 2 or logp.shape != logp_prox.shape:
        msg = f"logp and logp_prox must share one [B, T] shape, got {logp.shape}, {logp_prox.shape}"
        raise ShapeError(msg)
    if corrected.mask.shape != logp.shape or corrected.weights.shape != logp.shape:
        msg = (
            f"corrected weights/mask {tuple(corrected.weights.shape)}/"
            f"{tuple(corrected.mask.shape)} do not match log probs {tuple(logp.shape)}"
        )
        raise ShapeError(msg)
    if clip_eps <= 0 or (clip_eps_high is not None and clip_eps_high <= 0):
        msg = f"clip_eps and clip_eps_high must be > 0, got {clip_eps}, {clip_eps_high}"
        raise ShapeError(msg)
    if dual_clip_c is not None and dual_clip_c <= 1:
        msg = f"dual_clip_c must be > 1, got {dual_clip_c}"
        raise ShapeError(msg)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    m = corrected.mask.detach().to(torch.bool)
    adv = _broadcast_advantages(advantages, logp.shape).to(logp.dtype)
    weights = corrected.weights.detach().to(logp.dtype)
    log_r = torch.where(m, logp - logp_prox.detach(), torch.zeros_like(logp))
    terms = _terms(logp, log_r, adv, m, corrected, (clip_eps, eps_high, dual_clip_c))
    per_token = terms.per_token * weights
    loss = aggregate(
        per_token,
        m,
        loss_agg,
        normalizer=normalizer,
        valid=corrected.valid,
        dr_grpo_tokens=dr_grpo_tokens,
        denominator=denominator,
    )
    metrics = _clip_metrics(m, log_r, terms.clip_active, terms.dual_active, weights)
    return loss, metrics


def _terms(
    logp: Tensor,
    log_r: Tensor,
    adv: Tensor,
    m: Tensor,
    corrected: Corrected,
    clip: tuple[float, float, float | None],
) -> surrogates.Terms:
    """The per-token policy term :func:`policy_loss` weights: the correction's surrogate, else
    PPO-clip (``clip``: ε_low, ε_high, dual-clip c) on the ratio to π_prox, or to μ when the
    correction anchors it there (``log_rho`` set)."""
    how = corrected.surrogate
    if how is None:
        anchored = log_r if corrected.log_rho is None else log_r + corrected.log_rho.to(log_r.dtype)
        low, high, dual = clip
        return surrogates.ppo_clip(
            anchored, adv, m, clip_eps=low, clip_eps_high=high, dual_clip_c=dual
        )
    if how.kind == "cispo":
        return surrogates.cispo(
            logp, log_r, corrected.log_rho, adv, m,
            clip_eps=how.clip_eps, clip_eps_high=how.clip_eps_high,
        )  # fmt: skip
    return surrogates.gspo(log_r, adv, m, clip_eps=how.clip_eps, clip_eps_high=how.clip_eps_high)


@torch.no_grad()
def _clip_metrics(
    m: Tensor,
    log_r: Tensor,
    clip_active: Tensor,
    dual_active: Tensor,
    weights: Tensor,
) -> dict[str, float]:
    """:func:`policy_loss`'s metrics over the kept tokens ``m`` (0.0 where none is kept);
    ``approx_kl`` over those whose ``log r_t`` is finite (a token π_θ can no longer sample has an
    infinite one)."""
    n = int(m.sum().item())
    kept_ratio = torch.exp(log_r)[m]
    kept_log_r = log_r[m & torch.isfinite(log_r)]
    denom = max(n, 1)
    return {
        "clip_frac": float((clip_active & m).sum().item()) / denom,
        "dual_clip_frac": float((dual_active & m).sum().item()) / denom,
        "ratio_mean": float(kept_ratio.mean().item()) if n else 0.0,
        "ratio_min": float(kept_ratio.min().item()) if n else 0.0,
        "ratio_max": float(kept_ratio.max().item()) if n else 0.0,
        "approx_kl": float((torch.expm1(kept_log_r) - kept_log_r).mean().item())
        if kept_log_r.numel()
        else 0.0,
        "kept_tokens": float(n),
        "weight_mean": float(weights[m].mean().item()) if n else 0.0,
    }
