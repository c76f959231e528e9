"""``orchestrate bench codec``: the patch codec against memcpy and two baselines, in one run.

A synthetic bf16 view (``--size-mb``, split into 32 MiB tensors, N(0, 0.02) weights) gets
Adam-like changes at each density: positions uniform at random, 95% of moves ±1 unit in the last
place, 5% ±2..4 units. Per density it reports the codec's ``bits_per_changed_element``,
``patch_bytes``, ``full_bytes``, ``encode_gbps`` (checksums already known, as a publisher has
them), ``encode_cold_gbps`` (hashing included), ``apply_gbps`` (in place, base vouched by digest,
every written tensor verified), ``apply_unverified_gbps`` and ``exact``; the same figures for
*int32 index + raw value* and *dense XOR + zstd level 1*; and ``memcpy_gbps`` (``copy_`` of the
whole view) measured in the same run. Throughputs are bytes of view per second (GB = 1e9 B);
each timing is the best of ``--repeats``. Every timed run follows a timed memcpy (then a pause,
:data:`SETTLE_S`, for the copy's threads to go idle), and the ratios
``encode_vs_memcpy``, ``apply_time_vs_copy`` and ``apply_unverified_time_vs_copy`` compare each
codec timing with the memcpy timed next to it; ``apply_vs_int32_scatter`` and
``apply_unverified_vs_int32_scatter`` are the codec's apply time, verified (as a reader applies:
the checksum from the words written, the base words it changes against the patch's) and not,
over the int32 scatter's of the same changes.

``--device cuda`` copies the view to the GPU and the codec's encoder scans it there
(:mod:`policies.codec.scan`; its row's ``scan_device``, and ``device_memcpy_gbps``, a copy of the
view on the GPU, which its ``encode_vs_memcpy`` pairs with); the patch must be the CPU encoder's
bytes for the row to be ``exact``. Applying, and the baselines, run on the host either way.

The int32 baseline applies with a compiled scatter of its stored values (one thread per tensor,
as the codec): no decoding at all, so its ``apply_time_vs_copy`` is the memory floor of any
in-place sparse apply on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import zstandard

from policies.codec import apply_patch, checksums, encode_patch, read_patch_header, state_digest
from policies.codec.kernels import jit
from policies.wire.logs import quiet_logs

DENSITIES = (0.001, 0.01, 0.03, 0.1)
_TENSOR_ELEMS = 1 << 24

State = dict[str, torch.Tensor]

SETTLE_S = 0.05
"""Untimed pause between a paired copy and the run it is paired with. ``copy_`` runs on torch's
OpenMP threads, which spin for a few ms after it (libgomp's default wait policy: 300 000 pause
loops) and took a core from the timed run: on the 2-core dev VM a thread of the codec's started
2.5–5 ms late, and the timed encode was ~10 ms slower (45–49 ms against 36)."""


class Timer:
    """Best-of-``repeats`` timings, each run paired with a copy of the whole view just before it.

    On a shared machine the memory bandwidth swings from second to second; a ratio between a
    codec timing and the memcpy timed moments before it is steadier than one between timings
    taken minutes apart.
    """

    def __init__(self, view: State, repeats: int) -> None:
        self._view, self._dst, self.repeats = view, _copy(view), repeats
        self.copies: list[float] = []

    def _copy_time(self) -> float:
        start = time.perf_counter()
        for k, v in self._view.items():
            self._dst[k].copy_(v)
        sync(self._view)
        return time.perf_counter() - start

    def best(
        self, fn: Callable[[Any], Any], setup: Callable[[], Any] = lambda: None
    ) -> tuple[float, float]:
        """Best wall time of ``fn(setup())`` (``setup`` untimed) and best of the paired copies."""
        best = copy = float("inf")
        for _ in range(self.repeats):
            arg = setup()
            copy = min(copy, self._copy_time())
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            fn(arg)
            best = min(best, time.perf_counter() - start)
        self.copies.append(copy)
        return best, copy


def sync(view: State) -> None:
    """Wait for the device work queued on ``view``'s tensors (a no-op on CPU)."""
    devices = {t.device for t in view.values() if t.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)


def make_view(size_mb: int, seed: int, device: str = "cpu") -> State:
    """A bf16 view of about ``size_mb`` MiB in tensors of at most 32 MiB, drawn on ``device``
    (a device's generator draws other values than the CPU's for one seed)."""
    gen = torch.Generator(device).manual_seed(seed)
    total = size_mb * (1 << 20) // 2
    out: State = {}
    i = 0
    while total > 0:
        n = min(total, _TENSOR_ELEMS)
        cols = 4096 if n % 4096 == 0 else 1
        w = torch.randn(n // cols, cols, generator=gen, dtype=torch.float32, device=device) * 0.02
        out[f"layers.{i}.weight"] = w.to(torch.bfloat16)
        total -= n
        i += 1
    return out


def adam_like(view: State, density: float, seed: int) -> State:
    """A copy of ``view`` with ``density`` of its values moved by a few units in the last place."""
    rng = np.random.default_rng(seed)
    out: State = {}
    for name, t in view.items():
        bits = t.clone().reshape(-1).view(torch.int16).numpy()
        n = max(1, round(bits.size * density))
        pos = rng.choice(bits.size, n, replace=False)
        step = rng.choice(np.array([-1, 1], dtype=np.int16), n)
        big = rng.random(n) < 0.05
        step[big] *= rng.integers(2, 5, int(big.sum())).astype(np.int16)
        bits[pos] += step
        out[name] = torch.from_numpy(bits).view(torch.bfloat16).reshape(t.shape)
    return out


def _copy(state: State) -> State:
    return {k: v.clone() for k, v in state.items()}


def same_bits(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _row(
    name: str,
    patch_bytes: int,
    changed: int,
    full: int,
    enc: tuple[float, float],
    app: tuple[float, float],
    exact: bool,
) -> dict[str, Any]:
    """A report row; ``enc``/``app`` are (codec, paired copy) seconds from :meth:`Timer.best`."""
    return {
        "codec": name,
        "patch_bytes": patch_bytes,
        "bits_per_changed_element": 8 * patch_bytes / max(changed, 1),
        "full_bytes": full,
        "encode_gbps": gbps(full, enc[0]),
        "encode_vs_memcpy": enc[1] / enc[0],
        "apply_gbps": gbps(full, app[0]),
        "apply_time_vs_copy": app[0] / app[1],
        "exact": exact,
    }


def _bench_sprawl(
    base: State, target: State, full: int, timer: Timer, device: str
) -> dict[str, Any]:
    """The codec's row; encoding scans the copies of ``base``/``target`` on ``device`` (its
    ``encode_vs_memcpy`` pairs with a copy of the view there), applying works on the host."""
    bsums, tsums = checksums(base), checksums(target)
    bdig = state_digest(base, known=bsums)
    patch = encode_patch(base, target, base_digest=bdig, target_checksums=tsums)
    db, dt = ({k: v.to(device) for k, v in s.items()} for s in (base, target))
    on_device = timer if device == "cpu" else Timer(db, timer.repeats)
    same = encode_patch(db, dt, base_digest=bdig, target_checksums=tsums) == patch
    enc = on_device.best(lambda _: encode_patch(db, dt, base_digest=bdig, target_checksums=tsums))
    cold = on_device.best(lambda _: encode_patch(db, dt))
    app = timer.best(  # verified as an island verifies: from the words written
        lambda s: apply_patch(s, patch, base_digest=bdig, base_checksums=bsums), lambda: _copy(base)
    )
    raw = timer.best(
        lambda s: apply_patch(s, patch, base_digest=bdig, verify=False), lambda: _copy(base)
    )
    result = apply_patch(_copy(base), patch, base_digest=bdig)
    changed = read_patch_header(patch).changed
    row = _row("sprawl", len(patch), changed, full, enc, app, same and same_bits(result, target))
    row.update(
        scan_device=device,
        changed=changed,
        encode_cold_gbps=gbps(full, cold[0]),
        apply_unverified_gbps=gbps(full, raw[0]),
        apply_unverified_time_vs_copy=raw[0] / raw[1],
    )
    if device != "cpu":
        row["device_memcpy_gbps"] = gbps(full, min(on_device.copies))
    return row


def _index_raw(base: State, target: State) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for k in base:
        b = base[k].reshape(-1).view(torch.int16).numpy()
        t = target[k].reshape(-1).view(torch.int16).numpy()
        idx = np.flatnonzero(b != t).astype(np.int32)
        out[k] = (idx, t[idx])
    return out


@jit
def _scatter(units: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
    for i in range(idx.size):
        units[idx[i]] = vals[i]


def _apply_index_raw(state: State, p: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """A compiled scatter of the stored values, one thread per tensor like the codec's apply:
    no decoding at all, so its time is the memory floor of any in-place sparse apply."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        jobs = [
            pool.submit(_scatter, state[k].reshape(-1).view(torch.int16).numpy(), idx, vals)
            for k, (idx, vals) in p.items()
        ]
    for job in jobs:
        job.result()


def _bench_index_raw(base: State, target: State, full: int, timer: Timer) -> dict[str, Any]:
    patch = _index_raw(base, target)
    enc = timer.best(lambda _: _index_raw(base, target))
    app = timer.best(lambda s: _apply_index_raw(s, patch), lambda: _copy(base))
    state = _copy(base)
    _apply_index_raw(state, patch)
    changed = sum(i.size for i, _ in patch.values())
    return _row("int32_index_raw", 6 * changed, changed, full, enc, app, same_bits(state, target))


def _xor_zstd(base: State, target: State) -> dict[str, bytes]:
    z = zstandard.ZstdCompressor(level=1)
    return {
        k: z.compress((base[k].view(torch.int16) ^ target[k].view(torch.int16)).numpy().data)
        for k in base
    }


def _apply_xor_zstd(state: State, p: dict[str, bytes]) -> None:
    d = zstandard.ZstdDecompressor()
    for k, blob in p.items():
        flat = state[k].reshape(-1).view(torch.int16)
        flat ^= torch.frombuffer(bytearray(d.decompress(blob)), dtype=torch.int16)


def _bench_xor_zstd(base: State, target: State, full: int, timer: Timer) -> dict[str, Any]:
    patch = _xor_zstd(base, target)
    enc = timer.best(lambda _: _xor_zstd(base, target))
    app = timer.best(lambda s: _apply_xor_zstd(s, patch), lambda: _copy(base))
    state = _copy(base)
    _apply_xor_zstd(state, patch)
    changed = sum(
        int((base[k].view(torch.int16) != target[k].view(torch.int16)).sum()) for k in base
    )
    size = sum(len(b) for b in patch.values())
    return _row("dense_xor_zstd1", size, changed, full, enc, app, same_bits(state, target))


def run(
    size_mb: int, repeats: int, densities: tuple[float, ...] = DENSITIES, device: str = "cpu"
) -> dict[str, Any]:
    """Run the whole benchmark and return its report (the codec's scan on ``device``).

    Every codec timing is paired with a memcpy timed just before it (:class:`Timer`); a row's
    ratios use those pairs and its ``memcpy_gbps`` is the best of its pairs, the report's the
    best of all. The codec's row also compares its verified and unverified apply with the int32
    scatter of the same changes (``apply_vs_int32_scatter``,
    ``apply_unverified_vs_int32_scatter``, ratios of times).
    """
    base = make_view(size_mb, seed=0)
    full = sum(t.numel() * t.element_size() for t in base.values())
    rows = []
    for i, density in enumerate(densities):
        target = adam_like(base, density, seed=i + 1)
        timer = Timer(base, repeats)
        sprawl = _bench_sprawl(base, target, full, timer, device)
        sprawl.update(density=density, memcpy_gbps=gbps(full, min(timer.copies)))
        rows.append(sprawl)
        for bench in (_bench_index_raw, _bench_xor_zstd):
            timer = Timer(base, repeats)
            row = bench(base, target, full, timer)
            row.update(density=density, memcpy_gbps=gbps(full, min(timer.copies)))
            rows.append(row)
        scatter_gbps = rows[-2]["apply_gbps"]  # the int32 baseline of this density
        sprawl["apply_vs_int32_scatter"] = scatter_gbps / sprawl["apply_gbps"]
        sprawl["apply_unverified_vs_int32_scatter"] = scatter_gbps / sprawl["apply_unverified_gbps"]
    return {
        "size_mb": size_mb,
        "full_bytes": full,
        "memcpy_gbps": max(r["memcpy_gbps"] for r in rows),
        "threads": torch.get_num_threads(),
        "scan_device": device,
        "rows": rows,
    }


def _table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"patch codec on a {report['size_mb']} MiB bf16 view — best memcpy "
        f"{report['memcpy_gbps']:.2f} GB/s ({report['threads']} threads); ratios use the "
        "memcpy timed next to each timing",
        caption="int32_index_raw applies with a compiled scatter and decodes nothing: its apply "
        "time is the memory floor of any in-place sparse apply on this machine",
    )
    for col in (
        "density",
        "codec",
        "bits/changed",
        "patch MB",
        "encode GB/s",
        "encode/memcpy",
        "apply GB/s",
        "apply/copy time",
        "unverified",
        "apply/scatter",
        "unverified/scatter",
        "exact",
    ):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        table.add_row(
            f"{r['density']:.1%}",
            r["codec"],
            f"{r['bits_per_changed_element']:.2f}",
            f"{r['patch_bytes'] / 1e6:.2f}",
            f"{r['encode_gbps']:.2f}",
            f"{r['encode_vs_memcpy']:.0%}",
            f"{r['apply_gbps']:.2f}",
            f"{r['apply_time_vs_copy']:.0%}",
            f"{r['apply_unverified_time_vs_copy']:.0%}" if "apply_unverified_gbps" in r else "–",
            f"{r['apply_vs_int32_scatter']:.2f}×" if r["codec"] == "sprawl" else "–",
            f"{r['apply_unverified_vs_int32_scatter']:.2f}×" if r["codec"] == "sprawl" else "–",
            str(r["exact"]),
        )
    Console().print(table)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench codec", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=256, help="size of the bf16 view in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="timings are the best of this")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--churn",
        action="store_true",
        help="instead: changed fraction of quantized views per scale policy",
    )
    parser.add_argument("--lr", type=float, default=1e-6, help="--churn: Adam step size")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the codec's change scan runs (the view is copied there for encoding)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("orchestrate bench codec: --device cuda: no CUDA GPU is available here")
    if args.churn:
        from orchestrator.bench.churn import churn_table, scale_churn

        with quiet_logs():
            rows = scale_churn(2048, 4096, args.lr)
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            churn_table(rows, args.lr)
        return 0
    with quiet_logs():
        report = run(args.size_mb, args.repeats, device=args.device)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _table(report)
    return 0 if all(r["exact"] for r in report["rows"]) else 1
