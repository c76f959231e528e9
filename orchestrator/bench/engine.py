"""``orchestrate bench engine``: batched-engine throughput and version-activation pause, one run.

Throughput: ``--concurrency`` levels (default 1, 4, 16) of requests submitted together to one
:class:`Engine` (the batch scheduler, no HTTP), each ``--max-tokens`` tokens at temperature 1
with its own seed, repeated ``--rounds`` times; reported as generated tokens per second. The
baseline is the single-request figure measured in the same run, and ``speedup`` is each level's
tokens/s over it (the target for 16 concurrent requests on CPU is ≥ 4×).

Pause: while ``--pause-load`` requests generate, the engine takes ``2 × --pause-trials``
versions with ``mode="pause"``; each is a real bitwise patch (``policies.codec``) changing
``--density`` of the served bf16 values by one unit in the last place. Odd versions take the
sidecar's path — the patch is decoded and verified into a staged view while the engine keeps
serving, then copied into the live tensors at a step boundary — and their pause (``p50_ms``,
``p99_ms``: generation held, no token produced) is the figure of merit; even versions decode and
apply the patch inside the pause, for comparison (``patch_in_pause_*``). Also reported: the time
to reach a step boundary (at most one decode step in progress) and the mean step time, in the
same run. Target: p99 ≤ 50 ms on the demo model.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from policies.codec import apply_patch, encode_patch
from policies.serve.engine import Engine
from policies.wire.lane import GenerateRequest
from policies.wire.logs import configure

PROMPT = list(range(3, 35))


def bench_requests(k: int, max_tokens: int, round_: int) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            prompt_token_ids=PROMPT, max_tokens=max_tokens, seed=1000 * round_ + i, temperature=1.0
        )
        for i in range(k)
    ]


def throughput(engine: Engine, k: int, max_tokens: int, rounds: int) -> dict[str, float]:
    """Tokens/s with ``k`` requests in flight together, best of ``rounds``."""
    best = 0.0
    for r in range(rounds):
        reqs = bench_requests(k, max_tokens, r)
        t0 = time.perf_counter()
        futs = [engine.batcher.submit(q, *engine.validate(q)) for q in reqs]
        tokens = sum(len(c.token_ids) for f in futs for c in f.result().choices)
        best = max(best, tokens / (time.perf_counter() - t0))
    return {"concurrency": k, "tokens_per_s": round(best, 1)}


def bumped(view: dict[str, torch.Tensor], density: float, gen: torch.Generator) -> dict[str, Any]:
    """A copy of ``view`` with ``density`` of its values moved by one unit in the last place."""
    out = {}
    for name, t in view.items():
        bits = t.detach().clone().contiguous().view(torch.int16).reshape(-1)
        n = max(1, int(bits.numel() * density))
        idx = torch.randint(0, bits.numel(), (n,), generator=gen)
        bits[idx] += 1
        out[name] = bits.view(t.dtype).reshape(t.shape)
    return out


def pause_trials(
    engine: Engine, trials: int, load: int, density: float, max_tokens: int
) -> dict[str, float]:
    """Activation pauses (ms) under load: ``trials`` staged, ``trials`` patched in the pause."""
    gen = torch.Generator().manual_seed(0)
    stop = threading.Event()

    def keep_busy() -> None:
        round_ = 0
        while not stop.is_set():
            futs = [
                engine.batcher.submit(q, *engine.validate(q))
                for q in bench_requests(load, max_tokens, round_)
            ]
            for f in futs:
                f.result()
            round_ += 1

    worker = threading.Thread(target=keep_busy, daemon=True)
    worker.start()
    pauses: list[float] = []
    waits: list[float] = []
    in_pause_patch: list[float] = []
    patch_bytes = 0
    try:
        time.sleep(0.2)
        for v in range(1, 2 * trials + 1):
            base = {k: t.detach().clone() for k, t in engine.live_tensors().items()}
            patch = encode_patch(base, bumped(base, density, gen))
            patch_bytes = len(patch)
            if v % 2:
                # the sidecar's path: decode + verify into a staged view while serving, then
                # copy it into the live tensors at a step boundary
                apply_patch(base, patch)
                done = engine.activate(base, version=v, mode="pause")
                pauses.append(done.held_s * 1e3)
                waits.append(done.wait_s * 1e3)
            else:
                # for comparison: decode and apply the patch inside the pause
                done = engine.apply(partial(apply_patch, patch=patch), version=v, mode="pause")
                in_pause_patch.append(done.held_s * 1e3)
            time.sleep(0.02)
    finally:
        stop.set()
        worker.join()
    steps0, t0 = engine.batcher.steps, time.perf_counter()
    futs = [
        engine.batcher.submit(q, *engine.validate(q)) for q in bench_requests(load, max_tokens, 99)
    ]
    for f in futs:
        f.result()
    step_ms = (time.perf_counter() - t0) * 1e3 / max(1, engine.batcher.steps - steps0)
    return {
        "trials": trials,
        "load_requests": load,
        "density": density,
        "patch_bytes": patch_bytes,
        "p50_ms": percentile(pauses, 0.5),
        "p99_ms": percentile(pauses, 0.99),
        "max_ms": percentile(pauses, 1.0),
        "patch_in_pause_p50_ms": percentile(in_pause_patch, 0.5),
        "patch_in_pause_p99_ms": percentile(in_pause_patch, 0.99),
        "to_step_boundary_p50_ms": percentile(waits, 0.5),
        "to_step_boundary_p99_ms": percentile(waits, 0.99),
        "step_ms": round(step_ms, 3),
    }


def percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench engine", description=__doc__)
    parser.add_argument("--model", type=Path, default=Path("runs/models/tiny"))
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pause-trials", type=int, default=50)
    parser.add_argument("--pause-load", type=int, default=16)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    configure(level="warning")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (args.model / "config.json").exists():
        from policies.model.build import init_model

        init_model(args.model, "tiny", seed=0)
    engine = Engine(args.model, dtype=torch.bfloat16)
    engine.activate(load_file(args.model / "model.safetensors"), version=0)
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
        rows = [throughput(engine, k, args.max_tokens, args.rounds) for k in levels]
        base = next((r["tokens_per_s"] for r in rows if r["concurrency"] == 1), None)
        if base is None:
            base = throughput(engine, 1, args.max_tokens, args.rounds)["tokens_per_s"]
        for r in rows:
            r["speedup"] = round(r["tokens_per_s"] / base, 2)
        pause = pause_trials(
            engine, args.pause_trials, args.pause_load, args.density, args.max_tokens
        )
    finally:
        engine.close()
    result = {
        "model": str(args.model),
        "dtype": "bfloat16",
        "max_tokens": args.max_tokens,
        "torch_threads": torch.get_num_threads(),
        "baseline_single_tokens_per_s": base,
        "throughput": rows,
        "activation_pause": pause,
    }
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for r in rows:
            sys.stdout.write(
                f"{r['concurrency']:>3} concurrent: {r['tokens_per_s']:>9.1f} tok/s "
                f"({r['speedup']}x single)\n"
            )
        sys.stdout.write(
            f"pause: p50 {pause['p50_ms']} ms, p99 {pause['p99_ms']} ms "
            f"(step {pause['step_ms']} ms, {pause['patch_bytes']} B patch)\n"
        )
    return 0
