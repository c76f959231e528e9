"""The root of the config tree, :class:`Config`: one field per section, and the checks that span
sections.

A :class:`Config` that validates names a run that can start as configured: a resumed in-process
trainer has a checkpoint, islands of other engine kinds serve float views only, LoRA versions go
to vLLM islands within their ranks, router replay has an engine that returns MoE routing, the
environments are given in one form with unique names, an external trainer shares an explicit
board, dynamic sampling has groups of two or more, a soft overlong penalty's buffer fits in a
model call, a batch holds at least ``trainer.minibatches`` groups, and the trainer's PPO clip
options are not set beside a correction that clips with its own (``cispo``, ``gspo``). What is
only known at run time (a model's chat template, an engine that starts) is not checked here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from orchestrator.config.environment import (
    EnvironmentConfig,
    MixtureEnvironmentConfig,
)
from orchestrator.config.fleet import FleetConfig
from orchestrator.config.sections import (
    AdminConfig,
    BoardConfig,
    LogConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    SchedulerConfig,
    Section,
    TimeoutsConfig,
)
from policies.train.config import FLOAT_VIEWS, TrainerConfig
from staleness.config import StalenessConfig


class Config(Section):
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
        return self

    @model_validator(mode="after")
    def _feed_bound_can_fill(self) -> Config:
        ahead = self.scheduler.max_lag + 1
        if self.trainer.mode == "feed" and self.trainer.feed.max_batches > ahead:
            raise ValueError(
                f"trainer.feed.max_batches = {self.trainer.feed.max_batches} can never fill: "
                f"admission (scheduler.max_lag = {self.scheduler.max_lag}) lets at most {ahead} "
                f"batches be formed before the trainer acknowledges one; set it to {ahead} or less"
            )
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_has_groups(self) -> Config:
        if self.scheduler.filters_groups is not None and self.scheduler.group_size < 2:
            raise ValueError(
                "scheduler.dynamic_sampling needs scheduler.group_size >= 2 (the rewards of a "
                "group of one are always equal: every group would be dropped)"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits_a_call(self) -> Config:
        s, max_tokens = self.staleness, self.sampling.max_tokens
        if s.overlong == "soft_penalty" and (s.overlong_buffer or 0) > max_tokens:
            raise ValueError(
                f"staleness.overlong_buffer = {s.overlong_buffer} exceeds sampling.max_tokens = "
                f"{max_tokens}: every response would be penalized (the buffer is the last "
                "tokens before max_tokens)"
            )
        return self

    @model_validator(mode="after")
    def _minibatches_fit_the_batch(self) -> Config:
        k, groups = self.trainer.minibatches, self.scheduler.groups_per_batch
        if k > groups:
            raise ValueError(
                f"trainer.minibatches = {k}: a batch has scheduler.groups_per_batch = {groups} "
                "groups and each minibatch takes whole groups; use at most that many"
            )
        surrogate = self.staleness.correction.type
        unused = [
            key
            for key, value in (
                ("clip_eps_high", self.trainer.clip_eps_high),
                ("dual_clip_c", self.trainer.dual_clip_c),
            )
            if value is not None
        ]
        if surrogate in ("cispo", "gspo") and unused:
            raise ValueError(
                f"trainer.{unused[0]} clips the PPO-clip term; staleness.correction.type = "
                f"{surrogate!r} trains with its own (set staleness.correction.clip_eps / "
                "clip_eps_high instead)"
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
