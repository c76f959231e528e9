"""Errors of the environments package."""

from __future__ import annotations


class EnvError(Exception):
    """Root of the environments package's errors."""


class EnvironmentLoadError(EnvError):
    """The configured environment cannot be imported or configured; names the config key."""
