"""The ``[fleet]`` section: the rollout endpoints, the local engines, the islands of other engine
kinds (``[[fleet.islands]]``), the islands on Ray (``[fleet.ray]``) and how all are supervised.

Checked at load: the fleet has at least one endpoint, the restart back-off cap is not below its
first wait, and a vLLM island that returns MoE routing names a GPU build of vLLM. Checks that
need other sections (LoRA versions, router replay, served views) are
:class:`~orchestrator.config.tree.Config`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, model_validator

from orchestrator.config.sections import Section
from orchestrator.types import EndpointRef
from policies.serve.options import Device, KVOnUpdate, VLLMUpdate
from policies.serve.types import QuiesceMode


class EndpointConfig(Section):
    url: str = Field(pattern=r"^https?://")
    """Base URL of a rollout endpoint speaking the request lane."""
    token: SecretStr | None = None
    """Bearer token for this endpoint (never written out: ``**********`` in config.json)."""
    weight: float = Field(default=1.0, gt=0)
    """Relative capacity of this endpoint."""


class _IslandConfig(Section):
    weight: float = Field(default=1.0, gt=0)
    """Relative capacity of this island in the pool."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    """How long the island (engine and sidecar) may take to report ready."""


class VLLMIslandConfig(_IslandConfig):
    """A local vLLM engine behind ``orchestrate sidecar --engine-kind vllm``: vLLM starts from
    the board's version 0, materialized into ``<run dir>/islands/vllm-<i>/model`` (its CPU
    attention needs head_dim ≥ 32: sprawl's ``small`` model, not ``tiny``), and takes later
    versions as patches through the sidecar."""

    kind: Literal["vllm"]
    """The engine kind (``orchestrate sidecar --engine-kind``)."""
    activation: QuiesceMode = "pause"
    """How the sidecar switches versions: drain in-flight requests, or vLLM's ``/pause``."""
    max_model_len: int = Field(default=2048, ge=64)
    """vLLM's ``--max-model-len`` (the context the sidecar advertises)."""
    kv_on_update: KVOnUpdate = "recompute"
    """In ``pause`` activation, the running requests' KV cache when a version lands:
    ``recompute`` it under the new weights (exact), or ``keep`` it (PipelineRL's way: faster, but
    their later tokens are sampled by the new version from KV the old one computed; logged as
    ``vllm.kv_kept``)."""
    update: VLLMUpdate = "inplace"
    """How a version reaches vLLM: ``inplace`` (the engine patch through vLLM's weight-transfer
    API, sprawl's backend; the CPU build then serves unpacked linear weights) or ``reload`` (the
    whole view written as a file and reloaded: the fallback and benchmark baseline)."""
    python: Path | None = None
    """Python of the vLLM environment; None: ``scripts/build-vllm-env.sh``'s cached build
    (built on first use, about 3 minutes)."""
    routed_experts: bool = False
    """Start vLLM with ``--enable-return-routed-experts`` (and its V2 model runner), so an MoE
    model's routing reaches the trainer (``trainer.router_replay``). Needs a GPU build of vLLM
    given as ``python``: the CPU build refuses it."""

    @model_validator(mode="after")
    def _routing_needs_a_gpu_build(self) -> VLLMIslandConfig:
        if self.routed_experts and self.python is None:
            raise ValueError(
                "routed_experts = true needs a GPU build of vLLM: set python to its environment's "
                "python (the default CPU build refuses --enable-return-routed-experts)"
            )
        return self


class LlamaCppIslandConfig(_IslandConfig):
    """``orchestrate sidecar --engine-kind llamacpp``: the sidecar runs its own ``llama-server``
    on each version's GGUF, written under ``<run dir>/islands/llamacpp-<i>``."""

    kind: Literal["llamacpp"]
    """The engine kind (``orchestrate sidecar --engine-kind``)."""
    llama_server: Path | None = None
    """The ``llama-server`` binary; None: ``scripts/build-llama-server.sh``'s cached build
    (built on first use, about 10 minutes)."""
    ctx: int | None = Field(default=None, ge=64)
    """``llama-server -c``; None: the model's ``max_position_embeddings``."""
    args: list[str] = Field(default_factory=list)
    """Extra ``llama-server`` arguments, e.g. ``["-t", "2"]``."""
    restart: bool = False
    """Stop the old server before starting the new version's (half the memory, a longer pause)."""


IslandConfig = Annotated[VLLMIslandConfig | LlamaCppIslandConfig, Field(discriminator="kind")]


AWS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_DEFAULT_REGION",
)
"""The environment variables of S3 credentials (what ``fleet.ray.env`` hands islands)."""


class RayResourcesConfig(Section):
    """``[fleet.ray.resources]``: what one island asks of Ray (where it is placed)."""

    num_cpus: float = Field(default=1.0, ge=0)
    """CPUs reserved per island."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per island (the engine sees only those Ray assigns it)."""
    custom: dict[str, float] = Field(default_factory=dict)
    """Ray custom resources per island, e.g. ``{"region:eu-west" = 0.01}`` for nodes started
    with ``ray start --resources '{"region:eu-west": 1}'``: how islands are pinned to a region
    or a provider."""


class RayFleetConfig(Section):
    """``[fleet.ray]``: rollout islands as Ray actors, placed by their resources, supervised
    by the run (:mod:`orchestrator.fleet`)."""

    address: str = "auto"
    """The Ray cluster (``ray.init(address=…)``): ``auto`` is the one this machine joined with
    ``ray start``, ``ray://host:10001`` a remote one, ``local`` a one-node cluster of the run's."""
    namespace: str | None = None
    """Ray namespace of the run's actors; default ``sprawl-<run name>``."""
    islands: int = Field(default=2, ge=0, le=1024)
    """Islands started with the run (ids ``ray-<i>``); ``orchestrate fleet scale`` changes it."""
    engine: IslandConfig | None = None
    """The engine of each island: the reference engine when unset, else ``[fleet.ray.engine]``
    with ``kind = "vllm"`` and the keys of a ``[[fleet.islands]]`` entry."""
    resources: RayResourcesConfig = Field(default_factory=RayResourcesConfig)
    work_dir: str = "/tmp/sprawl-islands"
    """Where an island works on its node: ``<work_dir>/<run>/<id>`` (engine logs, GGUFs,
    materialized models)."""
    env: list[str] = Field(default_factory=lambda: list(AWS_ENV))
    """Environment variables (those set) handed to every island's engine: the board's storage
    credentials. They travel as actor arguments, never in Ray's ``runtime_env`` or a log."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    """How long an island may take from placement to serving."""
    health_interval_s: float = Field(default=1.0, gt=0)
    """How often each island's processes and ``/health`` are checked."""
    drain_timeout_s: float = Field(default=60.0, ge=0)
    """How long a removed island's calls in flight may take before it is stopped (they fail
    over with their token prefix after that)."""


class FleetConfig(Section):
    local_engines: int = Field(default=2, ge=0, le=64)
    """Reference engines ``orchestrate`` launches as subprocesses on loopback."""
    device: Device = "cpu"
    """Device of the local engines."""
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    """Remote endpoints (any engine behind a sidecar), in addition to the local ones."""
    islands: list[IslandConfig] = Field(default_factory=list)
    """Local islands of other engine kinds (``[[fleet.islands]]`` with ``kind = "vllm"`` or
    ``"llamacpp"``), launched beside the reference engines; endpoint ids ``<kind>-<i>``."""
    startup_timeout_s: float = Field(default=120.0, gt=0)
    """How long a local engine may take to report ready."""
    max_adapters: int = Field(default=4, ge=1, le=256)
    """LoRA versions (``trainer.lora``) each engine of the run (reference engines, vLLM islands)
    keeps resident at once, the least recently used evicted: a request is served at the newest
    resident version its bounds admit, and gets a 409 when none is (docs/fleet.md#lora-versions)."""
    max_inflight_per_endpoint: int = Field(default=4, ge=1)
    """Concurrent model calls sent to one endpoint at most (the adaptive limit's ceiling)."""
    breaker_failures: int = Field(default=3, ge=1)
    """Consecutive failed calls that open an endpoint's circuit breaker."""
    breaker_cooldown_s: float = Field(default=10.0, gt=0)
    """How long an open breaker keeps an endpoint out of rotation before one probe call."""
    restart: bool = True
    """Supervise the local engines and islands: one that exits, or whose health checks fail for
    ``unhealthy_s``, is taken out of rotation at once and restarted (``false``: it stays in the
    pool, kept out of rotation by its failed health checks and breaker, never restarted)."""
    max_restarts: int = Field(default=5, ge=0)
    """Restarts per local endpoint for the whole run; once spent it stays out of rotation."""
    restart_backoff_s: float = Field(default=1.0, gt=0)
    """Wait before an endpoint's first restart; doubled for each further one."""
    restart_backoff_max_s: float = Field(default=60.0, gt=0)
    """The longest wait before a restart."""
    unhealthy_s: float = Field(default=30.0, gt=0)
    """How long a live local endpoint's health checks may fail in a row before it is restarted."""
    ray: RayFleetConfig | None = None
    """Islands on a Ray cluster (``[fleet.ray]``), started and supervised with the run."""

    def engine_islands(self) -> list[tuple[str, VLLMIslandConfig | LlamaCppIslandConfig]]:
        """The islands of other engine kinds the run launches, each with its config key: the
        local ones, and the Ray islands' engine when they run one."""
        out: list[tuple[str, VLLMIslandConfig | LlamaCppIslandConfig]] = [
            (f"fleet.islands[{i}]", spec) for i, spec in enumerate(self.islands)
        ]
        if self.ray is not None and self.ray.islands and self.ray.engine is not None:
            out.append(("fleet.ray.engine", self.ray.engine))
        return out

    def endpoint_refs(self) -> list[EndpointRef]:
        return [
            EndpointRef(
                id=f"remote-{i}",
                url=e.url.rstrip("/"),
                token=e.token.get_secret_value() if e.token is not None else None,
                weight=e.weight,
            )
            for i, e in enumerate(self.endpoints)
        ]

    @model_validator(mode="after")
    def _has_endpoints(self) -> FleetConfig:
        rays = self.ray.islands if self.ray is not None else 0
        if self.local_engines == 0 and not self.endpoints and not self.islands and not rays:
            raise ValueError(
                "no rollout endpoints: set fleet.local_engines > 0, fleet.islands, "
                "fleet.endpoints or fleet.ray.islands"
            )
        return self

    @model_validator(mode="after")
    def _backoff_cap_above_start(self) -> FleetConfig:
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError(
                f"fleet.restart_backoff_max_s ({self.restart_backoff_max_s}) is below "
                f"fleet.restart_backoff_s ({self.restart_backoff_s}): the cap must be at least the "
                "first wait"
            )
        return self
