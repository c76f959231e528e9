"""``orchestrate bench sparsity``: how many served bits real AdamW steps change, and patch sizes.

Loads any HF causal-LM directory, trains it for ``--steps`` AdamW steps (fp32 or bf16 master
weights, ``--lr``, no weight decay) with the ordinary next-token loss on text from
:mod:`policies.model.corpus` tokenized by the model's own tokenizer, and after every step builds
each served view (:func:`policies.codec.views.build_view`: bf16, fp8 with 128×128 block scales, int4
group, nvfp4). For every step and every ``k`` in ``--ks`` it compares the view with the one ``k``
steps older and reports ``changed_fraction`` (changed units over all units, raw bits compared;
packed int4/nvfp4 count bytes, scales count as elements) and ``patch_bytes`` (the
:func:`policies.codec.encode_patch` size), next to ``full_bytes`` — the baseline, a full copy of
that view — and their ratio. Nothing is synthetic: the gradients come from a real loss.

Not covered: learning-rate warmup or schedules, gradient clipping, RL losses (an RL step's
gradient has other statistics than next-token loss; the learning rate dominates the changed
fraction either way).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from policies.codec import encode_patch, read_patch_header
from policies.codec.views import ViewKind, ViewSpec, build_view
from policies.model.corpus import generate_corpus
from policies.wire.logs import quiet_logs

VIEWS: tuple[ViewKind, ...] = ("bf16", "fp8_block", "int4_group", "nvfp4")
Master = Literal["fp32", "bf16"]
State = dict[str, torch.Tensor]


def token_batches(
    model_dir: Path, *, batch: int, seq: int, seed: int, docs: int = 4000
) -> Iterator[torch.Tensor]:
    """Endless ``(batch, seq)`` token batches of ``docs`` corpus documents (cycled)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for doc in generate_corpus(docs, seed):
        ids.extend(tok(doc)["input_ids"])
        eos = tok.eos_token_id
        if isinstance(eos, int):
            ids.append(eos)
    stream = torch.tensor(ids, dtype=torch.long)
    per = batch * seq
    n = stream.numel() // per
    if n == 0:
        raise ValueError(f"corpus too short for batches of {batch}×{seq} tokens")
    i = 0
    while True:
        yield stream[(i % n) * per : (i % n + 1) * per].reshape(batch, seq)
        i += 1


def train_states(
    model_dir: Path,
    *,
    steps: int,
    lr: float,
    master: Master = "fp32",
    seed: int = 0,
    batch: int = 4,
    seq: int = 64,
) -> Iterator[State]:
    """The master state dict before training, then after each of ``steps`` AdamW steps.

    Each yielded dict is a detached copy (tied names still share one tensor).
    """
    torch.manual_seed(seed)
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    docs = min(4000, 16 * (steps + 1))  # ≈ 3 batches of fresh text per step, then cycled
    batches = token_batches(model_dir, batch=batch, seq=seq, seed=seed, docs=docs)

    def snapshot() -> State:
        copies: dict[int, torch.Tensor] = {}
        out: State = {}
        for name, t in model.state_dict().items():
            key = t.untyped_storage().data_ptr()
            if key not in copies:
                copies[key] = t.detach().clone()
            out[name] = copies[key]
        return out

    yield snapshot()
    for _ in range(steps):
        ids = next(batches)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        yield snapshot()


def _full_bytes(view: State) -> int:
    seen: dict[int, int] = {}
    for t in view.values():
        seen[t.untyped_storage().data_ptr()] = t.nbytes
    return sum(seen.values())


def run(
    model_dir: Path,
    *,
    steps: int,
    lr: float,
    master: Master,
    ks: tuple[int, ...],
    views: tuple[ViewKind, ...] = VIEWS,
    seed: int = 0,
) -> dict[str, object]:
    """Per step, view and k: changed fraction and patch bytes (see the module docstring)."""
    history: dict[ViewKind, list[State]] = {v: [] for v in views}
    rows: list[dict[str, object]] = []
    for step, state in enumerate(
        train_states(model_dir, steps=steps, lr=lr, master=master, seed=seed)
    ):
        for kind in views:
            view = build_view(state, ViewSpec(kind=kind))
            past = history[kind]
            past.append(view)
            del past[: max(0, len(past) - max(ks) - 1)]
            for k in ks:
                if len(past) <= k:
                    continue
                patch = encode_patch(past[-1 - k], view)
                full = _full_bytes(view)
                rows.append(
                    {
                        "step": step,
                        "view": kind,
                        "k": k,
                        "changed_fraction": read_patch_header(patch).density,
                        "patch_bytes": len(patch),
                        "full_bytes": full,
                        "patch_over_full": len(patch) / full,
                    }
                )
    summary = []
    for kind in views:
        for k in ks:
            sel = [r for r in rows if r["view"] == kind and r["k"] == k]
            if sel:
                summary.append(
                    {
                        "view": kind,
                        "k": k,
                        "mean_changed_fraction": _mean(sel, "changed_fraction"),
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
        "steps": steps,
        "ks": list(ks),
        "rows": rows,
        "summary": summary,
    }


def _mean(rows: list[dict[str, object]], key: str) -> float:
    vals = [v for r in rows if isinstance(v := r[key], int | float)]
    return sum(vals) / len(vals)


def _table(report: dict[str, object]) -> str:
    lines = [
        f"model {report['model']} ({report['parameters']:,} parameters), "
        f"master {report['master']}, lr {report['lr']}, {report['steps']} AdamW steps",
        "",
        f"{'view':<11} {'k':>3} {'changed':>9} {'patch B':>12} {'full B':>12} {'patch/full':>10}",
    ]
    summary = report["summary"]
    assert isinstance(summary, list)
    for s in summary:
        lines.append(
            f"{s['view']:<11} {s['k']:>3} {s['mean_changed_fraction']:>9.4%} "
            f"{s['mean_patch_bytes']:>12,.0f} {s['full_bytes']:>12,d} "
            f"{s['mean_patch_over_full']:>10.4%}"
        )
    lines += ["", "per step (k = 1): step view changed patch_bytes"]
    rows = report["rows"]
    assert isinstance(rows, list)
    for r in rows:
        if r["k"] == 1:
            lines.append(
                f"{r['step']:>4} {r['view']:<11} {r['changed_fraction']:.4%} {r['patch_bytes']:,}"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench sparsity", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="HF causal-LM directory")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    parser.add_argument("--steps", type=int, default=8, help="AdamW steps")
    parser.add_argument("--master", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--ks", default="1,2,4,8", help="compare against versions k steps old")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    ks = tuple(int(k) for k in args.ks.split(","))
    with quiet_logs():
        report = run(
            args.model, steps=args.steps, lr=args.lr, master=args.master, ks=ks, seed=args.seed
        )
    sys.stdout.write(json.dumps(report, indent=1) + "\n" if args.json else _table(report))
    return 0
