"""Isolated execution of model-written code and shell tools (see docs/sandbox.md).

Use `SandboxPool(SandboxConfig(...))`, then `await pool.run(argv, files=..., stdin=...)` or
`await pool.run_python(code)`; both return an `ExecResult`. Limits hit are data on the result;
only set-up problems raise (`SandboxError` and subclasses). Importing this package does not
import torch.
"""

from sandbox.errors import SandboxError, SandboxRequestError, SandboxUnavailableError
from sandbox.pool import SandboxPool, build_backend
from sandbox.types import ExecResult, KilledReason, Limits, Sandbox, SandboxConfig

__all__ = [
    "ExecResult",
    "KilledReason",
    "Limits",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxPool",
    "SandboxRequestError",
    "SandboxUnavailableError",
    "build_backend",
]
