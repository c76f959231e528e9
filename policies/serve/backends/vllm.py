"""vLLM behind the sidecar: token ids in and out, versions staged from the shadow, exact reloads.

Generation (:mod:`policies.serve.backends.vllm_wire`): ``POST /inference/v1/generate`` when the
engine runs with ``--enable-scale-out`` (its ``weight_versions`` spans are cross-checked against
the sidecar's stamps), else ``POST /v1/completions``; token ids in and out, every sampling field
explicit, log probs of the distribution sampled (``--logprobs-mode processed_logprobs``), an MoE
model's routing when vLLM returns it (``--enable-return-routed-experts``: a GPU build). The
context length is the engine's (``GET /v1/models`` → ``max_model_len``), read by
:meth:`VLLMBackend.connect`, which also learns whether the token route is there and how many
workers read each version (``/get_world_size``).

This class takes versions by **reloading the whole view** (``--vllm-update reload``: the fallback
and the benchmark's baseline); :mod:`policies.serve.backends.vllm_inplace` applies them in place.
Versions: **stage** advances the island's :class:`~policies.serve.backends.shadow.Shadow` with
patches from the board, writes the staged view as an island-local safetensors file (the engine
must be able to read ``work_dir``) and waits until every worker has checked and read it while
serving (``sprawl_prepare``: the pause then holds only the reload); **apply** asks every worker
to load it through vLLM's own ``reload_weights`` (:mod:`policies.serve.backends.vllm_worker`, ``POST
/collective_rpc``), checks that every worker loaded the manifest's digest, and resets the prefix
cache so no KV block of the old weights is reused, and labels the weights with the sprawl version
(``/update_weight_version``: ``/weight_info`` and the token route's spans name it). Mode
``"pause"`` wraps it in ``POST /pause?mode=keep`` … ``POST /resume`` and resets the running
requests' KV too (``reset_running_requests``; ``kv_on_update = "keep"`` leaves it), so in-flight
requests continue on the new weights; mode ``"wait"`` drains first (the base class), so no
request spans versions.

All-or-nothing: a worker that refuses the file changed nothing; one that failed midway put the
previous version back before answering; both raise :class:`~policies.errors.EngineError`, so the
sidecar keeps serving the old version, counts the failure and retries later. A worker that could
not be put back marks the engine broken: every request is then a 503 until it is restarted.
Start the engine as in ``docs/fleet.md`` (``--worker-extension-cls``, ``VLLM_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import structlog
import torch

from policies.board import Board, Manifest, anchor_payload
from policies.codec.digests import state_digest
from policies.errors import EngineError
from policies.serve.backends.base import EngineUnavailable, HttpBackend, Sample
from policies.serve.backends.shadow import Shadow
from policies.serve.backends.vllm_wire import (
    COMPLETIONS,
    TITO,
    completions_body,
    read_sample,
    tito_body,
)
from policies.serve.backends.vllm_worker import PREPARE_METHOD, RPC_METHOD
from policies.serve.options import KVOnUpdate
from policies.serve.types import QuiesceMode
from policies.wire.lane import GenerateRequest

log = structlog.get_logger(__name__)
PREPARE_POLL_S = 0.005
"""How soon the sidecar first asks the workers whether the staged file is read (doubling to
0.1 s)."""
PREPARE_WAIT_S = 120.0
"""How long staging waits, serving, for the workers to read the staged file."""
"""What a pause-mode activation does to the running requests' KV cache: ``recompute`` it under
the new weights (exact), or ``keep`` it (PipelineRL's way: faster, but the tokens after the update
are sampled by the new version from KV the previous one computed)."""
ADAPTER: ContextVar[str | None] = ContextVar("sprawl_vllm_adapter", default=None)
"""The LoRA adapter the current request runs through (set by ``vllm_lora.VLLMLoraBackend``)."""


def write_view(view: dict[str, torch.Tensor], path: Path) -> None:
    """The served view as one safetensors file, written to a sibling and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(anchor_payload(view)[0])
    tmp.replace(path)


def file_digest(manifest: Manifest, view: dict[str, torch.Tensor]) -> str:
    """The state digest the vLLM workers compute of ``view``'s file (``sum-128`` checksums): the
    manifest's, except for a sharded version, whose manifest digest covers its pieces
    (``policies.board.sharded``): that one is computed here from the whole tensors the shadow
    assembled and verified."""
    if manifest.shards:
        return state_digest(view)
    return manifest.digest


class VLLMBackend(HttpBackend):
    kind = "vllm"

    def __init__(
        self, url: str, *, work_dir: Path, kv_on_update: KVOnUpdate = "recompute", **kw: Any
    ) -> None:
        super().__init__(url, **kw)
        self.work_dir = work_dir
        self.kv_on_update = kv_on_update
        self.tito = False
        """Generation through ``/inference/v1/generate`` (learnt by :meth:`connect`)."""
        self.shadow = Shadow("vllm")
        self.broken: str | None = None
        self._digests: dict[int, str] = {}  # per staged or live version: its file's digest
        self.workers = 1
        self.island_bytes: dict[int, int] = {}
        """Per version activated: bytes written plus read on the island's disk for it (the
        staged file, written once and read by every worker)."""

    async def connect(self) -> None:
        """Read the served model's context length from the engine (``max_model_len``)."""
        out = await self.call("/v1/models")
        models = out.get("data") if isinstance(out, dict) else None
        if not isinstance(models, list) or not models:
            raise EngineUnavailable(f"vllm /v1/models lists no model: {out!r}"[:300])
        named = [m for m in models if m.get("id") == self.name]
        if not named:
            ids = [m.get("id") for m in models]
            raise EngineUnavailable(
                f"vllm serves {ids}, not {self.name!r}: pass --model, or start vLLM with "
                f"--served-model-name {self.name}"
            )
        self.max_context = int(named[0]["max_model_len"])
        self.tito = await self._has_tito()
        out = await self.call("/get_world_size?include_dp=false")  # workers that read a version
        self.workers = int(out["world_size"]) if isinstance(out, dict) else 1
        log.info("vllm.connected", engine=self.url, generate=TITO if self.tito else COMPLETIONS)

    async def generate_one(self, req: GenerateRequest, seed: int | None) -> Sample:
        if self.broken is not None:
            raise EngineUnavailable(self.broken)
        if self.lost:
            raise EngineUnavailable("vllm went away; the live version is put back when it returns")
        model = ADAPTER.get() or self.name
        tito = self.tito and ADAPTER.get() is None  # adapters' versions are not vLLM's labels
        route = TITO if tito else COMPLETIONS
        body = tito_body(model, req, seed) if tito else completions_body(model, req, seed)
        try:
            out = await self.call(route, body)
        except EngineUnavailable:
            self.lost = True  # checked (and the version put back) at the next reconcile
            raise
        return read_sample(route, out, req)

    async def _has_tito(self) -> bool:
        """Whether the engine answers ``/inference/v1/generate`` (``--enable-scale-out``): an
        empty request is refused as invalid there, as not found or forbidden elsewhere."""
        try:
            async with self.session.post(f"{self.url}{TITO}", json={}) as r:
                return r.status in (400, 422)
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"vllm {TITO} unreachable: {exc}") from exc

    async def recover(self) -> None:
        """Ask the workers what they serve; an engine that restarted (on its startup checkpoint)
        gets the live version back before it serves again. Requests are 503 meanwhile. Asked at
        most once a second while nothing failed (a restart takes tens of seconds)."""
        if not self._status_due():
            return
        try:
            out = await self.call("/collective_rpc", {"method": "sprawl_status", "args": []})
        except EngineUnavailable:
            self.lost = True
            raise
        live = self.shadow.live
        want = None if live is None else str(self._file(live.version))
        results = out.get("results") if isinstance(out, dict) else None
        if isinstance(results, list) and all(
            isinstance(r, dict) and r.get("current") == want for r in results
        ):
            self.lost = False
            return
        if live is None:  # nothing activated yet: its startup checkpoint is what it should serve
            self.lost = False
            return
        log.warning("engine_restarted", engine=self.url, putting_back=live.version)
        digest = self._digests.get(live.version, live.digest)
        out = await self.call("/collective_rpc", {"method": RPC_METHOD, "args": [want, digest]})
        self._check(live.version, digest, out)
        await self.call("/reset_prefix_cache", {})
        self.lost = False

    async def reset_cache(self, version: int, mode: QuiesceMode) -> None:
        """No KV block of the old weights is reused: the prefix cache is reset, and in pause mode
        the running requests' KV too, unless ``kv_on_update`` is ``keep`` (logged, since their
        later tokens then come from stale KV)."""
        if mode == "pause" and self.kv_on_update == "recompute":
            await self.call("/reset_prefix_cache?reset_running_requests=true", {})
            return
        if mode == "pause":
            log.info("vllm.kv_kept", engine=self.url, version=version)
        await self.call("/reset_prefix_cache", {})

    def _file(self, version: int) -> Path:
        return self.work_dir / f"v{version:08d}.safetensors"

    async def stage(self, board: Board, version: int) -> None:
        await anyio.to_thread.run_sync(self.shadow.stage, board, version)
        staged, view = self.shadow.take(version)
        await anyio.to_thread.run_sync(write_view, view, self._file(version))
        digest = await anyio.to_thread.run_sync(file_digest, staged.manifest, view)
        self._digests[version] = digest
        await self._prepared(version, digest)

    async def _prepare(self, version: int, digest: str) -> list[dict[str, Any]] | None:
        """Have every worker check and read the staged file while it serves, or say whether it
        is done (``sprawl_prepare``); their answers, or None when they cannot (an engine env
        built before that method, or the engine away: logged, and each activation then reads the
        file itself, paused)."""
        body = {"method": PREPARE_METHOD, "args": [str(self._file(version)), digest]}
        try:
            out = await self.call("/collective_rpc", body)
        except EngineError as exc:
            log.warning("vllm.prepare_failed", engine=self.url, version=version, error=str(exc))
            return None
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not all(
            isinstance(r, dict) and r.get("ok") is True for r in results
        ):
            log.warning("vllm.prepare_failed", engine=self.url, version=version, out=str(out)[:300])
            return None
        return results

    async def _prepared(self, version: int, digest: str) -> None:
        """Have every worker read and check the staged file, and wait, the engine serving, until
        they all have (at most :data:`PREPARE_WAIT_S`; the activation then waits for the rest,
        paused)."""
        wait = PREPARE_POLL_S
        with anyio.move_on_after(PREPARE_WAIT_S):
            while True:
                results = await self._prepare(version, digest)
                if results is None or all(r.get("done") is True for r in results):
                    return
                await anyio.sleep(wait)
                wait = min(2 * wait, 0.1)

    async def apply(self, version: int, mode: QuiesceMode) -> None:
        staged, _ = self.shadow.take(version)
        path = self._file(version)
        digest = self._digests.get(version, staged.manifest.digest)
        if mode == "pause":
            await self.call("/pause?mode=keep", {})
        try:
            out = await self.call(
                "/collective_rpc", {"method": RPC_METHOD, "args": [str(path), digest]}
            )
            self._check(version, digest, out)
            await self.call("/update_weight_version", {"new_version": str(version)})
            await self.reset_cache(version, mode)
        except EngineError:
            path.unlink(missing_ok=True)
            raise
        finally:
            if mode == "pause":
                await self.call("/resume", {})
        self.island_bytes[version] = path.stat().st_size * (1 + self.workers)
        self.shadow.activated(staged)
        self._digests = {v: d for v, d in self._digests.items() if v >= version}
        for old in self.work_dir.glob("v*.safetensors"):
            if old != path:  # the live file stays: a failed reload puts it back
                old.unlink(missing_ok=True)

    def _check(self, version: int, digest: str, out: Any) -> None:
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results:
            raise EngineUnavailable(f"vllm collective_rpc gave no results: {out!r}"[:300])
        failed = [r for r in results if not (isinstance(r, dict) and r.get("ok") is True)]
        lost = [
            r
            for r in failed
            if isinstance(r, dict) and r.get("changed") and not r.get("rolled_back")
        ]
        if lost:
            self.broken = f"vllm could not be put back after a failed reload: {lost[0]}"[:500]
            raise EngineUnavailable(self.broken)
        if failed:
            raise EngineError(f"vllm refused version {version}: {failed[0]}"[:500])
        digests = {r.get("digest") for r in results}
        if digests != {digest}:
            raise EngineError(f"vllm workers loaded {digests} for version {version}, not {digest}")
        log.info(  # what the pause held: the wait for the checked file, then the reload
            "vllm.reloaded",
            engine=self.url,
            version=version,
            prepared=all(r.get("prepared") is True for r in results),
            check_s=max(float(r.get("check_s") or 0.0) for r in results),
            reload_s=max(float(r.get("reload_s") or 0.0) for r in results),
        )
