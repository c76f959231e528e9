"""The passes of a trainer step: a micro-batch laid out and scored, minibatches, π_prox, lag.

- :class:`Layout` / :func:`layout` — one micro-batch as the tensors its forward needs: token ids
  and attention padded to its longest row, each token's sampling transforms, the engine's routing
  to replay, and over tokens 1..T the loss mask and μ;
- :func:`score` — the log probs [B, T-1] of tokens 1..T under a model, each under the
  distribution it was sampled from, and that distribution's entropy (chunked,
  :func:`policies.train.scoring.score_chunked`);
- :func:`split_groups` — the batch's ``trainer.minibatches`` minibatches: whole GRPO groups,
  consecutive, as even as the group count allows (the first take one group more when it does not
  divide);
- :class:`Proximal` — π_prox: the log probs of the whole batch under the weights before its first
  optimizer step (scored once, without gradient) and the correction over the whole batch, which
  every minibatch's micro-batches take their rows of;
- :func:`lag_metrics` — each sampled token's lag in optimizer steps: a token ``L`` versions old
  trained in minibatch ``j`` (0-based) of ``k`` is ``L·k + j`` optimizer steps behind the weights
  that take the step, since a version is ``k`` steps.

Guarantees: the minibatches cover every row once, in order, each a whole number of groups; a
batch of fewer groups than minibatches is refused (:class:`~policies.errors.ScoringError`) rather
than stepped on empty ones. Not covered: the lag of a run whose ``trainer.minibatches`` changed
across a resume (a version is then not ``k`` steps throughout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from policies.errors import ScoringError
from policies.model.moe import replay_routing
from policies.train.config import TrainerConfig
from policies.train.samples import (
    TrainSample,
    loss_targets,
    micro_batches,
    pad_batch,
    routing_to_replay,
)
from policies.train.scoring import (
    TokenSampling,
    output_head,
    pad_cat,
    score_chunked,
    token_sampling,
)
from staleness.config import Correction
from staleness.corrections import correct
from staleness.lag import segment_lag
from staleness.types import Corrected, SegmentVersions

__all__ = ["Layout", "Proximal", "lag_metrics", "layout", "proximal", "score", "split_groups"]


@dataclass(frozen=True)
class Layout:
    """One micro-batch's tensors: ``ids``/``attn`` [B, T], ``how`` (sampling transforms, [B, T]),
    ``routed`` ([B, T, layers, top_k] or None), ``mask``/``behav`` [B, T-1] (tokens 1..T)."""

    ids: Tensor
    attn: Tensor
    how: TokenSampling
    routed: Tensor | None
    mask: Tensor
    behav: Tensor


def layout(
    samples: Sequence[TrainSample], config: TrainerConfig, default: tuple[float, int, float]
) -> Layout:
    """``samples`` laid out on ``config.device``; ``default`` = the run's (temperature, top_k,
    top_p) for tokens outside every sampling segment."""
    ids, attn = pad_batch(samples, config.device)
    width = ids.shape[1]
    how = token_sampling([s.sampling for s in samples], width, default, config.device)
    routed = routing_to_replay(samples, width, config.router_replay, config.device)
    mask, behav = loss_targets(samples, width - 1, config.device)
    return Layout(ids, attn, how, routed, mask, behav)


def score(model: PreTrainedModel, lay: Layout, chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """Log probs [B, T-1] of tokens 1..T under the distribution each was sampled from (its
    segment's transforms) and that distribution's entropy; 0 on padding. With ``lay.routed``
    each position is routed to those experts (-1: the router's own choice;
    :func:`policies.model.moe.replay_routing`)."""
    ids, attn = lay.ids, lay.attn
    if lay.routed is None:
        hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
    else:
        with replay_routing(model, lay.routed):
            hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
    live = attn[:, 1:].bool()
    logp, ent = score_chunked(
        hidden[:, :-1][live],
        output_head(model),
        ids[:, 1:][live],
        lay.how[:, 1:].flat(live),
        chunk_tokens=chunk_tokens,
    )
    zeros = torch.zeros(live.shape, dtype=logp.dtype, device=logp.device)
    return zeros.masked_scatter(live, logp), zeros.masked_scatter(live, ent)


def split_groups(n_samples: int, group_size: int, k: int) -> list[range]:
    """The rows of ``k`` minibatches of whole groups (``group_size`` consecutive rows each), in
    order; with ``G`` groups the first ``G mod k`` take ``⌈G/k⌉`` groups, the others ``⌊G/k⌋``."""
    groups = n_samples // group_size
    if groups < k or groups * group_size != n_samples:
        msg = (
            f"trainer.minibatches = {k} needs at least {k} whole groups per batch; this batch has "
            f"{n_samples} samples of group_size {group_size}"
        )
        raise ScoringError(msg)
    base, extra = divmod(groups, k)
    out, lo = [], 0
    for j in range(k):
        rows = (base + (j < extra)) * group_size
        out.append(range(lo, lo + rows))
        lo += rows
    return out


@torch.no_grad()
def proximal(
    model: PreTrainedModel,
    samples: Sequence[TrainSample],
    correction: Correction,
    config: TrainerConfig,
    default: tuple[float, int, float],
) -> Proximal:
    """π_prox: the whole batch scored under ``model``'s weights before the batch's first
    optimizer step, micro-batch by micro-batch (``trainer.micro_batch_tokens``), without gradient
    and without dropout (the policy as served, as AReaL's ``compute_logp``), and corrected as one
    batch."""
    logps, behavs, masks = [], [], []
    model.train(False)
    try:
        for rows in micro_batches(samples, config.micro_batch_tokens):
            lay = layout([samples[i] for i in rows], config, default)
            logps.append(score(model, lay, config.logit_chunk_tokens)[0])
            behavs.append(lay.behav)
            masks.append(lay.mask)
    finally:
        model.train()
    logp = pad_cat(logps)
    corrected = correct(correction, logp_prox=logp, logp_behav=pad_cat(behavs), mask=pad_cat(masks))
    return Proximal(logp, corrected)


@dataclass(frozen=True)
class Proximal:
    """π_prox over the whole batch: ``logp`` [B, W] (W the batch's widest row's tokens − 1) and
    the correction computed over all of it."""

    logp: Tensor
    corrected: Corrected

    def rows(self, index: range, width: int) -> tuple[Tensor, Corrected]:
        """The rows ``index`` of the log probs and the correction, cut to ``width`` positions (a
        micro-batch of those rows is padded to its own longest)."""
        at = slice(index.start, index.stop)
        return self.logp[at, :width], self.corrected.rows(at, width)


def lag_metrics(
    samples: Sequence[TrainSample], minibatches: Sequence[range], version: int
) -> dict[str, float]:
    """``lag_steps/mean`` and ``lag_steps/max`` over the batch's sampled tokens and
    ``lag_steps/minibatch_<j>`` (the mean over minibatch ``j``'s), each token's lag in optimizer
    steps being ``(version − its segment's version_start) · k + j``; empty when no sample
    reports its segments' versions. A segment stamped after ``version`` raises
    :class:`~staleness.errors.LagError`."""
    if not any(s.policy_versions for s in samples):
        return {}
    k = len(minibatches)
    out: dict[str, float] = {}
    total, count, most = 0, 0, 0
    for j, rows in enumerate(minibatches):
        mb_total, mb_count = 0, 0
        for i in rows:
            sample = samples[i]
            for start, end, v_start, v_end in sample.policy_versions:
                n = sum(sample.mask[max(start, 0) : end])
                seg = SegmentVersions(start=v_start, end=v_end, n_tokens=n)
                steps = segment_lag(seg, version) * k + j
                mb_total, mb_count = mb_total + steps * n, mb_count + n
                most = max(most, steps) if n else most
        out[f"lag_steps/minibatch_{j}"] = mb_total / mb_count if mb_count else 0.0
        total, count = total + mb_total, count + mb_count
    out["lag_steps/mean"] = total / count if count else 0.0
    out["lag_steps/max"] = float(most)
    return out
