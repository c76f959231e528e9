"""llama.cpp behind the sidecar: a ``llama-server`` child the sidecar owns, one per version.

The sidecar starts ``llama-server`` (``scripts/build-llama-server.sh`` builds and caches it; or
``--llama-server PATH``) on loopback with a random API key, and drives it as follows.

**Versions.** *stage* advances the island's :class:`~policies.serve.backends.shadow.Shadow` with
patches (in a worker thread, while the old version serves) and exports the staged view to an
island-local GGUF (``v<version>.gguf``, F32 matrices: :mod:`policies.board.gguf`) and starts a
second ``llama-server`` on it, while the old one serves (single-model llama-server has no reload
endpoint); *apply* waits for in-flight requests, switches to the new server and stops the old.
The pause reported is that switch. All-or-nothing: a new server that does not come up healthy
is never switched to, and the failure is raised for the sidecar to count and retry.
``--llama-restart`` stops the old server before starting the new one instead (half the memory,
a pause of the restart) and serves the previous file again if the new one fails. ``pause`` mode
is served as ``wait``: a switch cannot keep a generation running.

**Generation.** Non-stream ``POST /completion`` with token-id prompts and every sampling field
sent explicitly: the sampler chain is exactly ``["temperature", "top_k", "top_p"]`` (plus
llama.cpp's final ``dist``), so ``min_p``, typical-p, penalties, DRY, XTC and mirostat are not
applied whatever their defaults; ``seed`` (``-1`` = random when the request has none),
``cache_prompt: false``, ``return_tokens: true`` (:mod:`~policies.serve.backends.llamacpp_wire`).
Log probs are of the distribution sampled: ``log(prob)`` of the sampled token with
``post_sampling_probs: true`` (the final candidate set, renormalised); at temperature 0 (greedy) the
raw log-softmax, as the reference engine reports. llama.cpp leaves out the probs entry of a token
whose text ends in an incomplete UTF-8 sequence; those entries are aligned by id and each missing
one is filled with one extra 1-token request that reads the raw log-softmax over the whole
vocabulary (the sampled token forced to a single-byte one by ``logit_bias``, which does not touch
the raw logits) and applies temperature → top-k → top-p here. ``stop_token_ids`` are enforced by the
sidecar: the answer is cut after the first stop id (kept, as the reference engine keeps it);
llama.cpp itself also ends on its end-of-generation tokens (``<|im_end|>`` and ``<|endoftext|>``).
``n`` choices are ``n`` requests seeded ``seed + i`` on one slot.

**Limits and errors.** The context length is the engine's (``/props``
``default_generation_settings.n_ctx``); a prompt that does not fit, or a token id outside the
engine's vocabulary, is a :class:`BadRequest` (400) before it reaches the engine. An engine that
errors or dies is :class:`EngineUnavailable` (503); a dead engine is restarted on the live
version's file by the next request. The child is terminated and reaped when the backend
closes (SIGTERM, then SIGKILL) and started under ``setpriv --pdeathsig TERM`` where that exists,
so it does not outlive a killed sidecar; it runs with the exact-serving flags (``EXACT_FLAGS``).
Not covered: streaming, prompt caching, more than one slot.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import structlog

from policies.board import Board
from policies.board.gguf import export_gguf, gguf_name
from policies.errors import BadRequest, EngineError
from policies.serve.backends.base import EngineUnavailable, HttpBackend, Sample, free_port
from policies.serve.backends.llamacpp_wire import (
    EXACT_FLAGS,
    LlamaOptions,
    ServerChild,
    completion_body,
    number,
    sampled_logprob,
)
from policies.serve.backends.shadow import Shadow, Staged
from policies.serve.types import Generation, QuiesceMode
from policies.wire.lane import FinishReason, GenerateRequest

log = structlog.get_logger(__name__)


class LlamaCppBackend(HttpBackend):
    """A sidecar-owned ``llama-server``, restarted on each version's GGUF (module docstring)."""

    kind = "llamacpp"

    def __init__(
        self,
        options: LlamaOptions,
        *,
        base: Mapping[str, bytes],
        workdir: Path,
        model: str,
        max_context: int,
        timeout_s: float = 600.0,
    ) -> None:
        self._api_key = secrets.token_urlsafe(24)  # the child's port is loopback, still guarded
        super().__init__(
            "http://127.0.0.1:0",
            model=model,
            max_context=options.ctx_size or max_context,
            api_key=self._api_key,
            timeout_s=timeout_s,
        )
        self.options = options
        self.base = dict(base)
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.shadow = Shadow("llamacpp")
        self._ctx = options.ctx_size or max_context
        self._child: ServerChild | None = None  # serving the live version
        self._next: ServerChild | None = None  # started on the staged version (prewarm)
        self._staged: tuple[Staged, Path, str | None] | None = None  # + why it cannot start
        self._lock = anyio.Lock()

    @property
    def live_gguf(self) -> Path | None:
        """The island-local file of the version being served."""
        return None if self._child is None else self._child.gguf

    # -- child processes ------------------------------------------------------------------------
    async def _request(self, url: str, path: str, body: dict[str, object] | None = None) -> Any:
        """``HttpBackend.call`` against one child (JSON in and out; errors → 503)."""
        method = "GET" if body is None else "POST"
        try:
            async with self.session.request(method, f"{url}{path}", json=body) as r:
                text = await r.text()
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"llamacpp {path} unreachable: {exc}") from exc
        if r.status >= 400:
            raise EngineUnavailable(f"llamacpp {path} answered {r.status}: {text[:300]}", r.status)
        try:
            return json.loads(text)
        except ValueError:
            raise EngineUnavailable(f"llamacpp {path} answered non-JSON: {text[:300]}") from None

    async def _spawn(self, gguf: Path) -> ServerChild:
        """Start a server on ``gguf`` (a new port) and wait until it is healthy, or raise."""
        port = free_port()
        cmd = [str(self.options.server), "-m", str(gguf), "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "-c", str(self._ctx), *EXACT_FLAGS, "--no-webui"]
        cmd += list(self.options.extra_args)
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # the child gets SIGTERM if the sidecar dies without closing it
            cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]
        logfile = self.workdir / "llama-server.log"
        with logfile.open("ab") as out:
            proc = await anyio.open_process(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env={**os.environ, "LLAMA_API_KEY": self._api_key},
            )
        child = ServerChild(proc, f"http://127.0.0.1:{port}", gguf)
        t0 = anyio.current_time()
        try:
            with anyio.fail_after(self.options.startup_timeout_s):
                # llama-server gives no readiness signal but /health (503 while loading)
                while not await self._healthy(child):
                    if not child.alive:
                        raise EngineUnavailable(
                            f"llama-server exited with {proc.returncode} on {gguf.name}; "
                            f"see {logfile}"
                        )
                    await anyio.sleep(0.01)
            await self._read_limits(child)
        except TimeoutError:
            await self._stop(child)
            raise EngineUnavailable(
                f"llama-server not healthy after {self.options.startup_timeout_s}s "
                f"(--llama-startup-timeout); see {logfile}"
            ) from None
        except BaseException:
            await self._stop(child)
            raise
        log.info(
            "engine_started",
            engine=self.kind,
            gguf=gguf.name,
            pid=proc.pid,
            port=port,
            ready_ms=round((anyio.current_time() - t0) * 1e3, 1),
        )
        return child

    async def _stop(self, child: ServerChild | None) -> None:
        if child is None:
            return
        proc = child.proc
        with anyio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.terminate()
                with anyio.move_on_after(5):
                    await proc.wait()
            if proc.returncode is None:
                log.warning("engine_killed", engine=self.kind, pid=proc.pid)
                proc.kill()
                await proc.wait()
            await proc.aclose()

    async def _healthy(self, child: ServerChild) -> bool:
        try:
            async with self.session.get(
                f"{child.url}/health", timeout=aiohttp.ClientTimeout(total=2)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _read_limits(self, child: ServerChild) -> None:
        props = await self._request(child.url, "/props")
        models = await self._request(child.url, "/v1/models")
        pieces = await self._request(child.url, "/tokenize", {"content": "a"})
        try:
            child.n_ctx = int(props["default_generation_settings"]["n_ctx"])
            child.n_vocab = int(models["data"][0]["meta"]["n_vocab"])
            child.ascii = int(pieces["tokens"][0])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineUnavailable(f"llama-server /props or /v1/models lacks {exc}") from None

    def _serve(self, child: ServerChild) -> None:
        self._child, self.url, self.max_context = child, child.url, child.n_ctx

    async def _running(self) -> ServerChild:
        """The serving child; a dead one is restarted on the live version's file first."""
        async with self._lock:
            child = self._child
            if child is None:
                raise EngineUnavailable("llama-server is not running (no version is live)")
            if not child.alive:
                log.warning(
                    "engine_restarting",
                    engine=self.kind,
                    exit_code=child.proc.returncode,
                    version=self.version,
                )
                await self._stop(child)
                self._serve(await self._spawn(child.gguf))
            assert self._child is not None
            return self._child

    # -- versions -------------------------------------------------------------------------------
    async def stage(self, board: Board, version: int) -> None:
        await self._stop(self._next)  # a server left from a stage that never activated
        self._next, self._staged = None, None
        staged = await anyio.to_thread.run_sync(self.shadow.stage, board, version)
        changed = self.shadow.changed(staged)
        _, view = self.shadow.take(version)
        path = self.workdir / f"v{version:08d}.gguf"
        name = gguf_name(board.run, version)
        try:
            await anyio.to_thread.run_sync(
                lambda: export_gguf(
                    view, self.base, path, matrix_dtype=self.options.matrix_dtype, name=name
                )
            )
        except OSError as exc:
            raise EngineError(f"writing {path} for version {version}: {exc}") from None
        problem = None
        if self.options.prewarm:  # the new server loads while the old one serves
            try:
                self._next = await self._spawn(path)
            except EngineUnavailable as exc:  # raised by apply, so the sidecar counts it
                problem = str(exc)
        self._staged = (staged, path, problem)
        log.info(
            "version_staged",
            engine=self.kind,
            version=version,
            bytes_read=staged.bytes_read,
            changed_tensors=None if changed is None else len(changed),
            gguf_bytes=path.stat().st_size,
            prewarmed=self._next is not None,
        )

    async def activate(self, version: int, mode: QuiesceMode) -> float:
        # a restart ends every generation, so in-flight requests always finish first
        return await super().activate(version, "wait")

    async def apply(self, version: int, mode: QuiesceMode) -> None:
        if self._staged is None or self._staged[0].version != version:
            raise EngineUnavailable(f"version {version} was not staged")
        staged, path, problem = self._staged
        old = self._child
        async with self._lock:
            new, self._next = self._next, None
            if new is None or not new.alive:
                if self.options.prewarm or problem is not None:
                    await self._stop(new)
                    raise EngineUnavailable(
                        f"llama-server did not come up on version {version} "
                        f"({problem or 'it exited'}); version {self.version} keeps serving"
                    )
                await self._stop(old)  # restart in place: half the memory, a longer pause
                try:
                    new = await self._spawn(path)
                except EngineUnavailable as exc:
                    if old is not None:
                        await self._restore(old.gguf)
                    raise EngineUnavailable(
                        f"llama-server did not come up on version {version} ({exc}); "
                        f"serving version {self.version} again"
                    ) from None
            else:
                await self._stop(old)
            self._serve(new)
        self._staged = None
        self.shadow.activated(staged)
        if old is not None and old.gguf != path:
            old.gguf.unlink(missing_ok=True)

    async def _restore(self, gguf: Path) -> None:
        try:
            self._serve(await self._spawn(gguf))
        except EngineUnavailable as exc:  # requests get 503 until a restart succeeds
            log.error("engine_rollback_failed", engine=self.kind, error=str(exc))

    # -- generation -----------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> Generation:
        vocab = None if self._child is None else self._child.n_vocab
        for field, ids in (
            ("prompt_token_ids", req.prompt_token_ids),
            ("stop_token_ids", req.stop_token_ids),
        ):
            bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise BadRequest(f"token id {bad[0]} outside the vocabulary [0, {vocab})", field)
        return await super().generate(req)  # which checks the context length

    async def generate_one(self, req: GenerateRequest, seed: int | None) -> Sample:
        child = await self._running()
        body = completion_body(req, req.prompt_token_ids, req.max_tokens, seed)
        out = await self._request(child.url, "/completion", body)
        try:
            tokens = [int(t) for t in out["tokens"]]
            entries = list(out.get("completion_probabilities") or [])
            stop_type = str(out["stop_type"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineUnavailable(f"llamacpp /completion answer lacks {exc}") from None
        stops = set(req.stop_token_ids)
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), None)
        finish: FinishReason = "stop" if cut is not None or stop_type == "eos" else "length"
        if cut is None and stop_type not in ("eos", "limit"):
            finish = "abort"
        key = "logprob" if req.temperature == 0.0 else "prob"
        logprobs: list[float] = []
        j = 0
        for i, token in enumerate(tokens[:cut]):
            if j < len(entries) and int(entries[j]["id"]) == token:
                value = number(entries[j], key)
                j += 1
                if key == "prob":
                    if value <= 0.0:
                        raise EngineUnavailable(f"llamacpp reported p = 0 for sampled {token}")
                    value = math.log(value)
            else:  # no entry: the token's text ended inside a UTF-8 sequence
                value = await self._fill(child, req, tokens[:i], token)
            logprobs.append(value)
        return Sample(tokens[:cut], logprobs, finish)

    async def _fill(
        self, child: ServerChild, req: GenerateRequest, before: list[int], token: int
    ) -> float:
        """The log prob of ``token`` after ``prompt + before``, from the raw distribution."""
        body = completion_body(req, req.prompt_token_ids + before, 1, 0)
        body.update(
            temperature=0.0,
            n_probs=child.n_vocab,
            post_sampling_probs=False,
            logit_bias=[[child.ascii, 1e4]],
        )
        out = await self._request(child.url, "/completion", body)
        try:
            raw = [-math.inf] * child.n_vocab
            for entry in out["completion_probabilities"][0]["top_logprobs"]:
                raw[int(entry["id"])] = number(entry, "logprob")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineUnavailable(f"llamacpp gave no distribution to fill a gap: {exc}") from None
        return sampled_logprob(raw, token, req.temperature, req.top_k, req.top_p)

    async def aclose(self) -> None:
        child, nxt, self._child, self._next = self._child, self._next, None, None
        await self._stop(nxt)
        await self._stop(child)
        await super().aclose()
