"""The reference trainer: GRPO with a PPO-clip loss, composed with a staleness correction.

One :meth:`Trainer.step` per batch:

1. recompute the current log probs of every sampled token with the trainer's weights, under the
   distribution the engine sampled it from: its segment's temperature, top-k and top-p
   (``TrainSample.sampling``; :mod:`policies.train.scoring`, a chunk of tokens at a time, so no
   fp32 [tokens, vocab] tensor exists beyond ``trainer.logit_chunk_tokens`` tokens);
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
   row (token or sequence level), so a micro-batch of whole rows computes them exactly;
5. one AdamW step (fp32 or bf16 master weights) after clipping the global gradient norm;
6. ``version += 1``; the checkpoint is written; the served view of the new version is published.

Version ``v`` is the number of optimizer steps taken.

With ``trainer.lora`` set the model carries a fresh peft LoRA adapter and only the adapter is
trained (the base weights stay frozen, bit for bit); each version's served view is the adapter,
published through the board like any view (:mod:`policies.train.lora`).

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
from policies.codec.views import ViewSpec, build_view, weight_sources
from policies.errors import CheckpointError, ScoringError
from policies.model.moe import replay_routing, routers
from policies.train.config import TrainerConfig
from policies.train.lora import adapter_view, with_lora
from policies.train.scoring import (
    Scored,
    TokenSampling,
    check_head,
    concat,
    output_head,
    score_chunked,
    token_sampling,
)
from policies.wire.batches import BatchSample, SegmentSampling
from policies.wire.routing import decode_routing
from staleness.config import StalenessConfig
from staleness.corrections import correct
from staleness.loss import aggregate, group_advantages, kl_penalty, normaliser, policy_loss
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
    sampling: Sequence[SegmentSampling] = ()
    """How each segment's tokens were sampled; tokens outside every segment are scored with the
    trainer's defaults (the run's ``[sampling]``)."""
    routed_experts: torch.Tensor | None = None
    """MoE: the experts positions ``0 .. R-1`` were routed to by the engine, ``[R, layers,
    top_k]`` int64 (``trainer.router_replay`` forces them); None: not reported."""

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
        state: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in self.model.state_dict().items():
            if t.data_ptr() in seen:  # tied weights are shipped once
                continue
            seen.add(t.data_ptr())
            state[name] = t.detach()
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

    def _check_routing(self, samples: Sequence[TrainSample]) -> None:
        """With ``trainer.router_replay`` on, refuse a batch of which no sample carries routing."""
        if self.config.router_replay and all(s.routed_experts is None for s in samples):
            msg = (
                "trainer.router_replay = true, but no sample of the batch carries "
                "routed_experts: the engines do not report MoE routing (the reference engine "
                "does; vLLM and SGLang need --enable-return-routed-experts)"
            )
            raise ScoringError(msg)

    def _routing(self, samples: Sequence[TrainSample], width: int) -> torch.Tensor | None:
        """The engine's routing [B, width, layers, top_k] to replay (-1 where a sample has none)
        when ``trainer.router_replay`` is on; None when it is off or no sample has any."""
        known = [s.routed_experts for s in samples if s.routed_experts is not None]
        if not self.config.router_replay or not known:
            return None
        layers, k = known[0].shape[1:]
        out = torch.full((len(samples), width, layers, k), -1, dtype=torch.long)
        for i, sample in enumerate(samples):
            if sample.routed_experts is not None:
                out[i, : sample.routed_experts.shape[0]] = sample.routed_experts
        return out.to(self.config.device)

    @torch.no_grad()
    def logprobs(self, samples: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log probs [B, T-1] of tokens 1..T under the current weights, and the mask.

        For inspection (no gradient); :meth:`step` scores with gradients itself."""
        self._check_routing(samples)
        ids, attn = self._batch(samples)
        width = ids.shape[1]
        how, routed = self._sampling(samples, width), self._routing(samples, width)
        logp, _ = self._score(self.model, ids, attn, how, routed)
        return logp, attn[:, 1:].bool()

    # -- the update ----------------------------------------------------------------------------
    def _micro_batches(self, samples: Sequence[TrainSample]) -> list[range]:
        """Consecutive rows whose padded size (rows × longest row) stays within
        ``trainer.micro_batch_tokens``; a row longer than that alone (all rows if unset)."""
        budget = self.config.micro_batch_tokens
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

    def _backward(self, samples: Sequence[TrainSample], advantages: torch.Tensor) -> Scored:
        """Forward and backward of one micro-batch's loss *sum* (the caller divides the summed
        gradients by the whole batch's normaliser); returns its detached per-token values."""
        s, st = self.config, self.staleness
        ids, attn = self._batch(samples)
        how = self._sampling(samples, ids.shape[1])
        routed = self._routing(samples, ids.shape[1])
        width = ids.shape[1] - 1
        mask = torch.zeros(len(samples), width, dtype=torch.bool, device=s.device)
        behav = torch.zeros(len(samples), width, device=s.device)
        for i, sample in enumerate(samples):
            n = max(len(sample.token_ids) - 1, 0)
            mask[i, :n] = torch.tensor(sample.mask[1:], dtype=torch.bool)
            behav[i, :n] = torch.tensor(sample.behaviour_logprobs[1:])

        logp, entropy = self._score(self.model, ids, attn, how, routed)
        logp_prox = logp.detach()
        corrected = correct(self.correction, logp_prox=logp_prox, logp_behav=behav, mask=mask)
        kept = corrected.mask

        def summed(values: torch.Tensor) -> torch.Tensor:
            return aggregate(
                values,
                kept,
                st.loss_agg,
                normalizer=st.normalizer,
                valid=mask,
                dr_grpo_tokens=st.dr_grpo_tokens,
                denominator=1.0,
            )

        loss, _ = policy_loss(
            logp,
            logp_prox,
            advantages,
            corrected,
            clip_eps=s.clip_eps,
            loss_agg=st.loss_agg,
            normalizer=st.normalizer,
            dr_grpo_tokens=st.dr_grpo_tokens,
            denominator=1.0,
        )
        if s.entropy_coef > 0:
            loss = loss - s.entropy_coef * summed(entropy)
        kl = torch.zeros_like(logp_prox)
        excluded = 0
        if self.reference is not None:
            with torch.no_grad():
                logp_ref, _ = self._score(self.reference, ids, attn, how, routed)
            outside = kept & ~torch.isfinite(logp_ref)  # π_ref's truncated set lacks the token
            excluded = int(outside.sum())
            kl = kl_penalty(logp, logp_ref, kept & ~outside, estimator=s.kl_estimator)
            loss = loss + s.kl_coef * summed(kl)
        loss.backward()  # type: ignore[no-untyped-call]
        return Scored(logp_prox, behav, mask, corrected, entropy.detach(), kl.detach(), excluded)

    def step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step on ``samples`` (group-contiguous), then publish version + 1."""
        s, st = self.config, self.staleness
        rewards = torch.tensor([sample.reward for sample in samples], device=s.device)
        advantages = group_advantages(rewards, self.group_size, normalize_std=st.scales_rewards)
        self._check_routing(samples)
        self.optimizer.zero_grad(set_to_none=True)
        parts = [
            self._backward([samples[i] for i in rows], advantages[rows.start : rows.stop])
            for rows in self._micro_batches(samples)
        ]
        whole = concat(parts)
        kept = whole.corrected.mask
        den = normaliser(
            kept,
            st.loss_agg,
            normalizer=st.normalizer,
            valid=whole.mask,
            dr_grpo_tokens=st.dr_grpo_tokens,
        )
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.div_(den)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip)
        self.optimizer.step()
        self.version += 1
        if self.checkpoint_path is not None:
            self.save_checkpoint()
        manifest = self.publish()

        # the step's values over the whole batch: π_θ equals π_prox in value before the update
        pg_loss, metrics = policy_loss(
            whole.logp,
            whole.logp,
            advantages,
            whole.corrected,
            clip_eps=s.clip_eps,
            loss_agg=st.loss_agg,
            normalizer=st.normalizer,
            dr_grpo_tokens=st.dr_grpo_tokens,
        )

        def agg(values: torch.Tensor) -> float:
            return float(
                aggregate(
                    values,
                    kept,
                    st.loss_agg,
                    normalizer=st.normalizer,
                    valid=whole.mask,
                    dr_grpo_tokens=st.dr_grpo_tokens,
                )
            )

        ent_term, kl_value = agg(whole.entropy), agg(whole.kl)
        loss = float(pg_loss) - s.entropy_coef * ent_term + s.kl_coef * kl_value
        metrics.update(
            correction_metrics(
                self.correction,
                whole.corrected,
                logp_prox=whole.logp,
                logp_behav=whole.behav,
                mask=whole.mask,
            )
        )
        outside = whole.mask & torch.isneginf(whole.logp)
        metrics.update(
            {
                "mismatch/outside_sampled_set": float(outside.sum()),
                "kl_ref_excluded_tokens": float(whole.kl_excluded),
            },
            loss=loss,
            loss_policy=float(pg_loss),
            entropy=ent_term,
            kl_ref=kl_value,
            grad_norm=float(grad_norm),
            reward_mean=float(rewards.mean()),
            version_bytes=float(manifest.bytes),
            micro_batches=float(len(parts)),
        )
        if s.router_replay:  # scored by the trainer's own routing: the engine reported none
            unrouted = sum(sample.routed_experts is None for sample in samples)
            metrics["router_replay/unrouted_samples"] = float(unrouted)
        log.info(
            "trainer_step",
            version=self.version,
            loss=round(loss, 5),
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
