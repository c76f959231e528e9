"""The reference trainer: GRPO with a PPO-clip loss, composed with a staleness correction.

One :meth:`Trainer.step` per batch:

1. recompute the current log probs of every sampled token with the trainer's weights, at the
   sampling temperature (``logits / T``; top-k / top-p are not re-applied, so those truncations
   show up as π/μ mismatch);
2. GRPO group-normalized advantages from the episode rewards (``staleness.loss.group_advantages``;
   divided by the group std unless ``staleness.scale_rewards`` resolves to false, as for
   ``dr_grpo``);
3. the configured staleness correction weights/masks each token (π_prox = the weights before this
   step, μ = the engine's log probs; ``staleness.corrections.correct``);
4. loss = PPO-clip policy term (``staleness.loss.policy_loss``)
   ``+ kl_coef · KL(π_θ ‖ π_ref)`` (``kl_penalty`` with ``kl_estimator``, π_ref = version 0, kept
   frozen, scored at the same temperature) ``− entropy_coef · H(π_θ)`` (full-vocabulary entropy of
   the tempered distribution); all three summed over the tokens the correction kept and
   aggregated alike, by ``staleness.loss_agg`` with ``staleness.normalizer``;
5. one AdamW step (fp32 or bf16 master weights) after clipping the global gradient norm;
6. ``version += 1``; the checkpoint is written; the served view of the new version is published.

Version ``v`` is the number of optimizer steps taken.

Checkpoints (when ``checkpoint_dir`` is set): after every step, one file ``trainer.pt`` holding the
model state, the optimizer state, the torch CPU RNG state and the version, written to a temporary
sibling, fsynced and renamed over the old one, so a crash loses at most the step in progress and
never leaves a torn checkpoint. The checkpoint is written *before* the version is published, so a
resumed trainer is never behind the board; :meth:`Trainer.ensure_published` republishes the
checkpointed version if the crash came between the two. ``resume=True`` restores the checkpoint if
one exists; on CPU the resumed run is bit-identical to an uninterrupted one (same parameters and
optimizer state, bit for bit, given the same batches).

Not covered: CUDA RNG state (a CUDA resume is deterministic only as far as the kernels are),
multi-GPU (FSDP), learning-rate schedules, and keeping more than the newest checkpoint. With bf16
masters there is no fp32 copy: AdamW updates smaller than half a bf16 ulp are rounded away.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from policies.board import Board, Manifest
from policies.errors import CheckpointError
from policies.train.config import TrainerConfig
from staleness.config import StalenessConfig
from staleness.corrections import correct
from staleness.loss import aggregate, group_advantages, kl_penalty, policy_loss
from staleness.metrics import correction_metrics

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECKPOINT = "trainer.pt"
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class TrainSample:
    """One episode as the trainer sees it: a token sequence and which tokens were sampled."""

    token_ids: list[int]
    mask: list[bool]  # True where the engine sampled the token (loss applies)
    behaviour_logprobs: list[float]  # μ per token (0.0 where mask is False)
    reward: float


class Trainer:
    """Owns the master weights and the optimizer; publishes every version to a board."""

    def __init__(
        self,
        model_dir: Path,
        board: Board,
        config: TrainerConfig,
        *,
        staleness: StalenessConfig,
        temperature: float,
        group_size: int,
        seed: int = 0,
        checkpoint_dir: Path | None = None,
        resume: bool = False,
    ) -> None:
        """``staleness`` is the run's ``[staleness]`` section (correction and loss aggregation),
        ``temperature`` the sampling temperature (log probs are rescored at it), ``group_size``
        the episodes per GRPO group; ``resume`` restores the checkpoint in ``checkpoint_dir`` if
        there is one."""
        torch.manual_seed(seed)
        self.config = config
        self.temperature = temperature
        self.group_size = group_size
        self.checkpoint_dir = checkpoint_dir
        self.board = board
        self.staleness = staleness
        self.correction = staleness.correction
        self.model = _load(model_dir, config)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
        self.reference: PreTrainedModel | None = None
        if config.kl_coef > 0:
            self.reference = _load(model_dir, config)
            self.reference.requires_grad_(False)
            self.reference.train(False)
        self.version = 0
        board.create(model_dir)
        if resume and self.checkpoint_path is not None and self.checkpoint_path.exists():
            self._restore(self.checkpoint_path)

    # -- versions ------------------------------------------------------------------------------
    def served_view(self) -> dict[str, torch.Tensor]:
        """The tensors engines serve: every state entry cast to the served dtype, once."""
        dtype = DTYPES[self.config.served_dtype]
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
            self.version, self.served_view(), view_name=self.config.served_dtype
        )

    def ensure_published(self) -> None:
        """Publish the current version unless the board already has it (after a resume)."""
        latest = self.board.latest()
        if latest is not None and latest > self.version:
            raise CheckpointError(
                f"board {self.board.root} is at version {latest}, ahead of the trainer's "
                f"checkpoint at {self.version}: it belongs to another run"
            )
        if latest != self.version:
            self.publish()

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path | None:
        d = self.checkpoint_dir
        return None if d is None else d / CHECKPOINT

    def save_checkpoint(self) -> Path:
        """Write model + optimizer + RNG + version atomically; return the checkpoint's path."""
        path = self.checkpoint_path
        if path is None:
            raise CheckpointError("the trainer was built without a checkpoint_dir")
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "format": CHECKPOINT_FORMAT,
            "version": self.version,
            "master_dtype": self.config.master_dtype,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
        }
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return path

    def _restore(self, path: Path) -> None:
        try:
            state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # any unpickling failure means the file is not ours / damaged
            raise CheckpointError(f"{path}: unreadable checkpoint: {exc}") from exc
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r} unknown")
        if state["master_dtype"] != self.config.master_dtype:
            raise CheckpointError(
                f"{path}: checkpoint has {state['master_dtype']} masters but "
                f"trainer.master_dtype is {self.config.master_dtype}"
            )
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{path}: checkpoint does not fit this model: {exc}") from exc
        torch.set_rng_state(state["rng"])
        self.version = int(state["version"])
        log.info("trainer_resumed", version=self.version, checkpoint=str(path))

    # -- scoring -------------------------------------------------------------------------------
    def _batch(self, samples: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.config.device
        width = max(max(len(s.token_ids) for s in samples), 2)
        ids = torch.zeros(len(samples), width, dtype=torch.long, device=dev)
        attn = torch.zeros_like(ids)
        for i, s in enumerate(samples):
            ids[i, : len(s.token_ids)] = torch.tensor(s.token_ids, dtype=torch.long)
            attn[i, : max(len(s.token_ids), 1)] = 1  # an empty row still attends to one token
        return ids, attn

    def _score(
        self, model: PreTrainedModel, ids: torch.Tensor, attn: torch.Tensor, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log probs [B, T-1] of tokens 1..T at the sampling temperature (+ entropy if asked)."""
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp_all = torch.log_softmax(logits / self.temperature, -1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None
        return logp, ent

    @torch.no_grad()
    def logprobs(self, samples: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log probs [B, T-1] of tokens 1..T under the current weights, and the mask.

        For inspection (no gradient); :meth:`step` scores with gradients itself."""
        ids, attn = self._batch(samples)
        logp, _ = self._score(self.model, ids, attn, entropy=False)
        return logp, attn[:, 1:].bool()

    # -- the update ----------------------------------------------------------------------------
    def step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step on ``samples`` (group-contiguous), then publish version + 1."""
        s = self.config
        ids, attn = self._batch(samples)
        width = ids.shape[1] - 1
        mask = torch.zeros(len(samples), width, dtype=torch.bool, device=s.device)
        behav = torch.zeros(len(samples), width, device=s.device)
        for i, sample in enumerate(samples):
            n = max(len(sample.token_ids) - 1, 0)
            mask[i, :n] = torch.tensor(sample.mask[1:], dtype=torch.bool)
            behav[i, :n] = torch.tensor(sample.behaviour_logprobs[1:])
        rewards = torch.tensor([sample.reward for sample in samples], device=s.device)
        st = self.staleness
        advantages = group_advantages(rewards, self.group_size, normalize_std=st.scales_rewards)

        logp, entropy = self._score(self.model, ids, attn, entropy=True)
        assert entropy is not None
        logp_prox = logp.detach()
        corrected = correct(self.correction, logp_prox=logp_prox, logp_behav=behav, mask=mask)
        pg_loss, metrics = policy_loss(
            logp,
            logp_prox,
            advantages,
            corrected,
            clip_eps=s.clip_eps,
            loss_agg=st.loss_agg,
            normalizer=st.normalizer,
            dr_grpo_tokens=st.dr_grpo_tokens,
        )
        kept = corrected.mask

        def agg(values: torch.Tensor) -> torch.Tensor:
            return aggregate(
                values,
                kept,
                st.loss_agg,
                normalizer=st.normalizer,
                valid=mask,
                dr_grpo_tokens=st.dr_grpo_tokens,
            )

        ent_term = agg(entropy if s.entropy_coef > 0 else entropy.detach())
        loss = pg_loss - s.entropy_coef * ent_term if s.entropy_coef > 0 else pg_loss
        kl_value = 0.0
        if self.reference is not None:
            with torch.no_grad():
                logp_ref, _ = self._score(self.reference, ids, attn, entropy=False)
            kl = agg(kl_penalty(logp, logp_ref, kept, estimator=s.kl_estimator))
            loss = loss + s.kl_coef * kl
            kl_value = float(kl.detach())

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip)
        self.optimizer.step()
        self.version += 1
        if self.checkpoint_path is not None:
            self.save_checkpoint()
        manifest = self.publish()
        metrics.update(
            correction_metrics(
                self.correction, corrected, logp_prox=logp_prox, logp_behav=behav, mask=mask
            )
        )
        metrics.update(
            loss=float(loss.detach()),
            loss_policy=float(pg_loss.detach()),
            entropy=float(ent_term.detach()),
            kl_ref=kl_value,
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


def _load(model_dir: Path, config: TrainerConfig) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[config.master_dtype])
    loaded: PreTrainedModel = model.to(config.device)  # type: ignore[arg-type]
    return loaded
