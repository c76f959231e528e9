"""Lag corrections as pure functions over [B, T] tensors: per-token weights and masks.

Inputs, for a batch of B sequences padded to T positions:

- ``logp_prox`` — float log probs of the sampled tokens under π_prox, the trainer's policy before
  this update (recomputed by the trainer; π_old in PPO terms);
- ``logp_behav`` — the engine's log probs of the same tokens under μ, the (possibly stale)
  behaviour policy that sampled them (after temperature / top-p: the distribution sampled);
- ``mask`` — bool (or 0/1 float), the positions that are sampled tokens and count in the loss.

Every policy computes the per-token behaviour ratio ``ρ_t = exp(logp_prox_t − logp_behav_t)`` and
returns a :class:`~staleness.types.Corrected`: ``weights`` multiply each token's policy-gradient
term (the PPO ratio in :mod:`staleness.loss` is always taken against π_prox), and ``mask`` removes
tokens from the loss and from its normaliser.

Guarantees: outputs are detached, ``mask ⊆ input mask``, ``weights == 0`` off the mask, weights are
finite and bounded by the policy's cap; values at padded positions (even NaN/inf) never reach the
outputs. The ratio is formed in log space and bounds are tested in log space, so a huge lag cannot
overflow into ``inf · 0``. Not covered: choosing the cap; the drop rule (see
:mod:`staleness.lag`), which runs before any of this.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from staleness.config import (
    Correction,
    DecoupledPPO,
    MaskedIS,
    NoCorrection,
    TokenMask,
    TruncatedIS,
)
from staleness.errors import ShapeError
from staleness.types import Corrected

__all__ = [
    "MAX_LOG_WEIGHT",
    "Corrected",
    "correct",
    "decoupled_ppo",
    "log_ratio",
    "masked_is",
    "no_correction",
    "token_mask",
    "truncated_is",
]


MAX_LOG_WEIGHT = 30.0
"""Numeric ceiling on an uncapped log weight (e³⁰ ≈ 1e13): keeps the weight, and the loss it
multiplies, finite in float32. Any ratio this large already means the token is noise."""


def _check(logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Tensor:
    """Validate shapes and return the mask as bool."""
    if logp_prox.ndim != 2:
        msg = f"log probs must be [B, T], got shape {tuple(logp_prox.shape)}"
        raise ShapeError(msg)
    if logp_prox.shape != logp_behav.shape or logp_prox.shape != mask.shape:
        msg = (
            "logp_prox, logp_behav and mask must share one [B, T] shape, got "
            f"{tuple(logp_prox.shape)}, {tuple(logp_behav.shape)}, {tuple(mask.shape)}"
        )
        raise ShapeError(msg)
    if not logp_prox.is_floating_point() or not logp_behav.is_floating_point():
        msg = f"log probs must be floating point, got {logp_prox.dtype}, {logp_behav.dtype}"
        raise ShapeError(msg)
    return mask.detach().to(torch.bool)


def log_ratio(logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Tensor:
    """``log ρ_t = logp_prox − logp_behav`` on the mask, 0 elsewhere; float32, detached."""
    m = _check(logp_prox, logp_behav, mask)
    diff = logp_prox.detach().float() - logp_behav.detach().float()
    return torch.where(m, diff, torch.zeros_like(diff))


def _result(weights: Tensor, mask: Tensor) -> Corrected:
    return Corrected(weights=torch.where(mask, weights, torch.zeros_like(weights)), mask=mask)


def no_correction(*, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Corrected:
    """``none``: ``w_t = 1`` on the mask; the mask is unchanged (identity)."""
    m = _check(logp_prox, logp_behav, mask)
    return _result(torch.ones(m.shape, dtype=torch.float32, device=m.device), m)


def truncated_is(cap: float, *, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Corrected:
    """``tis``: token-level truncated IS, ``w_t = min(ρ_t, C)``; no token is masked.

    Truncation bounds the variance a stale token can add at the price of bias where ``ρ_t > C``.
    Source: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training".
    """
    m = _check(logp_prox, logp_behav, mask)
    lr = log_ratio(logp_prox, logp_behav, m)
    weights = torch.exp(torch.clamp(lr, max=math.log(cap)))
    return _result(weights, m)


def masked_is(cfg: MaskedIS, *, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Corrected:
    """``mis``: sequence-level masked IS (rejection of whole sequences).

    ``s_b = Σ_t log ρ_bt`` over the row's valid tokens (``aggregate="product"``) or that sum over
    the row's valid-token count (``"geometric"``); ``ρ_seq = exp(s_b)``. Row b is kept iff
    ``lower ≤ ρ_seq ≤ upper`` (bounds compared in log space); a rejected row loses every token.
    Kept rows get ``w_bt = ρ_seq`` with ``reweight`` (so weights lie in ``[lower, upper]``), else 1.
    A row with no valid token has ``s_b = 0`` and no tokens to keep.

    Source: Liu, Li et al. 2025, "When speed kills stability: demystifying RL collapse from the
    training-inference mismatch".
    """
    m = _check(logp_prox, logp_behav, mask)
    lr = log_ratio(logp_prox, logp_behav, m)
    seq = lr.sum(dim=1)
    if cfg.aggregate == "geometric":
        seq = seq / m.sum(dim=1).clamp(min=1).to(seq.dtype)
    log_lo, log_hi = math.log(cfg.lower_bound), math.log(cfg.upper)
    accepted = (seq >= log_lo) & (seq <= log_hi)
    kept = m & accepted[:, None]
    if cfg.reweight:
        w_seq = torch.exp(torch.clamp(seq, min=log_lo, max=log_hi))
        weights = w_seq[:, None].expand_as(lr)
    else:
        weights = torch.ones_like(lr)
    return _result(weights, kept)


def decoupled_ppo(
    cap: float | None, *, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor
) -> Corrected:
    """``decoupled_ppo``: ``w_t = ρ_t = π_prox/μ``; with a cap, tokens with ``ρ_t > cap`` masked.

    Paired with the PPO clip against π_prox in :func:`staleness.loss.policy_loss`, this is the
    decoupled objective ``E_μ[ ρ_t · min(r_t A, clip(r_t, 1±ε) A) ]`` with ``r_t = π_θ/π_prox``:
    the trust region is measured from the recent proximal policy, not from the stale μ.
    Source: Fu et al. 2025, "AReaL: a large-scale asynchronous reinforcement learning system for
    language reasoning" (masking above the cap, rather than truncating, follows AReaL). Uncapped
    weights are still limited to ``exp(MAX_LOG_WEIGHT)`` so they stay finite.
    """
    m = _check(logp_prox, logp_behav, mask)
    lr = log_ratio(logp_prox, logp_behav, m)
    if cap is None:
        weights = torch.exp(torch.clamp(lr, max=MAX_LOG_WEIGHT))
        return _result(weights, m)
    kept = m & (lr <= math.log(cap))
    return _result(torch.exp(torch.clamp(lr, max=math.log(cap))), kept)


def token_mask(
    c: float, *, reweight: bool = False, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor
) -> Corrected:
    """``token_mask``: keep token t iff ``1/c ≤ ρ_t ≤ c``; weight 1 (or ``ρ_t`` with ``reweight``).

    Masking instead of truncating drops the tokens whose ratio says the sample is not
    representative of π_prox in either direction, leaving no biased-but-counted tokens.
    With ``reweight`` this is IcePop (Ling team 2025, "Every step evolves: scaling RL for
    trillion-scale thinking model"); without it, plain two-sided token rejection.
    """
    m = _check(logp_prox, logp_behav, mask)
    lr = log_ratio(logp_prox, logp_behav, m)
    bound = math.log(c)
    kept = m & (lr.abs() <= bound)
    weights = torch.exp(torch.clamp(lr, min=-bound, max=bound)) if reweight else torch.ones_like(lr)
    return _result(weights, kept)


def correct(cfg: Correction, *, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Corrected:
    """Apply the configured correction (dispatch on ``cfg.type``)."""
    match cfg:
        case NoCorrection():
            return no_correction(logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
        case TruncatedIS(cap=cap):
            return truncated_is(cap, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
        case MaskedIS():
            return masked_is(cfg, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
        case DecoupledPPO(cap=cap):
            return decoupled_ppo(cap, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
        case TokenMask(c=c, reweight=reweight):
            return token_mask(
                c, reweight=reweight, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask
            )
