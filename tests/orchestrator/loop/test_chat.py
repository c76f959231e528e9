"""What a run takes from the model's files: the tool parser's precedence, the context limit, and
a template sprawl cannot bridge stopping the run at start-up with one error naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.loop.chat import model_chat
from policies.model.chat_template import SPRAWL_JSON
from policies.wire.errors import SprawlError

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture
def model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model's config and tokenizer files (no weights: nothing here loads them)."""
    out = tmp_path / "model"
    out.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    return out


def test_parser_from_config_then_model_notes_then_template(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert model_chat(model_dir, tokenizer, TOOLS).parser.name == "hermes"  # the template's
    (model_dir / SPRAWL_JSON).write_text(json.dumps({"tool_parser": "mistral"}))
    assert model_chat(model_dir, tokenizer, TOOLS).parser.name == "mistral"
    chosen = model_chat(model_dir, tokenizer, TOOLS, tool_parser_name="qwen3_coder")
    assert chosen.parser.name == "qwen3_coder"


def test_unreadable_model_notes_name_the_file(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    (model_dir / SPRAWL_JSON).write_text("[1, 2")
    with pytest.raises(SprawlError, match=r"sprawl\.json is not readable JSON"):
        model_chat(model_dir, tokenizer, TOOLS)


def test_context_from_the_model_unless_configured(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert model_chat(model_dir, tokenizer, None).max_context == 2048  # max_position_embeddings
    assert model_chat(model_dir, tokenizer, None, max_context=512).max_context == 512


def test_a_template_that_cannot_be_bridged_fails_at_start_up(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
        "[answered]{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )  # replaces an earlier assistant turn's text: the sampled tokens could not be kept
    with pytest.raises(SprawlError, match=r"the chat template of .*model does not render"):
        model_chat(model_dir, tokenizer, None)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ raise_exception('tool messages are not supported') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    model_chat(model_dir, tokenizer, None)  # no tools: no tool messages to render
    with pytest.raises(SprawlError, match=r"followed by tool: tool messages are not supported"):
        model_chat(model_dir, tokenizer, TOOLS)
    tokenizer.chat_template = None
    with pytest.raises(SprawlError, match=r"model has no chat template"):
        model_chat(model_dir, tokenizer, None)
