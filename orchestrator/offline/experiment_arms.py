"""The arms of ``orchestrate experiment lag``, and what one run of an arm yields.

:data:`ARMS` names each arm's lag budget and correction; :func:`arm_config` resolves one arm and
seed to a run config in which only those differ between arms (``staleness.drop`` cleared,
``scheduler.max_concurrent_episodes`` raised to what the lag budget can admit).
:func:`lag_histogram` measures, from a finished run's trajectory log, the lag of every model
call of a trained episode.
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
    max_lag: int
    correction: dict[str, Any]


REFERENCE = "on_policy"
UNCORRECTED = "lag4_none"

ARMS = (
    Arm(REFERENCE, "on-policy (max_lag 0)", 0, {"type": "none"}),
    Arm(UNCORRECTED, "max_lag 4, uncorrected", 4, {"type": "none"}),
    Arm("lag4_tis", "max_lag 4 + TIS (cap 2)", 4, {"type": "tis", "cap": 2.0}),
    Arm("lag4_dppo", "max_lag 4 + decoupled PPO (cap 2)", 4, {"type": "decoupled_ppo", "cap": 2.0}),
    Arm("lag4_mask", "max_lag 4 + token mask (c 2)", 4, {"type": "token_mask", "c": 2.0}),
)
CORRECTED = tuple(a.name for a in ARMS if a.correction["type"] != "none")


def pick_arms(names: str | None) -> tuple[Arm, ...]:
    """The arms ``--arms a,b,…`` names, in :data:`ARMS` order, ``on_policy`` always included."""
    if names is None:
        return ARMS
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {a.name for a in ARMS}
    if unknown:
        known = ", ".join(a.name for a in ARMS)
        raise ConfigError(f"--arms: unknown arm {', '.join(sorted(unknown))} (known: {known})")
    return tuple(a for a in ARMS if a.name in wanted | {REFERENCE})


@dataclass
class ArmResult:
    arm: str
    label: str
    rewards: list[float]
    seed: int = 0
    lag_histogram: dict[int, int] = field(default_factory=dict)
    dropped_groups: int = 0
    seconds: float = 0.0


def arm_config(
    config: Path | None,
    arm: Arm,
    *,
    out: Path,
    model_dir: Path,
    steps: int,
    seed: int,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """The resolved config of one arm and seed: ``config`` < ``overrides`` < what the arm fixes."""
    base = load_config(config, overrides)
    in_flight = (1 + arm.max_lag) * base.scheduler.groups_per_batch * base.scheduler.group_size
    fixed: dict[str, Any] = {
        "run.root": str(out / "runs" / f"s{seed}"),
        "run.name": arm.name,
        "run.seed": seed,
        "run.overwrite": True,
        "model.path": str(model_dir),
        "model.init": None,
        "model.warm_start": None,  # the experiment warm-starts its model itself
        "trainer.max_steps": steps,
        "scheduler.max_lag": arm.max_lag,
        "scheduler.max_concurrent_episodes": max(base.scheduler.max_concurrent_episodes, in_flight),
        "staleness.correction": arm.correction,
        "staleness.drop": None,
    }
    return load_config(config, {**(overrides or {}), **fixed})


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
