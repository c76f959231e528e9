"""Mixture-of-experts routing: record which experts a forward pass routed to, and replay it.

A Qwen2-MoE / Qwen3-MoE model routes every token, in every MoE layer, to the ``top_k`` experts of
largest router softmax probability (``Qwen3MoeTopKRouter``: logits → softmax → top-k →
renormalised over the k when ``norm_topk_prob``). Two numerically different forwards of the same
weights (the engine's bf16 served view, the trainer's fp32 masters) can pick different experts for
a token whose k-th and (k+1)-th probabilities nearly tie, and one flipped expert changes that
token's output, and every later token's, far more than rounding does.

- :class:`RoutingRecorder` captures the expert ids each router picked, per token and MoE layer,
  in the order of ``torch.topk`` (most probable first): ``[tokens, layers, top_k]``.
- :func:`replay_routing` forces a forward to use recorded ids. What is replayed is the
  *selection* only: for a position with recorded ids, the router's own top-k is replaced by them
  and the expert weights are the router's softmax probabilities *of those ids* under the current
  weights (renormalised over the k ids when the model's ``norm_topk_prob`` is set), so the gradient
  still flows into the router as in an ordinary forward. Positions marked ``-1`` (nothing
  recorded) route as usual.

Guarantees: replaying the ids a forward recorded reproduces that forward exactly (same ids, same
weights); a recorder on a replayed forward records the replayed ids. Both work on any model
whose routers are the Qwen2-MoE / Qwen3-MoE top-k router; any other model has no routers here
(:func:`routers` is empty) and is refused by the callers.

Not covered: shared experts (Qwen2-MoE's shared expert is dense, nothing to route) and
auxiliary-loss-free routers with score-correction biases (DeepSeek-V3 style).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

ROUTERS = (Qwen2MoeTopKRouter, Qwen3MoeTopKRouter)
RouterOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Hook = Callable[[nn.Module, object, RouterOutput], RouterOutput | None]


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, one per MoE layer, in layer order (empty: not an MoE model)."""
    return [m for m in model.modules() if isinstance(m, ROUTERS)]


def top_k(model: nn.Module) -> int:
    """Experts per token of an MoE model (0 when it has no routers)."""
    found = routers(model)
    return int(getattr(found[0], "top_k", 0)) if found else 0


class RoutingRecorder:
    """Forward hooks on every router of ``model``; :meth:`take` returns what the forwards since
    the last call routed, ``[tokens, layers, top_k]`` int64 on the CPU (tokens in the order the
    model flattened them: batch-major)."""

    def __init__(self, model: nn.Module) -> None:
        self._layers = routers(model)
        self._seen: list[list[torch.Tensor]] = [[] for _ in self._layers]
        self._handles = [
            router.register_forward_hook(self._hook(i)) for i, router in enumerate(self._layers)
        ]

    @property
    def active(self) -> bool:
        """Whether the model has routers to record."""
        return bool(self._layers)

    @property
    def experts(self) -> int:
        """Experts per MoE layer (0 when there are no routers)."""
        return int(getattr(self._layers[0], "num_experts", 0)) if self._layers else 0

    def _hook(self, layer: int) -> Hook:
        def hook(_module: nn.Module, _args: object, output: RouterOutput) -> None:
            self._seen[layer].append(output[2].detach().to("cpu"))

        return hook

    def take(self) -> torch.Tensor:
        """The recorded ids ``[tokens, layers, top_k]``, forgetting them."""
        per_layer = [torch.cat(seen) for seen in self._seen]
        self._seen = [[] for _ in self._layers]
        return torch.stack(per_layer, dim=1)

    def discard(self) -> None:
        """Forget what was recorded (a forward that failed part-way)."""
        self._seen = [[] for _ in self._layers]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _replayed(router: nn.Module, output: RouterOutput, ids: torch.Tensor) -> RouterOutput:
    """``output`` with the selection of every position whose ``ids`` [N, k] are >= 0 replaced."""
    logits, scores, chosen = output
    known = (ids >= 0).all(dim=-1)
    forced = torch.where(known[:, None], ids.to(chosen.device), chosen)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1).gather(-1, forced)
    if getattr(router, "norm_topk_prob", False):
        probs = probs / probs.sum(dim=-1, keepdim=True)
    weights = torch.where(known[:, None], probs.to(scores.dtype), scores)
    return logits, weights, forced


@contextmanager
def replay_routing(model: nn.Module, routed: torch.Tensor) -> Iterator[None]:
    """Forwards of ``model`` inside the block route by ``routed`` [B, T, layers, top_k] (the ids
    of each position, ``-1`` where none were recorded); every forward must be over a [B, T] batch.

    Raises ``ValueError`` when ``routed`` does not fit the model's routers."""
    found = routers(model)
    k = top_k(model)
    if routed.ndim != 4 or routed.shape[2] != len(found) or routed.shape[3] != k:
        msg = (
            f"routing of shape {tuple(routed.shape)} does not fit the model: it has "
            f"{len(found)} MoE layers of top-{k} routing ([batch, tokens, {len(found)}, {k}])"
        )
        raise ValueError(msg)
    flat = routed.reshape(-1, len(found), k)

    def hook(layer: int) -> Hook:
        def forced(_module: nn.Module, _args: object, output: RouterOutput) -> RouterOutput:
            if output[2].shape[0] != flat.shape[0]:
                msg = (
                    f"a forward over {output[2].shape[0]} tokens under a replay of {flat.shape[0]}"
                )
                raise ValueError(msg)
            return _replayed(found[layer], output, flat[:, layer])

        return forced

    # first among the routers' hooks, so a RoutingRecorder sees the routing the forward used
    handles = [
        router.register_forward_hook(hook(i), prepend=True) for i, router in enumerate(found)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
