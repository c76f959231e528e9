"""``orchestrate bench sync``: how fast a new version reaches every island over a slow link.

Every island reads the board through its own :class:`~orchestrator.bench.link.Link`, a serial
link of ``--link-mbit`` Mbit/s: a read is delivered once the link has carried its bytes after
every earlier read of that island (a token bucket on the board's read path, so the time follows
the bytes actually fetched), and each read, found or not, first takes a round trip of
``--link-rtt-ms`` (default 0; reads in flight together overlap theirs). Two views, one run each:

- **demo**: sprawl's tiny model (bf16), each island a real reference :class:`Engine` behind a
  :class:`Sidecar` (``activation="pause"``), reconciling from its own throttled board;
- **synthetic**: a ``--size-mb`` bf16 view (default 1024) of 32 MiB-or-smaller random tensors;
  an island is the verified view itself (no engine).

For each: **full** is shipping the full checkpoint over the link — version 0's anchor fetched,
checksummed and (demo) copied into the engine — which is also how the islands start. **sync** is
the time from the start of ``Board.publish`` of version 1 (``--density`` of the values moved by
±1 ulp, like an Adam step) to the moment the last island serves it (polling the pointer every
``--poll-ms``; islands start on a version while it is being streamed, chunk by chunk). Each
view reports ``patch_link_s`` (the patch's own link time: the limit), ``sync_s``, ``speedup``
(full / sync) and ``limit_ratio`` (``speedup`` / (full bytes / patch bytes); target ≥ 0.75).
``exact`` says each island's view (demo: the engine's live tensors) is bitwise equal to the
published one. The synthetic sync runs ``--repeats`` times (default 5; after the first, each
on a run of its own: version 0 published again and the islands reset to it, no link time
counted), since one sync on two shared cores varied up to 2× from run to run: its
``publish_s``, ``sync_s`` and what derives from them are the median, and ``runs`` lists each.

Synthetic also measures **catch-up** of an island 8 versions behind (versions 1..8 published at
the same density): one squashed patch (the board's plan: the ``from-00000000/`` chunks of
version 8) against the 8 deltas applied one after another, bytes and time over the link, both
checked bitwise. Demo also reports the engine pause (``orchestrator.bench.engine.pause_trials``,
p50/p99) on an island's engine, under load.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file

from orchestrator.bench.engine import pause_trials
from orchestrator.bench.link import Link, ThrottledBoard, add_link_flags, parse_flags
from orchestrator.bench.synthetic import View, adam_step, same_bits, synthetic_view
from policies.board import Board
from policies.serve.backends.reference import ReferenceBackend
from policies.serve.engine import Engine
from policies.serve.sidecar import Sidecar
from policies.wire.logs import configure


def _announced(board: Board, version: int) -> bool:
    """Whether ``version`` is published or being streamed (asked for together, as a sidecar
    does)."""
    latest, stream = board.latest_and_stream()
    return (latest or -1) >= version or (stream is not None and stream.version == version)


def against_the_limit(
    full_s: float, full_bytes: int, patch_bytes: int, sync_s: float, mbit: float
) -> dict[str, float]:
    """How a sync compares with its limit: ``patch_link_s`` (the link time of the patch alone),
    ``sync_s``, ``speedup`` (full checkpoint time / ``sync_s``) and ``limit_ratio`` (``speedup``
    / (``full_bytes`` / ``patch_bytes``): 1.0 is a sync as fast as its bytes allow)."""
    speedup = full_s / sync_s
    return {
        "patch_link_s": round(patch_bytes * 8 / (mbit * 1e6), 3),
        "sync_s": round(sync_s, 3),
        "speedup": round(speedup, 1),
        "limit_ratio": round(speedup / (full_bytes / patch_bytes), 3),
    }


def _timed_publish(board: Board, version: int, view: View) -> tuple[float, float, int]:
    """Publish; (start, end) perf-counter times and the delta's bytes."""
    t0 = time.perf_counter()
    m = board.publish(version, view, view_name="bfloat16")
    return t0, time.perf_counter(), m.bytes


class SyncRun(NamedTuple):
    """One sync: the publish's seconds, the seconds until the last island holds the version,
    whether every island's view is bitwise the published one, and the delta's bytes."""

    publish_s: float
    sync_s: float
    exact: bool
    patch_bytes: int


def _sync(
    pub: Board, boards: list[ThrottledBoard], held: list[View], view1: View, poll_s: float
) -> SyncRun:
    """Publish version 1 while every island (its board and the version-0 view it holds)
    follows it."""

    def follow(i: int) -> float:
        while not _announced(boards[i], 1):
            time.sleep(poll_s)
        boards[i].advance(held[i], 0, 1)  # chunk by chunk while version 1 is being streamed
        return time.perf_counter()

    with ThreadPoolExecutor(len(boards)) as pool:
        futs = [pool.submit(follow, i) for i in range(len(boards))]
        start, published, patch_bytes = _timed_publish(pub, 1, view1)
        served = max(f.result() for f in futs)
    exact = all(same_bits(h, view1) for h in held)
    return SyncRun(published - start, served - start, exact, patch_bytes)


def run_synthetic(
    root: Path,
    size_mb: int,
    density: float,
    mbit: float,
    islands: int,
    poll_s: float,
    repeats: int = 1,
    rtt_ms: float = 0.0,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    pub = Board(str(root), "synthetic")
    view0 = synthetic_view(size_mb)
    view_bytes = sum(t.nbytes for t in view0.values())
    pub.publish(0, view0, view_name="bfloat16")
    boards = [ThrottledBoard(str(root), "synthetic", Link(mbit, rtt_ms)) for _ in range(islands)]
    t0 = time.perf_counter()
    _, held0 = boards[0].load(0)  # the full checkpoint over the link, verified
    full_s = time.perf_counter() - t0
    full_bytes = boards[0].link.bytes
    held = [held0] + [{k: t.clone() for k, t in held0.items()} for _ in boards[1:]]
    view1 = adam_step(view0, density, gen)
    runs = [_sync(pub, boards, held, view1, poll_s)]
    for k in range(1, repeats):  # the same sync again, each on a run of its own
        run = f"synthetic-{k}"
        again = Board(str(root), run)
        again.publish(0, view0, view_name="bfloat16")
        for h in held:
            for name, t in h.items():
                t.copy_(view0[name])
        links = [ThrottledBoard(str(root), run, Link(mbit, rtt_ms)) for _ in range(islands)]
        runs.append(_sync(again, links, held, view1, poll_s))
        shutil.rmtree(root / run)
    held.clear()
    behind = [{k: t.clone() for k, t in view0.items()} for _ in range(2)]
    del view0  # the publisher holds what it still needs
    last = view1
    for v in range(2, 9):
        last = adam_step(last, density, gen)
        pub.publish(v, last, view_name="bfloat16")
    catch_up = {"behind": 8}
    for name, view in zip(("squashed", "chained"), behind, strict=True):
        lag = ThrottledBoard(str(root), "synthetic", Link(mbit, rtt_ms))
        hops = [(0, 8)] if name == "squashed" else [(v - 1, v) for v in range(1, 9)]
        t0 = time.perf_counter()
        patches = 0
        for have, want in hops:
            patches += len(lag.catch_up(have, want).steps)
            lag.advance(view, have, want)
        catch_up[name] = {  # type: ignore[assignment]
            "bytes": lag.link.bytes,
            "patches": patches,
            "s": round(time.perf_counter() - t0, 3),
        }
    catch_up["exact"] = all(same_bits(v, last) for v in behind)
    patch_bytes = runs[0].patch_bytes
    return {
        "size_mb": size_mb,
        "view_bytes": view_bytes,
        "islands": islands,
        "full": {"bytes": full_bytes, "s": round(full_s, 3)},
        "sync": {
            "patch_bytes": patch_bytes,
            "publish_s": round(statistics.median(r.publish_s for r in runs), 3),
        },
        **against_the_limit(
            full_s, full_bytes, patch_bytes, statistics.median(r.sync_s for r in runs), mbit
        ),
        "runs": [{"publish_s": round(r.publish_s, 3), "sync_s": round(r.sync_s, 3)} for r in runs],
        "exact": all(r.exact for r in runs),
        "catch_up": catch_up,
    }


async def _demo(
    root: Path,
    model: Path,
    density: float,
    mbit: float,
    islands: int,
    poll_s: float,
    rtt_ms: float = 0.0,
) -> tuple[dict[str, Any], Engine]:
    engines = [Engine(model, dtype=torch.bfloat16) for _ in range(islands)]
    weights = load_file(model / "model.safetensors")
    view0 = {k: weights[k].to(torch.bfloat16) for k in engines[0].live_tensors()}
    pub = Board(str(root), "demo")
    pub.create(model)
    pub.publish(0, view0, view_name="bfloat16")
    cars = [
        Sidecar(
            ReferenceBackend(engines[i]),
            ThrottledBoard(str(root), "demo", Link(mbit, rtt_ms)),
            poll_interval_s=poll_s,
            registry=CollectorRegistry(),
            activation="pause",
        )
        for i in range(islands)
    ]
    t0 = time.perf_counter()
    await cars[0].reconcile()  # the full checkpoint over the link, verified, into the engine
    full_s = time.perf_counter() - t0
    full_bytes = cars[0].board.link.bytes  # type: ignore[attr-defined]
    for car in cars[1:]:
        await car.reconcile()
    view1 = adam_step(view0, density, torch.Generator().manual_seed(2))
    done: list[float] = []

    async def follow(car: Sidecar) -> None:
        while car.applied_version != 1:
            await car.reconcile()
            await anyio.sleep(poll_s)
        done.append(time.perf_counter())

    async with anyio.create_task_group() as tg:
        for car in cars:
            tg.start_soon(follow, car)
        start, published, patch_bytes = await anyio.to_thread.run_sync(
            _timed_publish, pub, 1, view1
        )
    exact = all(same_bits(e.live_tensors(), view1) for e in engines)
    for e in engines[1:]:
        e.close()
    result = {
        "model": str(model),
        "view_bytes": sum(t.nbytes for t in view0.values()),
        "islands": islands,
        "full": {"bytes": full_bytes, "s": round(full_s, 3)},
        "sync": {"patch_bytes": patch_bytes, "publish_s": round(published - start, 3)},
        **against_the_limit(full_s, full_bytes, patch_bytes, max(done) - start, mbit),
        "exact": exact,
    }
    return result, engines[0]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench sync", description=__doc__)
    parser.add_argument("--model", type=Path, default=Path("runs/models/tiny"))
    parser.add_argument("--size-mb", type=int, default=1024)
    add_link_flags(parser, poll_ms=5.0)
    parser.add_argument("--islands", type=int, default=2)
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="syncs of the synthetic view (each from a fresh version 0); sync_s is the median",
    )
    parser.add_argument("--pause-trials", type=int, default=20)
    parser.add_argument("--pause-load", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parse_flags(parser, argv, ("size_mb", "islands", "repeats"))
    configure(level="warning")
    if not (args.model / "config.json").exists():
        from policies.model.build import init_model

        init_model(args.model, "tiny", seed=0)
    poll_s = args.poll_ms / 1e3
    with tempfile.TemporaryDirectory(prefix="sprawl-bench-sync-") as tmp:
        demo, engine = anyio.run(
            _demo,
            Path(tmp),
            args.model,
            args.density,
            args.link_mbit,
            args.islands,
            poll_s,
            args.link_rtt_ms,
        )
        try:
            demo["pause"] = pause_trials(
                engine, args.pause_trials, args.pause_load, args.density, max_tokens=32
            )
        finally:
            engine.close()
        synthetic = run_synthetic(
            Path(tmp),
            args.size_mb,
            args.density,
            args.link_mbit,
            args.islands,
            poll_s,
            args.repeats,
            args.link_rtt_ms,
        )
    result = {
        "link_mbit_s": args.link_mbit,
        "link_rtt_ms": args.link_rtt_ms,
        "density": args.density,
        "torch_threads": torch.get_num_threads(),
        "demo": demo,
        "synthetic": synthetic,
    }
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for name, r in (("demo", demo), ("synthetic", synthetic)):
            sys.stdout.write(
                f"{name}: full {r['full']['s']} s, sync {r['sync_s']} s ({r['speedup']}x; "
                f"limit {r['patch_link_s']} s, ratio {r['limit_ratio']}), exact={r['exact']}\n"
            )
        cu = synthetic["catch_up"]
        sys.stdout.write(
            f"catch-up 8 behind: squashed {cu['squashed']}, chained {cu['chained']}\n"
            f"pause: p50 {demo['pause']['p50_ms']} ms, p99 {demo['pause']['p99_ms']} ms\n"
        )
    return 0
