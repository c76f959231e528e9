"""Boards of sprawl's tiny model, and an engine serving one, for engine and sidecar tests."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import torch
from transformers import AutoModelForCausalLM

from policies.board import Board
from policies.serve.connections import LaneLimits
from policies.serve.reference_server import serve_board
from policies.serve.types import QuiesceMode


def publish_scaled(board: Board, version: int, model_dir: Path, scale: float = 1.0) -> None:
    """Publish the model's weights × ``scale`` as a bf16 view (scale ≠ 1 makes a new version)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    view = {
        k: (v * scale).to(torch.bfloat16)
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    board.publish(version, view, view_name="bfloat16")


def tiny_board(root: Path, model_dir: Path) -> Board:
    """A board holding the tiny model as version 0."""
    b = Board(str(root / "board"), "run")
    b.create(model_dir)
    publish_scaled(b, 0, model_dir)
    return b


@asynccontextmanager
async def engine(
    board: Board,
    token: str | None = None,
    poll_interval_s: float = 0.05,
    activation: QuiesceMode = "wait",
    tls: ssl.SSLContext | None = None,
    limits: LaneLimits | None = None,
    base_model: Path | None = None,
    max_adapters: int = 4,
) -> AsyncIterator[str]:
    """A reference engine with its sidecar serving ``board`` on loopback; its base URL
    (``https`` with ``tls``; ``base_model``: serving LoRA versions, ``max_adapters`` resident)."""
    async with anyio.create_task_group() as tg:
        port = await tg.start(
            lambda task_status: serve_board(
                board.url,
                board.run,
                host="127.0.0.1",
                port=0,
                device="cpu",
                token=token,
                poll_interval_s=poll_interval_s,
                activation=activation,
                tls=tls,
                limits=limits,
                base_model=base_model,
                max_adapters=max_adapters,
                task_status=task_status,
            )
        )
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


def adam_like_step(
    state: dict[str, torch.Tensor], seed: int, density: float, float_noise: float = 0.0
) -> dict[str, torch.Tensor]:
    """A fraction ``density`` of the bf16 values move ±1 ulp (as Adam moves served weights);
    other float tensors get N(0, ``float_noise``) added. Tied tensors stay tied."""
    g = torch.Generator().manual_seed(seed)
    made: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if id(t) not in made:
            new = t.clone()
            if t.dtype == torch.bfloat16:
                bits = new.view(torch.int16).reshape(-1)
                hit = torch.rand(bits.numel(), generator=g) < density
                step = (torch.randint(0, 2, (int(hit.sum()),), generator=g) * 2 - 1).to(torch.int16)
                old = bits[hit]
                moved = old + step  # one ulp of magnitude, in sign-magnitude bits
                # one ulp below ±0 is the smallest subnormal of the other sign, not a NaN pattern
                moved[(old == 0) & (step < 0)] = -32767  # 0x8001
                moved[(old == -32768) & (step < 0)] = 1  # 0x8000 (-0) → 0x0001
                bits[hit] = moved
            elif t.is_floating_point() and float_noise:
                new += torch.randn(t.shape, generator=g) * float_noise
            made[id(t)] = new
        out[name] = made[id(t)]
    return out
