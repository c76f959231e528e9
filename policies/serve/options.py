"""The options of the serving commands, one model each: ``orchestrate serve`` (the reference
engine behind a lane) and ``orchestrate sidecar`` (a lane in front of another engine).

Each model is the one definition of its command's settings: the command's flags are generated
from it (:mod:`policies.wire.flags`), and every process that starts the command — the local
fleet, an island, a Ray actor — builds the same model and turns it into argv
(:func:`orchestrator.fleet.children.sprawl_command`), so a default, a bound and an error message
live here only. Importing this module is cheap (no torch): the run config takes its
vocabularies (``VLLMUpdate``, ``KVOnUpdate``, …) from here.

Guarantees: a model validates every value and every combination the command needs (exactly one
of ``--model`` and ``--board`` for ``serve``; an ``--engine-url`` for every sidecar engine kind
but ``llamacpp``, which starts its own; ``--tls-cert`` with ``--tls-key``); tokens and API keys
travel in the environment, never in argv (:func:`policies.wire.flags.secret_env`).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from policies.serve.connections import FLAGS as LIMIT_FLAGS
from policies.serve.connections import LaneLimits
from policies.serve.types import QuiesceMode

EngineKind = Literal["vllm", "sglang", "openai", "llamacpp"]
VLLMUpdate = Literal["inplace", "reload"]
KVOnUpdate = Literal["recompute", "keep"]
SGLangUpdate = Literal["inplace", "disk"]
LogFormat = Literal["auto", "pretty", "json"]
Device = Literal["cpu", "cuda"]


class LaneOptions(LaneLimits):
    """What every lane server takes: where it listens, its token, how it follows the board."""

    FLAGS: ClassVar[dict[str, str]] = LIMIT_FLAGS

    run: str = "demo"
    """Run name on the board."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port to listen on (0 picks a free one)."""
    token: str | None = Field(default=None, json_schema_extra={"secret": "SPRAWL_TOKEN"})
    """Bearer token required on every route but /health."""
    poll_interval: float = Field(default=0.25, gt=0, allow_inf_nan=False)
    """Seconds between looks at the board's pointer."""
    activation: QuiesceMode = "wait"
    """Drain in-flight requests before a version switch, or pause them at a step boundary."""
    max_adapters: int = Field(default=4, ge=1)
    """LoRA versions resident at once (least recently used evicted; fleet.max_adapters)."""
    tls_cert: Path | None = None
    """PEM certificate (serve over HTTPS; with --tls-key)."""
    tls_key: Path | None = None
    """PEM private key of --tls-cert."""
    parent_stdin: bool = False
    """Exit when stdin closes (how the process that started it stops it)."""
    log_format: LogFormat = "auto"
    """Log lines for a terminal (pretty), for machines (json), or chosen by stdout (auto)."""

    @model_validator(mode="after")
    def _tls_pair(self) -> LaneOptions:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        return self

    def limits(self) -> LaneLimits:
        """The connection limits these options set."""
        return LaneLimits(**{k: getattr(self, k) for k in LaneLimits.model_fields})


class ServeOptions(LaneOptions):
    """``orchestrate serve``: the reference engine serving a model dir or a board's versions."""

    COMMAND: ClassVar[str] = "serve"

    model: Path | None = None
    """HF model dir, served as fixed version 0."""
    board: str | None = None
    """Board URL (fsspec) or path: serve its newest version and follow it."""
    device: Device = "cpu"
    """Where the reference engine runs."""
    base_model: Path | None = None
    """With --board: the model dir whose weights a run's LoRA versions adapt (trainer.lora)."""

    @model_validator(mode="after")
    def _one_source(self) -> ServeOptions:
        if (self.model is None) == (self.board is None):
            raise ValueError("give exactly one of --model and --board")
        if self.base_model is not None and not (self.base_model / "config.json").is_file():
            raise ValueError(
                f"argument --base-model: {self.base_model} is not a model dir (no config.json)"
            )
        return self


class SidecarOptions(LaneOptions):
    """``orchestrate sidecar``: a version-aware lane in front of a vLLM, SGLang, llama.cpp or
    frozen OpenAI-compatible engine."""

    COMMAND: ClassVar[str] = "sidecar"

    engine_kind: EngineKind
    """The engine behind the sidecar."""
    board: str
    """Board URL (fsspec) or path."""
    port: int = Field(default=8100, ge=0, le=65535)
    """Port to listen on (0 picks a free one)."""
    poll_interval: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    """Seconds between looks at the board's pointer."""
    engine_url: str = ""
    """The engine's URL (every kind but llamacpp, which starts its own)."""
    engine_api_key: str | None = Field(
        default=None, json_schema_extra={"secret": "SPRAWL_ENGINE_API_KEY"}
    )
    """API key the engine requires."""
    vllm_update: VLLMUpdate = "inplace"
    """vllm: the engine patch through vLLM's weight-transfer API (the engine started with
    --weight-transfer-config '{"backend": "sprawl"}'), or the whole view reloaded."""
    kv_on_update: KVOnUpdate = "recompute"
    """vllm, --activation pause: the running requests' KV recomputed under the new version
    (exact), or kept (faster; their later tokens come from stale KV); sglang: recompute only."""
    sglang_update: SGLangUpdate = "inplace"
    """sglang: the engine patch through update_weights_from_tensor and sprawl's loader (the
    engine started with --custom-weight-loader
    policies.serve.backends.sglang_loader.apply_engine_patch), or the changed tensors through
    --materialize-dir and update_weights_from_disk."""
    materialize_dir: Path | None = None
    """Island-local directory the engine reads staged versions from (vLLM, SGLang)."""
    version: int | None = Field(default=None, ge=0)
    """The fixed version an openai engine serves."""
    model: str | None = None
    """Model name the engine serves (default: the run name)."""
    llama_server: Path | None = None
    """llamacpp: the llama-server binary (default: the cached build)."""
    llama_ctx: int | None = Field(default=None, ge=1)
    """llamacpp: llama-server -c (default: the model's context)."""
    llama_arg: list[str] = Field(default_factory=list)
    """llamacpp: one more llama-server argument (repeat the flag for more)."""
    llama_startup_timeout: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    """llamacpp: seconds llama-server may take to serve."""
    llama_restart: bool = False
    """llamacpp: stop the old llama-server before starting the new version's (half the memory)."""

    @model_validator(mode="after")
    def _engine_reached(self) -> SidecarOptions:
        if self.engine_kind == "llamacpp" and self.engine_url:
            raise ValueError("llamacpp starts its own engine; no --engine-url")
        if self.engine_kind != "llamacpp" and not self.engine_url:
            raise ValueError(f"--engine-kind {self.engine_kind} needs --engine-url")
        if self.engine_kind == "openai" and self.version is None:
            raise ValueError("--engine-kind openai needs --version (the version it serves)")
        return self
