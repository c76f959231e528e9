"""``orchestrate bench sparsity``: how many served bits optimizer steps change, and patch sizes.

Loads any HF causal-LM directory, trains it for ``--steps`` steps of each optimizer of
``--optimizer`` (fp32 or bf16 master weights, no weight decay, a constant learning rate) with the
ordinary next-token loss on text from :mod:`policies.model.corpus` tokenized by the model's own
tokenizer, every optimizer from the same initial weights on the same batches:

- ``adamw``: ``torch.optim.AdamW`` on every parameter at ``--lr`` (full fine-tune RL uses
  1e-6 … 1e-5);
- ``muon``: ``torch.optim.Muon`` (Newton–Schulz-orthogonalised momentum, nesterov, momentum
  0.95) on the 2-D hidden matrices at ``--muon-lr`` (0.02, the usual rate) scaled per matrix by
  ``--muon-adjust-lr`` (torch's ``adjust_lr_fn``: ``original`` = × √max(1, rows/cols),
  ``match_rms_adamw`` = × 0.2·√max(rows, cols)); Muon takes only 2-D parameters, and the
  embeddings (the tied output head with them), norms, biases and 3-D expert stacks take AdamW
  at ``--lr``, as the usual Muon recipe does.

After every step it builds
each served view (:func:`policies.codec.views.build_view`: bf16, fp8 with 128×128 block scales, int4
group, nvfp4), each quantized one under every scale policy of ``--scale-policies`` (``trainer.
scale_policy``; ``fixed_between_anchors`` recomputes the scales every ``--anchor-every`` steps
from step 0, as the board's count rule anchors a run). For every step and every ``k`` in
``--ks`` it compares the view with the one ``k`` steps older and reports ``changed_fraction``
(changed units over all units, raw bits compared; packed int4/nvfp4 count bytes, scales count as
elements), ``changed_scales`` (changed scale elements over all of them; 0 for bf16) and
``patch_bytes`` (the :func:`policies.codec.encode_patch` size), next to ``full_bytes`` — the
baseline, a full copy of that view — and their ratio. All views are built from the same states,
so they see the same steps. Nothing is synthetic: the gradients come from a real loss.

Not covered: learning-rate warmup or decay, gradient clipping, RL losses (an RL step's
gradient has other statistics than next-token loss; the learning rate dominates the changed
fraction either way).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from orchestrator.bench.optimizer_steps import (
    MUON_LR,
    OPTIMIZERS,
    Master,
    MuonAdjust,
    OptimizerName,
    State,
    train_states,
)
from policies.board.types import BoardOptions
from policies.codec import encode_patch, read_patch_header
from policies.codec.views import ScalePolicy, ViewKind, ViewSpec, build_view, weight_sources
from policies.wire.logs import quiet_logs

VIEWS: tuple[ViewKind, ...] = ("bf16", "fp8_block", "int4_group", "nvfp4")
POLICIES: tuple[ScalePolicy, ...] = ("fresh", "pow2", "fixed_between_anchors")


def _full_bytes(view: State) -> int:
    seen: dict[int, int] = {}
    for t in view.values():
        seen[t.untyped_storage().data_ptr()] = t.nbytes
    return sum(seen.values())


def _changed_scales(old: State, new: State) -> tuple[int, int]:
    """(changed, all) scale elements between two versions of a view (raw bits compared)."""
    names = {s for srcs in weight_sources(new).values() for s in srcs[1:]}
    changed = total = 0
    for name in names - {n for n in names if n.endswith("weight_shape")}:
        a, b = (t.contiguous().reshape(-1).view(torch.uint8) for t in (old[name], new[name]))
        n = old[name].numel()
        changed += int((a != b).reshape(n, -1).any(-1).sum())
        total += n
    return changed, total


def _rows(
    model_dir: Path,
    specs: list[ViewSpec],
    *,
    steps: int,
    lr: float,
    master: Master,
    ks: tuple[int, ...],
    anchor_every: int,
    seed: int,
    optimizer: OptimizerName,
    muon_lr: float,
    muon_adjust: MuonAdjust,
) -> list[dict[str, object]]:
    """Per step, view, scale policy and k of one optimizer's run (see the module docstring)."""
    history: dict[ViewSpec, list[State]] = {spec: [] for spec in specs}
    anchors: dict[ViewSpec, State] = {}
    rows: list[dict[str, object]] = []
    states = train_states(
        model_dir,
        steps=steps,
        lr=lr,
        master=master,
        seed=seed,
        optimizer=optimizer,
        muon_lr=muon_lr,
        muon_adjust=muon_adjust,
    )
    for step, state in enumerate(states):
        for spec in specs:
            anchor = None if step % anchor_every == 0 else anchors.get(spec)
            view = build_view(state, spec, anchor=anchor)
            if anchor is None:
                anchors[spec] = view
            past = history[spec]
            past.append(view)
            del past[: max(0, len(past) - max(ks) - 1)]
            for k in ks:
                if len(past) <= k:
                    continue
                patch = encode_patch(past[-1 - k], view)
                full = _full_bytes(view)
                scales_changed, scales = _changed_scales(past[-1 - k], view)
                rows.append(
                    {
                        "optimizer": optimizer,
                        "step": step,
                        "view": spec.kind,
                        "scale_policy": spec.scale_policy,
                        "k": k,
                        "changed_fraction": read_patch_header(patch).density,
                        "changed_scales": scales_changed / scales if scales else 0.0,
                        "patch_bytes": len(patch),
                        "full_bytes": full,
                        "patch_over_full": len(patch) / full,
                    }
                )
    return rows


def run(
    model_dir: Path,
    *,
    steps: int,
    lr: float,
    master: Master,
    ks: tuple[int, ...],
    views: tuple[ViewKind, ...] = VIEWS,
    policies: tuple[ScalePolicy, ...] = POLICIES,
    anchor_every: int = 16,
    seed: int = 0,
    optimizers: tuple[OptimizerName, ...] = ("adamw",),
    muon_lr: float = MUON_LR,
    muon_adjust: MuonAdjust = "original",
) -> dict[str, object]:
    """Per optimizer, step, view, scale policy and k: changed fractions and patch bytes (see
    the module docstring)."""
    specs = [
        ViewSpec(kind=kind, scale_policy=policy)
        for kind in views
        for policy in (policies if ViewSpec(kind=kind).quantized else ("fresh",))
    ]
    rows = [
        row
        for optimizer in optimizers
        for row in _rows(
            model_dir,
            specs,
            steps=steps,
            lr=lr,
            master=master,
            ks=ks,
            anchor_every=anchor_every,
            seed=seed,
            optimizer=optimizer,
            muon_lr=muon_lr,
            muon_adjust=muon_adjust,
        )
    ]
    summary = []
    for optimizer in optimizers:
        for spec in specs:
            for k in ks:
                sel = [
                    r
                    for r in rows
                    if (r["optimizer"], r["view"], r["scale_policy"], r["k"])
                    == (optimizer, spec.kind, spec.scale_policy, k)
                ]
                if sel:
                    summary.append(
                        {
                            "optimizer": optimizer,
                            "view": spec.kind,
                            "scale_policy": spec.scale_policy,
                            "k": k,
                            "mean_changed_fraction": _mean(sel, "changed_fraction"),
                            "mean_changed_scales": _mean(sel, "changed_scales"),
                            "mean_patch_bytes": _mean(sel, "patch_bytes"),
                            "full_bytes": sel[0]["full_bytes"],
                            "mean_patch_over_full": _mean(sel, "patch_over_full"),
                        }
                    )
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    return {
        "model": str(model_dir),
        "parameters": params,
        "master": master,
        "lr": lr,
        "optimizers": list(optimizers),
        "muon_lr": muon_lr,
        "muon_adjust_lr": muon_adjust,
        "steps": steps,
        "ks": list(ks),
        "anchor_every": anchor_every,
        "rows": rows,
        "summary": summary,
    }


def _mean(rows: list[dict[str, object]], key: str) -> float:
    vals = [v for r in rows if isinstance(v := r[key], int | float)]
    return sum(vals) / len(vals)


def _table(report: dict[str, object]) -> str:
    lines = [
        f"model {report['model']} ({report['parameters']:,} parameters), "
        f"master {report['master']}, {report['steps']} steps of "
        f"{', '.join(map(str, report['optimizers']))} (AdamW lr {report['lr']}; Muon lr "  # type: ignore[call-overload]
        f"{report['muon_lr']}, adjust_lr_fn {report['muon_adjust_lr']}), "
        f"fixed scales recomputed every {report['anchor_every']} steps",
        "",
        f"{'optimizer':<9} {'view':<11} {'scale policy':<22} {'k':>3} {'changed':>9} {'scales':>8} "
        f"{'patch B':>12} {'full B':>12} {'patch/full':>10}",
    ]
    summary = report["summary"]
    assert isinstance(summary, list)
    for s in summary:
        lines.append(
            f"{s['optimizer']:<9} {s['view']:<11} {s['scale_policy']:<22} {s['k']:>3} "
            f"{s['mean_changed_fraction']:>9.4%} {s['mean_changed_scales']:>8.2%} "
            f"{s['mean_patch_bytes']:>12,.0f} {s['full_bytes']:>12,d} "
            f"{s['mean_patch_over_full']:>10.4%}"
        )
    lines += ["", "per step (k = 1): optimizer step view scale_policy changed scales patch_bytes"]
    rows = report["rows"]
    assert isinstance(rows, list)
    for r in rows:
        if r["k"] == 1:
            lines.append(
                f"{r['optimizer']:<9} {r['step']:>4} {r['view']:<11} {r['scale_policy']:<22} "
                f"{r['changed_fraction']:.4%} {r['changed_scales']:.2%} {r['patch_bytes']:,}"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench sparsity", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="HF causal-LM directory")
    parser.add_argument(
        "--optimizer",
        default="adamw",
        help="optimizers to compare, comma-separated: adamw, muon (same model, data, schedule)",
    )
    parser.add_argument(
        "--lr", type=float, default=1e-6, help="AdamW learning rate (also Muon's AdamW part)"
    )
    parser.add_argument(
        "--muon-lr", type=float, default=MUON_LR, help="Muon learning rate (2-D hidden matrices)"
    )
    parser.add_argument(
        "--muon-adjust-lr",
        choices=["original", "match_rms_adamw"],
        default="original",
        help="Muon's per-matrix learning-rate rule (torch.optim.Muon adjust_lr_fn)",
    )
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--master", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--ks", default="1,2,4,8", help="compare against versions k steps old")
    parser.add_argument(
        "--scale-policies",
        default=",".join(POLICIES),
        help="scale policies of the quantized views (trainer.scale_policy values)",
    )
    parser.add_argument(
        "--anchor-every",
        type=int,
        default=BoardOptions().anchor_every,
        help="fixed_between_anchors: recompute scales every this many steps (board.anchor_every)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    ks = tuple(int(k) for k in args.ks.split(","))
    policies: list[ScalePolicy] = []
    for name in args.scale_policies.split(","):
        policy = next((p for p in POLICIES if p == name), None)
        if policy is None:
            parser.error(f"--scale-policies: {name!r} is not one of {', '.join(POLICIES)}")
        policies.append(policy)
    if args.anchor_every < 1:
        parser.error("--anchor-every: must be at least 1")
    chosen: list[OptimizerName] = []
    for name in args.optimizer.split(","):
        optimizer = next((o for o in OPTIMIZERS if o == name), None)
        if optimizer is None:
            parser.error(f"--optimizer: {name!r} is not one of {', '.join(OPTIMIZERS)}")
        chosen.append(optimizer)
    if "muon" in chosen and not hasattr(torch.optim, "Muon"):
        parser.error(
            f"--optimizer muon: needs torch >= 2.9 (torch.optim.Muon), not {torch.__version__}"
        )
    for flag in ("lr", "muon_lr"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')}: must be > 0")
    with quiet_logs():
        report = run(
            args.model,
            steps=args.steps,
            lr=args.lr,
            master=args.master,
            ks=ks,
            policies=tuple(policies),
            anchor_every=args.anchor_every,
            seed=args.seed,
            optimizers=tuple(chosen),
            muon_lr=args.muon_lr,
            muon_adjust=args.muon_adjust_lr,
        )
    sys.stdout.write(json.dumps(report, indent=1) + "\n" if args.json else _table(report))
    return 0
