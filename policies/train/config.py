"""The trainer's configuration: the ``[trainer]`` section of a run config, as the trainer takes it.

The orchestrator's config tree (:mod:`orchestrator.config`) holds this model as its ``trainer``
field, and :class:`~policies.train.trainer.Trainer` takes it as it is: one source of truth. No
torch here, so parsing a config stays cheap.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

FLOAT_VIEWS = ("bfloat16", "float16", "float32")
"""``served_view`` values that are a plain cast of the weights (no scales)."""


class FeedConfig(BaseModel):
    """The ``[trainer.feed]`` table: where the orchestrator serves the batch feed in ``feed`` mode
    (:mod:`orchestrator.loop.feed`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Address the batch feed binds (``0.0.0.0`` to reach it from another machine)."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the batch feed; 0 picks a free one (written to ``<run dir>/feed.json``)."""
    token: SecretStr | None = Field(default=None, min_length=1)
    """Bearer token the batch feed requires; unset: a random one per run. Either way it is written
    with the URL to ``<run dir>/feed.json`` (mode 0600), and only there (``**********`` in
    config.json and the trajectory log's run.json)."""
    max_batches: int = Field(default=1, ge=1, le=64)
    """The most batches the feed holds unacknowledged: the orchestrator forms and offers batches
    ``v + 1 … v + max_batches − 1`` while the trainer steps on ``v``, so the trainer finds its next
    batch ready. Each group is still decided against the version its batch is trained at, and
    admission (``scheduler.max_lag``) still caps every lag, so at most ``scheduler.max_lag + 1``
    batches can be ready at once (a larger value is refused). 1: the next batch is formed only
    after the trainer acknowledged the last."""


class LoraConfig(BaseModel):
    """The ``[trainer.lora]`` table: train a LoRA adapter (``peft``) on frozen base weights; each
    version is the adapter (docs/trainer.md#lora-versions)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rank: int = Field(default=8, ge=1, le=1024)
    """Rank ``r`` of every adapter matrix."""
    alpha: int = Field(default=16, ge=1)
    """LoRA scaling numerator: the adapter adds ``alpha / rank · B A`` (published with the
    scaling folded into ``lora_B``)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Names (last component) of the linear layers that get an adapter, e.g. ``q_proj``."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (engines serve without it)."""

    @field_validator("target_modules")
    @classmethod
    def _plain_names(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if not m or not m.replace("_", "").isalnum()]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a module name (letters, digits and _)")
        if len(set(v)) != len(v):
            raise ValueError(f"names a module twice: {v}")
        return v


MOVED_KEYS = {
    "served_dtype": "renamed to served_view (same values, plus the quantized views fp8_block, "
    "int4_group and nvfp4)",
    "loss_agg": "moved to the [staleness] table (staleness.loss_agg), next to the normalizer it "
    "works with",
}
"""``[trainer]`` keys of earlier sprawl, and where they went (refused, naming it)."""


class TrainerConfig(BaseModel):
    """The ``[trainer]`` section: how the reference trainer (or an external one) steps."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: Literal["in_process", "external", "feed"] = "in_process"
    """``in_process``: the reference trainer in this process. ``external``: any trainer in
    another process, through batch files and the board (``policies/wire/batches.py``).
    ``feed``: any trainer in another process or cluster, pulling batches over HTTP from the
    orchestrator's batch feed (``[trainer.feed]``, ``policies/wire/feed.py``) and publishing on
    the board."""
    batch_dir: Path | None = None
    """Where batch files go in ``external`` mode; default ``<run dir>/batches``."""
    feed: FeedConfig = FeedConfig()
    """The batch feed of ``feed`` mode."""
    max_steps: int = Field(default=4, ge=1)
    """Trainer steps: batches trained, each published as one version after version 0."""
    minibatches: int = Field(default=1, ge=1, le=1024)
    """Optimizer steps per batch (AReaL's ``ppo_n_minibatches``): the batch's groups are split
    into this many group-contiguous minibatches, each one AdamW step, against the proximal log
    probs of the weights before the first; one version is published per batch. At most
    ``scheduler.groups_per_batch``; when it does not divide the groups, the first minibatches
    take one group more (docs/trainer.md#minibatches)."""
    lr: float = Field(default=2e-4, gt=0, le=1)
    """AdamW learning rate (of the first step after any warm-up, with a decaying
    ``lr_schedule``)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """How the learning rate moves over ``max_steps``: ``constant`` keeps ``lr``; ``linear`` and
    ``cosine`` decay it from ``lr`` at the first step after the warm-up (``lr_warmup_steps``)
    towards ``lr_final``, reached by the step after the last (:meth:`lr_at`). The rate follows
    from the version alone, so a resumed trainer takes the same rates with no scheduler state."""
    lr_final: float = Field(default=0.0, ge=0)
    """Where a decaying ``lr_schedule`` ends; at most ``lr``."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up: the first this many steps take ``lr·(v+1)/lr_warmup_steps`` (version v),
    reaching ``lr`` at the last of them; a decaying ``lr_schedule`` then runs over the steps
    left (verl's ``lr_warmup_steps``, TRL's ``warmup_steps``). Below ``max_steps``; 0: off."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trainer's master weights."""
    served_view: Literal["bfloat16", "float16", "float32", "fp8_block", "int4_group", "nvfp4"] = (
        "bfloat16"
    )
    """The view engines serve (what the board publishes; its manifests' ``view``): the weights
    cast to a float dtype, or a quantized view (``policies.codec.views``; docs/codec.md). Only the
    reference engine serves quantized views."""
    scale_policy: Literal["pow2", "fixed_between_anchors", "fresh"] | None = None
    """Scales of a quantized ``served_view`` (None: ``pow2``; float views have none):
    ``pow2`` rounds each up to a power of two (it changes only when its amax crosses one),
    ``fixed_between_anchors`` recomputes them only at the versions the board must anchor,
    ``fresh`` at every version (docs/trainer.md)."""
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO clip range: the ratio π_θ/π_prox is clipped to ``[1 − clip_eps, 1 + clip_eps_high]``
    (the ``cispo`` and ``gspo`` corrections clip with their own bands)."""
    clip_eps_high: float | None = Field(default=None, gt=0, le=10)
    """Upper PPO clip range (DAPO's clip-higher, e.g. 0.28); unset: ``clip_eps``."""
    dual_clip_c: float | None = Field(default=None, gt=1, le=100)
    """Dual clip: a negative-advantage token's loss is at most ``−c·A`` (Ye et al. 2020; AReaL's
    ``c_clip``, verl's ``clip_ratio_c``, e.g. 3); unset: off."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clip."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device of the trainer."""
    kl_coef: float = Field(default=0.0, ge=0, le=10)
    """Weight of the KL(π_θ ‖ π_ref) penalty against the frozen version 0 (0: off, no reference
    model is loaded)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman 2020): ``k3`` is unbiased and non-negative."""
    entropy_coef: float = Field(default=0.0, ge=0, le=1)
    """Weight of the entropy bonus (subtracted from the loss; 0: off, entropy is still logged)."""
    checkpoint: bool = True
    """Checkpoint model + optimizer + RNG after every step into ``<run dir>/trainer/ckpt``."""
    micro_batch_tokens: int | None = Field(default=None, ge=2)
    """Gradient accumulation: each forward/backward takes consecutive samples whose padded size
    (samples × the longest one's tokens) stays within this (a longer sample goes alone); the loss
    is normalized over the whole batch, so the step equals one unsplit pass. Unset: one pass."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of every weight (``[trainer.lora]``); unset: full-parameter
    training. Needs a float ``served_view``."""
    router_replay: bool = False
    """MoE models: score every sampled token with the experts the engine routed it to (each
    sample's ``routed_experts``), not the trainer's own top-k; the router's probabilities of
    those experts stay the differentiable expert weights (docs/trainer.md#moe-router-replay).
    Needs an MoE model and engines that report routing."""
    logit_chunk_tokens: int = Field(default=1024, ge=1)
    """Tokens whose fp32 logits exist at once when scoring: the output head and log-softmax run
    this many tokens at a time, recomputed in the backward, so memory grows with this × vocab
    rather than with the batch's tokens × vocab."""

    def lr_at(self, version: int) -> float:
        """The learning rate of the step from ``version`` to ``version + 1``: during the warm-up
        its linear ramp to ``lr``; then ``lr`` at the first step after it, then the schedule's
        fraction of the way to ``lr_final`` (all of it from ``max_steps`` on)."""
        version = max(version, 0)
        warmup = self.lr_warmup_steps
        if version < warmup:
            return self.lr * (version + 1) / warmup
        if self.lr_schedule == "constant":
            return self.lr
        done = min((version - warmup) / (self.max_steps - warmup), 1.0)
        left = 1.0 - done if self.lr_schedule == "linear" else (1 + math.cos(math.pi * done)) / 2
        return self.lr_final + (self.lr - self.lr_final) * left

    @model_validator(mode="after")
    def _lr_final_needs_a_decay(self) -> TrainerConfig:
        if self.lr_final > self.lr:
            raise ValueError(f"lr_final {self.lr_final} is above lr {self.lr}: a schedule decays")
        if self.lr_final and self.lr_schedule == "constant":
            raise ValueError(
                "lr_final applies to a decaying lr_schedule (linear or cosine); lr_schedule is "
                "'constant'"
            )
        return self

    @model_validator(mode="after")
    def _warmup_ends_before_the_last_step(self) -> TrainerConfig:
        if self.lr_warmup_steps >= self.max_steps:
            raise ValueError(
                f"lr_warmup_steps {self.lr_warmup_steps} is not below max_steps "
                f"{self.max_steps}: the warm-up would take the whole run and leave no step "
                "at lr after it"
            )
        return self

    @model_validator(mode="after")
    def _scale_policy_needs_a_quantized_view(self) -> TrainerConfig:
        if self.scale_policy is not None and self.served_view in FLOAT_VIEWS:
            raise ValueError(
                f"scale_policy applies to quantized served views; served_view is "
                f"{self.served_view!r}, which has no scales"
            )
        return self

    @model_validator(mode="after")
    def _lora_needs_a_float_view(self) -> TrainerConfig:
        if self.lora is not None and self.served_view not in FLOAT_VIEWS:
            raise ValueError(
                f"lora: a LoRA version is its adapter, published as a float view; served_view "
                f"is {self.served_view!r} (use one of {', '.join(FLOAT_VIEWS)})"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, where in MOVED_KEYS.items():
                if key in data:
                    raise ValueError(f"{key}: {where}")
        return data
