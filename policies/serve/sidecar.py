"""The sidecar: makes an engine version-aware by reconciling it with the board.

It watches the board pointer (every ``poll_interval_s``, or at once when notified through
``POST /v1/policy/notify``; a missed notification only delays convergence), then for a newer
version: **stage** (fetch and verify checksums while the engine keeps serving) → **activate**
(the backend applies it at a decode-step boundary) → report. The engine is reached through a
:class:`~policies.serve.types.Backend`: :class:`~policies.serve.backends.reference.ReferenceBackend`
wraps the reference engine (weights copied into the live tensors in place);
``policies.serve.backends`` also holds the vLLM, SGLang and frozen-OpenAI backends.

Activation modes (``activation``): ``"wait"`` (default) stops admitting new requests, lets
in-flight generations finish, applies, resumes; ``"pause"`` holds in-flight generations at the
next step boundary, applies, and resumes them on the new weights — their responses then report
``policy_version.start != end``.

Guarantees:

- ``applied_version`` is never reported before the backend has activated that version;
- a request whose ``policy_version`` bounds exclude the version applied when it *joins the
  engine* gets :class:`~policies.serve.types.VersionNotServed` (the server answers 409 with
  ``Retry-After``); it is never served;
- every response carries the versions applied at its start and its end;
- a version that fails verification is never activated: the old one keeps serving, the failure is
  logged and counted, and the sidecar moves on to the next newer version when one appears; a
  island serving nothing yet starts on the newest version that verifies (each newer one it
  skips is logged as ``version_skipped`` with the reason) and keeps following the board; an
  activation the engine fails (e.g. an external engine briefly unreachable) is logged, counted
  and retried with exponential backoff (``poll_interval_s`` × 2^n, at most 60 s), the old version
  serving meanwhile (state ``failed`` while none is); a version the pointer names but that cannot be
  read or reached (missing manifest, no route) is not refused: it is tried again at the next
  reconcile;
- board URLs are logged with their credentials (``user:password@``, query strings) removed.

Streaming: when the board is streaming a version from the one served (``Board.stream``, read with
the pointer at every reconcile: ``Board.latest_and_stream``), the sidecar stages it at once: chunks
are fetched and applied to the shadow as the publisher writes them, each tensor verified as soon as
it is whole, so activation waits only for the last chunk and the commit; a stream that is abandoned
(publisher died or restarted) leaves the shadow to be rebuilt and the old version serving
(``policies.board.stream``).

Catch-up: the sidecar always targets the newest version; the board plans the route (squashed
patches when far behind, an anchor when too far) and the backend applies it to a CPU
shadow of the served view, falling back to the nearest anchor when a patch fails; a patch file
that failed verification is never planned again by this sidecar (a damaged, truncated or
misplaced patch is routed around through squashed patches or a later anchor).

LoRA versions (``trainer.lora``): an engine that holds several adapters at once
(:class:`~policies.serve.types.MultiVersion`: the reference engine, :mod:`policies.serve.adapters`,
and vLLM, ``backends.vllm_lora``) serves a request at the newest resident version its bounds
admit, so one island is a mixed-version fleet; the 409 then says no resident version fits.
``applied_version`` is the newest one activated.

Not covered: more than one staged version at a time (a newer version published while one is
being staged is picked up by the next reconcile).
"""

from __future__ import annotations

import anyio
import structlog
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry

from policies.board import Board
from policies.board.store import redact
from policies.errors import (
    BoardError,
    BoardFormatError,
    EngineError,
    PatchError,
    PolicyError,
    VersionCorrupt,
)
from policies.serve.backends.reference import ReferenceBackend
from policies.serve.engine import Engine
from policies.serve.sidecar_metrics import SidecarMetrics
from policies.serve.types import (
    Backend,
    Generation,
    MultiVersion,
    OutOfBounds,
    QuiesceMode,
    VersionNotServed,
)
from policies.wire.lane import (
    GenerateRequest,
    GenerateResponse,
    PolicyState,
    SidecarState,
    Usage,
    VersionStamp,
)

log = structlog.get_logger(__name__)


class Sidecar:
    """One engine made version-aware (module docstring): :meth:`run` follows the board and
    stages → activates versions through the backend; :meth:`generate` serves a request inside
    its bounds and stamps it; :meth:`policy_state` is ``GET /v1/policy``. ``fixed_version``
    serves one declared version and never polls."""

    def __init__(
        self,
        backend: Backend | Engine,
        board: Board,
        *,
        poll_interval_s: float,
        registry: CollectorRegistry,
        activation: QuiesceMode = "wait",
        fixed_version: int | None = None,
    ) -> None:
        self.backend: Backend = (
            ReferenceBackend(backend) if isinstance(backend, Engine) else backend
        )
        self.board = board
        self.poll_interval_s = poll_interval_s
        self.activation: QuiesceMode = activation
        self.applied_version: int | None = fixed_version
        self.fixed = fixed_version is not None
        self.staged_version: int | None = None
        self.state: SidecarState = "serving" if self.fixed else "starting"
        self.metrics = SidecarMetrics(registry)
        if fixed_version is not None:
            self.metrics.applied.set(fixed_version)
        self._wake = anyio.Event()
        self._refused: set[int] = set()
        self._failed_activations = 0  # in a row: the retry backoff doubles with each
        self._retry_at = 0.0

    # -- reconcile ------------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Reconcile forever; ``started`` once a version is applied (at once when fixed)."""
        if self.fixed:
            task_status.started()
            await anyio.sleep_forever()
        started = False
        while True:
            await self.reconcile()
            if not started and self.applied_version is not None:
                task_status.started()
                started = True
            with anyio.move_on_after(self.poll_interval_s):
                await self._wake.wait()
            self._wake = anyio.Event()

    def notify(self) -> None:
        """Check the board now rather than at the next poll."""
        self._wake.set()

    async def reconcile(self) -> None:
        """Bring the engine to the board's newest good version, if it is not there yet."""
        if self.fixed:
            return
        try:
            await self.backend.recover()
        except PolicyError as exc:
            log.warning("engine_unavailable", error=redact(str(exc)), serving=self.applied_version)
            return
        try:  # the stream asked for with the pointer: one round trip to a distant board
            target, stream = await anyio.to_thread.run_sync(self.board.latest_and_stream)
        except BoardError as exc:
            log.warning("board_unreadable", error=redact(str(exc)))
            return
        applied = self.applied_version
        if applied is not None and (target is None or target <= applied):
            # nothing newer is published: stage a version being streamed from the one served,
            # chunk by chunk as it lands (it is activated only once published and verified)
            if stream is None or stream.version <= applied or applied not in stream.bases:
                return
            target = stream.version
        if target is None:
            return
        if applied is not None and (target <= applied or target in self._refused):
            return
        if anyio.current_time() < self._retry_at:  # backing off after a failed activation
            return
        before = self.board.store.bytes_read
        target = await self._stage_newest_good(target)
        if target is None:
            return
        bytes_read = self.board.store.bytes_read - before
        self.metrics.board_bytes.inc(bytes_read)
        self.state = "activating"
        try:
            pause = await self.backend.activate(target, self.activation)
        except PolicyError as exc:
            # The engine did not switch (it may be briefly unreachable): keep serving the old
            # version and try again at the next reconcile.
            self.metrics.failures.inc()
            self.metrics.activation_failures.inc()
            self._failed_activations += 1
            backoff = min(60.0, self.poll_interval_s * 2**self._failed_activations)
            self._retry_at = anyio.current_time() + backoff
            log.error(
                "activation_failed",
                version=target,
                error=redact(str(exc)),
                serving=self.applied_version,
                retry_in_s=round(backoff, 2),
            )
            self.staged_version = None
            self.state = "serving" if self.applied_version is not None else "failed"
            return
        self._failed_activations = 0
        self.applied_version = target
        self.staged_version = None
        self.state = "serving"
        self.metrics.pause.observe(pause)
        self.metrics.activations.inc()
        self.metrics.applied.set(target)
        log.info(
            "version_activated",
            version=target,
            digest=self._digest(target),
            pause_ms=round(pause * 1e3, 2),
            mode=self.activation,
            board_bytes_read=bytes_read,
        )

    async def _stage_newest_good(self, target: int) -> int | None:
        """Stage ``target``; an island serving nothing yet falls back to the newest older version
        that stages (each one skipped is logged as ``version_skipped`` with why), so a damaged
        newest version never keeps it from serving. The version staged, or None."""
        candidates = [target]
        if self.applied_version is None:
            candidates += reversed(await anyio.to_thread.run_sync(self._published_below, target))
        candidates = [v for v in candidates if v not in self._refused]
        for i, version in enumerate(candidates):
            error = await self._stage(version)
            if error is None:
                return version
            if self.applied_version is None and i + 1 < len(candidates):
                log.warning(
                    "version_skipped",
                    version=version,
                    error=error,
                    trying=candidates[i + 1],
                )
        return None

    def _published_below(self, target: int) -> list[int]:
        try:
            return [v for v in self.board.versions() if v < target]
        except BoardError as exc:
            log.warning("board_unreadable", error=redact(str(exc)))
            return []

    async def _stage(self, version: int) -> str | None:
        """Stage ``version``; None when staged, else why not (a version that failed
        verification is refused for good; one not reachable yet is tried again later)."""
        self.state = "staging" if self.applied_version is not None else "catching_up"
        self.staged_version = version
        try:
            await self.backend.stage(self.board, version)
        except PolicyError as exc:
            error = redact(str(exc))
            self.staged_version = None
            self.state = "serving" if self.applied_version is not None else "starting"
            if not isinstance(exc, (VersionCorrupt, PatchError, BoardFormatError)):
                # not on the board (yet), or no route to it: nothing failed verification, so
                # it is tried again at the next reconcile rather than refused for good
                log.warning("version_unavailable", version=version, error=error)
                return error
            self._refused.add(version)
            self.metrics.failures.inc()
            log.error("version_refused", version=version, error=error, serving=self.applied_version)
            return error
        return None

    def _digest(self, version: int) -> str | None:
        """The board's digest of ``version`` (what the activated view was verified against)."""
        try:
            return self.board.manifest(version).digest
        except BoardError:
            return None

    # -- serving --------------------------------------------------------------------------------
    def _resident(self) -> list[int]:
        """The versions the engine serves at once (LoRA adapters); empty for one full version."""
        backend = self.backend
        return backend.resident_versions() if isinstance(backend, MultiVersion) else []

    def _conflict(self, req: GenerateRequest, applied: int | None) -> VersionNotServed:
        self.metrics.conflicts.inc()
        staged = self.staged_version
        resident = self._resident()
        served = (
            f"no resident adapter version ({', '.join(map(str, resident))}) is"
            if resident
            else f"applied version {applied} is"
        )
        return VersionNotServed(
            f"{served} outside the requested bounds "
            f"[{req.policy_version.min}, {req.policy_version.max}]",
            applied,
            staged,
            staged is not None and req.policy_version.admits(staged),
        )

    async def run_request(self, req: GenerateRequest) -> Generation:
        """Serve ``req`` at a version inside its bounds; the generation carries its stamps."""
        applied = self.applied_version
        admits = req.policy_version.admits
        if applied is None or not (admits(applied) or any(map(admits, self._resident()))):
            raise self._conflict(req, applied)
        try:
            gen = await self.backend.generate(req)
        except OutOfBounds as exc:  # an activation landed while the request queued
            raise self._conflict(req, exc.version) from None
        self.metrics.tokens.inc(sum(len(c.token_ids) for c in gen.choices))
        self.metrics.stamp_mismatches.inc(gen.stamp_mismatches)
        return gen

    async def generate(self, req: GenerateRequest, request_id: str) -> GenerateResponse:
        """Serve ``POST /v1/generate``."""
        gen = await self.run_request(req)
        start, end = stamps(gen, self.applied_version)
        completion = sum(len(c.token_ids) for c in gen.choices)
        return GenerateResponse(
            id=request_id,
            model=self.board.run,
            prompt_token_ids=req.prompt_token_ids,
            choices=gen.choices,
            policy_version=VersionStamp(start=start, end=end),
            usage=Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=completion),
        )

    def policy_state(self) -> PolicyState:
        return PolicyState(
            applied_version=self.applied_version,
            staged_version=self.staged_version,
            state=self.state,
            run=self.board.run,
            max_context=self.backend.max_context,
        )


def stamps(gen: Generation, applied: int | None) -> tuple[int, int]:
    start = gen.start if gen.start is not None else applied
    end = gen.end if gen.end is not None else start
    if start is None or end is None:
        raise EngineError("generation finished without a version")
    return start, end
