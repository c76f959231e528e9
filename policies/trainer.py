"""The reference trainer: GRPO with a PPO-clip loss, composed with a staleness correction.

One :meth:`Trainer.step` per batch: recompute the current log probs of every sampled token (at the
sampling temperature), take GRPO group-normalized advantages from the rewards, weight/mask tokens
with the configured staleness correction (π_prox = the weights before this step, μ = the engine's
log probs), take one AdamW step with gradient clipping, and publish the served view of the new
version to the board. Version ``v`` is the number of optimizer steps taken.

Not covered yet: optimizer checkpoints and resume, KL / entropy terms, multi-GPU (FSDP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from transformers import AutoModelForCausalLM

from policies.board import Board, Manifest
from staleness.config import Correction
from staleness.corrections import correct
from staleness.loss import group_advantages, policy_loss
from staleness.metrics import correction_metrics

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TrainSample:
    """One episode as the trainer sees it: a token sequence and which tokens were sampled."""

    token_ids: list[int]
    mask: list[bool]  # True where the engine sampled the token (loss applies)
    behaviour_logprobs: list[float]  # μ per token (0.0 where mask is False)
    reward: float


@dataclass(frozen=True)
class TrainerSettings:
    lr: float
    weight_decay: float
    master_dtype: str
    served_dtype: str
    clip_eps: float
    grad_clip: float
    temperature: float
    group_size: int
    device: str = "cpu"
    seed: int = 0


class Trainer:
    """Owns the master weights and the optimizer; publishes every version to a board."""

    def __init__(
        self, model_dir: Path, board: Board, settings: TrainerSettings, correction: Correction
    ) -> None:
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.board = board
        self.correction = correction
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[settings.master_dtype])
        self.model = model.to(settings.device)  # type: ignore[arg-type]
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay
        )
        self.version = 0
        board.create(model_dir)

    def served_view(self) -> dict[str, torch.Tensor]:
        """The tensors engines serve: every state entry cast to the served dtype, once."""
        dtype = DTYPES[self.settings.served_dtype]
        view: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in self.model.state_dict().items():
            if t.data_ptr() in seen:  # tied weights are shipped once
                continue
            seen.add(t.data_ptr())
            view[name] = t.detach().to(
                "cpu", dtype=dtype if t.is_floating_point() else t.dtype, copy=True
            )
        return view

    def publish(self) -> Manifest:
        return self.board.publish(
            self.version, self.served_view(), view_name=self.settings.served_dtype
        )

    def logprobs(self, samples: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log probs [B, T-1] of tokens 1..T under the current weights, and the mask."""
        dev = self.settings.device
        width = max(max(len(s.token_ids) for s in samples), 2)
        ids = torch.zeros(len(samples), width, dtype=torch.long, device=dev)
        attn = torch.zeros_like(ids)
        for i, s in enumerate(samples):
            ids[i, : len(s.token_ids)] = torch.tensor(s.token_ids, dtype=torch.long)
            attn[i, : max(len(s.token_ids), 1)] = 1  # an empty row still attends to one token
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logits = logits / self.settings.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return logp, attn[:, 1:].bool()

    def step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step on ``samples`` (group-contiguous), then publish version + 1."""
        dev = self.settings.device
        width = max(max(len(s.token_ids) for s in samples), 2) - 1
        mask = torch.zeros(len(samples), width, dtype=torch.bool, device=dev)
        behav = torch.zeros(len(samples), width, device=dev)
        for i, s in enumerate(samples):
            n = max(len(s.token_ids) - 1, 0)
            mask[i, :n] = torch.tensor(s.mask[1:], dtype=torch.bool)
            behav[i, :n] = torch.tensor(s.behaviour_logprobs[1:])
        rewards = torch.tensor([s.reward for s in samples], device=dev)
        advantages = group_advantages(rewards, self.settings.group_size)

        logp, _ = self.logprobs(samples)
        logp_prox = logp.detach()
        corrected = correct(self.correction, logp_prox=logp_prox, logp_behav=behav, mask=mask)
        loss, metrics = policy_loss(
            logp, logp_prox, advantages, corrected, clip_eps=self.settings.clip_eps
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        self.version += 1
        manifest = self.publish()
        metrics.update(
            correction_metrics(
                self.correction, corrected, logp_prox=logp_prox, logp_behav=behav, mask=mask
            )
        )
        metrics.update(
            loss=float(loss.detach()),
            grad_norm=float(grad_norm),
            reward_mean=float(rewards.mean()),
            version_bytes=float(manifest.bytes),
        )
        log.info(
            "trainer_step",
            version=self.version,
            loss=round(float(loss.detach()), 5),
            reward_mean=round(float(rewards.mean()), 4),
            samples=len(samples),
        )
        return metrics
