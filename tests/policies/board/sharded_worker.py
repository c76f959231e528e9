"""One rank of a torchrun trainer publishing sharded versions (run by test_board_sharded.py).

Loads the model, shards it with FSDP2 ``fully_shard`` on a gloo process group, and for each
version takes a small AdamW step (none before the first) and publishes it with
:class:`ShardedPublisher`. Rank 0 also publishes the same weights, gathered whole with
``full_tensor()`` and cast alike, with a single-process :class:`Board` to ``--ref-run``: the
reference a sharded version must be bit-identical to. ``--kill-rank R --kill-version V``: rank R
kills itself (SIGKILL) after writing its shard of V, before the commit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from policies.board import Board, BoardOptions, ShardedPublisher
from policies.board.types import ShardEntry


class _KilledAfterWriting(ShardedPublisher):
    """A rank that dies between writing its durable files and the commit."""

    kill_version = -1

    def _write(self, version: int, *args: Any, **kwargs: Any) -> ShardEntry:
        entry = super()._write(version, *args, **kwargs)
        if version == self.kill_version:
            os.kill(os.getpid(), signal.SIGKILL)
        return entry


def _reference_view(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights, cast to bf16 like a served view, tied names sharing one tensor."""
    view: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, t in state.items():
        local = t.to_local() if isinstance(t, DTensor) else t
        ptr = local.untyped_storage().data_ptr()
        if ptr in seen and local.numel():
            view[name] = view[seen[ptr]]
            continue
        seen[ptr] = name
        full = t.full_tensor() if isinstance(t, DTensor) else t
        dtype = torch.bfloat16 if full.is_floating_point() else full.dtype
        view[name] = full.detach().to("cpu", dtype=dtype, copy=True)
    return view


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--board", required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--versions", required=True, help="comma-separated")
    ap.add_argument("--ref-run", default="ref")
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-version", type=int, default=-1)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pub = ShardedPublisher(args.board, "run", options=BoardOptions(anchor_every=16))
    if rank == args.kill_rank:
        pub = _KilledAfterWriting(args.board, "run", options=BoardOptions(anchor_every=16))
        pub.kill_version = args.kill_version
    pub.create(args.model)
    ref = Board(args.board, args.ref_run) if rank == 0 else None
    if ref is not None:
        ref.create(args.model)
    versions = [int(v) for v in args.versions.split(",")]
    g = torch.Generator().manual_seed(1)
    for i, v in enumerate(versions):
        if i:
            ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        state = model.state_dict()
        view = _reference_view(state)  # a collective (full_tensor): every rank takes part
        if v == args.kill_version and ref is not None:
            ref = None  # the reference does not publish the version the crash loses
        pub.publish(v, state, view_name="bf16")
        if ref is not None:
            ref.publish(v, view, view_name="bf16")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip the interpreter's finalisation: gloo's run-loop thread may still be freeing the last
    # collective's work (a decref under the GIL), which a finalising interpreter turns into a
    # libstdc++ abort (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
