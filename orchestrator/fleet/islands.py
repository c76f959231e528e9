"""Local islands of other engine kinds (``[[fleet.islands]]``): vLLM and llama.cpp, each behind
an ``orchestrate sidecar`` subprocess, as endpoints of the pool.

- **vLLM** (``vllm-<i>``): the board's newest version (version 0 on a fresh run) is
  materialized into ``<island dir>/model`` (a run of LoRA versions, :class:`LoraServing`: vLLM
  starts on the base model instead, with run-time LoRA adapters, and the sidecar loads each
  version as one); the vLLM API server is started on it under
  :mod:`orchestrator.fleet.guard` (its engine core and workers die with the orchestrator) with the
  flags of :func:`~policies.serve.backends.vllm_launch.vllm_command`; once its ``/health``
  answers, ``orchestrate sidecar --engine-kind vllm`` is started in front of it, writing staged
  versions under ``<island dir>/versions``.
- **llama.cpp** (``llamacpp-<i>``): ``orchestrate sidecar --engine-kind llamacpp``, which runs
  and reaps its own ``llama-server``; GGUFs and the server's log are under ``<island dir>``.

Sidecars run with ``--parent-stdin``; every process is a
:class:`~orchestrator.fleet.children.Children` child (sidecar logs ``<log dir>/<id>.log``, vLLM's
``<log dir>/<id>-engine.log``). The engine environments are built on first use when not configured
(``scripts/build-vllm-env.sh``, ``scripts/build-llama-server.sh``; cached outside the clone).

An island that dies mid-run is restarted whole by the supervisor
(:mod:`orchestrator.fleet.supervisor`, ``fleet.restart``): :func:`start_island` again, after its
processes are stopped. Not covered: GPUs (every island serves on CPU).
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import structlog
from pydantic import BaseModel, ConfigDict

from orchestrator.config import IslandConfig, LlamaCppIslandConfig, VLLMIslandConfig
from orchestrator.errors import FleetError
from orchestrator.fleet.children import Child, Children, LocalIsland, read_ready, sprawl_command
from orchestrator.types import EndpointRef
from policies.errors import EngineError, PolicyError
from policies.serve.options import SidecarOptions

log = structlog.get_logger(__name__)
ROOT = Path(__file__).resolve().parents[2]
HEALTH_EVERY_S = 0.5
"""vLLM gives no readiness signal but ``/health``: how often it is asked while starting."""


class LoraServing(BaseModel):
    """How the run's engines serve LoRA versions (``trainer.lora``; docs/fleet.md#lora-versions).
    It travels to Ray islands in their spec, so ``base_model`` must be a path on their nodes."""

    model_config = ConfigDict(frozen=True)

    base_model: Path
    """The weights every version adapts (the run's ``model.path``)."""
    max_adapters: int
    """Versions resident at once (``fleet.max_adapters``)."""
    rank: int
    """The adapters' rank (``trainer.lora.rank``)."""

    def serve_options(self) -> dict[str, Any]:
        """The :class:`~policies.serve.options.ServeOptions` fields for it."""
        return {"base_model": self.base_model, "max_adapters": self.max_adapters}


def island_ids(islands: Sequence[IslandConfig]) -> list[str]:
    """``<kind>-<i>``, numbered per kind in config order."""
    seen: dict[str, int] = {}
    ids = []
    for spec in islands:
        ids.append(f"{spec.kind}-{seen.get(spec.kind, 0)}")
        seen[spec.kind] = seen.get(spec.kind, 0) + 1
    return ids


async def start_island(
    index: int,
    spec: IslandConfig,
    children: Children,
    *,
    island_id: str,
    board_url: str,
    run: str,
    island_dir: Path,
    poll_interval_s: float,
    host: str = "127.0.0.1",
    lora: LoraServing | None = None,
) -> LocalIsland:
    """Start island ``fleet.islands[index]`` and return it once it serves (its sidecar bound to
    ``host``; ``lora`` set: serving LoRA versions); what it started is stopped again when it
    fails to."""
    key = f"fleet.islands[{index}]"
    own: list[Child] = []
    await anyio.Path(island_dir).mkdir(parents=True, exist_ok=True)
    common: dict[str, Any] = {
        "engine_kind": spec.kind, "board": board_url, "run": run, "host": host, "port": 0,
        "poll_interval": poll_interval_s, "parent_stdin": True, "log_format": "json",
    }  # fmt: skip
    try:
        binary = await anyio.to_thread.run_sync(_engine_binary, spec)  # before the clock starts
        with anyio.move_on_after(spec.startup_timeout_s):
            if isinstance(spec, VLLMIslandConfig):
                engine = await _vllm_engine(
                    spec, binary, children, own, island_id, island_dir, run, board_url, lora
                )
            else:
                engine = _llamacpp_options(spec, binary, island_dir)
            argv, env = sprawl_command(SidecarOptions.model_validate(common | engine))
            child = await children.spawn(island_id, argv, env=env)
            own.append(child)
            url = await read_ready(child, math.inf, key)
            log.info(
                "island_started", island=island_id, kind=spec.kind, url=url, pid=child.proc.pid
            )
            return LocalIsland(
                EndpointRef(id=island_id, url=url, weight=spec.weight), own, children
            )
    except BaseException as exc:
        await children.stop(*own)
        if isinstance(exc, PolicyError | FleetError):  # engine build, board, start-up
            raise FleetError(f"{key} ({spec.kind}): {exc}") from None
        raise
    await children.stop(*own)
    raise FleetError(
        f"{key} ({island_id}) not ready after {spec.startup_timeout_s}s "
        f"({key}.startup_timeout_s); see {children.log_dir}/{island_id}*.log"
    )


def _engine_binary(spec: IslandConfig) -> Path:
    """The configured engine binary, or the cached build (built first when it is missing)."""
    if isinstance(spec, VLLMIslandConfig):
        from policies.serve.backends.vllm_launch import engine_python

        return spec.python or engine_python()
    return spec.llama_server or _llama_server()


async def _vllm_engine(
    spec: VLLMIslandConfig,
    python: Path,
    children: Children,
    own: list[Child],
    island_id: str,
    island_dir: Path,
    run: str,
    board_url: str,
    lora: LoraServing | None,
) -> dict[str, Any]:
    """Start vLLM on the board's newest version, or with ``lora`` on the base model with
    run-time adapters; the sidecar options that point at it."""
    from policies.board import Board
    from policies.serve.backends.base import free_port
    from policies.serve.backends.vllm_launch import vllm_command, vllm_env, vllm_lora_rank

    if lora is None:
        board = Board(board_url, run)
        model_dir = island_dir / "model"
        version = await anyio.to_thread.run_sync(board.latest)
        if version is None:
            raise FleetError("the board has no version to start vLLM from")
        await anyio.to_thread.run_sync(board.materialize, version, model_dir)
        adapters = None
    else:
        model_dir, version = lora.base_model, None
        adapters = (lora.max_adapters, vllm_lora_rank(lora.rank))
    port = free_port()
    argv = vllm_command(
        python, model_dir, name=run, port=port, max_model_len=spec.max_model_len, lora=adapters,
        routed_experts=spec.routed_experts, update="reload" if lora is not None else spec.update,
    )  # fmt: skip
    engine = await children.spawn(
        f"{island_id}-engine",
        [sys.executable, "-m", "orchestrator.fleet.guard", *argv],
        env=vllm_env(lora=lora is not None, routed_experts=spec.routed_experts),
        ready_line=False,
        grace_s=30.0,  # longer than the guard's own grace for vLLM
    )
    own.append(engine)
    url = f"http://127.0.0.1:{port}"
    await _until_healthy(url, engine)
    log.info(
        "vllm_started", island=island_id, url=url, version=version, lora=lora is not None,
        pid=engine.proc.pid,
    )  # fmt: skip
    options: dict[str, Any] = {
        "engine_url": url, "model": run, "activation": spec.activation,
        "materialize_dir": island_dir / "versions", "vllm_update": spec.update,
        "kv_on_update": spec.kv_on_update,
    }  # fmt: skip
    return options | ({"max_adapters": lora.max_adapters} if lora is not None else {})


async def _until_healthy(url: str, engine: Child) -> None:
    """Return once ``url``/health answers 200; raise if the engine exits first."""
    code: int | None = None
    async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:

        async def exited() -> None:  # raised below: out of the task group, it stays one error
            nonlocal code
            code = await engine.proc.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(exited)
        while True:
            try:
                async with session.get(
                    f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    if r.status == 200:
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass  # not listening yet
            await anyio.sleep(HEALTH_EVERY_S)
        tg.cancel_scope.cancel()
    if code is not None:
        raise FleetError(f"vLLM exited with {code} while starting; see {engine.log_path}")


def _llamacpp_options(spec: LlamaCppIslandConfig, server: Path, island_dir: Path) -> dict[str, Any]:
    """The sidecar's options for a llama.cpp island (it starts llama-server itself)."""
    return {
        "llama_server": server,
        "materialize_dir": island_dir,
        "llama_ctx": spec.ctx,
        "llama_restart": spec.restart,
        "llama_arg": list(spec.args),
    }


def _llama_server() -> Path:
    """The cached ``llama-server``, built first if it is missing (about 10 minutes)."""
    from policies.serve.backends.llamacpp_wire import default_server_path

    cached = default_server_path()
    if cached.is_file():
        return cached
    script = ROOT / "scripts" / "build-llama-server.sh"
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise EngineError(f"scripts/build-llama-server.sh failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])
