"""The reference backend: sprawl's own engine behind the sidecar, patched in place.

Staging advances the island's :class:`~policies.serve.backends.shadow.Shadow` (a CPU copy of the
served view) with verified patches while the engine serves; activation copies into the live
tensors only the tensors whose manifest checksum differs from the live version's.

Quantized views (``fp8_block``, ``int4_group``, ``nvfp4``: the manifest's ``view``) stay quantized
in the shadow — patches are applied to their codes and scales, bit for bit, never to weights —
and each activation recomputes, with :func:`policies.codec.views.dequantize` and before the
engine pauses, only the weights whose codes or scales changed (all of them on the first), so
the live weights are always ``dequantize(view)`` of the staged version, cast to the engine's
dtype (exactly that in fp32, which ``orchestrate serve --board`` picks for quantized views).

A LoRA version (its view is an adapter: :mod:`policies.serve.adapters`) is loaded beside the base
weights as one more resident adapter (:meth:`Engine.load_adapter`), never copied into them.
"""

from __future__ import annotations

import anyio
import torch

from policies.board import Board
from policies.codec.views import ViewKind, ViewSpec, dequantize, quantized_kind, weight_sources
from policies.serve.adapters import is_adapter_view
from policies.serve.backends.shadow import Shadow
from policies.serve.engine import Engine
from policies.serve.types import Generation, QuiesceMode
from policies.wire.lane import GenerateRequest


class ReferenceBackend:
    """The reference engine, patched in place from the shadow."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = engine.name
        self.max_context = engine.max_context
        self.shadow = Shadow("reference")

    async def stage(self, board: Board, version: int) -> None:
        await anyio.to_thread.run_sync(self.shadow.stage, board, version)

    async def activate(self, version: int, mode: QuiesceMode) -> float:
        staged, view = self.shadow.take(version)
        if is_adapter_view(staged.manifest.tensors):
            loaded = await anyio.to_thread.run_sync(
                lambda: self.engine.load_adapter(view, version=version, mode=mode)
            )
            self.shadow.activated(staged)
            return loaded.held_s
        changed = self.shadow.changed(staged)
        kind = quantized_kind(staged.manifest.view)
        if kind is not None:
            view, changed = await anyio.to_thread.run_sync(_weights, view, kind, changed)
        done = await anyio.to_thread.run_sync(
            lambda: self.engine.activate(view, version=version, mode=mode, only=changed)
        )
        self.shadow.activated(staged)
        return done.held_s

    async def generate(self, req: GenerateRequest) -> Generation:
        return await self.engine.agenerate(req)

    def resident_versions(self) -> list[int]:
        """The LoRA versions the engine holds (empty while it serves full versions)."""
        return self.engine.adapters.versions() if self.engine.batcher.adapters else []

    async def recover(self) -> None:
        """The engine lives in this process: it cannot restart on other weights."""

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.engine.close)


def _weights(
    view: dict[str, torch.Tensor], kind: ViewKind, changed: set[str] | None
) -> tuple[dict[str, torch.Tensor], set[str] | None]:
    """The dequantized weights a quantized ``view`` serves and the names to copy: every weight
    (``changed`` None), or those computed from a changed view tensor."""
    only = None
    if changed is not None:
        sources = weight_sources(view)
        only = {name for name, srcs in sources.items() if not changed.isdisjoint(srcs)}
    return dequantize(view, ViewSpec(kind=kind), only=only), only
