"""Lag corrections as pure functions over [B, T] tensors: per-token weights and masks.

Inputs, for a batch of B sequences padded to T positions:

- ``logp_prox`` — float log probs of the sampled tokens under π_prox, the trainer's policy before
  this update (recomputed by the trainer; π_old in PPO terms);
- ``logp_behav`` — the engine's log probs of the same tokens under μ, the (possibly stale)
  behaviour policy that sampled them (after temperature / top-p: the distribution sampled);
- ``mask`` — bool (or 0/1 float), the positions that are sampled tokens and count in the loss.

Every policy computes the per-token behaviour ratio ``ρ_t = exp(logp_prox_t − logp_behav_t)`` and
returns a :class:`~staleness.types.Corrected`: ``weights`` multiply each token's policy-gradient
term (the PPO ratio in :mod:`staleness.loss` is always taken against π_prox), ``mask`` removes
tokens from the loss (and, with the default ``kept`` normaliser, from its normaliser), and
``valid`` is the input mask (the ``original`` normaliser). ``cispo`` and ``gspo`` weight and
mask nothing; they name the term the loss takes instead of PPO-clip (``surrogate``,
:mod:`staleness.surrogates`). Every policy decides each row by that row alone except ``m2po``,
whose mask is a statistic of the whole batch given (:func:`batch_level`).

Non-finite log ratios: a valid token whose ``logp_prox − logp_behav`` is NaN or ±inf (an engine
that returned NaN or −inf for a sampled token, ``−inf − (−inf)``) is masked out by *every*
policy before the policy runs, so it reaches neither the loss nor a sequence-level statistic;
:func:`nonfinite_tokens` counts them (``is/nonfinite_tokens`` in
:func:`staleness.metrics.correction_metrics`). AReaL 1.0.4 instead maps such a ratio to 1 and
keeps the token; a log prob that is not a number says the token's record is broken, so sprawl
does not train on it.

Guarantees: outputs are detached, ``mask ⊆ input mask``, ``weights == 0`` off the mask, weights are
finite and bounded by the policy's cap; values at padded positions (even NaN/inf) never reach the
outputs. The ratio is formed in log space and bounds are tested in log space, so a huge lag cannot
overflow into ``inf · 0``. Not covered: choosing the cap; the drop rule (see
:mod:`staleness.lag`), which runs before any of this.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

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
from staleness.errors import ShapeError
from staleness.types import Corrected, Surrogate

__all__ = [
    "Corrected",
    "batch_level",
    "cispo",
    "correct",
    "decoupled_ppo",
    "gspo",
    "log_ratio",
    "m2po",
    "masked_is",
    "no_correction",
    "nonfinite_tokens",
    "token_mask",
    "truncated_is",
]


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


def _diff(logp_prox: Tensor, logp_behav: Tensor) -> Tensor:
    return logp_prox.detach().float() - logp_behav.detach().float()


def _usable(logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The input mask as bool, and its tokens whose log ratio is finite."""
    m = _check(logp_prox, logp_behav, mask)
    return m, m & torch.isfinite(_diff(logp_prox, logp_behav))


def nonfinite_tokens(logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Tensor:
    """Bool [B, T]: tokens on the mask whose log ratio is NaN or ±inf (every policy masks them)."""
    m, usable = _usable(logp_prox, logp_behav, mask)
    return m & ~usable


def log_ratio(logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Tensor:
    """``log ρ_t = logp_prox − logp_behav`` on the mask where it is finite, 0 elsewhere; float32,
    detached."""
    _, usable = _usable(logp_prox, logp_behav, mask)
    diff = _diff(logp_prox, logp_behav)
    return torch.where(usable, diff, torch.zeros_like(diff))


def _result(weights: Tensor, kept: Tensor, valid: Tensor) -> Corrected:
    return Corrected(
        weights=torch.where(kept, weights, torch.zeros_like(weights)), mask=kept, valid=valid
    )


def no_correction(
    *,
    logp_prox: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    anchor: Literal["proximal", "behaviour"] = "proximal",
) -> Corrected:
    """``none``: ``w_t = 1`` on the mask; the mask is unchanged (identity) but for tokens whose log
    ratio is not finite. ``anchor="behaviour"``: ``log_rho`` carries ``log ρ_t``, so PPO-clip's
    ratio is ``π_θ/μ``."""
    m, usable = _usable(logp_prox, logp_behav, mask)
    out = _result(torch.ones(m.shape, dtype=torch.float32, device=m.device), usable, m)
    if anchor == "proximal":
        return out
    rho = log_ratio(logp_prox, logp_behav, out.mask)
    return Corrected(out.weights, out.mask, out.valid, log_rho=rho)


def truncated_is(
    cap: float,
    *,
    level: Literal["token", "sequence"] = "token",
    logp_prox: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
) -> Corrected:
    """``tis``: truncated IS; no token is masked (but those with a non-finite log ratio).

    ``level="token"``: ``w_t = min(ρ_t, C)``. ``level="sequence"``: every token of row b gets
    ``w_b = min(Π_t ρ_bt, C)``, the product over the row's valid tokens (formed as ``exp`` of the
    summed log ratios, truncated in log space). Truncation bounds the variance a stale token (or
    sequence) can add at the price of bias where the ratio exceeds C. The sequence product is the
    likelihood ratio of the whole sample, so it is unbiased below the cap, but it shrinks or grows
    geometrically with length. Sources: Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"; sequence level as verl (``rollout_is_level="sequence"``,
    ``rollout_is_mode="truncate"``) and TRL (``vllm_importance_sampling_mode="sequence_truncate"``).
    """
    m, usable = _usable(logp_prox, logp_behav, mask)
    lr = log_ratio(logp_prox, logp_behav, m)
    if level == "sequence":
        seq = torch.clamp(lr.sum(dim=1), max=math.log(cap))
        return _result(torch.exp(seq)[:, None].expand_as(lr), usable, m)
    weights = torch.exp(torch.clamp(lr, max=math.log(cap)))
    return _result(weights, usable, m)


def masked_is(cfg: MaskedIS, *, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Corrected:
    """``mis``: sequence-level masked IS (rejection of whole sequences).

    ``s_b = Σ_t log ρ_bt`` over the row's valid tokens (``aggregate="product"``) or that sum over
    the row's valid-token count (``"geometric"``); ``ρ_seq = exp(s_b)``. Row b is kept iff
    ``lower ≤ ρ_seq ≤ upper`` (bounds compared in log space); a rejected row loses every token.
    Kept rows get ``w_bt = ρ_seq`` with ``reweight`` (so weights lie in ``[lower, upper]``), else 1.
    A row with no valid token has ``s_b = 0`` and no tokens to keep.

    Source: Liu, Li et al. 2025, "When speed kills stability: demystifying RL collapse from the
    training-inference mismatch". Tokens with a non-finite log ratio are left out of ``s_b`` (and
    of the count) and masked; the rest of their row is judged without them.
    """
    m, usable = _usable(logp_prox, logp_behav, mask)
    lr = log_ratio(logp_prox, logp_behav, m)
    seq = lr.sum(dim=1)
    if cfg.aggregate == "geometric":
        seq = seq / usable.sum(dim=1).clamp(min=1).to(seq.dtype)
    log_lo, log_hi = math.log(cfg.lower_bound), math.log(cfg.upper)
    accepted = (seq >= log_lo) & (seq <= log_hi)
    kept = usable & accepted[:, None]
    if cfg.reweight:
        w_seq = torch.exp(torch.clamp(seq, min=log_lo, max=log_hi))
        weights = w_seq[:, None].expand_as(lr)
    else:
        weights = torch.ones_like(lr)
    return _result(weights, kept, m)


def decoupled_ppo(
    cap: float | None, *, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor
) -> Corrected:
    """``decoupled_ppo``: with a cap, ``w_t = ρ_t = π_prox/μ`` and tokens with ``ρ_t > cap`` masked;
    without one, ``w_t = 1`` and nothing masked.

    Paired with the PPO clip against π_prox in :func:`staleness.loss.policy_loss`, the capped
    form is the decoupled objective ``E_μ[ ρ_t · min(r_t A, clip(r_t, 1±ε) A) ]`` with
    ``r_t = π_θ/π_prox`` over the tokens with ``ρ_t ≤ cap``: the trust region is measured from the
    recent proximal policy, not from the stale μ. Source: Fu et al. 2025, "AReaL: a large-scale
    asynchronous reinforcement learning system for language reasoning". Both forms match AReaL
    1.0.4's ``ppo_actor_loss_fn``: with ``rejection_sampling`` (token level, ``metric="ratio"``,
    ``action="mask"``, ``upper=cap``) it multiplies the clipped objective by the raw ratio of the
    tokens it keeps; with ``rejection_sampling=None`` it applies no behaviour weight at all (an
    unbounded ρ_t would let one stale token dominate the batch; AReaL ≤ 1.0.3 and the paper's
    formula did weight by it).
    """
    m, usable = _usable(logp_prox, logp_behav, mask)
    lr = log_ratio(logp_prox, logp_behav, m)
    if cap is None:
        return _result(torch.ones_like(lr), usable, m)
    kept = usable & (lr <= math.log(cap))
    return _result(torch.exp(torch.clamp(lr, max=math.log(cap))), kept, m)


def token_mask(
    c: float, *, reweight: bool = False, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor
) -> Corrected:
    """``token_mask``: keep token t iff ``1/c ≤ ρ_t ≤ c``; weight 1 (or ``ρ_t`` with ``reweight``).

    Masking instead of truncating drops the tokens whose ratio says the sample is not
    representative of π_prox in either direction, leaving no biased-but-counted tokens.
    With ``reweight`` this is IcePop (Ling team 2025, "Every step evolves: scaling RL for
    trillion-scale thinking model"); without it, plain two-sided token rejection.
    """
    m, usable = _usable(logp_prox, logp_behav, mask)
    lr = log_ratio(logp_prox, logp_behav, m)
    bound = math.log(c)
    kept = usable & (lr.abs() <= bound)
    weights = torch.exp(torch.clamp(lr, min=-bound, max=bound)) if reweight else torch.ones_like(lr)
    return _result(weights, kept, m)


def m2po(threshold: float, *, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Corrected:
    """``m2po``: mask the tokens of largest ``(log ρ_t)²`` until the rest's mean is below
    ``threshold``; kept tokens get weight 1.

    Over every usable token of the batch given (a batch statistic: call it on the whole batch),
    sorted by ``(log ρ_t)²`` descending (ties in position order), the smallest ``j`` for which
    the mean of tokens ``j..n−1`` is ``< threshold`` masks tokens ``0..j−1``; when no ``j`` does,
    all but the last are masked (AReaL 1.0.4 ``_get_m2po_loss_mask``, which keeps one token
    rather than none). Squares and means are taken in float64. Source: Zheng et al. 2025,
    "Prosperity before collapse: how far can off-policy RL reach with stale data on LLMs?"
    (M2PO); AReaL's ``_apply_m2po_masking``, there per micro-batch of its engine.
    """
    m, usable = _usable(logp_prox, logp_behav, mask)
    m2 = log_ratio(logp_prox, logp_behav, m).double().square()[usable]
    n = m2.numel()
    keep = torch.ones(n, dtype=torch.bool, device=m.device)
    if n:
        order = torch.sort(m2, descending=True, stable=True).indices
        tail = m2[order].flip(0).cumsum(0).flip(0)
        tail_mean = tail / torch.arange(n, 0, -1, dtype=tail.dtype, device=tail.device)
        below = torch.nonzero(tail_mean < threshold)
        cut = int(below[0, 0]) if below.numel() else n - 1
        keep[order[:cut]] = False
    kept = torch.zeros_like(usable)
    kept[usable] = keep
    return _result(torch.ones(m.shape, dtype=torch.float32, device=m.device), kept, m)


def cispo(cfg: CISPO, *, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Corrected:
    """``cispo``: no weight, no mask; the loss takes CISPO's term
    (:func:`staleness.surrogates.cispo`), its IS ratio anchored on μ (``log_rho`` carries
    ``log ρ_t``) or on π_prox."""
    m, usable = _usable(logp_prox, logp_behav, mask)
    out = _result(torch.ones(m.shape, dtype=torch.float32, device=m.device), usable, m)
    rho = log_ratio(logp_prox, logp_behav, m) if cfg.anchor == "behaviour" else None
    how = Surrogate("cispo", cfg.clip_eps, cfg.clip_eps_high)
    return Corrected(out.weights, out.mask, out.valid, surrogate=how, log_rho=rho)


def gspo(cfg: GSPO, *, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Corrected:
    """``gspo``: no weight, no mask; the loss takes GSPO's sequence-level term
    (:func:`staleness.surrogates.gspo`) over the sequences' usable tokens."""
    m, usable = _usable(logp_prox, logp_behav, mask)
    out = _result(torch.ones(m.shape, dtype=torch.float32, device=m.device), usable, m)
    how = Surrogate("gspo", cfg.clip_eps, cfg.clip_eps_high)
    return Corrected(out.weights, out.mask, out.valid, surrogate=how)


def batch_level(cfg: Correction) -> bool:
    """Whether the correction decides a token by a statistic of the whole batch (``m2po``), so a
    trainer must apply it to the whole batch at once, not to each micro-batch; every other
    decides per row."""
    return isinstance(cfg, M2PO)


def correct(cfg: Correction, *, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor) -> Corrected:
    """Apply the configured correction (dispatch on ``cfg.type``)."""
    match cfg:
        case NoCorrection(anchor=anchor):
            return no_correction(
                logp_prox=logp_prox, logp_behav=logp_behav, mask=mask, anchor=anchor
            )
        case TruncatedIS(cap=cap, level=level):
            return truncated_is(
                cap, level=level, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask
            )
        case MaskedIS():
            return masked_is(cfg, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
        case DecoupledPPO(cap=cap):
            return decoupled_ppo(cap, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
        case TokenMask(c=c, reweight=reweight):
            return token_mask(
                c, reweight=reweight, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask
            )
        case M2PO(threshold=threshold):
            return m2po(threshold, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
        case CISPO():
            return cispo(cfg, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
        case GSPO():
            return gspo(cfg, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
