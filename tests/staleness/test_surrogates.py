"""M2PO, CISPO and GSPO against the code they are named after, on the same tensors.

The references are re-typed below from their source, keeping their arithmetic and only the
branches these settings take (none of the packages is installed here):

- AReaL v1.0.4 (inclusionAI/AReaL, tag ``v1.0.4``): ``areal/trainer/ppo/actor.py``
  ``grpo_loss_fn``'s M2PO step (``_apply_m2po_masking``, ``_get_m2po_loss_mask``) and
  ``areal/utils/functional/functional.py`` ``ppo_actor_loss_fn`` with ``rejection_sampling=None``
  (``importance_sampling_level`` ``token`` and ``sequence``, the latter through
  ``_compute_sequence_level_ratio_and_advantages``'s 2-D branch), and with the engine's log probs
  as ``proximal_logprobs`` (its coupled loss: ``use_decoupled_loss = false``);
- verl (volcengine/verl ``b178a3cd``): ``verl/trainer/ppo/core_algos.py``
  ``compute_policy_loss_cispo``, ``compute_policy_loss_gspo`` and ``agg_loss``;
- SkyRL (NovaSky-AI/SkyRL ``a9564572``): ``skyrl/backends/skyrl_train/utils/ppo_utils.py``
  ``compute_policy_loss_cispo`` (``cispo_anchor`` ``old`` and ``rollout``), ``gspo_policy_loss``,
  ``reduce_loss`` after ``apply_loss_reduction_to_advantages_minibatch``;
- TRL (huggingface/trl ``v1.9.0-26-gf2cd5771``): ``trl/trainer/grpo_trainer.py``
  ``_compute_loss`` with ``loss_type="cispo"``, and with ``importance_sampling_level="sequence"``
  and ``loss_type="grpo"`` (GSPO).

Values and gradients with respect to π_θ's log probs are compared. The tensors keep every log
ratio within ±20 (verl and SkyRL clamp there before ``exp``) and every GSPO log ratio below 10
(verl and SkyRL clamp there).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from staleness.config import CISPO, GSPO, M2PO, Correction, NoCorrection
from staleness.corrections import correct
from staleness.loss import LossAgg, policy_loss

Batch = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
"""logp (π_θ, leaf with grad), logp_prox, logp_behav, mask, advantages [B]."""


def _batch(seed: int, *, stale: float = 0.5, drift: float = 0.2) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    behav = -torch.rand(b, t, generator=gen) * 4 - 0.05
    prox = (behav + stale * torch.randn(b, t, generator=gen)).clamp(max=-1e-3)
    logp = (prox + drift * torch.randn(b, t, generator=gen)).clamp(max=-1e-3).requires_grad_()
    mask = torch.rand(b, t, generator=gen) < 0.8
    mask[:, 0] = True  # every row has a token (SkyRL's sequence mean counts every row)
    adv = torch.randn(b, generator=gen)
    return logp, prox, behav, mask, adv


def _ours(batch: Batch, cfg: Correction, loss_agg: LossAgg, **clip: float) -> Tensor:
    logp, prox, behav, mask, adv = batch
    corrected = correct(cfg, logp_prox=prox, logp_behav=behav, mask=mask)
    loss, _ = policy_loss(logp, prox, adv, corrected, loss_agg=loss_agg, **clip)  # type: ignore[arg-type]
    return loss


def _compare(ours: Tensor, ref: Tensor, logp: Tensor) -> float:
    """Assert equal values and gradients; return the largest absolute difference of either."""
    (g_ours,) = torch.autograd.grad(ours, logp, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref, logp, retain_graph=True)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-7)
    return max(float((ours - ref).detach().abs()), float((g_ours - g_ref).abs().max()))


# ---- AReaL v1.0.4 -----------------------------------------------------------------------------


def areal_m2po_mask(old_logp: Tensor, prox_logp: Tensor, loss_mask: Tensor, m2: float) -> Tensor:
    """``_apply_m2po_masking`` with ``_get_m2po_loss_mask``."""
    delta = old_logp - prox_logp
    sq = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = sq.view(-1)[mask_flat]
    if m2_selected.numel() == 0:
        return loss_mask
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    n = sorted_m2.numel()
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    avg_m2_suffix = suffix_sums / counts
    below_threshold_indices = torch.where(avg_m2_suffix < m2)[0]
    num_to_mask = below_threshold_indices[0].item() if len(below_threshold_indices) else n - 1
    sorted_mask = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        sorted_mask[: int(num_to_mask)] = False
    full = torch.zeros_like(mask_flat, dtype=torch.bool)
    full[mask_flat] = sorted_mask[restored_indices]
    return full.view_as(loss_mask)


def areal_ppo_actor_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    importance_sampling_level: str = "token",
) -> Tensor:
    """``ppo_actor_loss_fn`` with ``rejection_sampling=None``; ``advantages`` per token."""
    loss_mask_count = loss_mask.count_nonzero() or 1
    if importance_sampling_level == "sequence":
        log_ratio = logprobs - proximal_logprobs
        seq_log_ratio_mean = torch.where(loss_mask, log_ratio, 0.0).sum(dim=1) / (
            loss_mask.sum(dim=1).clamp(min=1)
        )
        ratio = torch.exp(seq_log_ratio_mean.unsqueeze(1).expand_as(log_ratio))
        ratio = torch.where(loss_mask, ratio, 0.0)
        seq_lengths = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
        advantages = (advantages.sum(dim=-1, keepdim=True) / seq_lengths).expand_as(log_ratio)
    else:
        ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if c_clip is not None:
        pg_loss3 = torch.sign(advantages) * c_clip * advantages
        pg_loss = torch.min(pg_loss, pg_loss3)
    return torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count


def _per_token(adv: Tensor, mask: Tensor) -> Tensor:
    """AReaL's advantages: per token, 0 off the loss mask (as its GAE leaves them)."""
    return torch.where(mask, adv[:, None].expand(mask.shape), 0.0)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("threshold", [0.04, 0.1, 1e-6])  # 1e-6: AReaL keeps a single token
def test_m2po_masks_as_areal(seed: int, threshold: float) -> None:
    _, prox, behav, mask, _ = _batch(seed)
    ours = correct(M2PO(threshold=threshold), logp_prox=prox, logp_behav=behav, mask=mask).mask
    ref = areal_m2po_mask(behav, prox, mask, threshold)
    assert torch.equal(ours, ref)
    assert 0 < int(ours.sum()) < int(mask.sum())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("high", "dual"), [(None, None), (0.28, 3.0)])
def test_m2po_loss_as_areal_grpo_loss_fn(seed: int, high: float | None, dual: float | None) -> None:
    """AReaL's ``grpo_loss_fn`` with ``m2_threshold``: the M2PO mask, then PPO-clip against
    π_prox over the kept tokens, divided by their count (sprawl's ``kept`` normaliser)."""
    batch = _batch(seed)
    logp, prox, behav, mask, adv = batch
    kw = {"clip_eps": 0.2} | ({} if high is None else {"clip_eps_high": high})
    kw |= {} if dual is None else {"dual_clip_c": dual}
    ours = _ours(batch, M2PO(threshold=0.1), "token_mean", **kw)
    kept = areal_m2po_mask(behav, prox, mask, 0.1)
    ref = areal_ppo_actor_loss(
        logp, prox, _per_token(adv, mask), kept, eps_clip=0.2, eps_clip_higher=high, c_clip=dual
    )
    _compare(ours, ref, logp)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("high", "dual"), [(None, None), (0.28, 3.0)])
def test_none_anchored_on_behaviour_as_areal_coupled_loss(
    seed: int, high: float | None, dual: float | None
) -> None:
    """AReaL's ``use_decoupled_loss = false`` without ``recompute_logprob``: ``grpo_loss_fn``
    passes the engine's log probs as ``proximal_logprobs``, so PPO-clip is taken against μ."""
    batch = _batch(seed)
    logp, _, behav, mask, adv = batch
    kw = {"clip_eps": 0.2} | ({} if high is None else {"clip_eps_high": high})
    kw |= {} if dual is None else {"dual_clip_c": dual}
    ours = _ours(batch, NoCorrection(anchor="behaviour"), "token_mean", **kw)
    ref = areal_ppo_actor_loss(
        logp, behav, _per_token(adv, mask), mask, eps_clip=0.2, eps_clip_higher=high, c_clip=dual
    )
    _compare(ours, ref, logp)
    recomputed = _ours(batch, NoCorrection(), "token_mean", **kw)  # the default: against π_prox
    assert not torch.allclose(ours, recomputed)


# ---- verl -------------------------------------------------------------------------------------


def verl_agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
    """``agg_loss`` on one data-parallel rank, no global batch info."""
    if loss_agg_mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    seq_mask = torch.sum(loss_mask, dim=-1)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def verl_cispo(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
    clip_ratio_low: float, clip_ratio_high: float,
) -> Tensor:  # fmt: skip
    """``compute_policy_loss_cispo`` (token-mean)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio_sg = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    return verl_agg_loss(pg_losses, response_mask.float(), "token-mean")


def verl_gspo(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
    clip_ratio_low: float, clip_ratio_high: float,
) -> Tensor:  # fmt: skip
    """``compute_policy_loss_gspo`` (the GSPO-token form; always seq-mean-token-mean)."""
    response_mask = response_mask.float()
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = (
        log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    )
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=10.0))
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(
        seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high
    )
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    return verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")


# ---- SkyRL ------------------------------------------------------------------------------------


def skyrl_reduce(loss: Tensor, loss_mask: Tensor) -> Tensor:
    return (loss * loss_mask).sum()


def skyrl_scale(advantages: Tensor, loss_mask: Tensor, loss_reduction: str) -> Tensor:
    """``apply_loss_reduction_to_advantages_minibatch`` (``token_mean``, ``sequence_mean``)."""
    if loss_reduction == "token_mean":
        return advantages / loss_mask.sum().clamp(min=1)
    batch_size = advantages.shape[0]
    return advantages / (batch_size * loss_mask.sum(dim=-1, keepdim=True).clamp(min=1))


def skyrl_cispo(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor,
    rollout_logprobs: Tensor, *, anchor: str, eps_low: float, eps_high: float,
) -> Tensor:  # fmt: skip
    """``compute_policy_loss_cispo`` (no TIS) after ``token_mean`` scaling."""
    behavior_log_probs = rollout_logprobs if anchor == "rollout" else old_log_probs
    delta = log_probs - behavior_log_probs
    ratio = torch.clamp(delta.to(torch.float32), -20.0, 20.0).exp().to(log_probs.dtype)
    clamped_ratio = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -advantages * clamped_ratio.detach() * log_probs
    return skyrl_reduce(loss, loss_mask)


def skyrl_gspo(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
    eps_low: float, eps_high: float,
) -> Tensor:  # fmt: skip
    """``gspo_policy_loss`` after ``sequence_mean`` scaling."""
    log_ratio = log_probs - old_log_probs
    m = loss_mask.float()
    log_importance_weights = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    log_token = log_probs - log_probs.detach() + log_importance_weights.detach()
    ratio = torch.exp(torch.clamp(log_token, max=10))
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    return skyrl_reduce(-torch.min(surr1, surr2), m)


# ---- TRL --------------------------------------------------------------------------------------


def trl_cispo(
    per_token_logps: Tensor, old_per_token_logps: Tensor, advantages: Tensor, mask: Tensor, *,
    epsilon_high: float,
) -> Tensor:  # fmt: skip
    """``_compute_loss``, ``loss_type="cispo"``, token level, one process."""
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
    per_token_loss = -clamped_ratios * advantages.unsqueeze(1) * per_token_logps
    normalizer = mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum() / normalizer


def trl_gspo(
    per_token_logps: Tensor, old_per_token_logps: Tensor, advantages: Tensor, mask: Tensor, *,
    epsilon_low: float, epsilon_high: float,
) -> Tensor:  # fmt: skip
    """``_compute_loss``, ``importance_sampling_level="sequence"``, ``loss_type="grpo"``."""
    mask = mask.float()
    log_ratio = per_token_logps - old_per_token_logps
    log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_importance_weights.unsqueeze(-1))
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


# ---- the comparisons --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("anchor", ["proximal", "behaviour"])
def test_cispo_as_verl_skyrl_and_trl(seed: int, anchor: str) -> None:
    batch = _batch(seed, stale=0.6, drift=0.4)  # ratios leave [0.8, 1.3] and [0, 2] both ways
    logp, prox, behav, mask, adv = batch
    ref_old = behav if anchor == "behaviour" else prox
    skyrl_anchor = "rollout" if anchor == "behaviour" else "old"
    mf, a = mask.float(), adv[:, None]
    for lo, hi in [(0.2, 0.3), (1.0, 1.0)]:
        cfg = CISPO(clip_eps=lo, clip_eps_high=hi, anchor=anchor)  # type: ignore[arg-type]
        ours = _ours(batch, cfg, "token_mean")
        verl = verl_cispo(ref_old, logp, a, mf, clip_ratio_low=lo, clip_ratio_high=hi)
        _compare(ours, verl, logp)
        scaled = skyrl_scale(a.expand(mask.shape), mf, "token_mean")
        skyrl = skyrl_cispo(
            logp, prox, scaled, mf, behav, anchor=skyrl_anchor, eps_low=lo, eps_high=hi
        )
        _compare(ours, skyrl, logp)
        if lo == 1.0:  # TRL has an upper bound only, and it is the bound itself
            _compare(ours, trl_cispo(logp, ref_old, adv, mf, epsilon_high=1.0 + hi), logp)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("lo", "hi"), [(3e-4, 4e-4), (0.05, 0.1)])
def test_gspo_as_trl_verl_skyrl_and_areal(seed: int, lo: float, hi: float) -> None:
    batch = _batch(seed, stale=0.3, drift=0.05)  # sequence ratios inside and outside the band
    logp, prox, _, mask, adv = batch
    mf = mask.float()
    ours = _ours(batch, GSPO(clip_eps=lo, clip_eps_high=hi), "seq_mean")
    _compare(ours, trl_gspo(logp, prox, adv, mf, epsilon_low=lo, epsilon_high=hi), logp)
    a = adv[:, None].expand(mask.shape)
    _compare(ours, verl_gspo(prox, logp, a, mf, clip_ratio_low=lo, clip_ratio_high=hi), logp)
    skyrl = skyrl_gspo(logp, prox, skyrl_scale(a, mf, "sequence_mean"), mf, eps_low=lo, eps_high=hi)
    _compare(ours, skyrl, logp)
    # AReaL's GSPO divides by the batch's tokens (token_mean) and averages per-token advantages
    gen = torch.Generator().manual_seed(seed)
    per_token = _per_token(adv, mask) * (1 + torch.rand(mask.shape, generator=gen))
    token_mean = _ours((logp, prox, prox, mask, per_token), GSPO(clip_eps=lo, clip_eps_high=hi),
                       "token_mean")  # fmt: skip
    areal = areal_ppo_actor_loss(logp, prox, per_token, mask, eps_clip=lo, eps_clip_higher=hi,
                                 importance_sampling_level="sequence")  # fmt: skip
    _compare(token_mean, areal, logp)


def test_the_comparisons_see_clipping() -> None:
    """The tensors above do reach the clipped branches (else the comparisons prove less)."""
    logp, prox, behav, mask, adv = _batch(0, stale=0.6, drift=0.4)
    for cfg in (CISPO(clip_eps=0.2, clip_eps_high=0.3), CISPO(anchor="proximal", clip_eps=0.2)):
        corrected = correct(cfg, logp_prox=prox, logp_behav=behav, mask=mask)
        _, metrics = policy_loss(logp, prox, adv, corrected)
        assert 0.1 < metrics["clip_frac"] < 0.9, (cfg, metrics)
    logp, prox, behav, mask, adv = _batch(0, stale=0.3, drift=0.05)
    corrected = correct(GSPO(), logp_prox=prox, logp_behav=behav, mask=mask)
    _, metrics = policy_loss(logp, prox, adv, corrected, loss_agg="seq_mean")
    assert 0.1 < metrics["clip_frac"] < 0.9, metrics


# ---- behaviour that the references do not cover ----------------------------------------------


def test_cispo_keeps_the_gradient_of_a_clipped_token() -> None:
    """PPO-clip stops a token whose ratio left the band; CISPO bounds its weight instead."""
    prox = torch.tensor([[math.log(0.2)]])
    logp = (prox + math.log(3.0)).requires_grad_()  # r = 3, far above 1 + ε
    mask = torch.ones(1, 1, dtype=torch.bool)
    adv = torch.tensor([1.0])
    ppo = correct(NoCorrection(), logp_prox=prox, logp_behav=prox, mask=mask)
    (g_ppo,) = torch.autograd.grad(policy_loss(logp, prox, adv, ppo)[0], logp)
    assert g_ppo.item() == 0.0
    cfg = CISPO(anchor="proximal", clip_eps=0.2, clip_eps_high=0.28)
    cispo = correct(cfg, logp_prox=prox, logp_behav=prox, mask=mask)
    loss, metrics = policy_loss(logp, prox, adv, cispo)
    (g,) = torch.autograd.grad(loss, logp)
    assert g.item() == pytest.approx(-1.28)  # −sg(clip(3)) · A
    assert metrics["clip_frac"] == 1.0


def test_gspo_clips_the_whole_sequence() -> None:
    """A sequence whose geometric-mean ratio is above 1 + ε_high stops all its tokens' gradient
    for a positive advantage, though some of its tokens' own ratios are below 1."""
    prox = torch.log(torch.full((2, 3), 0.3))
    logp = (prox + torch.tensor([[0.2, -0.05, 0.1], [0.0, 0.0, 0.0]])).requires_grad_()
    mask = torch.ones(2, 3, dtype=torch.bool)
    corrected = correct(GSPO(clip_eps=0.01, clip_eps_high=0.01), logp_prox=prox,
                        logp_behav=prox, mask=mask)  # fmt: skip
    loss, metrics = policy_loss(
        logp, prox, torch.tensor([1.0, 1.0]), corrected, loss_agg="seq_mean"
    )
    (g,) = torch.autograd.grad(loss, logp)
    assert (g[0] == 0).all()
    torch.testing.assert_close(g[1], torch.full((3,), -1 / 6))  # seq mean of 2 rows of 3 tokens
    assert metrics["clip_frac"] == 0.5


@pytest.mark.parametrize(
    "cfg",
    [
        NoCorrection(),
        NoCorrection(anchor="behaviour"),
        CISPO(),
        CISPO(anchor="proximal"),
        GSPO(),
        M2PO(threshold=0.01),
    ],
    ids=str,
)
def test_a_token_the_policy_can_no_longer_sample_is_finite(cfg: Correction) -> None:
    """π_θ's log prob −inf on a kept token (a later minibatch moved it out of the top-k set):
    loss and gradient finite; an empty mask gives 0 with a zero gradient."""
    logp, prox, behav, mask, adv = _batch(1)
    dead = logp.detach().clone()
    dead[0, 0] = float("-inf")
    dead.requires_grad_()
    agg: LossAgg = "seq_mean" if isinstance(cfg, GSPO) else "token_mean"
    corrected = correct(cfg, logp_prox=prox, logp_behav=behav, mask=mask)
    loss, metrics = policy_loss(dead, prox, adv, corrected, loss_agg=agg)
    (g,) = torch.autograd.grad(loss, dead)
    assert torch.isfinite(loss)
    assert torch.isfinite(g).all()
    assert g[0, 0] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    none = torch.zeros_like(mask)
    empty = correct(cfg, logp_prox=prox, logp_behav=behav, mask=none)
    loss, _ = policy_loss(logp, prox, adv, empty, loss_agg=agg)
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0.0
    assert (g == 0).all()


# ---- the figures in docs/staleness.md: python -m tests.staleness.test_surrogates ---------------


def _sweep(seeds: int = 100) -> None:
    """Print the largest |ours − reference| of a loss value or gradient per comparison."""
    worst: dict[str, float] = {}

    def note(name: str, ours: Tensor, ref: Tensor, logp: Tensor) -> None:
        worst[name] = max(worst.get(name, 0.0), _compare(ours, ref, logp))

    same = 0
    for seed in range(seeds):
        _, prox, behav, mask, _ = _batch(seed)
        for th in (0.04, 0.1, 1e-6):
            ours_mask = correct(M2PO(threshold=th), logp_prox=prox, logp_behav=behav, mask=mask)
            same += torch.equal(ours_mask.mask, areal_m2po_mask(behav, prox, mask, th))
        b = _batch(seed)
        logp, prox, behav, mask, adv = b
        kept = areal_m2po_mask(behav, prox, mask, 0.1)
        clip = {"clip_eps": 0.2, "clip_eps_high": 0.28, "dual_clip_c": 3.0}
        ref = areal_ppo_actor_loss(logp, prox, _per_token(adv, mask), kept, eps_clip=0.2,
                                   eps_clip_higher=0.28, c_clip=3.0)  # fmt: skip
        note("m2po loss / AReaL grpo_loss_fn", _ours(b, M2PO(threshold=0.1), "token_mean", **clip),
             ref, logp)  # fmt: skip
        coupled = areal_ppo_actor_loss(logp, behav, _per_token(adv, mask), mask, eps_clip=0.2,
                                       eps_clip_higher=0.28, c_clip=3.0)  # fmt: skip
        naive = _ours(b, NoCorrection(anchor="behaviour"), "token_mean", **clip)
        note("none, anchor behaviour / AReaL coupled loss", naive, coupled, logp)
        b = _batch(seed, stale=0.6, drift=0.4)
        logp, prox, behav, mask, adv = b
        mf, a = mask.float(), adv[:, None]
        for anchor in ("behaviour", "proximal"):
            old = behav if anchor == "behaviour" else prox
            sky = "rollout" if anchor == "behaviour" else "old"
            for lo, hi in ((0.2, 0.3), (1.0, 4.0)):
                ours = _ours(b, CISPO(clip_eps=lo, clip_eps_high=hi, anchor=anchor), "token_mean")  # type: ignore[arg-type]
                note(
                    "cispo / verl",
                    ours,
                    verl_cispo(old, logp, a, mf, clip_ratio_low=lo, clip_ratio_high=hi),
                    logp,
                )
                scaled = skyrl_scale(a.expand(mask.shape), mf, "token_mean")
                note(
                    "cispo / SkyRL",
                    ours,
                    skyrl_cispo(logp, prox, scaled, mf, behav, anchor=sky, eps_low=lo, eps_high=hi),
                    logp,
                )
                if lo == 1.0:
                    note(
                        "cispo / TRL",
                        ours,
                        trl_cispo(logp, old, adv, mf, epsilon_high=1 + hi),
                        logp,
                    )
        b = _batch(seed, stale=0.3, drift=0.05)
        logp, prox, behav, mask, adv = b
        mf, a = mask.float(), adv[:, None].expand(mask.shape)
        for lo, hi in ((3e-4, 4e-4), (0.05, 0.1)):
            cfg = GSPO(clip_eps=lo, clip_eps_high=hi)
            ours = _ours(b, cfg, "seq_mean")
            note(
                "gspo / TRL",
                ours,
                trl_gspo(logp, prox, adv, mf, epsilon_low=lo, epsilon_high=hi),
                logp,
            )
            note(
                "gspo / verl",
                ours,
                verl_gspo(prox, logp, a, mf, clip_ratio_low=lo, clip_ratio_high=hi),
                logp,
            )
            note(
                "gspo / SkyRL",
                ours,
                skyrl_gspo(
                    logp, prox, skyrl_scale(a, mf, "sequence_mean"), mf, eps_low=lo, eps_high=hi
                ),
                logp,
            )
            gen = torch.Generator().manual_seed(seed)
            pt = _per_token(adv, mask) * (1 + torch.rand(mask.shape, generator=gen))
            note(
                "gspo token_mean / AReaL sequence level",
                _ours((logp, prox, prox, mask, pt), cfg, "token_mean"),
                areal_ppo_actor_loss(
                    logp,
                    prox,
                    pt,
                    mask,
                    eps_clip=lo,
                    eps_clip_higher=hi,
                    importance_sampling_level="sequence",
                ),
                logp,
            )
    print(f"m2po masks equal to AReaL's: {same} of {3 * seeds}")
    for name, diff in worst.items():
        print(f"{name:40s} {diff:.2g}")


if __name__ == "__main__":
    _sweep()
