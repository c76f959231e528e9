"""vLLM behind the sidecar, versions applied in place through vLLM's own weight-transfer API.

The default way a vLLM island takes versions (``orchestrate sidecar --engine-kind vllm
--vllm-update inplace``; the engine started with ``--weight-transfer-config '{"backend":
"sprawl"}'``, :mod:`policies.serve.backends.vllm_transfer`). Generation is
:class:`~policies.serve.backends.vllm.VLLMBackend`'s.

**stage** advances the island's shadow with the board's patches while the engine serves and hands
each frame on as it is applied (:func:`policies.codec.written.recording`), while the rest of the
patch still crosses the link: the frames are written as they came (nothing re-encoded) into
**engine patch** parts of at least :data:`PART_BYTES` under ``work_dir``
(:mod:`policies.serve.backends.engine_patch`), and every worker reads each part ahead on a thread
of its own, checking it against its weights, while the engine serves
(:class:`~policies.serve.backends.engine_apply.Updates`). A version's parts go in one
weight-update session: ``/start_weight_update`` before its first part, ``/update_weights``
``{"path", "digest", "part"}`` for each. A stage that replaced tensors whole (an anchor) hands on
one part of everything since the version the engine serves instead. **apply** then drives
vLLM's routes: ``/pause?mode=keep`` (mode ``"pause"``; mode ``"wait"`` drained first) →
``/update_weights {"parts": …}`` (the writes alone) → ``/finish_weight_update`` with
``weight_version`` = the sprawl version → prefix cache reset → ``/resume``, and checks
``/weight_info`` says that version. No full-view file is written or read per version. A session
left open by a sidecar that stopped is closed (label unchanged) before the next one opens.

All-or-nothing: each worker reads the values each frame changes from its own weights, computes
the new ones and checks the tensors they make against the frame's target checksums before it
writes anything, and undoes its own writes if one fails midway; the sidecar then asks every
worker to take that update back (``{"undo": version}``: a worker that failed has nothing to take
back) with the old ``weight_version``, before generation resumes. If that fails too, the engine
is marked broken: every request is a 503 until it restarts. An engine that restarted
(``/weight_info`` no longer names the live version) gets the live view back whole (a part of
whole tensors) before it serves again (the shadow's copy rebuilt from the board first if it holds
another version, a staged one then staged again). ``island_bytes`` counts what each version wrote
and the workers read on the island (its parts, once written and once read per worker).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream

from policies.board import Board
from policies.codec.written import Frame, Written, recording
from policies.errors import EngineError
from policies.serve.backends.base import EngineUnavailable
from policies.serve.backends.engine_patch import Chain, build, encode, file_digest, live_sums, write
from policies.serve.backends.shadow import Staged
from policies.serve.backends.vllm import VLLMBackend
from policies.serve.types import QuiesceMode

log = structlog.get_logger(__name__)
PART_BYTES = 256 << 10
"""Frames handed on together (a worker reads each part ahead in one call; fewer, larger parts
cost the engine fewer round trips while the rest of the patch crosses the link)."""


@dataclass(frozen=True)
class _Part:
    """One part of the engine patch since the live version, on the island."""

    path: Path
    digest: str


class VLLMInplaceBackend(VLLMBackend):
    """See the module docstring."""

    def __init__(self, url: str, *, work_dir: Path, **kw: Any) -> None:
        super().__init__(url, work_dir=work_dir, **kw)
        self.pending: Written | None = Written()  # since the live version; None: unknown
        self.parts: list[_Part] = []  # the engine patch since the live version, in parts
        self.chain = Chain({})
        self.written_bytes = 0  # engine-patch bytes written since the live version
        self.ready: int | None = None  # the version whose parts are all handed on
        self.updating = False  # a weight-update session is open on the engine
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
        """Advance the shadow, handing each frame on as it is applied (module docstring)."""
        self.board = board  # the live view is rebuilt from it for an engine that restarted
        self.ready = None
        if not self.parts:
            self.chain = Chain(live_sums(self.shadow.live))
        token = anyio.lowlevel.current_token()
        send, receive = anyio.create_memory_object_stream[Frame](max_buffer_size=math.inf)

        def landed(frame: Frame) -> None:  # in the staging thread
            anyio.from_thread.run_sync(send.send_nowait, frame, token=token)

        t0 = anyio.current_time()
        failed: list[Exception] = []  # raised as they are, once the parts handed on are written
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._hand_on, receive, version, failed)
            with send:
                try:
                    written = await anyio.to_thread.run_sync(self._advance, board, version, landed)
                except Exception as exc:
                    failed.insert(0, exc)
        if failed:
            self.parts = []  # the copy is rebuilt from an anchor next: everything whole then
            raise failed[0]
        if self.pending is not None:
            self.pending.merge(written)
        if written.replaced or self.pending is None:
            # the parts describe values the engine does not hold: one part of everything since
            _, view = self.shadow.take(version)
            self.parts = []
            data = await anyio.to_thread.run_sync(
                build, self.pending, view, self.shadow.live, version
            )
            await self._part(data, version)
        self.ready = version
        took = round(anyio.current_time() - t0, 4)
        log.debug("vllm.staged", version=version, parts=len(self.parts), stage_s=took)

    async def _hand_on(
        self, receive: MemoryObjectReceiveStream[Frame], version: int, failed: list[Exception]
    ) -> None:
        """Write the frames that landed as parts of at least :data:`PART_BYTES` (the rest when
        the stage ends), and have every worker read each ahead; an engine that fails to take one
        is noted in ``failed`` (the rest still drain)."""
        frames: list[Frame] = []
        async with receive:
            async for frame in receive:
                frames.append(frame)
                if sum(len(f.data) for f in frames) >= PART_BYTES and not failed:
                    await self._handed(frames, version, failed)
                    frames = []
        if frames and not failed:
            await self._handed(frames, version, failed)

    async def _handed(self, frames: list[Frame], version: int, failed: list[Exception]) -> None:
        try:
            await self._part(frames, version)
        except EngineError as exc:
            failed.append(exc)

    async def _part(self, frames: list[Frame] | bytes, version: int) -> None:
        """Write ``frames`` (or an engine patch made already) as the next part."""
        if isinstance(frames, bytes):
            data = frames
        else:
            chained = [self.chain.next(f) for f in frames]
            data = await anyio.to_thread.run_sync(encode, chained, set(), version)
        path = self.work_dir / f"v{version:08d}.{len(self.parts):05d}.enginepatch"
        await anyio.to_thread.run_sync(write, path, data)
        part = _Part(path, file_digest(data))
        self.written_bytes += len(data)
        info = {"path": str(path), "digest": part.digest, "part": len(self.parts)}
        self.parts.append(part)
        await self._open()
        await self._call_session("/update_weights", {"update_info": info})

    def _advance(self, board: Board, version: int, landed: Callable[[Frame], None]) -> Written:
        with recording(landed) as written:
            try:
                self.shadow.stage(board, version)
            except BaseException:
                self.pending = Written()  # the copy is rebuilt from an anchor: marked whole then
                raise
        return written

    async def _open(self) -> None:
        """Open the weight-update session the parts are read ahead in, if it is not open: one
        session from a version's first part to its write, so reading a part ahead is one call."""
        if self.updating:
            return
        try:
            await self.call("/start_weight_update", {})
        except EngineError as exc:
            if "already active" not in str(exc):
                raise
            # a session left open (by a sidecar that stopped midway): closed, label unchanged
            await self.call("/finish_weight_update", {})
            await self.call("/start_weight_update", {})
        self.updating = True

    async def _call_session(self, path: str, body: dict[str, Any]) -> None:
        try:
            await self.call(path, body)
        except EngineError:
            self.updating = False  # vLLM's worker ends the session on an error
            raise

    async def _send(self, update_info: dict[str, Any], weight_version: str | None) -> None:
        """The rest of a weight-update session (opened first if need be); ``weight_version`` None
        leaves vLLM's label as it is."""
        await self._open()
        await self._call_session("/update_weights", {"update_info": update_info})
        label = {} if weight_version is None else {"weight_version": weight_version}
        self.updating = False
        await self.call("/finish_weight_update", label)

    async def apply(self, version: int, mode: QuiesceMode) -> None:
        staged, _ = self.shadow.take(version)
        if self.ready != version:
            raise EngineError(f"version {version} has no engine patch staged")
        parts = [[str(p.path), p.digest] for p in self.parts]
        if mode == "pause":
            await self.call("/pause?mode=keep", {})
        try:
            try:
                await self._send({"parts": parts}, str(version))
            except EngineError as exc:
                await self._undo(version, exc)
                raise
            await self.reset_cache(version, mode)
        finally:
            if mode == "pause":
                await self.call("/resume", {})
        got = await self._engine_version()
        if got != str(version):
            raise EngineError(f"vllm /weight_info says {got!r} after version {version}")
        self._activated(staged)

    def _activated(self, staged: Staged) -> None:
        written = self.written_bytes
        self.island_bytes[staged.version] = written * (1 + self.workers)
        self.shadow.activated(staged)
        self.pending, self.parts, self.ready, self.lost = Written(), [], None, False
        self.written_bytes = 0
        for old in self.work_dir.glob("v*.enginepatch"):
            old.unlink(missing_ok=True)
        log.info(
            "vllm.patched",
            engine=self.url,
            version=staged.version,
            engine_patch_bytes=written,
            island_bytes=self.island_bytes[staged.version],
        )

    async def _undo(self, version: int, exc: EngineError) -> None:
        """Put back the version served before ``version`` failed (module docstring): a worker
        that failed undid its own writes; one that succeeded takes its update back."""
        live = self.shadow.live  # None: its startup weights, whose label stays as it is
        try:
            await self._send({"undo": version}, None if live is None else str(live.version))
        except EngineError as again:
            self.broken = f"vllm could not be put back after a failed update: {again}"[:500]
            raise EngineUnavailable(self.broken) from exc
        log.warning("vllm.update_undone", engine=self.url, version=version, error=str(exc))

    async def recover(self) -> None:
        """An engine that restarted (on its startup checkpoint) gets the live view back whole
        before it serves again (asked at most once a second while nothing failed)."""
        if not self._status_due():
            return
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
        self.updating = False  # a restarted engine has none open
        view = await anyio.to_thread.run_sync(self.shadow.live_view, self.board)
        self.pending, self.parts, self.ready = Written(), [], None  # staged ones: staged again
        self.written_bytes = 0
        data = await anyio.to_thread.run_sync(build, None, view, None, live.version)
        path = self.work_dir / "restore.enginepatch"
        await anyio.to_thread.run_sync(write, path, data)
        try:
            parts = [[str(path), file_digest(data)]]
            await self._send({"parts": parts}, str(live.version))
            await self.call("/reset_prefix_cache", {})
        finally:
            path.unlink(missing_ok=True)
        self.lost = False
