"""Errors of the environments package."""

from __future__ import annotations

from policies.wire.errors import SprawlError


class EnvError(SprawlError):
    """Root of the environments package's errors."""


class EnvironmentLoadError(EnvError):
    """The configured environment cannot be imported or configured; names the config key."""


class EnvDefinitionError(EnvError):
    """An Environment subclass is defined wrongly (e.g. a tool parameter without a type hint)."""


class TaskSourceError(EnvError):
    """The configured task source cannot be read or lacks required columns; names the key."""


class RewardError(EnvError):
    """A reward function raised; the message names the reward, the exception type and message."""
