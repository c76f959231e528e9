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
import ssl
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
from policies.serve.backends.sglang import SGLangBackend
from policies.serve.backends.sglang_inplace import SGLangInplaceBackend
from policies.serve.backends.shadow import check_view
from policies.serve.backends.vllm import VLLMBackend
from policies.serve.backends.vllm_inplace import VLLMInplaceBackend
from policies.serve.backends.vllm_lora import VLLMLoraBackend
from policies.serve.connections import LaneLimits
from policies.serve.options import EngineKind, KVOnUpdate, SGLangUpdate, SidecarOptions, VLLMUpdate
from policies.serve.server import run_lane, tls_context
from policies.serve.sidecar import Sidecar
from policies.serve.types import QuiesceMode
from policies.wire.flags import add_flags, parse_flags
from policies.wire.lifetime import serve_until_stopped

log = structlog.get_logger(__name__)
KINDS = get_args(EngineKind)


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
    """``orchestrate sidecar``'s flags: :class:`~policies.serve.options.SidecarOptions`."""
    p = argparse.ArgumentParser(prog="orchestrate sidecar", description=__doc__.split("\n\n")[0])
    add_flags(p, SidecarOptions)
    return p


def main(argv: list[str]) -> int:
    from policies.wire.logs import configure

    parser = build_parser()
    args = parse_flags(parser, SidecarOptions, argv)
    configure(args.log_format)
    cert, key = args.tls_cert, args.tls_key
    tls = tls_context(cert, key) if cert and key else None  # both or neither (SidecarOptions)
    llama = None
    if args.engine_kind == "llamacpp":
        from policies.serve.backends.llamacpp_wire import find_llama_server

        llama = LlamaOptions(
            server=find_llama_server(args.llama_server),
            ctx_size=args.llama_ctx,
            extra_args=tuple(args.llama_arg),
            startup_timeout_s=args.llama_startup_timeout,
            prewarm=not args.llama_restart,
        )
    limits = args.limits()

    async def run() -> None:
        await serve_until_stopped(
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
            ),
            host=args.host,
            https=tls is not None,
            parent_stdin=args.parent_stdin,
        )

    try:
        anyio.run(run)
    except KeyboardInterrupt:
        return 130
    return 0
