"""The reference trainer: GRPO with a PPO-clip loss, composed with a staleness correction.

One :meth:`Trainer.step` per batch, ``k = trainer.minibatches`` optimizer steps:

1. GRPO group-normalized advantages from the episode rewards over the whole batch
   (``staleness.loss.group_advantages``; divided by the group std unless
   ``staleness.scale_rewards`` resolves to false, as for ``dr_grpo``);
2. with ``k > 1`` (or a correction that is a batch statistic, ``m2po``, over several
   micro-batches): π_prox, the log probs of every sampled token under the weights before the
   batch's first step, scored once without gradient, and the correction over the whole batch
   (:func:`policies.train.passes.proximal`); with ``k = 1`` π_prox is the training pass's own
   log probs, detached, and no extra forward runs;
3. the groups split into ``k`` group-contiguous minibatches (``passes.split_groups``); for each:
   recompute π_θ's log probs of its sampled tokens under the distribution the engine sampled each
   from (its segment's temperature, top-k and top-p; :mod:`policies.train.scoring`, a chunk of
   ``trainer.logit_chunk_tokens`` tokens at a time); the correction weights/masks each token
   (μ = the engine's log probs; ``staleness.corrections.correct``); loss = the policy term
   against π_prox (``staleness.loss.policy_loss``: PPO-clip with ``clip_eps``,
   ``clip_eps_high``, ``dual_clip_c``, or the correction's surrogate) ``+ kl_coef · KL(π_θ ‖
   π_ref)`` (π_ref = version 0, frozen; tokens outside its sampled set left out) ``−
   entropy_coef · H(π_θ)``, all three over the kept tokens and aggregated alike by
   ``staleness.loss_agg`` with ``staleness.normalizer`` over the minibatch; with
   ``trainer.micro_batch_tokens`` per micro-batch of consecutive samples, each backpropagating
   its loss *sum*, the summed gradients divided once by the minibatch's normaliser
   (:mod:`policies.train.objective`); one AdamW step (fp32 or bf16 masters, at the rate
   ``trainer.lr_schedule`` and ``lr_warmup_steps`` give this version) after clipping the
   global gradient norm;
4. ``version += 1``; the checkpoint is written; the served view of the new version is published.

Version ``v`` is the number of batches trained (``k·v`` optimizer steps); a token ``L`` versions
old trained in minibatch ``j`` is ``L·k + j`` optimizer steps behind (``lag_steps/*`` metrics).

With ``trainer.lora`` set the model carries a fresh peft LoRA adapter and only the adapter is
trained (the base weights stay frozen, bit for bit); each version's served view is the adapter,
published through the board like any view (:mod:`policies.train.lora`).

Checkpoints (when ``checkpoint_dir`` is set): after every batch (all ``k`` steps), one file
``trainer.pt`` holding the model state, the optimizer state, the torch CPU RNG state and the
version, written to a temporary sibling, fsynced and renamed over the old one, so a crash loses
at most the batch in progress and never leaves a torn checkpoint
(:mod:`policies.train.checkpoint`). The checkpoint is written *before* the version is published,
so a resumed trainer is never behind the board; :meth:`Trainer.ensure_published` republishes the
checkpointed version if the crash came between the two. ``resume=True`` restores the checkpoint
if one exists and takes the interrupted batch again from its first minibatch; on CPU the resumed
run is bit-identical to an uninterrupted one (same parameters and optimizer state, bit for bit,
given the same batches).

Not covered: CUDA RNG state (a CUDA resume is deterministic only as far as the kernels are),
multi-GPU (FSDP) and keeping more than the newest checkpoint. With bf16
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
from policies.model.moe import routers
from policies.train.checkpoint import CHECKPOINT, restore_checkpoint, write_checkpoint
from policies.train.config import TrainerConfig
from policies.train.lora import adapter_view, with_lora
from policies.train.objective import micro_batch_loss, step_metrics
from policies.train.passes import (
    Layout,
    Proximal,
    lag_metrics,
    layout,
    proximal,
    score,
    split_groups,
)
from policies.train.samples import TrainSample, check_routing, micro_batches
from policies.train.scoring import Scored, check_head, concat
from staleness.config import StalenessConfig
from staleness.corrections import batch_level
from staleness.errors import LagError
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
    def _layout(self, samples: Sequence[TrainSample]) -> Layout:
        return layout(samples, self.config, self.sampling)

    @torch.no_grad()
    def logprobs(self, samples: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log probs [B, T-1] of tokens 1..T under the current weights, and the mask.

        For inspection (no gradient); :meth:`step` scores with gradients itself."""
        check_routing(samples, self.config.router_replay)
        lay = self._layout(samples)
        logp, _ = score(self.model, lay, self.config.logit_chunk_tokens)
        return logp, lay.attn[:, 1:].bool()

    # -- the update ----------------------------------------------------------------------------
    def _backward(
        self,
        samples: Sequence[TrainSample],
        advantages: torch.Tensor,
        rows: range,
        prox: Proximal | None,
    ) -> Scored:
        """Forward and backward of the loss *sum* of the micro-batch ``rows`` of the batch (the
        caller divides the summed gradients by the minibatch's normaliser); returns its detached
        per-token values. ``prox``: π_prox of the batch (None: π_prox is this pass's π_θ)."""
        samples, advantages = samples[rows.start : rows.stop], advantages[rows.start : rows.stop]
        lay = self._layout(samples)
        logp, entropy = score(self.model, lay, self.config.logit_chunk_tokens)
        logp_ref = None
        if self.reference is not None:
            with torch.no_grad():
                logp_ref, _ = score(self.reference, lay, self.config.logit_chunk_tokens)
        loss, scored = micro_batch_loss(
            logp,
            entropy,
            logp_ref,
            lay.behav,
            lay.mask,
            advantages,
            correction=self.correction,
            config=self.config,
            staleness=self.staleness,
            proximal=None if prox is None else prox.rows(rows, logp.shape[1]),
        )
        loss.backward()  # type: ignore[no-untyped-call]
        return scored

    def _optimizer_step(
        self,
        samples: Sequence[TrainSample],
        advantages: torch.Tensor,
        rows: range,
        prox: Proximal | None,
    ) -> tuple[list[Scored], float]:
        """One minibatch (``rows`` of the batch): accumulate its gradient micro-batch by
        micro-batch, divide it once by its normaliser, clip its norm and step the optimizer;
        return its micro-batches' values and the gradient norm before clipping."""
        st = self.staleness
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for micro in micro_batches(samples[rows.start : rows.stop], self.config.micro_batch_tokens):
            at = range(rows.start + micro.start, rows.start + micro.stop)
            parts.append(self._backward(samples, advantages, at, prox))
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
        return parts, float(grad_norm)

    def _update(
        self, samples: Sequence[TrainSample], minibatches: Sequence[range], advantages: torch.Tensor
    ) -> tuple[Scored, int, list[float]]:
        """The batch's optimizer steps, one per minibatch, against π_prox; return the batch's
        values, the number of micro-batches and each step's gradient norm before clipping."""
        split = len(micro_batches(samples, self.config.micro_batch_tokens)) > 1
        prox = None
        if len(minibatches) > 1 or (batch_level(self.correction) and split):
            prox = proximal(self.model, samples, self.correction, self.config, self.sampling)
        parts: list[Scored] = []
        norms = []
        for rows in minibatches:
            done, norm = self._optimizer_step(samples, advantages, rows, prox)
            parts += done
            norms.append(norm)
        return concat(parts), len(parts), norms

    def step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """``trainer.minibatches`` optimizer steps on ``samples`` (group-contiguous), then publish
        version + 1."""
        s, st = self.config, self.staleness
        rewards = torch.tensor([sample.reward for sample in samples], device=s.device)
        advantages = group_advantages(rewards, self.group_size, normalize_std=st.scales_rewards)
        check_routing(samples, s.router_replay)
        minibatches = split_groups(len(samples), self.group_size, s.minibatches)
        try:
            lags = lag_metrics(samples, minibatches, self.version)
        except LagError as exc:  # stamps of another trainer's clock: train, without lag metrics
            log.warning("trainer_lag_unknown", version=self.version, reason=str(exc))
            lags = {}
        whole, micro, norms = self._update(samples, minibatches, advantages)
        self.version += 1
        if self.checkpoint_path is not None:
            self.save_checkpoint()
        manifest = self.publish()
        metrics = step_metrics(
            whole, advantages, correction=self.correction, config=s, staleness=st
        )
        metrics.update(
            lags,
            grad_norm=sum(norms) / len(norms),
            grad_norm_max=max(norms),
            lr=s.lr_at(self.version - 1),
            reward_mean=float(rewards.mean()),
            version_bytes=float(manifest.bytes),
            micro_batches=float(micro),
            minibatches=float(len(minibatches)),
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
