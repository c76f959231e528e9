"""A distributed trainer of your own on sprawl: FSDP2, the batch feed, the sharded publisher.

The template to copy into your stack (docs/trainer.md, "Bring your own trainer"). Beside a run of
``orchestrate --config X --trainer.mode feed --board.url URL``::

    torchrun --nproc-per-node 2 examples/torchrun_trainer.py --model DIR --board URL \\
        --run-name NAME --run-dir RUN_DIR --steps N [--backend nccl]

Every rank loads the model, shards it (``fully_shard``) and publishes version 0 (a collective).
Then, per version v: rank 0 pulls batch v from the feed and broadcasts it; each rank scores its
rows under the sampling transforms each token was drawn with, takes GRPO advantages and the run's
staleness correction (``policies.train.external``) and
the PPO-clip loss (``staleness.loss.policy_loss``); FSDP2 averages the gradients over the ranks;
AdamW steps; every rank publishes its shard of v + 1; rank 0 acknowledges batch v with metrics.

``--minibatches K`` (> 1) takes K AdamW steps per batch, as ``trainer.minibatches`` does in the
reference trainer: each rank first scores its rows without gradient (π_prox, the weights before
the batch's first step) and corrects them as a whole, then steps on K consecutive slices of its
rows against those log probs; one version is still published per batch.

Kept simple on purpose: each rank normalises the loss over its own rows, and its minibatches are
slices of its rows (not whole GRPO groups; the advantages are the whole batch's either way); a
batch statistic (``m2po``) is taken over each rank's rows; no checkpoint (a restarted job starts
from ``--model``, so pair it with a fresh run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from policies.board import BoardOptions, ShardedPublisher
from policies.errors import FeedUnavailable
from policies.train.external import (
    WireTensors,
    correction,
    scored_logprobs,
    staleness_of,
    wire_tensors,
)
from policies.wire.batches import BatchFile
from policies.wire.feed import FeedClient
from staleness.loss import policy_loss
from staleness.types import Corrected


def pull(run_dir: Path, version: int) -> tuple[FeedClient, BatchFile]:
    """Rank 0: batch ``version`` from the feed, waiting for the orchestrator to serve it."""
    while True:
        try:
            client = FeedClient.discover(run_dir)
            while (batch := client.next(wait_s=30)) is None:
                pass
        except FeedUnavailable:  # the orchestrator has not written feed.json yet
            time.sleep(0.5)
            continue
        if batch.version != version:
            raise RuntimeError(f"the feed sent batch {batch.version}; the trainer is at {version}")
        return client, batch


def forward(model: torch.nn.Module, t: WireTensors) -> torch.Tensor:
    """Logits [B, T − 1, V] of the rows ``t`` (position t scores token t + 1)."""
    logits: torch.Tensor = model(input_ids=t.ids, attention_mask=t.attention).logits
    return logits[:, :-1].float()


def minibatch_loss(
    model: torch.nn.Module,
    batch: BatchFile,
    t: WireTensors,
    part: slice,
    prox: tuple[torch.Tensor, Corrected] | None,
    clip_eps: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of rows ``part`` of ``t`` against ``prox`` (None: π_prox is π_θ)."""
    mb = t.rows(part)
    logp = scored_logprobs(forward(model, mb), mb)  # each token under its call's transforms
    if prox is None:
        logp_prox, corrected = logp.detach(), correction(batch, mb, logp.detach())
    else:
        width = logp.shape[1]
        logp_prox, corrected = prox[0][part, :width], prox[1].rows(part, width)
    st = staleness_of(batch)
    return policy_loss(
        logp, logp_prox, mb.advantages, corrected,
        clip_eps=clip_eps, loss_agg=st.loss_agg, normalizer=st.normalizer,
        dr_grpo_tokens=st.dr_grpo_tokens,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--model", "--board", "--run-name", "--run-dir"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--steps", type=int, required=True, help="the run's trainer.max_steps")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--clip-eps", type=float, default=0.2)
    ap.add_argument("--minibatches", type=int, default=1, help="optimizer steps per batch")
    ap.add_argument("--backend", default="gloo")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.to(device)  # type: ignore[arg-type]
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    publisher = ShardedPublisher(args.board, args.run_name, options=BoardOptions())
    publisher.create(Path(args.model))
    version = 0
    publisher.publish(version, model.state_dict(), view_name="bf16")
    while version < args.steps:
        client, batch = pull(Path(args.run_dir), version) if rank == 0 else (None, None)
        box = [batch.model_dump_json() if batch is not None else None]
        dist.broadcast_object_list(box, src=0)
        batch = BatchFile.model_validate_json(str(box[0]))
        n = len(batch.samples)
        mine = slice(rank * n // world, (rank + 1) * n // world)
        t = wire_tensors(batch, device=device).rows(mine if mine.start < mine.stop else slice(0, 1))
        prox = None  # one step per batch: π_prox is π_θ before the step, from the same forward
        if args.minibatches > 1:  # π_prox once, before the first of the batch's steps
            with torch.no_grad():
                logp_prox = scored_logprobs(forward(model, t), t)
            prox = (logp_prox, correction(batch, t, logp_prox))
        rows, mean_loss = mine.stop - mine.start, torch.zeros(2, device=device)
        metrics: dict[str, float] = {}
        for k in range(args.minibatches):
            part = slice(k * rows // args.minibatches, (k + 1) * rows // args.minibatches)
            share = 1.0 if part.start < part.stop else 0.0  # no rows: still run FSDP2's collectives
            loss, step_metrics = minibatch_loss(
                model, batch, t, part if share else slice(0, 1), prox, args.clip_eps
            )
            optimizer.zero_grad(set_to_none=True)
            (loss * share).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            mean_loss += torch.tensor([float(loss.detach()) * share, share], device=device)
            metrics = step_metrics if share else metrics
        version += 1
        publisher.publish(version, model.state_dict(), view_name="bf16")  # collective
        dist.all_reduce(mean_loss)
        if client is not None:  # after the publish: the board's pointer announced the version
            client.ack(batch.version, {**metrics, "loss": float(mean_loss[0] / mean_loss[1])})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip the interpreter's finalisation: gloo's run-loop thread may still be freeing the last
    # collective's work (a decref under the GIL), which a finalising interpreter turns into a
    # libstdc++ abort (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
