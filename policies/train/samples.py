"""The trainer's input: episodes as samples, and a batch of them as the tensors a step needs.

:class:`TrainSample` is one episode as the trainer sees it: its token ids, which tokens the
engine sampled, μ per token, the reward, how each segment was sampled and the MoE routing the
engine reported (:meth:`TrainSample.from_wire` reads one of the batch protocol's). The functions
lay a batch out as tensors: ids and attention mask padded to the longest row (:func:`pad_batch`),
the loss mask and behaviour log probs of tokens 1..T (:func:`loss_targets`), the engine's routing
to replay (:func:`routing_to_replay`), and the split into micro-batches (:func:`micro_batches`).

Guarantees: a sample whose routing or sampling segments do not fit its tokens, or whose sampling
transforms are out of range, is refused with :class:`~policies.errors.ScoringError` as it is
made; padding is token 0 outside the attention mask (an empty row still attends to one
position), out of the loss mask, with μ 0; micro-batches are consecutive rows, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from policies.errors import ScoringError
from policies.wire.batches import BatchSample, SegmentSampling
from policies.wire.routing import decode_routing


@dataclass(frozen=True)
class TrainSample:
    """One episode as the trainer sees it: a token sequence and which tokens were sampled."""

    token_ids: list[int]
    mask: list[bool]  # True where the engine sampled the token (loss applies)
    behaviour_logprobs: list[float]  # μ per token (0.0 where mask is False)
    reward: float
    sampling: Sequence[SegmentSampling] = ()
    """How each segment's tokens were sampled; tokens outside every segment are scored with the
    trainer's defaults (the run's ``[sampling]``)."""
    routed_experts: torch.Tensor | None = None
    """MoE: the experts positions ``0 .. R-1`` were routed to by the engine, ``[R, layers,
    top_k]`` int64 (``trainer.router_replay`` forces them); None: not reported."""
    policy_versions: Sequence[tuple[int, int, int, int]] = ()
    """Per segment ``(start_token, end_token, version_start, version_end)``, as the batch
    protocol's: what the trainer's lag metrics count (empty: none reported)."""

    @classmethod
    def from_wire(cls, sample: BatchSample) -> TrainSample:
        """A sample of the batch protocol (:mod:`policies.wire.batches`) as the trainer's."""
        return cls(
            token_ids=sample.token_ids,
            mask=sample.mask,
            behaviour_logprobs=sample.behaviour_logprobs,
            reward=sample.reward,
            sampling=sample.sampling,
            routed_experts=None
            if sample.routed_experts is None
            else torch.from_numpy(decode_routing(sample.routed_experts)),
            policy_versions=sample.policy_versions,
        )

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        routed = self.routed_experts
        if routed is not None and (routed.ndim != 3 or routed.shape[0] > n):
            msg = (
                f"routed_experts of shape {tuple(routed.shape)}: expected [positions <= {n}, "
                "layers, top_k]"
            )
            raise ScoringError(msg)
        for seg in self.sampling:
            if not 0 <= seg.start <= seg.end <= n:
                msg = f"sampling segment [{seg.start}, {seg.end}) lies outside the {n} tokens"
                raise ScoringError(msg)
            if seg.temperature < 0 or seg.top_k < 0 or not 0 < seg.top_p <= 1:
                msg = (
                    f"sampling segment [{seg.start}, {seg.end}): temperature {seg.temperature} "
                    f"(>= 0), top_k {seg.top_k} (>= 0) or top_p {seg.top_p} (in (0, 1]) "
                    "out of range"
                )
                raise ScoringError(msg)


def pad_batch(samples: Sequence[TrainSample], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] and attention mask of ``samples``, right-padded to the longest (and to at
    least 2 positions)."""
    width = max(max(len(s.token_ids) for s in samples), 2)
    ids = torch.zeros(len(samples), width, dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, : len(s.token_ids)] = torch.tensor(s.token_ids, dtype=torch.long)
        attn[i, : max(len(s.token_ids), 1)] = 1  # an empty row still attends to one token
    return ids, attn


def loss_targets(
    samples: Sequence[TrainSample], width: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of tokens 1..T the engine sampled, and μ of each, [B, ``width``] (False / 0 beyond
    a row's tokens)."""
    mask = torch.zeros(len(samples), width, dtype=torch.bool, device=device)
    behav = torch.zeros(len(samples), width, device=device)
    for i, sample in enumerate(samples):
        n = max(len(sample.token_ids) - 1, 0)
        mask[i, :n] = torch.tensor(sample.mask[1:], dtype=torch.bool)
        behav[i, :n] = torch.tensor(sample.behaviour_logprobs[1:])
    return mask, behav


def check_routing(samples: Sequence[TrainSample], router_replay: bool) -> None:
    """With ``trainer.router_replay`` on, refuse a batch of which no sample carries routing."""
    if router_replay and all(s.routed_experts is None for s in samples):
        msg = (
            "trainer.router_replay = true, but no sample of the batch carries "
            "routed_experts: the engines do not report MoE routing (the reference engine "
            "does; vLLM and SGLang need --enable-return-routed-experts)"
        )
        raise ScoringError(msg)


def routing_to_replay(
    samples: Sequence[TrainSample], width: int, router_replay: bool, device: str
) -> torch.Tensor | None:
    """The engine's routing [B, width, layers, top_k] to replay (-1 where a sample has none)
    when ``trainer.router_replay`` is on; None when it is off or no sample has any."""
    known = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not router_replay or not known:
        return None
    layers, k = known[0].shape[1:]
    out = torch.full((len(samples), width, layers, k), -1, dtype=torch.long)
    for i, sample in enumerate(samples):
        if sample.routed_experts is not None:
            out[i, : sample.routed_experts.shape[0]] = sample.routed_experts
    return out.to(device)


def micro_batches(samples: Sequence[TrainSample], budget: int | None) -> list[range]:
    """Consecutive rows whose padded size (rows × longest row) stays within ``budget``
    (``trainer.micro_batch_tokens``); a row longer than that alone (all rows if None)."""
    if budget is None:
        return [range(len(samples))]
    out, lo, longest = [], 0, 0
    for i, sample in enumerate(samples):
        n = max(len(sample.token_ids), 2)
        if i > lo and max(longest, n) * (i + 1 - lo) > budget:
            out.append(range(lo, i))
            lo, longest = i, 0
        longest = max(longest, n)
    out.append(range(lo, len(samples)))
    return out
