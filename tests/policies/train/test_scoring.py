"""The trainer's scorer: the engine's sampling transforms, chunked over tokens, −inf-safe."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from policies.errors import ScoringError
from policies.serve.sampling import sample_token
from policies.train.samples import TrainSample
from policies.train.scoring import (
    TokenSampling,
    check_head,
    sampled_logprobs,
    score_chunked,
    token_sampling,
)
from policies.wire.batches import SegmentSampling

# (temperature, top_k, top_p) per row kind: plain, tempered, top-k, top-p, both, greedy
KINDS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (0.7, 5, 0.8), (0.0, 0, 1.0)]


def _sampling(n: int, device: str = "cpu") -> TokenSampling:
    rows = [KINDS[i % len(KINDS)] for i in range(n)]
    return TokenSampling(
        temperature=torch.tensor([r[0] for r in rows], device=device),
        top_k=torch.tensor([r[1] for r in rows], dtype=torch.long, device=device),
        top_p=torch.tensor([r[2] for r in rows], device=device),
    )


def test_log_probs_equal_the_engines_for_every_transform() -> None:
    """The engine's sampled token and reported log prob, rescored: the same number."""
    torch.manual_seed(0)
    n = 60
    logits = torch.randn(n, 300) * 3
    how = _sampling(n)
    tokens, reported = [], []
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        t, k, p = KINDS[i % len(KINDS)]
        token, lp = sample_token(logits[i], t, k, p, gen)
        tokens.append(token)
        reported.append(lp)
    logp, entropy = sampled_logprobs(logits, torch.tensor(tokens), how)
    assert torch.allclose(logp, torch.tensor(reported), atol=1e-5)
    full = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    truncated = (how.top_k > 0) | (how.top_p < 1)
    assert bool((entropy[truncated] < full[truncated]).all())  # fewer tokens, less entropy
    plain = how.temperature == 1.0
    assert torch.allclose(entropy[plain & ~truncated], full[plain & ~truncated], atol=1e-5)


def test_a_token_outside_the_kept_set_scores_minus_inf_with_zero_gradient() -> None:
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]] * 2, requires_grad=True)
    how = TokenSampling(temperature=torch.ones(2), top_k=torch.tensor([2, 2]), top_p=torch.ones(2))
    logp, entropy = sampled_logprobs(logits, torch.tensor([0, 3]), how)  # token 3: not in top 2
    assert torch.isneginf(logp[1])
    assert torch.isfinite(logp[0])
    assert torch.isfinite(entropy).all()
    kept = torch.isfinite(logp)
    (torch.where(kept, logp, 0.0).sum() + entropy.sum()).backward()  # type: ignore[no-untyped-call]
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()
    assert float(logits.grad[:, 2:].abs().sum()) == 0.0  # outside the set: no gradient at all


def _head_and_hidden(n: int, vocab: int, width: int) -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(1)
    head = torch.nn.Linear(width, vocab, bias=False)
    with torch.no_grad():
        head.weight.mul_(4.0)
    return head, torch.randn(n, width, requires_grad=True)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_values_and_gradients_equal_the_unchunked(chunk: int) -> None:
    n, vocab = 64, 300
    head, hidden = _head_and_hidden(n, vocab, 16)
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(2))
    how = _sampling(n)

    def run(chunked: bool) -> tuple[torch.Tensor, ...]:
        if chunked:
            logp, ent = score_chunked(hidden, head, targets, how, chunk_tokens=chunk)
        else:
            logp, ent = sampled_logprobs(head(hidden), targets, how)
        loss = torch.where(torch.isfinite(logp), logp, 0.0).sum() + 0.1 * ent.sum()
        g_hidden, g_head = torch.autograd.grad(loss, [hidden, head.weight])
        return logp.detach(), ent.detach(), g_hidden, g_head

    want, got = run(chunked=False), run(chunked=True)
    assert bool(torch.isneginf(want[0]).any()), "no target outside a truncated set: weak test"
    for w, g in zip(want, got, strict=True):
        assert torch.allclose(w, g, atol=1e-5, rtol=1e-5, equal_nan=False)
        assert bool(torch.isfinite(g).any())
    assert all(bool(torch.isfinite(g).all()) for g in got[1:])


class _LargestTensor(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the bytes of the largest tensor any op (forward or backward) produces."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@contextmanager
def _largest() -> Iterator[_LargestTensor]:
    with _LargestTensor() as mode:
        yield mode


def test_chunking_bounds_the_largest_tensor_by_chunk_times_vocab() -> None:
    """Memory: with chunks of c tokens no tensor of the forward or the backward holds more than
    c × vocab values; unchunked, one holds tokens × vocab fp32 values."""
    n, vocab, width, chunk = 512, 1000, 16, 8
    head, hidden = _head_and_hidden(n, vocab, width)
    targets = torch.randint(0, vocab, (n,))
    how = _sampling(n)
    peaks = {}
    for c in (chunk, n):
        with _largest() as mode:
            logp, ent = score_chunked(hidden, head, targets, how, chunk_tokens=c)
            loss = torch.where(torch.isfinite(logp), logp, 0.0).sum() + ent.sum()
            loss.backward()  # type: ignore[no-untyped-call]
        peaks[c] = mode.largest
    per_chunk = chunk * vocab * 8  # the sort's int64 indices are the widest per-token tensor
    assert peaks[chunk] <= max(per_chunk, vocab * width * 4, n * width * 4)
    assert peaks[n] >= n * vocab * 4
    assert peaks[n] >= 8 * peaks[chunk]


def test_token_sampling_maps_segments_to_their_tokens() -> None:
    segs = [SegmentSampling(2, 4, 0.5, 3, 0.9), SegmentSampling(5, 6, 0.0, 0, 1.0)]
    how = token_sampling([segs, []], 7, (1.0, 0, 1.0))
    assert how.temperature.tolist() == [
        [1.0, 1.0, 0.5, 0.5, 1.0, 0.0, 1.0],
        [1.0] * 7,
    ]
    assert how.top_k[0].tolist() == [0, 0, 3, 3, 0, 0, 0]
    assert how.top_p[0, 2:4].tolist() == pytest.approx([0.9, 0.9])


@pytest.mark.parametrize(
    ("seg", "match"),
    [
        (SegmentSampling(3, 9, 1.0, 0, 1.0), r"\[3, 9\) lies outside the 5 tokens"),
        (SegmentSampling(1, 3, -1.0, 0, 1.0), "temperature -1.0"),
        (SegmentSampling(1, 3, 1.0, 0, 0.0), "top_p 0.0"),
    ],
)
def test_a_malformed_sampling_segment_is_refused(seg: SegmentSampling, match: str) -> None:
    with pytest.raises(ScoringError, match=match):
        TrainSample(
            token_ids=[1, 2, 3, 4, 5],
            mask=[False, True, True, False, False],
            behaviour_logprobs=[0.0] * 5,
            reward=0.0,
            sampling=[seg],
        )


def test_a_model_whose_logits_are_not_its_head_is_refused() -> None:
    small: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    check_head(Qwen2ForCausalLM(Qwen2Config(**small)))  # logits = lm_head(last hidden state)
    capped = Gemma2ForCausalLM(Gemma2Config(**small, head_dim=8, final_logit_softcapping=0.5))
    with pytest.raises(ScoringError, match="Gemma2ForCausalLM: its logits are not its output head"):
        check_head(capped)
