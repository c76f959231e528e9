"""The chat route reads calls in the served model's dialect: detected from its chat template, or
named; the dialect's special-token markers survive decoding, and tool_choice prefills its syntax."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from policies.board import Board
from policies.serve.openai_routes import OpenAIRoutes
from policies.serve.sidecar import Sidecar
from policies.wire.errors import SprawlError
from policies.wire.lane import ChatCompletionRequest
from tests.support.backends import ScriptedBackend
from tests.support.boards import tiny_board

pytestmark = pytest.mark.anyio

TOOLS: list[dict[Any, Any] | Callable[..., Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}, "digits": {"type": "integer"}},
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is 37 * 12?"}]
# A Mistral-style template: only its text matters for detection, so the marker sits in a comment.
MISTRAL_TEMPLATE = (
    "{# assistant calls: [TOOL_CALLS][{...}] #}{% for m in messages %}[INST]{{ m.content }}"
    "[/INST]{% endfor %}"
)


@pytest.fixture
def board(tmp_path: Path, tiny_model_dir: Path) -> Board:
    return tiny_board(tmp_path, tiny_model_dir)


def routes(
    board: Board, tokenizer: PreTrainedTokenizerBase, reply: str, tool_parser: str | None = None
) -> tuple[OpenAIRoutes, ScriptedBackend]:
    backend = ScriptedBackend(tokenizer, reply)
    sidecar = Sidecar(
        backend, board, poll_interval_s=1.0, registry=CollectorRegistry(), fixed_version=7
    )
    return OpenAIRoutes(sidecar, tokenizer, tool_parser=tool_parser), backend


def tool_calls(message: dict[str, object]) -> list[Any]:
    calls = message["tool_calls"]
    assert isinstance(calls, list)
    return calls


def request(**extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS, **extra})


async def test_mistral_detected_and_its_special_marker_kept(
    board: Board, tiny_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["[TOOL_CALLS]"], special_tokens=True)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    call = '[{"name": "calculator", "arguments": {"expression": "37 * 12"}}]'
    served, backend = routes(board, tokenizer, "Let me compute.[TOOL_CALLS]" + call)
    assert served.parser.name == "mistral"
    assert tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") in backend.ids  # one special token
    out = await served.chat(request())
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message["content"] == "Let me compute."
    (tc,) = tool_calls(choice.message)
    assert tc["function"]["name"] == "calculator"
    assert json.loads(tc["function"]["arguments"]) == {"expression": "37 * 12"}


async def test_named_parser_prefills_its_dialect_and_types_values(
    board: Board, tokenizer: PreTrainedTokenizerBase
) -> None:
    reply = (
        "<parameter=expression>\n37 * 12\n</parameter>\n<parameter=digits>\n3\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    served, backend = routes(board, tokenizer, reply, tool_parser="qwen3_coder")
    tool_choice = {"type": "function", "function": {"name": "calculator"}}
    out = await served.chat(request(tool_choice=tool_choice))
    prefill = "<tool_call>\n<function=calculator>\n"
    text = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str)
    (sent,) = backend.calls
    assert sent.prompt_token_ids == tokenizer.encode(text + prefill, add_special_tokens=False)
    (choice,) = out.choices
    (tc,) = tool_calls(choice.message)
    assert json.loads(tc["function"]["arguments"]) == {"expression": "37 * 12", "digits": 3}


async def test_reasoning_is_returned_as_reasoning_content(
    board: Board, tokenizer: PreTrainedTokenizerBase
) -> None:
    served, _ = routes(board, tokenizer, "<think>\n37 * 12 = 444\n</think>\nIt is 444.")
    assert served.parser.name == "hermes"  # sprawl's own template
    (choice,) = (await served.chat(request())).choices
    assert choice.message == {
        "role": "assistant",
        "content": "It is 444.",
        "reasoning_content": "37 * 12 = 444",
    }


def test_unknown_parser_is_refused(board: Board, tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(SprawlError, match="unknown tool-call parser 'hermes3'"):
        routes(board, tokenizer, "", tool_parser="hermes3")
