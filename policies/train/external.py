"""A wire batch as tensors, and the staleness correction on it, for a trainer of your own.

An external trainer (``trainer.mode = "feed"`` or ``"external"``) gets a
:class:`~policies.wire.batches.BatchFile`; these helpers give it what the reference trainer
(:class:`policies.train.trainer.Trainer`) computes from the same batch, so that it applies the
same correction:

- :func:`wire_tensors` — token ids and attention [B, T] (padded with 0), and over the T − 1
  scored positions (position t scores token t + 1, as ``logits[:, :-1]`` of a causal LM): the
  loss mask, the engine's log probs μ, the per-token lag (``batch.version`` minus the version
  that started the token's model call, :func:`staleness.lag.segment_lag`; −1 off the mask), the
  sampling transforms each token was drawn with (temperature, top-k, top-p of its segment), and
  GRPO advantages [B] over the whole batch (``staleness.loss.group_advantages``, with the
  batch's ``scale_rewards``);
- :func:`scored_logprobs` — log probs of the batch's tokens from the trainer's logits under
  those transforms, as the reference trainer scores them
  (:func:`policies.train.scoring.sampled_logprobs`);
- :func:`correction` — the batch's ``[staleness.correction]`` applied to the trainer's own π_prox
  log probs (``staleness.corrections.correct``): per-token weights and mask for
  ``staleness.loss.policy_loss``, which the batch's ``staleness`` also parameterises
  (``loss_agg``, ``normalizer``, ``dr_grpo_tokens``).

:meth:`WireTensors.rows` takes a slice of the rows after the advantages were computed over the
whole batch, so ranks that split a batch by rows keep GRPO's group statistics.

Several optimizer steps per batch (the reference trainer's ``trainer.minibatches``) need nothing
more from the protocol, which asks for one version per batch whatever happens in between: score
the rows once without gradient before the first step (π_prox), take :func:`correction` over all of
them, and give each step's ``policy_loss`` its rows of both (:meth:`WireTensors.rows`,
:meth:`staleness.types.Corrected.rows`), as ``examples/torchrun_trainer.py --minibatches K``
does. ``trainer.minibatches`` itself is the in-process trainer's and ``orchestrate train``'s; an
external trainer takes its own setting. Not covered:
splitting the loss normaliser across ranks; :func:`scored_logprobs` holds [B, T − 1, V] fp32
logits at once (the reference trainer chunks them: ``trainer.logit_chunk_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import ValidationError
from torch import Tensor

from policies.errors import PolicyError
from policies.train.scoring import TokenSampling, sampled_logprobs, token_sampling
from policies.wire.batches import BatchFile
from staleness.config import StalenessConfig
from staleness.corrections import correct
from staleness.lag import segment_lag
from staleness.loss import group_advantages
from staleness.types import Corrected, SegmentVersions


@dataclass(frozen=True)
class WireTensors:
    """One batch as tensors (see the module docstring for each field's meaning)."""

    ids: Tensor
    attention: Tensor
    mask: Tensor
    behaviour: Tensor
    lag: Tensor
    advantages: Tensor
    sampling: TokenSampling

    def rows(self, index: slice) -> WireTensors:
        """The rows ``index`` of every field."""
        return WireTensors(
            ids=self.ids[index],
            attention=self.attention[index],
            mask=self.mask[index],
            behaviour=self.behaviour[index],
            lag=self.lag[index],
            advantages=self.advantages[index],
            sampling=self.sampling[index, :],
        )


def staleness_of(batch: BatchFile) -> StalenessConfig:
    """The run's ``[staleness]`` section the batch carries."""
    if batch.staleness is None:
        raise PolicyError(
            f"batch {batch.version} carries no [staleness] section (written by an older sprawl)"
        )
    try:
        return StalenessConfig.model_validate(batch.staleness)
    except ValidationError as exc:
        msg = f"batch {batch.version}: its [staleness] section is not this sprawl's: {exc}"
        raise PolicyError(msg) from None


def wire_tensors(batch: BatchFile, *, device: str | torch.device = "cpu") -> WireTensors:
    """The batch's tensors, laid out as the reference trainer lays them."""
    samples = batch.samples
    if not samples:
        raise PolicyError(f"batch {batch.version} has no samples")
    width = max(max(len(s.token_ids) for s in samples), 2)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(len(samples), width - 1, dtype=torch.bool)
    behaviour = torch.zeros(len(samples), width - 1)
    lag = torch.full((len(samples), width - 1), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        attention[i, : max(n, 1)] = 1  # an empty row still attends to one token
        if n > 1:
            mask[i, : n - 1] = torch.tensor(s.mask[1:], dtype=torch.bool)
            behaviour[i, : n - 1] = torch.tensor(s.behaviour_logprobs[1:])
        for start, end, v_start, v_end in s.policy_versions:
            seg = SegmentVersions(start=v_start, end=v_end, n_tokens=end - start)
            lag[i, max(start - 1, 0) : end - 1] = segment_lag(seg, batch.version)
    lag = torch.where(mask, lag, torch.full_like(lag, -1))
    rewards = torch.tensor([s.reward for s in samples])
    advantages = group_advantages(
        rewards, batch.group_size, normalize_std=staleness_of(batch).scales_rewards
    )
    # the transforms of token t + 1 at scored position t; prompt and environment tokens (not
    # scored) get plain sampling
    sampling = token_sampling([s.sampling for s in samples], width, (1.0, 0, 1.0), device)
    return WireTensors(
        ids=ids.to(device),
        attention=attention.to(device),
        mask=mask.to(device),
        behaviour=behaviour.to(device),
        lag=lag.to(device),
        advantages=advantages.to(device),
        sampling=sampling[:, 1:],
    )


def scored_logprobs(logits: Tensor, tensors: WireTensors) -> Tensor:
    """Log probs [B, T − 1] of ``tensors.ids[:, 1:]`` from ``logits`` [B, T − 1, V] (the model's
    ``logits[:, :-1]``), each under its token's sampling transforms; differentiable. A token
    outside its call's top-k / top-p set scores −inf (mask it, as the correction does)."""
    rows, width, vocab = logits.shape
    keep = torch.ones(rows, width, dtype=torch.bool, device=logits.device)
    logp, _ = sampled_logprobs(
        logits.reshape(-1, vocab), tensors.ids[:, 1:].reshape(-1), tensors.sampling.flat(keep)
    )
    return logp.reshape(rows, width)


def correction(batch: BatchFile, tensors: WireTensors, logp_prox: Tensor) -> Corrected:
    """The batch's correction of ``tensors`` given π_prox log probs [B, T − 1] of the scored
    tokens (the trainer's weights before this step, no gradient needed)."""
    return correct(
        staleness_of(batch).correction,
        logp_prox=logp_prox,
        logp_behav=tensors.behaviour,
        mask=tensors.mask,
    )
