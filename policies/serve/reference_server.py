"""The reference engine on the lane: serving a board's versions, or a model directory as version 0.

:func:`serve_board` waits for the board's first version, builds the reference engine from the
run's base files in the served dtype of the newest version whose manifest reads (float32 for a
quantized view, whose live weights are ``dequantize``'s), and serves it through a
:class:`~policies.serve.sidecar.Sidecar` that follows the board; a run of LoRA versions needs the
base model they adapt. :func:`serve_model` serves a plain HF model directory as the fixed version
0, with no board to follow. Both bind the lane with :func:`~policies.serve.server.run_lane` and
register the engine's batch gauges (:func:`engine_registry`) beside the sidecar's metrics.

Guarantees: nothing is served before the engine holds a version (``task_status.started`` comes
with the bound port once it does); a pointer that is missing or malformed at start is waited out
(logged as ``board_unreadable``), never an error; a LoRA version without ``base_model`` and a
model directory without weights are an :class:`~policies.errors.EngineError` naming what to give.
"""

from __future__ import annotations

import re
import ssl
import tempfile
from pathlib import Path

import anyio
import structlog
import torch
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry, Gauge
from safetensors.torch import load_file

from policies.board import Board
from policies.codec.views import quantized_kind
from policies.errors import BoardError, EngineError
from policies.serve.adapters import is_lora_version
from policies.serve.backends.reference import ReferenceBackend
from policies.serve.connections import LaneLimits
from policies.serve.engine import Engine
from policies.serve.server import run_lane
from policies.serve.sidecar import Sidecar
from policies.serve.types import QuiesceMode

log = structlog.get_logger(__name__)


async def serve_board(
    board_url: str,
    run: str,
    *,
    host: str,
    port: int,
    device: str,
    token: str | None,
    poll_interval_s: float,
    activation: QuiesceMode = "wait",
    tls: ssl.SSLContext | None = None,
    limits: LaneLimits | None = None,
    base_model: Path | None = None,
    max_adapters: int = 4,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the board's newest version until cancelled; ``started`` with the bound port.

    A run of LoRA versions (``trainer.lora``) needs ``base_model``, the model directory whose
    weights its adapters adapt; the engine keeps ``max_adapters`` of them resident."""
    board = Board(board_url, run)
    with tempfile.TemporaryDirectory(prefix="sprawl-engine-") as tmp:
        model_dir = Path(tmp) / run
        model_dir.mkdir()
        latest = await _wait_for_board(board)
        base = await anyio.to_thread.run_sync(board.base_files)  # every version must record them
        for name, data in base.items():
            (model_dir / name).write_bytes(data)
        dtype = await anyio.to_thread.run_sync(_served_dtype, board, latest)
        if base_model is None and await anyio.to_thread.run_sync(is_lora_version, board, latest):
            raise EngineError(
                f"version {latest} of run {run!r} is a LoRA version (an adapter, "
                "trainer.lora): serve it with --base-model DIR, the model it adapts"
            )
        engine = await anyio.to_thread.run_sync(
            lambda: Engine(
                model_dir,
                device=device,
                dtype=dtype,
                base_weights=base_model,
                max_adapters=max_adapters,
            )
        )
        registry = engine_registry(engine)
        sidecar = Sidecar(
            ReferenceBackend(engine),
            board,
            poll_interval_s=poll_interval_s,
            registry=registry,
            activation=activation,
        )
        await run_lane(
            sidecar,
            host=host,
            port=port,
            token=token,
            registry=registry,
            tokenizer=engine.tokenizer,
            tls=tls,
            limits=limits,
            task_status=task_status,
        )


async def serve_model(
    model_dir: Path,
    *,
    host: str,
    port: int,
    device: str,
    token: str | None,
    tls: ssl.SSLContext | None = None,
    limits: LaneLimits | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a plain HF model dir as the fixed version 0 (no board) until cancelled.

    The weights (every ``*.safetensors`` in the dir, in their stored dtype) are copied into the
    engine once; the sidecar is in fixed-version mode, so it never polls, every response is
    stamped 0 and bounds excluding 0 get 409. Its board is an empty private directory that is
    never read; it only names the run in ``/v1/models`` and responses: the dir's name, with
    what a run name cannot hold (:func:`policies.board.types.check_run_name`) replaced by ``-``.
    """

    def load() -> Engine:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise EngineError(f"{model_dir} holds no *.safetensors weights")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(f))
        floats = {t.dtype for t in weights.values() if t.is_floating_point()}
        dtype = floats.pop() if len(floats) == 1 else torch.float32
        engine = Engine(model_dir, device=device, dtype=dtype)
        engine.activate(weights, version=0)
        return engine

    engine = await anyio.to_thread.run_sync(load)
    with tempfile.TemporaryDirectory(prefix="sprawl-fixed-") as tmp:
        registry = engine_registry(engine)
        sidecar = Sidecar(
            ReferenceBackend(engine),
            Board(tmp, _run_name_of(model_dir)),
            poll_interval_s=3600.0,
            registry=registry,
            fixed_version=0,
        )
        await run_lane(
            sidecar,
            host=host,
            port=port,
            token=token,
            registry=registry,
            tokenizer=engine.tokenizer,
            tls=tls,
            limits=limits,
            task_status=task_status,
        )


def engine_registry(engine: Engine) -> CollectorRegistry:
    """A metrics registry holding the reference engine's batch gauges."""
    registry = CollectorRegistry()
    rows = Gauge(
        "sprawl_engine_active_rows",
        "Sequences decoding in the batch (one per choice of each running request)",
        registry=registry,
    )
    rows.set_function(lambda: engine.batcher.active_rows)
    queued = Gauge(
        "sprawl_engine_queued_requests", "Requests waiting to join the batch", registry=registry
    )
    queued.set_function(lambda: engine.batcher.queued)
    return registry


def _run_name_of(model_dir: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", model_dir.resolve().name)
    name = re.sub(r"\.{2,}", ".", name).lstrip("._-")[:128]
    return name or "model"


async def _wait_for_board(board: Board) -> int:
    """The pointer's version, once there is one (a malformed pointer is logged and waited out:
    the next publish repairs it)."""
    while True:
        try:
            latest = await anyio.to_thread.run_sync(board.latest)
        except BoardError as exc:
            log.warning("board_unreadable", error=str(exc))
            latest = None
        if latest is not None:
            return latest
        await anyio.sleep(0.2)


def _served_dtype(board: Board, latest: int) -> torch.dtype:
    """The engine's dtype: that of the newest version whose manifest reads (the sidecar starts
    on the newest version that verifies, at or below ``latest``); float32 for a quantized view,
    so the live weights are ``dequantize``'s fp32 weights, bit for bit."""
    dtypes: set[str] = set()
    for version in reversed(board.versions()):
        if version > latest:
            continue
        try:
            manifest = board.manifest(version)
        except BoardError:
            continue
        if quantized_kind(manifest.view) is not None:
            return torch.float32
        dtypes = {e.dtype for e in manifest.tensors.values()}
        break
    floats = [d for d in dtypes if d in ("bfloat16", "float16", "float32")]
    return getattr(torch, floats[0]) if len(floats) == 1 else torch.float32
