"""vLLM behind the sidecar, versions applied in place through vLLM's own weight-transfer API.

The default way a vLLM island takes versions (``orchestrate sidecar --engine-kind vllm
--vllm-update inplace``; the engine started with ``--weight-transfer-config '{"backend":
"sprawl"}'``, :mod:`policies.serve.backends.vllm_transfer`). Generation is
:class:`~policies.serve.backends.vllm.VLLMBackend`'s.

**stage** advances the island's shadow with the board's patches while the engine serves, recording
where they wrote (:func:`policies.codec.written.recording`: positions and old values, no pass over
the model), and writes the **engine patch** of everything written since the version the engine
serves (:mod:`policies.serve.backends.engine_patch`: flat positions and changes per tensor, about
the patch's size; a tensor an anchor replaced travels whole) as one island-local file under
``work_dir``, which every worker reads and plans on a thread of its own while the engine serves (an
update session with ``"prepare": true``). **apply** then drives vLLM's routes: ``/pause?mode=keep``
(mode ``"pause"``; mode ``"wait"`` drained first) → ``/start_weight_update`` → ``/update_weights``
→ ``/finish_weight_update`` with ``weight_version`` = the sprawl version → prefix cache reset →
``/resume``, and checks ``/weight_info`` says that version. No full-view file is written or read
per version.

The engine patch carries each tensor's changes against the values the engine serves (an Adam
step's ±1 unit in the last place: about as small as the board's patch) and the sum of those old
values, which each worker checks against its own weights before it writes anything
(:mod:`policies.serve.backends.engine_apply`).

All-or-nothing: a worker checks the file (digest, names, dtypes, positions, old values) before
writing and undoes its own writes if one fails midway; the sidecar then asks every worker to take
that update back (``{"undo": version}``: a worker that failed has nothing to take back) with the
old ``weight_version``, before generation resumes. If that fails too, the engine is marked
broken: every request is a 503 until it restarts. An engine that restarted (``/weight_info``
no longer names the live version) gets the live view back whole (a dense engine patch) before it
serves again (the shadow's copy rebuilt from the board first if it holds another version, a staged
one then staged again). ``island_bytes`` counts what each version wrote and the workers read on the
island (the engine patch, once written and once read per worker).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

from policies.board import Board
from policies.codec.written import TensorChanges, Written, recording
from policies.errors import EngineError
from policies.serve.backends.base import EngineUnavailable
from policies.serve.backends.engine_patch import (
    EngineTensor,
    delta,
    encode,
    file_digest,
    unit_sum,
    write,
)
from policies.serve.backends.shadow import Staged
from policies.serve.backends.vllm import STATUS_EVERY_S, VLLMBackend
from policies.serve.decode import QuiesceMode

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _Prepared:
    """A staged version's engine patch, on the island."""

    version: int
    path: Path
    digest: str
    size: int


def engine_tensors(written: Written | None, view: dict[str, torch.Tensor]) -> list[EngineTensor]:
    """The engine patch for ``view`` given what was ``written`` since the engine's version:
    each written tensor's changes (``delta``), a tensor replaced whole as it is (``dense``);
    ``written`` None: the engine's version is unknown, everything ``dense``."""
    if written is None:
        return [EngineTensor(n, tuple(t.shape), "dense", t.reshape(-1)) for n, t in view.items()]
    patch = [
        EngineTensor(n, tuple(view[n].shape), "dense", view[n].reshape(-1))
        for n in sorted(written.replaced)
    ]
    for name in sorted(written.parts):
        ch: TensorChanges = written.take(name, view[name])
        shape = tuple(view[name].shape)
        changes = delta(ch.old, ch.new)
        patch.append(EngineTensor(name, shape, "delta", changes, ch.positions, unit_sum(ch.old)))
    return patch


class VLLMInplaceBackend(VLLMBackend):
    """See the module docstring."""

    def __init__(self, url: str, *, work_dir: Path, **kw: Any) -> None:
        super().__init__(url, work_dir=work_dir, **kw)
        self.pending: Written | None = Written()  # since the live version; None: unknown
        self.prepared: _Prepared | None = None
        self.board: Board | None = None

    async def connect(self) -> None:
        """As :class:`VLLMBackend`, then make the engine's weights writable in place."""
        await super().connect()
        await self.call("/init_weight_transfer_engine", {"init_info": {}})

    async def _engine_version(self) -> str | None:
        out = await self.call("/weight_info")
        version = out.get("weight_version") if isinstance(out, dict) else None
        return None if version is None else str(version)

    async def stage(self, board: Board, version: int) -> None:
        self.board = board  # the live view is rebuilt from it for an engine that restarted
        t0 = anyio.current_time()
        written = await anyio.to_thread.run_sync(self._advance, board, version)
        if self.pending is not None:
            self.pending.merge(written)
        _, view = self.shadow.take(version)
        t1 = anyio.current_time()
        path = self.work_dir / f"v{version:08d}.enginepatch"
        data = await anyio.to_thread.run_sync(self._write_patch, view, version, path)
        self.prepared = _Prepared(version, path, file_digest(data), len(data))
        t2 = anyio.current_time()
        # every worker reads and plans it while serving, so the pause holds only the writes
        info = {"path": str(path), "digest": self.prepared.digest, "prepare": True}
        await self._send(info, None)
        log.debug(
            "vllm.staged",
            version=version,
            advance_s=round(t1 - t0, 4),
            engine_patch_s=round(t2 - t1, 4),
            prepare_s=round(anyio.current_time() - t2, 4),
        )

    def _write_patch(self, view: dict[str, torch.Tensor], version: int, path: Path) -> bytes:
        data = encode(engine_tensors(self.pending, view), version)
        write(path, data)
        return data

    def _advance(self, board: Board, version: int) -> Written:
        with recording() as written:
            try:
                self.shadow.stage(board, version)
            except BaseException:
                self.pending = Written()  # the copy is rebuilt from an anchor: marked whole then
                raise
        return written

    async def _send(self, update_info: dict[str, Any], weight_version: str | None) -> None:
        """One weight-update session; ``weight_version`` None leaves vLLM's label as it is."""
        await self.call("/start_weight_update", {})
        await self.call("/update_weights", {"update_info": update_info})
        label = {} if weight_version is None else {"weight_version": weight_version}
        await self.call("/finish_weight_update", label)

    async def apply(self, version: int, mode: QuiesceMode) -> None:
        staged, _ = self.shadow.take(version)
        prepared = self.prepared
        if prepared is None or prepared.version != version:
            raise EngineError(f"version {version} has no engine patch staged")
        if mode == "pause":
            await self.call("/pause?mode=keep", {})
        try:
            try:
                info = {"path": str(prepared.path), "digest": prepared.digest}
                await self._send(info, str(version))
            except EngineError as exc:
                await self._undo(prepared, exc)
                raise
            await self.reset_cache(version, mode)
        finally:
            if mode == "pause":
                await self.call("/resume", {})
        got = await self._engine_version()
        if got != str(version):
            raise EngineError(f"vllm /weight_info says {got!r} after version {version}")
        self._activated(staged, prepared)

    def _activated(self, staged: Staged, prepared: _Prepared) -> None:
        self.island_bytes[prepared.version] = prepared.size * (1 + self.workers)
        self.shadow.activated(staged)
        self.pending, self.prepared, self.lost = Written(), None, False
        for old in self.work_dir.glob("v*.enginepatch"):
            old.unlink(missing_ok=True)
        log.info(
            "vllm.patched",
            engine=self.url,
            version=prepared.version,
            engine_patch_bytes=prepared.size,
            island_bytes=self.island_bytes[prepared.version],
        )

    async def _undo(self, prepared: _Prepared, exc: EngineError) -> None:
        """Put back the version served before ``prepared`` failed (module docstring): a worker
        that failed undid its own writes; one that succeeded takes its update back."""
        live = self.shadow.live  # None: its startup weights, whose label stays as it is
        try:
            await self._send(
                {"undo": prepared.version}, None if live is None else str(live.version)
            )
        except EngineError as again:
            self.broken = f"vllm could not be put back after a failed update: {again}"[:500]
            raise EngineUnavailable(self.broken) from exc
        log.warning("vllm.update_undone", engine=self.url, version=prepared.version, error=str(exc))

    async def recover(self) -> None:
        """An engine that restarted (on its startup checkpoint) gets the live view back whole
        before it serves again (asked at most once a second while nothing failed)."""
        now = anyio.current_time()
        if not self.lost and now - self._asked < STATUS_EVERY_S:
            return
        self._asked = now
        try:
            got = await self._engine_version()
        except EngineUnavailable:
            self.lost = True
            raise
        live = self.shadow.live
        if live is None or got == str(live.version):
            self.lost = False
            return
        log.warning("engine_restarted", engine=self.url, putting_back=live.version, engine_says=got)
        self.lost = True
        assert self.board is not None  # a version is live: it was staged from the board
        await self.call("/init_weight_transfer_engine", {"init_info": {}})
        view = await anyio.to_thread.run_sync(self.shadow.live_view, self.board)
        self.pending, self.prepared = Written(), None  # a staged version is staged again
        data = await anyio.to_thread.run_sync(encode, engine_tensors(None, view), live.version)
        path = self.work_dir / "restore.enginepatch"
        await anyio.to_thread.run_sync(write, path, data)
        try:
            await self._send({"path": str(path), "digest": file_digest(data)}, str(live.version))
            await self.call("/reset_prefix_cache", {})
        finally:
            path.unlink(missing_ok=True)
        self.lost = False
