"""Real optimizer steps on a model, for the benchmarks that measure what a step changes.

:func:`train_states` loads any HF causal-LM directory and yields its master state before
training and after each step of the ordinary next-token loss on text from
:mod:`policies.model.corpus`, tokenized by the model's own tokenizer; for a given seed every
optimizer sees the same initial weights and the same batches. :func:`optimizers` is what one step
runs: ``adamw`` (``torch.optim.AdamW`` on every parameter), or ``muon`` (``torch.optim.Muon`` on
the 2-D hidden matrices, AdamW on the embeddings, the tied output head, norms, biases and 3-D
expert stacks, as the usual Muon recipe does). No weight decay, a constant learning rate.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from policies.model.corpus import generate_corpus

Master = Literal["fp32", "bf16"]
OptimizerName = Literal["adamw", "muon"]
OPTIMIZERS: tuple[OptimizerName, ...] = ("adamw", "muon")
MuonAdjust = Literal["original", "match_rms_adamw"]
MUON_LR = 0.02
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


def optimizers(
    model: torch.nn.Module,
    optimizer: OptimizerName,
    *,
    lr: float,
    muon_lr: float = MUON_LR,
    muon_adjust: MuonAdjust = "original",
) -> list[torch.optim.Optimizer]:
    """The optimizers one step runs (see the module docstring): AdamW on everything, or Muon on
    the 2-D hidden matrices and AdamW on the rest."""
    params = list(model.parameters())
    if optimizer == "adamw":
        return [torch.optim.AdamW(params, lr=lr, weight_decay=0.0)]
    embeddings = {
        id(m.weight)
        for m in (model.get_input_embeddings(), model.get_output_embeddings())  # type: ignore[operator]
        if m is not None
    }
    hidden = [p for p in params if p.ndim == 2 and id(p) not in embeddings]
    rest = [p for p in params if p.ndim != 2 or id(p) in embeddings]
    out: list[torch.optim.Optimizer] = [
        torch.optim.Muon(hidden, lr=muon_lr, weight_decay=0.0, adjust_lr_fn=muon_adjust)
    ]
    if rest:
        out.append(torch.optim.AdamW(rest, lr=lr, weight_decay=0.0))
    return out


def train_states(
    model_dir: Path,
    *,
    steps: int,
    lr: float,
    master: Master = "fp32",
    seed: int = 0,
    batch: int = 4,
    seq: int = 64,
    optimizer: OptimizerName = "adamw",
    muon_lr: float = MUON_LR,
    muon_adjust: MuonAdjust = "original",
) -> Iterator[State]:
    """The master state dict before training, then after each of ``steps`` optimizer steps.

    Each yielded dict is a detached copy (tied names still share one tensor).
    """
    torch.manual_seed(seed)
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.train()
    opts = optimizers(model, optimizer, lr=lr, muon_lr=muon_lr, muon_adjust=muon_adjust)
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
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in opts:
            opt.step()
        yield snapshot()
