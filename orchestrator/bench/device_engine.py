"""``bench device`` part ``engine``: the reference engine on the device, its throughput and its
activation pause.

The ``engine_model`` (built under ``--work``) is served in bf16 by one
:class:`policies.serve.engine.Engine` on the device. ``throughput``: ``tokens_per_s`` of 1 and of
``concurrency`` requests submitted together, ``max_tokens`` each, best of ``rounds``
(:func:`orchestrator.bench.engine.throughput`); the single request is the same-run baseline
(``speedup``).

``activation_pause``: a patch moving ``pause_density`` of the served values by one unit in the
last place (:func:`orchestrator.bench.engine.bumped`, as ``bench engine`` does) is encoded on the
host, and so is its inverse; each is applied (verified) to a host copy of its base, as a sidecar
stages a version while the engine serves. Then, under ``concurrency`` requests of load, the
engine activates the two staged views in turn, ``pause_trials`` times, in ``pause`` mode and
with only the tensors the patch changed, as the reference backend
(:mod:`policies.serve.backends.reference`) does: ``p50_ms``, ``p99_ms``, ``max_ms`` of the pause
(generation held), ``to_step_boundary_*_ms``, and ``step_ms`` (a decode step under that load).
``copy_p50_ms``: the same tensors copied from the host into tensors on the device outside the
engine, the same-run floor of this way of activating. ``exact``: each staged view is the version
it was staged to, and afterwards the engine's live tensors are the last view activated, bit for
bit. Target (issue #44): p50 ≤ 5 ms on an H200 for the ~1 B model.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from orchestrator.bench.codec import same_bits
from orchestrator.bench.device_models import model_dir, parameters
from orchestrator.bench.device_scale import Device, Report, Scale
from orchestrator.bench.engine import bench_requests, bumped, percentile, throughput
from policies.codec import apply_patch, encode_patch, read_patch_header
from policies.serve.engine import Engine

State = dict[str, torch.Tensor]


class Load:
    """``requests`` generations kept in flight on ``engine`` from a thread, until :meth:`stop`."""

    def __init__(self, engine: Engine, requests: int, max_tokens: int) -> None:
        self.engine, self.requests, self.max_tokens = engine, requests, max_tokens
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_busy, daemon=True)

    def _keep_busy(self) -> None:
        round_ = 0
        while not self._stop.is_set():
            reqs = bench_requests(self.requests, self.max_tokens, round_)
            futures = [self.engine.batcher.submit(q, *self.engine.validate(q)) for q in reqs]
            for f in futures:
                f.result()
            round_ += 1

    def __enter__(self) -> Load:
        self._thread.start()
        time.sleep(0.2)  # the batch is decoding
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def staged_pair(live: State, density: float) -> tuple[State, State, set[str], int, bool]:
    """Host copies of the live view (``a``) and of it moved by a patch (``b``), each staged from
    the other by applying the host-encoded patch, verified; the names the patch changes, its
    bytes, and whether each staged view is the version it was staged to, bit for bit."""
    a = {k: t.detach().cpu().clone() for k, t in live.items()}
    b = bumped(a, density, torch.Generator().manual_seed(0))
    forward, back = encode_patch(a, b), encode_patch(b, a)
    staged_b = apply_patch({k: t.clone() for k, t in a.items()}, forward)
    staged_a = apply_patch({k: t.clone() for k, t in b.items()}, back)
    exact = same_bits(staged_b, b) and same_bits(staged_a, a)
    changed = {r.name for r in read_patch_header(forward).tensors if r.changed}
    return staged_a, staged_b, changed, len(forward), exact


def _copy_ms(view: State, live: State, names: set[str], trials: int) -> float:
    """p50 of copying ``names`` of ``view`` into fresh tensors shaped like the live ones."""
    scratch = {n: torch.empty_like(live[n]) for n in names}
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for n in names:
            scratch[n].copy_(view[n].to(device=scratch[n].device, dtype=scratch[n].dtype))
        if scratch and next(iter(scratch.values())).device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return percentile(times, 0.5)


def pause_trials(engine: Engine, scale: Scale) -> dict[str, Any]:
    """The activation pause figures (module docstring)."""
    live = engine.live_tensors()
    staged_a, staged_b, changed, patch_bytes, staged = staged_pair(live, scale.pause_density)
    copy_ms = _copy_ms(staged_b, live, changed, max(3, scale.pause_trials // 4))
    pauses: list[float] = []
    waits: list[float] = []
    with Load(engine, scale.concurrency, scale.max_tokens):
        for v in range(1, scale.pause_trials + 1):
            view = staged_b if v % 2 else staged_a
            done = engine.activate(view, version=v, mode="pause", only=changed)
            pauses.append(done.held_s * 1e3)
            waits.append(done.wait_s * 1e3)
            time.sleep(0.02)
        steps0, t0 = engine.batcher.steps, time.perf_counter()
        time.sleep(0.5)
        step_ms = (time.perf_counter() - t0) * 1e3 / max(1, engine.batcher.steps - steps0)
    now = {k: t.detach().cpu() for k, t in engine.live_tensors().items()}
    return {
        "trials": scale.pause_trials,
        "load_requests": scale.concurrency,
        "density": scale.pause_density,
        "patch_bytes": patch_bytes,
        "tensors_changed": len(changed),
        "p50_ms": percentile(pauses, 0.5),
        "p99_ms": percentile(pauses, 0.99),
        "max_ms": percentile(pauses, 1.0),
        "to_step_boundary_p50_ms": percentile(waits, 0.5),
        "to_step_boundary_p99_ms": percentile(waits, 0.99),
        "copy_p50_ms": copy_ms,
        "step_ms": round(step_ms, 3),
        "exact": staged and same_bits(now, staged_b if scale.pause_trials % 2 else staged_a),
    }


def run(scale: Scale, device: Device, work: Path, report: Report) -> None:
    """The engine part, written to ``report`` as it comes."""
    path = model_dir(work, scale.engine_model)
    engine = Engine(path, device=device, dtype=torch.bfloat16)
    try:
        engine.activate(load_file(path / "model.safetensors"), version=0)
        report.update(
            model=scale.engine_model,
            parameters=parameters(path),
            view_bytes=sum(t.nbytes for t in engine.live_tensors().values()),
            max_tokens=scale.max_tokens,
        )
        one = throughput(engine, 1, scale.max_tokens, scale.rounds)
        many = throughput(engine, scale.concurrency, scale.max_tokens, scale.rounds)
        many["speedup"] = round(many["tokens_per_s"] / one["tokens_per_s"], 2)
        report.update(throughput=[one, many])
        report.update(activation_pause=pause_trials(engine, scale))
    finally:
        engine.close()
