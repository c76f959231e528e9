"""What a run takes from the model's own files to talk to it: the chat template, the tool-call
dialect and the context limit.

:func:`model_chat` resolves all three once, before any engine starts, so a template sprawl cannot
bridge or an unknown parser stops the run at start-up with one error naming it, not as an
``env_error`` on every episode:

- the template is the tokenizer's (``tokenizer_config.json``), checked by
  :class:`~policies.wire.chat_tokens.ChatTokens`;
- the tool parser is ``model.tool_parser``, else the one ``orchestrate init-model
  --tool-parser`` wrote to ``<model>/sprawl.json``, else the one the template's text names
  (:func:`~policies.wire.tool_parsers.detect_tool_parser`);
- the context limit is ``model.max_context``, else the model's ``config.json``
  (``max_position_embeddings`` of its text model). Engines report theirs on ``GET /v1/policy``;
  each model call is bounded by the smallest of all (:meth:`Pool.max_context`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.errors import ConfigError
from policies.model.chat_template import noted_tool_parser
from policies.wire.chat_tokens import ChatTokens
from policies.wire.tool_parsers import detect_tool_parser, tool_parser
from policies.wire.tool_parsers.types import ToolParser

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ModelChat:
    """How episodes talk to one model: template bridge, tool parser, context limit."""

    chat: ChatTokens
    parser: ToolParser
    max_context: int


def model_chat(
    model_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict[str, Any]] | None,
    *,
    tool_parser_name: str | None = None,
    max_context: int | None = None,
) -> ModelChat:
    """Resolve the template, parser and context of the model at ``model_dir`` (module docstring);
    ``tool_parser_name`` and ``max_context`` are the config's overrides."""
    chat = ChatTokens(tokenizer, tools, name=str(model_dir))
    name = tool_parser_name or noted_tool_parser(model_dir)
    if name is None:
        name = detect_tool_parser(getattr(tokenizer, "chat_template", None))
    return ModelChat(chat, tool_parser(name), max_context or _model_context(model_dir))


def _model_context(model_dir: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        raise ConfigError(
            f"model.max_context: {model_dir}/config.json names no max_position_embeddings; "
            "set model.max_context"
        )
    return limit
