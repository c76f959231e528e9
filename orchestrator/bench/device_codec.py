"""``bench device`` part ``codec``: the codec's change scan + encode on the view's own device.

A bf16 view of ``view_mb`` MiB (:func:`orchestrator.bench.codec.make_view`, drawn on the device)
gets Adam-like changes at each density (:func:`moved`: 95% of the moves ±1 unit in the last
place, 5% ±2..4, drawn on the device too), and ``encode_patch`` scans the device tensors where they
live (:mod:`policies.codec.scan`: only the changes cross to the host, where the sections are
entropy coded), the checksums known, as a publisher has them. Per density (``rows``):

- ``encode_s`` / ``encode_gbps``: scan + encode, best of ``repeats``, in GB (1e9 B) of view per
  second; ``copy_s`` / ``device_memcpy_gbps``: a copy of the whole view on its device timed just
  before each encode (:class:`orchestrator.bench.codec.Timer`: device to device on a GPU, the
  same-run baseline), and ``encode_vs_memcpy`` = ``copy_s / encode_s``;
- ``scan_s`` / ``scan_gbps``: the torch scan alone (:func:`policies.codec.scan.scan_tensor` over
  every tensor: compare, compaction, the changes moved to the host), best of ``repeats``;
- ``to_host_bytes``: bytes one encode moved to the host (``to_host_vs_patch``: over the patch);
- ``exact``: the patch is the bytes the host encoder writes from host copies of both views, and
  applied (verified) to a host copy of the base it gives the target bit for bit.

On a CPU the view is on the host: the encoder takes its compiled host scan, ``to_host_bytes`` is 0
and the copy is a memcpy. Target (issue #44): ≥ 1 000 GB/s at 1% on an H200.
"""

from __future__ import annotations

from typing import Any

import torch

from orchestrator.bench.codec import Timer, gbps, make_view, same_bits
from orchestrator.bench.device_scale import Device, Report, Scale
from policies.codec import apply_patch, checksums, encode_patch, read_patch_header, state_digest
from policies.codec import scan as device_scan
from policies.codec.format import CHUNK

State = dict[str, torch.Tensor]


def moved(view: State, density: float, seed: int) -> State:
    """A copy of ``view`` (bf16) with ``density`` of each tensor's values moved by a few units in
    the last place (as :func:`orchestrator.bench.codec.adam_like`), drawn on the view's device."""
    out: State = {}
    for name, t in view.items():
        dev = t.device
        gen = torch.Generator(dev).manual_seed(seed)
        seed += 1
        bits = t.reshape(-1).view(torch.int16).clone()
        n = max(1, round(bits.numel() * density))
        pos = torch.randperm(bits.numel(), generator=gen, device=dev)[:n]
        step = torch.randint(0, 2, (n,), generator=gen, device=dev, dtype=torch.int16) * 2 - 1
        far = torch.rand(n, generator=gen, device=dev) < 0.05
        big = torch.randint(2, 5, (n,), generator=gen, device=dev, dtype=torch.int16)
        bits[pos] += torch.where(far, step * big, step)
        out[name] = bits.view(torch.bfloat16).reshape(t.shape)
    return out


def on_host(view: State) -> State:
    """``view`` on the host (the same tensors when it is there)."""
    return {k: v.cpu() for k, v in view.items()}


def _scan(base: State, target: State) -> None:
    for k, b in base.items():
        device_scan.scan_tensor(b, target[k], b.element_size(), CHUNK)


def _row(
    view: State, host: State, sums: dict[str, str], density: float, seed: int, timer: Timer
) -> dict[str, Any]:
    """One density's figures (module docstring); ``sums``: ``host``'s checksums."""
    full = sum(t.nbytes for t in view.values())
    digest = state_digest(host, known=sums)
    target = moved(view, density, seed)
    target_host = on_host(target)
    target_sums = checksums(target_host)
    reference = encode_patch(host, target_host, base_digest=digest, target_checksums=target_sums)

    def encode(_: object) -> bytes:
        return encode_patch(view, target, base_digest=digest, target_checksums=target_sums)

    before = device_scan.host_bytes.total
    patch = encode(None)
    crossed = device_scan.host_bytes.total - before
    enc_s, copy_s = timer.best(encode)
    scan_s, _ = timer.best(lambda _: _scan(view, target))
    applied = apply_patch(
        {k: v.clone() for k, v in host.items()}, patch, base_digest=digest, base_checksums=sums
    )
    changed = read_patch_header(patch).changed
    return {
        "density": density,
        "changed": changed,
        "patch_bytes": len(patch),
        "bits_per_changed_element": 8 * len(patch) / max(changed, 1),
        "encode_s": enc_s,
        "encode_gbps": gbps(full, enc_s),
        "copy_s": copy_s,
        "device_memcpy_gbps": gbps(full, copy_s),
        "encode_vs_memcpy": copy_s / enc_s,
        "scan_s": scan_s,
        "scan_gbps": gbps(full, scan_s),
        "to_host_bytes": crossed,
        "to_host_vs_patch": crossed / len(patch),
        "exact": patch == reference and same_bits(applied, target_host),
    }


def run(scale: Scale, device: Device, report: Report) -> None:
    """The codec part: one row per density of ``scale``, written to ``report`` as it comes."""
    view = make_view(scale.view_mb, seed=0, device=device)
    host = on_host(view)
    sums = checksums(host)
    report.update(
        view_bytes=sum(t.nbytes for t in view.values()),
        tensors=len(view),
        repeats=scale.repeats,
        rows=[],
    )
    rows: list[dict[str, Any]] = []
    timer = Timer(view, scale.repeats)
    for i, density in enumerate(scale.densities):
        rows.append(_row(view, host, sums, density, seed=1000 * (i + 1), timer=timer))
        report.update(rows=rows, device_memcpy_gbps=max(r["device_memcpy_gbps"] for r in rows))
