"""``orchestrate bench publish``: sharded publish time and peak memory per rank, by world size.

For each world size in ``--ranks`` (default ``1,2``) it starts that many processes on one
machine (a gloo process group on loopback). Together they hold a ``--size-mb`` bf16 view (default
1024; the tensors of :func:`orchestrator.bench.synthetic.synthetic_view`'s shapes, each sharded by
rows as FSDP2 ``Shard(0)`` ``DTensor``s, every rank generating only its own rows), publish it as
version 0 (an anchor) with :class:`policies.board.ShardedPublisher`, move ``--density`` of the
values by ±1 ulp (:func:`orchestrator.bench.synthetic.adam_step`, on each rank's rows) and publish
version 1 (a delta). Per rank it reports ``publish_s`` (version 1, from a barrier until
``publish`` returns on that rank, the commit included), ``anchor_s`` (version 0) and
``peak_rss_bytes`` (the process's peak resident set, the interpreter and torch included; also
``baseline_rss_bytes``, measured before the view was built). Per world size, ``publish_s`` is the
slowest rank's. Every rank runs pinned to its own cores, the same number in every world size
(``cores_per_rank``: the machine's cores over the largest world size), as on a cluster where each
rank brings its own; the code's thread pools still size themselves by the machine's core count.
The baseline measured in the same run is world size 1 (the whole view on one process, as
``Board.publish`` would hold it): ``speedup`` is its ``publish_s`` over the largest
world's and ``memory_ratio`` the largest world's highest per-rank peak over its peak
(``net_memory_ratio``: the same net of each process's baseline; None when a view so small left
the 1-rank peak at its baseline). Targets: 2 ranks ≥ 1.7× faster,
per-rank memory ≤ 0.6× of one rank's. ``load_avg`` records the machine's 1-minute load before
each world size ran (the ranks share the machine's cores, ``cpu_count``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

CPUS = os.cpu_count() or 1


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(board: str, size_mb: int, density: float, cores: list[int]) -> dict[str, Any]:
    """One rank (``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment), pinned to ``cores``:
    its figures."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from orchestrator.bench.synthetic import adam_step, synthetic_shapes
    from policies.board import BoardOptions, ShardedPublisher
    from policies.wire.logs import configure

    configure(level="warning")
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    baseline = _peak_rss()
    gen = torch.Generator().manual_seed(1000 + rank)
    shapes = synthetic_shapes(size_mb)
    local: dict[str, torch.Tensor] = {}
    for name, full in shapes.items():
        mine, _ = compute_local_shape_and_global_offset(full, mesh, [Shard(0)])
        local[name] = torch.randn(*mine, generator=gen).to(torch.bfloat16)

    def state(
        view: dict[str, torch.Tensor], full: dict[str, tuple[int, int]] = shapes
    ) -> dict[str, torch.Tensor]:
        return {
            k: DTensor.from_local(
                t,
                mesh,
                [Shard(0)],
                run_check=False,
                shape=torch.Size(full[k]),
                stride=(full[k][1], 1),
            )
            for k, t in view.items()
        }

    warm = ShardedPublisher(board, "warmup")  # one-time costs (kernel loads) left out
    small = {"w": torch.randn(64, 64, generator=gen).to(torch.bfloat16)}
    warm.publish(0, state(small, {"w": (64 * world, 64)}), view_name="bf16")
    warm.publish(1, state(adam_step(small, 0.1, gen), {"w": (64 * world, 64)}), view_name="bf16")
    pub = ShardedPublisher(board, "bench", options=BoardOptions())
    dist.barrier()
    t0 = time.perf_counter()
    pub.publish(0, state(local), view_name="bf16")
    anchor_s = time.perf_counter() - t0
    moved = adam_step(local, density, gen)
    dist.barrier()
    t0 = time.perf_counter()
    m = pub.publish(1, state(moved), view_name="bf16")
    publish_s = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "publish_s": round(publish_s, 3),
        "anchor_s": round(anchor_s, 3),
        "peak_rss_bytes": _peak_rss(),
        "baseline_rss_bytes": baseline,
        "kind": m.kind,
        "delta_bytes": m.bytes,
    }


def run_world(
    world: int, size_mb: int, density: float, root: Path, per_rank: int
) -> dict[str, Any]:
    """Start ``world`` ranks, each pinned to its own ``per_rank`` cores, publishing to a fresh
    board under ``root``; their figures."""
    from policies.serve.backends.base import free_port

    load = os.getloadavg()[0]
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(per_rank),
        }
        cores = ",".join(str((rank * per_rank + i) % CPUS) for i in range(per_rank))
        cmd = [
            sys.executable, "-m", "orchestrator.bench.publish", "--worker",
            "--board", str(root / f"world-{world}"), "--size-mb", str(size_mb),
            "--density", str(density), "--cores", cores,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    ranks = []
    for rank, p in enumerate(procs):
        out, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit(
                f"orchestrate bench publish: rank {rank} of {world} exited {p.returncode}"
            )
        ranks.append(json.loads(out.strip().splitlines()[-1]))
    return {
        "ranks": world,
        "publish_s": max(r["publish_s"] for r in ranks),
        "anchor_s": max(r["anchor_s"] for r in ranks),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "load_avg": round(load, 2),
        "per_rank": ranks,
    }


def run(worlds: list[int], size_mb: int, density: float) -> dict[str, Any]:
    per_rank = max(1, CPUS // max(worlds))
    with tempfile.TemporaryDirectory(prefix="sprawl-bench-publish-") as tmp:
        results = [run_world(w, size_mb, density, Path(tmp), per_rank) for w in worlds]
    base, top = results[0], results[-1]

    def net(r: dict[str, Any]) -> int:
        return max(int(x["peak_rss_bytes"]) - int(x["baseline_rss_bytes"]) for x in r["per_rank"])

    return {
        "size_mb": size_mb,
        "density": density,
        "cpu_count": CPUS,
        "cores_per_rank": per_rank,
        "worlds": results,
        "speedup": round(base["publish_s"] / top["publish_s"], 2),
        "memory_ratio": round(top["peak_rss_bytes"] / base["peak_rss_bytes"], 3),
        "net_memory_ratio": round(net(top) / net(base), 3) if net(base) else None,
    }


def _ranks(text: str) -> list[int]:
    try:
        worlds = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks {text!r}: use world sizes like 1,2") from None
    if not worlds or any(w < 1 for w in worlds):
        raise argparse.ArgumentTypeError(f"--ranks {text!r}: world sizes must be ≥ 1")
    return worlds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench publish", description=__doc__)
    parser.add_argument("--ranks", type=_ranks, default=[1, 2], help="world sizes, e.g. 1,2")
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--board", help=argparse.SUPPRESS)
    parser.add_argument("--cores", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        cores = [int(c) for c in args.cores.split(",")]
        sys.stdout.write(json.dumps(worker(args.board, args.size_mb, args.density, cores)) + "\n")
        sys.stdout.flush()
        # gloo's run-loop thread frees the last barrier's work (a decref, under the GIL) after the
        # barrier has returned; an interpreter already finalising kills that thread mid-unwind and
        # libstdc++ aborts the rank (1 run in 6 here). A worker has nothing left to clean up.
        os._exit(0)
    result = run(args.ranks, args.size_mb, args.density)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    for r in result["worlds"]:
        sys.stdout.write(
            f"{r['ranks']} rank(s): publish {r['publish_s']} s (anchor {r['anchor_s']} s), "
            f"peak RSS per rank {r['peak_rss_bytes'] / 2**20:.0f} MiB (load {r['load_avg']})\n"
        )
    sys.stdout.write(
        f"speedup {result['speedup']}x, memory ratio {result['memory_ratio']} "
        f"(net of the interpreter {result['net_memory_ratio']})\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
