"""``orchestrate``: the command line.

    orchestrate --config X.toml [--print-config] [--log-format auto|pretty|json] [--section.key V …]
    orchestrate init-model --out DIR [--size tiny|small] [--seed N] [--sft-steps N]
                           [--chat-template FILE [--tool-parser NAME]]
    orchestrate serve (--model DIR | --board URL [--run NAME]) [--port P] [--host H]
                      [--device cpu|cuda] [--token T] [--header-timeout S] [--idle-timeout S]
                      [--body-timeout S] [--max-connections N]
    orchestrate versions --board URL [--run NAME] [--json]
    orchestrate materialize --board URL [--run NAME] --version N --out DIR
    orchestrate bench codec|engine|sync|publish|fleet|sparsity|router-replay|scheduler|async|device
                      [...]
    orchestrate fleet list|add|remove|up|scale|down --orchestrator URL|RUN_DIR [...]
    orchestrate train --config X.toml [--section.key V …]   (an external reference trainer)
    orchestrate sidecar --engine-url URL --engine-kind vllm|sglang|openai --board URL [--port P]
    orchestrate experiment lag --config X.toml [--lags 0,4] [--arms a,b] [--section.key V …]
    orchestrate chaos --config X.toml --fault NAME|all … [--runs N] [--out DIR] [--json]
    orchestrate inspect LOG [--episode ID]
    orchestrate replay LOG (--what-if POLICIES.toml [--model DIR] | --train --config X.toml)
    orchestrate report RUN_DIR [--out FILE]

Heavy imports (torch, transformers) happen inside the commands that need them, so that a bad
config fails in well under a second. The command (:func:`entry`) exits without the interpreter's
final teardown once everything else is done (:func:`_exit_after_the_rest`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import structlog
from anyio.abc import TaskStatus

from orchestrator.config import load_config, parse_overrides
from orchestrator.errors import SprawlError
from policies.wire.lifetime import serve_until_stopped
from policies.wire.logs import configure

if TYPE_CHECKING:
    import ssl

    from policies.serve.options import ServeOptions


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
        from orchestrator.warm_start import warm_start

        warm_start(out, steps=args.sft_steps, seed=args.seed)
    sys.stdout.write(f"{out}\n")
    return 0


def _serve(argv: list[str]) -> int:
    from policies.serve.options import ServeOptions
    from policies.serve.server import tls_context
    from policies.wire.flags import add_flags, parse_flags

    parser = argparse.ArgumentParser(
        prog="orchestrate serve",
        description="Serve a model dir (fixed version 0) or the board's newest version with the "
        "reference engine + sidecar.",
    )
    add_flags(parser, ServeOptions)
    options = parse_flags(parser, ServeOptions, argv)
    configure(options.log_format)
    cert, key = options.tls_cert, options.tls_key
    tls = tls_context(cert, key) if cert and key else None  # both or neither (ServeOptions)
    anyio.run(_serve_until_stopped, options, tls)
    return 0


async def _serve_until_stopped(options: ServeOptions, tls: ssl.SSLContext | None) -> None:
    """Serve the model or the board; print ``{"url": …}`` once serving; stop on SIGINT or
    SIGTERM, or (``--parent-stdin``) when stdin closes."""
    from policies.serve.reference_server import serve_board, serve_model

    o, limits = options, options.limits()

    async def serve(task_status: TaskStatus[int]) -> None:
        if o.model is not None:
            await serve_model(
                o.model, host=o.host, port=o.port, device=o.device,
                token=o.token, tls=tls, limits=limits, task_status=task_status,
            )  # fmt: skip
        else:
            assert o.board is not None  # one of the two (ServeOptions)
            await serve_board(
                o.board, o.run, host=o.host, port=o.port, device=o.device,
                token=o.token, poll_interval_s=o.poll_interval,
                activation=o.activation, tls=tls, limits=limits, base_model=o.base_model,
                max_adapters=o.max_adapters, task_status=task_status,
            )  # fmt: skip

    await serve_until_stopped(
        serve, host=o.host, https=tls is not None, parent_stdin=o.parent_stdin
    )


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
        "device": "orchestrator.bench.device",
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
    "fleet": _delegate("orchestrator.fleet.cli"),
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


_exit_code: int | None = None
"""What :func:`entry`'s ``main`` returned; None while it runs or when it raised."""


def _exit_after_the_rest() -> None:
    """The last exit handler: once the interpreter has joined every non-daemon thread and run
    every other exit handler (they run last-registered first; this one is registered before any
    but ``logging``'s, which it runs itself), leave without the final teardown — freeing torch's
    and transformers' module graph, ~1.4 s that nobody waits for. A command that raised exits
    the usual way, with its traceback."""
    if _exit_code is None:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed stream
            stream.flush()
    os._exit(_exit_code)


def entry() -> None:
    """The ``orchestrate`` command (``python -m orchestrator.cli`` too)."""
    global _exit_code
    atexit.register(_exit_after_the_rest)
    code = main()
    _exit_code = code
    sys.exit(code)


if __name__ == "__main__":
    entry()
