"""Staleness configuration: which lag correction a trainer applies, and which episodes it drops.

One pydantic tree, loaded from the ``[staleness]`` table of a run config (or per environment)::

    [staleness]
    drop = { statistic = "max", max_lag = 4 }
    loss_agg = "token_mean"        # or "seq_mean", "dr_grpo" (then dr_grpo_tokens = N)
    normalizer = "kept"            # or "original"
    overlong = "none"              # or "mask", "soft_penalty" (then overlong_buffer = N)

    [staleness.correction]
    type = "tis"
    cap = 2.0
    level = "token"                # or "sequence"

Guarantees:

- Bad values fail when the config is loaded, and the pydantic error names the offending key
  (``cap``, ``c``, ``max_lag``, an unknown ``type``, a misspelt field: every model is
  ``extra="forbid"``).
- Importing this module does not import torch (the orchestrator's config tree imports it, and the
  orchestrator holds no weights). The math that reads these models lives in
  :mod:`staleness.corrections` and :mod:`staleness.lag`.

The formulas behind each correction are documented on the functions that implement them
(:mod:`staleness.corrections`) and in ``docs/staleness.md``. Notation: ``π_prox`` is the trainer's
policy before this update (log probs recomputed by the trainer), ``μ`` the behaviour policy the
engine sampled from (the engine's log probs), and ``ρ_t = π_prox(a_t) / μ(a_t)`` the per-token
behaviour ratio.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "CISPO",
    "GSPO",
    "M2PO",
    "Correction",
    "DecoupledPPO",
    "DropRule",
    "LagStatistic",
    "LengthBiasConfig",
    "LossAgg",
    "MaskedIS",
    "NoCorrection",
    "Normalizer",
    "Overlong",
    "StalenessConfig",
    "TokenMask",
    "TruncatedIS",
]

LagStatistic = Literal["max", "mean", "token_weighted"]
"""How an episode's per-segment lags are reduced to one number (see :mod:`staleness.lag`)."""

LossAgg = Literal["token_mean", "seq_mean", "dr_grpo"]
"""How per-token loss terms are reduced to one scalar (see :func:`staleness.loss.aggregate`)."""

Overlong = Literal["none", "mask", "soft_penalty"]
"""What happens to an episode cut by a length limit, or close to one (DAPO; ``overlong``)."""

Normalizer = Literal["kept", "original"]
"""What ``token_mean`` / ``seq_mean`` divide by when a correction masks tokens: the tokens it
kept, or the tokens it was given (see :func:`staleness.loss.aggregate`)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class DropRule(_Model):
    """Drop an episode whose lag statistic exceeds ``max_lag`` (keep iff statistic ≤ max_lag)."""

    statistic: LagStatistic = "max"
    """Which lag to compare: ``max`` (oldest model call), ``mean`` (mean over model calls) or
    ``token_weighted`` (mean over sampled tokens)."""

    max_lag: int = Field(ge=0)
    """Largest lag, in trainer versions, an episode may have and still be trained on."""


class NoCorrection(_Model):
    """Train on lagged tokens as if they were on-policy: every weight is 1, no token is masked.
    ``anchor="behaviour"`` centres PPO-clip on μ instead of π_prox: ``π_θ/μ`` is clipped, as
    AReaL's coupled loss (the "naive PPO" of Fu et al. 2025; docs/staleness.md)."""

    type: Literal["none"] = "none"
    """Selects this policy."""

    anchor: Literal["proximal", "behaviour"] = "proximal"
    """PPO-clip's ratio denominator: π_prox (``proximal``) or μ (``behaviour``)."""


class TruncatedIS(_Model):
    """Truncated importance sampling: ``w_t = min(ρ_t, cap)`` per token, or one weight per
    sequence ``w_b = min(Π_t ρ_bt, cap)`` with ``level="sequence"``; no token is masked.

    Source: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training" (TIS); the sequence level is verl's ``rollout_is_level="sequence"`` with
    ``rollout_is_mode="truncate"`` and TRL's ``vllm_importance_sampling_mode="sequence_truncate"``
    (both take the product of the token ratios).
    """

    type: Literal["tis"] = "tis"
    """Selects this policy."""

    cap: float = Field(default=2.0, gt=0)
    """Truncation level C of the behaviour ratio π_prox/μ (per token, or per sequence)."""

    level: Literal["token", "sequence"] = "token"
    """``token``: one weight per token; ``sequence``: one weight per sequence, the product of its
    valid tokens' ratios truncated at ``cap``, shared by all its tokens."""


class MaskedIS(_Model):
    """Sequence-level masked importance sampling.

    The sequence ratio is ``ρ_seq = Π_t ρ_t`` (``aggregate="product"``) or its geometric mean
    ``exp(mean_t log ρ_t)`` (``aggregate="geometric"``) over the sequence's valid tokens. A
    sequence is kept iff ``lower ≤ ρ_seq ≤ upper``; every token of a rejected sequence is masked.
    With ``reweight`` the kept tokens are weighted by ``ρ_seq`` (so weights lie in
    ``[lower, upper]``), otherwise by 1 (pure rejection).

    Source: Liu, Li et al. 2025, "When speed kills stability: demystifying RL collapse from the
    training-inference mismatch" (sequence-level MIS / rejection sampling).
    """

    type: Literal["mis"] = "mis"
    """Selects this policy."""

    upper: float = Field(default=2.0, gt=1)
    """Largest sequence ratio that is kept."""

    lower: float | None = Field(default=None, gt=0, lt=1)
    """Smallest sequence ratio that is kept; ``None`` means ``1 / upper``."""

    aggregate: Literal["product", "geometric"] = "product"
    """``product``: the true sequence likelihood ratio; ``geometric``: its per-token geometric mean,
    which does not grow with length (use for long agentic episodes)."""

    reweight: bool = True
    """Weight kept sequences by ``ρ_seq`` (only meaningful for ``aggregate="product"``; the
    geometric mean is not an importance weight)."""

    @model_validator(mode="after")
    def _geometric_is_rejection_only(self) -> MaskedIS:
        if self.aggregate == "geometric" and self.reweight:
            msg = (
                "reweight: must be false when aggregate='geometric' "
                "(the geometric mean ratio is a rejection statistic, not an importance weight)"
            )
            raise ValueError(msg)
        return self

    @property
    def lower_bound(self) -> float:
        """The effective lower bound: ``lower`` or ``1 / upper``."""
        return self.lower if self.lower is not None else 1.0 / self.upper


class DecoupledPPO(_Model):
    """Decoupled PPO: clip against the proximal policy π_prox instead of the behaviour policy μ.

    With ``cap`` set, each token is weighted by ``ρ_t = π_prox/μ`` and tokens whose ``ρ_t > cap``
    are masked (not truncated); without it no behaviour weight is applied (``w_t = 1``). Both as
    AReaL 1.0.4 computes its decoupled loss (``rejection_sampling`` with ``action="mask"``,
    ``metric="ratio"``, ``upper=cap``; and ``rejection_sampling=None``).

    Source: Fu et al. 2025, "AReaL: a large-scale asynchronous reinforcement learning system for
    language reasoning" (decoupled PPO objective; Hilton et al. 2021 "Batch size-invariance for
    policy optimization" introduced the proximal policy).
    """

    type: Literal["decoupled_ppo"] = "decoupled_ppo"
    """Selects this policy."""

    cap: float | None = Field(default=None, gt=1)
    """Weight tokens by π_prox/μ and mask those whose ratio exceeds this; ``None``: no behaviour
    weight and no masking (only the trust region moves to π_prox). Must exceed 1: a cap at or
    below 1 would mask every token the trainer now prefers."""


class TokenMask(_Model):
    """Two-sided token masking: mask tokens whose ``ρ_t`` leaves ``[1/c, c]``.

    Kept tokens get weight 1, or ``ρ_t`` with ``reweight`` (IcePop-style, Ling team 2025 "Every
    step evolves: scaling RL for trillion-scale thinking model").
    """

    type: Literal["token_mask"] = "token_mask"
    """Selects this policy."""

    c: float = Field(default=2.0, gt=1)
    """Band half-width in ratio space: a token is kept iff ``1/c ≤ ρ_t ≤ c``."""

    reweight: bool = False
    """Weight kept tokens by ``ρ_t`` instead of 1."""


class M2PO(_Model):
    """Second-moment trust policy optimization: mask the tokens whose squared behaviour log ratio
    ``(log ρ_t)²`` is largest, fewest first, until the mean of the rest is below ``threshold``.

    Over the batch the trainer corrects (every token of it, all minibatches): sorted by ``(log
    ρ_t)²`` descending, the smallest ``j`` whose remaining tokens' mean is ``< threshold`` masks
    the first ``j``; if no ``j`` does, all but the last (smallest) token are masked. Kept tokens
    get weight 1. As AReaL 1.0.4's ``m2_threshold`` (``_apply_m2po_masking``). Source: Zheng et
    al. 2025, "Prosperity before collapse: how far can off-policy RL reach with stale data on
    LLMs?" (M2PO).
    """

    type: Literal["m2po"] = "m2po"
    """Selects this policy."""

    threshold: float = Field(default=0.04, gt=0)
    """τ_M2: the largest mean squared log ratio the kept tokens may have (the paper's and AReaL's
    example value: 0.04)."""


class CISPO(_Model):
    """Clipped IS-weight policy optimization: every token's term is ``−sg(clip(π_θ/anchor,
    1 − clip_eps, 1 + clip_eps_high)) · A · log π_θ`` in place of PPO-clip, so a token whose
    ratio leaves the band keeps a (bounded) gradient.

    ``anchor="behaviour"`` takes the ratio against μ, the policy that sampled the token (the IS
    weight is the staleness correction; SkyRL's ``cispo_anchor="rollout"``); ``"proximal"``
    against π_prox, the trainer's weights before the batch (MiniMax-M1's π_old as verl, TRL and
    SkyRL's default recompute it; the ratio is then 1 until a batch's second minibatch). No
    behaviour weight is applied besides. Source: MiniMax 2025, "MiniMax-M1: scaling test-time
    compute efficiently with lightning attention" (CISPO); bounds as SkyRL's and ScaleRL's
    defaults (ratio clipped to [0, 5]).
    """

    type: Literal["cispo"] = "cispo"
    """Selects this policy."""

    clip_eps: float = Field(default=1.0, gt=0, le=1)
    """Lower clip of the IS ratio at ``1 − clip_eps`` (1: no lower bound, as MiniMax-M1)."""

    clip_eps_high: float = Field(default=4.0, gt=0)
    """Upper clip of the IS ratio at ``1 + clip_eps_high`` (4: the ratio is capped at 5, TRL's
    and ScaleRL's recommendation)."""

    anchor: Literal["behaviour", "proximal"] = "behaviour"
    """The IS ratio's denominator: μ (``behaviour``) or π_prox (``proximal``)."""


class GSPO(_Model):
    """Group sequence policy optimization: PPO-clip on the sequence's length-normalised ratio
    ``s_b = exp(mean_t log(π_θ/π_prox))``, clipped to ``[1 − clip_eps, 1 + clip_eps_high]``, one
    term per sequence; no behaviour weight. Needs ``loss_agg = "seq_mean"`` (the paper's mean
    over sequences; verl forces it, TRL warns on the others).

    As TRL's ``importance_sampling_level="sequence"`` and verl's ``policy_loss.loss_mode="gspo"``
    (written in the GSPO-token form, equal in value and gradient when the advantage is one per
    sequence, as GRPO's is). Source: Zheng et al. 2025, "Group sequence policy optimization".
    """

    type: Literal["gspo"] = "gspo"
    """Selects this policy."""

    clip_eps: float = Field(default=3e-4, gt=0, lt=1)
    """Lower clip of the sequence ratio at ``1 − clip_eps`` (the paper's 3e-4)."""

    clip_eps_high: float = Field(default=4e-4, gt=0)
    """Upper clip of the sequence ratio at ``1 + clip_eps_high`` (the paper's 4e-4)."""


Correction = Annotated[
    NoCorrection | TruncatedIS | MaskedIS | DecoupledPPO | TokenMask | M2PO | CISPO | GSPO,
    Field(discriminator="type"),
]
"""One lag correction, chosen by its ``type`` key."""


class LengthBiasConfig(_Model):
    """The length-bias guard (:mod:`staleness.length_bias`): when it warns, and what it does about
    it."""

    z_threshold: float = Field(default=3.0, gt=0)
    """One-sided z of "long groups are dropped more than short ones" at which the guard warns
    (3 ≈ 0.13 % false alarms per look; the live guard looks after every decision)."""

    min_groups: int = Field(default=20, ge=1)
    """Decisions each half (short, long) must hold before the test can fire."""

    requeue: bool = False
    """Re-run the task of a group the staleness policy dropped (not one the run's stop dropped):
    a new group of the same task is admitted at the current trainer version, recorded with
    ``requeued_from``. Costs rollout time; keeps long tasks in the training data."""

    max_requeues: int = Field(default=1, ge=1, le=16)
    """How many times one task may be re-run after staleness drops, along one requeue chain."""


class StalenessConfig(_Model):
    """How a trainer learns from lagged tokens: a drop rule, a correction, and how the loss is
    reduced over the tokens the correction keeps."""

    correction: Correction = NoCorrection()
    """The per-token correction applied to the episodes that survive ``drop``."""

    drop: DropRule | None = None
    """Which groups are trained on: keep iff the group's lag statistic ≤ ``max_lag``. ``None``:
    the run's lag budget is the rule (``statistic="max"``, ``max_lag=scheduler.max_lag``); a rule
    set here replaces it, looser or stricter (``scheduler.max_lag`` then only bounds admission)."""

    loss_agg: LossAgg = "token_mean"
    """``token_mean``: Σ ℓ over the batch's tokens / their count (DAPO); ``seq_mean``: mean over
    sequences of each sequence's token mean (GRPO); ``dr_grpo``: Σ ℓ / (sequences ×
    ``dr_grpo_tokens``), a constant (Dr. GRPO)."""

    normalizer: Normalizer = "kept"
    """What ``token_mean`` / ``seq_mean`` divide by: ``kept``: the tokens the correction kept (a
    masked token does not dilute the others); ``original``: the valid tokens before the
    correction masked any (AReaL), so masking only removes gradient. ``dr_grpo`` ignores it."""

    dr_grpo_tokens: int | None = Field(default=None, ge=1)
    """The constant of ``loss_agg="dr_grpo"``: tokens per sequence it divides by (TRL's
    ``max_completion_length``), e.g. the most tokens an episode can sample. Required with
    ``dr_grpo``, refused otherwise."""

    length_bias: LengthBiasConfig = LengthBiasConfig()
    """The length-bias guard: thresholds of its warning and the optional ``requeue``."""

    scale_rewards: bool | None = None
    """Divide each group's centred rewards by the group's std (GRPO). ``None``: true, except with
    ``loss_agg="dr_grpo"``, whose paper drops the std (TRL keeps ``scale_rewards`` separate and on
    by default)."""

    # -- overlong handling (DAPO): applied by the orchestrator before the batch is formed --------
    overlong: Overlong = "none"
    """``none``: a truncated episode is trained like any other; ``mask`` (DAPO's overlong
    filtering): a truncated episode (its last model call stopped at ``max_tokens``, or it reached
    the context limit) carries no loss, while its reward still counts in its group's advantages;
    ``soft_penalty`` (DAPO's soft overlong punishment): a model call whose response comes within
    ``overlong_buffer`` tokens of its ``max_tokens`` adds a penalty growing linearly to
    ``−overlong_penalty_factor`` at ``max_tokens`` to the episode's reward before advantages are
    computed (the episode's worst call counts; the log keeps the environment's reward)."""

    overlong_buffer: int | None = Field(default=None, ge=1)
    """``soft_penalty``: the buffer, in tokens before a call's ``max_tokens``, over which the
    penalty grows (verl's ``overlong_buffer.len``); at most ``sampling.max_tokens``. Required with
    ``soft_penalty``, unused otherwise."""

    overlong_penalty_factor: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    """``soft_penalty``: the penalty at ``max_tokens`` (verl's ``overlong_buffer.penalty_factor``);
    unused otherwise."""

    @model_validator(mode="after")
    def _soft_penalty_needs_its_buffer(self) -> StalenessConfig:
        if self.overlong == "soft_penalty" and self.overlong_buffer is None:
            msg = (
                "overlong_buffer: required when overlong='soft_penalty' (the tokens before a "
                "call's max_tokens over which the penalty grows, e.g. a fifth of max_tokens)"
            )
            raise ValueError(msg)
        return self

    @model_validator(mode="after")
    def _dr_grpo_needs_its_constant(self) -> StalenessConfig:
        if self.loss_agg == "dr_grpo" and self.dr_grpo_tokens is None:
            msg = (
                "dr_grpo_tokens: required when loss_agg='dr_grpo' (the constant the summed token "
                "losses are divided by, per sequence: e.g. the most tokens an episode samples)"
            )
            raise ValueError(msg)
        if self.loss_agg != "dr_grpo" and self.dr_grpo_tokens is not None:
            msg = (
                f"dr_grpo_tokens: only used with loss_agg='dr_grpo', got loss_agg={self.loss_agg!r}"
            )
            raise ValueError(msg)
        return self

    @model_validator(mode="after")
    def _gspo_is_per_sequence(self) -> StalenessConfig:
        if isinstance(self.correction, GSPO) and self.loss_agg != "seq_mean":
            msg = (
                f"loss_agg: correction.type = 'gspo' is one term per sequence and needs "
                f"loss_agg = 'seq_mean' (the paper's mean over sequences), got {self.loss_agg!r}"
            )
            raise ValueError(msg)
        return self

    @property
    def scales_rewards(self) -> bool:
        """Whether advantages are divided by the group std (``scale_rewards`` resolved)."""
        if self.scale_rewards is not None:
            return self.scale_rewards
        return self.loss_agg != "dr_grpo"

    def effective_drop(self, scheduler_max_lag: int) -> DropRule:
        """The drop rule the batcher applies: ``drop``, or the run's lag budget without one."""
        return self.drop if self.drop is not None else DropRule(max_lag=scheduler_max_lag)
