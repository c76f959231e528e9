"""The trainer of ``bench sync --engine``: a process of its own that publishes each version.

In a run the trainer publishes from its own cluster and the island's sidecar runs next to the
engine: they share no process. The bench keeps them apart the same way: this process holds the
served view, moves ``density`` of its bf16 values by ±1 ulp per version (an Adam step,
:func:`~orchestrator.bench.synthetic.adam_step`) and publishes it, while the engine, its sidecar and
the throttled link live in the bench's process. (In one process the publisher's threads took
turns with the sidecar's on one interpreter lock, which no run has.)

Times are ``time.monotonic()``, one clock for every process of the machine.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import anyio
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from orchestrator.bench.synthetic import adam_step
from policies.board import Board, Manifest
from policies.wire.logs import configure

_state: dict[str, object] = {}


def bf16_view(model: Path) -> dict[str, torch.Tensor]:
    """The bf16 served view of a model directory's weights (a tied head once, as the
    embedding): what a bench publishes as version 0."""
    weights = load_file(model / "model.safetensors")
    tied = bool(AutoConfig.from_pretrained(model).tie_word_embeddings)
    return {
        k: w.to(torch.bfloat16)
        for k, w in weights.items()
        if not (tied and k == "lm_head.weight")  # shipped once, as the embedding
    }


def _start(url: str, run: str, model: str, density: float) -> None:
    configure(level="warning")
    board = Board(url, run)
    board.create(Path(model))
    view = bf16_view(Path(model))
    board.publish(0, view, view_name="bfloat16")
    _state.update(board=board, view=view, density=density, gen=torch.Generator().manual_seed(1))


def _next(version: int) -> tuple[float, Manifest]:
    board, gen = _state["board"], _state["gen"]
    assert isinstance(board, Board)
    assert isinstance(gen, torch.Generator)
    view = adam_step(_state["view"], float(_state["density"]), gen)  # type: ignore[arg-type]
    _state["view"] = view
    t0 = time.monotonic()
    return t0, board.publish(version, view, view_name="bfloat16")


class TrainerProcess:
    """The trainer's process: version 0 of ``model`` published on ``url``/``run`` as it starts
    (:meth:`start`), then one version per :meth:`publish`."""

    def __init__(self, url: str, run: str, model: Path, density: float) -> None:
        self._args = (url, run, str(model), density)
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads
        self._pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=_start, initargs=self._args)
        self._pool.submit(time.monotonic).result()  # started, version 0 published

    async def publish(self, version: int) -> tuple[float, Manifest]:
        """Publish ``version``: when its publish started, and its manifest."""
        assert self._pool is not None, "start() first"
        future = self._pool.submit(_next, version)
        return await anyio.to_thread.run_sync(future.result)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
