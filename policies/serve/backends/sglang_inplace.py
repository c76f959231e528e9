"""SGLang behind the sidecar, versions applied in place through SGLang's own
``POST /update_weights_from_tensor`` and sprawl's custom weight loader.

The default way an SGLang island takes versions (``orchestrate sidecar --engine-kind sglang
--sglang-update inplace``; SGLang started with ``--custom-weight-loader
policies.serve.backends.sglang_loader.apply_engine_patch``, :mod:`~policies.serve.backends
.sglang_loader`, which also names the SGLang source these shapes were checked against).
Generation is :class:`~policies.serve.backends.sglang.SGLangBackend`'s; ``--sglang-update disk``
keeps that class's directory of changed tensors and ``update_weights_from_disk``.

**connect** reads ``GET /get_server_info``: the loader must be among ``custom_weight_loader``
(else the engine is refused before any update: an SGLang without it ends its scheduler on an
unknown ``load_format``), ``tp_size`` (one command per tensor-parallel rank), ``model_path`` (the
checkpoint every rank learns its map from); then every rank learns it (``init``) before the lane
opens.

**stage** advances the island's shadow with the board's patches while the engine serves, keeping
the frames it applied (:func:`policies.codec.written.recording`), and writes the **engine patch**
of everything applied since the version the engine serves
(:func:`~policies.serve.backends.engine_patch.build`: those frames as they crossed the link) as
one island-local file under ``materialize_dir``, as :mod:`~policies.serve.backends.vllm_inplace`
does. Unlike vLLM there is no read-ahead: SGLang takes its model-update writer lock
for an update made while generation runs, which would drain the engine, so each rank reads and
plans the patch inside the pause (work proportional to the patch).

**apply**: ``POST /pause_generation {"mode": "retract"}`` (mode ``"pause"``; mode ``"wait"`` is
drained first) → ``POST /update_weights_from_tensor {"serialized_named_tensors": [one command per
rank], "load_format": <the loader>, "flush_cache": true, "abort_all_requests": false}`` → every
rank's result read from the island → ``POST /update_weight_version {"new_version": "<sprawl
version>", "abort_all_requests": false}`` → ``POST /continue_generation``, and ``GET /model_info``
must name the version. The label is not sent with the update: SGLang answers ``success`` whatever
the loader found (it never raises) and would set it; it moves only once every rank said ``ok``.
``flush_cache`` drops the radix cache, so no KV the old weights computed is reused; under a retract
pause that needs an SGLang with sgl-project/sglang#31962 (before it, the flush is refused while
retracted requests wait, and the update's assert ends the scheduler: use ``--activation wait``).
``kv_on_update = "keep"`` (SGLang's ``in_place`` pause) is not offered: SGLang cannot flush while
requests hold their KV in place, so new requests would reuse prefixes the old weights computed.

All-or-nothing: a rank that fails midway undoes its own writes; if any rank failed, every rank is
asked to take the update back (``undo``; a no-op where it failed) and the label stays, before
generation continues. If that fails too the engine is marked broken: requests are 503, retracted
requests stay paused, no version is applied, and a reconcile (at most once a second) writes the
live view whole (a dense engine patch) before generation continues. An engine that restarted (its
label is not the live version) learns its map again and gets the live view whole before it
serves. ``island_bytes`` counts, per version, the engine patch written once and read by every
rank, and the ranks' results.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

from policies.board import Board
from policies.codec.written import Written, recording
from policies.errors import EngineError
from policies.serve.backends.base import EngineUnavailable, Sample
from policies.serve.backends.engine_patch import build, file_digest, write
from policies.serve.backends.sglang import SGLangBackend, moe_shape
from policies.serve.backends.sglang_loader import LOADER, command_payload
from policies.serve.backends.shadow import Staged
from policies.serve.types import QuiesceMode
from policies.wire.lane import GenerateRequest

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _Prepared:
    """A staged version's engine patch, on the island."""

    version: int
    path: Path
    digest: str
    size: int


def _collect(paths: list[Path]) -> tuple[list[dict[str, Any] | None], int]:
    """Each rank's result (None where it wrote none), removed once read; and their bytes."""
    answers: list[dict[str, Any] | None] = []
    size = 0
    for path in paths:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            answers.append(None)
            continue
        path.unlink(missing_ok=True)
        size += len(data)
        answer = json.loads(data)
        answers.append(answer if isinstance(answer, dict) else None)
    return answers, size


class SGLangInplaceBackend(SGLangBackend):
    """See the module docstring."""

    def __init__(self, url: str, *, materialize_dir: Path, **kw: Any) -> None:
        super().__init__(url, materialize_dir=materialize_dir, **kw)
        self.pending: Written | None = Written()  # since the live version; None: unknown
        self.prepared: _Prepared | None = None
        self.board: Board | None = None
        self.workers = 1
        """Tensor-parallel ranks: each gets its own command and writes its own result."""
        self.checkpoint = ""
        self.island_bytes: dict[int, int] = {}
        """Per version activated: bytes written plus read on the island's disk for it."""
        self.paused = False  # generation is paused by this backend (left so while broken)
        self._updates = 0
        self._run = secrets.token_hex(4)  # results of another sidecar process never match
        self._result_bytes = 0  # the last update's results, written and read once each
        self._info_route = "/model_info"
        self._config_read = False

    async def connect(self) -> None:
        """As :class:`SGLangBackend`, then check the loader is there and have every rank learn
        where checkpoint elements live."""
        await super().connect()
        info = self.server_info
        loaders = info.get("custom_weight_loader") or []
        if LOADER not in loaders:
            raise EngineUnavailable(
                f"sglang was started without --custom-weight-loader {LOADER} (it has "
                f"{loaders}): start it with it, or pass --sglang-update disk"
            )
        if int(info.get("pp_size") or 1) != 1 or int(info.get("dp_size") or 1) != 1:
            raise EngineUnavailable(
                "sglang in place covers tensor parallelism only (pp_size and dp_size 1): "
                "pass --sglang-update disk"
            )
        self.workers = int(info.get("tp_size") or 1)
        self.checkpoint = str(info["model_path"])
        try:
            await self._engine_version()
        except EngineUnavailable:  # a release before /model_info
            self._info_route = "/get_model_info"
        self.materialize_dir.mkdir(parents=True, exist_ok=True)
        for old in self.materialize_dir.glob("u-*.json"):  # left by an earlier process
            old.unlink(missing_ok=True)
        await self._update({"op": "init"}, flush=False)

    async def generate_one(self, req: GenerateRequest, seed: int | None) -> Sample:
        if self.lost:
            raise EngineUnavailable("sglang went away; the live version is put back on its return")
        try:
            return await super().generate_one(req, seed)
        except EngineUnavailable:
            self.lost = True  # checked (and the version put back) at the next reconcile
            raise

    async def _engine_version(self) -> str | None:
        out = await self.call(self._info_route)
        version = out.get("weight_version") if isinstance(out, dict) else None
        return None if version is None else str(version)

    async def _label(self, version: str) -> None:
        """SGLang's ``weight_version``, without aborting anything (its default would)."""
        body = {"new_version": version, "abort_all_requests": False}
        out = await self.call("/update_weight_version", body)
        if not isinstance(out, dict) or out.get("success") is not True:
            raise EngineError(f"sglang did not take weight_version {version}: {out!r}"[:500])

    async def _update(self, command: dict[str, Any], *, flush: bool) -> None:
        """One ``update_weights_from_tensor`` carrying ``command`` to every rank; raises
        :class:`EngineError` unless every rank's result says ``ok``."""
        self._updates += 1
        name = f"u-{self._run}-{self._updates:08d}"
        results = [self.materialize_dir / f"{name}.rank{r}.json" for r in range(self.workers)]
        payloads = [
            command_payload({**command, "rank": r, "result": str(p), "checkpoint": self.checkpoint})
            for r, p in enumerate(results)
        ]
        body = {
            "serialized_named_tensors": payloads,
            "load_format": LOADER,
            "flush_cache": flush,
            "abort_all_requests": False,
        }
        try:
            out = await self.call("/update_weights_from_tensor", body)
            if not isinstance(out, dict) or out.get("success") is not True:
                raise EngineError(f"sglang did not run the update: {out!r}"[:500])
        finally:
            answers, size = await anyio.to_thread.run_sync(_collect, results)
            self._result_bytes = 2 * size
        failed = [
            f"rank {r}: " + (str(a.get("error")) if a else "no result (the loader did not run)")
            for r, a in enumerate(answers)
            if not (a and a.get("ok") is True)
        ]
        if failed:
            raise EngineError(f"sglang {command['op']} failed: " + "; ".join(failed)[:1000])

    # -- versions -------------------------------------------------------------------------------
    async def stage(self, board: Board, version: int) -> None:
        self.board = board  # the live view is rebuilt from it for an engine that restarted
        if not self._config_read:
            base = await anyio.to_thread.run_sync(board.base_files)
            self._moe = moe_shape(base["config.json"]) if "config.json" in base else None
            self._config_read = True
        written = await anyio.to_thread.run_sync(self._advance, board, version)
        if self.pending is not None:
            self.pending.merge(written)
        staged, view = self.shadow.take(version)
        path = self.materialize_dir / f"v{version:08d}.enginepatch"
        data = await anyio.to_thread.run_sync(self._write_patch, view, version, path)
        self.prepared = _Prepared(version, path, file_digest(data), len(data))
        log.info(
            "sglang.staged",
            version=version,
            board_bytes_read=staged.bytes_read,
            engine_patch_bytes=len(data),
        )

    def _advance(self, board: Board, version: int) -> Written:
        with recording() as written:
            try:
                self.shadow.stage(board, version)
            except BaseException:
                self.pending = Written()  # the copy is rebuilt from an anchor: marked whole then
                raise
        return written

    def _write_patch(self, view: dict[str, torch.Tensor], version: int, path: Path) -> bytes:
        data = build(self.pending, view, self.shadow.live, version)
        write(path, data)
        return data

    async def apply(self, version: int, mode: QuiesceMode) -> None:
        staged, _ = self.shadow.take(version)
        prepared = self.prepared
        if prepared is None or prepared.version != version:
            raise EngineError(f"version {version} has no engine patch staged")
        if self.broken is not None and self.shadow.live is not None:
            raise EngineUnavailable(f"{self.broken}; the live view is written whole first")
        if mode == "pause":
            await self.call("/pause_generation", {"mode": "retract"})
            self.paused = True
        try:
            command = {"version": version, "path": str(prepared.path), "digest": prepared.digest}
            try:
                await self._update({"op": "apply", **command}, flush=True)
                await self._label(str(version))
            except EngineError as exc:
                await self._undo(prepared, exc)
                raise
            self.broken = None  # the weights are a version again (a first one lands whole)
        finally:
            # retracted requests continue only on weights that are a version
            if self.paused and self.broken is None:
                await self._continue()
        got = await self._engine_version()
        if got != str(version):
            raise EngineError(f"sglang /model_info says {got!r} after version {version}")
        self._activated(staged, prepared)

    async def _continue(self) -> None:
        await self.call("/continue_generation", {})
        self.paused = False

    def _activated(self, staged: Staged, prepared: _Prepared) -> None:
        island = prepared.size * (1 + self.workers) + self._result_bytes
        self.island_bytes[prepared.version] = island
        self.shadow.activated(staged)
        self.pending, self.prepared, self.lost = Written(), None, False
        for old in self.materialize_dir.glob("v*.enginepatch"):
            old.unlink(missing_ok=True)
        log.info(
            "sglang.patched",
            engine=self.url,
            version=prepared.version,
            engine_patch_bytes=prepared.size,
            island_bytes=island,
        )

    async def _undo(self, prepared: _Prepared, exc: EngineError) -> None:
        """Put back the version served before ``prepared`` failed (module docstring)."""
        live = self.shadow.live  # None: its startup weights, whose label stays as it is
        try:
            await self._update({"op": "undo", "version": prepared.version}, flush=True)
            if live is not None:
                await self._label(str(live.version))
        except EngineError as again:
            self.broken = f"sglang could not be put back after a failed update: {again}"[:500]
            raise EngineUnavailable(self.broken) from exc
        log.warning(
            "sglang.update_undone", engine=self.url, version=prepared.version, error=str(exc)
        )

    async def recover(self) -> None:
        """An engine that restarted (on its startup checkpoint), or that a failed update left
        broken, gets the live view back whole before it serves again (asked at most once a
        second while nothing failed)."""
        if not self._status_due():
            return
        try:
            got = await self._engine_version()
        except EngineUnavailable:
            self.lost = True
            raise
        live = self.shadow.live
        if live is None or (got == str(live.version) and self.broken is None):
            self.lost = False
            return
        log.warning(
            "engine_restarted" if self.broken is None else "sglang.restoring",
            engine=self.url,
            putting_back=live.version,
            engine_says=got,
        )
        self.lost = True
        await self._restore(live.version)
        self.broken, self.lost = None, False
        if self.paused:
            await self._continue()

    async def _restore(self, version: int) -> None:
        """Every rank (learning its map again if it restarted) gets the live view whole."""
        assert self.board is not None  # a version is live: it was staged from the board
        await self._update({"op": "init"}, flush=False)
        view = await anyio.to_thread.run_sync(self.shadow.live_view, self.board)
        self.pending, self.prepared = Written(), None  # a staged version is staged again
        data = await anyio.to_thread.run_sync(build, None, view, None, version)
        path = self.materialize_dir / "restore.enginepatch"
        await anyio.to_thread.run_sync(write, path, data)
        command = {"version": version, "path": str(path), "digest": file_digest(data)}
        try:
            await self._update({"op": "apply", **command}, flush=True)
            await self._label(str(version))
        finally:
            path.unlink(missing_ok=True)
