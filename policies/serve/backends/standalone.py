"""``orchestrate sidecar``: the lane in front of an external engine (vLLM, SGLang, OpenAI API).

    orchestrate sidecar --engine-url URL --engine-kind vllm|sglang|openai --board URL
        [--run NAME] [--port P] [--host H] [--token T] [--engine-api-key K]
        [--activation wait|pause] [--vllm-update inplace|reload] [--kv-on-update recompute|keep]
        [--sglang-update inplace|disk]
        [--materialize-dir DIR]
        [--version N] [--model NAME]
        [--tls-cert PEM --tls-key PEM] [--parent-stdin]
        [--header-timeout S] [--idle-timeout S] [--body-timeout S] [--max-connections N]
    orchestrate sidecar --engine-kind llamacpp --board URL [--llama-server PATH]
        [--llama-ctx N] [--llama-arg ARG ...] [--llama-startup-timeout S] [--llama-restart]

``--engine-kind llamacpp`` starts and owns its own ``llama-server`` (no ``--engine-url``;
``scripts/build-llama-server.sh`` builds the binary it finds by default) and restarts it on each
version's GGUF, written under ``--materialize-dir``.

SIGINT / SIGTERM stop it cleanly (its ``llama-server`` reaped); ``--parent-stdin`` also stops it
when its stdin closes, which is how the local fleet keeps islands from outliving the
orchestrator.

The board's ``base/`` files give the tokenizer (for ``/v1/chat/completions`` and
``/v1/completions``) and the context length. ``--token`` (default ``$SPRAWL_TOKEN``) guards the
sidecar's routes; ``--engine-api-key`` (default ``$SPRAWL_ENGINE_API_KEY``) is sent to the
engine. The board URL is logged with its credentials removed. A lane client that disconnects
cancels its engine request (the sidecar closes that connection; vLLM, SGLang and llama.cpp abort
a request whose connection closes). The connection limits (``--header-timeout`` …) are
:class:`~policies.serve.connections.LaneLimits`.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import tempfile
from pathlib import Path
from typing import get_args

import anyio
import structlog
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from policies.board import Board
from policies.board.store import redact
from policies.errors import BoardError
from policies.serve.adapters import is_lora_version
from policies.serve.backends.base import HttpBackend
from policies.serve.backends.llamacpp import LlamaCppBackend
from policies.serve.backends.llamacpp_wire import LlamaOptions
from policies.serve.backends.openai import OpenAIBackend
from policies.serve.backends.sglang import SGLangBackend, SGLangUpdate
from policies.serve.backends.sglang_inplace import SGLangInplaceBackend
from policies.serve.backends.shadow import check_view
from policies.serve.backends.vllm import KVOnUpdate, VLLMBackend
from policies.serve.backends.vllm_inplace import VLLMInplaceBackend
from policies.serve.backends.vllm_launch import VLLMUpdate
from policies.serve.backends.vllm_lora import VLLMLoraBackend
from policies.serve.connections import LaneLimits, add_limit_flags, limits_from
from policies.serve.server import run_lane, tls_context
from policies.serve.sidecar import Sidecar
from policies.serve.types import QuiesceMode
from policies.wire.lifetime import cancel_on_signal, stdin_closed

log = structlog.get_logger(__name__)
KINDS = ("vllm", "sglang", "openai", "llamacpp")


def _load_base(board: Board, into: Path) -> tuple[PreTrainedTokenizerBase | None, int]:
    # every version the sidecar stages from here on must record these base files
    for name, data in board.base_files().items():
        (into / name).write_bytes(data)
    config = into / "config.json"
    max_context = 4096
    if config.exists():
        max_context = int(json.loads(config.read_text()).get("max_position_embeddings", 4096))
    tokenizer = None
    if (into / "tokenizer_config.json").exists() or (into / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(into)
    return tokenizer, max_context


def _check_latest_view(board: Board, engine_kind: str) -> None:
    """Refuse at startup a board whose newest version this engine kind cannot serve."""
    latest = board.latest()
    if latest is not None:
        check_view(engine_kind, board.manifest(latest))


def make_backend(
    kind: str,
    engine_url: str,
    *,
    board: Board,
    model: str,
    max_context: int,
    api_key: str | None,
    materialize_dir: Path,
    version: int | None,
    tokenizer: PreTrainedTokenizerBase | None,
    llama: LlamaOptions | None = None,
    base_dir: Path | None = None,
    max_adapters: int | None = None,
    vllm_update: VLLMUpdate = "inplace",
    kv_on_update: KVOnUpdate = "recompute",
    sglang_update: SGLangUpdate = "inplace",
) -> HttpBackend:
    """The backend of ``kind``; ``max_adapters`` set: the board holds LoRA versions (vLLM only),
    that many resident."""
    if max_adapters is not None and kind != "vllm":
        raise BoardError(
            f"run {board.run!r} publishes LoRA versions (trainer.lora); of the sidecar's engine "
            f"kinds only vllm serves them, not {kind}"
        )
    if kind == "llamacpp":
        if llama is None or base_dir is None:
            raise BoardError("--engine-kind llamacpp needs its llama-server options")
        from policies.board.gguf import base_files

        return LlamaCppBackend(
            llama,
            base=base_files(base_dir),
            workdir=materialize_dir,
            model=model,
            max_context=max_context,
        )
    common = {"model": model, "max_context": max_context, "api_key": api_key}
    if kind == "sglang":
        if kv_on_update == "keep":
            raise BoardError(
                "--kv-on-update keep is vLLM's: SGLang cannot flush its prefix cache while "
                "requests keep their KV in place, so new requests would reuse the old version's "
                "(SGLang pauses with retract: recompute)"
            )
        sglang = SGLangInplaceBackend if sglang_update == "inplace" else SGLangBackend
        return sglang(engine_url, materialize_dir=materialize_dir, **common)
    if kind == "vllm" and max_adapters is not None:
        return VLLMLoraBackend(
            engine_url, work_dir=materialize_dir, max_adapters=max_adapters, **common
        )
    if kind == "vllm":
        cls = VLLMInplaceBackend if vllm_update == "inplace" else VLLMBackend
        return cls(engine_url, work_dir=materialize_dir, kv_on_update=kv_on_update, **common)
    if kind == "openai":
        if version is None:
            raise BoardError("--engine-kind openai needs --version (the version it serves)")
        return OpenAIBackend(engine_url, version=version, tokenizer=tokenizer, **common)
    raise BoardError(f"unknown engine kind {kind!r}; one of {', '.join(KINDS)}")


async def serve_sidecar(
    *,
    engine_url: str,
    engine_kind: str,
    board_url: str,
    run: str,
    host: str,
    port: int,
    token: str | None,
    api_key: str | None = None,
    activation: QuiesceMode = "wait",
    poll_interval_s: float = 1.0,
    materialize_dir: Path | None = None,
    version: int | None = None,
    model: str | None = None,
    tls: ssl.SSLContext | None = None,
    llama: LlamaOptions | None = None,
    limits: LaneLimits | None = None,
    max_adapters: int = 4,
    vllm_update: VLLMUpdate = "inplace",
    kv_on_update: KVOnUpdate = "recompute",
    sglang_update: SGLangUpdate = "inplace",
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the sidecar until cancelled; ``started`` with the bound port. A board of LoRA
    versions is served through the engine's adapters, ``max_adapters`` resident (vLLM)."""
    board = Board(board_url, run)
    log.info("sidecar_starting", engine=engine_kind, board=redact(board_url), run=run)
    with tempfile.TemporaryDirectory(prefix="sprawl-sidecar-") as tmp:
        tokenizer, max_context = await anyio.to_thread.run_sync(_load_base, board, Path(tmp))
        if engine_kind != "openai":  # a frozen OpenAI engine serves no board weights
            await anyio.to_thread.run_sync(_check_latest_view, board, engine_kind)
        latest = await anyio.to_thread.run_sync(board.latest)
        lora = latest is not None and await anyio.to_thread.run_sync(is_lora_version, board, latest)
        backend = make_backend(
            engine_kind,
            engine_url,
            board=board,
            model=model or run,
            max_context=max_context,
            api_key=api_key,
            materialize_dir=materialize_dir or Path(tmp) / "versions",
            version=version,
            tokenizer=tokenizer,
            llama=llama,
            base_dir=Path(tmp),
            max_adapters=max_adapters if lora else None,
            vllm_update=vllm_update,
            kv_on_update=kv_on_update,
            sglang_update=sglang_update,
        )
        try:
            await backend.connect()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await backend.aclose()  # run_lane closes it from here on
            raise
        registry = CollectorRegistry()
        sidecar = Sidecar(
            backend,
            board,
            poll_interval_s=poll_interval_s,
            registry=registry,
            activation=activation,
            fixed_version=version if engine_kind == "openai" else None,
        )
        await run_lane(
            sidecar,
            host=host,
            port=port,
            token=token,
            registry=registry,
            tokenizer=tokenizer,
            tls=tls,
            wait_for_version=False,
            limits=limits,
            task_status=task_status,
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orchestrate sidecar", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", default="", help="the engine (all kinds but llamacpp)")
    p.add_argument("--engine-kind", choices=KINDS, required=True)
    p.add_argument("--board", required=True, help="board URL (fsspec) or path")
    p.add_argument("--run", default="demo")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--token", default=os.environ.get("SPRAWL_TOKEN"))
    p.add_argument("--engine-api-key", default=os.environ.get("SPRAWL_ENGINE_API_KEY"))
    p.add_argument("--activation", choices=["wait", "pause"], default="wait")
    p.add_argument(
        "--vllm-update",
        choices=get_args(VLLMUpdate),
        default="inplace",
        help="vllm: the engine patch through vLLM's weight-transfer API (the engine started with "
        '--weight-transfer-config \'{"backend": "sprawl"}\'), or the whole view reloaded',
    )
    p.add_argument(
        "--kv-on-update",
        choices=get_args(KVOnUpdate),
        default="recompute",
        help="vllm, --activation pause: the running requests' KV recomputed under the new "
        "version (exact), or kept (faster; their later tokens come from stale KV); sglang: "
        "recompute only",
    )
    p.add_argument(
        "--sglang-update",
        choices=get_args(SGLangUpdate),
        default="inplace",
        help="sglang: the engine patch through update_weights_from_tensor and sprawl's loader "
        "(the engine started with --custom-weight-loader "
        "policies.serve.backends.sglang_loader.apply_engine_patch), or the changed tensors "
        "through --materialize-dir and update_weights_from_disk",
    )
    p.add_argument("--poll-interval", type=float, default=1.0)
    p.add_argument(
        "--materialize-dir",
        type=Path,
        help="island-local directory the engine reads staged versions from (vLLM, SGLang)",
    )
    p.add_argument("--version", type=int, help="the fixed version an openai endpoint serves")
    p.add_argument("--model", help="model name the engine serves (default: the run name)")
    p.add_argument(
        "--max-adapters",
        type=int,
        default=4,
        help="LoRA versions resident at once (vLLM started with --enable-lora)",
    )
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--log-format", choices=["auto", "pretty", "json"], default="auto")
    p.add_argument(
        "--parent-stdin",
        action="store_true",
        help="exit when stdin closes (used by the local fleet)",
    )
    p.add_argument("--llama-server", type=Path, help="llama-server binary (default: cached build)")
    p.add_argument("--llama-ctx", type=int, help="llama-server -c (default: the model's context)")
    p.add_argument(
        "--llama-arg", action="append", default=[], help="extra llama-server argument (repeat)"
    )
    p.add_argument("--llama-startup-timeout", type=float, default=60.0)
    p.add_argument(
        "--llama-restart",
        action="store_true",
        help="stop the old llama-server before starting the new version's (half the memory)",
    )
    add_limit_flags(p)
    return p


def main(argv: list[str]) -> int:
    from policies.wire.logs import configure

    parser = build_parser()
    args = parser.parse_args(argv)
    limits = limits_from(parser, args)
    configure(args.log_format)
    if (args.tls_cert is None) != (args.tls_key is None):
        sys.stderr.write("orchestrate sidecar: --tls-cert and --tls-key go together\n")
        return 2
    tls = tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    llama = None
    if args.engine_kind == "llamacpp":
        if args.engine_url:
            sys.stderr.write(
                "orchestrate sidecar: llamacpp starts its own engine; no --engine-url\n"
            )
            return 2
        from policies.serve.backends.llamacpp_wire import find_llama_server

        llama = LlamaOptions(
            server=find_llama_server(args.llama_server),
            ctx_size=args.llama_ctx,
            extra_args=tuple(args.llama_arg),
            startup_timeout_s=args.llama_startup_timeout,
            prewarm=not args.llama_restart,
        )
    elif not args.engine_url:
        sys.stderr.write(
            f"orchestrate sidecar: --engine-kind {args.engine_kind} needs --engine-url\n"
        )
        return 2

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            bound = await tg.start(
                lambda task_status: serve_sidecar(
                    engine_url=args.engine_url,
                    engine_kind=args.engine_kind,
                    board_url=args.board,
                    run=args.run,
                    host=args.host,
                    port=args.port,
                    token=args.token,
                    api_key=args.engine_api_key,
                    activation=args.activation,
                    poll_interval_s=args.poll_interval,
                    materialize_dir=args.materialize_dir,
                    version=args.version,
                    model=args.model,
                    tls=tls,
                    llama=llama,
                    limits=limits,
                    max_adapters=args.max_adapters,
                    vllm_update=args.vllm_update,
                    kv_on_update=args.kv_on_update,
                    sglang_update=args.sglang_update,
                    task_status=task_status,
                )
            )
            scheme = "https" if tls else "http"
            sys.stdout.write(json.dumps({"url": f"{scheme}://{args.host}:{bound}"}) + "\n")
            sys.stdout.flush()
            tg.start_soon(cancel_on_signal, tg.cancel_scope)
            if args.parent_stdin:
                await stdin_closed()
                log.info("parent_gone")
                tg.cancel_scope.cancel()

    try:
        anyio.run(run)
    except KeyboardInterrupt:
        return 130
    return 0
