"""``orchestrate bench codec --churn``: how many codes and scales of each served view one
Adam-like step changes, per scale policy (``docs/codec.md#scale-churn``).

fp32 masters ~ N(0, 0.02) with a few outliers move by ``lr`` in a random direction (Adam's
normalized update); each (view, scale policy) is built before and after the step and compared
as integers of the element width. Reported per row: ``changed_codes`` and ``changed_scales``
(fractions), ``patch_bytes`` and ``full_bytes`` of the view.
"""

from __future__ import annotations

from typing import Any

import torch

from policies.codec import encode_patch
from policies.codec.views import ViewSpec, build_view


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.reshape(-1).view(ints[t.element_size()])


def scale_churn(rows: int, cols: int, lr: float, seed: int = 0) -> list[dict[str, Any]]:
    """Changed fraction of each view's elements and scales after one Adam-like step.

    fp32 masters ~ N(0, 0.02) with a few outliers move by ``lr`` in a random direction (Adam's
    normalized update); each (view, scale policy) is built before and after the step.
    """
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(rows, cols, generator=gen) * 0.02
    w0.view(-1)[torch.randint(0, w0.numel(), (rows // 8,), generator=gen)] *= 8
    w1 = w0 + lr * torch.sign(torch.randn(rows, cols, generator=gen))
    out = []
    for kind in ("bf16", "fp8_e4m3", "fp8_block", "int4_group", "nvfp4"):
        policies = ("fresh",) if kind == "bf16" else ("fresh", "pow2", "fixed_between_anchors")
        for policy in policies:
            spec = ViewSpec(kind=kind, scale_policy=policy)  # type: ignore[arg-type]
            v0 = build_view({"w.weight": w0}, spec)
            v1 = build_view({"w.weight": w1}, spec, anchor=v0)
            codes = scales = changed_codes = changed_scales = 0
            for name, t in v0.items():
                a, b = _as_ints(t), _as_ints(v1[name])
                diff = int((a != b).sum())
                if name.endswith(("_scale", "_scale_inv", "_scale_2")):
                    scales, changed_scales = scales + a.numel(), changed_scales + diff
                elif not name.endswith("_shape"):
                    codes, changed_codes = codes + a.numel(), changed_codes + diff
            patch = encode_patch(v0, v1)
            out.append(
                {
                    "view": kind,
                    "scale_policy": policy,
                    "changed_codes": changed_codes / codes,
                    "changed_scales": changed_scales / max(scales, 1),
                    "patch_bytes": len(patch),
                    "full_bytes": sum(t.numel() * t.element_size() for t in v1.values()),
                }
            )
    return out


def churn_table(rows: list[dict[str, Any]], lr: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"scale churn: one Adam-like step (lr {lr:g}) on a 2048×4096 fp32 weight")
    for col in ("view", "scale policy", "codes changed", "scales changed", "patch / full"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["view"],
            r["scale_policy"],
            f"{r['changed_codes']:.3%}",
            f"{r['changed_scales']:.2%}",
            f"{r['patch_bytes'] / r['full_bytes']:.3%}",
        )
    Console().print(table)
