"""The policies package's error tree: board (and patch codec), engine and trainer failures.

Every error names what was wrong (the version, the tensor, the field). The engine converts these
into JSON error bodies on the lane; the sidecar logs and counts version failures and keeps
serving the version it has.
"""

from __future__ import annotations

from policies.wire.errors import SprawlError


class PolicyError(SprawlError):
    """Root of the policies package's errors."""


class BoardError(PolicyError):
    """The board is missing, unreadable, or an operation would break its rules."""


class VersionCorrupt(BoardError):
    """A version's bytes do not match its manifest (torn, truncated or corrupted)."""


class BoardFormatError(BoardError):
    """A version was written in a manifest format this sprawl does not read (an older or a newer
    sprawl wrote it); the message says how to proceed."""


class PointerMalformed(BoardError):
    """A run's ``POINTER`` does not name a version (not JSON, or no integer version in range)."""


class EngineError(PolicyError):
    """The engine cannot serve a request."""


class BadRequest(EngineError):
    """A request is invalid; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ExportError(BoardError):
    """A version cannot be written in the requested format (e.g. GGUF for another architecture)."""


class ModelBuildError(PolicyError):
    """``init_model`` cannot build what was asked: the chat template is unreadable, cannot be
    rendered or closes no assistant turn with a control token, or the tool parser is unknown."""


class AdapterError(PolicyError):
    """A LoRA adapter does not fit the model: ``trainer.lora.target_modules`` names no layer of
    it, or a LoRA version's tensors are not an adapter of the engine's model."""


class CheckpointError(PolicyError):
    """A trainer checkpoint is unreadable or does not fit the trainer resuming from it."""


class PatchError(BoardError, ValueError):
    """A patch cannot be read or applied (raised by :mod:`policies.codec`)."""


class PatchCorrupt(PatchError):
    """The patch bytes are damaged or truncated (frame checksum or structure)."""


class PatchBaseMismatch(PatchError):
    """The patch was made against a different base version."""


class PatchBaseCorrupt(PatchBaseMismatch):
    """The base held differs from the patch's base in words the patch changes, though it was
    vouched for (its memory damaged since it was verified, or those tensors already patched):
    the patch is not to blame, the base must be reloaded."""


class PatchChecksumMismatch(PatchError):
    """A patched tensor does not match the target checksum the patch names."""


class FeedError(PolicyError):
    """The orchestrator's batch feed refused a request (the message names the URL and why)."""


class FeedUnavailable(FeedError):
    """The batch feed cannot be reached (not started yet, restarting, or gone): worth retrying."""


class ScoringError(PolicyError, ValueError):
    """The trainer cannot score what it was given: a sample's sampling segments are malformed, or
    the model's logits are not its output head applied to its last hidden state."""
