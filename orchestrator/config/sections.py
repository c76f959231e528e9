"""The run-wide sections of the config tree, and :class:`Section`, the base of every section.

A section refuses unknown keys (``extra="forbid"``) and takes each field's description from the
docstring under it. Here: ``[run]``, ``[model]`` (with ``[model.warm_start]``), ``[board]``,
``[sampling]``, ``[scheduler]`` (with ``[scheduler.dynamic_sampling]``), ``[timeouts]``,
``[admin]`` and ``[log]``. Each checks only its own keys; checks that span sections are
:class:`~orchestrator.config.tree.Config`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from policies.board.types import BoardOptions, check_run_name
from policies.errors import BoardError
from policies.serve.options import LogFormat
from policies.wire.tool_parsers import TOOL_PARSERS


class Section(BaseModel):
    """A config section: unknown keys refused, each field described by its docstring."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class RunConfig(Section):
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


class WarmStartConfig(Section):
    """SFT on ideal calculator episodes before RL (:mod:`orchestrator.warm_start`), for a model
    sprawl builds (``model.init``): a random model almost never writes a tool call, so RL on it
    has nothing to reinforce. The recipe is :func:`orchestrator.warm_start.sft_phases`."""

    steps: int = Field(default=1800, ge=0)
    """SFT steps on operands 2..99: the tool-call format and copying numbers."""
    focus_steps: int = Field(default=100, ge=0)
    """Then SFT steps on the run's own range (the calculator's ``max_operand``)."""
    eval_episodes: int = Field(default=32, ge=0)
    """Episodes sampled before and after the last phase to score it (``<model>/sft.json``)."""


class ModelConfig(Section):
    path: Path = Path("runs/models/tiny")
    """HF causal-LM directory (safetensors) the trainer starts from."""
    init: Literal["tiny", "small", "medium", "tiny-moe"] | None = "tiny"
    """Build sprawl's own model of this size at ``path`` if it is missing (None: require it)."""
    warm_start: WarmStartConfig | None = None
    """Warm-start the model sprawl builds at ``path`` by SFT (``[model.warm_start]``); the model
    is built once and reused by later runs while its ``sft.json`` records the same recipe."""
    tool_parser: str | None = None
    """How the model writes tool calls (``hermes``, ``llama3_json``, ``mistral``,
    ``qwen3_coder``, ``openai``: gpt-oss's harmony); None: from ``<path>/sprawl.json``, else
    detected from the chat template."""
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


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature (the trainer scores tokens at the same temperature)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(default=0, ge=0)
    """Top-k cut-off; 0 disables it."""
    max_tokens: int = Field(default=48, ge=1)
    """Tokens sampled per model call at most."""


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (``[scheduler.dynamic_sampling]``; verl's
    ``algorithm.filter_groups``): a group whose rewards are all equal carries no GRPO advantage;
    the batcher drops it before it reaches a batch, and its admission slot goes to a new group
    under the same lag budget (:mod:`orchestrator.loop.batcher`). The table's presence turns it
    on."""

    enabled: bool = True
    """Filter groups; false turns a ``[scheduler.dynamic_sampling]`` table (or an override) off."""
    tolerance: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Rewards count as equal when their population std is at most this; None: the tolerance of
    the group advantages (8 float32 ulps of the largest |reward|,
    :func:`staleness.rewards.rewards_equal`), so exactly the groups whose advantages are all 0
    are dropped."""
    max_refills: int = Field(default=32, ge=0)
    """Groups it may drop (and so replace) while one batch is formed; one more stops the run with
    an error naming this key, as verl's ``max_num_gen_batches`` and SkyRL's
    ``max_sample_batches`` do (the tasks are too easy or too hard for the policy). 0: no bound,
    the batch waits for as many groups as it takes (verl's and SkyRL's 0)."""


class SchedulerConfig(Section):
    group_size: int = Field(default=4, ge=1)
    """Episodes per GRPO group (same task)."""
    groups_per_batch: int = Field(default=2, ge=1)
    """Groups the trainer consumes per optimizer step."""
    max_lag: int = Field(default=1, ge=0)
    """Trainer versions a sample may lag when it is trained on (0: synchronous)."""
    max_concurrent_episodes: int = Field(default=16, ge=1)
    """Episodes in flight at once."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """Drop groups whose rewards are all equal and admit replacements (DAPO); None: off."""

    @property
    def filters_groups(self) -> DynamicSamplingConfig | None:
        """The dynamic sampling config when it is on, else None."""
        ds = self.dynamic_sampling
        return ds if ds is not None and ds.enabled else None


class TimeoutsConfig(Section):
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


class AdminConfig(Section):
    enabled: bool = True
    """Serve the admin API (fleet add/remove/list) while the run goes on."""
    host: str = "127.0.0.1"
    """Address the admin API binds."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the admin API; 0 picks a free one (written to ``<run dir>/admin.json``)."""
    token: SecretStr | None = Field(default=None, min_length=1)
    """Bearer token the admin API requires (every route but /health); unset: a random one per
    run. Either way it is written with the URL to ``<run dir>/admin.json`` (mode 0600), and
    only there (``**********`` in config.json and the trajectory log's run.json)."""


class LogConfig(Section):
    format: LogFormat = "auto"
    """``auto``: pretty on a terminal, JSON otherwise."""
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Minimum level logged."""
