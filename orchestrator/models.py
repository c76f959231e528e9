"""The model a run starts from: ``model.path``, built by sprawl when it is missing.

:func:`ensure_model` returns ``model.path`` when it holds a model; otherwise, with ``model.init``
set, it builds sprawl's own model of that size there (:func:`policies.model.build.init_model`),
warm-started by SFT when ``[model.warm_start]`` is set (:func:`orchestrator.warm_start.warm_model`:
built once in a temp directory and renamed into place, reused by later runs while its
``sft.json`` records the same recipe, refused when it records another). The warm start writes
calculator episodes, so it needs a calculator among the run's environments; its last phase
trains on that environment's operand range.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from orchestrator.config import Config, EnvironmentConfig
from orchestrator.errors import ConfigError

log = structlog.get_logger(__name__)

CALCULATOR = "environments.calculator:Calculator"


def calculator_max_operand(cfg: Config) -> int | None:
    """The run's calculator difficulty (its ``args.max_operand``); None when no environment of
    the run is the calculator."""
    from environments.calculator import CalculatorConfig

    envs: list[EnvironmentConfig] = [*cfg.environments] or [cfg.environment]
    for env in envs:
        if env.kind == "class" and env.cls == CALCULATOR:
            return CalculatorConfig(**env.args).max_operand
    return None


def ensure_model(cfg: Config) -> Path:
    """The model directory, built with sprawl's own generator when configured and missing."""
    path = cfg.model.path
    warm = cfg.model.warm_start
    if warm is None and (path / "config.json").exists():
        return path
    if cfg.model.init is None:
        raise ConfigError(
            f"model.path: {path} is not an HF model directory (and model.init "
            "is unset, so sprawl will not build one)"
        )
    if warm is None:
        from policies.model.build import init_model

        log.info("building_model", path=str(path), size=cfg.model.init)
        return init_model(path, cfg.model.init, seed=cfg.run.seed)
    max_operand = calculator_max_operand(cfg)
    if max_operand is None:
        raise ConfigError(
            f"model.warm_start: the SFT warm start writes {CALCULATOR} episodes, and no "
            "environment of this run is the calculator; remove [model.warm_start]"
        )
    from orchestrator.warm_start import sft_phases, warm_model

    phases = sft_phases(warm.steps, warm.focus_steps, max_operand)
    if not path.exists():
        log.info("building_model", path=str(path), size=cfg.model.init, warm_start=phases)
    size, seed = cfg.model.init, cfg.run.seed
    return warm_model(path, size=size, seed=seed, phases=phases, eval_episodes=warm.eval_episodes)
