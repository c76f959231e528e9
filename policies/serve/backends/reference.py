"""The reference backend: sprawl's own engine behind the sidecar, patched in place.

Staging advances the island's :class:`~policies.serve.backends.shadow.Shadow` (a CPU copy of the
served view) with verified patches while the engine serves; activation copies into the live
tensors only the tensors whose manifest checksum differs from the live version's.
"""

from __future__ import annotations

import anyio

from policies.board import Board
from policies.serve.backends.shadow import Shadow
from policies.serve.decode import Generation, QuiesceMode
from policies.serve.engine import Engine
from policies.wire.lane import GenerateRequest


class ReferenceBackend:
    """The reference engine, patched in place from the shadow."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = engine.name
        self.max_context = engine.max_context
        self.shadow = Shadow()

    async def stage(self, board: Board, version: int) -> None:
        await anyio.to_thread.run_sync(self.shadow.stage, board, version)

    async def activate(self, version: int, mode: QuiesceMode) -> float:
        staged, view = self.shadow.take(version)
        changed = self.shadow.changed(staged)
        done = await anyio.to_thread.run_sync(
            lambda: self.engine.activate(view, version=version, mode=mode, only=changed)
        )
        self.shadow.activated(staged)
        return done.held_s

    async def generate(self, req: GenerateRequest) -> Generation:
        return await self.engine.agenerate(req)

    async def recover(self) -> None:
        """The engine lives in this process: it cannot restart on other weights."""

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.engine.close)
