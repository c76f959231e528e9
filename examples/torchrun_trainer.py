"""A distributed trainer of your own on sprawl: FSDP2, the batch feed, the sharded publisher.

The template to copy into your stack (docs/trainer.md, "Bring your own trainer"). Beside a run of
``orchestrate --config X --trainer.mode feed --board.url URL``::

    torchrun --nproc-per-node 2 examples/torchrun_trainer.py --model DIR --board URL \\
        --run-name NAME --run-dir RUN_DIR --steps N [--checkpoint-dir DIR] [--backend nccl]

Every rank loads the model, shards it (``fully_shard``) and publishes version 0 (a collective).
Then, per version v: rank 0 pulls batch v from the feed and broadcasts it; each rank scores its
rows under the sampling transforms each token was drawn with, takes GRPO advantages and the run's
staleness correction (``policies.train.external``) and the PPO-clip loss
(``staleness.loss.policy_loss``); FSDP2 averages the gradients over the ranks; AdamW steps; the
ranks checkpoint, publish their shards of v + 1, and rank 0 acknowledges batch v with metrics
(rank 0 prints a JSON line per batch received and per step: its version, groups and metrics).

Restarts. With ``--checkpoint-dir`` every step is checkpointed *before* it is published: model
and AdamW state through ``torch.distributed.checkpoint`` (each rank writes its shards) into
``DIR/v<version>``, then rank 0 names it in ``DIR/LATEST`` (``{"version", "metrics"}``: the
version and the metrics of the step that made it), written to a temporary file, fsynced and
renamed, so a crash leaves the previous checkpoint whole. The job started again with the same
command restores the newest one, publishes its version if the crash came between the checkpoint
and the publish (a board *ahead* of the checkpoint, or more than one behind, is refused: another
run's), acknowledges the batch of that step again (with its metrics; a duplicate if it had
been; at the run's last version it gives up after 30 s, the run may be over), and continues with
the next batch: the feed delivers a batch again until it is acknowledged, so a step the crash
interrupted is taken once, by the restarted job. A restarted orchestrator (``run.resume``)
serves the batches it had not seen acknowledged again, on a new port: while the feed cannot be
reached, ``feed.json`` is read again (for at most ``--feed-wait-s``, default 600).

``--minibatches K`` (> 1) takes K AdamW steps per batch, as ``trainer.minibatches`` does in the
reference trainer: each rank first scores its rows without gradient (π_prox, the weights before
the batch's first step) and corrects them as a whole, then steps on K consecutive slices of its
rows against those log probs; one version is still published per batch.

Kept simple on purpose: each rank normalises the loss over its own rows, and its minibatches are
slices of its rows (not whole GRPO groups; the advantages are the whole batch's either way); a
batch statistic (``m2po``) is taken over each rank's rows; one checkpoint is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save as save_state
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

T = TypeVar("T")


def on_feed(run_dir: Path, call: Callable[[FeedClient], T], wait_s: float) -> T:
    """Rank 0: ``call`` on the feed ``feed.json`` names, read again while the feed cannot be
    reached (the orchestrator starting, or restarted on another port), for at most ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return call(FeedClient.discover(run_dir))
        except FeedUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def pull(run_dir: Path, version: int, wait_s: float) -> BatchFile:
    """Rank 0: batch ``version`` from the feed, waiting for the orchestrator to serve it."""
    while (batch := on_feed(run_dir, lambda c: c.next(wait_s=30), wait_s)) is None:
        pass
    if batch.version != version:
        raise RuntimeError(f"the feed sent batch {batch.version}; the trainer is at {version}")
    print(json.dumps({"event": "batch_received", "version": version}), flush=True)
    return batch


def ack(run_dir: Path, version: int, metrics: dict[str, float], wait_s: float) -> None:
    """Rank 0: batch ``version`` is trained and ``version + 1`` published (a duplicate is fine)."""
    on_feed(run_dir, lambda c: c.ack(version, metrics), wait_s)


def save(ckpt: Path, version: int, model: Any, optimizer: Any, metrics: dict[str, float]) -> None:
    """Every rank: checkpoint ``version`` (module docstring); older ones are removed."""
    rank, path = dist.get_rank(), ckpt / f"v{version:08d}"
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)  # what a crash mid-save left of this version
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    save_state({"model": model_state, "optim": optim_state}, checkpoint_id=path)  # collective
    if rank == 0:
        tmp = ckpt / "LATEST.tmp"
        with tmp.open("w") as f:
            json.dump({"version": version, "metrics": metrics}, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(ckpt / "LATEST")
        for old in ckpt.glob("v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def restore(ckpt: Path, model: Any, optimizer: Any) -> tuple[int, dict[str, float]]:
    """Every rank: the newest checkpoint's version and step metrics, its state loaded into
    ``model`` and ``optimizer``; ``(0, {})`` when there is none."""
    if not (ckpt / "LATEST").exists():
        return 0, {}
    latest = json.loads((ckpt / "LATEST").read_text())
    version = int(latest["version"])
    model_state, optim_state = get_state_dict(model, optimizer)
    load({"model": model_state, "optim": optim_state}, checkpoint_id=ckpt / f"v{version:08d}")
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return version, {k: float(v) for k, v in latest["metrics"].items()}


def resume(publisher: ShardedPublisher, version: int, model: Any) -> None:
    """Every rank: publish ``version`` unless the board has it (version 0 on a new board; the
    checkpoint's after a crash between its save and its publish)."""
    box = [publisher.latest() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    latest = box[0]
    if latest == version:
        return
    if not (latest is None and version == 0) and latest != version - 1:
        raise RuntimeError(
            f"the board is at version {latest} and the checkpoint at {version}: "
            "the board or the checkpoint directory belongs to another run"
        )
    publisher.publish(version, model.state_dict(), view_name="bf16")


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
    ap.add_argument("--checkpoint-dir", type=Path, help="checkpoint every step; resume from it")
    ap.add_argument("--feed-wait-s", type=float, default=600.0)
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
    run_dir, ckpt = Path(args.run_dir), args.checkpoint_dir
    version, last = restore(ckpt, model, optimizer) if ckpt else (0, {})
    resume(publisher, version, model)
    if version > 0 and rank == 0:  # the step before the crash may not have been acknowledged
        print(json.dumps({"event": "trainer_resumed", "version": version}), flush=True)
        ended = version >= args.steps  # the run may be over, its feed gone
        try:
            ack(run_dir, version - 1, last, 30.0 if ended else args.feed_wait_s)
        except FeedUnavailable:
            if not ended:
                raise
    while version < args.steps:
        batch = pull(run_dir, version, args.feed_wait_s) if rank == 0 else None
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
        dist.all_reduce(mean_loss)
        metrics = {**metrics, "loss": float(mean_loss[0] / mean_loss[1])}
        if ckpt is not None:  # before the publish: the checkpoint is never behind the board
            save(ckpt, version, model, optimizer, metrics)
        publisher.publish(version, model.state_dict(), view_name="bf16")  # collective
        if rank == 0:  # after the publish: the board's pointer announced the version
            groups = sorted({s.group_id for s in batch.samples})
            step = {"event": "trainer_step", "version": version, "groups": groups, **metrics}
            print(json.dumps(step), flush=True)
            ack(run_dir, batch.version, metrics, args.feed_wait_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip the interpreter's finalisation: gloo's run-loop thread may still be freeing the last
    # collective's work (a decref under the GIL), which a finalising interpreter turns into a
    # libstdc++ abort (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
