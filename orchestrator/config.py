"""The configuration tree: one pydantic model, loaded from TOML with dotted command-line overrides.

Precedence is defaults < TOML file < command line. A command-line override mirrors the field
path: ``--trainer.max_steps 2`` sets ``[trainer] max_steps = 2``; its value is read as a TOML
value when it parses as one (``2``, ``1e-3``, ``true``, ``"x"``, ``[1, 2]``) and as a plain string
otherwise. Any unknown key or bad value fails before anything starts, with a :class:`ConfigError`
naming the key and where it came from (the file, or the command line).

Importing this module must not import torch (the CLI parses configs before any heavy import).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from orchestrator.errors import ConfigError
from orchestrator.types import EndpointRef
from policies.board.types import BoardOptions, check_run_name
from policies.errors import BoardError
from policies.train.config import FLOAT_VIEWS, TrainerConfig
from policies.wire.tool_parsers import TOOL_PARSERS
from staleness.config import DropRule, StalenessConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class RunConfig(_Section):
    name: str = "demo"
    """Run name; the run directory is ``<root>/<name>`` and the board's is ``<board>/<name>``
    (1-128 letters, digits, ``.``, ``_`` or ``-``, starting with a letter or digit, no ``..``)."""
    root: Path = Path("runs")
    """Directory under which run directories are created."""
    seed: int = Field(default=0, ge=0)
    """Seed for the trainer, task order and sampling."""
    overwrite: bool = False
    """Replace the run directory when it exists (its logs, board and checkpoints are deleted);
    False: refuse to start, naming the run it would replace."""
    report: bool = True
    """Write ``<run dir>/report.html`` (``orchestrate report``) when the run ends."""
    resume: bool = False
    """Continue the run in the existing run directory after a crash or a stop (SIGKILL, Ctrl-C)
    instead of starting from scratch: the trainer resumes from its checkpoint (needs
    ``trainer.checkpoint`` for the in-process trainer), the logs are appended to and reconciled
    (``orchestrator/record/resume.py``). Keep the other settings as they were (``trainer.max_steps``
    may grow)."""

    @field_validator("name")
    @classmethod
    def _one_board_segment(cls, name: str) -> str:
        try:
            return check_run_name(name)
        except BoardError as exc:
            raise ValueError(str(exc)) from None


class WarmStartConfig(_Section):
    """SFT on ideal calculator episodes before RL (:mod:`policies.train.sft`), for a model
    sprawl builds (``model.init``): a random model almost never writes a tool call, so RL on it
    has nothing to reinforce. The recipe is :func:`policies.train.sft.sft_phases`."""

    steps: int = Field(default=1800, ge=0)
    """SFT steps on operands 2..99: the tool-call format and copying numbers."""
    focus_steps: int = Field(default=100, ge=0)
    """Then SFT steps on the run's own range (the calculator's ``max_operand``)."""
    eval_episodes: int = Field(default=32, ge=0)
    """Episodes sampled before and after the last phase to score it (``<model>/sft.json``)."""


class ModelConfig(_Section):
    path: Path = Path("runs/models/tiny")
    """HF causal-LM directory (safetensors) the trainer starts from."""
    init: Literal["tiny", "small", "medium", "tiny-moe"] | None = "tiny"
    """Build sprawl's own model of this size at ``path`` if it is missing (None: require it)."""
    warm_start: WarmStartConfig | None = None
    """Warm-start the model sprawl builds at ``path`` by SFT (``[model.warm_start]``); the model
    is built once and reused by later runs while its ``sft.json`` records the same recipe."""
    tool_parser: str | None = None
    """How the model writes tool calls (``hermes``, ``llama3_json``, ``mistral``,
    ``qwen3_coder``); None: from ``<path>/sprawl.json``, else detected from the chat template."""
    max_context: int | None = Field(default=None, ge=64)
    """Tokens an episode's sequence may reach; None: the model's ``max_position_embeddings``
    (engines that serve less bound it further)."""

    @model_validator(mode="after")
    def _warm_start_builds(self) -> ModelConfig:
        if self.warm_start is not None and self.init is None:
            raise ValueError("model.warm_start needs model.init (the size of the model to build)")
        return self

    @field_validator("tool_parser")
    @classmethod
    def _known_parser(cls, name: str | None) -> str | None:
        if name is not None and name not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {name!r}; one of {', '.join(TOOL_PARSERS)}")
        return name


class BoardConfig(BoardOptions):
    """The ``[board]`` section: where the board is, how sidecars watch it, and the publisher's
    :class:`~policies.board.types.BoardOptions` themselves (inherited, not copied)."""

    url: str | None = None
    """fsspec URL or path of the version board; default ``<run dir>/board``."""
    poll_interval_s: float = Field(default=0.25, gt=0, le=60)
    """How often sidecars re-read the board pointer (a missed notification delays this long)."""


class EndpointConfig(_Section):
    url: str = Field(pattern=r"^https?://")
    """Base URL of a rollout endpoint speaking the request lane."""
    token: str | None = None
    """Bearer token for this endpoint."""
    weight: float = Field(default=1.0, gt=0)
    """Relative capacity of this endpoint."""


class _IslandConfig(_Section):
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
    activation: Literal["wait", "pause"] = "pause"
    """How the sidecar switches versions: drain in-flight requests, or vLLM's ``/pause``."""
    max_model_len: int = Field(default=2048, ge=64)
    """vLLM's ``--max-model-len`` (the context the sidecar advertises)."""
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    """In ``pause`` activation, the running requests' KV cache when a version lands:
    ``recompute`` it under the new weights (exact), or ``keep`` it (PipelineRL's way: faster, but
    their later tokens are sampled by the new version from KV the old one computed; logged as
    ``vllm.kv_kept``)."""
    update: Literal["inplace", "reload"] = "inplace"
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


class RayResourcesConfig(_Section):
    """``[fleet.ray.resources]``: what one island asks of Ray (where it is placed)."""

    num_cpus: float = Field(default=1.0, ge=0)
    """CPUs reserved per island."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per island (the engine sees only those Ray assigns it)."""
    custom: dict[str, float] = Field(default_factory=dict)
    """Ray custom resources per island, e.g. ``{"region:eu-west" = 0.01}`` for nodes started
    with ``ray start --resources '{"region:eu-west": 1}'``: how islands are pinned to a region
    or a provider."""


class RayFleetConfig(_Section):
    """``[fleet.ray]``: rollout islands as Ray actors, placed by their resources, supervised
    by the run (:mod:`orchestrator.rayfleet`)."""

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


class FleetConfig(_Section):
    local_engines: int = Field(default=2, ge=0, le=64)
    """Reference engines ``orchestrate`` launches as subprocesses on loopback."""
    device: Literal["cpu", "cuda"] = "cpu"
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
            EndpointRef(id=f"remote-{i}", url=e.url.rstrip("/"), token=e.token, weight=e.weight)
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


class SamplingConfig(_Section):
    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature (the trainer scores tokens at the same temperature)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(default=0, ge=0)
    """Top-k cut-off; 0 disables it."""
    max_tokens: int = Field(default=48, ge=1)
    """Tokens sampled per model call at most."""


class SchedulerConfig(_Section):
    group_size: int = Field(default=4, ge=1)
    """Episodes per GRPO group (same task)."""
    groups_per_batch: int = Field(default=2, ge=1)
    """Groups the trainer consumes per optimizer step."""
    max_lag: int = Field(default=1, ge=0)
    """Trainer versions a sample may lag when it is trained on (0: synchronous)."""
    max_concurrent_episodes: int = Field(default=16, ge=1)
    """Episodes in flight at once."""


class TimeoutsConfig(_Section):
    connect_s: float = Field(default=5.0, gt=0)
    """Connecting to an endpoint."""
    call_s: float = Field(default=60.0, gt=0)
    """One model call (raises, so retry/failover can act)."""
    tool_s: float = Field(default=10.0, gt=0)
    """One tool call."""
    episode_s: float = Field(default=300.0, gt=0)
    """A whole episode (graceful: the partial trajectory is kept, stop reason episode_timeout)."""
    trainer_step_s: float = Field(default=3600.0, gt=0)
    """How long an external trainer may take to publish the next version after a batch."""
    version_wait_s: float = Field(default=120.0, gt=0)
    """How long a call waits for an endpoint inside its version bounds."""


class EnvironmentConfig(_Section):
    kind: Literal["class", "verifiers"] = "class"
    """``class``: a sprawl Environment subclass named by ``cls``; ``verifiers``: a verifiers
    environment named by ``id``, run by its own rollout loop (docs/environments.md)."""
    cls: str = "environments.calculator:Calculator"
    """Import path ``module:Class`` of the Environment subclass (``kind = "class"``)."""
    id: str | None = None
    """The verifiers environment's module or id (``kind = "verifiers"``): ``my_env``, or
    ``owner/my-env`` for the module ``my_env``."""
    max_turns: int = Field(default=3, ge=1)
    """Model calls per episode at most."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Arguments validated by the environment's own config model (``kind = "verifiers"``: the
    keyword arguments of its ``load_environment``)."""

    @model_validator(mode="after")
    def _kind_names_the_environment(self) -> EnvironmentConfig:
        if self.kind == "verifiers":
            if not self.id:
                raise ValueError(
                    "id: required when kind = 'verifiers' (the verifiers environment's module "
                    "or id)"
                )
            if "cls" in self.model_fields_set:
                raise ValueError("cls: not used when kind = 'verifiers'; name it in id")
        elif self.id is not None:
            raise ValueError("id: only for kind = 'verifiers'; a class is named by cls")
        return self

    def target(self) -> str:
        """What the loader imports: ``id`` for a verifiers environment, else ``cls``."""
        return self.id if self.kind == "verifiers" and self.id else self.cls


class EnvironmentStaleness(_Section):
    """An environment's own staleness rule, replacing the given keys of the run's
    ``[staleness]`` (a key left out keeps the run's value; no deeper merge). Only ``drop`` may be
    given: the orchestrator decides each group by its environment's rule, while the correction
    and the loss reduction are the trainer's, applied to whole mixed batches."""

    drop: DropRule | None = None
    """This environment's drop rule (``None``: the lag budget, ``scheduler.max_lag``)."""


class MixtureEnvironmentConfig(EnvironmentConfig):
    """One ``[[environments]]`` entry: an environment of a mixture, admitted by weight."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """The environment's name in the run (``Episode.environment``, log fields, metric labels);
    unique within the run."""
    weight: float = Field(default=1.0, gt=0)
    """Share of admitted groups, relative to the other entries' weights."""
    staleness: EnvironmentStaleness | None = None
    """Overrides of the run's ``[staleness]`` for this environment's groups (``drop`` only)."""

    @model_validator(mode="before")
    @classmethod
    def _class_entry_names_cls(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kind", "class") == "class" and "cls" not in data:
            raise ValueError("cls: required (import path module:Class of the environment)")
        return data

    def effective_staleness(self, run: StalenessConfig) -> StalenessConfig:
        """The run's ``[staleness]`` with this entry's given keys replacing the run's."""
        if self.staleness is None:
            return run
        given = self.staleness.model_dump(include=self.staleness.model_fields_set)
        return run.model_validate({**run.model_dump(), **given})


class AdminConfig(_Section):
    enabled: bool = True
    """Serve the admin API (fleet add/remove/list) while the run goes on."""
    host: str = "127.0.0.1"
    """Address the admin API binds."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the admin API; 0 picks a free one (written to ``<run dir>/admin.json``)."""
    token: str | None = Field(default=None, min_length=1)
    """Bearer token the admin API requires (every route but /health); unset: a random one per
    run. Either way it is written with the URL to ``<run dir>/admin.json`` (mode 0600)."""


class LogConfig(_Section):
    format: Literal["auto", "pretty", "json"] = "auto"
    """``auto``: pretty on a terminal, JSON otherwise."""
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Minimum level logged."""


class Config(_Section):
    """The whole resolved configuration of a run."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    board: BoardConfig = Field(default_factory=BoardConfig)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    environments: list[MixtureEnvironmentConfig] = Field(default_factory=list)
    """Several environments in one run (``[[environments]]``), admitted by ``weight``; exclusive
    with ``[environment]``, the one-environment form."""
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _resume_has_a_checkpoint(self) -> Config:
        if self.run.resume and self.trainer.mode == "in_process" and not self.trainer.checkpoint:
            raise ValueError(
                "run.resume needs trainer.checkpoint = true (the in-process trainer resumes "
                "from its checkpoint in <run dir>/trainer/ckpt)"
            )
        return self

    @model_validator(mode="after")
    def _islands_serve_float_views(self) -> Config:
        view = self.trainer.served_view
        if view not in FLOAT_VIEWS and self.fleet.islands:
            kind = self.fleet.islands[0].kind
            raise ValueError(
                f"trainer.served_view = {view!r} is served only by the reference engines: "
                f"fleet.islands[0] (kind {kind!r}) cannot serve quantized views here; use "
                "trainer.served_view = 'bfloat16' or drop the islands"
            )
        return self

    @model_validator(mode="after")
    def _lora_islands_are_vllm(self) -> Config:
        if self.trainer.lora is None:
            return self
        engines = self.fleet.engine_islands()
        for key, spec in engines:
            if spec.kind != "vllm":
                raise ValueError(
                    f"trainer.lora: {key} (kind {spec.kind!r}) cannot serve LoRA versions; of "
                    "the islands only kind 'vllm' does (docs/fleet.md#lora-versions)"
                )
        from policies.serve.backends.vllm_launch import LORA_RANKS

        if engines and self.trainer.lora.rank > LORA_RANKS[-1]:
            raise ValueError(
                f"trainer.lora.rank = {self.trainer.lora.rank}: vLLM islands ({engines[0][0]}) "
                f"serve LoRA ranks up to {LORA_RANKS[-1]}"
            )
        return self

    @model_validator(mode="after")
    def _router_replay_has_a_routing_engine(self) -> Config:
        if not self.trainer.router_replay:
            return self
        fleet = self.fleet
        ray = fleet.ray
        if fleet.local_engines or fleet.endpoints or (ray and ray.islands and not ray.engine):
            return self  # reference engines route; a remote endpoint may
        engines = fleet.engine_islands()
        if any(s.kind == "vllm" and s.routed_experts for _, s in engines):
            return self
        why = "; ".join(
            f"{key} (kind {s.kind!r}) "
            + ("needs routed_experts = true" if s.kind == "vllm" else "reports no routing")
            for key, s in engines
        )
        raise ValueError(  # the fleet has an endpoint (checked above): here, an island
            f"trainer.router_replay = true, but no engine of the fleet returns MoE routing: {why}; "
            "add reference engines (fleet.local_engines) or a vLLM island with "
            "routed_experts = true (docs/trainer.md#moe-router-replay)"
        )

    @model_validator(mode="after")
    def _one_environment_form(self) -> Config:
        # a dump of a mixture's config carries the default [environment]: it round-trips
        given = "environment" in self.model_fields_set and self.environment != EnvironmentConfig()
        if self.environments and given:
            raise ValueError(
                "[environment] and [[environments]] are exclusive: give one environment in "
                "[environment], or a mixture in [[environments]]"
            )
        names = [e.name for e in self.environments]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"environments: names must be unique, {', '.join(dup)} repeated")
        return self

    @model_validator(mode="after")
    def _external_trainer_shares_a_board(self) -> Config:
        mode = self.trainer.mode
        if mode in ("external", "feed") and self.board.url is None:
            raise ValueError(
                f"board.url must be set when trainer.mode is {mode!r} (the trainer and the "
                "orchestrator share it; the default lives inside the run dir, which a new run "
                "clears)"
            )
        if mode == "feed" and self.run.resume:
            raise ValueError(
                "run.resume is not supported with trainer.mode = 'feed' (the feed holds the "
                "batch in flight in memory only); resume a run of trainer.mode = 'external'"
            )
        return self

    def environment_staleness(self) -> dict[str, StalenessConfig]:
        """Name → staleness config of each ``[[environments]]`` entry with a ``staleness``
        table of its own (the others are decided by the run's ``[staleness]``)."""
        return {
            e.name: e.effective_staleness(self.staleness)
            for e in self.environments
            if e.staleness is not None and e.staleness.model_fields_set
        }

    @property
    def run_dir(self) -> Path:
        return self.run.root / self.run.name

    @property
    def board_url(self) -> str:
        return self.board.url or str(self.run_dir / "board")


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["--a.b", "1", "--c=x"]`` into ``{"a.b": 1, "c": "x"}`` (values read as TOML)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like --section.key VALUE"
            )
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key} (command line): missing value")
            value = args[i + 1]
            i += 1
        out[key] = _toml_value(value)
        i += 1
    return out


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Load ``path`` (TOML), apply dotted ``overrides``; raise :class:`ConfigError` on a problem."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    from_cli: set[str] = set()
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
        from_cli.add(dotted)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source, from_cli)) from None


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted} (command line): {part} is not a section")
        node = child
    node[parts[-1]] = value


def _describe(exc: ValidationError, source: str, from_cli: set[str]) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        where = (
            "command line" if any(key == k or key.startswith(k + ".") for k in from_cli) else source
        )
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        got = "" if err["type"] == "extra_forbidden" else f" (got {err['input']!r})"
        lines.append(f"{where}: {key or '<root>'}: {msg}{got}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
