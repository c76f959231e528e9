"""``orchestrate bench sync --engine reference|vllm|llamacpp``: a real engine behind its sidecar,
following versions over a slow link.

One run: sprawl's ``--model-size`` model (``small`` by default, ``medium`` ~100 M and ``large``
~0.5 B parameters; bf16 view; built under ``runs/models/`` if missing), published as version 0
and served by the engine (the reference engine in process, a live vLLM CPU server, or the
sidecar's own llama-server); the engine's sidecar reads the board through a serial link of
``--link-mbit`` Mbit/s, each read a round trip of ``--link-rtt-ms`` away (default 0;
:class:`~orchestrator.bench.link.ThrottledBoard`). Then ``--versions`` versions are published,
each moving ``--density`` of the bf16 values by ±1 ulp (an Adam step). Per version: ``sync_s``
(from the start of ``Board.publish`` to the sidecar serving it, which may come before the
publish returns: the patches for islands further behind are written after the commit),
``board_bytes_read`` (what crossed the link to stage it), ``patch_bytes``, ``pause_ms`` (how
long generation was held), ``island_bytes`` (vLLM: bytes written plus read on the island's disk
to hand the engine that version) and ``engine_weight_version`` (vLLM's ``/weight_info``). Per
run: their p50s,
``limit_ratio`` (the full checkpoint's link time ÷ ``sync_s`` p50, over full ÷ patch bytes: the
share of what the bytes allow), ``decode_tokens_per_s`` (8 sampled requests of 64 tokens at
once after the last version) and ``exact`` (greedy token ids and log probs of the live engine
after the last version equal those of a fresh engine started on that version, taking versions
the same way).

``--engine vllm`` runs both ways a version reaches vLLM in the same invocation, one engine each:
``inplace`` (the engine patch through vLLM's weight-transfer API) and ``reload`` (the whole view
as a file, reloaded: the baseline); the JSON holds one object per way and their ratios.

Targets: board bytes per version ≤ 2 × the patch (issue #14); vLLM in place (issue #46):
``island_bytes`` ≤ 3 × ``patch_bytes``, at ``medium`` the pause p50 ≤ 0.5 × the reload's and
``limit_ratio`` ≥ 0.3; exact everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file

from orchestrator.bench.link import Link, ThrottledBoard, add_link_flags, parse_flags
from orchestrator.bench.trainer import TrainerProcess
from policies.board import Board, Manifest
from policies.board.types import WEIGHTS
from policies.serve.backends.base import HttpBackend
from policies.serve.backends.reference import ReferenceBackend
from policies.serve.engine import Engine
from policies.serve.options import VLLMUpdate
from policies.serve.sidecar import Sidecar
from policies.serve.types import Backend, QuiesceMode
from policies.wire.lane import GenerateRequest
from policies.wire.logs import configure

ENGINES = ("reference", "vllm", "llamacpp")
SIZES = ("small", "medium", "large")
PROMPTS = [[1, 17, 300, 42, 99, 7], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 400, 401, 2, 1, 33]]


class _Timed:
    """A backend whose activation pauses are recorded."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name, self.max_context = inner.name, inner.max_context
        self.pauses: list[float] = []

    async def stage(self, board: Board, version: int) -> None:
        await self.inner.stage(board, version)

    async def activate(self, version: int, mode: QuiesceMode) -> float:
        held = await self.inner.activate(version, mode)
        self.pauses.append(held)
        return held

    async def generate(self, req: GenerateRequest) -> Any:
        return await self.inner.generate(req)

    async def recover(self) -> None:
        await self.inner.recover()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _greedy(out: Any) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in out.choices]


async def _answers(backend: Backend) -> list[Any]:
    reqs = [GenerateRequest(prompt_token_ids=p, max_tokens=16, temperature=0.0) for p in PROMPTS]
    return [_greedy(await backend.generate(r)) for r in reqs]


@contextlib.asynccontextmanager
async def _engine(
    kind: str, model: Path, work: Path, name: str, update: VLLMUpdate = "inplace"
) -> AsyncIterator[Backend]:
    """An engine serving ``model`` (a materialized version), as a sidecar backend (vLLM: taking
    versions by ``update``)."""
    if kind == "reference":
        engine = Engine(model, dtype=torch.bfloat16)  # weights arrive by activation only
        engine.activate(load_file(model / WEIGHTS), version=0)
        backend: Backend = ReferenceBackend(engine)
        try:
            yield backend
        finally:
            await backend.aclose()
        return
    with contextlib.ExitStack() as stack:
        http: HttpBackend
        if kind == "vllm":
            from policies.serve.backends.vllm import VLLMBackend
            from policies.serve.backends.vllm_inplace import VLLMInplaceBackend
            from policies.serve.backends.vllm_launch import engine_python, vllm_server

            python = await anyio.to_thread.run_sync(engine_python)
            log = work / f"{name}-{update}.log"
            url = stack.enter_context(vllm_server(python, model, log, update=update))
            cls = VLLMInplaceBackend if update == "inplace" else VLLMBackend
            http = cls(url, work_dir=work / f"{name}-{update}", model="m", max_context=2048)
        else:
            http = _llamacpp(model, work / name)
        try:
            await http.connect()
            yield http
        finally:
            await http.aclose()


def _llamacpp(model: Path, work: Path) -> HttpBackend:
    from policies.board.gguf import base_files
    from policies.serve.backends.llamacpp import LlamaCppBackend
    from policies.serve.backends.llamacpp_wire import LlamaOptions, find_llama_server

    options = LlamaOptions(server=find_llama_server(None))
    return LlamaCppBackend(
        options, base=base_files(model), workdir=work, model="m", max_context=2048
    )


async def _publish(
    trainer: TrainerProcess, version: int, out: list[tuple[float, Manifest]], car: Sidecar
) -> None:
    out.append(await trainer.publish(version))
    car.notify()


async def _decode_tps(backend: Backend, concurrent: int = 8, tokens: int = 64) -> float:
    """Tokens per second decoded by ``concurrent`` sampled requests at once."""
    got: list[int] = []

    async def one(i: int) -> None:
        req = GenerateRequest(
            prompt_token_ids=PROMPTS[i % len(PROMPTS)], max_tokens=tokens, temperature=1.0, seed=i
        )
        out = await backend.generate(req)
        got.append(len(out.choices[0].token_ids))

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(concurrent):
            tg.start_soon(one, i)
    return round(sum(got) / (time.perf_counter() - t0), 1)


async def _weight_version(backend: Backend) -> str | None:
    if not isinstance(backend, HttpBackend):
        return None
    out = await backend.call("/weight_info") if backend.kind == "vllm" else None
    return str(out.get("weight_version")) if isinstance(out, dict) else None


def _p50_p99(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50": round(statistics.median(ordered), 2), "p99": round(p99, 2)}


async def run(
    kind: str,
    root: Path,
    model: Path,
    versions: int,
    density: float,
    mbit: float,
    poll_s: float,
    rtt_ms: float = 0.0,
    update: VLLMUpdate = "inplace",
) -> dict[str, Any]:
    """One engine following ``versions`` versions (vLLM: taking them by ``update``)."""
    await anyio.Path(root).mkdir(parents=True, exist_ok=True)
    trainer = TrainerProcess(str(root / "board"), "bench", model, density)
    await anyio.to_thread.run_sync(trainer.start)
    try:
        found = await _follow(kind, root, trainer, versions, mbit, poll_s, rtt_ms, update)
    finally:
        await anyio.to_thread.run_sync(trainer.close)
    return {
        "engine": kind,
        "update": update if kind == "vllm" else None,
        "model": str(model),
        "link_mbit_s": mbit,
        "link_rtt_ms": rtt_ms,
        "density": density,
        **found,
    }


async def _follow(
    kind: str,
    root: Path,
    trainer: TrainerProcess,
    versions: int,
    mbit: float,
    poll_s: float,
    rtt_ms: float,
    update: VLLMUpdate,
) -> dict[str, Any]:
    """The engine, its sidecar and the link, following the versions ``trainer`` publishes."""
    pub = Board(str(root / "board"), "bench")  # read only: the trainer publishes
    start_dir = pub.materialize(0, root / "v0")
    full_bytes = (start_dir / WEIGHTS).stat().st_size
    link = Link(mbit, rtt_ms)
    rows: list[dict[str, Any]] = []
    async with _engine(kind, start_dir, root, "live", update) as inner:
        backend = _Timed(inner)
        car = Sidecar(
            backend,
            ThrottledBoard(pub.url, "bench", link),
            poll_interval_s=poll_s,
            registry=CollectorRegistry(),
            activation="pause",
        )
        async with anyio.create_task_group() as tg:
            await tg.start(car.run)
            for v in range(1, versions + 1):
                before = link.bytes
                published: list[tuple[float, Manifest]] = []
                async with anyio.create_task_group() as publishing:
                    # served once its patch from v-1 is committed: the patches for islands
                    # further behind are written after that, while it serves
                    publishing.start_soon(_publish, trainer, v, published, car)
                    with anyio.fail_after(300):
                        while True:
                            if car.applied_version == v:
                                break
                            await anyio.sleep(poll_s / 4)
                    served = time.monotonic()
                t0, manifest = published[0]
                sync_s = served - t0
                island = getattr(inner, "island_bytes", {})
                rows.append(
                    {
                        "version": v,
                        "sync_s": round(sync_s, 4),
                        "board_bytes_read": link.bytes - before,
                        "patch_bytes": manifest.patches[0].bytes,
                        "pause_ms": round(backend.pauses[-1] * 1e3, 2),
                        "island_bytes": island.get(v),
                        "engine_weight_version": await _weight_version(inner),
                    }
                )
            live = await _answers(car.backend)
            decode_tps = await _decode_tps(car.backend)
            tg.cancel_scope.cancel()
    fresh_dir = pub.materialize(versions, root / "fresh-model")
    async with _engine(kind, fresh_dir, root, "fresh", update) as fresh:
        if kind == "llamacpp":  # a new llama-server on the version's GGUF, built from the board
            await fresh.stage(pub, versions)
            await fresh.activate(versions, "wait")
        exact = live == await _answers(fresh)
    return {
        **_figures(rows, full_bytes, mbit),
        "decode_tokens_per_s": decode_tps,
        "exact": exact,
    }


def _figures(rows: list[dict[str, Any]], full_bytes: int, mbit: float) -> dict[str, Any]:
    """The run's figures from its per-version rows (module docstring)."""
    sync_p50 = statistics.median(r["sync_s"] for r in rows)
    patch_p50 = statistics.median(r["patch_bytes"] for r in rows)
    full_s = full_bytes * 8 / (mbit * 1e6)
    island = [r["island_bytes"] / r["patch_bytes"] for r in rows if r["island_bytes"] is not None]
    return {
        "full_checkpoint_bytes": full_bytes,
        "full_checkpoint_link_s": round(full_s, 3),
        "versions": rows,
        "sync_s_p50": sync_p50,
        "patch_bytes_p50": patch_p50,
        "limit_ratio": round(full_s / sync_p50 / (full_bytes / patch_p50), 3),
        "board_bytes_per_patch_byte_max": round(
            max(r["board_bytes_read"] / r["patch_bytes"] for r in rows), 3
        ),
        "island_bytes_per_patch_byte_max": round(max(island), 3) if island else None,
        "pause_ms": _p50_p99([r["pause_ms"] for r in rows]),
    }


async def run_vllm(root: Path, model: Path, versions: int, **link: Any) -> dict[str, Any]:
    """Both ways a version reaches vLLM, in one run: ``inplace`` then ``reload`` (the baseline),
    and how they compare (issue #46's targets)."""
    out: dict[str, Any] = {"engine": "vllm", "model": str(model)}
    for update in ("inplace", "reload"):
        out[update] = await run("vllm", root / update, model, versions, update=update, **link)
    inplace, reload = out["inplace"], out["reload"]
    out["pause_p50_inplace_over_reload"] = round(
        inplace["pause_ms"]["p50"] / reload["pause_ms"]["p50"], 3
    )
    out["decode_tps_inplace_over_reload"] = round(
        inplace["decode_tokens_per_s"] / reload["decode_tokens_per_s"], 3
    )
    return out


def _summary(r: dict[str, Any]) -> str:
    island = r["island_bytes_per_patch_byte_max"]
    return (
        f"{r['engine']}{' ' + r['update'] if r['update'] else ''}: publish→serving p50 "
        f"{r['sync_s_p50']} s (limit_ratio {r['limit_ratio']}), board bytes ≤ "
        f"{r['board_bytes_per_patch_byte_max']}× the patch"
        f"{f', island bytes ≤ {island}× the patch' if island is not None else ''}, pause p50 "
        f"{r['pause_ms']['p50']} ms p99 {r['pause_ms']['p99']} ms, decode "
        f"{r['decode_tokens_per_s']} tok/s, exact={r['exact']} (full checkpoint: "
        f"{r['full_checkpoint_bytes']} B, {r['full_checkpoint_link_s']} s on the link)\n"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench sync --engine", description=__doc__)
    parser.add_argument("--engine", choices=ENGINES, required=True)
    parser.add_argument("--model-size", choices=SIZES, default="small")
    parser.add_argument(
        "--model", type=Path, help="model directory (default: runs/models/<size>, built if missing)"
    )
    parser.add_argument("--versions", type=int, default=10)
    add_link_flags(parser, poll_ms=20.0)
    parser.add_argument("--json", action="store_true")
    args = parse_flags(parser, argv, ("versions",))
    configure(level="warning")
    model = args.model or Path("runs/models") / args.model_size
    if not (model / "config.json").exists():
        from policies.model.build import init_model

        init_model(model, args.model_size, seed=0)
    link = {
        "density": args.density,
        "mbit": args.link_mbit,
        "poll_s": args.poll_ms / 1e3,
        "rtt_ms": args.link_rtt_ms,
    }
    with tempfile.TemporaryDirectory(prefix="sprawl-bench-engine-") as tmp:
        if args.engine == "vllm":
            result = anyio.run(lambda: run_vllm(Path(tmp), model, args.versions, **link))
            rows = [result["inplace"], result["reload"]]
        else:
            result = anyio.run(lambda: run(args.engine, Path(tmp), model, args.versions, **link))
            rows = [result]
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        sys.stdout.write("".join(_summary(r) for r in rows))
    return 0
