"""``orchestrate bench scheduler``: what the orchestrator adds on top of a raw HTTP client.

Starts instant fake lane endpoints in a separate process on loopback, then, in this process and
in the same run:

- baseline: a raw aiohttp client loop posting ``/v1/generate`` with the same concurrency;
- sprawl: the same calls through the pool (routing, version bounds, accounting, response
  validation) over :class:`~orchestrator.loop.client.HttpTransport`.

Reports, at ``--concurrency`` (saturated) and at concurrency 1 (latency without queueing): calls
per second, calls per CPU-second of this process (per core), p50/p99 latency, and the p50 the
pool adds at concurrency 1. Then holds ``--episodes`` episodes in flight at once (calculator
environment, tiny tokenizer, an in-memory fleet that answers after ``--hold-s``) and reports the
Python heap they take (tracemalloc), per episode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from aiohttp import web
from rich.console import Console
from rich.table import Table

from orchestrator.loop.client import HttpTransport
from orchestrator.loop.pool import Pool
from orchestrator.types import EndpointRef
from policies.wire.lane import GenerateRequest, VersionBounds
from policies.wire.logs import configure

_RESPONSE = {
    "id": "fake",
    "model": "fake",
    "prompt_token_ids": [1, 2, 3, 4],
    "choices": [
        {"index": 0, "token_ids": [5, 6, 7, 8], "logprobs": [-0.5] * 4, "finish_reason": "stop"}
    ],
    "policy_version": {"start": 3, "end": 3},
    "usage": {"prompt_tokens": 4, "completion_tokens": 4},
}


async def _fake_server(n: int) -> None:
    """Serve ``n`` instant lane endpoints; print their URLs as one JSON line."""
    body = json.dumps(_RESPONSE).encode()
    policy = json.dumps(
        {"applied_version": 3, "staged_version": None, "state": "serving", "run": "fake"}
    ).encode()

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def get_policy(_request: web.Request) -> web.Response:
        return web.Response(body=policy, content_type="application/json")

    app = web.Application()
    app.add_routes([web.post("/v1/generate", generate), web.get("/v1/policy", get_policy)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    urls = []
    for _ in range(n):
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
    urls = [f"http://127.0.0.1:{addr[1]}" for addr in runner.addresses]
    sys.stdout.write(json.dumps(urls) + "\n")
    sys.stdout.flush()
    await anyio.sleep_forever()


async def _measure(
    calls: int, concurrency: int, one: Callable[[], Awaitable[None]]
) -> dict[str, float]:
    latencies: list[float] = []
    todo = iter(range(calls))

    async def worker() -> None:
        for _ in todo:
            t0 = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - t0)

    cpu0, t0 = time.process_time(), time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    latencies.sort()
    return {
        "calls_per_s": round(calls / wall, 1),
        "calls_per_cpu_s": round(calls / cpu, 1),
        "p50_ms": round(statistics.median(latencies) * 1e3, 3),
        "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1e3, 3),
    }


async def throughput(urls: list[str], calls: int, concurrency: int) -> dict[str, Any]:
    req = GenerateRequest(
        prompt_token_ids=[1, 2, 3, 4], max_tokens=4, policy_version=VersionBounds(min=2)
    )
    body = req.model_dump()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        counter = iter(range(1 << 62))

        async def raw() -> None:
            url = urls[next(counter) % len(urls)]
            async with session.post(f"{url}/v1/generate", json=body) as r:
                await r.json()

        transport = HttpTransport(session, connect_s=5.0, call_s=30.0)
        pool = Pool(transport, version_wait_s=30.0, poll_interval_s=60.0, max_inflight=concurrency)
        for i, url in enumerate(urls):
            pool.add(EndpointRef(id=f"fake-{i}", url=url))
        await pool.refresh_all()

        async def routed() -> None:
            await pool.generate(req)

        await _measure(min(calls, 500), concurrency, raw)  # warm up connections
        baseline = await _measure(calls, concurrency, raw)
        sprawl = await _measure(calls, concurrency, routed)
        # latency without queueing: one call at a time
        lat_calls = max(calls // 10, 100)
        baseline_1 = await _measure(lat_calls, 1, raw)
        sprawl_1 = await _measure(lat_calls, 1, routed)
    return {
        "baseline_raw_aiohttp": baseline,
        "sprawl_pool": sprawl,
        "per_core_ratio": round(sprawl["calls_per_cpu_s"] / baseline["calls_per_cpu_s"], 2),
        "baseline_raw_aiohttp_c1": baseline_1,
        "sprawl_pool_c1": sprawl_1,
        "added_p50_ms": round(sprawl_1["p50_ms"] - baseline_1["p50_ms"], 3),
        "added_p50_ms_saturated": round(sprawl["p50_ms"] - baseline["p50_ms"], 3),
    }


async def _memory(model: Path, episodes: int, hold_s: float) -> dict[str, float]:
    import random

    from transformers import AutoTokenizer

    from orchestrator.bench.simulate import SimEndpoint, SimFleet, calculator_runner

    tokenizer = AutoTokenizer.from_pretrained(model)
    fleet = SimFleet(
        {"sim": SimEndpoint(seconds_per_token=hold_s / 8, sync_delay_s=0.0)},
        random.Random(0),
        eos=int(tokenizer.eos_token_id),
        mean_tokens=8,
        sigma=0.01,
    )
    pool = Pool(fleet, version_wait_s=600.0, poll_interval_s=600.0, max_inflight=episodes)
    runner = await calculator_runner(
        pool,
        {"sim": "sim://"},
        tokenizer,
        num_tasks=64,
        max_tokens=16,
        max_turns=1,
        episode_timeout_s=600.0,
        max_context=4096,
    )
    tasks = list(runner.env.tasks())
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    peak_in_flight = 0.0
    async with anyio.create_task_group() as tg:
        for i in range(episodes):
            tg.start_soon(runner.run, tasks[i % len(tasks)], f"g{i}", lambda: VersionBounds(), 0)
        await anyio.sleep(hold_s / 2)  # every episode is now waiting on its model call
        in_flight = tracemalloc.get_traced_memory()[0] - base
        peak_in_flight = in_flight
    tracemalloc.stop()
    return {
        "episodes": episodes,
        "heap_mb": round(peak_in_flight / 2**20, 1),
        "kb_per_episode": round(peak_in_flight / episodes / 1024, 2),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench scheduler")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=10000)
    parser.add_argument("--hold-s", type=float, default=20.0)
    parser.add_argument("--model", type=Path, help="tokenizer dir (default: build sprawl's tiny)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fake-server", type=int, metavar="N", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fake_server:
        anyio.run(_fake_server, args.fake_server)
        return 0
    configure("auto", "warning")  # per-call logs would measure the logger, not the pool
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.bench.scheduler",
            "--fake-server",
            str(args.endpoints),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        urls = json.loads(server.stdout.readline())
        result = anyio.run(throughput, urls, args.calls, args.concurrency)
    finally:
        server.terminate()
        server.wait(timeout=10)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from policies.model.build import init_model

            model = init_model(Path(tmp) / "tiny", "tiny")
        result["memory"] = anyio.run(_memory, model, args.episodes, args.hold_s)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        table = Table("", "calls/s", "calls per CPU-s", "p50 ms", "p99 ms")
        for name in (
            "baseline_raw_aiohttp",
            "sprawl_pool",
            "baseline_raw_aiohttp_c1",
            "sprawl_pool_c1",
        ):
            r = result[name]
            table.add_row(
                name,
                str(r["calls_per_s"]),
                str(r["calls_per_cpu_s"]),
                str(r["p50_ms"]),
                str(r["p99_ms"]),
            )
        console = Console()
        console.print(table)
        console.print(f"added p50: {result['added_p50_ms']} ms; memory: {result['memory']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
