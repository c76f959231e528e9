"""The environment sections: ``[environment]`` (one environment) or ``[[environments]]`` (a
mixture, each entry with a name, a weight and optionally its own drop rule).

Checked at load: a verifiers environment is named by ``id`` and a class by ``cls``, never the
other way; a mixture entry's ``staleness`` table holds ``drop`` only. That the two forms are
exclusive and a mixture's names unique is checked by :class:`~orchestrator.config.tree.Config`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from orchestrator.config.sections import Section
from staleness.config import DropRule, StalenessConfig


class EnvironmentConfig(Section):
    kind: Literal["class", "verifiers"] = "class"
    """``class``: a sprawl Environment subclass named by ``cls``; ``verifiers``: a verifiers
    environment named by ``id``, run by its own rollout loop (docs/environments.md)."""
    cls: str = "environments.calculator:Calculator"
    """Import path ``module:Class`` of the Environment subclass (``kind = "class"``)."""
    id: str | None = None
    """The verifiers environment's taskset id (``kind = "verifiers"``): an installed package's
    module ``my_env``, or ``owner/my-env`` for the module ``my_env``."""
    max_turns: int = Field(default=3, ge=1)
    """Model calls per episode at most."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Arguments validated by the environment's own config model (``kind = "verifiers"``: the
    environment's ``[env]`` table, verifiers' ``EnvConfig``: ``agent``, ``taskset``, ...)."""
    renderer: dict[str, Any] | None = None
    """``kind = "verifiers"``: the ``renderers`` package's ``RendererConfig`` the environment's
    train client renders prompts with (``{name = "qwen3", enable_thinking = false}``); None:
    ``auto``, from the model's name, else the tokenizer's chat template."""

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
        elif self.renderer is not None:
            raise ValueError("renderer: only for kind = 'verifiers'")
        return self

    def target(self) -> str:
        """What the loader imports: ``id`` for a verifiers environment, else ``cls``."""
        return self.id if self.kind == "verifiers" and self.id else self.cls


class EnvironmentStaleness(Section):
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
