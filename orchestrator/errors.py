"""The orchestrator's error tree: one root, one subclass per layer that can fail.

Errors that reach the user name what was wrong and, where one exists, the config key to change.
A failed episode is never an exception that escapes the run: it is recorded on the trajectory
(see :class:`orchestrator.types.ErrorRecord`).
"""

from __future__ import annotations

from policies.wire.errors import SprawlError

__all__ = ["SprawlError"]


class ConfigError(SprawlError):
    """The configuration (file or command line) is invalid; the message names the key."""


class FleetError(SprawlError):
    """A rollout engine could not be started or reached."""


class EndpointError(SprawlError):
    """One model call to one endpoint failed (transport, 5xx, malformed answer, timeout).

    Raised per call so that retry and failover can act on it.
    """

    def __init__(self, endpoint: str, message: str, *, retryable: bool = True) -> None:
        super().__init__(f"{endpoint}: {message}")
        self.endpoint = endpoint
        self.retryable = retryable


class VersionUnavailable(EndpointError):
    """The endpoint answered 409: no version inside the request's bounds is applied there."""

    def __init__(self, endpoint: str, message: str, applied_version: int | None) -> None:
        super().__init__(endpoint, message)
        self.applied_version = applied_version


class Overloaded(EndpointError):
    """The endpoint answered 429 or 503: back off and send the call elsewhere."""


class TrainerError(SprawlError):
    """The trainer failed to take a step or to publish a version."""


class FeedRefused(TrainerError):
    """The batch feed refuses a trainer's request; ``status`` is the HTTP status it answers
    (400 a bad request, 409 a batch that is not out for training or a version not yet published)
    and ``type`` the error type of the JSON body."""

    def __init__(self, status: int, type_: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.param = param


class TrajlogError(SprawlError):
    """A trajectory or event log is missing or corrupt (beyond a torn tail, which is skipped)."""


class RefillsExhausted(SprawlError):
    """Dynamic sampling dropped more groups while one batch formed than
    ``scheduler.dynamic_sampling.max_refills`` allows (the run stops, as verl's does)."""
