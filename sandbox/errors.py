"""The sandbox package's error tree.

Only set-up problems raise: the sandbox cannot be built (missing or broken bubblewrap, cgroups
required but absent) or the caller asked for something invalid (a file path escaping the work
dir). Whatever the sandboxed code does — crash, loop, flood, exhaust memory — is reported on
`ExecResult`, never raised.
"""

from __future__ import annotations

from policies.wire.errors import SprawlError


class SandboxError(SprawlError):
    """Root of every error this package raises."""


class SandboxUnavailableError(SandboxError):
    """The configured backend cannot run here; the message names the config key to change."""


class SandboxRequestError(SandboxError, ValueError):
    """The caller's request is invalid (bad file path, too much input for the work dir)."""
