"""The codec's compiled kernels, made ready before the first version needs them.

numba compiles a kernel the first time a process calls it with types it has not seen, and keeps
the machine code in its on-disk cache (:mod:`policies.codec.kernels`). On a machine where sprawl
never ran, the first version a publisher encoded took 9.1 s and the first a reader applied 8.5 s
(the `small` model; the next ones 0.03–0.04 s and 0.01 s), so a fresh clone's first run served
its first versions seconds late. :func:`warm_up` encodes and applies a small patch of every unit
width a view has (1, 2, 4 and 8 bytes), in every way a run does (the checksum summed by the scan
or given; applied verified from the tensors or from the base's checksums, in place or into a
copy), with changes sparse, in bitmasks and dense: on a cold cache it compiles every kernel a
version uses, on a warm one it loads them (~0.5 s). ``make install`` runs it
(``python -m policies.codec.warm``), and a run calls it as it starts.
"""

from __future__ import annotations

import time

import structlog
import torch

from policies.codec.apply import apply_patch
from policies.codec.digests import checksums
from policies.codec.encode import encode_patch

log = structlog.get_logger(__name__)

_DTYPES = (torch.uint8, torch.bfloat16, torch.float32, torch.float64)
"""One dtype of each unit width (fp8 / int4 views are bytes)."""
_UNITS = 3 << 16
"""Three chunks of the default chunk size: a sparse, a bitmask and a dense one."""


def _target(base: torch.Tensor) -> torch.Tensor:
    """``base``, its first chunk changed sparsely, its second in a bitmask, its third densely."""
    out = base.clone()
    bits = out.view(torch.uint8).view(-1)
    width = base.element_size()
    chunk = len(bits) // 3
    for i, step in enumerate((997, 5, 1)):  # sparse, bitmask (1/5 of units), dense
        bits[i * chunk : (i + 1) * chunk : step * width] ^= 1
    return out


def warm_up() -> float:
    """Compile (or load from the cache) every codec kernel a version uses; the seconds taken."""
    t0 = time.perf_counter()
    for dtype in _DTYPES:
        base = {"w": torch.zeros(_UNITS, dtype=dtype), "v": torch.zeros(64, dtype=dtype)}
        target = {"w": _target(base["w"]), "v": base["v"] + 1}
        sums = checksums(base)
        for patch in (
            encode_patch(base, target),
            encode_patch(base, target, target_checksums=checksums(target)),
        ):
            apply_patch(base, patch, in_place=False)
            apply_patch(base, patch, in_place=False, base_checksums=sums)
            held = {k: t.clone() for k, t in base.items()}
            apply_patch(held, patch, base_checksums=sums)
    seconds = time.perf_counter() - t0
    log.debug("codec.warm", seconds=round(seconds, 3))
    return seconds


if __name__ == "__main__":
    from policies.wire.logs import configure

    configure(level="warning")
    print(f"codec kernels ready in {warm_up():.1f} s")
