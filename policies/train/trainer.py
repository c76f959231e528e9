"""The reference trainer: GRPO with a PPO-clip loss, composed with a staleness correction.

One :meth:`Trainer.step` per batch:

1. recompute the current log probs of every sampled token with the trainer's weights, under the
   distribution the engine sampled it from: its segment's temperature, top-k and top-p
   (``TrainSample.sampling``, :mod:`policies.train.samples`; :mod:`policies.train.scoring`, a
   chunk of tokens at a time, so no fp32 [tokens, vocab] tensor exists beyond
   ``trainer.logit_chunk_tokens`` tokens);
2. GRPO group-normalized advantages from the episode rewards (``staleness.loss.group_advantages``;
   divided by the group std unless ``staleness.scale_rewards`` resolves to false, as for
   ``dr_grpo``);
3. the configured staleness correction weights/masks each token (π_prox = the weights before this
   step, μ = the engine's log probs; ``staleness.corrections.correct``);
4. loss = PPO-clip policy term (``staleness.loss.policy_loss``)
   ``+ kl_coef · KL(π_θ ‖ π_ref)`` (``kl_penalty`` with ``kl_estimator``, π_ref = version 0, kept
   frozen, scored with the same transforms; tokens outside its sampled set are left out)
   ``− entropy_coef · H(π_θ)`` (full-vocabulary entropy of the distribution sampled from); all
   three summed over the tokens the correction kept and aggregated alike, by
   ``staleness.loss_agg`` with ``staleness.normalizer``. With ``trainer.micro_batch_tokens`` steps
   1–4 run per micro-batch of consecutive samples, each backpropagating its loss *sum*; the
   summed gradients are divided once by the whole batch's normaliser
   (``staleness.loss.normaliser``), so the gradient is the unsplit batch's. Corrections are per
   row (token or sequence level), so a micro-batch of whole rows computes them exactly
   (steps 3–4: :mod:`policies.train.objective`);
5. one AdamW step (fp32 or bf16 master weights, at ``trainer.lr_schedule``'s rate for this
   version) after clipping the global gradient norm;
6. ``version += 1``; the checkpoint is written; the served view of the new version is published.

Version ``v`` is the number of optimizer steps taken.

With ``trainer.lora`` set the model carries a fresh peft LoRA adapter and only the adapter is
trained (the base weights stay frozen, bit for bit); each version's served view is the adapter,
published through the board like any view (:mod:`policies.train.lora`).

Checkpoints (when ``checkpoint_dir`` is set): after every step, one file ``trainer.pt`` holding the
model state, the optimizer state, the torch CPU RNG state and the version, written to a temporary
sibling, fsynced and renamed over the old one, so a crash loses at most the step in progress and
never leaves a torn checkpoint (:mod:`policies.train.checkpoint`). The checkpoint is written
*before* the version is published, so a resumed trainer is never behind the board;
:meth:`Trainer.ensure_published` republishes the checkpointed version if the crash came between
the two. ``resume=True`` restores the checkpoint if one exists; on CPU the resumed run is
bit-identical to an uninterrupted one (same parameters and optimizer state, bit for bit, given the
same batches).

Not covered: CUDA RNG state (a CUDA resume is deterministic only as far as the kernels are),
multi-GPU (FSDP), learning-rate warmup, and keeping more than the newest checkpoint. With bf16
masters there is no fp32 copy: AdamW updates smaller than half a bf16 ulp are rounded away.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from policies.board import Board, Manifest
from policies.codec.digests import StorageKey, storage_key
from policies.codec.views import ViewSpec, build_view, weight_sources
from policies.errors import CheckpointError, ScoringError
from policies.model.moe import replay_routing, routers
from policies.train.checkpoint import CHECKPOINT, restore_checkpoint, write_checkpoint
from policies.train.config import TrainerConfig
from policies.train.lora import adapter_view, with_lora
from policies.train.objective import micro_batch_loss, step_metrics
from policies.train.samples import (
    TrainSample,
    check_routing,
    loss_targets,
    micro_batches,
    pad_batch,
    routing_to_replay,
)
from policies.train.scoring import (
    Scored,
    TokenSampling,
    check_head,
    concat,
    output_head,
    score_chunked,
    token_sampling,
)
from staleness.config import StalenessConfig
from staleness.loss import group_advantages, normaliser

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tied_once(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor once: a name whose tensor is another's (the same storage,
    offset, shape, stride and dtype: tied weights) is left out. Tensors that merely share an
    address — empty ones, or two views of one storage — are all kept."""
    out: dict[str, torch.Tensor] = {}
    seen: set[StorageKey] = set()
    for name, t in state.items():
        key = storage_key(t)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t.detach()
    return out


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
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        checkpoint_dir: Path | None = None,
        resume: bool = False,
    ) -> None:
        """``staleness`` is the run's ``[staleness]`` section (correction and loss aggregation),
        ``temperature``, ``top_k``, ``top_p`` the run's sampling transforms (log probs are
        rescored with them where a sample does not record its segments'), ``group_size`` the
        episodes per GRPO group; ``resume`` restores the checkpoint in ``checkpoint_dir`` if
        there is one."""
        torch.manual_seed(seed)
        self.config = config
        self.sampling = (temperature, top_k, top_p)
        self.group_size = group_size
        self.checkpoint_dir = checkpoint_dir
        self.board = board
        self.staleness = staleness
        self.correction = staleness.correction
        self.model = _load(model_dir, config)
        if config.lora is not None:
            self.model = with_lora(self.model, config.lora)
        check_head(self.model)
        if config.router_replay and not routers(self.model):
            msg = (
                f"trainer.router_replay = true needs a mixture-of-experts model (Qwen2-MoE / "
                f"Qwen3-MoE routers); {model_dir} is a {type(self.model).__name__}"
            )
            raise ScoringError(msg)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            weight_decay=config.weight_decay,
        )
        self.reference: PreTrainedModel | None = None
        if config.kl_coef > 0:
            self.reference = _load(model_dir, config)
            self.reference.requires_grad_(False)
            self.reference.train(False)
        self.version = 0
        self._published: Manifest | None = None  # this process's last publish
        self._scales: dict[str, torch.Tensor] = {}  # scale tensors fixed since the last anchor
        board.create(model_dir)
        if resume and self.checkpoint_path is not None and self.checkpoint_path.exists():
            self._restore(self.checkpoint_path)

    # -- versions ------------------------------------------------------------------------------
    def served_view(self) -> dict[str, torch.Tensor]:
        """The tensors engines serve (``trainer.served_view``), on the trainer's device (a GPU
        trainer's view is scanned there when published: only the changes cross to the host,
        ``policies.board.publish``), tied weights once:
        the state cast to a float dtype, or its quantized view (``policies.codec.views``) with
        ``trainer.scale_policy``'s scales. With ``trainer.lora`` set: the adapter's tensors
        (:func:`policies.train.lora.adapter_view`)."""
        if self.config.lora is not None:
            return adapter_view(self.model, self.config.lora, DTYPES[self.config.served_view])
        state = tied_once(self.model.state_dict())
        spec = view_spec(self.config)
        if spec is None:
            dtype = DTYPES[self.config.served_view]
            return {
                name: t.to(dtype=dtype if t.is_floating_point() else t.dtype, copy=True)
                for name, t in state.items()
            }
        return build_view(state, spec, anchor=None if self._scales_due() else self._scales)

    def publish(self) -> Manifest:
        """Publish the current version's served view (the manifest's ``view`` names it).

        ``fixed_between_anchors`` scales are recomputed exactly at the versions the board is
        bound to anchor: this process's first publish (a fresh publisher anchors) and the
        version ``board.anchor_every`` after the last anchor. Anchors the board adds early
        (``anchor_fraction``) keep the scales, so a recomputation never lands in a delta."""
        due = self._scales_due()
        view = self.served_view()
        manifest = self.board.publish(self.version, view, view_name=self.config.served_view)
        if due and self.config.scale_policy == "fixed_between_anchors":
            self._scales = {s: view[s] for src in weight_sources(view).values() for s in src[1:]}
        self._published = manifest
        return manifest

    def _scales_due(self) -> bool:
        last = self._published
        return (
            last is None
            or last.anchor is None
            or self.version - last.anchor >= self.board.options.anchor_every
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
        write_checkpoint(
            path,
            version=self.version,
            master_dtype=self.config.master_dtype,
            model=self.model,
            optimizer=self.optimizer,
        )
        return path

    def _restore(self, path: Path) -> None:
        self.version = restore_checkpoint(
            path, master_dtype=self.config.master_dtype, model=self.model, optimizer=self.optimizer
        )
        log.info("trainer_resumed", version=self.version, checkpoint=str(path))

    # -- scoring -------------------------------------------------------------------------------
    def _score(
        self,
        model: PreTrainedModel,
        ids: torch.Tensor,
        attn: torch.Tensor,
        how: TokenSampling,
        routed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log probs [B, T-1] of tokens 1..T under the distribution each was sampled from (its
        segment's transforms, ``how`` [B, T]) and that distribution's entropy; 0 on padding.
        ``routed`` [B, T, layers, top_k]: the experts to route each position to (-1: the
        router's own choice; :func:`policies.model.moe.replay_routing`)."""
        if routed is None:
            hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
        else:
            with replay_routing(model, routed):
                hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
        live = attn[:, 1:].bool()
        logp, ent = score_chunked(
            hidden[:, :-1][live],
            output_head(model),
            ids[:, 1:][live],
            how[:, 1:].flat(live),
            chunk_tokens=self.config.logit_chunk_tokens,
        )
        zeros = torch.zeros(live.shape, dtype=logp.dtype, device=logp.device)
        return zeros.masked_scatter(live, logp), zeros.masked_scatter(live, ent)

    def _sampling(self, samples: Sequence[TrainSample], width: int) -> TokenSampling:
        rows = [s.sampling for s in samples]
        return token_sampling(rows, width, self.sampling, self.config.device)

    def _routing(self, samples: Sequence[TrainSample], width: int) -> torch.Tensor | None:
        return routing_to_replay(samples, width, self.config.router_replay, self.config.device)

    @torch.no_grad()
    def logprobs(self, samples: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log probs [B, T-1] of tokens 1..T under the current weights, and the mask.

        For inspection (no gradient); :meth:`step` scores with gradients itself."""
        check_routing(samples, self.config.router_replay)
        ids, attn = pad_batch(samples, self.config.device)
        how, routed = self._sampling(samples, ids.shape[1]), self._routing(samples, ids.shape[1])
        logp, _ = self._score(self.model, ids, attn, how, routed)
        return logp, attn[:, 1:].bool()

    # -- the update ----------------------------------------------------------------------------
    def _backward(self, samples: Sequence[TrainSample], advantages: torch.Tensor) -> Scored:
        """Forward and backward of one micro-batch's loss *sum* (the caller divides the summed
        gradients by the whole batch's normaliser); returns its detached per-token values."""
        ids, attn = pad_batch(samples, self.config.device)
        how = self._sampling(samples, ids.shape[1])
        routed = self._routing(samples, ids.shape[1])
        mask, behav = loss_targets(samples, ids.shape[1] - 1, self.config.device)
        logp, entropy = self._score(self.model, ids, attn, how, routed)
        logp_ref = None
        if self.reference is not None:
            with torch.no_grad():
                logp_ref, _ = self._score(self.reference, ids, attn, how, routed)
        loss, scored = micro_batch_loss(
            logp,
            entropy,
            logp_ref,
            behav,
            mask,
            advantages,
            correction=self.correction,
            config=self.config,
            staleness=self.staleness,
        )
        loss.backward()  # type: ignore[no-untyped-call]
        return scored

    def _update(
        self, samples: Sequence[TrainSample], advantages: torch.Tensor
    ) -> tuple[Scored, int, float]:
        """Accumulate the batch's gradient micro-batch by micro-batch, divide it once by the
        whole batch's normaliser, clip its norm and step the optimizer; return the batch's
        values, the number of micro-batches and the gradient norm before clipping."""
        st = self.staleness
        self.optimizer.zero_grad(set_to_none=True)
        parts = [
            self._backward([samples[i] for i in rows], advantages[rows.start : rows.stop])
            for rows in micro_batches(samples, self.config.micro_batch_tokens)
        ]
        whole = concat(parts)
        den = normaliser(
            whole.corrected.mask,
            st.loss_agg,
            normalizer=st.normalizer,
            valid=whole.mask,
            dr_grpo_tokens=st.dr_grpo_tokens,
        )
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.div_(den)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr_at(self.version)
        self.optimizer.step()
        return whole, len(parts), float(grad_norm)

    def step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step on ``samples`` (group-contiguous), then publish version + 1."""
        s, st = self.config, self.staleness
        rewards = torch.tensor([sample.reward for sample in samples], device=s.device)
        advantages = group_advantages(rewards, self.group_size, normalize_std=st.scales_rewards)
        check_routing(samples, s.router_replay)
        whole, micro, grad_norm = self._update(samples, advantages)
        self.version += 1
        if self.checkpoint_path is not None:
            self.save_checkpoint()
        manifest = self.publish()
        metrics = step_metrics(
            whole, advantages, correction=self.correction, config=s, staleness=st
        )
        metrics.update(
            grad_norm=grad_norm,
            lr=s.lr_at(self.version - 1),
            reward_mean=float(rewards.mean()),
            version_bytes=float(manifest.bytes),
            micro_batches=float(micro),
        )
        if s.router_replay:  # scored by the trainer's own routing: the engine reported none
            unrouted = sum(sample.routed_experts is None for sample in samples)
            metrics["router_replay/unrouted_samples"] = float(unrouted)
        log.info(
            "trainer_step",
            version=self.version,
            loss=round(metrics["loss"], 5),
            reward_mean=round(float(rewards.mean()), 4),
            samples=len(samples),
        )
        return metrics


def view_spec(config: TrainerConfig) -> ViewSpec | None:
    """The quantized view ``trainer.served_view`` names (None for a float cast)."""
    kind = config.served_view
    if kind == "fp8_block" or kind == "int4_group" or kind == "nvfp4":
        return ViewSpec(kind=kind, scale_policy=config.scale_policy or "pow2")
    return None


def _load(model_dir: Path, config: TrainerConfig) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[config.master_dtype])
    loaded: PreTrainedModel = model.to(config.device)  # type: ignore[arg-type]
    return loaded
