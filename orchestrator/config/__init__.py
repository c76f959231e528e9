"""The configuration tree: one pydantic model, loaded from TOML with dotted command-line overrides.

This package is the config's one public home: import every name from :mod:`orchestrator.config`.
Its modules:

- :mod:`~orchestrator.config.sections` — :class:`Section`, the base of every section, and the
  run-wide sections (``[run]``, ``[model]``, ``[board]``, ``[sampling]``, ``[scheduler]``
  with ``[scheduler.dynamic_sampling]``, ``[timeouts]``, ``[admin]``, ``[log]``);
- :mod:`~orchestrator.config.fleet` — ``[fleet]``: endpoints, local engines, islands, Ray;
- :mod:`~orchestrator.config.environment` — ``[environment]`` and ``[[environments]]``;
- :mod:`~orchestrator.config.tree` — :class:`Config`, the root, and the checks across sections;
- :mod:`~orchestrator.config.load` — :func:`load_config` and :func:`parse_overrides`: defaults <
  TOML file < command line, every problem a :class:`~orchestrator.errors.ConfigError` naming the
  key and its source.

Importing this package must not import torch (the CLI parses configs before any heavy import).
"""

from orchestrator.config.environment import (
    EnvironmentConfig,
    EnvironmentStaleness,
    MixtureEnvironmentConfig,
)
from orchestrator.config.fleet import (
    AWS_ENV,
    EndpointConfig,
    FleetConfig,
    IslandConfig,
    LlamaCppIslandConfig,
    RayFleetConfig,
    RayResourcesConfig,
    VLLMIslandConfig,
)
from orchestrator.config.load import load_config, parse_overrides
from orchestrator.config.sections import (
    AdminConfig,
    BoardConfig,
    DynamicSamplingConfig,
    LogConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    SchedulerConfig,
    TimeoutsConfig,
    WarmStartConfig,
)
from orchestrator.config.tree import Config

__all__ = [
    "AWS_ENV",
    "AdminConfig",
    "BoardConfig",
    "Config",
    "DynamicSamplingConfig",
    "EndpointConfig",
    "EnvironmentConfig",
    "EnvironmentStaleness",
    "FleetConfig",
    "IslandConfig",
    "LlamaCppIslandConfig",
    "LogConfig",
    "MixtureEnvironmentConfig",
    "ModelConfig",
    "RayFleetConfig",
    "RayResourcesConfig",
    "RunConfig",
    "SamplingConfig",
    "SchedulerConfig",
    "TimeoutsConfig",
    "VLLMIslandConfig",
    "WarmStartConfig",
    "load_config",
    "parse_overrides",
]
