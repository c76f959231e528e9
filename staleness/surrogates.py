"""Policy-gradient terms per token: PPO-clip, CISPO and GSPO, as pure functions over [B, T].

:func:`staleness.loss.policy_loss` takes one of these per token, multiplies it by the correction's
weight and aggregates it over the correction's mask; which one is the correction's choice
(``Corrected.surrogate``; ``None``: PPO-clip). Inputs, for a batch of B sequences padded to T:

- ``log_r`` — ``log r_t = logp − logp_prox`` on the kept tokens ``m``, 0 elsewhere, with
  gradient through ``logp`` (π_θ); ``r_t`` is the ratio to π_prox, the trainer's weights before
  the batch's first optimizer step;
- ``adv`` — the advantages broadcast to [B, T], detached;
- ``m`` — bool, the tokens the correction kept.

Each returns the per-token term (0 off ``m``; the caller masks again when it aggregates) and which
kept tokens had their ratio clipped. Guarantees: a kept token whose current log prob is −inf (the
weights moved so that it left the truncated sampling set) adds a finite value and a gradient of
exactly 0, never NaN, under every surrogate.

Sources, each checked against the reference's code on the same tensors
(``tests/staleness/test_surrogates.py``): PPO-clip with clip-higher and dual clip (Schulman et al.
2017; Yu et al. 2025, DAPO; Ye et al. 2020), CISPO (MiniMax 2025, "MiniMax-M1"; verl's
``compute_policy_loss_cispo``, SkyRL's, TRL's ``loss_type="cispo"``), GSPO (Zheng et al. 2025,
"Group sequence policy optimization"; TRL's ``importance_sampling_level="sequence"``, verl's and
SkyRL's ``gspo``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Terms", "cispo", "gspo", "ppo_clip"]


@dataclass(frozen=True)
class Terms:
    """Per-token loss terms [B, T] (0 off the kept tokens), and bool [B, T]: the kept tokens whose
    ratio was clipped (``clip_active``) and those the dual clip bounded (``dual_active``)."""

    per_token: Tensor
    clip_active: Tensor
    dual_active: Tensor


def ppo_clip(
    log_r: Tensor,
    adv: Tensor,
    m: Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float,
    dual_clip_c: float | None,
) -> Terms:
    """``max(−A·r_t, −A·clip(r_t, 1 − clip_eps, 1 + clip_eps_high))``; with ``dual_clip_c`` a
    negative-advantage token's term is at most ``−c·A`` (dual clip, as AReaL and verl)."""
    ratio = torch.exp(log_r)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(m)
    if dual_clip_c is not None:
        bound = -dual_clip_c * adv
        dual_active = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual_active, bound, per_token)
    return Terms(per_token, clipped > unclipped, dual_active)


def cispo(
    logp: Tensor,
    log_r: Tensor,
    log_rho: Tensor | None,
    adv: Tensor,
    m: Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float,
) -> Terms:
    """``−sg(clip(w_t, 1 − clip_eps, 1 + clip_eps_high)) · A · log π_θ(a_t)`` with the IS ratio
    ``w_t = r_t · ρ_t = π_θ/μ`` (``log_rho`` given: anchored on μ) or ``w_t = r_t`` (anchored on
    π_prox). The weight carries no gradient, so every kept token keeps the REINFORCE gradient
    ``−w·A·∇log π_θ``, bounded where ``w_t`` leaves the band. A token whose ``logp`` is not finite
    contributes 0."""
    log_w = log_r if log_rho is None else log_r + log_rho.detach().to(log_r.dtype)
    w = torch.exp(log_w.detach())
    lo, hi = 1.0 - clip_eps, 1.0 + clip_eps_high
    weight = torch.clamp(w, lo, hi)
    live = m & torch.isfinite(logp)
    lp = torch.where(live, logp, torch.zeros_like(logp))
    per_token = -adv * weight * lp
    return Terms(per_token, m & ((w < lo) | (w > hi)), torch.zeros_like(m))


def gspo(
    log_r: Tensor,
    adv: Tensor,
    m: Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float,
) -> Terms:
    """One PPO-clip term per sequence on ``s_b = exp(Σ_t log r_bt / n_b)`` (the geometric mean
    of the kept tokens' ratios, ``n_b`` of them; gradient through every token's log prob) and the
    row's mean advantage over its kept tokens: ``max(−A_b·s_b, −A_b·clip(s_b, 1 − clip_eps,
    1 + clip_eps_high))``, the same value on each of the row's kept tokens (aggregate with
    ``seq_mean`` for the paper's mean over sequences). A row without a kept token gives 0."""
    count = m.sum(dim=1, keepdim=True).clamp(min=1).to(log_r.dtype)
    seq_ratio = torch.exp(log_r.sum(dim=1, keepdim=True) / count)
    seq_adv = torch.where(m, adv, torch.zeros_like(adv)).sum(dim=1, keepdim=True) / count
    unclipped = -seq_adv * seq_ratio
    clipped = -seq_adv * torch.clamp(seq_ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
    per_row = torch.maximum(unclipped, clipped)
    per_token = torch.where(m, per_row.expand_as(log_r), torch.zeros_like(log_r))
    return Terms(per_token, m & (clipped > unclipped), torch.zeros_like(m))
