"""``orchestrate bench fleet``: how fast the run's Ray fleet comes up and heals, and what the pool
adds per call with many islands registered.

On a real Ray cluster (``--address``, default a head node it starts on loopback with
:func:`~orchestrator.fleet.ray_cluster.ray_head`) and sprawl's tiny model, through the run's own
parts (pool, supervisor, :class:`~orchestrator.fleet.ray_scale.Scaler`):

- ``fleet_up_s``: from asking for ``--islands`` islands (what ``orchestrate fleet up`` does) to
  every one serving (actor placed, engine started on the board's version, registered and
  healthy in the pool);
- ``replace_s``: from killing one island's actor to its replacement serving under the same id
  (``fleet.restart_backoff_s`` is set to 0.1 s, so this is detection + a new island's start);
- ``added_latency_ms``: the p50 latency the pool adds to a call at concurrency 1 with
  ``--simulated`` instant islands registered (fake lane endpoints in another process), and
  ``added_latency_ms_1`` with one — the same-run baseline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from rich.console import Console

from orchestrator.bench.scheduler import throughput
from orchestrator.bench.trainer import bf16_view
from orchestrator.config import FleetConfig, RayFleetConfig, RayResourcesConfig
from orchestrator.fleet.local import fleet_supervisor
from orchestrator.fleet.ray_cluster import ray_head
from orchestrator.fleet.ray_launch import ray_fleet
from orchestrator.fleet.ray_scale import Scaler
from orchestrator.loop.client import HttpTransport
from orchestrator.loop.pool import Pool
from orchestrator.types import NULL_EVENTS
from policies.board import Board
from policies.wire.logs import configure


async def _heal(address: str, root: Path, islands: int) -> dict[str, float]:
    import ray

    board = Board(str(root / "board"), "bench")
    model = root / "tiny"
    board.create(model)
    board.publish(0, bf16_view(model), view_name="bfloat16")
    fleet = RayFleetConfig(
        address=address,
        islands=0,
        work_dir=str(root / "islands"),
        resources=RayResourcesConfig(num_cpus=0.25),
        health_interval_s=0.25,
    )
    restarts = FleetConfig(restart_backoff_s=0.1)  # only its fleet.restart* keys are read
    async with (
        aiohttp.ClientSession() as session,
        ray_fleet(
            fleet, board_url=board.url, run="bench", device="cpu", poll_interval_s=0.25
        ) as rays,
    ):
        pool = Pool(
            HttpTransport(session, connect_s=5, call_s=30), version_wait_s=60, poll_interval_s=0.25
        )
        supervisor = fleet_supervisor(pool, restarts, {}, events=NULL_EVENTS)
        scaler = Scaler(pool, supervisor, [], rays.launcher, drain_timeout_s=10, events=NULL_EVENTS)
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervisor.run, [])
            tg.start_soon(scaler.run)
            tg.start_soon(pool.watch)
            t0 = time.perf_counter()
            scaler.scale(islands)
            await _until(lambda: _serving(pool, scaler) == islands)
            up = time.perf_counter() - t0
            victim = pool.endpoints["ray-0"]
            [name] = [n for n in ray.util.list_named_actors() if n.startswith("ray-0.")]
            actor = ray.get_actor(name)
            t1 = time.perf_counter()
            await anyio.to_thread.run_sync(ray.kill, actor)
            await _until(
                lambda: pool.endpoints["ray-0"] is not victim and _serving(pool, scaler) == islands
            )
            replace = time.perf_counter() - t1
            tg.cancel_scope.cancel()
    return {"fleet_up_s": round(up, 2), "replace_s": round(replace, 2)}


def _serving(pool: Pool, scaler: Scaler) -> int:
    return sum(
        1
        for i in scaler.members
        if (ep := pool.endpoints.get(i)) is not None and not ep.removed and ep.healthy
    )


async def _until(done: Any, timeout_s: float = 600) -> None:
    with anyio.fail_after(timeout_s):
        while not done():  # noqa: ASYNC110 (state another task changes; no event for it)
            await anyio.sleep(0.05)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench fleet")
    parser.add_argument("--islands", type=int, default=2)
    parser.add_argument("--address", help="a Ray cluster (default: a head node on loopback)")
    parser.add_argument("--simulated", type=int, default=64, help="islands for the latency part")
    parser.add_argument("--calls", type=int, default=5000, help="calls per latency measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    configure("auto", "warning")
    result: dict[str, Any] = {"islands": args.islands, "simulated": args.simulated}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        from policies.model.build import init_model

        init_model(root / "tiny", "tiny", seed=0)
        if args.address:
            result.update(anyio.run(_heal, args.address, root, args.islands))
        else:
            with ray_head(root, num_cpus=2) as head:
                result.update(anyio.run(_heal, head.address, root, args.islands))
    for n, key in ((args.simulated, "added_latency_ms"), (1, "added_latency_ms_1")):
        server = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.bench.scheduler", "--fake-server", str(n)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            urls = json.loads(server.stdout.readline())
            measured = anyio.run(throughput, urls, args.calls, 1)
            # at concurrency 1 its main measurement is the unqueued latency, over all the calls
            result[key] = measured["added_p50_ms_saturated"]
        finally:
            server.terminate()
            server.wait(timeout=10)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        Console().print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
