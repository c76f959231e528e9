"""The run's environments as loaded, and the chat each one's episodes speak.

``[environment]`` gives one environment, ``[[environments]]`` a mixture; either way each loaded
environment has its name in the run, its admission weight and turn limit, and the run's tool
timeout. :func:`model_chats` resolves each environment's chat (its tool schemas in the model's
chat template); the run calls it before any engine starts, so a template sprawl cannot bridge
stops the run there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from environments.loader import load_environment
from orchestrator.config import Config
from orchestrator.loop.chat import ModelChat, model_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from environments.base import Environment


@dataclass
class RunEnvironment:
    """One environment of the run, as loaded: its name in the run (None: the class's), its
    admission weight and turn limit."""

    env: Environment
    name: str | None
    weight: float
    max_turns: int


def load_environments(cfg: Config) -> list[RunEnvironment]:
    """The ``[[environments]]`` of a mixture, or the one ``[environment]``."""
    if not cfg.environments:
        one = cfg.environment
        envs = [
            RunEnvironment(
                load_environment(one.target(), one.args, kind=one.kind, renderer=one.renderer),
                None,
                1.0,
                one.max_turns,
            )
        ]
    else:
        envs = [
            RunEnvironment(
                load_environment(
                    e.target(),
                    e.args,
                    key=f"environments[{i}]",
                    kind=e.kind,
                    renderer=e.renderer,
                ),
                e.name,
                e.weight,
                e.max_turns,
            )
            for i, e in enumerate(cfg.environments)
        ]
    for e in envs:
        e.env.tool_timeout_s = cfg.timeouts.tool_s
    return envs


def model_chats(
    cfg: Config,
    model_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    envs: list[RunEnvironment],
) -> list[ModelChat]:
    """One chat per environment (its own tool schemas), in the order of ``envs``."""
    return [
        model_chat(
            model_dir,
            tokenizer,
            e.env.tool_schemas(),
            tool_parser_name=cfg.model.tool_parser,
            max_context=cfg.model.max_context,
        )
        for e in envs
    ]
