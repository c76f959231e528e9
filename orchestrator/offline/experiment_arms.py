"""The arms and lags of ``orchestrate experiment lag``, and what one run yields.

An *arm* is a correction (:data:`ARMS`: its name, label and ``staleness.correction`` table); a
*lag* is a ``scheduler.max_lag`` budget. Every arm runs at every lag above 0; lag 0 is the
on-policy reference (:data:`REFERENCE`, no correction), run once per seed and shared by all arms.
:func:`plan` turns ``--arms`` and ``--lags`` into the runs of one seed; :func:`arm_config`
resolves one run to a config in which only the lag budget and the correction differ between runs
(``staleness.drop`` cleared, ``scheduler.max_concurrent_episodes`` raised to what the lag budget
can admit; the ``gspo`` arm also sets ``staleness.loss_agg = "seq_mean"``, the mean over
sequences GSPO is defined with, whatever the config says). :func:`lag_histogram` measures, from
a finished run's trajectory log, the lag of every model call of a trained episode, and
:func:`drift` how far apart μ and π_prox were.

The lag is a budget, not a fixed lag: admission lets rollout run up to ``max_lag`` trainer
versions ahead, and the measured histogram says how far it did. A version is one batch, so with
``trainer.minibatches = k`` a lag of L versions is ``L·k + j`` optimizer steps for a token
trained in minibatch ``j`` (the trainer's ``lag_steps/*``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.config import Config, load_config
from orchestrator.errors import ConfigError
from orchestrator.record.frames import iter_records


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    correction: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)
    """what else the arm's runs set, as dotted keys (GSPO's mean over sequences)"""


@dataclass(frozen=True)
class Run:
    """One run of a seed: ``arm`` at ``scheduler.max_lag = lag`` (the reference at lag 0)."""

    arm: Arm
    lag: int

    @property
    def name(self) -> str:
        return REFERENCE if self.lag == 0 else f"lag{self.lag}_{self.arm.name}"

    @property
    def label(self) -> str:
        return ON_POLICY.label if self.lag == 0 else f"max_lag {self.lag}, {self.arm.label}"


REFERENCE = "on_policy"
UNCORRECTED = ("uncorrected", "naive_ppo")
"""The arms without a correction: PPO-clip against π_prox (``none``, sprawl's default) and
against μ (``none`` with ``anchor="behaviour"``: AReaL's coupled loss, its "naive PPO")."""
ON_POLICY = Arm(REFERENCE, "on-policy (max_lag 0)", {"type": "none"})

ARMS = (
    Arm("uncorrected", "uncorrected", {"type": "none"}),
    Arm("naive_ppo", "naive PPO (clip to μ)", {"type": "none", "anchor": "behaviour"}),
    Arm("tis", "TIS (cap 2)", {"type": "tis", "cap": 2.0}),
    Arm("decoupled_ppo", "decoupled PPO (cap 2)", {"type": "decoupled_ppo", "cap": 2.0}),
    Arm("token_mask", "token mask (c 2)", {"type": "token_mask", "c": 2.0}),
    Arm("m2po", "M2PO (τ 0.04)", {"type": "m2po"}),
    Arm("cispo", "CISPO (ε 1, ε_high 4)", {"type": "cispo"}),
    Arm(
        "gspo",
        "GSPO (ε 3e-4, ε_high 4e-4)",
        {"type": "gspo"},
        {"staleness.loss_agg": "seq_mean"},  # one term per sequence, as the paper defines it
    ),
)
DEFAULT_ARMS = "uncorrected,tis,decoupled_ppo,token_mask"
DEFAULT_LAGS = "0,4"
FIXED = ("scheduler.max_lag", "staleness.correction", "staleness.drop")
"""Override keys the experiment sets per run (a ``--section.key`` under one is refused)."""


def pick_arms(names: str) -> tuple[Arm, ...]:
    """The arms ``--arms a,b,…`` names, in :data:`ARMS` order."""
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {a.name for a in ARMS}
    if unknown:
        known = ", ".join(a.name for a in ARMS)
        raise ConfigError(f"--arms: unknown arm {', '.join(sorted(unknown))} (known: {known})")
    if not wanted:
        raise ConfigError("--arms: name at least one arm")
    return tuple(a for a in ARMS if a.name in wanted)


def parse_lags(text: str) -> tuple[int, ...]:
    """``--lags 0,1,2,4,8`` as sorted distinct budgets, 0 (the reference) always included."""
    lags = {0}
    for part in (p.strip() for p in text.split(",")):
        if not part.isdigit() or len(part) > 3:
            raise ConfigError(f"--lags: {part!r} is not a lag (integers 0..999, comma-separated)")
        lags.add(int(part))
    return tuple(sorted(lags))


def plan(arms: tuple[Arm, ...], lags: tuple[int, ...]) -> list[Run]:
    """The runs of one seed: the reference once, then every arm at every lag above 0."""
    return [Run(ON_POLICY, 0)] + [Run(a, lag) for lag in lags if lag > 0 for a in arms]


def check_overrides(overrides: dict[str, Any] | None) -> None:
    """Refuse an override of what the experiment sets per run (:data:`FIXED`)."""
    for key in overrides or {}:
        for fixed in FIXED:
            if key == fixed or key.startswith(fixed + "."):
                raise ConfigError(
                    f"--{key}: the experiment sets {fixed} per run (choose them with --arms "
                    "and --lags)"
                )


@dataclass
class ArmResult:
    arm: str
    """the run's name: ``on_policy`` or ``lag<L>_<arm>``"""
    label: str
    rewards: list[float]
    seed: int = 0
    lag_histogram: dict[int, int] = field(default_factory=dict)
    dropped_groups: int = 0
    seconds: float = 0.0
    correction: str = REFERENCE
    """the arm (:data:`ARMS`), or ``on_policy`` for the reference"""
    lag: int = 0
    """the run's ``scheduler.max_lag``"""
    drift: dict[str, float] = field(default_factory=dict)
    """:data:`DRIFT` metrics, each the mean over the run's steps (:func:`drift`)"""
    final_rewards: list[float] = field(default_factory=list)
    """the rewards of fresh episodes of the run's last version (:mod:`orchestrator.run.score`);
    empty when it was not scored"""
    final_failed: int = 0
    """of those episodes, how many failed (each still scored)"""


def arm_config(
    config: Path | None,
    run: Run,
    *,
    out: Path,
    model_dir: Path,
    steps: int,
    seed: int,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """The resolved config of one run and seed: ``config`` < ``overrides`` < what the run fixes."""
    base = load_config(config, overrides)
    in_flight = (1 + run.lag) * base.scheduler.groups_per_batch * base.scheduler.group_size
    fixed: dict[str, Any] = {
        "run.root": str(out / "runs" / f"s{seed}"),
        "run.name": run.name,
        "run.seed": seed,
        "run.overwrite": True,
        "model.path": str(model_dir),
        "model.init": None,
        "model.warm_start": None,  # the experiment warm-starts its model itself
        "trainer.max_steps": steps,
        "scheduler.max_lag": run.lag,
        "scheduler.max_concurrent_episodes": max(base.scheduler.max_concurrent_episodes, in_flight),
        "staleness.correction": run.arm.correction,
        "staleness.drop": None,
        **run.arm.settings,
    }
    try:
        return load_config(config, {**(overrides or {}), **fixed})
    except ConfigError as exc:
        raise ConfigError(f"run {run.name} (seed {seed}): {exc}") from None


DRIFT = ("mismatch/kl_k3", "mismatch/logp_abs_mean")
"""How far the behaviour policy μ was from π_prox in a run, per sampled token: the k3 estimate of
KL(μ‖π_prox) and the mean |log π_prox − log μ| (the trainer's metrics; the same for every arm)."""


def drift(log_dir: Path) -> dict[str, float]:
    """Each :data:`DRIFT` metric of a finished run's trajectory log, averaged over its steps."""
    values: dict[str, list[float]] = {name: [] for name in DRIFT}
    for rec in iter_records(log_dir, "batches"):
        for name, found in values.items():
            value = rec.get("metrics", {}).get(name)
            if isinstance(value, int | float):
                found.append(float(value))
    return {name: sum(v) / len(v) for name, v in values.items() if v}


def lag_histogram(log_dir: Path) -> dict[int, int]:
    """Model calls of trained episodes by lag: consuming trainer version − version at call start."""
    consumed: dict[str, int] = {}
    for rec in iter_records(log_dir, "batches"):
        for gid in rec["groups"]:
            consumed[gid] = int(rec["trained_at_version"])
    hist: Counter[int] = Counter()
    for rec in iter_records(log_dir, "episodes"):
        episode = rec["episode"]
        version = consumed.get(episode["group_id"])
        if version is None:  # dropped, or never batched before the run ended
            continue
        for seg in episode["segments"]:
            hist[version - int(seg["policy_version"]["start"])] += 1
    return dict(sorted(hist.items()))
