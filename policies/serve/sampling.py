"""How the reference engine samples a token, and the log prob it reports for it.

:func:`sample_token` is the rule every log prob sprawl records refers to: the reference engine's
decode batcher (:mod:`policies.serve.decode`) samples with it, and the trainer rescores with the
same transforms (:func:`policies.train.scoring.sampled_logprobs`).

Guarantees: the log prob reported is that of the token under the distribution it was actually
sampled from (after temperature, top-k and top-p); the draw uses only the generator it is given;
NaN logits raise :class:`~policies.errors.EngineError` (the row fails, not the batch).
"""

from __future__ import annotations

import torch

from policies.errors import EngineError


def sample_token(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator
) -> tuple[int, float]:
    """Sample one token id from 1-D ``logits``; return it with its log prob as sampled.

    The distribution is logits / temperature, then top-k, then top-p (the smallest prefix whose
    mass reaches ``top_p``; the top token always stays, so a ``top_p`` that rounds to 0 keeps only
    it), renormalized. Temperature 0 is greedy and reports the log prob under the untempered
    distribution; so is a temperature so small that logits / temperature overflows (its limit).
    NaN logits raise :class:`EngineError` (the row fails, not the batch).
    """
    if bool(torch.isnan(logits).any()):
        raise EngineError("the model produced NaN logits")
    scaled = logits / temperature if temperature > 0.0 else logits
    if temperature == 0.0 or not bool(torch.isfinite(scaled.max())):
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    if top_k > 0 and top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        outside = (torch.cumsum(probs, -1) - probs) >= top_p
        outside[0] = False
        scaled = scaled.scatter(0, order[outside], float("-inf"))
    logp = torch.log_softmax(scaled, -1)
    token = int(torch.multinomial(logp.exp(), 1, generator=gen))
    return token, float(logp[token])
