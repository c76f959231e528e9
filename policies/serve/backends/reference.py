"""The reference backend: sprawl's own engine behind the sidecar, patched in place."""

from __future__ import annotations

import anyio
import structlog
import torch

from policies.board import Board
from policies.board.store import redact
from policies.board.types import Manifest
from policies.errors import EngineError, PatchError, PolicyError, VersionCorrupt
from policies.serve.decode import Generation, QuiesceMode
from policies.serve.engine import Engine
from policies.wire.lane import GenerateRequest

log = structlog.get_logger(__name__)


class ReferenceBackend:
    """The reference engine, patched in place.

    It keeps a *shadow* of the served view on the CPU. Staging brings the shadow to the new
    version with ``Board.advance`` (the board's patch plan: one squashed patch when far behind,
    every patch verified) while the engine serves; if a patch fails, the shadow is rebuilt from
    the nearest anchor, and if that fails too the version is refused and the shadow dropped.
    Activation copies into the live tensors only the tensors whose manifest checksum differs
    from the live version's.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = engine.name
        self.max_context = engine.max_context
        self._shadow: dict[str, torch.Tensor] | None = None
        self._shadow_version: int | None = None
        self._live: Manifest | None = None
        self._staged: tuple[int, Manifest] | None = None

    async def stage(self, board: Board, version: int) -> None:
        def advance() -> Manifest:
            shadow, have = self._shadow, self._shadow_version
            self._shadow, self._shadow_version = None, None  # unusable until this succeeds
            if shadow is None:
                shadow, have = {}, None
            try:
                manifest = board.advance(shadow, have, version)
            except PolicyError as exc:
                if have is None:
                    raise
                log.warning(
                    "patch_failed_reloading_anchor", version=version, error=redact(str(exc))
                )
                shadow = {}
                try:
                    manifest = board.advance(shadow, None, version)
                except PolicyError as again:
                    if isinstance(again, (VersionCorrupt, PatchError)):
                        raise
                    raise exc from None  # no other route: the version stays refused

            self._shadow, self._shadow_version = shadow, version
            return manifest

        manifest = await anyio.to_thread.run_sync(advance)
        self._staged = (version, manifest)

    async def activate(self, version: int, mode: QuiesceMode) -> float:
        staged, self._staged = self._staged, None
        shadow = self._shadow
        if staged is None or staged[0] != version or shadow is None:
            raise EngineError(f"version {version} was not staged")
        target, live = staged[1], self._live
        changed = None
        if live is not None:
            changed = {
                name
                for name, entry in target.tensors.items()
                if name not in live.tensors or live.tensors[name].checksum != entry.checksum
            }
        done = await anyio.to_thread.run_sync(
            lambda: self.engine.activate(shadow, version=version, mode=mode, only=changed)
        )
        self._live = target
        return done.held_s

    async def generate(self, req: GenerateRequest) -> Generation:
        return await self.engine.agenerate(req)

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.engine.close)
