"""The reference trainer's objective: the loss a micro-batch backpropagates, and a step's metrics.

Composed from the pure loss math of :mod:`staleness` (step 3 of :mod:`policies.train.trainer`):
the configured correction weights or masks each sampled token (π_prox = the weights before the
batch's first optimizer step, μ = the engine's log probs); the loss is the PPO-clip policy term
(``trainer.clip_eps``, ``clip_eps_high``, ``dual_clip_c``; or the correction's surrogate)
``− entropy_coef · H(π_θ) + kl_coef · KL(π_θ ‖ π_ref)``, the KL over the kept tokens that π_ref's
sampled set holds, all three aggregated alike by ``staleness.loss_agg`` with
``staleness.normalizer``. :func:`micro_batch_loss` gives a micro-batch's loss *sum* (denominator
1: the step divides the summed gradients by the minibatch's normaliser once);
:func:`step_metrics` computes the terms over the whole batch, as the step reports them.

Pure functions over tensors: the trainer owns the model, the forward passes and the optimizer.
"""

from __future__ import annotations

import torch

from policies.train.config import TrainerConfig
from policies.train.scoring import Scored
from staleness.config import Correction, StalenessConfig
from staleness.corrections import correct
from staleness.loss import aggregate, kl_penalty, policy_loss
from staleness.metrics import correction_metrics
from staleness.types import Corrected


def micro_batch_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    logp_ref: torch.Tensor | None,
    behav: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    correction: Correction,
    config: TrainerConfig,
    staleness: StalenessConfig,
    proximal: tuple[torch.Tensor, Corrected] | None = None,
) -> tuple[torch.Tensor, Scored]:
    """A micro-batch's loss sum, from π_θ's log probs ``logp`` and ``entropy`` (with grad) and
    π_ref's ``logp_ref`` (None without a KL term), and its detached per-token values.

    ``proximal``: π_prox's log probs of these rows and the correction over them, computed before
    the batch's first optimizer step (:class:`policies.train.passes.Proximal`); None: π_prox is
    π_θ itself (one optimizer step per batch) and the rows are corrected here."""
    s, st = config, staleness
    if proximal is None:
        logp_prox = logp.detach()
        corrected = correct(correction, logp_prox=logp_prox, logp_behav=behav, mask=mask)
    else:
        logp_prox, corrected = proximal
    kept = corrected.mask

    def summed(values: torch.Tensor) -> torch.Tensor:
        return aggregate(
            values,
            kept,
            st.loss_agg,
            normalizer=st.normalizer,
            valid=mask,
            dr_grpo_tokens=st.dr_grpo_tokens,
            denominator=1.0,
        )

    loss, _ = policy_loss(
        logp,
        logp_prox,
        advantages,
        corrected,
        clip_eps=s.clip_eps,
        clip_eps_high=s.clip_eps_high,
        dual_clip_c=s.dual_clip_c,
        loss_agg=st.loss_agg,
        normalizer=st.normalizer,
        dr_grpo_tokens=st.dr_grpo_tokens,
        denominator=1.0,
    )
    if s.entropy_coef > 0:
        loss = loss - s.entropy_coef * summed(entropy)
    kl = torch.zeros_like(logp_prox)
    excluded = 0
    if logp_ref is not None:
        outside = kept & ~torch.isfinite(logp_ref)  # π_ref's truncated set lacks the token
        excluded = int(outside.sum())
        kl = kl_penalty(logp, logp_ref, kept & ~outside, estimator=s.kl_estimator)
        loss = loss + s.kl_coef * summed(kl)
    scored = Scored(
        logp.detach(), logp_prox, behav, mask, corrected, entropy.detach(), kl.detach(), excluded
    )
    return loss, scored


def step_metrics(
    whole: Scored,
    advantages: torch.Tensor,
    *,
    correction: Correction,
    config: TrainerConfig,
    staleness: StalenessConfig,
) -> dict[str, float]:
    """The step's loss terms over the whole batch (``loss``, ``loss_policy``, ``entropy``,
    ``kl_ref``), the policy term's and the correction's metrics, and the tokens outside π_prox's
    sampled set or left out of the KL. Each minibatch's values are those of the pass that took
    its optimizer step: π_θ equals π_prox in the first, and drifts from it in the later ones
    (``ratio_*``, ``clip_frac``)."""
    s, st = config, staleness
    kept = whole.corrected.mask
    pg_loss, metrics = policy_loss(
        whole.logp,
        whole.logp_prox,
        advantages,
        whole.corrected,
        clip_eps=s.clip_eps,
        clip_eps_high=s.clip_eps_high,
        dual_clip_c=s.dual_clip_c,
        loss_agg=st.loss_agg,
        normalizer=st.normalizer,
        dr_grpo_tokens=st.dr_grpo_tokens,
    )

    def agg(values: torch.Tensor) -> float:
        return float(
            aggregate(
                values,
                kept,
                st.loss_agg,
                normalizer=st.normalizer,
                valid=whole.mask,
                dr_grpo_tokens=st.dr_grpo_tokens,
            )
        )

    ent_term, kl_value = agg(whole.entropy), agg(whole.kl)
    loss = float(pg_loss) - s.entropy_coef * ent_term + s.kl_coef * kl_value
    metrics.update(
        correction_metrics(
            correction,
            whole.corrected,
            logp_prox=whole.logp_prox,
            logp_behav=whole.behav,
            mask=whole.mask,
        )
    )
    outside = whole.mask & torch.isneginf(whole.logp_prox)
    metrics.update(
        {
            "mismatch/outside_sampled_set": float(outside.sum()),
            "kl_ref_excluded_tokens": float(whole.kl_excluded),
        },
        loss=loss,
        loss_policy=float(pg_loss),
        entropy=ent_term,
        kl_ref=kl_value,
    )
    return metrics
