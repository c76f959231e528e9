"""The llama-server contract: where the binary is, the flags it runs with, what a request sends
and how the log prob of the distribution sampled is read back.

Built against llama.cpp commit 0c1e5709 (vendored in llama-cpp-python 0.3.36; see
``docs/fleet.md``). Every sampling field is sent explicitly, with the sampler chain
``temperature → top_k → top_p`` (llama.cpp's default chain puts temperature last and adds
``min_p``), and the sampled token's log prob is ``log(prob)`` of the post-sampling distribution
(greedy: the raw log prob, as the reference engine reports it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from anyio.abc import Process

from policies.board.gguf import MatrixDtype
from policies.errors import EngineError
from policies.serve.backends.base import EngineUnavailable
from policies.wire.lane import GenerateRequest

log = structlog.get_logger(__name__)

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist whose vendored llama.cpp (0c1e5709) we build
EXACT_FLAGS = ("-fa", "off", "-ctk", "f32", "-ctv", "f32", "--cache-ram", "0", "-np", "1")
SAMPLERS = ("temperature", "top_k", "top_p")


def default_server_path() -> Path:
    """Where ``scripts/build-llama-server.sh`` caches the binary."""
    root = os.environ.get("SPRAWL_ENGINE_CACHE") or Path.home() / ".cache/sprawl/engines"
    return Path(root) / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}/bin/llama-server"


def find_llama_server(explicit: Path | None) -> Path:
    """``explicit`` (``--llama-server``) or the cached build; raises naming both when absent."""
    path = explicit or default_server_path()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EngineError(
            f"no llama-server at {path}: pass --llama-server PATH or run "
            "scripts/build-llama-server.sh (it caches the binary there)"
        )
    return path


@dataclass(frozen=True)
class LlamaOptions:
    """How the sidecar runs its ``llama-server``."""

    server: Path
    ctx_size: int | None = None
    """``-c``; None: the model's ``max_position_embeddings`` (``--llama-ctx``)."""
    extra_args: tuple[str, ...] = ()
    """Appended to the command line (``--llama-arg``), e.g. ``-t 8``."""
    startup_timeout_s: float = 60.0
    """Seconds a (re)started server has to answer ``/health`` (``--llama-startup-timeout``)."""
    matrix_dtype: MatrixDtype = "f32"
    prewarm: bool = True
    """Start the new version's server while the old one serves, then switch (the pause is the
    switch; two servers run while a version stages). False: stop, then start on the new file
    (half the memory; the pause is the restart) — ``--llama-restart``."""


def sampled_logprob(
    raw: Sequence[float], token: int, temperature: float, top_k: int, top_p: float
) -> float:
    """Log prob of ``token`` after temperature → top-k → top-p over raw log probs ``raw``
    (the reference engine's ``sample_token`` rule; temperature 0 is the raw log prob)."""
    logits = torch.tensor(raw, dtype=torch.float32)
    if temperature == 0.0:
        return float(torch.log_softmax(logits, -1)[token])
    scaled = logits / temperature
    if 0 < top_k < scaled.numel():
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k).values[-1], -math.inf)
    if top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(ordered, -1)
        scaled = scaled.scatter(0, order[(torch.cumsum(probs, -1) - probs) >= top_p], -math.inf)
    return float(torch.log_softmax(scaled, -1)[token])


def completion_body(
    req: GenerateRequest, prompt: list[int], n_predict: int, seed: int | None
) -> dict[str, object]:
    """The ``/completion`` body for one choice: every sampling field explicit."""
    greedy = req.temperature == 0.0
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "samplers": list(SAMPLERS),
        "temperature": req.temperature,
        "top_k": req.top_k,
        "top_p": req.top_p,
        "min_p": 0.0,
        "typical_p": 1.0,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "dry_multiplier": 0.0,
        "dynatemp_range": 0.0,
        "mirostat": 0,
        "repeat_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logit_bias": [],
        "ignore_eos": False,
        "seed": -1 if seed is None else seed,
        "n_probs": 1,
        "post_sampling_probs": not greedy,
        "return_tokens": True,
        "cache_prompt": False,
        "stream": False,
    }


def number(entry: Mapping[str, object], key: str) -> float:
    value = entry.get(key)
    if not isinstance(value, (int, float)):
        raise EngineUnavailable(f"llamacpp probs entry without a numeric {key!r}: {entry}")
    return float(value)


@dataclass
class ServerChild:
    """One running ``llama-server`` and what it reported about itself."""

    proc: Process
    url: str
    gguf: Path
    n_ctx: int = 0
    n_vocab: int = 0
    ascii: int = 0  # a single-byte token, forced when filling a UTF-8 gap

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None
