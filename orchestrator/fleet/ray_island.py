"""One rollout island as a Ray actor: its engine (and sidecar) as child processes of the actor.

:class:`IslandActor` runs on the node Ray picks from the island's resources
(:mod:`orchestrator.fleet.ray_launch` starts it). :meth:`~IslandActor.start` puts the run's
secrets into the actor process's environment (never into Ray's ``runtime_env``, which the
dashboard shows, nor onto a command line), starts the engine with a bearer token of its own
(``$SPRAWL_TOKEN``), and returns its URL once it serves; :meth:`~IslandActor.health` says whether
every process still runs and the engine answers; :meth:`~IslandActor.stop` stops the processes.

The engine processes exit when the actor process does (their stdin is a pipe from it:
``--parent-stdin``), so a killed actor leaves no engine behind.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from pydantic import BaseModel, ConfigDict

from orchestrator.config import IslandConfig
from orchestrator.fleet.children import Child, Children, read_ready, sprawl_command
from orchestrator.fleet.islands import LoraServing, start_island
from policies.serve.options import ServeOptions

log = structlog.get_logger(__name__)


class IslandSpec(BaseModel):
    """What an island runs: everything but secrets (this travels in Ray's task arguments)."""

    model_config = ConfigDict(frozen=True)

    id: str
    board_url: str
    run: str
    poll_interval_s: float
    device: str
    work_dir: str
    startup_timeout_s: float
    island: IslandConfig | None = None
    """``None``: the reference engine (``orchestrate serve``); else a sidecar island (vLLM)."""
    lora: LoraServing | None = None
    """Set: the run publishes LoRA versions (its base model a path on the island's node)."""


class Secrets:
    """Environment variables an island's engine needs (the board's storage credentials); its
    ``repr`` shows their names only."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __repr__(self) -> str:
        return f"Secrets({sorted(self.env)})"


class IslandActor:
    """A Ray actor (:mod:`orchestrator.fleet.ray_launch` applies ``ray.remote`` with the island's
    resources)."""

    def __init__(self, spec: IslandSpec, creds: Secrets) -> None:
        self.spec = spec
        self.env = creds.env
        self.token = secrets.token_urlsafe(24)
        self.children: Children | None = None
        self.url: str | None = None

    def __repr__(self) -> str:  # Ray's name for the actor in its logs and dashboard
        return f"IslandActor({self.spec.id})"

    async def start(self) -> tuple[str, str]:
        """Start the engine; its URL and bearer token once it serves."""
        spec = self.spec
        os.environ.update(self.env)
        os.environ["SPRAWL_TOKEN"] = self.token
        work = Path(spec.work_dir)
        self.children = await Children(work / "logs").__aenter__()
        if spec.island is None:
            url = await self._reference(self.children)
        else:
            started = await start_island(
                0,
                spec.island,
                self.children,
                island_id=spec.id,
                board_url=spec.board_url,
                run=spec.run,
                island_dir=work,
                poll_interval_s=spec.poll_interval_s,
                host=_node_ip(),
                lora=spec.lora,
            )
            url = started.ref.url
        self.url = url
        log.info("island_serving", island=spec.id, url=url)
        return url, self.token

    async def _reference(self, children: Children) -> str:
        spec = self.spec
        options = ServeOptions.model_validate(
            {
                "board": spec.board_url,
                "run": spec.run,
                "host": _node_ip(),
                "port": 0,
                "device": spec.device,
                "poll_interval": spec.poll_interval_s,
                "parent_stdin": True,
                "log_format": "json",
                **(spec.lora.serve_options() if spec.lora is not None else {}),
            }
        )
        argv, env = sprawl_command(options)
        child = await children.spawn(spec.id, argv, env=env)
        return await read_ready(child, spec.startup_timeout_s, "fleet.ray.startup_timeout_s")

    async def health(self) -> dict[str, Any]:
        """``{"alive", "reason", "exit_code"}``: whether every process of the island runs and
        the engine answers ``/health``."""
        assert self.children is not None
        assert self.url is not None
        dead = [c for c in self.children.started if c.proc.returncode is not None]
        if dead:
            return {
                "alive": False,
                "reason": _exited(dead[0]),
                "exit_code": dead[0].proc.returncode,
            }
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r,
            ):
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            return {
                "alive": False,
                "reason": f"/health: {exc or type(exc).__name__}",
                "exit_code": None,
            }
        ok = status == 200
        return {
            "alive": ok,
            "reason": "" if ok else f"/health answered {status}",
            "exit_code": None,
        }

    async def stop(self) -> None:
        """Stop the island's processes (SIGTERM, then SIGKILL of what is left) and reap them."""
        if self.children is not None:
            await self.children.stop(*self.children.started)
        log.info("island_stopped", island=self.spec.id)


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def _exited(child: Child) -> str:
    return f"{child.name} exited with code {child.proc.returncode}; see {child.log_path}"
