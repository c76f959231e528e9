"""``orchestrate``: the command line.

    orchestrate --config X.toml [--print-config] [--log-format auto|pretty|json] [--section.key V …]
    orchestrate init-model --out DIR [--size tiny|small] [--seed N] [--sft-steps N]
                           [--chat-template FILE [--tool-parser NAME]]
    orchestrate serve (--model DIR | --board URL [--run NAME]) [--port P] [--host H]
                      [--device cpu|cuda] [--token T] [--header-timeout S] [--idle-timeout S]
                      [--body-timeout S] [--max-connections N]
    orchestrate versions --board URL [--run NAME] [--json]
    orchestrate materialize --board URL [--run NAME] --version N --out DIR
    orchestrate bench codec|engine|sync|publish|fleet|sparsity|router-replay|scheduler|async [...]
    orchestrate fleet list|add|remove|up|scale|down --orchestrator URL|RUN_DIR [...]
    orchestrate train --config X.toml [--section.key V …]   (an external reference trainer)
    orchestrate sidecar --engine-url URL --engine-kind vllm|sglang|openai --board URL [--port P]
    orchestrate experiment lag --config X.toml [--steps N] [--out DIR] [--section.key V …]
    orchestrate chaos --config X.toml --fault NAME|all … [--runs N] [--out DIR] [--json]
    orchestrate inspect LOG [--episode ID]
    orchestrate replay LOG (--what-if POLICIES.toml [--model DIR] | --train --config X.toml)
    orchestrate report RUN_DIR [--out FILE]

Heavy imports (torch, transformers) happen inside the commands that need them, so that a bad
config fails in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import structlog
from anyio.abc import TaskStatus

from orchestrator.config import load_config, parse_overrides
from orchestrator.errors import SprawlError
from policies.wire.lifetime import cancel_on_signal, stdin_closed
from policies.wire.logs import configure

log = structlog.get_logger("orchestrate")


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="orchestrate",
        description="Run an RL loop described by a TOML config.",
        epilog="Any config field can be overridden with --section.key VALUE.",
    )
    parser.add_argument("--config", type=Path, help="TOML config file")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config (JSON) and exit"
    )
    parser.add_argument("--log-format", choices=["auto", "pretty", "json"])
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    if args.log_format:
        overrides["log.format"] = args.log_format
    cfg = load_config(args.config, overrides)
    if args.print_config:
        sys.stdout.write(cfg.model_dump_json(indent=2) + "\n")
        return 0
    configure(cfg.log.format, cfg.log.level)
    from orchestrator.run import run

    summary = anyio.run(run, cfg)
    if cfg.run.report:
        from orchestrator.offline.report import write_run_report

        summary.report = write_run_report(summary.run_dir)
    sys.stdout.write(summary.render() + "\n")
    return 130 if summary.interrupted else 0


def _init_model(argv: list[str]) -> int:
    from policies.wire.tool_parsers import TOOL_PARSERS

    parser = argparse.ArgumentParser(
        prog="orchestrate init-model", description="Build sprawl's own tiny model and tokenizer."
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--size", choices=["tiny", "small", "medium", "large", "tiny-moe"], default="tiny"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sft-steps", type=int, default=0, help="SFT warm start on the calculator format (0: none)"
    )
    parser.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="Jinja chat template to build the tokenizer for (default: sprawl's Hermes-style one); "
        "examples/chat_templates/ has one per model family",
    )
    parser.add_argument(
        "--tool-parser",
        choices=list(TOOL_PARSERS),
        help="the parser engines should read this model's tool calls with (written to sprawl.json)",
    )
    args = parser.parse_args(argv)
    configure()
    from policies.model.build import init_model

    out = init_model(
        args.out,
        args.size,
        seed=args.seed,
        chat_template=args.chat_template,
        tool_parser=args.tool_parser,
    )
    if args.sft_steps > 0:
        from policies.train.sft import warm_start

        warm_start(out, steps=args.sft_steps, seed=args.seed)
    sys.stdout.write(f"{out}\n")
    return 0


def _serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="orchestrate serve",
        description="Serve a model dir (fixed version 0) or the board's newest version with the "
        "reference engine + sidecar.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="HF model dir, served as fixed version 0")
    source.add_argument("--board", help="board URL (fsspec) or path")
    parser.add_argument("--run", default="demo", help="run name on the board")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--token",
        default=os.environ.get("SPRAWL_TOKEN"),
        help="bearer token required on every route but /health (default: $SPRAWL_TOKEN)",
    )
    parser.add_argument("--poll-interval", type=float, default=0.25)
    parser.add_argument(
        "--activation",
        choices=["wait", "pause"],
        default="wait",
        help="drain in-flight requests before a version switch, or pause them at a step boundary",
    )
    parser.add_argument(
        "--base-model",
        type=Path,
        help="with --board: the model dir whose weights a run's LoRA versions adapt (trainer.lora)",
    )
    parser.add_argument(
        "--max-adapters",
        type=int,
        default=4,
        help="LoRA versions resident at once (least recently used evicted; fleet.max_adapters)",
    )
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate (serve over HTTPS)")
    parser.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    parser.add_argument(
        "--parent-stdin",
        action="store_true",
        help="exit when stdin closes (used by the local fleet)",
    )
    parser.add_argument("--log-format", choices=["auto", "pretty", "json"], default="auto")
    from policies.serve.connections import add_limit_flags, limits_from

    add_limit_flags(parser)
    args = parser.parse_args(argv)
    limits = limits_from(parser, args)
    if not 0 <= args.port <= 65535:
        parser.error(f"argument --port: {args.port} is not a port (0-65535; 0 picks a free one)")
    if not 0 < args.poll_interval < float("inf"):
        parser.error(f"argument --poll-interval: {args.poll_interval} is not a positive number")
    if args.max_adapters < 1:
        parser.error(f"argument --max-adapters: {args.max_adapters} is below 1")
    if args.base_model is not None and not (args.base_model / "config.json").is_file():
        parser.error(
            f"argument --base-model: {args.base_model} is not a model dir (no config.json)"
        )
    configure(args.log_format)
    from policies.serve.reference_server import serve_board, serve_model
    from policies.serve.server import tls_context

    tls = tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None

    async def serve(task_status: TaskStatus[int]) -> None:
        if args.model is not None:
            await serve_model(
                args.model, host=args.host, port=args.port, device=args.device,
                token=args.token, tls=tls, limits=limits, task_status=task_status,
            )  # fmt: skip
        else:
            await serve_board(
                args.board, args.run, host=args.host, port=args.port, device=args.device,
                token=args.token, poll_interval_s=args.poll_interval,
                activation=args.activation, tls=tls, limits=limits, base_model=args.base_model,
                max_adapters=args.max_adapters, task_status=task_status,
            )  # fmt: skip

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            port = await tg.start(serve)
            scheme = "https" if args.tls_cert else "http"
            sys.stdout.write(json.dumps({"url": f"{scheme}://{args.host}:{port}"}) + "\n")
            sys.stdout.flush()
            tg.start_soon(cancel_on_signal, tg.cancel_scope)
            if args.parent_stdin:
                await stdin_closed()
                log.info("parent_gone")
                tg.cancel_scope.cancel()

    anyio.run(main)
    return 0


def _versions(argv: list[str]) -> int:
    from policies.board.cli import versions

    return versions(argv)


def _materialize(argv: list[str]) -> int:
    from policies.board.cli import materialize

    return materialize(argv)


def _bench(argv: list[str]) -> int:
    benches: dict[str, str] = {
        "codec": "orchestrator.bench.codec",
        "engine": "orchestrator.bench.engine",
        "sync": "orchestrator.bench.sync",
        "publish": "orchestrator.bench.publish",
        "fleet": "orchestrator.bench.fleet",
        "sparsity": "orchestrator.bench.sparsity",
        "router-replay": "orchestrator.bench.router_replay",
        "async": "orchestrator.bench.async_rl",
        "scheduler": "orchestrator.bench.scheduler",
    }
    if not argv or argv[0] not in benches:
        sys.stderr.write(f"usage: orchestrate bench {{{','.join(benches)}}} [args]\n")
        return 2
    import importlib

    name = benches[argv[0]]
    if argv[0] == "sync" and any(a == "--engine" or a.startswith("--engine=") for a in argv):
        name = "orchestrator.bench.engine_sync"  # a real engine behind its sidecar
    module = importlib.import_module(name)
    result: int = module.main(argv[1:])
    return result


def _delegate(module: str) -> Callable[[list[str]], int]:
    """A subcommand implemented by ``module.main(argv)`` (inspect, replay, report)."""

    def command(argv: list[str]) -> int:
        import importlib

        configure()
        result: int = importlib.import_module(module).main(argv)
        return result

    return command


USER_ERRORS = (SprawlError,)
PATH_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)
"""A path given on the command line (or in a config) that is missing, of the wrong kind or not
accessible: reported in one line naming the path, like a :data:`USER_ERRORS` error."""


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": _delegate("orchestrator.train_worker"),
    "fleet": _delegate("orchestrator.fleet_cli"),
    "init-model": _init_model,
    "serve": _serve,
    "versions": _versions,
    "materialize": _materialize,
    "bench": _bench,
    "inspect": _delegate("orchestrator.offline.inspect_log"),
    "replay": _delegate("orchestrator.offline.replay"),
    "report": _delegate("orchestrator.offline.report"),
    "experiment": _delegate("orchestrator.offline.experiment"),
    "chaos": _delegate("orchestrator.chaos.cli"),
    "sidecar": _delegate("policies.serve.backends.standalone"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = COMMANDS.get(argv[0]) if argv else None
    try:
        return command(argv[1:]) if command else _run(argv)
    except BaseException as exc:
        leaves = _leaves(exc)
        if not all(_user_error(e) for e in leaves):
            raise
        for leaf in leaves:
            sys.stderr.write(f"orchestrate: error: {_describe(leaf)}\n")
        return 2


def _user_error(exc: BaseException) -> bool:
    return isinstance(exc, USER_ERRORS) or (
        isinstance(exc, PATH_ERRORS) and exc.filename is not None
    )


def _describe(exc: BaseException) -> str:
    """One line: a user error's message, or ``PATH: what is wrong with it``."""
    if isinstance(exc, PATH_ERRORS) and not isinstance(exc, USER_ERRORS):
        other = f" → {exc.filename2}" if exc.filename2 is not None else ""
        return f"{exc.filename}{other}: {exc.strerror or type(exc).__name__}"
    return str(exc)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


if __name__ == "__main__":
    sys.exit(main())
