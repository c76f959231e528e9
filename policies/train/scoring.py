"""Scoring sampled tokens as the engine sampled them, a chunk of tokens at a time.

The engine samples each token from ``logits / temperature``, then keeps the ``top_k`` most likely,
then the smallest prefix of the rest whose mass reaches ``top_p``, renormalized
(:func:`policies.serve.sampling.sample_token`). :func:`sampled_logprobs` applies the same
transforms, in the same order, per token, so on-policy the trainer's log probs equal the engine's.
:func:`score_chunked` computes them (and the entropy of that distribution) from the model's last
hidden states, projecting ``logit_chunk_tokens`` tokens through the output head at a time under
:func:`torch.utils.checkpoint.checkpoint`: no fp32 ``[tokens, vocab]`` tensor exists beyond one
chunk's, in the forward or the backward (which recomputes each chunk's logits). :func:`check_head`
refuses a model whose logits are something else than its output head applied to its last hidden
states; :class:`Scored` / :func:`concat` carry a micro-batch's detached values to the step's
whole-batch metrics.

Guarantees: a token outside the truncated set (possible off-policy: the weights moved since it was
sampled) gets log prob −inf, and its gradient, like every excluded token's, is exactly 0, never
NaN; the entropy sums only over the kept tokens. Temperature 0 (greedy) scores under the
untempered, untruncated distribution, as the engine reports it; so does a temperature so small that
``logits / temperature`` overflows.

Not covered: ties at a top-k / top-p boundary ordered differently by the engine's sort (a token
within float rounding of the boundary may be in one set and not the other).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from policies.errors import ScoringError
from policies.wire.batches import SegmentSampling
from staleness.types import Corrected

__all__ = [
    "Scored",
    "TokenSampling",
    "check_head",
    "concat",
    "output_head",
    "pad_cat",
    "sampled_logprobs",
    "score_chunked",
    "token_sampling",
]


@dataclass(frozen=True)
class TokenSampling:
    """Sampling transforms per position, each [B, T]: ``temperature`` (float, 0: greedy),
    ``top_k`` (int64, 0: off), ``top_p`` (float, 1: off)."""

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor

    def __getitem__(self, index: tuple[slice, slice]) -> TokenSampling:
        return TokenSampling(self.temperature[index], self.top_k[index], self.top_p[index])

    def flat(self, keep: Tensor) -> TokenSampling:
        """The positions on the bool mask ``keep`` [B, T], as [N] tensors."""
        return TokenSampling(self.temperature[keep], self.top_k[keep], self.top_p[keep])


def token_sampling(
    rows: Sequence[Sequence[SegmentSampling]],
    width: int,
    default: tuple[float, int, float],
    device: torch.device | str = "cpu",
) -> TokenSampling:
    """Per-token transforms [len(rows), width] from each row's segments (token ``t`` in
    ``[start, end)`` was sampled with that segment's); tokens outside every segment (prompt,
    environment replies: not trained on) get ``default`` = (temperature, top_k, top_p)."""
    temp, k, p = default
    shape = (len(rows), width)
    out = TokenSampling(
        temperature=torch.full(shape, float(temp), device=device),
        top_k=torch.full(shape, int(k), dtype=torch.long, device=device),
        top_p=torch.full(shape, float(p), device=device),
    )
    for i, segments in enumerate(rows):
        for seg in segments:
            out.temperature[i, seg.start : seg.end] = seg.temperature
            out.top_k[i, seg.start : seg.end] = seg.top_k
            out.top_p[i, seg.start : seg.end] = seg.top_p
    return out


def sampled_logprobs(
    logits: Tensor, targets: Tensor, sampling: TokenSampling
) -> tuple[Tensor, Tensor]:
    """Log prob of ``targets`` [N] and entropy [N] under the distribution each row of ``logits``
    [N, V] was sampled from (``sampling``'s tensors are [N]); both −inf-safe (module docstring)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    temp = sampling.temperature.to(logits.dtype)
    scaled = logits / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
    plain = (temp <= 0) | ~torch.isfinite(scaled.amax(dim=-1))  # greedy, or its limit
    scaled = torch.where(plain[:, None], logits, scaled)
    top_k = torch.where(plain, 0, sampling.top_k)
    top_p = torch.where(plain, torch.ones_like(sampling.top_p), sampling.top_p)
    by_k = (top_k > 0) & (top_k < vocab)
    by_p = top_p < 1.0
    if bool((by_k | by_p).any()):
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        kth = ordered.gather(-1, (torch.where(by_k, top_k, vocab) - 1)[:, None])
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        outside = ((torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]) & by_p[:, None]
        outside[:, 0] = False  # the most likely token always stays
        dropped = (scaled < kth) | torch.zeros_like(outside).scatter(-1, order, outside)
        scaled = scaled.masked_fill(dropped, float("-inf"))
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    finite = logp_all.masked_fill(~torch.isfinite(logp_all), 0.0)  # no 0 · −inf, forward or back
    entropy = -(logp_all.exp() * finite).sum(dim=-1)
    return logp, entropy


def score_chunked(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    targets: Tensor,
    sampling: TokenSampling,
    *,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor]:
    """:func:`sampled_logprobs` of ``head(hidden)`` for ``hidden`` [N, H], ``chunk_tokens`` rows at
    a time; with gradients, each chunk's logits are recomputed in the backward instead of kept."""
    if chunk_tokens < 1:
        msg = f"chunk_tokens must be >= 1, got {chunk_tokens}"
        raise ValueError(msg)

    def one(h: Tensor, t: Tensor, temp: Tensor, k: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        return sampled_logprobs(head(h), t, TokenSampling(temp, k, p))

    logps, entropies = [], []
    for lo in range(0, hidden.shape[0], chunk_tokens):
        part = slice(lo, lo + chunk_tokens)
        args = (
            hidden[part],
            targets[part],
            sampling.temperature[part],
            sampling.top_k[part],
            sampling.top_p[part],
        )
        if torch.is_grad_enabled() and hidden.requires_grad:
            logp, ent = checkpoint(one, *args, use_reentrant=False)
        else:
            logp, ent = one(*args)
        logps.append(logp)
        entropies.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)


@dataclass
class Scored:
    """One micro-batch's per-token values after its backward, detached, [rows, T-1] each, and the
    tokens it left out of the KL term (outside π_ref's sampled set). ``logp`` is π_θ's, the
    weights that took the micro-batch's optimizer step; ``logp_prox`` π_prox's, the weights
    before the batch's first (the same tensor with one minibatch)."""

    logp: torch.Tensor
    logp_prox: torch.Tensor
    behav: torch.Tensor
    mask: torch.Tensor
    corrected: Corrected
    entropy: torch.Tensor
    kl: torch.Tensor
    kl_excluded: int = 0


def pad_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """[rows, T] tensors stacked by rows, each right-padded with 0 (False) to the widest."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])


def concat(parts: Sequence[Scored]) -> Scored:
    """The micro-batches' values as one batch (rows in order, right-padded to the widest)."""
    first = parts[0].corrected
    corrected = Corrected(
        weights=pad_cat([p.corrected.weights for p in parts]),
        mask=pad_cat([p.corrected.mask for p in parts]),
        valid=pad_cat([p.mask if p.corrected.valid is None else p.corrected.valid for p in parts]),
        surrogate=first.surrogate,
        log_rho=None
        if first.log_rho is None
        else pad_cat([p.corrected.log_rho for p in parts if p.corrected.log_rho is not None]),
    )
    return Scored(
        logp=pad_cat([p.logp for p in parts]),
        logp_prox=pad_cat([p.logp_prox for p in parts]),
        behav=pad_cat([p.behav for p in parts]),
        mask=pad_cat([p.mask for p in parts]),
        corrected=corrected,
        entropy=pad_cat([p.entropy for p in parts]),
        kl=pad_cat([p.kl for p in parts]),
        kl_excluded=sum(p.kl_excluded for p in parts),
    )


def check_head(model: PreTrainedModel) -> None:
    """Refuse a model whose logits are not its output head applied to its last hidden state (a
    final soft-cap or scale): the chunked scorer would score it wrongly."""
    ids = torch.tensor([[0, 1, 2]], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        split = output_head(model)(model.base_model(input_ids=ids).last_hidden_state)
    if not torch.allclose(logits.float(), split.float(), rtol=1e-3, atol=1e-4):
        msg = (
            f"{type(model).__name__}: its logits are not its output head applied to its last "
            "hidden state (a final logit soft-cap or scale?); the trainer cannot score it"
        )
        raise ScoringError(msg)


def output_head(model: PreTrainedModel) -> Callable[[Tensor], Tensor]:
    """The module that turns the model's last hidden states into logits."""
    head = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    if not callable(head):
        msg = f"{type(model).__name__} has no output head (get_output_embeddings() is None)"
        raise ScoringError(msg)
    return head  # type: ignore[no-any-return]
