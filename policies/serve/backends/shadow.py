"""The island's shadow of the served view: the one island-side path every backend shares.

Every backend (reference, vLLM, SGLang, llama.cpp) keeps a CPU copy of the version its engine
serves and advances it with patches only, while the engine keeps serving:
:meth:`Shadow.stage` brings the copy to a newer version with ``Board.advance`` (the board's plan:
the next patch, one squashed patch when far behind, an anchor only when too far; a version being
streamed from the one held, chunk by chunk as it lands), every patch verified; if a patch fails,
the copy is rebuilt from the nearest anchor, and if that fails too the version is refused and
the copy dropped (the next stage starts from an anchor). The engine then takes, locally, only
what changed: :meth:`Shadow.changed` names the tensors whose manifest checksum differs from the
live version's, and :meth:`Shadow.activated` records that the engine now serves the staged
version.

Quantized served views (``trainer.served_view`` = ``fp8_block`` …; the manifest's ``view``) are
staged only for the reference engine, which dequantizes them itself; every other engine kind
refuses them (:func:`check_view`) instead of serving something else.

Guarantees: the board is the only thing read over the link, and per version it reads the patch
(or the squashed patch), not the checkpoint, unless the plan needs an anchor;
:attr:`Staged.bytes_read` is what one stage read from the board (the sidecar exports it as
``sprawl_board_bytes_read_total`` and logs it). A failed stage never leaves a half-advanced copy
that claims a version. Not covered: two stages at once (the sidecar stages one version at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from policies.board import Board
from policies.board.store import redact
from policies.board.types import Manifest
from policies.codec.views import quantized_kind
from policies.errors import EngineError, PatchError, PolicyError, VersionCorrupt

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Staged:
    """A version the shadow holds and the engine does not serve yet."""

    version: int
    manifest: Manifest
    bytes_read: int
    """Bytes this stage read from the board (patches, or an anchor when the plan needed one)."""


def check_view(engine: str, manifest: Manifest) -> None:
    """Raise :class:`EngineError` if ``engine`` cannot serve ``manifest``'s view here: only the
    reference engine serves quantized views."""
    if engine != "reference" and quantized_kind(manifest.view) is not None:
        raise EngineError(
            f"version {manifest.version} is a {manifest.view} view (trainer.served_view); the "
            f"{engine} engine cannot serve quantized views here: publish a float view "
            '(trainer.served_view = "bfloat16") or serve the run with reference engines'
        )


class Shadow:
    """A CPU copy of the served view, advanced with verified patches (see the module docstring)."""

    def __init__(self, engine: str) -> None:
        """``engine``: the engine kind the copy feeds (``reference``, ``vllm``, …)."""
        self.engine = engine
        self.view: dict[str, torch.Tensor] | None = None
        self.version: int | None = None
        self.live: Manifest | None = None  # the manifest of the version the engine serves
        self.staged: Staged | None = None

    def stage(self, board: Board, version: int) -> Staged:
        """Advance the copy to ``version`` (blocking: run it in a worker thread)."""
        if self.engine != "reference" and self.version is None:
            check_view(self.engine, board.manifest(version))  # before fetching a whole anchor
        before = board.store.bytes_read
        view, have = self.view, self.version
        self.view, self.version, self.staged = None, None, None  # unusable until this succeeds
        if view is None:
            view, have = {}, None
        try:
            manifest = board.advance(view, have, version)
        except PolicyError as exc:
            if have is None:
                raise
            log.warning("patch_failed_reloading_anchor", version=version, error=redact(str(exc)))
            view = {}
            try:
                manifest = board.advance(view, None, version)
            except PolicyError as again:
                if isinstance(again, (VersionCorrupt, PatchError)):
                    raise
                raise exc from None  # no other route: the version stays refused
        if self.engine != "reference":  # a streamed version has no manifest before this
            check_view(self.engine, manifest)
        self.view, self.version = view, version
        self.staged = Staged(version, manifest, board.store.bytes_read - before)
        return self.staged

    def take(self, version: int) -> tuple[Staged, dict[str, torch.Tensor]]:
        """The staged version and the copy, to activate; raises if ``version`` is not staged."""
        staged, view = self.staged, self.view
        if staged is None or staged.version != version or view is None:
            raise EngineError(f"version {version} was not staged")
        return staged, view

    def live_view(self, board: Board) -> dict[str, torch.Tensor]:
        """The copy at the live version, rebuilt from the board (an anchor, then patches) if it
        holds another one or none (blocking: run it in a worker thread); a staged version is
        dropped."""
        live = self.live
        if live is None:
            raise EngineError("no version is live")
        if self.view is None or self.version != live.version or self.staged is not None:
            self.view, self.version, self.staged = None, None, None
            self.activated(self.stage(board, live.version))
        assert self.view is not None  # stage() set it
        return self.view

    def changed(self, staged: Staged) -> set[str] | None:
        """Tensors whose checksum differs from the live version's (None: nothing is live, all)."""
        live = self.live
        if live is None:
            return None
        return {
            name
            for name, entry in staged.manifest.tensors.items()
            if name not in live.tensors or live.tensors[name].checksum != entry.checksum
        }

    def activated(self, staged: Staged) -> None:
        """The engine now serves ``staged``."""
        self.live = staged.manifest
        self.staged = None
