"""The sidecar: makes an engine version-aware by reconciling it with the board.

It watches the board pointer (every ``poll_interval_s``, or at once when notified through
``POST /v1/policy/notify``; a missed notification only delays convergence), then for a newer
version: fetch → verify checksums → stage → activate. Activation takes the engine lock, so new
requests queue behind it and in-flight generations finish first; then it copies the view into
the live tensors and only then reports the new version.

Guarantees:

- ``applied_version`` is never reported before the engine has activated that version;
- a request whose ``policy_version`` bounds exclude the applied version gets
  :class:`VersionNotServed` (the server answers 409 with ``Retry-After``); it is never served;
- every response carries the versions applied at its start and its end;
- a version that fails verification is never activated: the old one keeps serving, the failure is
  logged and counted, and the sidecar moves on to the next newer version when one appears.

Not covered yet: sparse patches (versions are loaded whole), pausing in-flight generations
mid-sequence, squashed catch-up.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from policies.board import Board
from policies.engine import Engine
from policies.errors import BoardError, EngineError
from policies.lane import (
    GenerateRequest,
    GenerateResponse,
    PolicyState,
    SidecarState,
    Usage,
    VersionStamp,
)

log = structlog.get_logger(__name__)


class VersionNotServed(EngineError):
    """No version inside the request's bounds is applied (answered as 409)."""

    def __init__(self, message: str, applied: int | None, staged: int | None, catching_up: bool):
        super().__init__(message)
        self.applied = applied
        self.staged = staged
        self.catching_up = catching_up


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.applied = Gauge(
            "sprawl_applied_version", "Policy version being served", registry=registry
        )
        self.activations = Counter(
            "sprawl_version_activations", "Versions activated", registry=registry
        )
        self.failures = Counter(
            "sprawl_version_failures", "Versions refused by verification", registry=registry
        )
        self.pause = Histogram(
            "sprawl_activation_pause_seconds",
            "Time new requests were held while a version was applied",
            registry=registry,
        )
        self.conflicts = Counter(
            "sprawl_version_conflicts", "Requests answered 409", registry=registry
        )
        self.tokens = Counter("sprawl_generated_tokens", "Tokens sampled", registry=registry)


class Sidecar:
    def __init__(
        self, engine: Engine, board: Board, *, poll_interval_s: float, registry: CollectorRegistry
    ) -> None:
        self.engine = engine
        self.board = board
        self.poll_interval_s = poll_interval_s
        self.applied_version: int | None = None
        self.staged_version: int | None = None
        self.state: SidecarState = "starting"
        self.metrics = SidecarMetrics(registry)
        self._lock = anyio.Lock()
        self._wake = anyio.Event()
        self._refused: set[int] = set()

    # -- reconcile ------------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Reconcile forever; ``started`` once the first version is applied."""
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
        try:
            target = await anyio.to_thread.run_sync(self.board.latest)
        except BoardError as exc:
            log.warning("board_unreadable", error=str(exc))
            return
        if target is None or target in self._refused:
            return
        if self.applied_version is not None and target <= self.applied_version:
            return
        self.state = "staging" if self.applied_version is not None else "catching_up"
        self.staged_version = target
        try:
            _, view = await anyio.to_thread.run_sync(self.board.load, target)
        except BoardError as exc:
            self._refused.add(target)
            self.metrics.failures.inc()
            log.error(
                "version_refused", version=target, error=str(exc), serving=self.applied_version
            )
            self.staged_version = None
            self.state = "serving" if self.applied_version is not None else "starting"
            return
        self.state = "activating"
        t0 = time.perf_counter()
        async with self._lock:
            await anyio.to_thread.run_sync(self.engine.activate, view)
            self.applied_version = target
        pause = time.perf_counter() - t0
        self.staged_version = None
        self.state = "serving"
        self.metrics.pause.observe(pause)
        self.metrics.activations.inc()
        self.metrics.applied.set(target)
        log.info("version_activated", version=target, pause_ms=round(pause * 1e3, 2))

    # -- serving --------------------------------------------------------------------------------
    def _check(self, req: GenerateRequest) -> int:
        applied = self.applied_version
        if applied is not None and req.policy_version.admits(applied):
            return applied
        self.metrics.conflicts.inc()
        latest = self.staged_version
        catching_up = latest is not None and req.policy_version.admits(latest)
        raise VersionNotServed(
            f"applied version {applied} is outside the requested bounds "
            f"[{req.policy_version.min}, {req.policy_version.max}]",
            applied,
            self.staged_version,
            catching_up,
        )

    async def generate(self, req: GenerateRequest, request_id: str) -> GenerateResponse:
        """Serve ``req`` at a version inside its bounds, stamped with the versions used."""
        self._check(req)
        async with self._lock:
            start = self._check(req)  # an activation may have landed while we queued
            choices = await anyio.to_thread.run_sync(self.engine.generate, req)
            end = self.applied_version
        assert end is not None
        completion = sum(len(c.token_ids) for c in choices)
        self.metrics.tokens.inc(completion)
        return GenerateResponse(
            id=request_id,
            model=self.board.run,
            prompt_token_ids=req.prompt_token_ids,
            choices=choices,
            policy_version=VersionStamp(start=start, end=end),
            usage=Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=completion),
        )

    def policy_state(self) -> PolicyState:
        return PolicyState(
            applied_version=self.applied_version,
            staged_version=self.staged_version,
            state=self.state,
            run=self.board.run,
        )

    def describe(self) -> dict[str, Any]:
        return self.policy_state().model_dump()
